//! Compressed all-reduce over the native TCP transport (`collective::Tcp`), one process
//! per rank, checked against the exact sum.
//!
//! ```text
//! cargo build --release --example tcp_allreduce
//! target/release/examples/tcp_allreduce --ranks 3 [--elements N]     # starts 3 ranks here
//! RANK=r WORLD_SIZE=p MASTER_ADDR=host MASTER_PORT=port tcp_allreduce   # one rank (torchrun's variables)
//! ```
//!
//! Without `RANK` in the environment it starts `--ranks` copies of itself on this host,
//! meeting on the loopback. Every rank all-reduces a synthetic gradient of N elements
//! (default 1 Mi; a different one per rank) with every representative codec and each
//! compressed strategy, checks on every element that the error against the exact sum
//! (f64, of every rank's gradient, which every rank can make) is within
//! `collective::error_bound`, and that every rank holds the same bits (an agreement on
//! a CRC of the output). Rank 0 prints one row per run. Exits non-zero if any check
//! fails.

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use gradpack::CodecSpec;
use gradpack::codec::REPRESENTATIVE_SPECS;
use gradpack::collective::{
    AllReduce, AllReduceOptions, Comm, ReduceOp, Strategy, StrategyChoice, Tcp, TcpOptions,
    Transport, chunk_range, error_bound,
};

const USAGE: &str = "usage: tcp_allreduce [--ranks P] [--elements N]\n\n\
    Without RANK in the environment, starts P ranks (default 3) on this host; with torchrun's\n\
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, runs as that rank. All-reduces N f32\n\
    elements per rank (default 1048576) with each representative codec and strategy over\n\
    TCP, checks the error bound against the exact sum and that ranks agree to the bit.";

fn main() -> ExitCode {
    let (ranks, n) = match parse() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("tcp_allreduce: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = if std::env::var_os("RANK").is_some() {
        rank_main(n)
    } else {
        launch(ranks, n)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tcp_allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Start `p` ranks of this program on the loopback and wait for them.
fn launch(p: usize, n: usize) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let children: Vec<_> = (0..p)
        .map(|r| {
            Command::new(&exe)
                .args(["--elements", &n.to_string()])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", p.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .spawn()
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut failed = 0;
    for mut c in children {
        failed += usize::from(!c.wait().map_err(|e| e.to_string())?.success());
    }
    if failed > 0 {
        return Err(format!("{failed} of {p} ranks failed"));
    }
    Ok(())
}

fn rank_main(n: usize) -> Result<(), String> {
    let opts = TcpOptions {
        timeout: Duration::from_secs(60),
        interface: None,
    };
    let t = Tcp::from_env(opts).map_err(|e| e.to_string())?;
    let (rank, p) = (t.rank(), t.size());
    let mut comm = Comm::new(t);
    // Every rank's gradient (each rank can make all of them), their exact sum, and per
    // ring chunk and over the tensor the sum over ranks of each rank's largest |x|.
    let grads: Vec<Vec<f32>> = (0..p)
        .map(|q| gradpack::synthetic::gradient(n, 1 + q as u64))
        .collect();
    let exact: Vec<f64> = (0..n)
        .map(|i| grads.iter().map(|g| f64::from(g[i])).sum())
        .collect();
    let absmax = |r: std::ops::Range<usize>| -> f64 {
        grads
            .iter()
            .map(|g| {
                g[r.clone()]
                    .iter()
                    .fold(0f64, |m, v| m.max(f64::from(v.abs())))
            })
            .sum()
    };
    let chunk_max: Vec<f64> = (0..p).map(|c| absmax(chunk_range(n, p, c))).collect();
    let all_max = absmax(0..n);
    if rank == 0 {
        println!(
            "gradpack compressed all-reduce over TCP: {p} ranks, {n} elements ({:.1} MiB f32 per rank)\n",
            n as f64 * 4.0 / 1048576.0
        );
        println!(
            "| codec | strategy | sent/rank (MiB) | vs fp32 ring | time (ms, rank 0) | max abs err | within bound | identical |"
        );
        println!("|---|---|---:|---:|---:|---:|---|---|");
    }
    let mut runs: Vec<(CodecSpec, Strategy)> =
        vec![("identity".parse().expect("a spec"), Strategy::Fp32Ring)];
    for spec in REPRESENTATIVE_SPECS {
        let codec: CodecSpec = spec.parse().expect("a representative spec");
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
    let mut failures = 0;
    let mut out = vec![0f32; n];
    for (codec, s) in runs {
        let o = AllReduceOptions {
            op: ReduceOp::Sum,
            strategy: StrategyChoice::Forced(s),
            ..Default::default()
        };
        let Ok(mut ar) = AllReduce::new(codec, n, &comm, o) else {
            continue;
        };
        let t0 = Instant::now();
        let stats = ar
            .run(&mut comm, &grads[rank], &mut out, 1)
            .map_err(|e| format!("rank {rank}: {codec} {}: {e}", s.name()))?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        // Chunked: the bound holds per chunk (the two-shot's and the ring's chunks).
        let ring = matches!(
            s,
            Strategy::CompressedRing | Strategy::Fp32Ring | Strategy::TwoShot
        );
        let (mut max_err, mut over) = (0f64, 0usize);
        let parts: Vec<(std::ops::Range<usize>, f64)> = if ring {
            (0..p)
                .map(|c| (chunk_range(n, p, c), chunk_max[c]))
                .collect()
        } else {
            vec![(0..n, all_max)]
        };
        for (range, a) in parts {
            let bound = error_bound(&codec, s, p, a) + p as f64 * f64::from(f32::EPSILON) * a;
            for i in range {
                let e = (f64::from(out[i]) - exact[i]).abs();
                max_err = max_err.max(e);
                over += usize::from(e.is_nan() || e > bound);
            }
        }
        // The same bits on every rank: an agreement on the output's CRC fails on every
        // rank if any rank's differs.
        let crc = crc32fast::hash(bytemuck::cast_slice(&out));
        let identical = comm.agree(u32::MAX - 1, &format!("crc={crc:08x}")).is_ok();
        failures += usize::from(over > 0) + usize::from(!identical);
        if rank == 0 {
            println!(
                "| {codec} | {} | {:.2} | {:.3} | {ms:.1} | {max_err:.3e} | {} | {} |",
                s.name(),
                stats.bytes_sent as f64 / 1048576.0,
                stats.bytes_sent as f64 / fp32_bytes,
                if over == 0 {
                    "yes".to_string()
                } else {
                    format!("NO ({over} elements)")
                },
                if identical { "yes" } else { "NO" },
            );
        }
    }
    if failures > 0 {
        return Err(format!("rank {rank}: {failures} checks failed"));
    }
    if rank == 0 {
        println!("\nall runs within bound and identical on every rank");
    }
    Ok(())
}

/// `--ranks` and `--elements`; `Ok(None)` for `--help`.
fn parse() -> Result<Option<(usize, usize)>, String> {
    let (mut ranks, mut n) = (3usize, 1usize << 20);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |what: &str| -> Result<usize, String> {
            let v = args.next().ok_or(format!("{what} needs a value"))?;
            v.parse().map_err(|_| format!("{what} {v}: not a count"))
        };
        match a.as_str() {
            "--help" | "-h" => return Ok(None),
            "--ranks" => ranks = value("--ranks")?,
            "--elements" => n = value("--elements")?,
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    if ranks == 0 {
        return Err("--ranks 0: at least one".into());
    }
    Ok(Some((ranks, n)))
}
