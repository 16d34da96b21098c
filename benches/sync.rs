//! The sync engine on a model-sized workload: the 161 parameter tensors of ResNet-50
//! (25.6 M parameters), in-process ranks over the link simulator.
//!
//! `cargo bench --bench sync` prints two markdown tables (docs/benchmarks.md records
//! them):
//!
//! 1. For each ring piece count (`GRADPACK_BENCH_PIECES`, default `1,4`: the plain and
//!    a pipelined ring), communication per step at `GRADPACK_BENCH_BANDWIDTH` (default 10 Gbit/s) and
//!    `GRADPACK_BENCH_LATENCY` (default 5 us) for 4 and 8 ranks (`GRADPACK_BENCH_RANKS`)
//!    and each policy: the time of `finish()` when every gradient is handed over at once
//!    (no overlap possible), beside the plan's modelled time; then a step with a simulated
//!    backward pass as long as the fp32 communication, serial (backward, then every
//!    bucket) and overlapped (buckets reduced on the communication thread as they fill).
//! 2. The overlap check: fp32 at 1 Gbit/s, 4 ranks, a backward pass as long as the
//!    communication: overlapped against serial step time, with 25 MiB and 8 MiB buckets.
//!
//! Modelled times come from the plan (`Plan::modelled_s`: the network alone for fixed
//! codecs), then again with every codec's speed measured on one thread here
//! (`Plan::remodel`), and for the overlapped step from `Plan::modelled_overlap_s`.
//!
//! The simulated backward pass hands each tensor over at a time proportional to the
//! parameters before it (the time is slept, so it costs no CPU). Every rank is a thread
//! and the engine adds a communication thread per rank, so on a machine with few cores
//! the codecs' compute is shared among the ranks: measured times include that. Medians
//! of `GRADPACK_BENCH_REPS` steps (default 3) after one warm-up.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use gradpack::CodecSpec;
use gradpack::collective::{Feedback, local};
use gradpack::cost::CodecProfile;
use gradpack::sync::{Network, Plan, Policy, SyncEngine, SyncOptions, Tensor, calibrate};

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
        })
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sleep until `t` (no spinning: the simulated compute must not take CPU).
fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

struct Run {
    /// Median step time, seconds.
    step_s: f64,
    /// Bytes each rank sent per step (max over ranks).
    sent: u64,
    plan: Plan,
    /// When each tensor is handed over, as a fraction of the backward pass.
    ready: Vec<f64>,
}

/// Median step time of `p` ranks over `link` with a simulated backward pass of
/// `backward` (zero: every gradient at once).
fn measure(
    layout: &[Tensor],
    p: usize,
    net: Network,
    opts: &SyncOptions,
    backward: Duration,
    reps: usize,
) -> Run {
    let barrier = Barrier::new(p);
    let total: usize = layout.iter().map(|t| t.len().unwrap()).sum();
    // When each tensor is ready, as a fraction of the backward pass.
    let mut at = Vec::with_capacity(layout.len());
    let mut acc = 0usize;
    for t in layout {
        acc += t.len().unwrap();
        at.push(acc as f64 / total as f64);
    }
    let grads: Vec<Vec<f32>> = layout
        .iter()
        .enumerate()
        .map(|(i, t)| gradpack::synthetic::gradient(t.len().unwrap(), i as u64))
        .collect();
    let res = local::run(p, Some(Duration::from_secs(600)), |comm| {
        let mut t = comm.into_inner();
        t.set_link(Some(local::Link {
            bandwidth_bit_s: net.bandwidth_bit_s,
            latency: Duration::from_secs_f64(net.latency_s),
        }));
        let mut e = SyncEngine::new(layout, t, opts.clone())?;
        let mut times = Vec::new();
        let mut sent = 0;
        for _ in 0..=reps {
            barrier.wait();
            let start = Instant::now();
            for (i, g) in grads.iter().enumerate() {
                if !backward.is_zero() {
                    sleep_until(start + backward.mul_f64(at[i]));
                }
                e.ready(i, g)?;
            }
            let s = e.finish()?;
            times.push(start.elapsed().as_secs_f64());
            sent = s.bytes_sent;
        }
        Ok((median(times[1..].to_vec()), sent, e.plan().clone()))
    });
    let mut step = 0f64;
    let mut sent = 0u64;
    let mut plan = None;
    for r in res {
        let (t, s, pl) = r.expect("a sync step");
        step = step.max(t);
        sent = sent.max(s);
        plan = Some(pl);
    }
    Run {
        step_s: step,
        sent,
        plan: plan.expect("ranks"),
        ready: at,
    }
}

/// Every codec's speed on this CPU (one thread), for the model with compute.
fn profiles(specs: &[&str]) -> Vec<CodecProfile> {
    specs
        .iter()
        .map(|s| calibrate(&s.parse().expect("spec"), 1 << 20, 0.3).expect("calibrate"))
        .collect()
}

fn main() {
    let layout = gradpack::synthetic::resnet50();
    let reps = env_f64("GRADPACK_BENCH_REPS", 3.0).max(1.0) as usize;
    let net = Network {
        bandwidth_bit_s: env_f64("GRADPACK_BENCH_BANDWIDTH", 10e9),
        latency_s: env_f64("GRADPACK_BENCH_LATENCY", 5e-6),
    };
    let ranks: Vec<usize> = std::env::var("GRADPACK_BENCH_RANKS")
        .unwrap_or_else(|_| "4,8".into())
        .split(',')
        .map(|s| s.trim().parse().expect("GRADPACK_BENCH_RANKS: counts"))
        .collect();
    let spec = |s: &str| s.parse::<CodecSpec>().expect("spec");
    let topk = spec("topk:ratio=0.01");
    let policies: Vec<(&str, Policy, Feedback)> = vec![
        ("fp32", Policy::uniform(spec("identity")), Feedback::None),
        ("fp16", Policy::with_rules(spec("fp16")), Feedback::None),
        ("int8", Policy::with_rules(spec("int8")), Feedback::None),
        ("top-k 1% + EF", Policy::with_rules(topk), Feedback::Worker),
        (
            "auto (fp16, int8, top-k 1%) + EF",
            Policy::auto(vec![spec("fp16"), spec("int8"), topk]),
            Feedback::Worker,
        ),
    ];
    gradpack::parallel::set_min_len(usize::MAX);
    println!(
        "ResNet-50 ({} tensors, {} parameters), in-process ranks over the link simulator at {:.1} Gbit/s and {:.1} us, {} cores, median of {reps} steps\n",
        layout.len(),
        layout.iter().map(|t| t.len().unwrap()).sum::<usize>(),
        net.bandwidth_bit_s / 1e9,
        net.latency_s * 1e6,
        std::thread::available_parallelism().map_or(1, |c| c.get())
    );
    let profs = profiles(&["identity", "fp16", "int8", "topk:ratio=0.01,values=f32"]);
    println!(
        "| ranks | policy | pieces | buckets | sent/rank (MiB) | comm, measured (ms) | modelled, network only (ms) | modelled with compute (ms) | measured / modelled | backward (ms) | step serial (ms) | step overlapped (ms) | overlapped, modelled (ms) | overlapped / serial |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let pieces: Vec<usize> = std::env::var("GRADPACK_BENCH_PIECES")
        .unwrap_or_else(|_| "1,4".into())
        .split(',')
        .map(|s| s.trim().parse().expect("GRADPACK_BENCH_PIECES: counts"))
        .collect();
    for &p in &ranks {
        let mut fp32_comm = None;
        for (name, policy, fb) in &policies {
            for &k in &pieces {
                let opts = SyncOptions {
                    policy: policy.clone(),
                    feedback: *fb,
                    network: net,
                    pieces: k,
                    ..Default::default()
                };
                let serial = SyncOptions {
                    overlap: false,
                    ..opts.clone()
                };
                let comm = measure(&layout, p, net, &serial, Duration::ZERO, reps);
                let backward = Duration::from_secs_f64(*fp32_comm.get_or_insert(comm.step_s));
                let s = measure(&layout, p, net, &serial, backward, reps);
                let o = measure(&layout, p, net, &opts, backward, reps);
                let mut with_compute = comm.plan.clone();
                with_compute.remodel(&profs);
                let modelled = with_compute.modelled_s();
                println!(
                    "| {p} | {name} | {k} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
                    comm.plan.buckets.len(),
                    comm.sent as f64 / 1048576.0,
                    comm.step_s * 1e3,
                    comm.plan.modelled_s() * 1e3,
                    modelled * 1e3,
                    comm.step_s / modelled,
                    backward.as_secs_f64() * 1e3,
                    s.step_s * 1e3,
                    o.step_s * 1e3,
                    with_compute.modelled_overlap_s(backward.as_secs_f64(), &o.ready) * 1e3,
                    o.step_s / s.step_s
                );
            }
        }
    }

    // The overlap check: 1 Gbit/s, fp32, 4 ranks, backward as long as the communication;
    // the default bucket caps, then 8 MiB buckets.
    let slow = Network {
        bandwidth_bit_s: 1e9,
        latency_s: 50e-6,
    };
    for cap in [25usize << 20, 8 << 20] {
        let opts = SyncOptions {
            policy: Policy::uniform(spec("identity")),
            network: slow,
            bucket_cap_bytes: cap,
            ..Default::default()
        };
        let serial = SyncOptions {
            overlap: false,
            ..opts.clone()
        };
        let comm = measure(&layout, 4, slow, &serial, Duration::ZERO, reps);
        let backward = Duration::from_secs_f64(comm.step_s);
        let s = measure(&layout, 4, slow, &serial, backward, reps);
        let o = measure(&layout, 4, slow, &opts, backward, reps);
        let mut with_compute = comm.plan.clone();
        with_compute.remodel(&profs);
        println!(
            "\noverlap check, fp32 at 1 Gbit/s and 50 us, 4 ranks, {} MiB buckets ({} buckets): communication {:.0} ms (modelled {:.0}), backward {:.0} ms; step serial {:.0} ms, overlapped {:.0} ms (modelled {:.0}): {:.2}x (target at most 0.6x)",
            cap >> 20,
            comm.plan.buckets.len(),
            comm.step_s * 1e3,
            with_compute.modelled_s() * 1e3,
            backward.as_secs_f64() * 1e3,
            s.step_s * 1e3,
            o.step_s * 1e3,
            with_compute.modelled_overlap_s(backward.as_secs_f64(), &o.ready) * 1e3,
            o.step_s / s.step_s
        );
    }
}
