//! The sync engine over MPI on a model-sized workload: the 161 parameter tensors of
//! ResNet-50 (25.6 M parameters), every rank handing its gradients over in backward
//! order while the engine's communication thread all-reduces full buckets.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_sync
//! mpirun -np 4 target/release/examples/mpi_sync [--steps N]
//! ```
//!
//! For each policy (fp32; fp16, int8 and top-k 1% with error feedback, each with
//! biases and small tensors as fp32; auto; int8 with error feedback between nodes and
//! f32 inside them, the two-level all-reduce, on the nodes MPI's shared-memory split
//! finds or, with `--per-node L`, on emulated nodes of L ranks), rank 0 prints the plan's size, the time per
//! step (slowest rank, median) and the bytes each rank sent, and checks that every rank
//! ends every step with bit-identical gradients (a CRC of all of them compared over MPI)
//! and, for fp32, that the mean is within f32 rounding of `MPI_Allreduce`'s. Exits
//! non-zero if a check fails.
//!
//! Then DiLoCo's outer synchroniser runs on the same transport (4 fragments synced at
//! staggered steps, each every 4 steps), and every rank's outer copy is checked to be
//! identical after every step.
//!
//! MPI is initialised with `Threading::Serialized`: the engine's communication thread
//! makes the MPI calls of the all-reduces while the main thread only makes its own
//! (barriers and checks) between steps, never at the same time.

use std::process::ExitCode;
use std::time::Instant;

use gradpack::CodecSpec;
use gradpack::collective::mpi::MpiTransport;
use gradpack::collective::{Feedback, Nodes};
use gradpack::outer::{OuterOptions, OuterSync};
use gradpack::sync::{Policy, SyncEngine, SyncOptions};
use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::traits::*;

const USAGE: &str = "usage: mpirun -np P mpi_sync [--steps N] [--per-node L]  (default 3 steps \
per policy; --per-node: emulate nodes of L consecutive ranks, instead of the nodes MPI's \
shared-memory split finds)";

fn main() -> ExitCode {
    let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Serialized) else {
        eprintln!("mpi_sync: MPI could not be initialised");
        return ExitCode::FAILURE;
    };
    let world = universe.world();
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    if threading < Threading::Serialized {
        if rank == 0 {
            eprintln!(
                "mpi_sync: this MPI gives {threading:?}; the engine's communication thread needs Serialized"
            );
        }
        return ExitCode::FAILURE;
    }
    let mut steps = 3usize;
    let mut per_node: Option<usize> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--steps" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) if n > 0 => steps = n,
                _ => {
                    if rank == 0 {
                        eprintln!("mpi_sync: --steps needs a positive count\n{USAGE}");
                    }
                    return ExitCode::FAILURE;
                }
            },
            "--per-node" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) if n > 0 => per_node = Some(n),
                _ => {
                    if rank == 0 {
                        eprintln!("mpi_sync: --per-node needs a positive count\n{USAGE}");
                    }
                    return ExitCode::FAILURE;
                }
            },
            "--help" | "-h" => {
                if rank == 0 {
                    println!("{USAGE}");
                }
                return ExitCode::SUCCESS;
            }
            other => {
                if rank == 0 {
                    eprintln!("mpi_sync: unknown argument {other:?}\n{USAGE}");
                }
                return ExitCode::FAILURE;
            }
        }
    }

    // The nodes: emulated, or the ranks that share memory (MPI's shared-memory split:
    // each rank's key is the world rank of its node's first rank).
    let nodes = match per_node {
        Some(l) => Nodes::uniform(p, l),
        None => {
            let local = world.split_shared(0);
            let mut leader = rank as i32;
            local.process_at_rank(0).broadcast_into(&mut leader);
            let mut keys = vec![0i32; p];
            world.all_gather_into(&leader, &mut keys[..]);
            Nodes::from_keys(&keys)
        }
    };
    let nodes = match nodes {
        Ok(n) => n,
        Err(e) => {
            eprintln!("rank {rank}: nodes: {e}");
            return ExitCode::FAILURE;
        }
    };
    let layout = gradpack::synthetic::resnet50();
    let total: usize = layout.iter().map(|t| t.len().expect("shape")).sum();
    let spec = |s: &str| s.parse::<CodecSpec>().expect("spec");
    let topk = spec("topk:ratio=0.01");
    let by_node = format!(
        "int8 + EF by node ({} nodes of {})",
        nodes.count(),
        nodes.max_node()
    );
    let policies: Vec<(&str, Policy, Feedback)> = vec![
        ("fp32", Policy::uniform(spec("identity")), Feedback::None),
        ("fp16", Policy::with_rules(spec("fp16")), Feedback::None),
        (
            "int8 + EF",
            Policy::with_rules(spec("int8")),
            Feedback::Worker,
        ),
        ("top-k 1% + EF", Policy::with_rules(topk), Feedback::Worker),
        (
            "auto + EF",
            Policy::auto(vec![spec("fp16"), spec("int8"), topk]),
            Feedback::Worker,
        ),
        (&by_node, Policy::with_rules(spec("int8")), Feedback::Worker),
    ];
    if rank == 0 {
        println!(
            "sync engine over MPI: ResNet-50 ({} tensors, {total} parameters), {p} ranks, {steps} steps per policy\n",
            layout.len()
        );
        println!(
            "| policy | buckets | sent/rank/step (MiB) | step (ms) | identical on every rank | fp32 vs MPI_Allreduce |"
        );
        println!("|---|---:|---:|---:|---|---|");
    }
    // Each rank's gradients (synthetic, different per rank), made once.
    let base: Vec<Vec<f32>> = layout
        .iter()
        .enumerate()
        .map(|(i, t)| {
            gradpack::synthetic::gradient(t.len().expect("shape"), (i * 64 + rank) as u64)
        })
        .collect();
    let mut failures = 0u64;
    let mut transport = Some(MpiTransport::new(&world));
    for (name, policy, feedback) in policies {
        let opts = SyncOptions {
            policy,
            feedback,
            seed: 11,
            // The last policy goes by node: f32 inside a node, int8 between nodes.
            nodes: (name == by_node).then(|| nodes.clone()),
            ..Default::default()
        };
        let mut engine = match SyncEngine::new(&layout, transport.take().expect("transport"), opts)
        {
            Ok(e) => e,
            Err(e) => {
                eprintln!("rank {rank}: {name}: {e}");
                world.abort(2);
            }
        };
        let mut times = Vec::with_capacity(steps);
        let (mut sent, mut differs, mut off) = (0u64, 0u64, 0u64);
        for step in 0..steps {
            // This step's gradients: the rank's own, scaled differently each step.
            let scale = 1.0 + 0.25 * step as f32;
            let grads: Vec<Vec<f32>> = base
                .iter()
                .map(|g| g.iter().map(|v| v * scale).collect())
                .collect();
            world.barrier();
            let t0 = Instant::now();
            let mut res = Ok(());
            for (i, g) in grads.iter().enumerate() {
                if let Err(e) = engine.ready(i, g) {
                    res = Err(e);
                    break;
                }
            }
            let stats = res.and_then(|_| engine.finish());
            let elapsed = t0.elapsed().as_secs_f64();
            let stats = match stats {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("rank {rank}: {name} step {step}: {e}");
                    world.abort(2);
                }
            };
            let mut slowest = 0f64;
            world.all_reduce_into(&elapsed, &mut slowest, SystemOperation::max());
            times.push(slowest);
            sent = sent.max(stats.bytes_sent);
            // Bit-identical on every rank: compare a CRC of every reduced gradient.
            let mut h = crc32fast::Hasher::new();
            for i in 0..layout.len() {
                let g = engine.grad(i).expect("finished step");
                h.update(bytemuck::cast_slice(g));
            }
            let mine = u64::from(h.finalize());
            let mut root = mine;
            world.process_at_rank(0).broadcast_into(&mut root);
            let mut d = 0u64;
            world.all_reduce_into(&u64::from(mine != root), &mut d, SystemOperation::sum());
            differs += d;
            if name == "fp32" {
                // Against MPI's own mean, to f32 rounding of p terms.
                for (i, g) in grads.iter().enumerate() {
                    let mut sum = vec![0f32; g.len()];
                    world.all_reduce_into(&g[..], &mut sum[..], SystemOperation::sum());
                    let mut mag = vec![0f32; g.len()];
                    let abs: Vec<f32> = g.iter().map(|v| v.abs()).collect();
                    world.all_reduce_into(&abs[..], &mut mag[..], SystemOperation::sum());
                    let ours = engine.grad(i).expect("finished step");
                    let bad = ours
                        .iter()
                        .zip(&sum)
                        .zip(&mag)
                        .filter(|&((&o, &s), &m)| {
                            let bound =
                                2.0 * p as f64 * f64::from(f32::EPSILON) * f64::from(m) / p as f64;
                            (f64::from(o) - f64::from(s) / p as f64).abs() > bound + 1e-30
                        })
                        .count() as u64;
                    let mut all = 0u64;
                    world.all_reduce_into(&bad, &mut all, SystemOperation::sum());
                    off += all;
                }
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let buckets = engine.plan().buckets.len();
        failures += u64::from(differs > 0) + u64::from(off > 0);
        if rank == 0 {
            println!(
                "| {name} | {buckets} | {:.2} | {:.1} | {} | {} |",
                sent as f64 / 1048576.0,
                median * 1e3,
                if differs == 0 {
                    "yes".to_string()
                } else {
                    format!("NO ({differs} rank-steps)")
                },
                match (name, off) {
                    ("fp32", 0) => "within rounding".to_string(),
                    ("fp32", n) => format!("NO ({n} elements)"),
                    _ => "-".to_string(),
                }
            );
        }
        match engine.into_transport() {
            Ok(t) => transport = Some(t),
            Err(e) => {
                eprintln!("rank {rank}: {e}");
                world.abort(2);
            }
        }
    }
    // DiLoCo over the same transport: every rank trains alone (a different drift per
    // rank), the outer synchroniser syncs 4 fragments at staggered steps, each every 4
    // steps, int8 with error feedback. After each step every rank's outer copy must be
    // the same (a CRC compared over MPI). No delay: with one, the communication thread
    // would make MPI calls while this thread compares CRCs, which Serialized forbids.
    let mut params: Vec<Vec<f32>> = layout
        .iter()
        .enumerate()
        .map(|(i, t)| gradpack::synthetic::gradient(t.len().expect("shape"), i as u64))
        .collect();
    let views: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let opts = OuterOptions {
        sync_every: 4,
        fragments: 4,
        codec: spec("int8"),
        feedback: Feedback::Worker,
        seed: 5,
        ..Default::default()
    };
    let mut outer =
        match OuterSync::new(&layout, &views, transport.take().expect("transport"), opts) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("rank {rank}: DiLoCo: {e}");
                world.abort(2);
            }
        };
    let (mut differs, mut syncs, mut sent) = (0u64, 0usize, 0u64);
    let t0 = Instant::now();
    let inner = 4 * steps.max(2);
    for step in 0..inner {
        for (i, (p, b)) in params.iter_mut().zip(&base).enumerate() {
            let lr = 1e-3 * (1 + (i + step) % 3) as f32;
            p.iter_mut().zip(b).for_each(|(x, g)| *x -= lr * g);
        }
        let mut views: Vec<&mut [f32]> = params.iter_mut().map(Vec::as_mut_slice).collect();
        match outer.step(&mut views) {
            Ok(s) => {
                syncs += s.applied;
                sent += s.bytes_sent;
            }
            Err(e) => {
                eprintln!("rank {rank}: DiLoCo step {step}: {e}");
                world.abort(2);
            }
        }
        let mut h = crc32fast::Hasher::new();
        for i in 0..layout.len() {
            h.update(bytemuck::cast_slice(outer.outer(i).expect("tensor")));
        }
        let mine = u64::from(h.finalize());
        let mut root = mine;
        world.process_at_rank(0).broadcast_into(&mut root);
        let mut d = 0u64;
        world.all_reduce_into(&u64::from(mine != root), &mut d, SystemOperation::sum());
        differs += d;
    }
    let secs = t0.elapsed().as_secs_f64();
    failures += u64::from(differs > 0) + u64::from(syncs == 0);
    if rank == 0 {
        println!(
            "\nDiLoCo (4 fragments, each synced every 4 steps, int8 + EF): {inner} inner steps, \
             {syncs} fragment syncs, {:.1} MiB sent by rank 0, {:.0} ms per inner step; outer \
             copies {}",
            sent as f64 / 1048576.0,
            1e3 * secs / inner as f64,
            if differs == 0 {
                "identical on every rank after every step".to_string()
            } else {
                format!("DIFFER ({differs} rank-steps)")
            }
        );
    }
    drop(outer);
    if rank == 0 {
        println!(
            "\n{}",
            if failures == 0 {
                "every step identical on every rank"
            } else {
                "FAILED"
            }
        );
    }
    drop(universe);
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
