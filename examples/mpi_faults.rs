//! Faults in a compressed all-reduce over MPI: what each does to the job.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_faults
//! mpirun -np 4 target/release/examples/mpi_faults corrupt   # exits 0 if recovery held
//! mpirun -np 4 target/release/examples/mpi_faults panic     # the job must end, non-zero
//! mpirun -np 4 target/release/examples/mpi_faults leave     # the job must end, non-zero
//! ```
//!
//! - `corrupt`: rank 1 flips a payload byte of the first message it sends. Every rank
//!   runs 5 steps of a 4-bit QSGD ring all-reduce on the same `Comm`, calling
//!   `reset_feedback` after an error, and checks each step that returns `Ok` against the
//!   same step run fault-free before (bit for bit). Exits 0 if no rank ever returned a
//!   wrong `Ok` and every rank's last two steps succeeded, 1 otherwise.
//! - `panic`: rank 1 panics in the middle of the all-reduce. Its `MpiTransport` aborts
//!   the job as it unwinds, so `mpirun` ends at once with a non-zero status.
//! - `leave`: rank 1 returns from `main` before the all-reduce. The other ranks time out
//!   (after 2 s here) with an error naming a peer and exit non-zero, so the job ends.

use std::process::ExitCode;
use std::time::Duration;

use gradpack::collective::mpi::MpiTransport;
use gradpack::collective::{
    AllReduce, AllReduceOptions, Comm, Strategy, StrategyChoice, Transport,
};
use gradpack::{CodecSpec, Result};
use mpi::collective::SystemOperation;
use mpi::traits::*;

const USAGE: &str = "usage: mpirun -np P mpi_faults corrupt|panic|leave (P >= 2)";

/// A transport whose `at`-th send goes through `fault`.
struct Faulty<F: FnMut(&mut Vec<u8>)> {
    inner: MpiTransport,
    sends: u64,
    at: u64,
    fault: F,
}

impl<F: FnMut(&mut Vec<u8>)> Transport for Faulty<F> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        match self.damaged(msg) {
            Some(m) => self.inner.send(&m, to),
            None => self.inner.send(msg, to),
        }
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        self.inner.recv(buf, from, max)
    }
    fn send_recv(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        max: usize,
    ) -> Result<()> {
        match self.damaged(send) {
            Some(m) => self.inner.send_recv(&m, to, recv, from, max),
            None => self.inner.send_recv(send, to, recv, from, max),
        }
    }
}

impl<F: FnMut(&mut Vec<u8>)> Faulty<F> {
    /// The message to send instead of `msg`, if this send is the faulty one.
    fn damaged(&mut self, msg: &[u8]) -> Option<Vec<u8>> {
        let i = self.sends;
        self.sends += 1;
        (i == self.at).then(|| {
            let mut m = msg.to_vec();
            (self.fault)(&mut m);
            m
        })
    }
}

const STEPS: u64 = 5;

fn main() -> ExitCode {
    let Some(universe) = mpi::initialize() else {
        eprintln!("mpi_faults: MPI could not be initialised");
        return ExitCode::FAILURE;
    };
    let world = universe.world();
    let (rank, p) = (world.rank() as usize, world.size() as usize);
    let mode = std::env::args().nth(1).unwrap_or_default();
    if !matches!(mode.as_str(), "corrupt" | "panic" | "leave") || p < 2 {
        if rank == 0 {
            println!("{USAGE}");
        }
        let help = matches!(mode.as_str(), "--help" | "-h");
        return if help {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    let n = 100_003;
    let codec: CodecSpec = "qsgd:bits=4".parse().expect("spec");
    let opts = AllReduceOptions {
        strategy: StrategyChoice::Forced(Strategy::CompressedRing),
        ..Default::default()
    };
    let grad = gradpack::synthetic::gradient(n, 5 + rank as u64);
    let mut transport = MpiTransport::new(&world);
    transport.set_timeout(Some(Duration::from_secs(2)));
    let mut ar = match AllReduce::new(codec, n, &transport, opts) {
        Ok(ar) => ar,
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            return ExitCode::FAILURE;
        }
    };

    match mode.as_str() {
        "panic" | "leave" => {
            let mut comm = Comm::new(Faulty {
                inner: transport,
                sends: 0,
                at: if rank == 1 && mode == "panic" {
                    1
                } else {
                    u64::MAX
                },
                fault: |_: &mut Vec<u8>| panic!("rank 1 panics in the middle of an all-reduce"),
            });
            if rank == 1 && mode == "leave" {
                eprintln!("rank 1 returns from main before the all-reduce");
                return ExitCode::SUCCESS;
            }
            let mut out = vec![0f32; n];
            match ar.run(&mut comm, &grad, &mut out, 1) {
                Ok(_) => {
                    eprintln!("rank {rank}: the all-reduce succeeded without rank 1");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("rank {rank}: {e}");
                    ExitCode::from(3)
                }
            }
        }
        _ => {
            // The fault-free run first, for reference.
            let mut comm = Comm::new(transport);
            let mut clean = Vec::new();
            for step in 0..STEPS {
                let mut out = vec![0f32; n];
                if let Err(e) = ar.run(&mut comm, &grad, &mut out, 100 + step) {
                    eprintln!("rank {rank}: fault-free step {step}: {e}");
                    return ExitCode::FAILURE;
                }
                clean.push(out);
            }
            let mut comm = Comm::new(Faulty {
                inner: comm.into_inner(),
                sends: 0,
                at: if rank == 1 { 0 } else { u64::MAX },
                fault: |m: &mut Vec<u8>| {
                    let i = m.len() - 9;
                    m[i] ^= 0x20;
                },
            });
            let (mut wrong, mut errors, mut late_errors) = (0u64, 0u64, 0u64);
            for step in 0..STEPS {
                let mut out = vec![0f32; n];
                match ar.run(&mut comm, &grad, &mut out, 100 + step) {
                    Ok(_) => {
                        let same = out
                            .iter()
                            .zip(&clean[step as usize])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        wrong += u64::from(!same);
                    }
                    Err(e) => {
                        eprintln!("rank {rank} step {step}: {e}");
                        ar.reset_feedback();
                        errors += 1;
                        late_errors += u64::from(step >= STEPS - 2);
                    }
                }
            }
            let sum = |v: u64| {
                let mut s = 0u64;
                world.all_reduce_into(&v, &mut s, SystemOperation::sum());
                s
            };
            let (wrong, errors, late) = (sum(wrong), sum(errors), sum(late_errors));
            let ok = wrong == 0 && late == 0 && errors > 0;
            if rank == 0 {
                println!(
                    "corrupted first message of rank 1, {p} ranks x {STEPS} steps: {errors} errors, \
                     {wrong} wrong Ok results, {late} errors in the last two steps: {}",
                    if ok { "recovered" } else { "FAILED" }
                );
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
