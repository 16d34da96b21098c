//! In-process compressed all-reduce: 8 simulated ranks (threads) x 4 Mi elements per
//! codec and strategy; wall time and bytes moved, with the fp32 ring as the same-run
//! baseline.
//!
//! `cargo bench --bench collective` prints a markdown table (docs/benchmarks.md records
//! one). Environment: `GRADPACK_BENCH_RANKS` (default 8), `GRADPACK_BENCH_ELEMENTS`
//! (default 4194304), `GRADPACK_BENCH_REPS` (timed repetitions after one warm-up, default
//! 5; the median is reported), `GRADPACK_BENCH_CODECS` (comma-separated specs; default
//! the representative set).
//!
//! Frames are sealed with a payload checksum (the collectives' default); the last column
//! is the same all-reduce unsealed, so the two give the checksum's cost.
//!
//! Every rank is a thread, so on a machine with fewer cores than ranks the ranks' compute
//! is serialised: the wall time is the whole world's encode/decode work divided among the
//! cores, plus the copies through the channels. The codecs' own rayon splitting is off
//! (the rank threads already occupy every core). Bytes are what the codec puts on the
//! wire; the in-process "network" moves them at memory speed, so this measures compute,
//! not a link (`gradpack model` and `gradpack report` combine the two).

use std::sync::Barrier;
use std::time::{Duration, Instant};

use gradpack::CodecSpec;
use gradpack::codec::REPRESENTATIVE_SPECS;
use gradpack::collective::{AllReduce, AllReduceOptions, Strategy, StrategyChoice, local};

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v}: expected a count")),
        Err(_) => default,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median wall time (seconds) of an all-reduce on every rank, and the bytes each rank sent.
fn measure(
    codec: CodecSpec,
    s: Strategy,
    inputs: &[Vec<f32>],
    reps: usize,
    checksum: bool,
) -> Option<(f64, Vec<u64>)> {
    let (p, n) = (inputs.len(), inputs[0].len());
    let barrier = Barrier::new(p);
    let opts = AllReduceOptions {
        strategy: StrategyChoice::Forced(s),
        checksum,
        ..Default::default()
    };
    let res = local::run(p, Some(Duration::from_secs(600)), |mut t| {
        let rank = gradpack::collective::Transport::rank(&t);
        let mut ar = AllReduce::new(codec, n, &t, opts.clone())?;
        let mut out = vec![0f32; n];
        let mut times = Vec::with_capacity(reps);
        let mut sent = 0;
        for rep in 0..=reps {
            barrier.wait();
            let t0 = Instant::now();
            let stats = ar.run(&mut t, &inputs[rank], &mut out, rep as u64)?;
            times.push(t0.elapsed().as_secs_f64());
            sent = stats.bytes_sent;
        }
        Ok((times, sent))
    });
    let mut per_rep = vec![0f64; reps];
    let mut sent = Vec::with_capacity(p);
    for r in res {
        let (times, s) = r.ok()?;
        // Every rank starts at the barrier: a repetition takes as long as its slowest rank.
        for (m, t) in per_rep.iter_mut().zip(&times[1..]) {
            *m = m.max(*t);
        }
        sent.push(s);
    }
    Some((median(per_rep), sent))
}

fn main() {
    let p = env_usize("GRADPACK_BENCH_RANKS", 8);
    let n = env_usize("GRADPACK_BENCH_ELEMENTS", 4 << 20);
    let reps = env_usize("GRADPACK_BENCH_REPS", 5).max(1);
    let codecs: Vec<String> = match std::env::var("GRADPACK_BENCH_CODECS") {
        Ok(v) => v.split(',').map(|s| s.trim().to_string()).collect(),
        Err(_) => REPRESENTATIVE_SPECS.iter().map(|s| s.to_string()).collect(),
    };
    // The rank threads already fill the cores.
    gradpack::parallel::set_min_len(usize::MAX);
    let inputs: Vec<Vec<f32>> = (0..p)
        .map(|r| gradpack::synthetic::gradient(n, 1 + r as u64))
        .collect();

    println!(
        "in-process all-reduce: {p} ranks x {n} elements, {} cores, median of {reps}\n",
        std::thread::available_parallelism().map_or(1, |c| c.get())
    );
    println!(
        "| codec | strategy | sent/rank (MiB) | moved, all ranks (MiB) | vs fp32 ring bytes | wall (ms) | vs fp32 ring time | unsealed wall (ms) |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let identity: CodecSpec = "identity".parse().unwrap();
    let (base_t, base_sent) =
        measure(identity, Strategy::Fp32Ring, &inputs, reps, true).expect("fp32 ring runs");
    let base_total: u64 = base_sent.iter().sum();
    let unsealed = |codec: CodecSpec, s: Strategy| {
        measure(codec, s, &inputs, reps, false).map_or(f64::NAN, |m| m.0)
    };
    let row = |codec: &str, s: Strategy, t: f64, sent: &[u64], plain: f64| {
        let total: u64 = sent.iter().sum();
        let per_rank = *sent.iter().max().unwrap() as f64;
        println!(
            "| {codec} | {} | {:.2} | {:.1} | {:.3} | {:.1} | {:.2} | {:.1} |",
            s.name(),
            per_rank / 1048576.0,
            total as f64 / 1048576.0,
            total as f64 / base_total as f64,
            t * 1e3,
            t / base_t,
            plain * 1e3
        );
    };
    let plain = unsealed(identity, Strategy::Fp32Ring);
    row("identity", Strategy::Fp32Ring, base_t, &base_sent, plain);
    for spec in &codecs {
        let codec: CodecSpec = spec.parse().unwrap_or_else(|e| panic!("{spec}: {e}"));
        let mut strategies = vec![
            Strategy::CompressedRing,
            Strategy::TwoShot,
            Strategy::CompressedAllGather,
        ];
        if matches!(codec, CodecSpec::Sign(_)) {
            strategies.push(Strategy::SignMajority);
        }
        for s in strategies {
            match measure(codec, s, &inputs, reps, true) {
                Some((t, sent)) => row(spec, s, t, &sent, unsealed(codec, s)),
                None => println!("| {spec} | {} | refused | | | | | |", s.name()),
            }
        }
    }
}
