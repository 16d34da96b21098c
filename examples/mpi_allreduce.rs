//! Compressed all-reduce over MPI, checked against MPI's own uncompressed all-reduce.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_allreduce
//! mpirun -np 4 target/release/examples/mpi_allreduce [--elements N]
//! ```
//!
//! Every rank all-reduces a synthetic gradient of N elements (default 4 Mi, 16 MiB of
//! f32; a different one per rank) with every representative codec and each compressed
//! strategy, then checks on every element that the error against `MPI_Allreduce` (f32
//! sum) is within `collective::error_bound` (plus the reference's own f32 rounding), and
//! that every rank holds bit-identical output. Rank 0 prints one row per run: bytes each
//! rank sent, the slowest rank's time, the largest and relative L2 error. Exits non-zero
//! if any check fails.

use std::process::ExitCode;
use std::time::Instant;

use gradpack::collective::mpi::MpiTransport;
use gradpack::collective::{
    AllReduce, AllReduceOptions, Comm, ReduceOp, Strategy, StrategyChoice, chunk_range, error_bound,
};
use gradpack::{CodecSpec, codec::REPRESENTATIVE_SPECS};
use mpi::collective::SystemOperation;
use mpi::traits::*;

fn main() -> ExitCode {
    let Some(universe) = mpi::initialize() else {
        eprintln!("mpi_allreduce: MPI could not be initialised");
        return ExitCode::FAILURE;
    };
    let world = universe.world();
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let n = match parse_elements() {
        Ok(Some(n)) => n,
        Ok(None) => {
            if rank == 0 {
                println!("{USAGE}");
            }
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            if rank == 0 {
                eprintln!("mpi_allreduce: {e}");
            }
            return ExitCode::FAILURE;
        }
    };
    let mut t = Comm::new(MpiTransport::new(&world));

    let grad = gradpack::synthetic::gradient(n, 1 + rank as u64);
    let mut exact = vec![0f32; n];
    world.barrier();
    let t0 = Instant::now();
    world.all_reduce_into(&grad[..], &mut exact[..], SystemOperation::sum());
    let mpi_time = max_over_ranks(&world, t0.elapsed().as_secs_f64());

    // Sum over ranks of each rank's largest |x|, per ring chunk and over the tensor.
    let local_max =
        |r: std::ops::Range<usize>| grad[r].iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    let mine: Vec<f64> = (0..p)
        .map(|c| local_max(chunk_range(n, p, c)))
        .chain([local_max(0..n)])
        .collect();
    let mut absmax = vec![0f64; p + 1];
    world.all_reduce_into(&mine[..], &mut absmax[..], SystemOperation::sum());
    let exact_norm = exact
        .iter()
        .map(|&v| (v as f64).powi(2))
        .sum::<f64>()
        .sqrt();

    if rank == 0 {
        println!(
            "gradpack compressed all-reduce over MPI: {p} ranks, {n} elements ({:.1} MiB f32 per rank)\n",
            n as f64 * 4.0 / 1048576.0
        );
        println!(
            "| codec | strategy | sent/rank (MiB) | vs fp32 ring | time (ms) | max abs err | rel L2 err | within bound | identical |"
        );
        println!("|---|---|---:|---:|---:|---:|---:|---|---|");
        println!(
            "| MPI_Allreduce | (MPI's own, f32) | - | - | {:.1} | reference | | | |",
            mpi_time * 1e3
        );
    }

    let mut runs: Vec<(CodecSpec, Strategy)> =
        vec![("identity".parse().unwrap(), Strategy::Fp32Ring)];
    for spec in REPRESENTATIVE_SPECS {
        let codec: CodecSpec = spec.parse().expect("representative spec");
        for s in [
            Strategy::CompressedRing,
            Strategy::CompressedAllGather,
            Strategy::TwoShot,
        ] {
            runs.push((codec, s));
        }
        if spec.starts_with("sign") {
            runs.push((codec, Strategy::SignMajority));
        }
    }

    let fp32_bytes = 2.0 * (p as f64 - 1.0) / p as f64 * 4.0 * n as f64;
    let mut failures = 0u64;
    let mut out = vec![0f32; n];
    for (codec, s) in runs {
        let opts = AllReduceOptions {
            op: ReduceOp::Sum,
            strategy: StrategyChoice::Forced(s),
            ..Default::default()
        };
        let mut ar = match AllReduce::new(codec, n, &t, opts) {
            Ok(ar) => ar,
            Err(e) => {
                if rank == 0 {
                    println!("| {codec} | {} | refused: {e} | | | | | | |", s.name());
                }
                continue;
            }
        };
        world.barrier();
        let t0 = Instant::now();
        let stats = match ar.run(&mut t, &grad, &mut out, 1) {
            Ok(stats) => stats,
            Err(e) => {
                eprintln!("rank {rank}: {codec} {}: {e}", s.name());
                world.abort(2);
            }
        };
        let time = max_over_ranks(&world, t0.elapsed().as_secs_f64());

        // Error against MPI's sum, which carries its own f32 rounding (at most
        // (p - 1) eps of the sum of magnitudes).
        // Chunked: the bound holds per chunk (the two-shot's and the ring's chunks).
        let ring = matches!(
            s,
            Strategy::CompressedRing | Strategy::Fp32Ring | Strategy::TwoShot
        );
        let (mut max_err, mut sq, mut over) = (0f64, 0f64, 0u64);
        for c in 0..p {
            let range = if ring { chunk_range(n, p, c) } else { 0..n };
            let a = if ring { absmax[c] } else { absmax[p] };
            let bound = error_bound(&codec, s, p, a) + p as f64 * f64::from(f32::EPSILON) * a;
            for i in range {
                let e = (out[i] as f64 - exact[i] as f64).abs();
                max_err = max_err.max(e);
                sq += e * e;
                // A NaN error counts as over the bound.
                over += u64::from(e.is_nan() || e > bound);
            }
            if !ring {
                break;
            }
        }
        let over = sum_over_ranks(&world, over);
        // Bit-identical: every rank's CRC equals rank 0's.
        let mine = u64::from(crc32fast::hash(bytemuck::cast_slice(&out)));
        let mut crc = mine;
        world.process_at_rank(0).broadcast_into(&mut crc);
        let differs = sum_over_ranks(&world, u64::from(mine != crc));
        let sent = max_over_ranks(&world, stats.bytes_sent as f64);
        failures += u64::from(over > 0) + u64::from(differs > 0);
        if rank == 0 {
            println!(
                "| {codec} | {} | {:.2} | {:.3} | {:.1} | {:.3e} | {:.3e} | {} | {} |",
                s.name(),
                sent / 1048576.0,
                sent / fp32_bytes,
                time * 1e3,
                max_err,
                sq.sqrt() / exact_norm.max(f64::MIN_POSITIVE),
                if over == 0 {
                    "yes".to_string()
                } else {
                    format!("NO ({over} elements)")
                },
                if differs == 0 {
                    "yes".to_string()
                } else {
                    format!("NO ({differs} ranks)")
                },
            );
        }
    }
    if rank == 0 {
        if failures == 0 {
            println!("\nall runs within bound and identical on every rank");
        } else {
            println!("\nFAILED: {failures} checks");
        }
    }
    drop(t);
    drop(universe);
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

const USAGE: &str = "usage: mpirun -np P mpi_allreduce [--elements N]\n\n\
    All-reduces N f32 elements per rank (default 4194304) with each representative codec and\n\
    strategy, checks the error bound against MPI_Allreduce and that ranks agree to the bit.";

/// `Ok(None)` for `--help`.
fn parse_elements() -> Result<Option<usize>, String> {
    let mut n = 4 << 20;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--help" | "-h" => return Ok(None),
            "--elements" => {
                let v = args.next().ok_or("--elements needs a value")?;
                n = v
                    .parse()
                    .map_err(|_| format!("--elements {v}: not a count"))?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?} (accepted: --elements N, --help)"
                ));
            }
        }
    }
    Ok(Some(n))
}

fn max_over_ranks<C: Communicator>(world: &C, v: f64) -> f64 {
    let mut m = 0f64;
    world.all_reduce_into(&v, &mut m, SystemOperation::max());
    m
}

fn sum_over_ranks<C: Communicator>(world: &C, v: u64) -> u64 {
    let mut s = 0u64;
    world.all_reduce_into(&v, &mut s, SystemOperation::sum());
    s
}
