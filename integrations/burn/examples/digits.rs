//! Data-parallel training of a burn MLP on the digits data set, gradients synced through
//! gradpack, for several codecs: workers as threads over gradpack's in-process transport
//! with its link simulator, or (feature `mpi`, `--mpi`) as MPI ranks.
//!
//!     cargo run --release --example digits -- --workers 4 --bandwidth 1Gbit/s
//!     cargo build --release --features mpi --example digits
//!     mpirun -np 4 target/release/examples/digits --mpi
//!
//! Every worker's parameters are checked to be bit-identical after every step.

mod common;

use std::time::Duration;

use common::{Digits, RunConfig, WorkerResult};
use gradpack::collective::{Feedback, Transport, local};
use gradpack::sync::{Network, Policy, SyncOptions};

struct Args {
    workers: usize,
    steps: usize,
    hidden: usize,
    bandwidth: Option<f64>,
    latency_s: f64,
    codecs: Vec<String>,
    mpi: bool,
}

impl Args {
    /// Every configuration trains the same model from the same start.
    fn run_config(&self) -> RunConfig {
        RunConfig {
            hidden: self.hidden,
            steps: self.steps,
            batch: 32,
            lr: 0.05,
            seed: 7,
            checkpoint: false,
        }
    }
}

const CODECS: &str = "fp32,fp16,int8,topk-ef,sign-ef,auto";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        workers: 2,
        steps: 400,
        hidden: 1024,
        bandwidth: Some(1e9),
        latency_s: 50e-6,
        codecs: CODECS.split(',').map(String::from).collect(),
        mpi: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--workers" => a.workers = v()?.parse().map_err(|e| format!("--workers: {e}"))?,
            "--steps" => a.steps = v()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--hidden" => a.hidden = v()?.parse().map_err(|e| format!("--hidden: {e}"))?,
            "--bandwidth" => {
                let s = v()?;
                a.bandwidth = if s == "none" {
                    None
                } else {
                    Some(gradpack::cost::parse_bandwidth(&s)?)
                };
            }
            "--latency" => a.latency_s = gradpack::cost::parse_duration(&v()?)?,
            "--codecs" => a.codecs = v()?.split(',').map(String::from).collect(),
            "--mpi" => a.mpi = true,
            "--help" | "-h" => {
                println!(
                    "digits [--workers N] [--steps N] [--hidden N] [--bandwidth 1Gbit/s|none] \
                     [--latency 50us] [--codecs {CODECS}] [--mpi]"
                );
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {k}")),
        }
    }
    if a.workers == 0 || a.steps == 0 || a.hidden == 0 {
        return Err("--workers, --steps and --hidden must be at least 1".into());
    }
    Ok(a)
}

/// The engine options of a named configuration.
fn options(name: &str, net: Network) -> Result<SyncOptions, String> {
    let spec = |s: &str| s.parse::<gradpack::CodecSpec>().map_err(|e| e.to_string());
    let (policy, feedback) = match name {
        "fp32" => (Policy::uniform(spec("identity")?), Feedback::None),
        "fp16" => (Policy::with_rules(spec("fp16")?), Feedback::None),
        "int8" => (Policy::with_rules(spec("int8")?), Feedback::None),
        "topk-ef" => (
            Policy::with_rules(spec("topk:ratio=0.01,values=fp16")?),
            Feedback::Worker,
        ),
        "sign-ef" => (Policy::with_rules(spec("sign")?), Feedback::Worker),
        "auto" => (
            Policy::auto(vec![
                spec("identity")?,
                spec("fp16")?,
                spec("int8")?,
                spec("topk:ratio=0.01,values=fp16")?,
            ]),
            Feedback::Worker,
        ),
        _ => {
            return Err(format!(
                "unknown codec configuration {name}; one of {CODECS}"
            ));
        }
    };
    Ok(SyncOptions {
        policy,
        feedback,
        network: net,
        ..SyncOptions::default()
    })
}

fn report(name: &str, results: &[WorkerResult], steps: usize) -> Result<(), String> {
    let first = &results[0];
    for (r, w) in results.iter().enumerate().skip(1) {
        if let Some(s) = (0..steps).find(|&s| w.param_hashes[s] != first.param_hashes[s]) {
            return Err(format!(
                "{name}: worker {r} diverged from worker 0 at step {s}"
            ));
        }
    }
    let avg = |v: &[f32]| v.iter().sum::<f32>() / v.len().max(1) as f32;
    let k = steps.min(20);
    println!(
        "| {name} | {:.1}% | {:.3} -> {:.3} | {:.1} | {:.2} | identical |",
        100.0 * first.accuracy,
        avg(&first.losses[..k]),
        avg(&first.losses[steps - k..]),
        1e3 * results.iter().map(|r| r.step_s).fold(0.0, f64::max),
        first.bytes_sent as f64 / steps as f64 / 1e6,
    );
    Ok(())
}

fn header(a: &Args, world: usize, how: &str) {
    println!(
        "{world} workers ({how}), MLP 64-{h}-{h}-10, {} steps of batch 32 per worker",
        a.steps,
        h = a.hidden
    );
    println!(
        "| sync | test accuracy | loss, first -> last 20 steps | ms/step | MB sent/step/worker | parameters |"
    );
    println!("|---|---:|---|---:|---:|---|");
}

fn threads(a: &Args, d: &Digits) -> Result<(), String> {
    let net = Network {
        bandwidth_bit_s: a.bandwidth.unwrap_or(100e9),
        latency_s: a.latency_s,
    };
    let how = match a.bandwidth {
        Some(b) => format!("threads, simulated links of {:.3} Gbit/s", b / 1e9),
        None => "threads, no link simulator".into(),
    };
    header(a, a.workers, &how);
    let cfg = a.run_config();
    for name in &a.codecs {
        let opts = options(name, net)?;
        let res = local::run(a.workers, Some(Duration::from_secs(60)), |comm| {
            let rank = comm.rank();
            let mut t = comm.into_inner();
            if let Some(b) = a.bandwidth {
                t.set_link(Some(local::Link {
                    bandwidth_bit_s: b,
                    latency: Duration::from_secs_f64(a.latency_s),
                }));
            }
            common::worker(t, rank, a.workers, d, &cfg, opts.clone(), None)
                .map_err(|e| gradpack::Error::Collective(e.to_string()))
        });
        let res: Result<Vec<_>, _> = res.into_iter().collect();
        report(name, &res.map_err(|e| format!("{name}: {e}"))?, a.steps)?;
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn mpi(a: &Args, d: &Digits) -> Result<(), String> {
    use mpi::traits::*;
    let universe = mpi::initialize_with_threading(mpi::Threading::Serialized)
        .ok_or("MPI is already initialised")?
        .0;
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    if rank == 0 {
        header(a, size, "MPI ranks");
    }
    let net = Network {
        bandwidth_bit_s: a.bandwidth.unwrap_or(10e9),
        latency_s: a.latency_s,
    };
    let cfg = a.run_config();
    for name in &a.codecs {
        let t = gradpack::collective::mpi::MpiTransport::new(&world);
        let r = common::worker(t, rank, size, d, &cfg, options(name, net)?, None)
            .map_err(|e| format!("{name}: {e}"))?;
        // Rank 0 checks every rank's parameter hashes against its own.
        let mut all = vec![0u64; a.steps * size];
        world.all_gather_into(&r.param_hashes[..], &mut all[..]);
        let mut times = vec![0f64; size];
        world.all_gather_into(&r.step_s, &mut times[..]);
        if rank == 0 {
            let rows: Vec<WorkerResult> = (0..size)
                .map(|q| WorkerResult {
                    losses: r.losses.clone(),
                    param_hashes: all[q * a.steps..(q + 1) * a.steps].to_vec(),
                    accuracy: r.accuracy,
                    step_s: times[q],
                    bytes_sent: r.bytes_sent,
                    compressed_elements: r.compressed_elements,
                    checkpoint: None,
                })
                .collect();
            report(name, &rows, a.steps)?;
        }
    }
    Ok(())
}

fn main() {
    let run = || -> Result<(), String> {
        let a = parse()?;
        let d = common::digits();
        if a.mpi {
            #[cfg(feature = "mpi")]
            return mpi(&a, &d);
            #[cfg(not(feature = "mpi"))]
            return Err("--mpi needs the example built with --features mpi".into());
        }
        threads(&a, &d)
    };
    if let Err(e) = run() {
        eprintln!("digits: {e}");
        std::process::exit(2);
    }
}
