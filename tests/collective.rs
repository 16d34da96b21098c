//! Compressed collectives on the in-process transport: bit-identical results on every
//! rank and equal to a sequential reference built from the plain codec API; the error
//! against an exact sum within `collective::error_bound`; the error-feedback sum
//! invariant; lengths 0, below, at and above the world size; faults (corrupt, truncated
//! and foreign frames, a silent peer, a peer that leaves) as errors naming the peer.

mod common;

use std::time::Duration;

use common::*;
use gradpack::collective::{
    AllReduce, AllReduceOptions, Comm, ENVELOPE_LEN, Feedback, ReduceOp, Stats, Strategy,
    StrategyChoice, Transport, chunk_range, error_bound, local, rank_seed,
};
use gradpack::{
    Codec, CodecSpec, EncodeCtx, Error, ErrorFeedback, FeedbackOptions, ResidualPrecision, Result,
};

const STRATEGIES: [Strategy; 5] = [
    Strategy::CompressedRing,
    Strategy::CompressedAllGather,
    Strategy::SignMajority,
    Strategy::Fp32Ring,
    Strategy::TwoShot,
];

fn opts(strategy: Strategy, op: ReduceOp, feedback: Feedback) -> AllReduceOptions {
    AllReduceOptions {
        op,
        strategy: StrategyChoice::Forced(strategy),
        feedback,
        ..Default::default()
    }
}

/// Rank `r`'s input: distinct data per rank, scales varying along the tensor, all within
/// fp16 range (so every codec's bound is finite).
fn input(n: usize, rank: usize) -> Vec<f32> {
    sample(n, 1000 + rank as u32)
        .into_iter()
        .map(|x| if x.abs() > 1e3 { x * 1e-36 } else { x })
        .collect()
}

/// One rank's outputs of every step, its last stats, and its residual after the last step.
type RankRun = (Vec<Vec<f32>>, Stats, Vec<f32>);

/// A way to damage a message.
type Damage = fn(&mut Vec<u8>);

/// Run `steps` all-reduces of `inputs` on an in-process world; per rank, the outputs of
/// every step and the last stats.
fn run_world(
    codec: CodecSpec,
    o: &AllReduceOptions,
    inputs: &[Vec<f32>],
    steps: u64,
) -> Vec<Result<RankRun>> {
    run_world_by(codec, o, inputs, steps, false)
}

/// [`run_world`] through `run`, or (`in_place`) through `run_in_place` on a copy of each
/// rank's input.
fn run_world_by(
    codec: CodecSpec,
    o: &AllReduceOptions,
    inputs: &[Vec<f32>],
    steps: u64,
    in_place: bool,
) -> Vec<Result<RankRun>> {
    let n = inputs[0].len();
    local::run(inputs.len(), Some(Duration::from_secs(30)), |mut t| {
        let mut ar = AllReduce::new(codec, n, &t, o.clone())?;
        let x = &inputs[t.rank()];
        let mut outs = Vec::new();
        let mut stats = None;
        for step in 0..steps {
            let out = if in_place {
                let mut data = x.clone();
                stats = Some(ar.run_in_place(&mut t, &mut data, 11 + step)?);
                data
            } else {
                let mut out = vec![f32::NAN; n];
                stats = Some(ar.run(&mut t, x, &mut out, 11 + step)?);
                out
            };
            outs.push(out);
        }
        Ok((outs, stats.unwrap(), ar.residual_f32()))
    })
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The sequential definition of one step without error feedback, from the codec API.
fn reference(
    codec: &CodecSpec,
    s: Strategy,
    op: ReduceOp,
    inputs: &[Vec<f32>],
    seed: u64,
) -> Vec<f32> {
    let (p, n) = (inputs.len(), inputs[0].len());
    let codec = if s == Strategy::Fp32Ring {
        "identity".parse().unwrap()
    } else {
        *codec
    };
    let ctx = |r: usize, off: usize| EncodeCtx {
        seed: rank_seed(&codec, seed, r),
        offset: off as u64,
    };
    let mut out = vec![0.0f32; n];
    match s {
        Strategy::CompressedRing | Strategy::Fp32Ring => {
            for c in 0..p {
                let range = chunk_range(n, p, c);
                // Chunk c starts at rank c+1 and travels right, ending at its owner c.
                let first = (c + 1) % p;
                let mut frame = codec
                    .encode(&inputs[first][range.clone()], &ctx(first, range.start))
                    .unwrap();
                for h in 1..p {
                    let q = (c + 1 + h) % p;
                    let mut acc = inputs[q][range.clone()].to_vec();
                    codec.decode_add(&frame, &mut acc).unwrap();
                    frame = codec.encode(&acc, &ctx(q, range.start)).unwrap();
                }
                codec.decode_into(&frame, &mut out[range]).unwrap();
            }
        }
        Strategy::CompressedAllGather => {
            for (r, x) in inputs.iter().enumerate() {
                let frame = codec.encode(x, &ctx(r, 0)).unwrap();
                if r == 0 {
                    codec.decode_into(&frame, &mut out).unwrap();
                } else {
                    codec.decode_add(&frame, &mut out).unwrap();
                }
            }
        }
        Strategy::TwoShot => {
            for c in 0..p {
                let range = chunk_range(n, p, c);
                // The owner c's own input, then the others' frames in rank order.
                let mut acc = inputs[c][range.clone()].to_vec();
                for q in (0..p).filter(|&q| q != c) {
                    let frame = codec
                        .encode(&inputs[q][range.clone()], &ctx(q, range.start))
                        .unwrap();
                    codec.decode_add(&frame, &mut acc).unwrap();
                }
                let frame = codec.encode(&acc, &ctx(c, range.start)).unwrap();
                codec.decode_into(&frame, &mut out[range]).unwrap();
            }
        }
        Strategy::SignMajority => {
            let mut votes = vec![0i32; n];
            for (r, x) in inputs.iter().enumerate() {
                let d = codec.decode(&codec.encode(x, &ctx(r, 0)).unwrap()).unwrap();
                for i in 0..n {
                    votes[i] += (d[i] > 0.0) as i32 - (d[i] < 0.0) as i32;
                    out[i] += d[i].abs();
                }
            }
            for i in 0..n {
                out[i] = match votes[i].signum() {
                    1 => out[i],
                    -1 => -out[i],
                    _ => out[i] * 0.0,
                };
            }
        }
    }
    if op == ReduceOp::Mean && p > 1 {
        out.iter_mut().for_each(|x| *x /= p as f32);
    }
    out
}

/// The ring refuses random-k with `scale=unbiased` (it would rescale at every hop).
fn refused(codec: &CodecSpec, s: Strategy) -> bool {
    let w = local::Local::world(2);
    match AllReduce::new(*codec, 10, &w[0], opts(s, ReduceOp::Sum, Feedback::None)) {
        Ok(_) => false,
        Err(e) => {
            assert!(
                matches!(s, Strategy::CompressedRing | Strategy::TwoShot)
                    && codec.to_string().contains("scale=unbiased"),
                "{codec} {}: {e}",
                s.name()
            );
            true
        }
    }
}

fn collective_specs() -> Vec<CodecSpec> {
    let mut v = specs();
    v.push("qsgd:bits=4,block=7".parse().unwrap());
    v
}

#[test]
fn every_rank_identical_and_equal_to_sequential_reference() {
    let specs = collective_specs();
    for p in [1usize, 2, 3, 5, 8, 16] {
        let mut lens = vec![0, 1, p.saturating_sub(1), p + 1, 1000, 4099];
        lens.sort_unstable();
        lens.dedup();
        for &n in &lens {
            let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(n, r)).collect();
            for codec in &specs {
                for s in STRATEGIES {
                    // The 16-rank world runs every strategy on a few codecs only.
                    if p == 16
                        && !["int8:block=64", "topk:ratio=0.1,values=f32", "sign:block=3"]
                            .contains(&codec.to_string().as_str())
                    {
                        continue;
                    }
                    if refused(codec, s) {
                        continue;
                    }
                    let op = if n % 2 == 0 {
                        ReduceOp::Sum
                    } else {
                        ReduceOp::Mean
                    };
                    let res = run_world(*codec, &opts(s, op, Feedback::None), &inputs, 1);
                    let want = bits(&reference(codec, s, op, &inputs, 11));
                    for (r, res) in res.into_iter().enumerate() {
                        let (outs, stats, _) = res.unwrap_or_else(|e| {
                            panic!("{codec} {} p={p} n={n} rank {r}: {e}", s.name())
                        });
                        assert_eq!(stats.strategy, s);
                        assert!(
                            bits(&outs[0]) == want,
                            "{codec} {} p={p} n={n}: rank {r} differs from the reference",
                            s.name()
                        );
                        let msgs = match s {
                            Strategy::CompressedRing | Strategy::Fp32Ring | Strategy::TwoShot => {
                                2 * (p - 1)
                            }
                            _ => p - 1,
                        };
                        assert_eq!(stats.messages, msgs as u64);
                    }
                }
            }
        }
    }
}

/// With the entropy stage, every strategy sums to the bits of the plain codec's sum, on
/// every rank, with error feedback too.
#[test]
fn the_entropy_stage_sums_to_the_bits_of_the_plain_codec() {
    let p = 3;
    let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(4099, r)).collect();
    for staged in specs().into_iter().filter(|c| c.entropy()) {
        let plain = staged.with_entropy(false).unwrap();
        for s in STRATEGIES {
            assert_eq!(
                refused(&staged, s),
                refused(&plain, s),
                "{staged} {}",
                s.name()
            );
            if refused(&staged, s) {
                continue;
            }
            for fb in [Feedback::None, Feedback::WorkerAndOwner] {
                let o = opts(s, ReduceOp::Sum, fb);
                let (a, b) = (
                    run_world(plain, &o, &inputs, 2),
                    run_world(staged, &o, &inputs, 2),
                );
                for (r, (a, b)) in a.into_iter().zip(b).enumerate() {
                    let (a, b) = match (a, b) {
                        (Ok(a), Ok(b)) => (a.0, b.0),
                        // Refused alike (error feedback with a non-contractive codec).
                        (Err(a), Err(b)) => {
                            assert_eq!(a.to_string(), b.to_string().replace(",entropy=on", ""));
                            continue;
                        }
                        (a, b) => panic!("{staged}: {:?} / {:?}", a.err(), b.err()),
                    };
                    let same = a.iter().zip(&b).all(|(a, b)| bits(a) == bits(b));
                    assert!(same, "{staged} {} {fb:?}: rank {r} differs", s.name());
                }
            }
        }
    }
}

#[test]
fn error_within_bound_of_exact_sum() {
    for codec in collective_specs() {
        for s in STRATEGIES {
            if refused(&codec, s) {
                continue;
            }
            for p in [2usize, 3, 4, 7] {
                let n = 3000;
                let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(n, r)).collect();
                let res = run_world(codec, &opts(s, ReduceOp::Sum, Feedback::None), &inputs, 1);
                let out = &res[0].as_ref().unwrap().0[0];
                // Per chunk: the sum over ranks of each rank's largest |x| in the chunk.
                for c in 0..p {
                    let range = if matches!(
                        s,
                        Strategy::CompressedRing | Strategy::Fp32Ring | Strategy::TwoShot
                    ) {
                        chunk_range(n, p, c)
                    } else {
                        0..n
                    };
                    let a: f64 = inputs
                        .iter()
                        .map(|x| {
                            x[range.clone()]
                                .iter()
                                .fold(0f64, |m, v| m.max(v.abs() as f64))
                        })
                        .sum();
                    let bound = error_bound(&codec, s, p, a);
                    for i in range {
                        let exact: f64 = inputs.iter().map(|x| x[i] as f64).sum();
                        let e = (out[i] as f64 - exact).abs();
                        assert!(
                            e <= bound,
                            "{codec} {} p={p}: element {i}: error {e:e} above bound {bound:e}",
                            s.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn codec_error_bound_holds_for_one_round_trip() {
    for codec in collective_specs() {
        for salt in 0..8 {
            let x = input(2000, salt);
            let d = codec
                .decode(&codec.encode(&x, &EncodeCtx::new(salt as u64)).unwrap())
                .unwrap();
            let a = x.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            let bound = codec.error_bound(a);
            for i in 0..x.len() {
                let e = (x[i] as f64 - d[i] as f64).abs();
                assert!(e <= bound, "{codec}: element {i}: {e:e} > {bound:e}");
            }
        }
    }
    let fp16: CodecSpec = "fp16".parse().unwrap();
    assert_eq!(fp16.error_bound(70000.0), f64::INFINITY);
}

#[test]
fn feedback_sum_invariant() {
    // With residuals at every encode, sum_r (x_r + old residual_r) = output + sum_r new
    // residual_r, to f32 rounding.
    for spec in [
        "int8:block=64",
        "sign:block=64",
        "qsgd:bits=2,block=64",
        "topk:ratio=0.1",
    ] {
        let codec: CodecSpec = spec.parse().unwrap();
        for s in [
            Strategy::CompressedRing,
            Strategy::CompressedAllGather,
            Strategy::TwoShot,
        ] {
            let (p, n) = (4usize, 2500);
            let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(n, r)).collect();
            let steps = 3;
            // The invariant is arithmetic, so it holds for non-contractive codecs too.
            let mut o = opts(s, ReduceOp::Sum, Feedback::WorkerAndOwner);
            o.feedback_options.allow_non_contractive = true;
            // Residuals after k steps, for k = 0..=steps, come from runs of k steps.
            let mut prev = vec![vec![0.0f32; n]; p];
            for k in 1..=steps {
                let res = run_world(codec, &o, &inputs, k);
                let out = &res[0].as_ref().unwrap().0[(k - 1) as usize];
                let next: Vec<Vec<f32>> =
                    res.iter().map(|r| r.as_ref().unwrap().2.clone()).collect();
                for i in 0..n {
                    let lhs: f64 = (0..p)
                        .map(|r| inputs[r][i] as f64 + prev[r][i] as f64)
                        .sum();
                    let rhs: f64 = out[i] as f64 + (0..p).map(|r| next[r][i] as f64).sum::<f64>();
                    let scale: f64 = (0..p)
                        .map(|r| {
                            inputs[r][i].abs() as f64
                                + prev[r][i].abs() as f64
                                + next[r][i].abs() as f64
                        })
                        .sum::<f64>()
                        + out[i].abs() as f64;
                    let tol = 4.0 * p as f64 * f32::EPSILON as f64 * scale + 1e-44;
                    assert!(
                        (lhs - rhs).abs() <= tol,
                        "{spec} {} step {k} element {i}: {lhs:e} vs {rhs:e}",
                        s.name()
                    );
                }
                prev = next;
            }
            // Feedback actually carries something.
            assert!(prev.iter().any(|r| r.iter().any(|&v| v != 0.0)), "{spec}");
        }
    }
}

#[test]
fn worker_feedback_keeps_no_owner_residual() {
    let codec: CodecSpec = "int8".parse().unwrap();
    let (p, n) = (3, 999);
    let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(n, r)).collect();
    let res = run_world(
        codec,
        &opts(Strategy::CompressedRing, ReduceOp::Sum, Feedback::Worker),
        &inputs,
        1,
    );
    for (r, res) in res.iter().enumerate() {
        let resid = &res.as_ref().unwrap().2;
        for c in 0..p {
            let nonzero = resid[chunk_range(n, p, c)].iter().any(|&v| v != 0.0);
            assert_eq!(nonzero, c != r, "rank {r} chunk {c}");
        }
    }
}

#[test]
fn auto_strategy_follows_the_cost_model() {
    let codec: CodecSpec = "int8".parse().unwrap();
    let auto = |lat: f64| AllReduceOptions {
        strategy: StrategyChoice::Auto {
            bandwidth_bit_s: 10e9,
            latency_s: lat,
            profile: None,
        },
        ..Default::default()
    };
    let worlds = local::Local::world(8);
    // A large tensor: the two-shot sends the ring's bytes (2/p of the all-gather's) in
    // 2 steps of latency where the ring takes 14.
    let big = AllReduce::new(codec, 1 << 22, &worlds[0], auto(1e-6)).unwrap();
    assert_eq!(big.strategy(), Strategy::TwoShot);
    // At 2 ranks it sends the ring's messages, and decodes its own chunk besides (which
    // the ring's model leaves out): never the model's pick there.
    let two = local::Local::world(2);
    let big = AllReduce::new(codec, 1 << 22, &two[0], auto(1e-6)).unwrap();
    assert_ne!(big.strategy(), Strategy::TwoShot);
    // A tiny tensor on slow-latency links: the fewest steps of latency win, the
    // all-gather's one at 2 ranks, the two-shot's two (against p - 1) at 8.
    let small = AllReduce::new(codec, 64, &two[0], auto(1e-3)).unwrap();
    assert_eq!(small.strategy(), Strategy::CompressedAllGather);
    let small = AllReduce::new(codec, 64, &worlds[0], auto(1e-3)).unwrap();
    assert_eq!(small.strategy(), Strategy::TwoShot);
}

#[test]
fn argument_errors() {
    let codec: CodecSpec = "int8".parse().unwrap();
    let res = local::run(2, Some(Duration::from_secs(5)), |mut t| {
        let mut ar = AllReduce::new(codec, 10, &t, AllReduceOptions::default())?;
        let mut out = vec![0.0; 9];
        let e = ar.run(&mut t, &[0.0; 10], &mut out, 0).unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
        let e = ar.run(&mut t, &[0.0; 11], &mut [0.0; 10], 0).unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
        Ok(())
    });
    assert!(res.iter().all(|r| r.is_ok()));
    // Feedback a codec refuses.
    let w = local::Local::world(2);
    let rk: CodecSpec = "randk:ratio=0.1,scale=unbiased".parse().unwrap();
    let e = AllReduce::new(
        rk,
        10,
        &w[0],
        opts(Strategy::CompressedRing, ReduceOp::Sum, Feedback::Worker),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Param { name: "scale", .. }), "{e}");
}

/// A transport that damages the messages one rank sends.
struct Faulty<F: FnMut(&mut Vec<u8>)> {
    inner: local::Local,
    damage: F,
}

impl<F: FnMut(&mut Vec<u8>)> Transport for Faulty<F> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        let mut msg = msg.to_vec();
        (self.damage)(&mut msg);
        self.inner.send(&msg, to)
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        self.inner.recv(buf, from, max)
    }
}

/// Run a 4-rank all-reduce where rank 1's messages pass through `damage`; returns every
/// rank's result.
fn with_fault(spec: &str, s: Strategy, damage: Damage) -> Vec<Result<Stats>> {
    with_fault_opts(spec, damage, opts(s, ReduceOp::Sum, Feedback::None)).0
}

/// [`with_fault`] with any options; also returns every rank's output.
fn with_fault_opts(
    spec: &str,
    damage: Damage,
    o: AllReduceOptions,
) -> (Vec<Result<Stats>>, Vec<Vec<f32>>) {
    let codec: CodecSpec = spec.parse().unwrap();
    let n = 1000;
    let res = local::run(4, Some(Duration::from_secs(5)), |t| {
        let rank = t.rank();
        let mut ar = AllReduce::new(codec, n, &t, o.clone())?;
        let x = input(n, rank);
        let mut out = vec![0.0; n];
        let stats = if rank == 1 {
            let inner = t.into_inner();
            let mut t = Comm::new(Faulty { inner, damage });
            ar.run(&mut t, &x, &mut out, 0)
        } else {
            let mut t = t;
            ar.run(&mut t, &x, &mut out, 0)
        };
        Ok((stats, out))
    });
    res.into_iter()
        .map(|r| {
            let (stats, out) = r.expect("rank setup");
            (stats, out)
        })
        .unzip()
}

/// The result of a rank that receives rank 1's messages: rank 2 in the ring and the
/// frame all-gather. In the two-shot every rank receives from rank 1, and which of them
/// reaches rank 1's message first depends on timing (a rank that fails leaves, and a
/// peer's send to it fails, naming it): the first whose error names rank 1, once every
/// rank but rank 1 is checked to have failed.
fn receiver_of_rank_1(res: &[Result<Stats>], s: Strategy) -> &Result<Stats> {
    if s != Strategy::TwoShot {
        return &res[2];
    }
    for (r, x) in res.iter().enumerate() {
        assert!(r == 1 || x.is_err(), "rank {r} succeeded: {x:?}");
    }
    res.iter()
        .find(|x| matches!(x, Err(Error::Peer { peer: 1, .. })))
        .unwrap_or(&res[2])
}

#[test]
fn a_bit_flipped_in_transit_is_an_error_sealed_or_not() {
    // One payload bit flipped in every message rank 1 sends (the byte before the last
    // 4, i.e. payload, not the checksum itself when sealed). The envelope's CRC-32C
    // covers the frame, so the receiver names rank 1 whether or not the frame carries a
    // payload checksum of its own (before envelope version 2, an unsealed frame decoded
    // to a wrong sum here and every rank "succeeded").
    let flip: Damage = |m| {
        if m.len() > 60 {
            let at = m.len() - 5;
            m[at] ^= 0x10;
        }
    };
    for s in [
        Strategy::CompressedRing,
        Strategy::CompressedAllGather,
        Strategy::TwoShot,
    ] {
        let plain = AllReduceOptions {
            checksum: false,
            ..opts(s, ReduceOp::Sum, Feedback::None)
        };
        let sealed = AllReduceOptions {
            checksum: true,
            ..plain.clone()
        };
        let (clean, clean_out) = with_fault_opts("int8", |_| {}, plain.clone());
        assert!(clean.iter().all(Result::is_ok));
        for o in [&plain, &sealed] {
            let (res, _) = with_fault_opts("int8", flip, o.clone());
            match receiver_of_rank_1(&res, s) {
                Err(Error::Peer {
                    peer: 1, source, ..
                }) => assert!(
                    matches!(**source, Error::Misplaced(ref m) if m.contains("damaged message")),
                    "{}: {source}",
                    s.name()
                ),
                other => panic!("{}: rank 2 got {other:?}", s.name()),
            }
        }
        // Sealed and undamaged: the same bits as unsealed, 4 more bytes per message.
        let (ok, ok_out) = with_fault_opts("int8", |_| {}, sealed);
        for r in 0..4 {
            assert_eq!(bits(&ok_out[r]), bits(&clean_out[r]));
            let (a, b) = (ok[r].as_ref().unwrap(), clean[r].as_ref().unwrap());
            assert_eq!(a.bytes_sent, b.bytes_sent + 4 * b.messages);
        }
    }
}

#[test]
fn damaged_frames_are_errors_naming_the_peer() {
    let cases: [(&str, Damage); 8] = [
        ("header byte flipped", |m| m[ENVELOPE_LEN + 9] ^= 0x40),
        ("truncated", |m| m.truncate(m.len() - 3)),
        ("empty", |m| m.clear()),
        ("garbage", |m| m.iter_mut().for_each(|b| *b = 0xA5)),
        ("trailing byte", |m| m.push(0)),
        ("envelope byte flipped", |m| m[21] ^= 0x01),
        ("frame without envelope", |m| {
            m.drain(..ENVELOPE_LEN);
        }),
        ("envelope only", |m| m.truncate(ENVELOPE_LEN)),
    ];
    for spec in ["int8", "topk:ratio=0.1"] {
        for s in [
            Strategy::CompressedRing,
            Strategy::CompressedAllGather,
            Strategy::SignMajority,
            Strategy::TwoShot,
        ] {
            for (what, damage) in cases {
                let res = with_fault(spec, s, damage);
                // Rank 2 receives from rank 1: its error names rank 1 and the problem.
                match receiver_of_rank_1(&res, s) {
                    Err(Error::Peer {
                        peer: 1,
                        phase,
                        source,
                        ..
                    }) => {
                        assert!(!phase.is_empty());
                        let msg = source.to_string();
                        assert!(!msg.is_empty());
                    }
                    other => panic!("{spec} {} {what}: rank 2 got {other:?}", s.name()),
                }
                // No rank succeeded with damaged data on its path, and none hung.
                assert!(res[2].is_err());
            }
        }
    }
}

#[test]
fn frames_of_another_codec_or_length_are_refused() {
    // Rank 1 runs with a different codec: its neighbours refuse its frames, by their
    // codec (shorter frames) or, before reading them, by their length (longer ones).
    let n = 500;
    for (other, want) in [("sign", "WrongCodec"), ("fp16", "MessageTooLong")] {
        let res = local::run(3, Some(Duration::from_secs(5)), |mut t| {
            let spec = if t.rank() == 1 { other } else { "int8" };
            let codec: CodecSpec = spec.parse().unwrap();
            let o = opts(Strategy::CompressedAllGather, ReduceOp::Sum, Feedback::None);
            let mut ar = AllReduce::new(codec, n, &t, o)?;
            ar.run(&mut t, &vec![1.0; n], &mut vec![0.0; n], 0)
        });
        match &res[2] {
            Err(Error::Peer {
                peer: 1, source, ..
            }) => {
                assert!(format!("{source:?}").starts_with(want), "{other}: {source}")
            }
            other => panic!("{other:?}"),
        }
    }
    // Rank 1 has a different length: its neighbours' frames do not fit its chunks, or
    // its frames do not fit theirs; whoever sees it first names the sender.
    let res = local::run(3, Some(Duration::from_secs(5)), |mut t| {
        let m = if t.rank() == 1 { n + 1 } else { n };
        let codec: CodecSpec = "int8".parse().unwrap();
        let o = opts(Strategy::CompressedRing, ReduceOp::Sum, Feedback::None);
        let mut ar = AllReduce::new(codec, m, &t, o)?;
        ar.run(&mut t, &vec![1.0; m], &mut vec![0.0; m], 0)
    });
    assert!(
        res.iter()
            .any(|r| matches!(r, Err(Error::Peer { source, .. })
            if matches!(**source, Error::OutputLength { .. }))),
        "{res:?}"
    );
    assert!(res.iter().all(|r| r.is_err()), "{res:?}");
}

#[test]
fn silent_peer_times_out_and_departed_peer_is_reported() {
    let codec: CodecSpec = "int8".parse().unwrap();
    let n = 100;
    // Rank 1 holds its transport but says nothing for longer than the timeout.
    let timeout = Duration::from_millis(300);
    let res = local::run(3, Some(timeout), |mut t| {
        let mut ar = AllReduce::new(codec, n, &t, AllReduceOptions::default())?;
        if t.rank() == 1 {
            std::thread::sleep(timeout * 3);
        }
        ar.run(&mut t, &vec![1.0; n], &mut vec![0.0; n], 0)
    });
    match &res[2] {
        Err(Error::Transport { peer: 1, reason }) => {
            assert!(reason.contains("timeout"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // Rank 1 leaves before the collective.
    let res = local::run(3, Some(Duration::from_secs(30)), |mut t| {
        if t.rank() == 1 {
            return Ok(None);
        }
        let mut ar = AllReduce::new(codec, n, &t, AllReduceOptions::default())?;
        ar.run(&mut t, &vec![1.0; n], &mut vec![0.0; n], 0)
            .map(Some)
    });
    // Which rank notices first is a race (rank 2 may find rank 0 already gone), but every
    // rank fails with a transport error saying a peer left, and someone names rank 1.
    for r in [0, 2] {
        match &res[r] {
            Err(Error::Transport { reason, .. }) => assert!(reason.contains("left"), "{reason}"),
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(
        res.iter()
            .any(|r| matches!(r, Err(Error::Transport { peer: 1, .. }))),
        "{res:?}"
    );
}

#[test]
fn ring_sends_less_than_allgather() {
    let codec: CodecSpec = "int8".parse().unwrap();
    let (p, n) = (8, 1 << 16);
    let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(n, r)).collect();
    let frame = codec.max_encoded_len(n) as f64;
    for (s, want) in [
        (
            Strategy::CompressedRing,
            2.0 * (p - 1) as f64 / p as f64 * frame,
        ),
        (Strategy::CompressedAllGather, (p - 1) as f64 * frame),
    ] {
        let res = run_world(codec, &opts(s, ReduceOp::Sum, Feedback::None), &inputs, 1);
        for r in res {
            let sent = r.unwrap().1.bytes_sent as f64;
            // Chunk frames carry their own headers and block rounding.
            assert!(
                (sent - want).abs() <= 2.0 * p as f64 * 64.0 + 0.01 * want,
                "{}: {sent} vs {want}",
                s.name()
            );
        }
    }
}

#[test]
fn in_place_runs_give_the_same_bits_and_residuals() {
    let specs = [
        "identity",
        "int8:block=64,rounding=stochastic",
        "sign:block=3",
        "topk:ratio=0.1,values=f32",
        "qsgd:bits=4,block=7",
    ];
    for p in [1usize, 2, 3, 8] {
        for n in [0, p + 1, 4099] {
            let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(n, r)).collect();
            for spec in specs {
                let codec: CodecSpec = spec.parse().unwrap();
                for s in STRATEGIES {
                    if refused(&codec, s) || (s == Strategy::Fp32Ring) != (spec == "identity") {
                        continue;
                    }
                    for (pieces, feedback, op) in [
                        (1, Feedback::None, ReduceOp::Mean),
                        (1, Feedback::WorkerAndOwner, ReduceOp::Sum),
                        (3, Feedback::WorkerAndOwner, ReduceOp::Mean),
                    ] {
                        let pieced = matches!(s, Strategy::CompressedRing | Strategy::TwoShot);
                        if !pieced && (pieces > 1 || spec == "identity") {
                            continue;
                        }
                        let o = AllReduceOptions {
                            pieces,
                            ..opts(s, op, feedback)
                        };
                        let a = run_world(codec, &o, &inputs, 3);
                        let b = run_world_by(codec, &o, &inputs, 3, true);
                        for r in 0..p {
                            let what =
                                format!("{spec} {} p={p} n={n} x{pieces} rank {r}", s.name());
                            let (a, b) = (a[r].as_ref().unwrap(), b[r].as_ref().unwrap());
                            for st in 0..3 {
                                assert_eq!(bits(&a.0[st]), bits(&b.0[st]), "{what} step {st}");
                            }
                            assert_eq!(bits(&a.2), bits(&b.2), "{what}: residuals");
                            assert_eq!(a.1, b.1, "{what}: stats");
                        }
                    }
                }
            }
        }
    }
}

/// The ring with worker+owner error feedback, defined sequentially from the codec and
/// `ErrorFeedback` API: chunk `c` starts at rank `c + 1`, and each rank on its way adds
/// its input to the decoded frame and encodes the sum through its own residual for that
/// chunk; the owner `c` encodes the full sum through its residual, and every rank decodes
/// that frame. Returns the outputs of `steps` steps (seeds `11 + step`) and the residuals
/// of every rank, in chunk order.
#[allow(clippy::needless_range_loop)]
fn fed_reference(
    codec: &CodecSpec,
    fo: FeedbackOptions,
    op: ReduceOp,
    inputs: &[Vec<f32>],
    steps: u64,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (p, n) = (inputs.len(), inputs[0].len());
    let mut ef: Vec<Vec<ErrorFeedback>> = (0..p)
        .map(|_| {
            (0..p)
                .map(|c| ErrorFeedback::with_options(*codec, chunk_range(n, p, c).len(), fo))
                .collect::<Result<_>>()
                .unwrap()
        })
        .collect();
    let mut outs = Vec::new();
    for step in 0..steps {
        let ctx = |r: usize, off: usize| EncodeCtx {
            seed: rank_seed(codec, 11 + step, r),
            offset: off as u64,
        };
        let mut out = vec![0.0f32; n];
        for c in 0..p {
            let range = chunk_range(n, p, c);
            let first = (c + 1) % p;
            let x = &inputs[first][range.clone()];
            let mut frame = ef[first][c].encode(x, &ctx(first, range.start)).unwrap();
            for h in 1..p {
                let q = (c + 1 + h) % p;
                let mut acc = inputs[q][range.clone()].to_vec();
                codec.decode_add(&frame, &mut acc).unwrap();
                frame = ef[q][c].encode(&acc, &ctx(q, range.start)).unwrap();
            }
            codec.decode_into(&frame, &mut out[range]).unwrap();
        }
        if op == ReduceOp::Mean && p > 1 {
            out.iter_mut().for_each(|x| *x /= p as f32);
        }
        outs.push(out);
    }
    let residuals = ef
        .iter()
        .map(|r| r.iter().flat_map(|e| e.residual_f32()).collect())
        .collect();
    (outs, residuals)
}

/// The ring's hops (sum, re-encode through the residual, and for the owner decode and
/// mean) are fused tile by tile and split across threads for long chunks: the outputs and
/// residuals equal the sequential definition bit for bit, for f32 and bf16 residuals,
/// short chunks and long ones (ranges on several threads).
#[test]
fn fed_ring_equals_its_sequential_definition() {
    gradpack::parallel::set_min_len(0);
    let specs = [
        "int8:block=64,rounding=stochastic",
        "fp16",
        "fp8:format=e4m3,block=32,scale=e8m0",
        "sign:block=3",
        "topk:ratio=0.1,values=f32",
    ];
    for (p, n) in [
        (2usize, 4099usize),
        (3, 1000),
        (5, 4099),
        (2, 300_001),
        (3, 200_003),
    ] {
        let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(n, r)).collect();
        for spec in specs {
            let codec: CodecSpec = spec.parse().unwrap();
            for precision in [ResidualPrecision::F32, ResidualPrecision::Bf16] {
                let fo = FeedbackOptions {
                    precision,
                    beta: 0.9,
                    ..Default::default()
                };
                if precision == ResidualPrecision::Bf16 && spec.starts_with("topk") {
                    continue;
                }
                let op = if p == 2 {
                    ReduceOp::Sum
                } else {
                    ReduceOp::Mean
                };
                let o = AllReduceOptions {
                    feedback_options: fo,
                    ..opts(Strategy::CompressedRing, op, Feedback::WorkerAndOwner)
                };
                let (want, residuals) = fed_reference(&codec, fo, op, &inputs, 3);
                for in_place in [false, true] {
                    let got = run_world_by(codec, &o, &inputs, 3, in_place);
                    for (r, got) in got.into_iter().enumerate() {
                        let what = format!("{spec} {precision:?} p={p} n={n} rank {r}");
                        let (outs, _, res) = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                        for st in 0..3 {
                            assert!(bits(&outs[st]) == bits(&want[st]), "{what} step {st}");
                        }
                        assert!(bits(&res) == bits(&residuals[r]), "{what}: residuals");
                    }
                }
            }
        }
    }
    gradpack::parallel::set_min_len(gradpack::parallel::DEFAULT_MIN_LEN);
}

#[test]
fn pipelined_ring_agrees_with_the_plain_ring() {
    let p = 4;
    for n in [0, 3, 4, 37, 1000, 4099] {
        let inputs: Vec<Vec<f32>> = (0..p).map(|r| input(n, r)).collect();
        for pieces in [2, 3, 7] {
            // Element-wise codecs: piece boundaries change nothing, so the sums are
            // bit-identical to the plain ring's.
            for spec in ["identity", "fp16", "bf16"] {
                let codec: CodecSpec = spec.parse().unwrap();
                let s = if spec == "identity" {
                    Strategy::Fp32Ring
                } else {
                    Strategy::CompressedRing
                };
                let plain = opts(s, ReduceOp::Sum, Feedback::None);
                let piped = AllReduceOptions {
                    pieces,
                    ..plain.clone()
                };
                let a = run_world(codec, &plain, &inputs, 2);
                let b = run_world(codec, &piped, &inputs, 2);
                for r in 0..p {
                    let (a, b) = (a[r].as_ref().unwrap(), b[r].as_ref().unwrap());
                    for st in 0..2 {
                        assert_eq!(bits(&a.0[st]), bits(&b.0[st]), "{spec} n={n} x{pieces}");
                    }
                    // One message per piece per hop.
                    assert_eq!(b.1.messages, a.1.messages * pieces as u64);
                }
            }
            // Block codecs with error feedback at every encode: ranks agree, every
            // element within the bound, and nothing is lost.
            let codec: CodecSpec = "int8:block=64,rounding=stochastic".parse().unwrap();
            let o = AllReduceOptions {
                pieces,
                ..opts(
                    Strategy::CompressedRing,
                    ReduceOp::Sum,
                    Feedback::WorkerAndOwner,
                )
            };
            let res = run_world(codec, &o, &inputs, 1);
            let outs: Vec<&RankRun> = res.iter().map(|r| r.as_ref().unwrap()).collect();
            for r in 1..p {
                assert_eq!(bits(&outs[r].0[0]), bits(&outs[0].0[0]));
            }
            for i in 0..n {
                let sum_in: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
                let sum_res: f64 = outs.iter().map(|o| f64::from(o.2[i])).sum();
                let mag: f64 = inputs.iter().map(|x| f64::from(x[i].abs())).sum::<f64>()
                    + outs.iter().map(|o| f64::from(o.2[i].abs())).sum::<f64>();
                let got = f64::from(outs[0].0[0][i]) + sum_res;
                assert!(
                    (got - sum_in).abs() <= 1e-5 * mag + 1e-30,
                    "n={n} x{pieces} element {i}: {got} vs {sum_in}"
                );
            }
        }
    }
}

/// A transport that counts the exchanges its collectives hand it together
/// ([`Transport::send_recv`], with or without an expected length), those of them told
/// the length of the message to come ([`Transport::send_recv_len`], checked against the
/// message that arrives), and the sends made apart.
struct Counting {
    inner: local::Local,
    together: usize,
    told: usize,
    apart: usize,
}

impl Transport for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        self.apart += 1;
        self.inner.send(msg, to)
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
        self.together += 1;
        self.inner.send(send, to)?;
        self.inner.recv(recv, from, max)
    }
    fn send_recv_len(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        len: usize,
        max: usize,
    ) -> Result<()> {
        self.told += 1;
        assert!(len <= max, "an expected length within the bound");
        self.send_recv(send, to, recv, from, max)?;
        assert_eq!(recv.len(), len, "rank {} from {from}", self.rank());
        Ok(())
    }
}

/// `calls` all-reduces of `codec` over `p` [`Counting`] transports with options `o`
/// (NaN in rank 1's input from the second call): each rank's output of the last call
/// (checked the same bits on every rank) and its counts `(together, told, apart)`.
fn counted_world(
    codec: CodecSpec,
    p: usize,
    n: usize,
    o: &AllReduceOptions,
    calls: u64,
) -> (Vec<u32>, Vec<(usize, usize, usize)>) {
    let counts = std::sync::Mutex::new(Vec::new());
    let outs: Vec<Vec<u32>> = std::thread::scope(|sc| {
        let hs: Vec<_> = local::Local::world(p)
            .into_iter()
            .map(|t| {
                let counts = &counts;
                let o = o.clone();
                sc.spawn(move || {
                    let t = Counting {
                        inner: t,
                        together: 0,
                        told: 0,
                        apart: 0,
                    };
                    let r = t.rank();
                    let mut ar = AllReduce::new(codec, n, &t, o).unwrap();
                    let mut comm = Comm::new(t);
                    let mut out = vec![0.0f32; n];
                    let mut x = input(n, r);
                    for step in 0..calls {
                        if step == 1 && r == 1 {
                            x[n / 2] = f32::NAN;
                        }
                        ar.run(&mut comm, &x, &mut out, 9 + step).unwrap();
                    }
                    let t = comm.into_inner();
                    counts.lock().unwrap().push((t.together, t.told, t.apart));
                    bits(&out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(outs.iter().all(|o| o == &outs[0]), "{codec}, {p} ranks");
    (
        outs.into_iter().next().unwrap(),
        counts.into_inner().unwrap(),
    )
}

/// The ring tells the transport the length of every message of a fixed-rate codec
/// before it arrives (with and without payload checksums, error feedback, lengths that
/// do not divide evenly among the ranks, NaN in the input), and of no message of the
/// others, whose lengths depend on the values; every length told is the length that
/// arrives, for every representative codec.
#[test]
fn the_ring_expects_the_lengths_of_fixed_rate_messages() {
    let specs = [
        "int8",
        "fp16",
        "sign",
        "fp8",
        "fp4:scale=e4m3",
        "qsgd:bits=8,block=64",
        "topk:ratio=0.01",
        "chunktopk:chunk=512,k=8",
    ];
    let ring = |feedback, checksum| {
        let mut o = opts(Strategy::CompressedRing, ReduceOp::Sum, feedback);
        o.checksum = checksum;
        o
    };
    for spec in specs {
        let codec: CodecSpec = spec.parse().unwrap();
        let fixed = !spec.contains("topk");
        for (p, n, checksum) in [(2usize, 10_007, false), (3, 4099, true), (4, 77, false)] {
            let hops = 2 * 2 * (p - 1);
            let want = if fixed { (hops, 0) } else { (0, hops) };
            let o = ring(Feedback::WorkerAndOwner, checksum);
            for (together, told, _) in counted_world(codec, p, n, &o, 2).1 {
                assert_eq!(
                    (told, together - told),
                    want,
                    "{spec}, {p} ranks, {n} elements"
                );
            }
        }
    }
    for spec in gradpack::codec::REPRESENTATIVE_SPECS {
        let codec: CodecSpec = spec.parse().unwrap();
        for (together, _, _) in counted_world(codec, 3, 4099, &ring(Feedback::None, true), 2).1 {
            assert_eq!(together, 8, "{spec}");
        }
    }
}

/// Every step of the ring with one piece, and of the frame all-gather, gives the
/// transport its send and receive together (a transport that moves both directions at
/// once only when the receive is posted first, as gloo's point-to-point, needs them so);
/// the pipelined ring sends ahead instead. The results are the same bits either way.
#[test]
fn unpipelined_steps_send_and_receive_together() {
    let n = 10_007;
    let int8: CodecSpec = "int8".parse().unwrap();
    for p in [2usize, 3, 4] {
        for (s, pieces, together) in [
            (Strategy::CompressedRing, 1, 2 * (p - 1)),
            (Strategy::CompressedRing, 3, 0),
            (Strategy::CompressedAllGather, 1, p - 1),
        ] {
            let mut o = opts(s, ReduceOp::Sum, Feedback::WorkerAndOwner);
            o.pieces = pieces;
            let (out, counts) = counted_world(int8, p, n, &o, 1);
            for (t, _, a) in counts {
                assert_eq!(t, together, "{s:?}, {pieces} pieces, {p} ranks");
                let sent = if s == Strategy::CompressedRing {
                    2 * (p - 1) * pieces
                } else {
                    p - 1
                };
                assert_eq!(t + a, sent, "{s:?}, {pieces} pieces, {p} ranks");
            }
            // The same bits as the plain in-process transport gives.
            let inputs: Vec<_> = (0..p).map(|r| input(n, r)).collect();
            let want = run_world(int8, &o, &inputs, 1);
            let want = bits(&want[0].as_ref().unwrap().0[0]);
            assert_eq!(out, want, "{s:?}, {pieces} pieces, {p} ranks");
        }
    }
}

#[test]
fn agree_fails_on_every_rank_naming_the_option_that_differs() {
    let same = local::run(3, Some(Duration::from_secs(5)), |mut t| {
        t.agree(7, "codec=int8 seed=1")?;
        t.agree(7, "")?;
        Ok(t.calls())
    });
    assert!(same.iter().all(|r| matches!(r, Ok(2))), "{same:?}");
    for (other, key) in [
        ("codec=int8 seed=2", "seed=2"),
        ("codec=fp16 seed=1", "codec=fp16"),
        ("codec=int8", "without option seed"),
        ("codec=int8 seed=1 pieces=2", "pieces=2"),
    ] {
        let res = local::run(3, Some(Duration::from_secs(5)), |mut t| {
            let mine = if t.rank() == 2 {
                other
            } else {
                "codec=int8 seed=1"
            };
            t.agree(7, mine)
        });
        for (r, e) in res.iter().enumerate() {
            let e = e.as_ref().unwrap_err().to_string();
            assert!(e.contains(key) || r == 2, "{other}: rank {r}: {e}");
            assert!(e.contains("agreement"), "{e}");
        }
    }
    let long = "x".repeat(gradpack::collective::MAX_SETTINGS + 1);
    let res = local::run(1, None, |mut t| t.agree(0, &long));
    assert!(res[0].is_err());
}
