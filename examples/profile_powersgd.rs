//! A PowerSGD step loop for profilers: `perf record target/release/examples/profile_powersgd
//! [ROWS] [COLS] [RANK] [STEPS]` runs a one-rank sync engine with PowerSGD on one matrix of
//! the synthetic gradient and prints the time per step and the throughput.

use gradpack::collective::local;
use gradpack::sync::{Policy, PowerSgd, SyncEngine, SyncOptions, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let rows: usize = args.next().map_or(Ok(2048), |a| a.parse())?;
    let cols: usize = args.next().map_or(Ok(2048), |a| a.parse())?;
    let rank: usize = args.next().map_or(Ok(4), |a| a.parse())?;
    let steps: u32 = args.next().map_or(Ok(50), |a| a.parse())?;
    let x = gradpack::synthetic::gradient(rows * cols, 7);
    let layout = [Tensor::new("w", &[rows, cols])];
    let opts = SyncOptions {
        policy: Policy::powersgd(PowerSgd::rank(rank)),
        overlap: false,
        ..Default::default()
    };
    let secs = local::run(1, None, |comm| {
        let mut e = SyncEngine::new(&layout, comm.into_inner(), opts.clone())?;
        let start = std::time::Instant::now();
        for _ in 0..steps {
            e.ready(0, &x)?;
            e.finish()?;
        }
        Ok(start.elapsed().as_secs_f64() / f64::from(steps))
    })
    .remove(0)?;
    println!(
        "{rows} x {cols} at rank {rank}: {:.3} ms per step, {:.2} GB/s of f32 gradient",
        secs * 1e3,
        (rows * cols * 4) as f64 / secs / 1e9
    );
    Ok(())
}
