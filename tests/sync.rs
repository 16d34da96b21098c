//! The sync engine: every tensor in exactly one bucket slot; results bit-identical on
//! every rank, to per-bucket all-reduces of the same layout and whatever order the
//! tensors arrive in, with and without the communication thread; checkpoints that
//! continue bit-identically and refuse other layouts and damage; a peer that leaves
//! mid-step is an error on every other rank, not a hang.

use std::time::Duration;

use gradpack::collective::{
    AllReduce, AllReduceOptions, BucketGather, Feedback, ReduceOp, Shared, StrategyChoice,
    Transport, local,
};
use gradpack::sync::{
    BucketReducer, HeldTensor, ModelSelection, Momentum, NamedState, Network, Policy, PowerSgd,
    ReducerOptions, SyncEngine, SyncOptions, Tensor, TensorGather, Way, default_strategy,
    wants_feedback,
};
use gradpack::{CodecSpec, Error, Result};

/// A small model's layout, last layer first (the order gradients become ready).
fn layout() -> Vec<Tensor> {
    vec![
        Tensor::new("head.bias", &[10]),
        Tensor::new("head.weight", &[10, 256]),
        Tensor::new("block2.norm", &[256]),
        Tensor::new("block2.weight", &[256, 256]),
        Tensor::new("block1.bias", &[256]),
        Tensor::new("block1.weight", &[256, 128]),
        Tensor::new("scale", &[]),
        Tensor::new("empty", &[0, 3]),
        Tensor::new("embed", &[300, 128]),
    ]
}

fn grads(layout: &[Tensor], rank: usize, step: u64) -> Vec<Vec<f32>> {
    layout
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let seed = 1000 * step + 100 * rank as u64 + i as u64;
            gradpack::synthetic::gradient(t.len().unwrap(), seed)
        })
        .collect()
}

fn opts(policy: Policy) -> SyncOptions {
    SyncOptions {
        policy,
        // Small caps so the layout spans several buckets.
        bucket_cap_bytes: 200_000,
        first_bucket_cap_bytes: 50_000,
        seed: 5,
        ..Default::default()
    }
}

type Steps = Vec<Vec<Vec<f32>>>;

/// Steps `steps` of engine `e` over [`layout`]: the gradients `input(step)` given in the
/// order `order(step)`; per step, every tensor's reduced gradient.
fn feed<T: Transport + Send + 'static>(
    e: &mut SyncEngine<T>,
    steps: core::ops::Range<u64>,
    input: impl Fn(u64) -> Vec<Vec<f32>>,
    order: impl Fn(u64) -> Vec<usize>,
) -> Result<Steps> {
    let l = layout();
    let mut out = Vec::new();
    for step in steps {
        let g = input(step);
        for i in order(step) {
            e.ready(i, &g[i])?;
        }
        e.finish()?;
        out.push((0..l.len()).map(|i| e.grad(i).unwrap().to_vec()).collect());
    }
    Ok(out)
}

/// Run `steps` steps on every rank; per rank and step, every tensor's reduced gradient.
/// `order(rank, step)` gives the order the tensors are handed over in.
fn run(
    p: usize,
    o: &SyncOptions,
    steps: u64,
    order: impl Fn(usize, u64) -> Vec<usize> + Sync,
) -> Vec<Result<Steps>> {
    let l = layout();
    local::run(p, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        let mut e = SyncEngine::new(&l, comm.into_inner(), o.clone())?;
        feed(&mut e, 0..steps, |s| grads(&l, rank, s), |s| order(rank, s))
    })
}

/// Every rank's engine given `input(rank, step)` as the gradients of each step, in order;
/// per rank and step, every tensor's reduced gradient.
fn run_fed(
    p: usize,
    o: &SyncOptions,
    steps: u64,
    input: impl Fn(usize, u64) -> Vec<Vec<f32>> + Sync,
) -> Vec<Steps> {
    let l = layout();
    local::run(p, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        let mut e = SyncEngine::new(&l, comm.into_inner(), o.clone())?;
        feed(&mut e, 0..steps, |s| input(rank, s), |s| in_order(rank, s))
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn in_order(_: usize, _: u64) -> Vec<usize> {
    (0..layout().len()).collect()
}

fn bits(x: &[Vec<Vec<f32>>]) -> Vec<u32> {
    x.iter().flatten().flatten().map(|v| v.to_bits()).collect()
}

#[test]
fn every_tensor_lands_in_exactly_one_slot() {
    // Random shape lists: 200 layouts of 1 to 60 tensors of 0 to 3 dimensions.
    let mut state = 12345u64;
    let mut next = |m: u64| {
        state = gradpack::rng::splitmix64(state);
        state % m
    };
    for _ in 0..200 {
        let n = 1 + next(60) as usize;
        let layout: Vec<Tensor> = (0..n)
            .map(|i| {
                let dims = next(4) as usize;
                let shape: Vec<usize> = (0..dims).map(|_| next(300) as usize).collect();
                Tensor::new(format!("t{i}"), &shape)
            })
            .collect();
        let cap = 1 + next(400_000) as usize;
        let first = 1 + next(100_000) as usize;
        let o = SyncOptions {
            policy: Policy::with_rules("int8".parse().unwrap()),
            bucket_cap_bytes: cap,
            first_bucket_cap_bytes: first,
            overlap: false,
            ..Default::default()
        };
        let w = local::Local::world(1);
        let e = SyncEngine::new(&layout, w.into_iter().next().unwrap(), o).unwrap();
        let plan = e.plan();
        let mut seen = vec![0; n];
        for b in &plan.buckets {
            let mut sum = 0;
            for &t in &b.tensors {
                seen[t] += 1;
                sum += layout[t].len().unwrap();
                // Small tensors and the rest never share a bucket.
                let small = layout[t].shape.len() <= 1 || layout[t].len().unwrap() < 16384;
                assert_eq!(small, b.small);
            }
            assert_eq!(sum, b.elements);
            // Within the cap unless it is a single tensor larger than it.
            assert!(b.tensors.len() == 1 || b.elements * 4 <= cap.max(first));
        }
        assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
    }
}

#[test]
fn ranks_agree_and_match_per_bucket_all_reduces() {
    let p = 3;
    for policy in [
        Policy::with_rules("int8:rounding=stochastic".parse().unwrap()),
        Policy::uniform("topk:ratio=0.05".parse().unwrap()),
        Policy::uniform("qsgd:bits=8".parse().unwrap()),
    ] {
        let o = SyncOptions {
            feedback: Feedback::Worker,
            ..opts(policy.clone())
        };
        let res = run(p, &o, 3, in_order);
        let ranks: Vec<Steps> = res.into_iter().map(|r| r.unwrap()).collect();
        for r in 1..p {
            assert_eq!(bits(&ranks[r]), bits(&ranks[0]), "{policy:?}: rank {r}");
        }
        // The same layout by hand: one AllReduce per bucket, the engine's seeds.
        let l = layout();
        let manual = local::run(p, Some(Duration::from_secs(20)), |comm| {
            let rank = comm.rank();
            let planner = SyncEngine::new(
                &l,
                Plain {
                    rank,
                    size: comm.size(),
                },
                SyncOptions {
                    overlap: false,
                    ..o.clone()
                },
            )?;
            let plan = planner.plan().clone();
            let mut comm = comm;
            let mut ars: Vec<AllReduce> = plan
                .buckets
                .iter()
                .enumerate()
                .map(|(b, bp)| {
                    AllReduce::new(
                        bp.codec,
                        bp.elements,
                        &comm,
                        AllReduceOptions {
                            op: ReduceOp::Mean,
                            strategy: StrategyChoice::Forced(bp.strategy),
                            feedback: o.feedback,
                            tag: b as u32,
                            ..Default::default()
                        },
                    )
                })
                .collect::<Result<_>>()?;
            let mut steps = Vec::new();
            for step in 0..3 {
                let g = grads(&l, rank, step);
                let mut per_tensor = vec![Vec::new(); l.len()];
                for (b, bp) in plan.buckets.iter().enumerate() {
                    let input: Vec<f32> = bp.tensors.iter().flat_map(|&t| g[t].clone()).collect();
                    let mut out = vec![0f32; bp.elements];
                    ars[b].run(&mut comm, &input, &mut out, planner.bucket_seed(step, b))?;
                    let mut off = 0;
                    for &t in &bp.tensors {
                        let n = l[t].len().unwrap();
                        per_tensor[t] = out[off..off + n].to_vec();
                        off += n;
                    }
                }
                steps.push(per_tensor);
            }
            Ok(steps)
        });
        let manual: Vec<Steps> = manual.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(bits(&manual[0]), bits(&ranks[0]), "{policy:?}");
    }
}

/// A transport that only reports its rank and size (to build a plan for a world).
struct Plain {
    rank: usize,
    size: usize,
}

impl Transport for Plain {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn send(&mut self, _: &[u8], _: usize) -> Result<()> {
        Err(Error::Collective(
            "a planning transport sends nothing".into(),
        ))
    }
    fn recv(&mut self, _: &mut Vec<u8>, _: usize, _: usize) -> Result<()> {
        Err(Error::Collective(
            "a planning transport receives nothing".into(),
        ))
    }
}

#[test]
fn arrival_order_and_the_thread_do_not_change_the_result() {
    let o = SyncOptions {
        feedback: Feedback::Worker,
        ..opts(Policy::with_rules(
            "int8:rounding=stochastic".parse().unwrap(),
        ))
    };
    let base = run(3, &o, 3, in_order);
    let base: Vec<Steps> = base.into_iter().map(|r| r.unwrap()).collect();
    // Every rank hands its tensors over in its own shuffled order, every step.
    let shuffled = run(3, &o, 3, |rank, step| {
        let mut v: Vec<usize> = (0..layout().len()).collect();
        let mut s = gradpack::rng::splitmix64(rank as u64 * 7 + step);
        for i in (1..v.len()).rev() {
            s = gradpack::rng::splitmix64(s);
            v.swap(i, (s % (i as u64 + 1)) as usize);
        }
        v
    });
    let inline = run(
        3,
        &SyncOptions {
            overlap: false,
            ..o.clone()
        },
        3,
        |_, _| (0..layout().len()).rev().collect(),
    );
    for (name, other) in [("shuffled", shuffled), ("inline", inline)] {
        let other: Vec<Steps> = other.into_iter().map(|r| r.unwrap()).collect();
        for r in 0..3 {
            assert_eq!(bits(&other[r]), bits(&base[r]), "{name} rank {r}");
        }
    }
}

#[test]
fn checkpoints_continue_bit_identically() {
    let o = SyncOptions {
        feedback: Feedback::WorkerAndOwner,
        ..opts(Policy::with_rules(
            "int8:rounding=stochastic".parse().unwrap(),
        ))
    };
    let p = 2;
    let straight = run(p, &o, 5, in_order);
    let straight: Vec<Steps> = straight.into_iter().map(|r| r.unwrap()).collect();
    let l = layout();
    let resumed = local::run(p, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        // Two steps, save.
        let mut e = SyncEngine::new(&l, comm.into_inner(), o.clone())?;
        feed(&mut e, 0..2, |s| grads(&l, rank, s), |_| in_order(rank, 0))?;
        let blob = e.save()?;
        // Damaged and foreign checkpoints are refused and change nothing.
        let mut bad = blob.clone();
        let at = bad.len() / 2;
        bad[at] ^= 1;
        assert!(matches!(e.restore(&bad), Err(Error::Checkpoint(_))));
        let mut other_layout = l.clone();
        other_layout[1].shape = vec![10, 255];
        let w = local::Local::world(1).pop().unwrap();
        let mut foreign = SyncEngine::new(
            &other_layout,
            w,
            SyncOptions {
                overlap: false,
                ..o.clone()
            },
        )?;
        match foreign.restore(&blob) {
            Err(Error::Checkpoint(m)) => assert!(m.contains("layout"), "{m}"),
            other => panic!("{other:?}"),
        }
        // A fresh engine on the same transport, restored, runs steps 2..5.
        let t = e.into_transport()?;
        let mut e = SyncEngine::new(&l, t, o.clone())?;
        e.restore(&blob)?;
        assert_eq!(e.step(), 2);
        feed(&mut e, 2..5, |s| grads(&l, rank, s), |_| in_order(rank, 0))
    });
    for (r, res) in resumed.into_iter().enumerate() {
        let res = res.unwrap();
        assert_eq!(bits(&res), bits(&straight[r][2..]), "rank {r}");
    }
}

#[test]
fn a_peer_that_leaves_mid_step_is_an_error_everywhere() {
    let l = layout();
    let o = opts(Policy::uniform("fp16".parse().unwrap()));
    let res = local::run(3, Some(Duration::from_millis(1500)), |comm| {
        let rank = comm.rank();
        let mut e = SyncEngine::new(&l, comm.into_inner(), o.clone())?;
        let g = grads(&l, rank, 0);
        if rank == 1 {
            // Half the tensors, then the engine (and its transport) goes away.
            for (i, gi) in g.iter().enumerate().take(l.len() / 2) {
                e.ready(i, gi)?;
            }
            drop(e);
            return Ok(None);
        }
        for (i, gi) in g.iter().enumerate() {
            e.ready(i, gi)?;
        }
        let started = std::time::Instant::now();
        let r = e.finish();
        Ok(Some((r.map(|_| ()), started.elapsed())))
    });
    for r in [0, 2] {
        let (res, took) = res[r].as_ref().unwrap().as_ref().unwrap();
        assert!(res.is_err(), "rank {r}: {res:?}");
        assert!(*took < Duration::from_secs(10), "rank {r} took {took:?}");
    }
}

/// The plans of two ranks' engines with measured `auto` over `candidates` on links of
/// `bw` bit/s, checked equal (the speeds are averaged over the ranks).
fn auto_plans(l: &[Tensor], candidates: &[CodecSpec], bw: f64) -> Vec<gradpack::sync::Plan> {
    let o = SyncOptions {
        policy: Policy::auto(candidates.to_vec()),
        network: Network {
            bandwidth_bit_s: bw,
            latency_s: 5e-6,
        },
        overlap: false,
        ..opts(Policy::uniform("fp16".parse().unwrap()))
    };
    let plans = local::run(2, Some(Duration::from_secs(20)), |comm| {
        let e = SyncEngine::new(l, comm.into_inner(), o.clone())?;
        Ok(e.plan().clone())
    });
    let plans: Vec<gradpack::sync::Plan> = plans.into_iter().map(|p| p.unwrap()).collect();
    assert_eq!(plans[0], plans[1]);
    plans
}

#[test]
fn auto_never_picks_a_codec_the_model_says_is_slower_than_fp32() {
    let l = layout();
    let candidates: Vec<CodecSpec> = ["fp16", "int8", "topk:ratio=0.01"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    for bw in [1e8, 1e10, 1e13] {
        let plans = auto_plans(&l, &candidates, bw);
        let text = plans[0].to_string();
        assert!(text.contains("bucket"), "{text}");
        for b in &plans[0].buckets {
            if b.small {
                assert!(matches!(b.codec, CodecSpec::Identity(_)));
            }
        }
        if bw >= 1e13 {
            // At 10 Tbit/s nothing compressed pays for its compute.
            assert!(
                plans[0]
                    .buckets
                    .iter()
                    .all(|b| matches!(b.codec, CodecSpec::Identity(_))),
                "{text}"
            );
        }
        if bw <= 1e8 {
            assert!(
                plans[0]
                    .buckets
                    .iter()
                    .any(|b| !matches!(b.codec, CodecSpec::Identity(_))),
                "{text}"
            );
        }
    }
}

/// Measured `auto` weighs the entropy stage by the bytes it measured it to save on its
/// calibration sample: on a slow link it takes `int8:entropy=on`, on a fast one the
/// plain `int8` (the coder's speed costs more than the bytes it saves).
#[test]
fn auto_takes_the_entropy_stage_where_its_bytes_pay() {
    let l = layout();
    let candidates: Vec<CodecSpec> = ["int8", "int8:entropy=on"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    for (bw, want) in [
        (1e7, "int8:block=256,rounding=nearest,entropy=on"),
        (2e10, "int8:block=256,rounding=nearest"),
    ] {
        let plans = auto_plans(&l, &candidates, bw);
        let text = plans[0].to_string();
        let big: Vec<_> = plans[0].buckets.iter().filter(|b| !b.small).collect();
        assert!(!big.is_empty(), "{text}");
        for b in big {
            assert_eq!(b.codec.to_string(), want, "at {bw} bit/s: {text}");
        }
    }
}

#[test]
fn bad_calls_are_errors() {
    let l = layout();
    let w = local::Local::world(1).pop().unwrap();
    let mut e = SyncEngine::new(&l, w, opts(Policy::uniform("fp16".parse().unwrap()))).unwrap();
    assert!(e.ready(99, &[]).is_err());
    assert!(matches!(
        e.ready(1, &[0.0; 3]),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(e.grad(0).is_err());
    assert!(e.finish().is_err());
    e.ready(0, &[1.0; 10]).unwrap();
    assert!(e.ready(0, &[1.0; 10]).is_err(), "given twice");
    assert!(e.save().is_err(), "mid-step");
    // Missing tensors: an error naming them; the engine goes on.
    match e.finish() {
        Err(Error::Collective(m)) => assert!(m.contains("head.weight"), "{m}"),
        other => panic!("{other:?}"),
    }
    e.reset_feedback().unwrap();
    let g = grads(&l, 0, 0);
    for (i, gi) in g.iter().enumerate() {
        e.ready(i, gi).unwrap();
    }
    e.finish().unwrap();
    // One rank, mean: every gradient comes back as it went in (fp16 rounding aside).
    for (i, gi) in g.iter().enumerate() {
        let back = e.grad(i).unwrap();
        for (a, b) in back.iter().zip(gi) {
            assert_eq!(*a, half::f16::from_f32(*b).to_f32());
        }
    }
}

#[test]
fn by_node_ranks_agree_match_the_mean_and_checkpoints_continue() {
    use gradpack::collective::Nodes;
    // 5 ranks on nodes of 3 and 2; int8 with error feedback between nodes.
    let o = SyncOptions {
        feedback: Feedback::Worker,
        nodes: Some(Nodes::uniform(5, 3).unwrap()),
        ..opts(Policy::with_rules("int8".parse().unwrap()))
    };
    let l = layout();
    let got = identical_on_every_rank(5, &o, 3);
    // Step 0 has no residual yet: each element within int8's bound of the exact mean.
    for (i, t) in l.iter().enumerate() {
        let n = t.len().unwrap();
        let mut mean = vec![0f64; n];
        let mut amax = 0f64;
        for rank in 0..5 {
            let g = &grads(&l, rank, 0)[i];
            for (m, &v) in mean.iter_mut().zip(g) {
                *m += v as f64 / 5.0;
            }
            amax += g.iter().fold(0f64, |a, &v| a.max(v.abs() as f64));
        }
        for (j, (&a, &b)) in got[0][0][i].iter().zip(&mean).enumerate() {
            assert!(
                (a as f64 - b).abs() <= amax / 127.0 / 5.0 * 2.0 + 1e-6,
                "{} [{j}]: {a} vs {b}",
                t.name
            );
        }
    }
    // Save after two steps, restore into a fresh engine: the third step is the same.
    let resumed = local::run(5, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        let mut e = SyncEngine::new(&l, comm.into_inner(), o.clone())?;
        for step in 0..2 {
            let g = grads(&l, rank, step);
            for (i, gi) in g.iter().enumerate() {
                e.ready(i, gi)?;
            }
            e.finish()?;
        }
        let blob = e.save()?;
        let t = e.into_transport()?;
        let mut f = SyncEngine::new(&l, t, o.clone())?;
        f.restore(&blob)?;
        let g = grads(&l, rank, 2);
        for (i, gi) in g.iter().enumerate() {
            f.ready(i, gi)?;
        }
        f.finish()?;
        Ok((0..l.len())
            .map(|i| f.grad(i).unwrap().to_vec())
            .collect::<Vec<_>>())
    });
    for (rank, r) in resumed.into_iter().enumerate() {
        assert_eq!(bits(&[r.unwrap()]), bits(&got[rank][2..3]), "rank {rank}");
    }
}

/// The plan every one of `p` ranks makes with `o` (asserted the same on all).
fn plan_of(p: usize, o: &SyncOptions) -> gradpack::sync::Plan {
    let plans: Vec<_> = local::run(p, Some(Duration::from_secs(20)), |comm| {
        Ok(SyncEngine::new(&layout(), comm.into_inner(), o.clone())?
            .plan()
            .clone())
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    assert!(
        plans.iter().all(|q| *q == plans[0]),
        "ranks agree on the plan"
    );
    plans.into_iter().next().unwrap()
}

/// `steps` steps on `p` ranks, asserted to end with the same bits on every rank.
fn identical_on_every_rank(p: usize, o: &SyncOptions, steps: u64) -> Vec<Steps> {
    let got: Vec<Steps> = run(p, o, steps, in_order)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    for r in 1..p {
        assert_eq!(bits(&got[r]), bits(&got[0]), "rank {r}");
    }
    got
}

#[test]
fn the_planner_goes_by_node_where_the_link_inside_nodes_pays() {
    use gradpack::collective::Nodes;
    use gradpack::sync::Network;
    // 6 ranks on 2 nodes of 3; int8 over a 1 Gbit/s link between nodes.
    let base = SyncOptions {
        nodes: Some(Nodes::uniform(6, 3).unwrap()),
        network: Network {
            bandwidth_bit_s: 1e9,
            latency_s: 50e-6,
        },
        ..opts(Policy::with_rules("int8".parse().unwrap()))
    };
    let inside = |bandwidth_bit_s: f64| SyncOptions {
        node_network: Some(Network {
            bandwidth_bit_s,
            latency_s: 2e-6,
        }),
        ..base.clone()
    };
    // A link inside nodes 100 times faster: the large buckets go by node (the uplinks
    // carry 2 (n - 1) / n of the bucket instead of 2 (p - 1) / p), and they are modelled
    // faster than flat.
    let fast = plan_of(6, &inside(100e9));
    let big: Vec<bool> = fast
        .buckets
        .iter()
        .filter(|b| b.elements > 30_000)
        .map(|b| b.by_node)
        .collect();
    assert!(!big.is_empty() && big.iter().all(|&b| b), "{fast}");
    assert!(format!("{fast}").contains("by node"));
    // A link inside nodes slower than the one between them: every bucket flat.
    let slow = plan_of(6, &inside(0.1e9));
    assert!(slow.buckets.iter().all(|b| !b.by_node), "{slow}");
    // Without a link inside nodes, every bucket goes by node, as before.
    assert!(plan_of(6, &base).buckets.iter().all(|b| b.by_node));
    // A plan that mixes the two runs, and every rank ends with the same bits.
    let mixed = inside(3e9);
    let p = plan_of(6, &mixed);
    let ways: Vec<bool> = p.buckets.iter().map(|b| b.by_node).collect();
    assert!(ways.contains(&true) && ways.contains(&false), "{p}");
    identical_on_every_rank(6, &mixed, 2);
}

#[test]
fn ranks_made_with_different_options_fail_every_step_naming_the_option() {
    let l = layout();
    let base = opts(Policy::uniform("int8".parse().unwrap()));
    let cases = [
        (
            "seed",
            SyncOptions {
                seed: 6,
                ..base.clone()
            },
        ),
        (
            "op",
            SyncOptions {
                op: ReduceOp::Sum,
                ..base.clone()
            },
        ),
        (
            "pieces",
            SyncOptions {
                pieces: 2,
                ..base.clone()
            },
        ),
        (
            "feedback",
            SyncOptions {
                feedback: Feedback::Worker,
                ..base.clone()
            },
        ),
        (
            "momentum",
            SyncOptions {
                momentum: 0.9,
                ..base.clone()
            },
        ),
        (
            "start_step",
            SyncOptions {
                start_step: 1,
                ..base.clone()
            },
        ),
    ];
    for (name, other) in cases {
        let res = local::run(3, Some(Duration::from_secs(10)), |comm| {
            let rank = comm.rank();
            let o = if rank == 2 {
                other.clone()
            } else {
                base.clone()
            };
            let mut e = SyncEngine::new(&l, comm.into_inner(), o)?;
            let mut errors = Vec::new();
            for step in 0..3 {
                let g = grads(&l, rank, step);
                let r = (|| {
                    for (i, gi) in g.iter().enumerate() {
                        e.ready(i, gi)?;
                    }
                    e.finish().map(|_| ())
                })();
                errors.push(r.expect_err("a step on options that differ").to_string());
                e.reset_feedback()?;
            }
            Ok(errors)
        });
        for (r, errors) in res.iter().enumerate() {
            let errors = errors.as_ref().unwrap();
            assert!(
                errors[0].contains(&format!("{name}=")),
                "{name}: rank {r}: {errors:?}"
            );
            assert_eq!(errors.len(), 3);
        }
    }
}

/// Each rank's velocities `u = m u + g` over `steps` steps of [`grads`], as f32 with
/// one rounding per operation.
fn velocities(l: &[Tensor], rank: usize, steps: u64, m: f32) -> Vec<Vec<Vec<f32>>> {
    let mut u: Vec<Vec<f32>> = l.iter().map(|t| vec![0.0; t.len().unwrap()]).collect();
    (0..steps)
        .map(|step| {
            let g = grads(l, rank, step);
            for (u, g) in u.iter_mut().zip(&g) {
                for (u, &g) in u.iter_mut().zip(g) {
                    *u = m * *u + g;
                }
            }
            u.clone()
        })
        .collect()
}

#[test]
fn momentum_correction_all_reduces_the_velocities_and_resumes_exactly() {
    // With momentum m, the engine given the gradients returns, bit for bit, what an
    // engine without it returns when given each rank's velocities u = m u + g: int8 with
    // error feedback at both sites, 3 ranks, by the ring and (the small tensors) in f32.
    let m = 0.9f32;
    let base = SyncOptions {
        feedback: Feedback::WorkerAndOwner,
        ..opts(Policy::with_rules("int8".parse().unwrap()))
    };
    let corrected = SyncOptions {
        momentum: m,
        ..base.clone()
    };
    let (p, steps) = (3, 4);
    let got: Vec<Steps> = run(p, &corrected, steps, in_order)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let l = layout();
    let want = run_fed(p, &base, steps, |rank, step| {
        velocities(&l, rank, step + 1, m).pop().unwrap()
    });
    for (r, want) in want.into_iter().enumerate() {
        assert_eq!(bits(&got[r]), bits(&want), "rank {r}");
        assert_eq!(bits(&got[r]), bits(&got[0]), "rank {r} against rank 0");
    }
    // Without momentum the results differ (the velocities are not the gradients).
    let plain: Steps = run(p, &base, steps, in_order).remove(0).unwrap();
    assert_ne!(bits(&plain[1..]), bits(&got[0][1..]));
    // Two steps, save, a fresh engine restored, two more: the straight run's bits.
    let resumed = local::run(p, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        let mut e = SyncEngine::new(&l, comm.into_inner(), corrected.clone())?;
        feed(&mut e, 0..2, |s| grads(&l, rank, s), |_| in_order(rank, 0))?;
        let blob = e.save()?;
        // A blob without velocities is another engine's, and so is this one to it.
        let w = local::Local::world(1).pop().unwrap();
        let single = |o: &SyncOptions| SyncOptions {
            overlap: false,
            ..o.clone()
        };
        let mut plain = SyncEngine::new(&l, w, single(&base))?;
        assert!(matches!(plain.restore(&blob), Err(Error::Checkpoint(_))));
        let w = local::Local::world(1).pop().unwrap();
        let mut other = SyncEngine::new(&l, w, single(&corrected))?;
        assert!(matches!(
            other.restore(&plain.save()?),
            Err(Error::Checkpoint(_))
        ));
        let t = e.into_transport()?;
        let mut e = SyncEngine::new(&l, t, corrected.clone())?;
        e.restore(&blob)?;
        feed(
            &mut e,
            2..steps,
            |s| grads(&l, rank, s),
            |_| in_order(rank, 0),
        )
    });
    for (r, res) in resumed.into_iter().enumerate() {
        assert_eq!(bits(&res.unwrap()), bits(&got[r][2..]), "rank {r}");
    }
    // Momentum outside [0, 1) is refused.
    for bad in [1.0f32, -0.1, f32::NAN, f32::INFINITY] {
        let w = local::Local::world(1).pop().unwrap();
        let o = SyncOptions {
            momentum: bad,
            ..base.clone()
        };
        match SyncEngine::new(&l, w, o) {
            Err(Error::Collective(msg)) => assert!(msg.contains("momentum"), "{msg}"),
            other => panic!("momentum {bad}: {other:?}"),
        }
    }
}

#[test]
fn steps_before_the_start_step_go_in_f32_and_compression_starts_clean() {
    // start_step 2 with int8 and error feedback at both sites on 3 ranks: steps 0 and 1
    // are the f32 mean (within the f32 ring's rounding, the same bits on every rank),
    // and steps 2 and 3 are, bit for bit, those of an engine that compressed from step 0
    // but was given zero gradients before step 2 (so its residuals start at zero too):
    // compression starts clean, with the seeds of its step.
    let base = SyncOptions {
        feedback: Feedback::WorkerAndOwner,
        ..opts(Policy::with_rules("int8".parse().unwrap()))
    };
    let warm = SyncOptions {
        start_step: 2,
        ..base.clone()
    };
    let (p, steps) = (3, 4);
    let got: Vec<Steps> = run(p, &warm, steps, in_order)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let l = layout();
    let zero_first = run_fed(p, &base, steps, |rank, step| {
        let mut g = grads(&l, rank, step);
        if step < 2 {
            g.iter_mut()
                .for_each(|t| t.iter_mut().for_each(|v| *v = 0.0));
        }
        g
    });
    for (r, z) in zero_first.into_iter().enumerate() {
        assert_eq!(bits(&got[r][2..]), bits(&z[2..]), "rank {r}");
        assert_eq!(bits(&got[r]), bits(&got[0]), "rank {r} against rank 0");
    }
    for step in 0..2u64 {
        let all: Vec<_> = (0..p).map(|r| grads(&l, r, step)).collect();
        for (i, t) in got[0][step as usize].iter().enumerate() {
            for (j, &v) in t.iter().enumerate() {
                let exact: f64 = all.iter().map(|g| f64::from(g[i][j])).sum::<f64>() / p as f64;
                let scale: f64 = all.iter().map(|g| f64::from(g[i][j]).abs()).sum::<f64>();
                assert!(
                    (f64::from(v) - exact).abs() <= 4.0 * f64::from(f32::EPSILON) * scale,
                    "step {step} tensor {i}[{j}]: {v} against {exact}"
                );
            }
        }
    }
}

#[test]
fn unbounded_caps_give_one_selection_over_the_model() {
    // Top-k 5% with error feedback and both caps at usize::MAX: every compressed tensor
    // (those above the small-tensor size) in one bucket, so the top-k is over all of
    // them together; the small ones in buckets of their own; the same bits on every rank.
    let o = SyncOptions {
        bucket_cap_bytes: usize::MAX,
        first_bucket_cap_bytes: usize::MAX,
        feedback: Feedback::Worker,
        ..opts(Policy::with_rules(
            "topk:ratio=0.05,values=fp16".parse().unwrap(),
        ))
    };
    let plan = plan_of(2, &o);
    let l = layout();
    let compressed: Vec<_> = plan.buckets.iter().filter(|b| !b.small).collect();
    assert_eq!(compressed.len(), 1, "{plan:?}");
    let mut want: Vec<usize> = (0..l.len())
        .filter(|&i| l[i].len().unwrap() >= gradpack::sync::SMALL_TENSOR && l[i].shape.len() > 1)
        .collect();
    let mut got = compressed[0].tensors.clone();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want);
    identical_on_every_rank(2, &o, 3);
}

/// Speeds of `specs` as a user would pass them (from `gradpack report --json`, say).
fn given_profiles(specs: &[&str]) -> Vec<gradpack::cost::CodecProfile> {
    specs
        .iter()
        .map(|s| gradpack::cost::CodecProfile {
            encode_bytes_per_s: 4e9,
            decode_bytes_per_s: 6e9,
            decode_add_bytes_per_s: 5e9,
            ..gradpack::cost::CodecProfile::nominal(*s, 32.0)
        })
        .collect()
}

#[test]
fn measured_auto_decides_alike_everywhere_as_the_tuner_does_and_resumes() {
    use gradpack::sync::{CodecChoice, Route, TuneOptions, Tuner};
    let specs = ["fp16", "int8"];
    let candidates: Vec<CodecSpec> = specs.iter().map(|s| s.parse().unwrap()).collect();
    let o = SyncOptions {
        policy: Policy {
            codec: CodecChoice::Auto {
                candidates: candidates.clone(),
                profiles: Some(given_profiles(&specs)),
            },
            ..Policy::auto(vec![])
        },
        network: Network {
            bandwidth_bit_s: 1e9,
            latency_s: 20e-6,
        },
        feedback: Feedback::WorkerAndOwner,
        trials: 2,
        trial_steps: 2,
        ..opts(Policy::uniform("fp16".parse().unwrap()))
    };
    // Float32 and two trials of two steps each: decided after the sixth step.
    let (p, steps) = (3, 9u64);
    let l = layout();
    let res = local::run(p, Some(Duration::from_secs(30)), |comm| {
        let rank = comm.rank();
        let mut e = SyncEngine::new(&l, comm.into_inner(), o.clone())?;
        let model = e.plan().clone();
        let mut out = feed(&mut e, 0..6, |s| grads(&l, rank, s), |_| in_order(rank, 0))?;
        let rows = e.trials();
        let decided = e.plan().clone();
        let blob = e.save()?;
        // The straight run goes on; a fresh engine restored from the blob runs the
        // same steps after it.
        out.extend(feed(
            &mut e,
            6..steps,
            |s| grads(&l, rank, s),
            |_| in_order(rank, 0),
        )?);
        let t = e.into_transport()?;
        let mut fresh = SyncEngine::new(&l, t, o.clone())?;
        assert_eq!(fresh.plan(), &model);
        fresh.restore(&blob)?;
        assert_eq!(fresh.plan(), &decided);
        let resumed = feed(
            &mut fresh,
            6..steps,
            |s| grads(&l, rank, s),
            |_| in_order(rank, 0),
        )?;
        let rows_after = fresh.trials();
        Ok((out, rows, decided, resumed, rows_after))
    });
    let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
    let (out0, rows0, plan0, _, _) = &res[0];
    let measured: Vec<_> = rows0.iter().filter(|r| r.measured_s.is_some()).collect();
    assert!(!measured.is_empty(), "{rows0:?}");
    for (rank, (out, rows, plan, resumed, rows_after)) in res.iter().enumerate() {
        // The same decision, the same bits, on every rank.
        assert_eq!(rows, rows0, "rank {rank}");
        assert_eq!(plan, plan0, "rank {rank}");
        assert_eq!(bits(out), bits(out0), "rank {rank}");
        // Restored, the engine measures nothing again and continues bit for bit.
        assert_eq!(bits(resumed), bits(&out[6..]), "rank {rank}");
        assert!(
            rows_after
                .iter()
                .all(|r| r.measured_s.is_some() || r.modelled_s.is_some())
        );
        assert!(
            rows_after.iter().filter(|r| r.chosen).count()
                == rows.iter().filter(|r| r.chosen).count()
        );
    }
    // Per measured bucket: float32 first, the kept one never measured slower, and its
    // decision shown in the plan.
    let buckets: std::collections::BTreeSet<usize> = measured.iter().map(|r| r.bucket).collect();
    for &b in &buckets {
        let rows: Vec<_> = rows0.iter().filter(|r| r.bucket == b).collect();
        assert_eq!(rows[0].config.route, Route::Fp32);
        assert_eq!(rows.len(), 3);
        let kept = rows.iter().find(|r| r.chosen).expect("decided");
        assert!(kept.measured_s.unwrap() <= rows[0].measured_s.unwrap());
        let bp = &plan0.buckets[b];
        let codec = kept.config.codec.unwrap();
        assert_eq!(bp.codec, codec, "bucket {b}");
    }
    // One code path decides: a tuner with the same options, fed the same measured
    // times, keeps the same configuration.
    let mut profiles = given_profiles(&specs);
    profiles.push(gradpack::cost::CodecProfile::nominal("identity", 32.0));
    let tune = TuneOptions {
        candidates,
        network: o.network,
        trials: 2,
        trial_steps: 1,
        ..TuneOptions::default()
    };
    let plan = &plan0;
    for &b in &buckets {
        let rows: Vec<_> = rows0.iter().filter(|r| r.bucket == b).collect();
        let mut t = Tuner::new(p, tune.clone(), profiles.clone()).unwrap();
        let ts: Vec<Tensor> = plan.buckets[b]
            .tensors
            .iter()
            .map(|&i| l[i].clone())
            .collect();
        let mut trial = None;
        for r in &rows {
            let turn = t.next(b, &ts, None).unwrap();
            assert_eq!(
                turn.config, r.config,
                "the same shortlist, in the same order"
            );
            assert_eq!(
                t.note(turn.trial.unwrap(), 1.0).unwrap().is_some(),
                r == rows.last().unwrap()
            );
            trial = turn.trial;
        }
        let means: Vec<f64> = rows.iter().map(|r| r.measured_s.unwrap()).collect();
        t.decide(trial.unwrap(), &means).unwrap();
        let kept = rows.iter().find(|r| r.chosen).unwrap();
        assert_eq!(t.choice_of(&ts[0].name), Some(&kept.config));
    }
}

#[test]
fn measured_auto_options_are_checked() {
    let l = layout();
    let w = || local::Local::world(1).pop().unwrap();
    let fixed = SyncOptions {
        trials: 2,
        ..opts(Policy::uniform("int8".parse().unwrap()))
    };
    match SyncEngine::new(&l, w(), fixed) {
        Err(Error::Collective(m)) => assert!(m.contains("auto"), "{m}"),
        other => panic!("{other:?}"),
    }
    let steps = SyncOptions {
        trial_steps: 0,
        ..opts(Policy::auto(vec!["int8".parse().unwrap()]))
    };
    assert!(SyncEngine::new(&l, w(), steps).is_err());
}

// ---------------------------------------------------------------- ModelSelection

/// A model for one top-k over the whole model: three matrices (the last with entries a
/// thousand times smaller), a vector and a matrix under `small_below` (both float32).
fn model_tensors() -> Vec<HeldTensor> {
    [
        ("w0", vec![8, 16]),
        ("b0", vec![16]),
        ("w1", vec![20, 10]),
        ("tiny", vec![2, 2]),
        ("w2", vec![30, 5]),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, shape))| HeldTensor {
        tensor: Tensor::new(name, &shape),
        key: 100 + i as u64,
    })
    .collect()
}

/// Rank `rank`'s gradient of tensor `t` at `step`.
fn model_grad(t: &HeldTensor, rank: usize, step: u64) -> Vec<f32> {
    let n = t.tensor.len().unwrap();
    let small = if t.tensor.name == "w2" { 1e-3 } else { 1.0 };
    (0..n)
        .map(|i| {
            // splitmix64 of the tensor, element, rank and step.
            let mut h = t.key ^ (i as u64) << 16 ^ (rank as u64) << 40 ^ step << 48;
            h = h.wrapping_add(0x9E37_79B9_7F4A_7C15);
            h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            h ^= h >> 31;
            ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * small
        })
        .collect()
}

/// A bucket `data` of the tensors `bucket` (indices into `tensors`) laid end to end,
/// copied out into each tensor's place of `by_tensor`.
fn split_by_tensor(
    tensors: &[HeldTensor],
    bucket: &[usize],
    data: &[f32],
    by_tensor: &mut [Vec<f32>],
) {
    let mut at = 0;
    for &t in bucket {
        let n = tensors[t].tensor.len().unwrap();
        by_tensor[t] = data[at..at + n].to_vec();
        at += n;
    }
}

/// Residuals (or velocities) by tensor name.
type Named = Vec<(String, Vec<f32>)>;

/// Each step's buckets as tensor indices into [`model_tensors`].
type Grouping = Vec<Vec<usize>>;

/// Per rank and step: each tensor's mean by name (in `model_tensors` order) after
/// reducing the step's gradients grouped by `groups(rank, step)` with `sel(rank)`, and
/// the selection's residuals after the last step.
#[allow(clippy::type_complexity)]
fn run_model(
    steps: u64,
    groups: impl Fn(usize, u64) -> Grouping + Sync,
    sel: impl Fn(usize) -> Result<ModelSelection> + Sync,
    skip: impl Fn(u64) -> Option<usize> + Sync,
) -> Vec<(Vec<Vec<Vec<f32>>>, Vec<(String, Vec<f32>)>)> {
    let tensors = model_tensors();
    local::run(3, Some(Duration::from_secs(20)), |mut comm| {
        let rank = comm.rank();
        let mut g = BucketGather::new(&comm, 7, ReduceOp::Mean)?;
        let mut s = sel(rank)?;
        let mut send = Vec::new();
        let mut out = Vec::new();
        for step in 0..steps {
            let groups: Grouping = groups(rank, step)
                .into_iter()
                .map(|b| b.into_iter().filter(|&t| Some(t) != skip(step)).collect())
                .collect();
            let held: Vec<Vec<HeldTensor>> = groups
                .iter()
                .map(|b| b.iter().map(|&t| tensors[t].clone()).collect())
                .collect();
            let mut data: Vec<Vec<f32>> = held
                .iter()
                .map(|b| b.iter().flat_map(|t| model_grad(t, rank, step)).collect())
                .collect();
            let mut buckets: Vec<(&mut [f32], &[HeldTensor])> = data
                .iter_mut()
                .zip(&held)
                .map(|(d, h)| (d.as_mut_slice(), h.as_slice()))
                .collect();
            s.reduce(&mut g, &mut comm, &mut send, &mut buckets, 11, step, true)?;
            let mut by_tensor = vec![Vec::new(); tensors.len()];
            for (b, d) in groups.iter().zip(&data) {
                split_by_tensor(&tensors, b, d, &mut by_tensor);
            }
            out.push(by_tensor);
        }
        Ok((out, s.residuals()))
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn topk_model(feedback: bool) -> impl Fn(usize) -> Result<ModelSelection> + Sync {
    move |_| {
        let names: Vec<String> = model_tensors()
            .iter()
            .map(|t| t.tensor.name.clone())
            .collect();
        ModelSelection::new("topk:ratio=0.05".parse()?, feedback, 8, false, &names)
    }
}

fn f32_bits<'a>(x: impl IntoIterator<Item = &'a Vec<Vec<f32>>>) -> Vec<u32> {
    x.into_iter()
        .flatten()
        .flatten()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn model_selection_is_one_top_k_over_the_model_whatever_the_grouping() {
    let one = |_: usize, _: u64| vec![vec![0, 1, 2, 3, 4]];
    // Every rank its own grouping and order, changing from step to step (DDP regroups).
    let mixed = |rank: usize, step: u64| match (rank + step as usize) % 3 {
        0 => vec![vec![4, 3], vec![1, 0], vec![2]],
        1 => vec![vec![2, 0], vec![1], vec![3, 4]],
        _ => vec![vec![0, 1, 2, 3, 4]],
    };
    let none = |_: u64| None;
    let a = run_model(4, one, topk_model(true), none);
    let b = run_model(4, mixed, topk_model(true), none);
    for r in 0..3 {
        // The same bits on every rank, and whatever the grouping.
        assert_eq!(f32_bits(&a[r].0), f32_bits(&a[0].0), "rank {r}");
        assert_eq!(f32_bits(&b[r].0), f32_bits(&a[0].0), "rank {r} regrouped");
        assert_eq!(b[r].1, a[r].1, "rank {r}: residuals");
    }
    // One selection over the model: w2's entries (a thousand times smaller) are never
    // among the largest 5% at the first step (no residual yet), though a top-k of its
    // own would keep 5% of them; w0 and w1 get entries.
    let first = &a[0].0[0];
    assert!(first[4].iter().all(|&v| v == 0.0));
    assert!(first[0].iter().any(|&v| v != 0.0) && first[2].iter().any(|&v| v != 0.0));
    // The float32 tensors (a vector, one under small_below) are the mean of the ranks.
    for t in [1, 3] {
        let tensors = model_tensors();
        let want: Vec<f32> = (0..model_grad(&tensors[t], 0, 0).len())
            .map(|i| {
                (0..3)
                    .map(|r| model_grad(&tensors[t], r, 0)[i] as f64)
                    .sum::<f64>()
                    / 3.0
            })
            .map(|v| v as f32)
            .collect();
        for (g, w) in first[t].iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                "tensor {t}: {g} vs {w}"
            );
        }
    }
    // Without error feedback there are no residuals.
    let c = run_model(1, one, topk_model(false), none);
    assert!(c[0].1.is_empty());
}

#[test]
fn model_selection_residuals_follow_names_and_restore_exactly() {
    let one = |_: usize, _: u64| vec![vec![0, 1, 2, 3, 4]];
    // w1 is frozen at step 1: its residual waits, by name, for step 2.
    let frozen = |step: u64| (step == 1).then_some(2);
    let a = run_model(2, one, topk_model(true), |_| None);
    let held = run_model(2, one, topk_model(true), frozen);
    let w1_after_0 = run_model(1, one, topk_model(true), |_| None);
    for r in 0..3 {
        let of = |res: &[(String, Vec<f32>)], n: &str| {
            res.iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(of(&held[r].1, "w1"), of(&w1_after_0[r].1, "w1"), "rank {r}");
        assert!(held[r].0[1][2].is_empty(), "w1 was not in step 1");
        // Only the compressed tensors have residuals.
        let names: Vec<&str> = a[r].1.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["w0", "w1", "w2"]);
    }
    // Residuals restored into a new selection: it continues as the first one did.
    let straight = run_model(3, one, topk_model(true), |_| None);
    let saved = run_model(2, one, topk_model(true), |_| None);
    let resumed = local::run(3, Some(Duration::from_secs(20)), |mut comm| {
        let rank = comm.rank();
        let mut s = topk_model(true)(rank)?;
        s.restore(saved[rank].1.clone());
        let mut g = BucketGather::new(&comm, 7, ReduceOp::Mean)?;
        let tensors = model_tensors();
        let mut x: Vec<f32> = tensors
            .iter()
            .flat_map(|t| model_grad(t, rank, 2))
            .collect();
        s.reduce(
            &mut g,
            &mut comm,
            &mut Vec::new(),
            &mut [(&mut x, &tensors)],
            11,
            2,
            true,
        )?;
        Ok(x)
    });
    for (r, x) in resumed.into_iter().enumerate() {
        let want: Vec<f32> = straight[r].0[2].iter().flatten().copied().collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x.unwrap()), bits(&want), "rank {r}");
    }
}

#[test]
fn model_selection_refuses_bad_calls_and_changes_nothing() {
    let names = vec!["a".to_string()];
    assert!(ModelSelection::new("int8".parse().unwrap(), true, 0, false, &names).is_err());
    let res = local::run(1, None, |mut comm| {
        let mut g = BucketGather::new(&comm, 1, ReduceOp::Mean)?;
        let mut s = ModelSelection::new("topk:k=2".parse()?, true, 0, false, &names)?;
        let t = [HeldTensor {
            tensor: Tensor::new("a", &[2, 3]),
            key: 1,
        }];
        let mut reduce = |s: &mut ModelSelection, x: &mut Vec<f32>| {
            let send = &mut Vec::new();
            s.reduce(&mut g, &mut comm, send, &mut [(x, &t)], 0, 0, false)
        };
        // A bucket whose tensors do not add up to it.
        let mut x = vec![1.0f32; 7];
        let e = reduce(&mut s, &mut x);
        assert!(matches!(e, Err(Error::Collective(_))), "{e:?}");
        assert_eq!(x, vec![1.0; 7]);
        // A restored residual of another length: refused when its tensor comes, and kept.
        s.restore(vec![("a".into(), vec![0.5; 5])]);
        let mut x = vec![1.0f32; 6];
        assert!(reduce(&mut s, &mut x).is_err());
        assert_eq!(x, vec![1.0; 6]);
        assert_eq!(s.residuals(), vec![("a".to_string(), vec![0.5; 5])]);
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn momentum_by_name_is_the_engines_velocity_whatever_the_buckets() {
    // The layout's tensors in buckets that change every step (and one tensor missing at
    // step 2, as a frozen layer): each bucket comes back holding its tensors' velocities,
    // bit for bit those the engine's arithmetic gives; saved and restored by name, a new
    // Momentum continues alike.
    let l = layout();
    let m = 0.9f32;
    let want = velocities(&l, 1, 4, m);
    let groupings: [&[&[usize]]; 4] = [
        &[&[0, 1, 2, 3, 4, 5, 6, 7, 8]],
        &[&[8, 1], &[0, 7, 6], &[5, 4, 3, 2]],
        &[&[0, 1, 2], &[3, 4], &[5, 6, 7]],
        &[&[2, 3, 8], &[7, 6, 5, 4, 1, 0]],
    ];
    let mut mo = Momentum::new(m).unwrap();
    let mut saved = Vec::new();
    for (step, groups) in groupings.iter().enumerate() {
        if step == 3 {
            // Restored into a new one from what was saved after step 2.
            mo = Momentum::new(m).unwrap();
            mo.restore(saved.clone());
        }
        let g = grads(&l, 1, step as u64);
        for b in groups.iter() {
            let ts: Vec<Tensor> = b.iter().map(|&t| l[t].clone()).collect();
            let mut x: Vec<f32> = b.iter().flat_map(|&t| g[t].clone()).collect();
            mo.apply(&ts, &mut x).unwrap();
            let mut at = 0;
            for &t in b.iter() {
                let n = l[t].len().unwrap();
                // Tensor 8 sat out step 2: its velocity is one step behind from there.
                let w = if t == 8 && step == 3 {
                    let mut u = want[1][8].clone();
                    for (u, &g) in u.iter_mut().zip(&g[8]) {
                        *u = m * *u + g;
                    }
                    u
                } else {
                    want[step][t].clone()
                };
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&x[at..at + n]), bits(&w), "step {step} tensor {t}");
                at += n;
            }
        }
        if step == 2 {
            saved = mo.velocities();
            assert_eq!(saved.len(), l.len());
        }
    }
}

#[test]
fn momentum_by_name_refuses_bad_calls_and_changes_nothing() {
    for m in [-0.1, 1.0, f32::NAN] {
        assert!(Momentum::new(m).is_err(), "{m}");
    }
    let mut mo = Momentum::new(0.5).unwrap();
    let t = [Tensor::new("a", &[2, 2]), Tensor::new("b", &[3])];
    let mut x = vec![1.0f32; 7];
    mo.apply(&t, &mut x).unwrap();
    let before = mo.velocities();
    // A bucket its tensors do not fill, and a velocity of another length.
    let mut short = vec![2.0f32; 6];
    assert!(mo.apply(&t, &mut short).is_err());
    assert_eq!(short, vec![2.0; 6]);
    let other = [Tensor::new("a", &[5]), Tensor::new("c", &[2])];
    let mut y = vec![2.0f32; 7];
    assert!(mo.apply(&other, &mut y).is_err());
    assert_eq!(y, vec![2.0; 7]);
    assert_eq!(mo.velocities(), before);
}

#[test]
fn tensor_gather_keeps_residuals_by_name_across_regroupings() {
    // The model's tensors with a codec each (top-k with error feedback by default, int8
    // without, float32 for the vector and the small matrix, one left to the caller),
    // regrouped every step on every rank: the results and residuals are those of one
    // bucket in a fixed order, and a restored TensorGather continues alike.
    let tensors = model_tensors();
    let codec_of = |t: usize| -> Option<CodecSpec> {
        match t {
            0 => Some("topk:ratio=0.1".parse().unwrap()),
            2 => Some("int8".parse().unwrap()),
            4 => None,
            _ => Some("identity".parse().unwrap()),
        }
    };
    // Steps `steps` on 3 ranks, grouped by `groups`, from each rank's `start` residuals
    // (none if empty): each step's means by tensor, and the residuals after.
    let run = |steps: std::ops::Range<u64>,
               groups: &(dyn Fn(usize, u64) -> Grouping + Sync),
               start: &[Named]| {
        local::run(3, Some(Duration::from_secs(20)), |mut comm| {
            let rank = comm.rank();
            let mut g = BucketGather::new(&comm, 3, ReduceOp::Mean)?;
            let mut tg = TensorGather::new(None);
            if let Some(saved) = start.get(rank) {
                tg.restore(saved.clone());
            }
            let mut out = Vec::new();
            for step in steps.clone() {
                let mut by_tensor = vec![Vec::new(); tensors.len()];
                for b in groups(rank, step) {
                    let held: Vec<(HeldTensor, Option<CodecSpec>)> = b
                        .iter()
                        .map(|&t| (tensors[t].clone(), codec_of(t)))
                        .collect();
                    let mut x: Vec<f32> = b
                        .iter()
                        .flat_map(|&t| model_grad(&tensors[t], rank, step))
                        .collect();
                    let send = &mut Vec::new();
                    tg.reduce(&mut g, &mut comm, send, &mut x, &held, 5, step, false)?;
                    split_by_tensor(&tensors, &b, &x, &mut by_tensor);
                }
                out.push(by_tensor);
            }
            Ok((out, tg.residuals()))
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let one = |_: usize, _: u64| vec![vec![0, 1, 2, 3, 4]];
    let regrouped = |_: usize, step: u64| match step % 3 {
        0 => vec![vec![4, 3], vec![1, 0], vec![2]],
        1 => vec![vec![2, 0, 1], vec![3, 4]],
        _ => vec![vec![0], vec![1, 2, 3, 4]],
    };
    let a = run(0..4, &one, &[]);
    let b = run(0..4, &regrouped, &[]);
    for r in 0..3 {
        assert!(f32_bits(&b[r].0) == f32_bits(&a[r].0), "rank {r}");
        // Every rank has the same means (the tensor left to the caller aside).
        let reduced = |x: &[Vec<Vec<f32>>]| -> Vec<u32> {
            let kept: Vec<Vec<Vec<f32>>> = x.iter().map(|s| s[..4].to_vec()).collect();
            f32_bits(&kept)
        };
        assert!(
            reduced(&a[r].0) == reduced(&a[0].0),
            "rank {r} against rank 0"
        );
        assert_eq!(b[r].1, a[r].1, "rank {r}: residuals");
        // Only top-k (error feedback by default) has a residual; the tensor left to
        // the caller is as it was.
        let names: Vec<&str> = a[r].1.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["w0"]);
        assert_eq!(a[r].0[0][4], model_grad(&tensors[4], r, 0));
    }
    // Restored after 2 steps, through the blob of a NamedState (what the PyTorch hook
    // saves too), a new one gives steps 2 and 3 as the first did.
    let saved: Vec<Named> = run(0..2, &one, &[])
        .into_iter()
        .map(|r| {
            let residuals = r.1;
            let blob = NamedState {
                step: 2,
                residuals,
                ..NamedState::default()
            }
            .save();
            NamedState::restore(&blob).expect("reads").residuals
        })
        .collect();
    let c = run(2..4, &one, &saved);
    for r in 0..3 {
        assert!(f32_bits(&c[r].0) == f32_bits(&a[r].0[2..]), "rank {r}");
    }
}

#[test]
fn tensor_gather_refuses_bad_calls_and_changes_nothing() {
    // The default choice of error feedback, and a choice given.
    let spec = |s: &str| -> CodecSpec { s.parse().unwrap() };
    for (c, on) in [
        ("topk:k=3", true),
        ("chunktopk:chunk=64,k=2", true),
        ("sign", true),
        ("int8", false),
        ("fp16", false),
        ("identity", false),
    ] {
        assert_eq!(wants_feedback(&spec(c), None), on, "{c}");
        assert_eq!(wants_feedback(&spec(c), Some(true)), c != "identity", "{c}");
        assert!(!wants_feedback(&spec(c), Some(false)), "{c}");
    }
    let res = local::run(1, None, |mut comm| {
        let mut g = BucketGather::new(&comm, 1, ReduceOp::Mean)?;
        let mut tg = TensorGather::new(None);
        let t = |name: &str, n: usize| HeldTensor {
            tensor: Tensor::new(name, &[n, 1]),
            key: 1,
        };
        let topk = Some(spec("topk:k=2"));
        // A bucket its tensors do not fill; a name twice; a restored residual of another
        // length: each refused, the bucket and the residuals unchanged.
        let mut x = vec![1.0f32; 7];
        let mut refused = |tg: &mut TensorGather, tensors: &[(HeldTensor, Option<CodecSpec>)]| {
            let send = &mut Vec::new();
            tg.reduce(&mut g, &mut comm, send, &mut x, tensors, 0, 0, false)
                .is_err()
        };
        assert!(refused(&mut tg, &[(t("a", 6), topk)]));
        assert!(refused(&mut tg, &[(t("a", 3), topk), (t("a", 4), topk)]));
        tg.restore(vec![("a".into(), vec![0.5; 5])]);
        assert!(refused(&mut tg, &[(t("a", 7), topk)]));
        assert_eq!(x, vec![1.0; 7]);
        assert_eq!(tg.residuals(), vec![("a".to_string(), vec![0.5; 5])]);
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn the_default_strategy_is_the_ring_from_three_ranks_for_quantisers() {
    use gradpack::cost::Strategy;
    let quantisers = [
        "fp16", "bf16", "int8", "qsgd", "natural", "ternary", "fp8", "fp4", "codebook",
    ];
    let others = [
        "sign",
        "topk:k=4",
        "randk:ratio=0.1",
        "chunktopk:chunk=64,k=2",
        "dct:chunk=8,k=2",
    ];
    for c in quantisers.iter().chain(&others) {
        let spec: CodecSpec = c.parse().unwrap();
        assert_eq!(
            default_strategy(&spec, 2),
            Strategy::CompressedAllGather,
            "{c}"
        );
        let three = if quantisers.contains(c) {
            Strategy::CompressedRing
        } else {
            Strategy::CompressedAllGather
        };
        for p in [3, 8, 64] {
            assert_eq!(default_strategy(&spec, p), three, "{c} at {p}");
        }
    }
    let f32: CodecSpec = "identity".parse().unwrap();
    assert_eq!(default_strategy(&f32, 5), Strategy::Fp32Ring);
}

// ---------------------------------------------------------------- BucketReducer

/// `BucketReducer` on 3 ranks over `steps`, the model's tensors in one bucket (index 0)
/// by `opts` (after `restored`, each rank's NamedState blob, when given): each step's
/// reduced bucket, and each rank's state after, saved as a NamedState blob.
fn reducer_run(
    opts: &ReducerOptions,
    steps: std::ops::Range<u64>,
    restored: &[Vec<u8>],
) -> Vec<(Vec<Vec<f32>>, Vec<u8>)> {
    let tensors = model_tensors();
    let layout: Vec<Tensor> = tensors.iter().map(|h| h.tensor.clone()).collect();
    local::run(3, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        let shared = Shared::new(comm.into_inner());
        let mut r: BucketReducer<Shared<_>> = BucketReducer::new(opts.clone())?;
        r.connect(3, None, Box::new(move |_| Ok(shared.clone())))?;
        if let Some(blob) = restored.get(rank) {
            r.restore_from(&NamedState::restore(blob)?)?;
        }
        let mut out = Vec::new();
        for step in steps.clone() {
            let mut x: Vec<f32> = tensors
                .iter()
                .flat_map(|t| model_grad(t, rank, step))
                .collect();
            let turn = opts.config(0, step, 3, &layout, None, None)?;
            let d = opts.decide(&layout, turn.codec, turn.way, step, None)?;
            if !r.run(&mut x, 0, step, &tensors, &d, false)? {
                // A plain float32 bucket is the front end's: the mean, by hand.
                let mut sum = vec![0f32; x.len()];
                for q in 0..3 {
                    let g: Vec<f32> = tensors
                        .iter()
                        .flat_map(|t| model_grad(t, q, step))
                        .collect();
                    sum.iter_mut().zip(&g).for_each(|(s, v)| *s += v);
                }
                x = sum.iter().map(|s| s / 3.0).collect();
            }
            out.push(x);
        }
        let mut saved = NamedState::default();
        r.save_into(&mut saved)?;
        Ok((out, saved.save()))
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn the_bucket_reducer_is_the_same_on_every_rank_and_resumes_exactly() {
    // top-k with error feedback by the all-gather, int8 with error feedback by the ring,
    // PowerSGD from step 1 with float32 before: every rank gets the same bits, close to
    // the true mean, and a reducer restored from another's NamedState after 2 steps
    // continues as the first did.
    let topk = ReducerOptions {
        codec: Some("topk:ratio=0.2".parse().unwrap()),
        small_below: 10,
        seed: 7,
        ..ReducerOptions::default()
    };
    let ring = ReducerOptions {
        codec: Some("int8".parse().unwrap()),
        feedback: Some(true),
        pieces: 2,
        small_below: 10,
        ..ReducerOptions::default()
    };
    let ps = ReducerOptions {
        codec: Some("identity".parse().unwrap()),
        powersgd: Some((PowerSgd::default(), 1)),
        ..ReducerOptions::default()
    };
    for (what, opts) in [("topk", &topk), ("ring", &ring), ("powersgd", &ps)] {
        let a = reducer_run(opts, 0..4, &[]);
        for r in 1..3 {
            assert!(
                f32_bits(&[a[r].0.clone()]) == f32_bits(&[a[0].0.clone()]),
                "{what}: rank {r}"
            );
        }
        let saved: Vec<Vec<u8>> = reducer_run(opts, 0..2, &[])
            .into_iter()
            .map(|r| r.1)
            .collect();
        let b = reducer_run(opts, 2..4, &saved);
        for r in 0..3 {
            assert!(
                f32_bits(&[b[r].0.clone()]) == f32_bits(&[a[r].0[2..].to_vec()]),
                "{what}: rank {r} resumed"
            );
        }
    }
    // The int8 ring's mean is within its bound of the true mean.
    let a = reducer_run(&ring, 0..1, &[]);
    let tensors = model_tensors();
    let mut truth = vec![0f32; a[0].0[0].len()];
    for q in 0..3 {
        let g: Vec<f32> = tensors.iter().flat_map(|t| model_grad(t, q, 0)).collect();
        truth.iter_mut().zip(&g).for_each(|(s, v)| *s += v / 3.0);
    }
    let worst = truth
        .iter()
        .zip(&a[0].0[0])
        .map(|(t, v)| (t - v).abs())
        .fold(0f32, f32::max);
    assert!(worst < 0.05, "int8 ring off by {worst}");
}

#[test]
fn the_bucket_reducer_decides_as_documented_and_refuses_bad_calls() {
    let layout: Vec<Tensor> = model_tensors().into_iter().map(|h| h.tensor).collect();
    let int8 = ReducerOptions {
        start_step: 2,
        ..ReducerOptions::default()
    };
    let turn =
        |o: &ReducerOptions, step, world| o.config(0, step, world, &layout, None, None).unwrap();
    assert_eq!(turn(&int8, 1, 3).way, Way::Fp32); // before start_step
    assert_eq!(turn(&int8, 2, 3).way, Way::Ring); // int8 from 3 ranks
    assert_eq!(turn(&int8, 2, 2).way, Way::AllGather);
    assert_eq!(turn(&int8, 9, 1).way, Way::Fp32); // alone
    let twoshot = ReducerOptions {
        way: Some(Way::TwoShot),
        ..ReducerOptions::default()
    };
    assert_eq!(turn(&twoshot, 0, 4).way, Way::TwoShot);
    // Measured auto needs its tuner; a mixed bucket needs the tuner's choices.
    let auto = ReducerOptions {
        codec: None,
        ..ReducerOptions::default()
    };
    assert!(auto.config(0, 0, 3, &layout, None, None).is_err());
    assert!(int8.decide(&layout, None, Way::AllGather, 3, None).is_err());
    // Small tensors and vectors make a plain bucket; the two-level one never is.
    let small: Vec<Tensor> = layout
        .iter()
        .filter(|t| t.len().unwrap() < 16384)
        .cloned()
        .collect();
    assert!(
        int8.decide(&small, int8.codec, Way::AllGather, 3, None)
            .unwrap()
            .plain()
    );
    assert!(
        !int8
            .decide(&small, int8.codec, Way::Hierarchical, 3, None)
            .unwrap()
            .plain()
    );
    assert!(
        BucketReducer::<Shared<local::Local>>::new(ReducerOptions {
            pieces: 0,
            ..int8.clone()
        })
        .is_err()
    );
    assert!(
        BucketReducer::<Shared<local::Local>>::new(ReducerOptions {
            way: Some(Way::Fp32),
            ..int8.clone()
        })
        .is_err()
    );
    // Not connected: an error, and the bucket unchanged.
    let mut r: BucketReducer<Shared<local::Local>> = BucketReducer::new(int8.clone()).unwrap();
    let tensors = model_tensors();
    let mut x: Vec<f32> = tensors.iter().flat_map(|t| model_grad(t, 0, 0)).collect();
    let before = x.clone();
    let d = int8
        .decide(&layout, int8.codec, Way::Ring, 3, None)
        .unwrap();
    assert!(r.run(&mut x, 0, 3, &tensors, &d, false).is_err());
    assert_eq!(x, before);
    // PowerSGD state into a reducer without PowerSGD: refused, nothing changed.
    let st = NamedState {
        low_rank: vec![("w0".into(), (None, vec![0.0; 3]))],
        ..NamedState::default()
    };
    assert!(r.restore_from(&st).is_err());
    assert!(!r.holds_state().unwrap());
}
