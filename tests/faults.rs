//! Collectives after a fault: one rank's transport fails a send, loses a message,
//! corrupts one, sends one twice, stalls past the timeout, or fails a receive; every rank
//! then follows the documented recovery (on an error, `reset_feedback` and go on to the
//! next step on the same `Comm`). Checked on every rank and step: a step that returns
//! `Ok` holds exactly the sum a fault-free world computes (bit for bit), never a wrong
//! sum, and the world is back to `Ok` on every rank within a step or two.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use gradpack::collective::{
    AllReduce, AllReduceOptions, Comm, ENVELOPE_LEN, ENVELOPE_VERSION, Feedback, ReduceOp,
    Strategy, StrategyChoice, Transport, local,
};
use gradpack::{CodecSpec, Error, Result};

/// What the faulty rank's transport does to its `at`-th send (or receive).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// The send returns an error and sends nothing.
    FailSend,
    /// The send reports success and the message is lost.
    Lose,
    /// One payload byte of the frame is flipped.
    CorruptPayload,
    /// One byte of the frame's header is flipped.
    CorruptHeader,
    /// The message is sent twice.
    Duplicate,
    /// The sender sleeps for this long first (longer than the receive timeout).
    Stall(Duration),
    /// The receive returns an error without taking the message.
    FailRecv,
}

struct Injector {
    inner: local::Local,
    fault: Option<(Fault, u64)>,
    sends: u64,
    recvs: u64,
}

impl Transport for Injector {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        let i = self.sends;
        self.sends += 1;
        let fault = match self.fault {
            Some((f, at)) if at == i && f != Fault::FailRecv => f,
            _ => return self.inner.send(msg, to),
        };
        match fault {
            Fault::FailSend => Err(Error::Transport {
                peer: to,
                reason: "injected send failure".into(),
            }),
            Fault::Lose => Ok(()),
            Fault::CorruptPayload | Fault::CorruptHeader => {
                let mut m = msg.to_vec();
                let at = if fault == Fault::CorruptHeader {
                    ENVELOPE_LEN + 24
                } else {
                    m.len() - 6
                };
                m[at] ^= 0x08;
                self.inner.send(&m, to)
            }
            Fault::Duplicate => {
                self.inner.send(msg, to)?;
                self.inner.send(msg, to)
            }
            Fault::Stall(d) => {
                std::thread::sleep(d);
                self.inner.send(msg, to)
            }
            Fault::FailRecv => unreachable!(),
        }
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        let i = self.recvs;
        self.recvs += 1;
        if self.fault == Some((Fault::FailRecv, i)) {
            return Err(Error::Transport {
                peer: from,
                reason: "injected receive failure".into(),
            });
        }
        self.inner.recv(buf, from, max)
    }
    // Local's send never blocks, so send-then-receive is its exchange too.
}

const STEPS: u64 = 6;
/// The receive timeout: long enough that a fault-free exchange never reaches it (under
/// qemu, for the NEON build, everything is many times slower), short enough that the
/// scenarios that wait for it run in seconds.
const TIMEOUT: Duration = if cfg!(target_arch = "x86_64") {
    Duration::from_millis(250)
} else {
    Duration::from_millis(1500)
};

/// One world at a time in this binary: the tests run in parallel threads, and on a
/// machine with few cores several 4-rank worlds at once could make a fault-free
/// exchange reach the timeout.
static ONE_WORLD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_world() -> std::sync::MutexGuard<'static, ()> {
    ONE_WORLD.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every rank's result of every step, rank `faulty` injecting `fault`.
fn world(
    codec: CodecSpec,
    o: &AllReduceOptions,
    inputs: &[Vec<f32>],
    fault: Option<(usize, Fault, u64)>,
) -> Vec<Vec<Result<Vec<f32>>>> {
    let n = inputs[0].len();
    let _one = one_world();
    let res = local::run(inputs.len(), Some(TIMEOUT), |t| {
        let rank = t.rank();
        let mut ar = AllReduce::new(codec, n, &t, o.clone())?;
        let mut comm = Comm::new(Injector {
            inner: t.into_inner(),
            fault: fault.filter(|f| f.0 == rank).map(|f| (f.1, f.2)),
            sends: 0,
            recvs: 0,
        });
        let mut steps = Vec::new();
        for step in 0..STEPS {
            let mut out = vec![f32::NAN; n];
            let r = ar.run(&mut comm, &inputs[rank], &mut out, 40 + step);
            if r.is_err() {
                ar.reset_feedback();
            }
            steps.push(r.map(|_| out));
        }
        Ok(steps)
    });
    res.into_iter().map(|r| r.expect("rank setup")).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Checks one scenario; returns how many (rank, step) pairs failed.
fn check(what: &str, got: &[Vec<Result<Vec<f32>>>], clean: &[Vec<Result<Vec<f32>>>]) -> usize {
    let mut errors = 0;
    for (r, steps) in got.iter().enumerate() {
        for (s, res) in steps.iter().enumerate() {
            match res {
                Ok(out) => {
                    let want = clean[r][s].as_ref().expect("clean run");
                    assert!(
                        bits(out) == bits(want),
                        "{what}: rank {r} step {s} returned Ok with a wrong sum"
                    );
                }
                Err(_) => errors += 1,
            }
        }
        // Back in step: the last two steps succeed everywhere.
        for (s, step) in steps.iter().enumerate().skip(STEPS as usize - 2) {
            assert!(
                step.is_ok(),
                "{what}: rank {r} step {s} still fails: {:?}",
                step.as_ref().err()
            );
        }
    }
    errors
}

/// Codec, strategy and ring pieces of each scenario family.
fn strategies() -> Vec<(&'static str, Strategy, usize)> {
    vec![
        ("qsgd:bits=4,block=64", Strategy::CompressedRing, 1),
        ("int8:rounding=stochastic", Strategy::CompressedAllGather, 1),
        ("sign:block=32", Strategy::SignMajority, 1),
        ("identity", Strategy::Fp32Ring, 1),
        ("topk:ratio=0.1", Strategy::CompressedRing, 1),
        ("int8:rounding=stochastic", Strategy::CompressedRing, 3),
        ("int8:rounding=stochastic", Strategy::TwoShot, 1),
        ("topk:ratio=0.1", Strategy::TwoShot, 2),
    ]
}

#[test]
fn every_fault_ends_in_correct_sums_or_errors_never_a_wrong_ok() {
    let (p, n) = (4, 301);
    let inputs: Vec<Vec<f32>> = (0..p).map(|r| sample(n, 500 + r as u32)).collect();
    let faults = [
        Fault::FailSend,
        Fault::Lose,
        Fault::CorruptPayload,
        Fault::CorruptHeader,
        Fault::Duplicate,
        Fault::FailRecv,
    ];
    let total = AtomicU64::new(0);
    for (spec, s, pieces) in strategies() {
        let codec: CodecSpec = spec.parse().unwrap();
        let o = AllReduceOptions {
            strategy: StrategyChoice::Forced(s),
            pieces,
            ..Default::default()
        };
        let clean = world(codec, &o, &inputs, None);
        assert!(clean.iter().flatten().all(Result::is_ok));
        // Messages per call per rank: 2 (p - 1) in a ring, p - 1 in an all-gather; faults
        // in the first call, the middle of it, and in the second.
        for fault in faults {
            for at in [0, 2, 7] {
                let what = format!("{spec} {} x{pieces} {fault:?} at message {at}", s.name());
                let got = world(codec, &o, &inputs, Some((1, fault, at)));
                let errors = check(&what, &got, &clean);
                // A duplicate is stale when it arrives and is dropped: no harm, no error.
                if fault != Fault::Duplicate {
                    assert!(errors > 0, "{what}: the fault went unnoticed");
                }
                total.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    assert_eq!(total.into_inner(), 8 * 6 * 3);
}

#[test]
fn a_damaged_message_in_either_shot_of_the_two_shot_fails_the_call_and_the_next_is_whole() {
    // Rank 1 of 4 sends 3 messages per shot in its first call: message 1 is of the
    // scatter (to rank 3), message 4 of the gather (to rank 3 too). The receiver names
    // rank 1; no rank returns a wrong sum (a rank either fails or holds the clean sum);
    // the second call is whole on every rank.
    let (p, n) = (4, 1001);
    let inputs: Vec<Vec<f32>> = (0..p).map(|r| sample(n, 700 + r as u32)).collect();
    let codec: CodecSpec = "int8".parse().unwrap();
    let o = AllReduceOptions {
        strategy: StrategyChoice::Forced(Strategy::TwoShot),
        ..Default::default()
    };
    let clean = world(codec, &o, &inputs, None);
    for at in [1, 4] {
        let what = format!("two-shot, message {at} damaged");
        let got = world(codec, &o, &inputs, Some((1, Fault::CorruptPayload, at)));
        check(&what, &got, &clean);
        match &got[3][0] {
            Err(Error::Peer { peer: 1, .. }) => {}
            other => panic!("{what}: rank 3 got {:?}", other.as_ref().map(|_| ())),
        }
        for (r, steps) in got.iter().enumerate() {
            assert!(steps[1].is_ok(), "{what}: rank {r}'s second call failed");
        }
    }
}

#[test]
fn a_stall_past_the_timeout_ends_in_correct_sums() {
    let (p, n) = (4, 257);
    let inputs: Vec<Vec<f32>> = (0..p).map(|r| sample(n, 900 + r as u32)).collect();
    for (spec, s, pieces) in strategies() {
        let codec: CodecSpec = spec.parse().unwrap();
        let o = AllReduceOptions {
            strategy: StrategyChoice::Forced(s),
            pieces,
            ..Default::default()
        };
        let clean = world(codec, &o, &inputs, None);
        for at in [0, 3] {
            let what = format!("{spec} {} stall at message {at}", s.name());
            let stall = Fault::Stall(TIMEOUT * 5 / 2);
            let got = world(codec, &o, &inputs, Some((2, stall, at)));
            check(&what, &got, &clean);
        }
    }
}

#[test]
fn error_feedback_recovers_after_a_fault() {
    // With residuals at every encode (WorkerAndOwner), a step that succeeds on every rank
    // loses nothing: sum over ranks of (input + residual before) = output + sum over
    // ranks of residual after, to f32 rounding. A stale frame summed in breaks it.
    let (p, n) = (4, 2048);
    let inputs: Vec<Vec<f32>> = (0..p)
        .map(|r| gradpack::synthetic::gradient(n, 77 + r as u64))
        .collect();
    for s in [
        Strategy::CompressedRing,
        Strategy::CompressedAllGather,
        Strategy::TwoShot,
    ] {
        let codec: CodecSpec = "int8:block=64".parse().unwrap();
        let o = AllReduceOptions {
            op: ReduceOp::Sum,
            strategy: StrategyChoice::Forced(s),
            feedback: Feedback::WorkerAndOwner,
            ..Default::default()
        };
        for fault in [
            None,
            Some(Fault::FailSend),
            Some(Fault::CorruptPayload),
            Some(Fault::Lose),
        ] {
            let what = format!("{} {fault:?}", s.name());
            let _one = one_world();
            let res = local::run(p, Some(TIMEOUT), |t| {
                let rank = t.rank();
                let mut ar = AllReduce::new(codec, n, &t, o.clone())?;
                let mut comm = Comm::new(Injector {
                    inner: t.into_inner(),
                    fault: fault.filter(|_| rank == 0).map(|f| (f, 1)),
                    sends: 0,
                    recvs: 0,
                });
                // Per step: Ok(output) or the error, and the residual after it.
                let mut steps = Vec::new();
                for step in 0..STEPS {
                    let mut out = vec![0.0; n];
                    let r = ar.run(&mut comm, &inputs[rank], &mut out, 9 + step);
                    if r.is_err() {
                        ar.reset_feedback();
                    }
                    steps.push((r.is_ok(), out, ar.residual_f32()));
                }
                Ok(steps)
            });
            let ranks: Vec<_> = res.into_iter().map(|r| r.expect("setup")).collect();
            let mut checked = 0;
            for st in 0..STEPS as usize {
                if !ranks.iter().all(|steps| steps[st].0) {
                    continue;
                }
                checked += 1;
                let out = &ranks[0][st].1;
                for i in 0..n {
                    let (mut lhs, mut rhs, mut mag) = (0f64, f64::from(out[i]), 0f64);
                    for (r, steps) in ranks.iter().enumerate() {
                        let before = if st == 0 { 0.0 } else { steps[st - 1].2[i] };
                        let after = steps[st].2[i];
                        lhs += f64::from(inputs[r][i]) + f64::from(before);
                        rhs += f64::from(after);
                        mag += f64::from(inputs[r][i].abs()) + f64::from(before.abs());
                    }
                    assert!(
                        (lhs - rhs).abs() <= 1e-5 * mag + 1e-30,
                        "{what}: step {st} element {i}: {lhs} vs {rhs}"
                    );
                }
            }
            assert!(
                checked >= STEPS as usize - 2,
                "{what}: only {checked} whole steps"
            );
        }
    }
}

#[test]
fn collectives_of_another_tag_are_refused() {
    // Rank 2 runs bucket 1 where the others run bucket 0: a misrouted message.
    let n = 100;
    let res = local::run(3, Some(Duration::from_secs(5)), |mut t| {
        let o = AllReduceOptions {
            tag: u32::from(t.rank() == 2),
            ..Default::default()
        };
        let mut ar = AllReduce::new("fp16".parse::<CodecSpec>()?, n, &t, o)?;
        ar.run(&mut t, &vec![1.0; n], &mut vec![0.0; n], 0)
    });
    assert!(
        res.iter()
            .any(|r| matches!(r, Err(Error::Peer { source, .. })
            if matches!(**source, Error::Misplaced(ref m) if m.contains("tag")))),
        "{res:?}"
    );
}

#[test]
fn a_frame_of_another_step_or_chunk_is_refused() {
    // Rank 1 replays, in the second call, a frame it sent in the first (fresh envelope,
    // old frame): the seed in the frame's header gives it away.
    struct Replay {
        inner: local::Local,
        first: Vec<Vec<u8>>,
        sends: usize,
    }
    impl Transport for Replay {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn size(&self) -> usize {
            self.inner.size()
        }
        fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
            let i = self.sends;
            self.sends += 1;
            if i < 2 {
                self.first.push(msg.to_vec());
                return self.inner.send(msg, to);
            }
            // The second call's first message: its envelope with the first call's frame.
            if i == 2 {
                let mut m = msg[..ENVELOPE_LEN].to_vec();
                m.extend_from_slice(&self.first[0][ENVELOPE_LEN..]);
                return self.inner.send(&m, to);
            }
            self.inner.send(msg, to)
        }
        fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
            self.inner.recv(buf, from, max)
        }
    }
    let n = 64;
    let codec: CodecSpec = "int8:rounding=stochastic".parse().unwrap();
    let res = local::run(2, Some(Duration::from_secs(5)), |t| {
        let rank = t.rank();
        let o = AllReduceOptions {
            strategy: StrategyChoice::Forced(Strategy::CompressedRing),
            ..Default::default()
        };
        let mut ar = AllReduce::new(codec, n, &t, o)?;
        let x = sample(n, 3 + rank as u32);
        let mut out = vec![0.0; n];
        let mut comm = Comm::new(Replay {
            inner: t.into_inner(),
            first: Vec::new(),
            sends: 0,
        });
        let mut results = Vec::new();
        for seed in [1, 2] {
            results.push(ar.run(&mut comm, &x, &mut out, seed).map(|_| ()));
        }
        Ok(results)
    });
    let rank0 = res[0].as_ref().unwrap();
    assert!(rank0[0].is_ok());
    match &rank0[1] {
        // The envelope's CRC covers the frame: the old frame under the new envelope
        // fails it before the frame's seed is even read.
        Err(Error::Peer {
            peer: 1, source, ..
        }) => assert!(
            matches!(**source, Error::Misplaced(ref m) if m.contains("damaged message")),
            "{source}"
        ),
        other => panic!("{other:?}"),
    }
}

/// What the relabelling rank does to the second call's first message.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Relabel {
    /// Sends the first call's first message with its envelope's call number and CRC
    /// rewritten, the CRC over the envelope alone (what version 1 covered).
    EnvelopeOnly,
    /// Sends the first call's first message with its call number rewritten, the version
    /// byte at version 1's 0 and the CRC-32C recomputed over envelope and frame.
    OldVersion,
    /// Sends the second call's envelope with the first call's frame behind it.
    Splice,
}

struct Relabeller {
    inner: local::Local,
    how: Relabel,
    first: Option<Vec<u8>>,
    sends: usize,
    per_call: usize,
}

impl Transport for Relabeller {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        let i = self.sends;
        self.sends += 1;
        if i == 0 {
            self.first = Some(msg.to_vec());
        }
        if i != self.per_call {
            return self.inner.send(msg, to);
        }
        let old = self.first.clone().expect("the first call's message");
        let m = match self.how {
            Relabel::Splice => {
                let mut m = msg[..ENVELOPE_LEN].to_vec();
                m.extend_from_slice(&old[ENVELOPE_LEN..]);
                m
            }
            Relabel::EnvelopeOnly | Relabel::OldVersion => {
                let mut m = old;
                m[8..16].copy_from_slice(&msg[8..16]); // the second call's number
                let crc = if self.how == Relabel::EnvelopeOnly {
                    crc32fast::hash(&m[0..32])
                } else {
                    m[29] = 0;
                    crc32c::crc32c_append(crc32c::crc32c(&m[0..32]), &m[ENVELOPE_LEN..])
                };
                m[32..36].copy_from_slice(&crc.to_le_bytes());
                m
            }
        };
        self.inner.send(&m, to)
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        self.inner.recv(buf, from, max)
    }
}

#[test]
fn a_relabelled_message_fails_the_call_for_every_codec() {
    // Rank 1 sends, in the second call, its first call's first message under the second
    // call's number (three ways), the data differing between calls. Every codec (those
    // whose frames record no seed too), by the ring and the all-gather: the rank
    // receiving it gets an error naming rank 1; any rank that completes that call holds
    // the clean world's sum, never a wrong one; the third call on the same Comm is
    // whole again on every rank.
    assert_eq!(ENVELOPE_VERSION, 2);
    let n = 300;
    for spec in specs() {
        for strategy in [
            Strategy::CompressedRing,
            Strategy::CompressedAllGather,
            Strategy::TwoShot,
        ] {
            let reencodes = matches!(strategy, Strategy::CompressedRing | Strategy::TwoShot);
            if reencodes && spec.to_string().contains("scale=unbiased") {
                continue; // refused by the ring and the two-shot
            }
            for how in [Relabel::EnvelopeOnly, Relabel::OldVersion, Relabel::Splice] {
                let o = AllReduceOptions {
                    strategy: StrategyChoice::Forced(strategy),
                    ..Default::default()
                };
                let clean = local::run(3, Some(Duration::from_secs(5)), |mut t| {
                    let mut ar = AllReduce::new(spec, n, &t, o.clone())?;
                    let mut outs = Vec::new();
                    for seed in [1, 2, 3] {
                        let x = sample(n, 40 + t.rank() as u32 + 10 * seed as u32);
                        let mut out = vec![0.0; n];
                        ar.run(&mut t, &x, &mut out, seed)?;
                        outs.push(out);
                    }
                    Ok(outs)
                });
                let res = local::run(3, Some(Duration::from_secs(5)), |t| {
                    let rank = t.rank();
                    let mut ar = AllReduce::new(spec, n, &t, o.clone())?;
                    // Messages rank 1 sends per call (to its right neighbour).
                    let per_call = match strategy {
                        Strategy::CompressedRing | Strategy::TwoShot => 2 * (3 - 1),
                        _ => 3 - 1,
                    };
                    let mut comm = Comm::new(Relabeller {
                        inner: t.into_inner(),
                        how: if rank == 1 { how } else { Relabel::Splice },
                        first: None,
                        sends: 0,
                        per_call: if rank == 1 { per_call } else { usize::MAX },
                    });
                    let mut results = Vec::new();
                    let mut out = vec![0.0; n];
                    for seed in [1, 2, 3] {
                        // Other data every call, so the first call's frame is not the
                        // second's (were they equal, the relabelled message would be true).
                        let x = sample(n, 40 + rank as u32 + 10 * seed as u32);
                        results.push(ar.run(&mut comm, &x, &mut out, seed).map(|_| out.clone()));
                    }
                    Ok(results)
                });
                let what = format!("{spec} by {strategy:?}, {how:?}");
                // Rank 2 receives rank 1's messages.
                let rank2 = res[2].as_ref().unwrap();
                match &rank2[1] {
                    Err(Error::Peer {
                        peer: 1, source, ..
                    }) => assert!(
                        matches!(**source, Error::Misplaced(ref m)
                            if m.contains("damaged message") || m.contains("version 0")),
                        "{what}: {source}"
                    ),
                    other => panic!("{what}: rank 2's second call gave {other:?}"),
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for (r, rank) in res.iter().enumerate() {
                    let rank = rank.as_ref().unwrap();
                    let want = clean[r].as_ref().unwrap();
                    for call in 0..3 {
                        match &rank[call] {
                            // Whatever completes holds the clean world's sum: a rank that
                            // never used the relabelled message (its sender, say).
                            Ok(out) => assert_eq!(
                                bits(out),
                                bits(&want[call]),
                                "{what}: rank {r} call {call} completed with another sum"
                            ),
                            Err(e) => assert_eq!(call, 1, "{what}: rank {r} call {call}: {e}"),
                        }
                    }
                }
            }
        }
    }
}
