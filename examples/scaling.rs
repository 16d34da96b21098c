//! How the operations scale with threads: the many-core figures.
//!
//! ```text
//! cargo run --release --example scaling [THREADS...]
//! ```
//!
//! Threads default to 1, 2, 4, 8 and 16, up to the machine's. Prints Markdown tables:
//! - encode and error-feedback steps at 64 Mi elements, in GB/s of f32 input, beside a
//!   memcpy of the same bytes and a pass with an error-feedback step's traffic (`r = 0.5 r
//!   + g`: two streams read, one written) on as many threads;
//! - the fused reduction of 8 int8 frames of 9 M elements against 8 `decode_add` calls and
//!   a memcpy of the output;
//! - `dct` (chunk 64, k 4) encode and decode at 1 Mi elements;
//! - a PowerSGD rank-2 step (`PowerSgdBucket`'s three calls on the caller's buffer, with
//!   error feedback and without, as the PyTorch hook runs them) on a 4096 x 2304 gradient against
//!   three read passes over it.
//!
//! Each figure is the best of repetitions filling about 0.3 s (at least 3).
//!
//! ```text
//! cargo run --release --example scaling -- --every [THREADS...]
//! ```
//!
//! With `--every`: instead, every representative codec's error-feedback step at 64 Mi
//! elements and its [`gradpack::reduce_frames`] of 8 frames of 8 Mi elements (64 Mi
//! decoded, GB/s of the 8 Mi output), each the best of repetitions filling about 0.15 s
//! (at least 3): the before-and-after check of a kernel change on many cores. A spec
//! this build cannot parse prints a row saying so, so that one program runs on two
//! commits.

use std::time::Instant;

use gradpack::sync::{PowerSgd, PowerSgdBucket};
use gradpack::{Codec, CodecSpec, EncodeCtx, ErrorFeedback, FeedbackOptions};
use rayon::prelude::*;

/// Seconds per call of `f`: the best of repetitions filling about 0.3 s, at least 3.
fn time(f: impl FnMut()) -> f64 {
    time_for(0.3, f)
}

/// Seconds per call of `f`: the best of repetitions filling about `fill` seconds, at
/// least 3.
fn time_for(fill: f64, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let (mut reps, mut best) = (0u32, f64::INFINITY);
    while start.elapsed().as_secs_f64() < fill || reps < 3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        reps += 1;
    }
    best
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool")
}

/// `r = 0.5 r + g` in 64 Ki-element pieces on the current pool: an error-feedback step's
/// traffic (two streams read, one written in place) with no codec work.
fn par_axpy(g: &[f32], r: &mut [f32]) {
    r.par_chunks_mut(1 << 16)
        .zip(g.par_chunks(1 << 16))
        .for_each(|(r, g)| r.iter_mut().zip(g).for_each(|(r, g)| *r = 0.5 * *r + g));
}

/// A copy of `src` into `dst` in 64 Ki-element pieces on the current pool.
fn par_copy(src: &[f32], dst: &mut [f32]) {
    dst.par_chunks_mut(1 << 16)
        .zip(src.par_chunks(1 << 16))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

fn row(name: &str, gbs: &[f64]) {
    let cells: Vec<String> = gbs.iter().map(|g| format!("{g:.1}")).collect();
    let scale = gbs.last().unwrap_or(&0.0) / gbs.first().unwrap_or(&1.0);
    println!("| {name} | {} | {scale:.1}x |", cells.join(" | "));
}

fn header(first: &str, threads: &[usize]) {
    let t: Vec<String> = threads.iter().map(|t| format!("{t} thr")).collect();
    println!("| {first} | {} | last / first |", t.join(" | "));
    println!("|---|{}---:|", "---:|".repeat(threads.len()));
}

/// GB/s of f32 input of `spec`'s encode of `x` on each pool (its error-feedback step when
/// `feedback`), each the best of repetitions filling about `fill` seconds.
fn encode_rates(
    pools: &[rayon::ThreadPool],
    spec: CodecSpec,
    x: &[f32],
    fill: f64,
    feedback: bool,
) -> Result<Vec<f64>, gradpack::Error> {
    let any = FeedbackOptions {
        allow_non_contractive: true,
        ..Default::default()
    };
    let mut frame = vec![0u8; spec.max_encoded_len(x.len())];
    let mut ef = ErrorFeedback::with_options(spec, x.len(), any)?;
    let ctx = EncodeCtx::new(1);
    let gb = (4 * x.len()) as f64 / 1e9;
    Ok(pools
        .iter()
        .map(|p| {
            let call = || {
                if feedback {
                    ef.encode_into(x, &ctx, &mut frame).expect("step");
                } else {
                    spec.encode_into(x, &ctx, &mut frame).expect("encode");
                }
            };
            gb / p.install(|| time_for(fill, call))
        })
        .collect())
}

/// `--every`: every representative codec's error-feedback step at 64 Mi elements and its
/// sum of 8 frames of 8 Mi, on each pool.
fn every(threads: &[usize], pools: &[rayon::ThreadPool]) -> Result<(), Box<dyn std::error::Error>> {
    // Each spec with its codec, or none where this build cannot parse it.
    let specs: Vec<(&str, Option<CodecSpec>)> = gradpack::codec::REPRESENTATIVE_SPECS
        .iter()
        .chain(&["identity", "topk:ratio=0.01,select=approx"])
        .map(|&name| (name, name.parse().ok()))
        .collect();
    let x = gradpack::synthetic::gradient(1 << 26, 7);
    header("error-feedback step, 64 Mi elements, GB/s of f32", threads);
    for &(name, spec) in &specs {
        let Some(spec) = spec else {
            println!("| {name} | not in this build |");
            continue;
        };
        let gbs = encode_rates(pools, spec, &x, 0.15, true)?;
        row(name, &gbs);
    }
    drop(x);

    let n = 1 << 23;
    let sources: Vec<Vec<f32>> = (0..8)
        .map(|r| gradpack::synthetic::gradient(n, 100 + r))
        .collect();
    let mut out = vec![0f32; n];
    let gb = (4 * n) as f64 / 1e9;
    println!();
    header("reduce_frames of 8 frames of 8 Mi, GB/s of output", threads);
    for &(name, spec) in &specs {
        let Some(spec) = spec else {
            println!("| {name} | not in this build |");
            continue;
        };
        let frames: Vec<Vec<u8>> = pools[pools.len() - 1].install(|| {
            sources
                .iter()
                .map(|g| spec.encode(g, &EncodeCtx::new(1)))
                .collect::<Result<_, _>>()
        })?;
        let gbs: Vec<f64> = pools
            .iter()
            .map(|p| {
                let sum = || gradpack::reduce_frames(&frames, &mut out).expect("sum");
                gb / p.install(|| time_for(0.15, sum))
            })
            .collect();
        row(name, &gbs);
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let args: Vec<String> = std::env::args().skip(1).collect();
    let every_codec = args.first().is_some_and(|a| a == "--every");
    let mut threads: Vec<usize> = args
        .iter()
        .skip(usize::from(every_codec))
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    if threads.is_empty() {
        threads = [1, 2, 4, 8, 16]
            .into_iter()
            .filter(|&t| t <= cores)
            .collect();
    }
    let pools: Vec<_> = threads.iter().map(|&t| pool(t)).collect();
    println!("{cores} cores; backend {}\n", gradpack::Backend::current());
    if every_codec {
        return every(&threads, &pools);
    }

    // Encode and error feedback at 64 Mi elements.
    let n = 1 << 26;
    let x = gradpack::synthetic::gradient(n, 7);
    let mut copy = vec![0f32; n];
    let gb = (4 * n) as f64 / 1e9;
    header("64 Mi elements, GB/s of f32", &threads);
    let memcpy: Vec<f64> = pools
        .iter()
        .map(|p| gb / p.install(|| time(|| par_copy(&x, &mut copy))))
        .collect();
    row("memcpy", &memcpy);
    let axpy: Vec<f64> = pools
        .iter()
        .map(|p| gb / p.install(|| time(|| par_axpy(&x, &mut copy))))
        .collect();
    row("r = 0.5 r + g (an error-feedback step's traffic)", &axpy);
    let ops: [(&str, &str, bool); 8] = [
        ("fp16 encode", "fp16", false),
        ("fp16 error-feedback step", "fp16", true),
        ("int8 stochastic encode", "int8:rounding=stochastic", false),
        ("qsgd 4-bit encode", "qsgd:bits=4", false),
        (
            "random-k strata encode",
            "randk:ratio=0.01,select=strata",
            false,
        ),
        (
            "top-k 1% approx encode",
            "topk:ratio=0.01,select=approx",
            false,
        ),
        (
            "top-k 1% approx error-feedback step",
            "topk:ratio=0.01,select=approx",
            true,
        ),
        (
            "random-k strata error-feedback step",
            "randk:ratio=0.01,select=strata",
            true,
        ),
    ];
    for (name, spec, ef) in ops {
        let spec: CodecSpec = spec.parse()?;
        let gbs = encode_rates(&pools, spec, &x, 0.3, ef)?;
        row(name, &gbs);
    }
    drop((x, copy));

    // The fused reduction of 8 int8 frames of 9 M elements.
    let n = 9_000_000;
    let spec: CodecSpec = "int8".parse()?;
    let frames: Vec<Vec<u8>> = (0..8)
        .map(|r| {
            spec.encode(
                &gradpack::synthetic::gradient(n, 100 + r),
                &EncodeCtx::new(1),
            )
        })
        .collect::<Result<_, _>>()?;
    let src = gradpack::synthetic::gradient(n, 3);
    let mut out = vec![0f32; n];
    let gb = (4 * n) as f64 / 1e9;
    println!();
    header("8 int8 frames of 9 M, GB/s of output", &threads);
    let mut rows: [Vec<f64>; 3] = Default::default();
    for p in &pools {
        p.install(|| {
            rows[0].push(gb / time(|| par_copy(&src, &mut out)));
            rows[1].push(gb / time(|| gradpack::reduce_frames(&frames, &mut out).expect("sum")));
            rows[2].push(
                gb / time(|| {
                    out.fill(0.0);
                    for f in &frames {
                        gradpack::decode_add(f, &mut out).expect("add");
                    }
                }),
            );
        });
    }
    row("memcpy of the output", &rows[0]);
    row("reduce_frames", &rows[1]);
    row("8 decode_add", &rows[2]);
    let ratios = |a: &[f64], b: &[f64]| -> Vec<String> {
        a.iter()
            .zip(b)
            .map(|(a, b)| format!("{:.2}", a / b))
            .collect()
    };
    println!(
        "\nreduce_frames / memcpy: {}; reduce_frames / 8 decode_add: {}",
        ratios(&rows[1], &rows[0]).join(", "),
        ratios(&rows[1], &rows[2]).join(", ")
    );

    // dct at 1 Mi elements.
    let n = 1 << 20;
    let x = gradpack::synthetic::gradient(n, 5);
    let spec: CodecSpec = "dct:chunk=64,k=4".parse()?;
    let frame = spec.encode(&x, &EncodeCtx::new(1))?;
    let mut buf = vec![0u8; spec.max_encoded_len(n)];
    let mut y = vec![0f32; n];
    let gb = (4 * n) as f64 / 1e9;
    println!();
    header("dct chunk 64, k 4, 1 Mi elements, GB/s", &threads);
    let mut enc = Vec::new();
    let mut dec = Vec::new();
    for p in &pools {
        p.install(|| {
            let ctx = EncodeCtx::new(1);
            enc.push(
                gb / time(|| {
                    spec.encode_into(&x, &ctx, &mut buf).expect("enc");
                }),
            );
            dec.push(gb / time(|| gradpack::decode(&frame, &mut y).expect("dec")));
        });
    }
    row("dct encode", &enc);
    row("dct decode", &dec);

    // PowerSGD rank 2 on 4096 x 2304.
    let (rows_, cols) = (4096, 2304);
    let g = gradpack::synthetic::gradient(rows_ * cols, 7);
    println!();
    header("PowerSGD rank 2, 4096 x 2304: ms", &threads);
    let mut steps = [Vec::new(), Vec::new()];
    let mut passes = Vec::new();
    for p in &pools {
        p.install(|| {
            let read = time(|| {
                // Bits XOR-ed: an associative fold, so the read runs at SIMD width.
                let fold = |c: &[f32]| c.iter().fold(0u32, |a, x| a ^ x.to_bits());
                std::hint::black_box(g.par_chunks(1 << 16).map(fold).reduce(|| 0, |a, b| a ^ b));
            });
            passes.push(3.0 * read * 1e3);
        });
        // The step's arithmetic on the caller's buffer, as the PyTorch hook drives it
        // (no engine: its copies in and out would be timed too), on this pool, with error
        // feedback and without.
        for (step, feedback) in steps.iter_mut().zip([true, false]) {
            let secs = p.install(|| -> Result<f64, gradpack::Error> {
                let settings = PowerSgd {
                    feedback,
                    ..PowerSgd::rank(2)
                };
                let mut b = PowerSgdBucket::new(settings, &[(rows_, cols, 2)])?;
                let (mut pp, mut qq) = (vec![0f32; b.p_len()], vec![0f32; b.q_len()]);
                let mut m = g.clone();
                Ok(time(|| {
                    b.p_step(&mut m, 1, &mut pp).expect("p");
                    b.q_step(&m, &mut pp, &mut qq).expect("q");
                    b.finish_in_place(&mut m, &pp, &qq).expect("finish");
                }))
            })?;
            step.push(secs * 1e3);
        }
    }
    let cells = |v: &[f64]| v.iter().map(|t| format!("{t:.2}")).collect::<Vec<_>>();
    println!(
        "| PowerSGD step, error feedback | {} | |",
        cells(&steps[0]).join(" | ")
    );
    println!(
        "| PowerSGD step, no feedback | {} | |",
        cells(&steps[1]).join(" | ")
    );
    println!("| three read passes | {} | |", cells(&passes).join(" | "));
    println!(
        "\nPowerSGD step / three read passes: {} (error feedback); {} (none)",
        ratios(&steps[0], &passes).join(", "),
        ratios(&steps[1], &passes).join(", ")
    );
    Ok(())
}
