//! The report's measurements: each codec's errors and speeds on this CPU, PowerSGD's
//! step, the gradients it reads, and the short training runs behind its `acc` column.

use std::path::PathBuf;
use std::time::Instant;

use gradpack::cost::{CodecProfile, Strategy};
use gradpack::{Codec, CodecSpec, EncodeCtx, ErrorFeedback};

use super::format::Row;
use crate::Res;

#[derive(Clone)]
pub(super) struct Measured {
    pub(super) spec: CodecSpec,
    pub(super) bits: f64,
    pub(super) rel_l2: f64,
    /// `||sum g - sum D|| / ||sum g||` after `EF_STEPS` steps of error feedback (`None`:
    /// the codec is not usable with error feedback).
    pub(super) ef_rel_l2: Option<f64>,
    pub(super) enc: f64,
    pub(super) dec: f64,
    pub(super) add: f64,
}

/// Steps of error feedback behind the report's "EF rel L2" column.
pub(super) const EF_STEPS: u64 = 8;

/// The ranks of the report's PowerSGD rows.
pub(super) const POWERSGD_RANKS: [usize; 2] = [1, 4];

/// PowerSGD on one matrix of the report's elements, at one rank.
pub(super) struct LowRankRow {
    pub(super) rank: usize,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Bits per element of the two factors (fp32) against the matrix.
    pub(super) bits: f64,
    /// One step's compute on this CPU (products, orthogonalisation, reconstruction, error
    /// feedback), the fastest of the timing rounds.
    pub(super) compute_s: f64,
    /// The modelled step: compute plus its two all-reduces.
    pub(super) t: f64,
    /// The link speed below which it beats the fp32 ring (bit/s; 0: never).
    pub(super) break_even: f64,
}

/// The matrix the report's elements make: rows a power of two near the square root.
pub(super) fn matrix_shape(n: usize) -> (usize, usize) {
    let rows = 1usize << (n.max(1).ilog2() / 2);
    (rows, (n / rows).max(1))
}

/// Time PowerSGD steps at `rank` on the `rows x cols` matrix `x` through a one-rank sync
/// engine (its all-reduces are then copies): the fastest of `rounds` steps after a
/// warm-up step.
pub(super) fn time_powersgd(
    x: &[f32],
    rows: usize,
    cols: usize,
    rank: usize,
    rounds: usize,
) -> Res<f64> {
    use gradpack::collective::local;
    use gradpack::sync::{Policy, PowerSgd, SyncEngine, SyncOptions, Tensor};
    let layout = [Tensor::new("matrix", &[rows, cols])];
    let opts = SyncOptions {
        policy: Policy::powersgd(PowerSgd::rank(rank)),
        overlap: false,
        ..Default::default()
    };
    let res = local::run(1, None, |comm| {
        let mut e = SyncEngine::new(&layout, comm.into_inner(), opts.clone())?;
        let mut best = f64::INFINITY;
        for round in 0..=rounds {
            let t = Instant::now();
            e.ready(0, &x[..rows * cols])?;
            e.finish()?;
            if round > 0 {
                best = best.min(t.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    });
    res.into_iter()
        .next()
        .expect("one rank")
        .map_err(|e| format!("PowerSGD rank {rank}: {e}"))
}

/// The fastest of at least 5 runs of `f` over about `budget` seconds: on a shared machine
/// noise only ever adds time, so the fastest run is the figure that two reports repeat
/// (the median moved the break-evens of identical runs by up to 170%, the fastest by up
/// to 46%, over three interleaved pairs of runs).
pub(super) fn best_secs(budget: f64, mut f: impl FnMut()) -> f64 {
    f(); // warm up
    let start = Instant::now();
    let mut t = Vec::new();
    while t.len() < 5 || (start.elapsed().as_secs_f64() < budget && t.len() < 200) {
        let s = Instant::now();
        f();
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    t[0]
}

/// Error feedback over a few steps of fresh gradients: the error of what the model
/// actually receives, `||sum g - sum D|| / ||sum g||`. `None` when the codec refuses
/// error feedback (codecs that are not contractive: random-k with `scale=unbiased`,
/// QSGD with variance factor >= 1).
pub(super) fn ef_error(
    spec: &CodecSpec,
    ef_grads: &[Vec<f32>],
    frame: &mut [u8],
    d: &mut [f32],
) -> Res<Option<f64>> {
    let n = d.len();
    let Ok(mut ef) = ErrorFeedback::new(*spec, n) else {
        return Ok(None);
    };
    if ef_grads.is_empty() {
        return Ok(Some(0.0));
    }
    let (mut sum_g, mut sum_d) = (vec![0f64; n], vec![0f64; n]);
    for (step, g) in ef_grads.iter().enumerate() {
        let l = ef
            .encode_into(g, &EncodeCtx::new(step as u64), frame)
            .map_err(|e| format!("{spec}: {e}"))?;
        gradpack::decode(&frame[..l], d).map_err(|e| format!("{spec}: {e}"))?;
        for i in 0..n {
            sum_g[i] += g[i] as f64;
            sum_d[i] += d[i] as f64;
        }
    }
    let (num, den) = sum_g
        .iter()
        .zip(&sum_d)
        .fold((0f64, 0f64), |(a, b), (&u, &v)| {
            (a + (u - v).powi(2), b + u * u)
        });
    Ok(Some((num / den).sqrt()))
}

/// Rounds of timing in `report`: every codec is timed once per round, the rounds
/// interleaved, so a slow spell of the machine touches every codec alike; a codec's
/// speeds are the fastest over the rounds, and the spread of its break-even over the
/// rounds is printed beside it. Nine short rounds sample more of the machine's states
/// than five longer ones, for the same time.
pub(super) const ROUNDS: usize = 9;

/// One codec's encode, decode and decode_add speeds (bytes of f32 input per second).
#[derive(Clone, Copy)]
pub(super) struct Speeds {
    pub(super) enc: f64,
    pub(super) dec: f64,
    pub(super) add: f64,
}

/// `spec`'s frame of `x` (seed 1) in a buffer that holds any frame of `x`, and its length.
pub(super) fn encoded(spec: &CodecSpec, x: &[f32]) -> Res<(Vec<u8>, usize)> {
    let mut frame = vec![0u8; spec.max_encoded_len(x.len())];
    let len = spec
        .encode_into(x, &EncodeCtx::new(1), &mut frame)
        .map_err(|e| format!("{spec}: {e}"))?;
    Ok((frame, len))
}

/// Error figures of `spec` on `x` (speeds left at zero; [`time_round`] measures them).
pub(super) fn measure(spec: &CodecSpec, x: &[f32], ef_grads: &[Vec<f32>]) -> Res<Measured> {
    let n = x.len();
    let (mut frame, len) = encoded(spec, x)?;
    let mut d = vec![0f32; n];
    gradpack::decode(&frame[..len], &mut d).map_err(|e| format!("{spec}: {e}"))?;
    let (num, den) = x.iter().zip(&d).fold((0f64, 0f64), |(a, b), (&u, &v)| {
        (a + (u as f64 - v as f64).powi(2), b + (u as f64).powi(2))
    });
    let ef_rel_l2 = ef_error(spec, ef_grads, &mut frame, &mut d)?;
    Ok(Measured {
        spec: *spec,
        bits: len as f64 * 8.0 / n as f64,
        rel_l2: (num / den).sqrt(),
        ef_rel_l2,
        enc: 0.0,
        dec: 0.0,
        add: 0.0,
    })
}

/// One round of timing of `spec` on `x`: the fastest run of each operation over `budget`
/// seconds (at least 5 runs).
pub(super) fn time_round(spec: &CodecSpec, x: &[f32], budget: f64) -> Res<Speeds> {
    let ctx = EncodeCtx::new(1);
    let (mut frame, len) = encoded(spec, x)?;
    let mut d = vec![0f32; x.len()];
    let bytes = 4.0 * x.len() as f64;
    let enc = best_secs(budget, || {
        spec.encode_into(x, &ctx, &mut frame).expect("encode");
    });
    let dec = best_secs(budget, || {
        gradpack::decode(&frame[..len], &mut d).expect("decode");
    });
    Ok(Speeds {
        enc: bytes / enc,
        dec: bytes / dec,
        add: time_add(&frame[..len], &mut d, budget),
    })
}

/// `frame`'s decode_add into `acc`, in bytes of f32 per second (the fastest over `budget`
/// seconds); for `identity`, the fp32 sum.
pub(super) fn time_add(frame: &[u8], acc: &mut [f32], budget: f64) -> f64 {
    let secs = best_secs(budget, || {
        gradpack::decode_add(frame, acc).expect("decode_add");
    });
    4.0 * acc.len() as f64 / secs
}

/// `m` with the fastest speeds of `rounds`.
pub(super) fn with_speeds(mut m: Measured, rounds: &[Speeds]) -> Measured {
    m.enc = rounds.iter().map(|s| s.enc).fold(0.0, f64::max);
    m.dec = rounds.iter().map(|s| s.dec).fold(0.0, f64::max);
    m.add = rounds.iter().map(|s| s.add).fold(0.0, f64::max);
    m
}

pub(super) fn profile(m: &Measured) -> CodecProfile {
    CodecProfile {
        spec: m.spec.to_string(),
        bits_per_element: m.bits,
        encode_bytes_per_s: m.enc,
        decode_bytes_per_s: m.dec,
        decode_add_bytes_per_s: m.add,
    }
}

pub(super) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock (days-to-civil conversion of
/// H. Hinnant's date algorithms).
pub(super) fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02}")
}

/// The gradients of `--input`: the first is measured and timed, and the error-feedback
/// steps run over all of them in turn ([`EF_STEPS`] steps). Every file must hold the same
/// number of finite values.
pub(super) fn read_inputs(paths: &[PathBuf]) -> Res<(Vec<f32>, Vec<Vec<f32>>, String)> {
    let mut grads: Vec<Vec<f32>> = Vec::with_capacity(paths.len());
    for p in paths {
        let (x, _) = crate::io::read_f32(p)?;
        if x.is_empty() {
            return Err(format!("--input {}: holds no values", p.display()));
        }
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return Err(format!(
                "--input {}: value {i} is {}: the error columns need finite gradients",
                p.display(),
                x[i]
            ));
        }
        if let Some(first) = grads.first()
            && first.len() != x.len()
        {
            return Err(format!(
                "--input {}: {} values, but {} holds {}: every step's gradient must have the \
                 same size",
                p.display(),
                x.len(),
                paths[0].display(),
                first.len()
            ));
        }
        grads.push(x);
    }
    let source = match paths {
        [one] => format!("{} (every error-feedback step)", one.display()),
        _ => format!(
            "{} and {} more (error-feedback steps in turn)",
            paths[0].display(),
            paths.len() - 1
        ),
    };
    let ef = (0..EF_STEPS as usize)
        .map(|s| grads[s % grads.len()].clone())
        .collect();
    Ok((grads.swap_remove(0), ef, source))
}

/// Test accuracy (percent) of the training runs behind the `acc` column.
pub(super) struct Trained {
    /// fp32's.
    pub(super) fp32: f64,
    /// Each codec row's minus fp32's, in points (NaN: diverged; `None`: refused).
    pub(super) codecs: Vec<Option<f64>>,
    /// Each PowerSGD rank's minus fp32's.
    pub(super) powersgd: Vec<Option<f64>>,
}

/// Train `gradpack train`'s default model and task once in fp32 and once per codec row
/// (with error feedback where the codec accepts it, with the row's strategy) and per
/// PowerSGD rank (with its error feedback).
pub(super) fn train_rows(
    rows: &[Row],
    ps_ranks: &[usize],
    bar: &indicatif::ProgressBar,
) -> Res<Trained> {
    use gradpack::train::{Dataset, ModelKind, TrainConfig, TrainResult, train};
    let ds = Dataset::synthetic(1);
    let cfg = TrainConfig::new(ModelKind::Mlp { hidden: 64 });
    let identity = CodecSpec::Identity(gradpack::Identity);
    let accuracy = |r: &TrainResult| {
        let l = r.last();
        if l.test_loss.is_finite() {
            100.0 * l.test_accuracy
        } else {
            f64::NAN
        }
    };
    bar.set_message("training: fp32");
    let base_cfg = TrainConfig {
        strategy: Strategy::Fp32Ring,
        ..cfg.clone()
    };
    let fp32 = train(&ds, &base_cfg, identity, false).map_err(|e| format!("training fp32: {e}"))?;
    let fp32 = accuracy(&fp32);
    bar.inc(1);
    let run = |cfg: &TrainConfig, codec: CodecSpec, ef: bool, name: &str| {
        bar.set_message(format!("training: {name}"));
        let r = match train(&ds, cfg, codec, ef) {
            Ok(r) => Some(accuracy(&r) - fp32),
            Err(gradpack::Error::Param { .. } | gradpack::Error::Collective(_)) => None,
            Err(e) => return Err(format!("training {name}: {e}")),
        };
        bar.inc(1);
        Ok(r)
    };
    let codecs = rows
        .iter()
        .map(|r| {
            let cfg = TrainConfig {
                strategy: r.strategy,
                ..cfg.clone()
            };
            run(
                &cfg,
                r.m.spec,
                r.m.ef_rel_l2.is_some(),
                &r.m.spec.to_string(),
            )
        })
        .collect::<Res<Vec<_>>>()?;
    let powersgd = ps_ranks
        .iter()
        .map(|&rank| {
            let cfg = TrainConfig {
                powersgd: Some(gradpack::sync::PowerSgd::rank(rank)),
                ..cfg.clone()
            };
            run(&cfg, identity, true, &format!("powersgd:rank={rank}"))
        })
        .collect::<Res<Vec<_>>>()?;
    Ok(Trained {
        fp32,
        codecs,
        powersgd,
    })
}
