//! `report`: measure every codec on this CPU and model what it buys on a network.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use gradpack::cost::{self, CodecProfile, Strategy};
use gradpack::{Backend, Codec, CodecSpec, EncodeCtx, ErrorFeedback};

use crate::model::speedup;
use crate::recommend::{Candidate, MAX_EF_ERROR, Verdict, explain, judge, recommend};
use crate::{Net, Network, Res, plot, progress, specs};

#[derive(Args)]
pub(crate) struct ReportArgs {
    /// Gradient elements (f32) to measure on.
    #[arg(long, default_value_t = 1 << 22)]
    elements: usize,
    #[command(flatten)]
    net: Net,
    /// Codec spec to measure (repeatable; default: a representative set).
    #[arg(long = "codec")]
    codecs: Vec<String>,
    /// Backend to force: scalar, avx2, avx512, neon (default: the best this CPU has).
    #[arg(long)]
    backend: Option<String>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an SVG of all-reduce time against link bandwidth to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Print every column (speeds, backend, the break-even's range) and the PowerSGD
    /// table; by default the table fits a terminal of 100 columns.
    #[arg(long)]
    wide: bool,
    /// Measure the error columns (and time the codecs) on this gradient instead of the
    /// synthetic one: .npy (any float dtype) or raw little-endian f32. Repeat it with the
    /// gradients of successive steps for the error-feedback column (one file: the same
    /// gradient every step).
    #[arg(long = "input", conflicts_with = "elements")]
    inputs: Vec<PathBuf>,
    /// Skip the short training runs behind the `acc` column: the recommendation then
    /// rests on the error-feedback error alone (marked `yes?`).
    #[arg(long)]
    no_train: bool,
    /// The most test accuracy (percentage points) a codec may lose against fp32 in the
    /// training runs and still count as tracking fp32.
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true)]
    tolerance: f64,
}

#[derive(Clone)]
struct Measured {
    spec: CodecSpec,
    bits: f64,
    rel_l2: f64,
    /// `||sum g - sum D|| / ||sum g||` after `EF_STEPS` steps of error feedback (`None`:
    /// the codec is not usable with error feedback).
    ef_rel_l2: Option<f64>,
    enc: f64,
    dec: f64,
    add: f64,
}

/// Steps of error feedback behind the report's "EF rel L2" column.
const EF_STEPS: u64 = 8;

/// The ranks of the report's PowerSGD rows.
const POWERSGD_RANKS: [usize; 2] = [1, 4];

/// PowerSGD on one matrix of the report's elements, at one rank.
struct LowRankRow {
    rank: usize,
    rows: usize,
    cols: usize,
    /// Bits per element of the two factors (fp32) against the matrix.
    bits: f64,
    /// One step's compute on this CPU (products, orthogonalisation, reconstruction, error
    /// feedback), the fastest of the timing rounds.
    compute_s: f64,
    /// The modelled step: compute plus its two all-reduces.
    t: f64,
    /// The link speed below which it beats the fp32 ring (bit/s; 0: never).
    break_even: f64,
}

/// The matrix the report's elements make: rows a power of two near the square root.
fn matrix_shape(n: usize) -> (usize, usize) {
    let rows = 1usize << (n.max(1).ilog2() / 2);
    (rows, (n / rows).max(1))
}

/// Time PowerSGD steps at `rank` on the `rows x cols` matrix `x` through a one-rank sync
/// engine (its all-reduces are then copies): the fastest of `rounds` steps after a
/// warm-up step.
fn time_powersgd(x: &[f32], rows: usize, cols: usize, rank: usize, rounds: usize) -> Res<f64> {
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
fn best_secs(budget: f64, mut f: impl FnMut()) -> f64 {
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
fn ef_error(
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
const ROUNDS: usize = 9;

/// One codec's encode, decode and decode_add speeds (bytes of f32 input per second).
#[derive(Clone, Copy)]
struct Speeds {
    enc: f64,
    dec: f64,
    add: f64,
}

/// `spec`'s frame of `x` (seed 1) in a buffer that holds any frame of `x`, and its length.
fn encoded(spec: &CodecSpec, x: &[f32]) -> Res<(Vec<u8>, usize)> {
    let mut frame = vec![0u8; spec.max_encoded_len(x.len())];
    let len = spec
        .encode_into(x, &EncodeCtx::new(1), &mut frame)
        .map_err(|e| format!("{spec}: {e}"))?;
    Ok((frame, len))
}

/// Error figures of `spec` on `x` (speeds left at zero; [`time_round`] measures them).
fn measure(spec: &CodecSpec, x: &[f32], ef_grads: &[Vec<f32>]) -> Res<Measured> {
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
fn time_round(spec: &CodecSpec, x: &[f32], budget: f64) -> Res<Speeds> {
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
fn time_add(frame: &[u8], acc: &mut [f32], budget: f64) -> f64 {
    let secs = best_secs(budget, || {
        gradpack::decode_add(frame, acc).expect("decode_add");
    });
    4.0 * acc.len() as f64 / secs
}

/// `m` with the fastest speeds of `rounds`.
fn with_speeds(mut m: Measured, rounds: &[Speeds]) -> Measured {
    m.enc = rounds.iter().map(|s| s.enc).fold(0.0, f64::max);
    m.dec = rounds.iter().map(|s| s.dec).fold(0.0, f64::max);
    m.add = rounds.iter().map(|s| s.add).fold(0.0, f64::max);
    m
}

fn profile(m: &Measured) -> CodecProfile {
    CodecProfile {
        spec: m.spec.to_string(),
        bits_per_element: m.bits,
        encode_bytes_per_s: m.enc,
        decode_bytes_per_s: m.dec,
        decode_add_bytes_per_s: m.add,
    }
}

fn cpu_model() -> String {
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
fn today() -> String {
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

/// Where a codec pays, in Gbit/s: `always`, `never`, or intervals such as `<120.5`,
/// `>480`, `<120.5, >480` (three significant digits from 100 up, so that two intervals
/// fit the report's column).
fn fmt_pays(pays: &[(f64, f64)]) -> String {
    pays_parts(pays).join(", ")
}

/// The intervals of [`fmt_pays`], one string each.
fn pays_parts(pays: &[(f64, f64)]) -> Vec<String> {
    let g = |bps: f64| {
        let v = bps / 1e9;
        if v >= 100.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    };
    match pays {
        [] => vec!["never".into()],
        [(lo, hi)] if *lo == 0.0 && hi.is_infinite() => vec!["always".into()],
        _ => pays
            .iter()
            .map(|&(lo, hi)| match (lo == 0.0, hi.is_infinite()) {
                (true, _) => format!("<{}", g(hi)),
                (false, true) => format!(">{}", g(lo)),
                (false, false) => format!("{}-{}", g(lo), g(hi)),
            })
            .collect(),
    }
}

/// [`fmt_pays`] in at most `width` characters (the narrow table's column): the first
/// intervals that fit, then `…` for the rest.
fn fit_pays(pays: &[(f64, f64)], width: usize) -> String {
    let parts = pays_parts(pays);
    let all = parts.join(", ");
    if all.chars().count() <= width {
        return all;
    }
    let mut out = String::new();
    for part in &parts {
        let next = if out.is_empty() {
            part.clone()
        } else {
            format!("{out}, {part}")
        };
        if next.chars().count() + ", …".chars().count() > width {
            break;
        }
        out = next;
    }
    if out.is_empty() {
        "…".to_string()
    } else {
        format!("{out}, …")
    }
}

/// A break-even and, when the timing rounds disagree, their range.
fn fmt_be(be: f64, (lo, hi): (f64, f64)) -> String {
    if fmt_bw(lo) == fmt_bw(hi) {
        fmt_bw(be)
    } else {
        format!("{} ({}-{})", fmt_bw(be), fmt_bw(lo), fmt_bw(hi))
    }
}

/// A bandwidth in Gbit/s for a label: `10`, `2.5`, `0.1`.
fn short_bw(gbit: f64) -> String {
    let s = format!("{gbit:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A bandwidth in Gbit/s.
fn fmt_bw(b: f64) -> String {
    format!("{:.1}", b / 1e9)
}

pub(crate) fn report(a: ReportArgs) -> Res<()> {
    let net = a.net.parse()?;
    if a.plot.as_ref().is_some_and(|p| crate::io::is_std(p)) {
        return Err("--plot -: stdout carries the report; give the SVG a file name".into());
    }
    if net.nodes < 2 {
        return Err(format!(
            "--nodes {}: the report models all-reduces between ranks, and one rank sends \
             nothing; give 2 or more",
            net.nodes
        ));
    }
    if let Some(p) = &a.plot {
        crate::io::check_writable(p, "--plot")?; // before a run of a minute or two
    }
    if a.elements == 0 && a.inputs.is_empty() {
        return Err("--elements must be at least 1".into());
    }
    let backend = match &a.backend {
        None => Backend::current(),
        Some(name) => Backend::by_name(name)
            .map_err(|e| format!("--backend: {e}"))?
            .ok_or_else(|| format!("--backend {name}: not supported on this CPU"))?,
    };
    let specs = specs(&a.codecs)?;
    // The names the short table shows: what the user typed, or the report's short specs.
    let names: Vec<String> = if a.codecs.is_empty() {
        gradpack::codec::REPRESENTATIVE_SPECS
            .iter()
            .map(|s| s.to_string())
            .collect()
    } else {
        a.codecs.clone()
    };
    if !(a.tolerance.is_finite() && a.tolerance >= 0.0) {
        return Err(format!(
            "--tolerance {}: expected percentage points >= 0, e.g. 0.5",
            a.tolerance
        ));
    }
    let (x, ef_grads, source) = if a.inputs.is_empty() {
        let n = a.elements;
        let ef: Vec<Vec<f32>> = (0..EF_STEPS)
            .map(|s| gradpack::synthetic::gradient(n, 3000 + s))
            .collect();
        (
            gradpack::synthetic::gradient(n, 2024),
            ef,
            "the synthetic gradient".to_string(),
        )
    } else {
        read_inputs(&a.inputs)?
    };
    let n = x.len();
    // Time budget per operation and round: about 20 s of timing for the whole default
    // report.
    let budget = 0.3_f64.min(20.0 / (3.0 * (specs.len() + 1) as f64)) / ROUNDS as f64;
    // PowerSGD's rows beside the default codecs; with --codec, only the codecs asked for.
    let ps_ranks: &[usize] = if a.codecs.is_empty() {
        &POWERSGD_RANKS
    } else {
        &[]
    };
    let train_runs = if a.no_train {
        0
    } else {
        1 + specs.len() + ps_ranks.len()
    };
    // The first line at once: a report takes a minute or two, and a reader should see it
    // has started (the progress bar shows only on a terminal; elsewhere `phase` prints a
    // line per phase on stderr).
    if !a.json {
        outln!(
            "gradpack {} report, {}, on {} (backend {backend})",
            env!("CARGO_PKG_VERSION"),
            today(),
            cpu_model(),
        );
    }
    let started = std::time::Instant::now();
    let phase = |what: String| {
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() {
            eprintln!(
                "gradpack report: {what} ({:.0} s so far)",
                started.elapsed().as_secs_f64()
            );
        }
    };
    let bar = progress(
        ((specs.len() + 1) * (ROUNDS + 1) + ps_ranks.len() + train_runs) as u64,
        false,
    );
    let identity: CodecSpec = "identity".parse().expect("identity parses");
    phase(format!("measuring the errors of {} codecs", specs.len()));
    bar.set_message("errors");
    let base = backend.run(|| measure(&identity, &x, &[]))?;
    bar.inc(1);
    let mut rows = Vec::new();
    for s in &specs {
        bar.set_message(format!("{s}: errors"));
        rows.push(backend.run(|| measure(s, &x, &ef_grads))?);
        bar.inc(1);
    }
    // Timing rounds: identity (the fp32 reduction) and every codec, interleaved; each
    // codec's timing is paired with a timing of the fp32 reduction just before it, so
    // both see the machine in the same state, and each round gives a break-even.
    let (sum_frame, sum_len) = encoded(&identity, &x)?;
    let mut sum_acc = vec![0f32; n];
    let mut base_rounds = Vec::new();
    let mut row_rounds: Vec<Vec<(Speeds, f64)>> = vec![Vec::new(); specs.len()];
    phase(format!(
        "timing {} codecs and fp32, {ROUNDS} rounds",
        specs.len()
    ));
    for round in 0..ROUNDS {
        bar.set_message(format!("timing, round {} of {ROUNDS}", round + 1));
        base_rounds.push(backend.run(|| time_round(&identity, &x, budget))?);
        bar.inc(1);
        for (s, r) in specs.iter().zip(row_rounds.iter_mut()) {
            let reduce = backend.run(|| time_add(&sum_frame[..sum_len], &mut sum_acc, budget));
            r.push((backend.run(|| time_round(s, &x, budget))?, reduce));
            bar.inc(1);
        }
    }
    let (mrows, mcols) = matrix_shape(n);
    let mut lowrank_compute = Vec::new();
    if !ps_ranks.is_empty() {
        phase(format!("timing PowerSGD of ranks {ps_ranks:?}"));
    }
    for &rank in ps_ranks {
        bar.set_message(format!("PowerSGD rank {rank}"));
        lowrank_compute.push(backend.run(|| time_powersgd(&x, mrows, mcols, rank, ROUNDS))?);
        bar.inc(1);
    }
    let base = with_speeds(base, &base_rounds);
    let rows: Vec<Measured> = rows
        .into_iter()
        .zip(&row_rounds)
        .map(|(m, r)| with_speeds(m, &r.iter().map(|p| p.0).collect::<Vec<_>>()))
        .collect();

    // fp32: the faster of the ring (its reduction is an f32 add, which identity's
    // decode_add measures) and an all-gather of fp32 frames.
    let reduce = base.add;
    let elements = n as f64;
    let cluster = cost::Cluster {
        nodes: net.nodes,
        bandwidth_bit_s: net.bandwidth,
        latency_s: net.latency,
    };
    let (fp32_strategy, fp32) = cost::best_fp32(&profile(&base), &cluster, elements, reduce);
    // PowerSGD: its compute on this CPU plus its two fp32 all-reduces of the factors.
    let lowrank: Vec<LowRankRow> = ps_ranks
        .iter()
        .zip(&lowrank_compute)
        .map(|(&rank, &compute_s)| {
            let c = cost::powersgd_cost(
                Strategy::Fp32Ring,
                &profile(&base),
                net.nodes,
                net.latency,
                &[(mrows, mcols)],
                rank,
                reduce,
            );
            let r = rank.min(mrows).min(mcols) as f64;
            // Equal times: compute + F_p + 8 B_p / b = F_f + 8 B_f / b.
            let ring = cost::allreduce_cost(
                Strategy::Fp32Ring,
                &profile(&base),
                net.nodes,
                net.latency,
                elements,
                reduce,
            );
            let extra = compute_s + c.fixed - ring.fixed;
            let saved = 8.0 * (ring.bytes - c.bytes);
            let break_even = if saved <= 0.0 {
                0.0
            } else if extra <= 0.0 {
                f64::INFINITY
            } else {
                saved / extra
            };
            LowRankRow {
                rank,
                rows: mrows,
                cols: mcols,
                bits: 32.0 * (mrows + mcols) as f64 * r / (mrows * mcols) as f64,
                compute_s,
                t: compute_s + c.time(net.bandwidth),
                break_even,
            }
        })
        .collect();
    let id = profile(&base);
    let region = |p: &CodecProfile, reduce: f64| {
        cost::winning_bandwidths(p, &id, net.nodes, net.latency, elements, reduce)
    };
    // The break-even of a region that is one interval from 0 up to it.
    let below = |r: &[(f64, f64)]| match r {
        [(lo, hi)] if *lo == 0.0 && hi.is_finite() => Some(*hi),
        _ => None,
    };
    let rows: Vec<Row> = rows
        .iter()
        .zip(&row_rounds)
        .map(|(m, rounds)| {
            let p = profile(m);
            let (strategy, t) = cost::best_strategy(&p, &cluster, elements, reduce);
            let pays = region(&p, reduce);
            // Where it pays by each timing round's own speeds.
            let round_pays: Vec<Vec<(f64, f64)>> = rounds
                .iter()
                .map(|(s, reduce)| {
                    let p = profile(&with_speeds(m.clone(), std::slice::from_ref(s)));
                    region(&p, *reduce)
                })
                .collect();
            let pays_stable = round_pays.iter().all(|r| same_region(r, &pays));
            let be = below(&pays).and_then(|be| {
                let per_round: Option<Vec<f64>> = round_pays.iter().map(|r| below(r)).collect();
                let per_round = per_round?;
                // The spread of the estimates: every round's, and the one from the fastest
                // speeds (which need not lie between the rounds').
                let range = per_round
                    .iter()
                    .fold((be, be), |(lo, hi), &b| (lo.min(b), hi.max(b)));
                Some((be, range))
            });
            Row {
                m,
                strategy,
                t,
                pays,
                pays_stable,
                be,
            }
        })
        .collect();

    let trained = if a.no_train {
        None
    } else {
        phase(format!(
            "training fp32, {} codecs and {} PowerSGD ranks (the longest part)",
            rows.len(),
            ps_ranks.len()
        ));
        Some(train_rows(&rows, ps_ranks, &bar)?)
    };
    phase("done".to_string());
    bar.finish_and_clear();
    // Candidates for the recommendation: every codec row (with error feedback where it
    // accepts it), then the PowerSGD rows.
    let mut cands: Vec<Candidate> = rows
        .iter()
        .zip(&names)
        .enumerate()
        .map(|(i, (r, name))| Candidate {
            name: name.clone(),
            strategy: r.strategy.name(),
            time_s: r.t,
            ef_error: r.m.ef_rel_l2,
            feedback: r.m.ef_rel_l2.is_some(),
            accuracy_delta: trained.as_ref().and_then(|t| t.codecs[i]),
        })
        .collect();
    for (k, l) in lowrank.iter().enumerate() {
        cands.push(Candidate {
            name: format!("powersgd:rank={}", l.rank),
            strategy: "ring",
            time_s: l.t,
            ef_error: None,
            feedback: true,
            accuracy_delta: trained.as_ref().and_then(|t| t.powersgd[k]),
        });
    }
    let verdicts: Vec<Verdict> = cands.iter().map(|c| judge(c, a.tolerance)).collect();
    let rec = recommend(&cands, fp32, a.tolerance);
    let fp32_name = if fp32_strategy == Strategy::Fp32Ring {
        "ring"
    } else {
        "allgather"
    };
    let network = format!("{} nodes at {} Gbit/s", net.nodes, fmt_bw(net.bandwidth));

    if a.json {
        let train_json = |i: usize| {
            let v = &verdicts[i];
            serde_json::json!({
                "feedback": cands[i].feedback,
                // Test accuracy minus fp32's in the training run (points; null: not
                // trained or diverged).
                "accuracy_delta_points": cands[i].accuracy_delta.filter(|d| d.is_finite()),
                "diverged": cands[i].accuracy_delta.is_some_and(f64::is_nan),
                "tracks": v.short(),
                "tracks_reasons": match v { Verdict::Fails(w) => w.clone(), _ => Vec::new() },
            })
        };
        let merge = |mut a: serde_json::Value, b: serde_json::Value| {
            if let (Some(a), serde_json::Value::Object(b)) = (a.as_object_mut(), b) {
                a.extend(b);
            }
            a
        };
        let codecs: Vec<serde_json::Value> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                merge(
                    serde_json::json!({
                        "spec": r.m.spec.to_string(),
                        "name": names[i],
                        "bits_per_element": r.m.bits,
                        "ratio": 32.0 / r.m.bits,
                        "rel_l2_error": r.m.rel_l2,
                        "ef_rel_l2_error": r.m.ef_rel_l2,
                        "unbiased": r.m.spec.unbiased(),
                        "encode_gb_s": r.m.enc / 1e9,
                        "decode_gb_s": r.m.dec / 1e9,
                        "decode_add_gb_s": r.m.add / 1e9,
                        "backend": backend.name(),
                        "strategy": r.strategy.name(),
                        // The link speed below which the codec pays, when it pays there and
                        // only there (null otherwise: see pays_at_gbit_s).
                        "break_even_gbit_s": r.be.map(|b| b.0 / 1e9),
                        // The lowest and highest of it and the timing rounds' break-evens.
                        "break_even_range_gbit_s": r.be.map(|b| [b.1.0 / 1e9, b.1.1 / 1e9]),
                        // Whether the rounds agree within 25% (the table marks it `?` if not).
                        "break_even_stable": r.be.map(|b| stable(b.1)),
                        // Whether the timing rounds give the same intervals within 25%.
                        "pays_stable": r.pays_stable,
                        // Every interval of link speeds where it pays (null: no upper end).
                        "pays_at_gbit_s": r.pays.iter().map(|&(lo, hi)| {
                            [Some(lo / 1e9), hi.is_finite().then_some(hi / 1e9)]
                        }).collect::<Vec<_>>(),
                        "allreduce_s": r.t,
                        "speedup": fp32 / r.t,
                    }),
                    train_json(i),
                )
            })
            .collect();
        let doc = serde_json::json!({
            "gradpack_version": env!("CARGO_PKG_VERSION"),
            "date": today(),
            "cpu": cpu_model(),
            "backend": backend.name(),
            "elements": n,
            "input": source,
            "nodes": net.nodes,
            "bandwidth_bit_s": net.bandwidth,
            "latency_s": net.latency,
            "fp32_reduce_gb_s": reduce / 1e9,
            "fp32_allreduce_s": fp32,
            "fp32_strategy": fp32_strategy.name(),
            "fp32_train_accuracy": trained.as_ref().map(|t| t.fp32 / 100.0),
            "tolerance_points": a.tolerance,
            "codecs": codecs,
            // PowerSGD on one rows x cols matrix of the same elements (fp32 factors).
            "powersgd": lowrank.iter().enumerate().map(|(k, l)| merge(serde_json::json!({
                "rank": l.rank, "rows": l.rows, "cols": l.cols,
                "bits_per_element": l.bits, "ratio": 32.0 / l.bits,
                "compute_s": l.compute_s, "allreduce_s": l.t, "speedup": fp32 / l.t,
                "break_even_gbit_s": l.break_even.is_finite().then_some(l.break_even / 1e9),
            }), train_json(rows.len() + k))).collect::<Vec<_>>(),
            // The fastest candidate that tracks fp32 (null: plain fp32), and the faster
            // ones passed over.
            "recommendation": rec.pick.map(|i| serde_json::json!({
                "name": cands[i].name, "strategy": cands[i].strategy,
                "feedback": cands[i].feedback, "allreduce_s": cands[i].time_s,
                "speedup": fp32 / cands[i].time_s,
            })),
            "passed_over": rec.passed_over.iter().map(|(i, why)| serde_json::json!({
                "name": cands[*i].name, "allreduce_s": cands[*i].time_s, "reasons": why,
            })).collect::<Vec<_>>(),
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?
        );
    } else {
        if a.inputs.is_empty() {
            outln!(
                "{n} f32 elements ({:.1} MiB) of {source}; the fp32 sum runs at {:.1} GB/s",
                n as f64 * 4.0 / 1048576.0,
                reduce / 1e9
            );
        } else {
            // The path on a line of its own, so the figures stay inside 100 columns.
            outln!("input: {source}");
            outln!(
                "{n} f32 elements ({:.1} MiB); the fp32 sum runs at {:.1} GB/s; acc: the \
                 built-in MLP",
                n as f64 * 4.0 / 1048576.0,
                reduce / 1e9
            );
        }
        outln!(
            "all-reduce model: {} nodes, {} Gbit/s links, {:.1} us latency; fp32 {:.3} ms ({fp32_name})\n",
            net.nodes,
            fmt_bw(net.bandwidth),
            net.latency * 1e6,
            fp32 * 1e3,
        );
        let acc = |i: usize| match cands[i].accuracy_delta {
            None => "-".to_string(),
            Some(d) if d.is_nan() => "diverged".to_string(),
            Some(d) => format!("{d:+.2}"),
        };
        if a.wide {
            wide_tables(
                &rows,
                &lowrank,
                &verdicts,
                &acc,
                backend,
                fp32,
                (mrows, mcols),
                &net,
            )?;
        } else {
            // Every candidate and fp32, fastest first.
            let mut order: Vec<Option<usize>> = (0..cands.len()).map(Some).collect();
            order.push(None);
            let time = |o: &Option<usize>| o.map_or(fp32, |i| cands[i].time_s);
            order.sort_by(|a, b| time(a).total_cmp(&time(b)));
            let w = cands.iter().map(|c| c.name.len()).max().unwrap_or(0).max(4);
            outln!(
                "{:<w$} {:>7} {:>7} {:>6} {:>6} {:>9} {:>8} {:>7} {:>10}",
                "spec",
                "bits/el",
                "EF err",
                "acc",
                "tracks",
                "strategy",
                "time ms",
                "speedup",
                "break-even"
            );
            for o in &order {
                let Some(i) = *o else {
                    outln!(
                        "{:<w$} {:>7.3} {:>7} {:>6} {:>6} {:>9} {:>8.3} {:>7} {:>10}",
                        "fp32",
                        32.0,
                        "-",
                        "-",
                        "-",
                        fp32_name,
                        fp32 * 1e3,
                        "1.00x",
                        "-"
                    );
                    continue;
                };
                let c = &cands[i];
                let (bits, be) = match rows.get(i) {
                    Some(r) => (
                        r.m.bits,
                        match r.be {
                            Some((be, range)) => {
                                format!("{}{}", fmt_bw(be), if stable(range) { "" } else { "?" })
                            }
                            // The same mark on every form when the rounds disagree.
                            None if r.pays_stable => fit_pays(&r.pays, 10),
                            None => format!("{}?", fit_pays(&r.pays, 9)),
                        },
                    ),
                    None => {
                        let l = &lowrank[i - rows.len()];
                        (l.bits, fmt_lowrank_be(l.break_even))
                    }
                };
                outln!(
                    "{:<w$} {:>7.3} {:>7} {:>6} {:>6} {:>9} {:>8.3} {:>7} {:>10}",
                    c.name,
                    bits,
                    c.ef_error.map_or("-".to_string(), fmt_err),
                    acc(i),
                    verdicts[i].short(),
                    c.strategy,
                    c.time_s * 1e3,
                    speedup(fp32, c.time_s),
                    be
                );
            }
            outln!(
                "\nEF err: ||sum g - sum D|| / ||sum g|| after {EF_STEPS} steps of error feedback (-: not used);\n\
                 acc: test accuracy against fp32 (points) of `gradpack train`'s MLP with the codec, its\n\
                 error feedback and strategy; tracks: EF err < {MAX_EF_ERROR} and acc within -{} (yes?: not\n\
                 trained); time: modelled all-reduce at {} Gbit/s with the faster strategy; break-even:\n\
                 the link speed (Gbit/s) below which it beats fp32, else the speeds where it does (<X, X-Y,\n\
                 >X, always, never; …: more ranges, in --wide and --json); ?: on any of these, the timing\n\
                 rounds disagree by more than 25%{}. --wide: every column.",
                a.tolerance,
                fmt_bw(net.bandwidth),
                if lowrank.is_empty() {
                    String::new()
                } else {
                    format!("; powersgd: a {mrows} x {mcols} matrix of it")
                }
            );
        }
        outln!();
        for line in explain(
            &cands,
            &rec,
            &network,
            (fp32, fp32_name),
            trained.as_ref().map(|t| t.fp32),
            a.tolerance,
        ) {
            outln!("{line}");
        }
    }
    if let Some(path) = &a.plot {
        plot(
            path,
            &rows
                .iter()
                .zip(&names)
                .map(|(r, name)| CodecProfile {
                    spec: name.clone(),
                    ..profile(r.m)
                })
                .collect::<Vec<_>>(),
            &profile(&base),
            &net,
            elements,
            reduce,
        )?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// A codec row of the report: its measurements and what the model makes of them.
struct Row<'a> {
    m: &'a Measured,
    strategy: Strategy,
    t: f64,
    /// Where the codec pays (bit/s intervals), from the fastest speeds.
    pays: Vec<(f64, f64)>,
    /// Whether every timing round's own speeds give the same intervals within 25%.
    pays_stable: bool,
    /// When it pays below a break-even and only there: that break-even, and the lowest
    /// and highest of it and the timing rounds' break-evens.
    be: Option<(f64, (f64, f64))>,
}

/// Whether the intervals `r` (one timing round's) are those of `pays` within 25% at
/// every finite end: the same count, each end within a factor of 1.25.
fn same_region(r: &[(f64, f64)], pays: &[(f64, f64)]) -> bool {
    let close = |a: f64, b: f64| {
        (a == b)
            || (a.is_finite() && b.is_finite() && a.min(b) > 0.0 && a.max(b) <= 1.25 * a.min(b))
    };
    r.len() == pays.len()
        && r.iter()
            .zip(pays)
            .all(|(x, y)| close(x.0, y.0) && close(x.1, y.1))
}

/// Whether a break-even's range (lowest, highest) is within 25%: the short table marks
/// the others `?`.
fn stable((lo, hi): (f64, f64)) -> bool {
    hi <= 1.25 * lo
}

/// An error figure in at most 7 characters: `0.57`, `6.4e-3`.
fn fmt_err(v: f64) -> String {
    if v >= 0.01 || v == 0.0 || !v.is_finite() {
        format!("{v:.2}")
    } else {
        format!("{v:.1e}")
    }
}

/// A PowerSGD row's break-even (Gbit/s), or `always`.
fn fmt_lowrank_be(be: f64) -> String {
    if be.is_finite() {
        fmt_bw(be)
    } else {
        "always".into()
    }
}

/// The gradients of `--input`: the first is measured and timed, and the error-feedback
/// steps run over all of them in turn ([`EF_STEPS`] steps). Every file must hold the same
/// number of finite values.
fn read_inputs(paths: &[PathBuf]) -> Res<(Vec<f32>, Vec<Vec<f32>>, String)> {
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
struct Trained {
    /// fp32's.
    fp32: f64,
    /// Each codec row's minus fp32's, in points (NaN: diverged; `None`: refused).
    codecs: Vec<Option<f64>>,
    /// Each PowerSGD rank's minus fp32's.
    powersgd: Vec<Option<f64>>,
}

/// Train `gradpack train`'s default model and task once in fp32 and once per codec row
/// (with error feedback where the codec accepts it, with the row's strategy) and per
/// PowerSGD rank (with its error feedback).
fn train_rows(rows: &[Row], ps_ranks: &[usize], bar: &indicatif::ProgressBar) -> Res<Trained> {
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

/// `--wide`: every measured column of every codec row, then the PowerSGD table.
#[allow(clippy::too_many_arguments)]
fn wide_tables(
    rows: &[Row],
    lowrank: &[LowRankRow],
    verdicts: &[Verdict],
    acc: &dyn Fn(usize) -> String,
    backend: Backend,
    fp32: f64,
    (mrows, mcols): (usize, usize),
    net: &Network,
) -> Res<()> {
    // The spec column fits the longest spec.
    let w = rows
        .iter()
        .map(|r| r.m.spec.to_string().len())
        .max()
        .unwrap_or(0)
        .max(4);
    outln!(
        "{:<w$} {:>7} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7} {:>9} {:>22} {:>9} {:>8} {:>8} {:>6}",
        "spec",
        "bits/el",
        "ratio",
        "rel L2",
        "EF rel L2",
        "enc GB/s",
        "dec GB/s",
        "add GB/s",
        "backend",
        "strategy",
        "break-even (range)",
        "time ms",
        "speedup",
        "acc",
        "tracks"
    );
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| rows[a].t.total_cmp(&rows[b].t));
    for i in order {
        let r = &rows[i];
        outln!(
            "{:<w$} {:>7.3} {:>6.1} {:>9.2e} {:>9} {:>8.2} {:>8.2} {:>8.2} {:>7} {:>9} {:>22} {:>9.3} {:>8} {:>8} {:>6}",
            r.m.spec.to_string(),
            r.m.bits,
            32.0 / r.m.bits,
            r.m.rel_l2,
            r.m.ef_rel_l2
                .map_or("-".to_string(), |v| format!("{v:.2e}")),
            r.m.enc / 1e9,
            r.m.dec / 1e9,
            r.m.add / 1e9,
            backend.name(),
            r.strategy.name(),
            match r.be {
                Some((be, range)) => fmt_be(be, range),
                None if r.pays_stable => fmt_pays(&r.pays),
                None => format!("{}?", fmt_pays(&r.pays)),
            },
            r.t * 1e3,
            speedup(fp32, r.t),
            acc(i),
            verdicts[i].short()
        );
    }
    outln!(
        "\nrel L2: ||x - D(x)|| / ||x||; EF rel L2: ||sum g - sum D|| / ||sum g|| after {EF_STEPS} steps of error feedback\n\
         (- where error feedback refuses a non-contractive codec);\n\
         break-even: the link speed (Gbit/s) below which the codec's all-reduce beats the fastest fp32 one, from\n\
         the fastest speeds of {ROUNDS} interleaved timing rounds, each timing the codec beside the fp32 sum (range:\n\
         with each round's own); where latency dominates, where it pays (<X, X-Y, >X, always, never; ?: the\n\
         rounds' own speeds give other intervals, by more than 25%);\n\
         time: the modelled all-reduce at {:.1} Gbit/s with the best strategy (ring or allgather); acc and\n\
         tracks: as in the short table (without --wide).",
        net.bandwidth / 1e9
    );
    // With --codec, no PowerSGD rows were asked for.
    if !lowrank.is_empty() {
        outln!(
            "\nPowerSGD on a {mrows} x {mcols} matrix of the same gradient (fp32 factors, warm start, error feedback):"
        );
        outln!(
            "{:>4} {:>7} {:>6} {:>10} {:>10} {:>9} {:>8} {:>8} {:>6}",
            "rank",
            "bits/el",
            "ratio",
            "compute ms",
            "break-even",
            "time ms",
            "speedup",
            "acc",
            "tracks"
        );
        for (k, l) in lowrank.iter().enumerate() {
            outln!(
                "{:>4} {:>7.3} {:>6.1} {:>10.3} {:>10} {:>9.3} {:>8} {:>8} {:>6}",
                l.rank,
                l.bits,
                32.0 / l.bits,
                l.compute_s * 1e3,
                fmt_lowrank_be(l.break_even),
                l.t * 1e3,
                speedup(fp32, l.t),
                acc(rows.len() + k),
                verdicts[rows.len() + k].short()
            );
        }
        outln!(
            "compute: one step on this CPU (M Q, M^T P, Gram-Schmidt, P Q^T and the residual), the fastest of {ROUNDS};\n\
             break-even: the link speed (Gbit/s) below which it beats the fp32 ring; time: the compute plus its\n\
             two fp32 ring all-reduces (of {mrows} r and {mcols} r values) at {:.1} Gbit/s.",
            net.bandwidth / 1e9
        );
    }
    Ok(())
}

/// All-reduce time against link bandwidth (1 to 400 Gbit/s, or wider to take in the
/// bandwidth asked about, which is marked; log-log), one line per codec (best strategy at
/// each bandwidth) and fp32.
fn plot(
    path: &Path,
    codecs: &[CodecProfile],
    base: &CodecProfile,
    net: &Network,
    elements: f64,
    reduce: f64,
) -> Res<()> {
    let asked = net.bandwidth / 1e9;
    let (x0, x1) = ((asked / 1.5).min(1.0), (asked * 1.5).max(400.0));
    let bws: Vec<f64> = (0..=200)
        .map(|i| 1e9 * x0 * (x1 / x0).powf(i as f64 / 200.0))
        .collect();
    let cluster = |b| cost::Cluster {
        nodes: net.nodes,
        bandwidth_bit_s: b,
        latency_s: net.latency,
    };
    // fp32: the faster of its ring and an all-gather of fp32 frames, as the report.
    let reference = plot::Series {
        name: "fp32".into(),
        pts: bws
            .iter()
            .map(|&b| {
                let t = cost::best_fp32(base, &cluster(b), elements, reduce).1;
                (b / 1e9, t * 1e3)
            })
            .collect(),
        dashed: false,
        variant: usize::MAX,
    };
    let mut per_family: Vec<&'static str> = Vec::new();
    let series = codecs
        .iter()
        .map(|c| {
            let fam = plot::family(&c.spec);
            let variant = per_family.iter().filter(|f| **f == fam).count();
            per_family.push(fam);
            let pts = bws
                .iter()
                .map(|&b| {
                    (
                        b / 1e9,
                        cost::best_strategy(c, &cluster(b), elements, reduce).1 * 1e3,
                    )
                })
                .collect();
            let s = plot::Series {
                name: c.spec.clone(),
                pts,
                dashed: false,
                variant,
            };
            (c.spec.clone(), s)
        })
        .collect();
    plot::small_multiples(
        path,
        &format!(
            "modelled all-reduce of {:.1} MiB on {} nodes, {:.0} us latency (best strategy; lower is faster)",
            elements * 4.0 / 1048576.0,
            net.nodes,
            net.latency * 1e6
        ),
        &plot::by_family(series),
        &reference,
        &plot::Axes {
            x: (x0, x1),
            x_log: true,
            x_label: "link bandwidth (Gbit/s)".into(),
            y_label: "time (ms)".into(),
            mark_x: Some((asked, format!(" {} Gbit/s asked", short_bw(asked)))),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::{fit_pays, fmt_pays, same_region};

    #[test]
    fn rounds_that_move_a_region_by_more_than_a_quarter_mark_it() {
        let inf = f64::INFINITY;
        let below = [(0.0, 100e9)];
        assert!(same_region(&[(0.0, 120e9)], &below));
        assert!(!same_region(&[(0.0, 130e9)], &below));
        assert!(!same_region(&[], &below), "never against <100");
        assert!(
            !same_region(&[(0.0, 100e9), (200e9, inf)], &below),
            "another interval"
        );
        assert!(
            same_region(&[(0.0, inf)], &[(0.0, inf)]),
            "always both times"
        );
        assert!(same_region(&[], &[]), "never both times");
        assert!(!same_region(&[(90e9, inf)], &[(50e9, inf)]));
    }

    #[test]
    fn where_a_codec_pays_fits_its_column() {
        let inf = f64::INFINITY;
        assert_eq!(fmt_pays(&[]), "never");
        assert_eq!(fmt_pays(&[(0.0, inf)]), "always");
        assert_eq!(fmt_pays(&[(0.0, 4.56e9)]), "<4.6");
        assert_eq!(fmt_pays(&[(480.2e9, inf)]), ">480");
        assert_eq!(fmt_pays(&[(2.5e9, 12.0e9)]), "2.5-12.0");
        // Two intervals, as a run at 16 nodes measured for fp16 (17 characters before).
        assert_eq!(fmt_pays(&[(0.0, 248.8e9), (1584.3e9, inf)]), "<249, >1584");
        // The narrow table's column of 10: what fits, then an ellipsis.
        let two = [(0.0, 242.0e9), (358.0e9, 2599.0e9)];
        assert_eq!(fmt_pays(&two), "<242, 358-2599");
        assert_eq!(fit_pays(&two, 10), "<242, …");
        assert_eq!(fit_pays(&[(0.0, 4.56e9)], 10), "<4.6");
        assert_eq!(fit_pays(&[(1234.5e9, 56789.0e9)], 5), "…");
        for pays in [
            &two[..],
            &[(0.0, 248.8e9), (1584.3e9, inf)],
            &[(2.5e9, 12.0e9)],
        ] {
            assert!(fit_pays(pays, 10).chars().count() <= 10, "{pays:?}");
        }
    }
}
