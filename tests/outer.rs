//! The outer synchroniser (DiLoCo): identical outer parameters on every rank, the outer
//! step against its f64 definition, streaming fragments, resume mid-round, faults; and
//! across a changing membership: a sync that fails when a member leaves runs again among
//! the rest, bit for bit as if the member had never been there; a member that joins
//! receives the state and every member ends identical; healing's refusals.

use std::time::{Duration, Instant};

use gradpack::collective::local::Local;
use gradpack::collective::{Feedback, Strategy, StrategyChoice, Transport, local};
use gradpack::outer::{Heal, OuterOptions, OuterSync};
use gradpack::sync::Tensor;
use gradpack::{CodecSpec, Error};

fn layout() -> Vec<Tensor> {
    vec![
        Tensor::new("emb", &[64, 33]),
        Tensor::new("l1.w", &[50, 40]),
        Tensor::new("l1.b", &[50]),
        Tensor::new("l2.w", &[10, 50]),
        Tensor::new("l2.b", &[10]),
    ]
}

/// Starting parameters, the same on every rank.
fn init(layout: &[Tensor]) -> Vec<Vec<f32>> {
    layout
        .iter()
        .enumerate()
        .map(|(t, x)| {
            (0..x.len().unwrap())
                .map(|j| ((j * 7 + t * 13) % 23) as f32 / 23.0 - 0.5)
                .collect()
        })
        .collect()
}

/// A deterministic stand-in for an inner optimizer step, different on every rank.
fn inner_step(params: &mut [Vec<f32>], rank: usize, step: u64) {
    for (t, p) in params.iter_mut().enumerate() {
        for (j, x) in p.iter_mut().enumerate() {
            let g = ((j + 3 * t) as f32 * 0.37 + step as f32 * 0.11 + rank as f32).sin();
            *x -= 0.01 * g + 0.001 * *x;
        }
    }
}

fn slices(p: &mut [Vec<f32>]) -> Vec<&mut [f32]> {
    p.iter_mut().map(|v| v.as_mut_slice()).collect()
}

fn spec(s: &str) -> CodecSpec {
    s.parse().unwrap()
}

/// Train `steps` inner steps on every rank of a world of `p`; each rank returns its
/// parameters and outer copy.
/// A rank's parameters and outer copy, one vector per tensor.
type Ended = (Vec<Vec<f32>>, Vec<Vec<f32>>);

fn train(p: usize, steps: u64, opts: &OuterOptions) -> Vec<Ended> {
    let layout = layout();
    local::run(p, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        let mut params = init(&layout);
        let views: Vec<&[f32]> = params.iter().map(|v| v.as_slice()).collect();
        let mut outer = OuterSync::new(&layout, &views, comm.into_inner(), opts.clone())?;
        for s in 1..=steps {
            inner_step(&mut params, rank, s);
            outer.step(&mut slices(&mut params))?;
        }
        let outers = (0..layout.len())
            .map(|i| outer.outer(i).map(<[f32]>::to_vec))
            .collect::<Result<_, _>>()?;
        Ok((params, outers))
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .unwrap()
}

#[test]
fn every_rank_ends_each_outer_step_with_the_same_outer_parameters() {
    let cases = [
        ("identity", 1, 0, Feedback::None),
        ("int8", 1, 0, Feedback::Worker),
        ("chunktopk", 2, 1, Feedback::Worker),
        ("fp4", 3, 2, Feedback::None),
        ("codebook", 4, 1, Feedback::Worker),
    ];
    for (codec, fragments, delay, feedback) in cases {
        let opts = OuterOptions {
            sync_every: 8,
            fragments,
            delay,
            codec: spec(codec),
            feedback,
            ..Default::default()
        };
        // 24 steps: every fragment has applied exactly three outer steps.
        let out = train(3, 24, &opts);
        for (params, outers) in &out[1..] {
            assert_eq!(outers, &out[0].1, "{codec}: outer copies differ");
            // The last fragment (it holds the last tensor) synced at step 24: its
            // tensors were just replaced by the outer copy (alpha 0) on every rank.
            assert_eq!(params.last(), outers.last(), "{codec}");
        }
        let init = init(&layout());
        assert_ne!(out[0].1, init, "{codec}: the outer copy never moved");
    }
}

#[test]
fn with_one_fragment_every_rank_holds_the_outer_parameters_after_a_sync() {
    let opts = OuterOptions {
        sync_every: 5,
        codec: spec("int8"),
        feedback: Feedback::Worker,
        ..Default::default()
    };
    let out = train(4, 10, &opts);
    for (params, outers) in &out {
        assert_eq!(params, outers);
        assert_eq!(params, &out[0].0);
    }
}

#[test]
fn outer_step_equals_its_f64_definition_within_f32_rounding() {
    // Two ranks, the fp32 ring: d = (delta_0 + delta_1) / 2 with each operation rounded
    // once; the f64 definition with the same deltas differs only by f32 rounding.
    let layout = vec![Tensor::new("w", &[3000])];
    let (lr, mu, h, rounds) = (0.7f32, 0.9f32, 4u64, 3u64);
    let opts = OuterOptions {
        sync_every: h,
        outer_lr: lr,
        outer_momentum: mu,
        strategy: StrategyChoice::Forced(Strategy::Fp32Ring),
        ..Default::default()
    };
    let x0: Vec<f32> = (0..3000).map(|j| (j as f32 * 0.01).cos()).collect();
    let step_of = |rank: usize, s: u64, x: &mut [f32]| {
        for (j, v) in x.iter_mut().enumerate() {
            *v -= 0.05 * ((j as f32 * 0.3 + s as f32 + rank as f32 * 1.7).sin());
        }
    };
    let res: Vec<Vec<f32>> = local::run(2, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        let mut x = x0.clone();
        let mut outer = OuterSync::new(&layout, &[&x], comm.into_inner(), opts.clone())?;
        for s in 1..=h * rounds {
            step_of(rank, s, &mut x);
            outer.step(&mut [&mut x])?;
        }
        Ok(x)
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .unwrap();
    assert_eq!(res[0], res[1]);
    // The f64 definition: both ranks start each round from the outer parameters.
    let (lr, mu) = (lr as f64, mu as f64);
    let mut outer: Vec<f64> = x0.iter().map(|&v| v as f64).collect();
    let mut m = vec![0f64; 3000];
    let mut bound = vec![0f64; 3000];
    let eps = f32::EPSILON as f64 / 2.0;
    for round in 0..rounds {
        let mut locals = Vec::new();
        for rank in 0..2 {
            let mut x: Vec<f32> = outer.iter().map(|&v| v as f32).collect();
            for s in round * h + 1..=(round + 1) * h {
                step_of(rank, s, &mut x);
            }
            locals.push(x);
        }
        for j in 0..3000 {
            let d = ((outer[j] - locals[0][j] as f64) + (outer[j] - locals[1][j] as f64)) / 2.0;
            m[j] = mu * m[j] + d;
            let u = d + mu * m[j];
            outer[j] -= lr * u;
            // Nine roundings per round, each at most eps of the largest magnitude seen.
            let scale = outer[j].abs() + lr * u.abs() + m[j].abs() + d.abs() + 2.0;
            bound[j] = bound[j] * (1.0 + lr + mu) + 9.0 * eps * scale;
        }
        // Rounding the outer copy to f32 for the next round's start is part of the
        // definition (the ranks train in f32).
        outer.iter_mut().for_each(|v| *v = *v as f32 as f64);
    }
    for j in 0..3000 {
        let err = (res[0][j] as f64 - outer[j]).abs();
        assert!(
            err <= bound[j],
            "element {j}: {} vs {} (bound {})",
            res[0][j],
            outer[j],
            bound[j]
        );
    }
}

#[test]
fn alpha_mixes_the_local_and_outer_parameters() {
    let layout = vec![Tensor::new("w", &[257])];
    let res = local::run(2, Some(Duration::from_secs(20)), |comm| {
        let rank = comm.rank();
        let mut x: Vec<f32> = (0..257).map(|j| j as f32 * 0.01).collect();
        let opts = OuterOptions {
            sync_every: 3,
            alpha: 0.25,
            ..Default::default()
        };
        let mut outer = OuterSync::new(&layout, &[&x], comm.into_inner(), opts)?;
        for s in 1..=3u64 {
            x.iter_mut()
                .for_each(|v| *v += (rank + 1) as f32 * 0.1 * s as f32);
            let before = x.clone();
            outer.step(&mut [&mut x])?;
            if s == 3 {
                let o = outer.outer(0)?;
                for j in 0..257 {
                    assert_eq!(x[j], 0.25 * before[j] + 0.75 * o[j]);
                }
            } else {
                assert_eq!(x, before, "no sync at step {s}");
            }
        }
        Ok(())
    });
    assert!(res.into_iter().all(|r| r.is_ok()));
}

#[test]
fn streaming_fragments_cover_every_parameter_exactly_once_per_cycle() {
    let layout = layout();
    for (h, p, tau) in [
        (8u64, 1usize, 0u64),
        (8, 2, 1),
        (10, 3, 2),
        (5, 5, 0),
        (12, 4, 3),
    ] {
        let res = local::run(1, None, |comm| {
            let params = init(&layout);
            let views: Vec<&[f32]> = params.iter().map(|v| v.as_slice()).collect();
            let opts = OuterOptions {
                sync_every: h,
                fragments: p,
                delay: tau,
                ..Default::default()
            };
            let mut outer = OuterSync::new(&layout, &views, comm.into_inner(), opts)?;
            let frags = outer.fragments();
            let mut all: Vec<usize> = frags.concat();
            all.sort();
            assert_eq!(
                all,
                (0..layout.len()).collect::<Vec<_>>(),
                "one fragment each"
            );
            let mut params = params.clone();
            let mut sent = vec![0; layout.len()];
            let mut applied = vec![0; layout.len()];
            let mut sent_at = vec![None; p];
            for s in 1..=4 * h {
                let due = outer.due();
                for &f in &due.send {
                    sent_at[f] = Some(s);
                }
                for &f in &due.apply {
                    assert_eq!(sent_at[f], Some(s - tau), "applied tau steps after sending");
                }
                // Count over whole cycles after the first.
                if s > h {
                    due.send
                        .iter()
                        .for_each(|&f| frags[f].iter().for_each(|&t| sent[t] += 1));
                    due.apply
                        .iter()
                        .for_each(|&f| frags[f].iter().for_each(|&t| applied[t] += 1));
                }
                outer.step(&mut slices(&mut params))?;
            }
            assert!(sent.iter().all(|&c| c == 3), "{h} {p} {tau}: sent {sent:?}");
            assert!(
                applied.iter().all(|&c| c == 3),
                "{h} {p} {tau}: applied {applied:?}"
            );
            Ok(())
        });
        res.into_iter().for_each(|r| r.unwrap());
    }
}

#[test]
fn resume_from_a_checkpoint_mid_round_continues_bit_for_bit() {
    let layout = layout();
    let opts = OuterOptions {
        sync_every: 4,
        fragments: 2,
        delay: 1,
        codec: spec("int8:rounding=stochastic"),
        feedback: Feedback::Worker,
        ..Default::default()
    };
    let total = 13u64;
    let straight = train(2, total, &opts);
    // Stop after step 5: fragment 0's all-reduce (formed at step 5) is in flight.
    let stop = 5u64;
    let saved: Vec<(Vec<Vec<f32>>, Vec<u8>)> = local::run(2, None, |comm| {
        let rank = comm.rank();
        let mut params = init(&layout);
        let views: Vec<&[f32]> = params.iter().map(|v| v.as_slice()).collect();
        let mut outer = OuterSync::new(&layout, &views, comm.into_inner(), opts.clone())?;
        for s in 1..=stop {
            inner_step(&mut params, rank, s);
            outer.step(&mut slices(&mut params))?;
        }
        assert_eq!(outer.due().apply, vec![0], "fragment 0 applies next");
        Ok((params, outer.save()?))
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .unwrap();
    let resumed = local::run(2, None, |comm| {
        let rank = comm.rank();
        let (mut params, blob): (Vec<Vec<f32>>, Vec<u8>) = saved[rank].clone();
        // A new synchroniser starts from other parameters: the blob carries the outer copy.
        let fresh = init(&layout);
        let views: Vec<&[f32]> = fresh.iter().map(|v| v.as_slice()).collect();
        let mut outer = OuterSync::new(&layout, &views, comm.into_inner(), opts.clone())?;
        outer.restore(&blob)?;
        assert_eq!(outer.inner_step(), stop);
        for s in stop + 1..=total {
            inner_step(&mut params, rank, s);
            outer.step(&mut slices(&mut params))?;
        }
        let outers = (0..layout.len())
            .map(|i| outer.outer(i).map(<[f32]>::to_vec))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((params, outers))
    });
    for (rank, r) in resumed.into_iter().enumerate() {
        let (params, outers) = r.unwrap();
        assert!(
            params == straight[rank].0,
            "rank {rank}: parameters differ after resume"
        );
        assert!(
            outers == straight[rank].1,
            "rank {rank}: outer copies differ after resume"
        );
    }
}

#[test]
fn a_saved_state_is_refused_by_another_configuration_and_when_damaged() {
    let layout = layout();
    let opts = OuterOptions {
        sync_every: 4,
        ..Default::default()
    };
    let res = local::run(1, None, |comm| {
        let params = init(&layout);
        let views: Vec<&[f32]> = params.iter().map(|v| v.as_slice()).collect();
        let mut a = OuterSync::new(&layout, &views, comm.into_inner(), opts.clone())?;
        let blob = a.save()?;
        let mut damaged = blob.clone();
        let k = damaged.len() / 2;
        damaged[k] ^= 1;
        assert!(matches!(a.restore(&damaged), Err(Error::Checkpoint(_))));
        let t = a.into_transport()?;
        let other = OuterOptions {
            outer_lr: 0.5,
            ..opts.clone()
        };
        let mut b = OuterSync::new(&layout, &views, t, other)?;
        assert!(matches!(b.restore(&blob), Err(Error::Checkpoint(_))));
        // Another seed (other stochastic draws) or another checksum setting too.
        for other in [
            OuterOptions {
                seed: 9,
                ..opts.clone()
            },
            OuterOptions {
                checksum: false,
                ..opts.clone()
            },
        ] {
            let t = b.into_transport()?;
            b = OuterSync::new(&layout, &views, t, other)?;
            assert!(matches!(b.restore(&blob), Err(Error::Checkpoint(_))));
        }
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn a_departed_rank_is_an_error_on_every_other_rank_within_the_timeout() {
    let layout = layout();
    let timeout = Duration::from_millis(500);
    let start = Instant::now();
    let res = local::run(3, Some(timeout), |comm| {
        let rank = comm.rank();
        let mut params = init(&layout);
        let views: Vec<&[f32]> = params.iter().map(|v| v.as_slice()).collect();
        let opts = OuterOptions {
            sync_every: 2,
            codec: spec("int8"),
            ..Default::default()
        };
        let mut outer = OuterSync::new(&layout, &views, comm.into_inner(), opts)?;
        if rank == 2 {
            return Ok(()); // leaves before the first sync
        }
        let mut first_err = None;
        for s in 1..=4u64 {
            inner_step(&mut params, rank, s);
            if let Err(e) = outer.step(&mut slices(&mut params)) {
                first_err.get_or_insert((s, e));
            }
        }
        let (s, e) = first_err.expect("the sync without rank 2 fails");
        assert_eq!(s, 2, "the first sync fails");
        // Later steps are refused, not run on a state that may differ across ranks.
        assert!(outer.step(&mut slices(&mut params)).is_err());
        Err(e)
    });
    assert!(start.elapsed() < timeout * 10, "took {:?}", start.elapsed());
    assert!(res[2].is_ok());
    for r in &res[..2] {
        assert!(
            matches!(r, Err(Error::Transport { .. }) | Err(Error::Peer { .. })),
            "{r:?}"
        );
    }
}

#[test]
fn bad_arguments_are_errors() {
    let layout = layout();
    let res = local::run(1, None, |comm| {
        let params = init(&layout);
        let views: Vec<&[f32]> = params.iter().map(|v| v.as_slice()).collect();
        let t = comm.into_inner();
        let bad = [
            OuterOptions {
                sync_every: 0,
                ..Default::default()
            },
            OuterOptions {
                sync_every: 4,
                fragments: 5,
                ..Default::default()
            },
            OuterOptions {
                sync_every: 4,
                delay: 4,
                ..Default::default()
            },
            OuterOptions {
                alpha: 1.5,
                ..Default::default()
            },
            OuterOptions {
                outer_lr: f32::NAN,
                ..Default::default()
            },
            OuterOptions {
                fragments: 6,
                ..Default::default()
            },
            OuterOptions {
                fragments: 2,
                assignment: Some(vec![0, 0, 0, 0, 0]),
                ..Default::default()
            },
            OuterOptions {
                fragments: 2,
                assignment: Some(vec![0, 1]),
                ..Default::default()
            },
        ];
        let mut t = Some(t);
        for o in bad {
            // The transport is given back on error only through a new world: build a
            // fresh one-rank transport each time.
            let tr = t
                .take()
                .unwrap_or_else(|| gradpack::collective::local::Local::world(1).pop().unwrap());
            assert!(
                OuterSync::new(&layout, &views, tr, o.clone()).is_err(),
                "{o:?}"
            );
        }
        let tr = gradpack::collective::local::Local::world(1).pop().unwrap();
        assert!(OuterSync::new(&layout, &views[..3], tr, OuterOptions::default()).is_err());
        let tr = gradpack::collective::local::Local::world(1).pop().unwrap();
        let opts = OuterOptions {
            sync_every: 1,
            ..Default::default()
        };
        let mut o = OuterSync::new(&layout, &views, tr, opts)?;
        let mut short = init(&layout);
        short[1].pop();
        assert!(matches!(
            o.step(&mut slices(&mut short)),
            Err(Error::LengthMismatch { .. })
        ));
        // Nothing was lost: a correct step still works.
        let mut ok = init(&layout);
        o.step(&mut slices(&mut ok))?;
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn diloco_with_compressed_pseudo_gradients_converges_on_a_quadratic() {
    // Rank r minimises |x - c_r|^2 / 2 with plain SGD from the outer copy; with outer
    // averaging (lr 1, no momentum) the outer copy contracts towards the mean of the c_r
    // by 0.9^10 per round. fp32 reaches it to rounding, int8 with error feedback gets
    // close, and the SparseLoCo layout (1.6% of the values a round) without feedback is
    // on its way. (With feedback, top-k on this problem re-sends the same unsent
    // displacement every round and overshoots: feedback suits pseudo-gradients that
    // change from round to round, and its decay `beta` bounds the overshoot.)
    let n = 8192;
    let layout = vec![Tensor::new("x", &[n])];
    let target = |r: usize, j: usize| ((j * (r + 3)) as f32 * 0.013).sin() + r as f32;
    let mean: Vec<f32> = (0..n)
        .map(|j| (0..4).map(|r| target(r, j)).sum::<f32>() / 4.0)
        .collect();
    let gap_of = |x: &[f32]| {
        x.iter()
            .zip(&mean)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    };
    let start = gap_of(&vec![0.0; n]);
    let mut gaps = Vec::new();
    for (codec, fb) in [
        ("identity", Feedback::None),
        ("int8", Feedback::Worker),
        ("chunktopk", Feedback::None),
    ] {
        let opts = OuterOptions {
            sync_every: 10,
            outer_lr: 1.0,
            outer_momentum: 0.0,
            codec: spec(codec),
            feedback: fb,
            ..Default::default()
        };
        let res: Vec<Vec<f32>> = local::run(4, Some(Duration::from_secs(20)), |comm| {
            let r = comm.rank();
            let mut x = vec![0.0f32; n];
            let mut outer = OuterSync::new(&layout, &[&x], comm.into_inner(), opts.clone())?;
            for _ in 0..600 {
                for (j, v) in x.iter_mut().enumerate() {
                    *v -= 0.1 * (*v - target(r, j));
                }
                outer.step(&mut [&mut x])?;
            }
            Ok(outer.outer(0)?.to_vec())
        })
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap();
        gaps.push((codec, gap_of(&res[0])));
    }
    assert!(gaps[0].1 < 1e-5, "{gaps:?}");
    assert!(gaps[1].1 < 0.02, "{gaps:?}");
    assert!(gaps[2].1 < 0.75 * start, "{gaps:?} from {start}");
}

#[test]
fn ranks_made_with_different_options_fail_their_first_sync_naming_the_option() {
    // Rank 1 differs in one option; every rank's first sync fails and names it, and no
    // rank ever returns Ok from a sync.
    let base = OuterOptions {
        sync_every: 2,
        codec: spec("int8"),
        ..Default::default()
    };
    let cases: Vec<(&str, OuterOptions)> = vec![
        (
            "lr",
            OuterOptions {
                outer_lr: 0.5,
                ..base.clone()
            },
        ),
        (
            "mu",
            OuterOptions {
                outer_momentum: 0.8,
                ..base.clone()
            },
        ),
        (
            "nesterov",
            OuterOptions {
                nesterov: false,
                ..base.clone()
            },
        ),
        (
            "alpha",
            OuterOptions {
                alpha: 0.5,
                ..base.clone()
            },
        ),
        (
            "H",
            OuterOptions {
                sync_every: 3,
                ..base.clone()
            },
        ),
        (
            "tau",
            OuterOptions {
                delay: 1,
                ..base.clone()
            },
        ),
        (
            "seed",
            OuterOptions {
                seed: 5,
                ..base.clone()
            },
        ),
        (
            "feedback",
            OuterOptions {
                feedback: Feedback::Worker,
                ..base.clone()
            },
        ),
    ];
    let layout = layout();
    for (name, other) in cases {
        let res = local::run(3, Some(Duration::from_secs(5)), |comm| {
            let rank = comm.rank();
            let mut params = init(&layout);
            let views: Vec<&[f32]> = params.iter().map(|v| v.as_slice()).collect();
            let o = if rank == 1 {
                other.clone()
            } else {
                base.clone()
            };
            let mut outer = OuterSync::new(&layout, &views, comm.into_inner(), o)?;
            let mut first = None;
            for s in 1..=6u64 {
                inner_step(&mut params, rank, s);
                match outer.step(&mut slices(&mut params)) {
                    Ok(st) => assert!(
                        first.is_some() || st.applied == 0,
                        "{name}: rank {rank} applied a sync"
                    ),
                    Err(e) => {
                        first.get_or_insert(e);
                    }
                }
            }
            Err::<(), _>(first.expect("the first sync fails"))
        });
        for (r, e) in res.iter().enumerate() {
            let e = e.as_ref().unwrap_err().to_string();
            assert!(e.contains(&format!("{name}=")), "{name}: rank {r}: {e}");
        }
    }
}

// The membership changes.

fn views(p: &[Vec<f32>]) -> Vec<&[f32]> {
    p.iter().map(|v| v.as_slice()).collect()
}

/// The `size` transports of a new in-process world, with a short timeout.
fn world(size: usize) -> Vec<Local> {
    Local::world(size)
        .into_iter()
        .map(|mut t| {
            t.set_timeout(Some(Duration::from_millis(800)));
            t
        })
        .collect()
}

fn options(codec: &str, feedback: Feedback, strategy: Strategy) -> OuterOptions {
    OuterOptions {
        sync_every: 3,
        codec: codec.parse::<CodecSpec>().unwrap(),
        feedback,
        strategy: StrategyChoice::Forced(strategy),
        ..Default::default()
    }
}

fn outers(sync: &OuterSync<Local>, n: usize) -> Vec<Vec<f32>> {
    (0..n).map(|i| sync.outer(i).unwrap().to_vec()).collect()
}

/// Members 0 and 1 of a world of 2 train `steps` inner steps from the start: the
/// reference.
fn two_from_the_start(steps: u64, opts: &OuterOptions) -> Vec<Ended> {
    each_of_two(opts, |member, t, layout, opts| {
        let mut params = init(layout);
        let mut sync = OuterSync::new(layout, &views(&params), t, opts).unwrap();
        for step in 1..=steps {
            inner_step(&mut params, member, step);
            sync.step(&mut slices(&mut params)).unwrap();
        }
        let o = outers(&sync, layout.len());
        (params, o)
    })
}

/// `member(rank, transport, layout, options)` on each member of a new world of 2, each
/// on a thread of its own; their results in rank order.
fn each_of_two<R: Send>(
    opts: &OuterOptions,
    member: impl Fn(usize, Local, &[Tensor], OuterOptions) -> R + Sync,
) -> Vec<R> {
    let layout = layout();
    std::thread::scope(|s| {
        let handles: Vec<_> = world(2)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let (layout, opts, member) = (&layout, opts.clone(), &member);
                s.spawn(move || member(rank, t, layout, opts))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Members 0 and 1 of a world of 3 whose member 2 leaves before the first sync: the
/// first sync fails on both; they re-form over a world of 2 and heal, which runs the
/// sync again; they train on to `steps`.
fn a_member_leaves(steps: u64, opts: &OuterOptions) -> Vec<(Ended, Heal)> {
    let layout = layout();
    let mut three = world(3);
    drop(three.pop()); // member 2 leaves
    std::thread::scope(|s| {
        let handles: Vec<_> = three
            .into_iter()
            .zip(world(2))
            .enumerate()
            .map(|(member, (t3, t2))| {
                let (layout, opts) = (&layout, opts.clone());
                s.spawn(move || {
                    let mut params = init(layout);
                    let mut sync = OuterSync::new(layout, &views(&params), t3, opts).unwrap();
                    let mut healed = None;
                    let mut t2 = Some(t2);
                    for step in 1..=steps {
                        inner_step(&mut params, member, step);
                        if let Err(e) = sync.step(&mut slices(&mut params)) {
                            assert_eq!(step, 3, "the first sync fails: {e}");
                            assert!(healed.is_none());
                            // Refused until re-formed and healed.
                            let again = sync.step(&mut slices(&mut params)).unwrap_err();
                            assert!(again.to_string().contains("re-form"), "{again}");
                            assert_eq!(sync.inner_step(), 3, "a refused step does not count");
                            sync.reform(t2.take().expect("one failure")).unwrap();
                            assert!(
                                sync.save().is_err(),
                                "no save between re-forming and healing"
                            );
                            healed = Some(sync.heal(&mut slices(&mut params)).unwrap());
                        }
                    }
                    let o = outers(&sync, layout.len());
                    ((params, o), healed.expect("a failed sync was healed"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_sync_that_fails_when_a_member_leaves_runs_again_among_the_rest_bit_for_bit() {
    // Error feedback on a compressed ring and on the frame all-gather: the failed
    // attempt's residual updates are undone, so the retry is the sync a world of two
    // would have run.
    for (codec, strategy) in [
        ("int8", Strategy::CompressedRing),
        ("int8", Strategy::CompressedAllGather),
        ("qsgd:bits=8", Strategy::CompressedRing),
        ("identity", Strategy::Fp32Ring),
    ] {
        let opts = options(codec, Feedback::Worker, strategy);
        let want = two_from_the_start(10, &opts);
        let got = a_member_leaves(10, &opts);
        for (member, ((ended, heal), want)) in got.iter().zip(&want).enumerate() {
            assert_eq!(heal.source, 0);
            assert!(heal.healed.is_empty(), "{heal:?}");
            assert_eq!(heal.retried, vec![(0, 2)], "{codec} {strategy:?}");
            assert_eq!(heal.applied, 1);
            assert!(heal.dropped.is_empty());
            let same = |a: &[Vec<f32>], b: &[Vec<f32>]| {
                a.iter()
                    .flatten()
                    .zip(b.iter().flatten())
                    .all(|(x, y)| x.to_bits() == y.to_bits())
            };
            assert!(
                same(&ended.0, &want.0),
                "{codec} {strategy:?} member {member}: params"
            );
            assert!(
                same(&ended.1, &want.1),
                "{codec} {strategy:?} member {member}: outer"
            );
        }
    }
}

/// Members 0 and 1 train in a world of 3 whose member 2 leaves before the first sync;
/// at the failed sync a new member 2 joins (fresh parameters, step 0) and all three
/// heal in a new world of 3; all train on to `steps`. Returns each member's end and
/// heal.
fn a_member_is_replaced(steps: u64, opts: &OuterOptions) -> Vec<(Ended, Heal)> {
    let layout = layout();
    let mut first = world(3);
    drop(first.pop());
    let mut second = world(3);
    let joiner = second.pop().unwrap();
    std::thread::scope(|s| {
        let mut handles: Vec<_> = first
            .into_iter()
            .zip(second)
            .enumerate()
            .map(|(member, (t1, t2))| {
                let (layout, opts) = (&layout, opts.clone());
                s.spawn(move || {
                    let mut params = init(layout);
                    let mut sync = OuterSync::new(layout, &views(&params), t1, opts).unwrap();
                    let mut healed = None;
                    let mut t2 = Some(t2);
                    for step in 1..=steps {
                        inner_step(&mut params, member, step);
                        if sync.step(&mut slices(&mut params)).is_err() {
                            sync.reform(t2.take().expect("one failure")).unwrap();
                            healed = Some(sync.heal(&mut slices(&mut params)).unwrap());
                        }
                    }
                    let o = outers(&sync, layout.len());
                    ((params, o), healed.expect("healed"))
                })
            })
            .collect();
        let (layout, opts) = (&layout, opts.clone());
        handles.push(s.spawn(move || {
            // Parameters of its own (a restarted process's): healing replaces them.
            let mut params: Vec<Vec<f32>> =
                init(layout).iter().map(|t| vec![9.0; t.len()]).collect();
            let mut sync = OuterSync::new(layout, &views(&params), joiner, opts).unwrap();
            let heal = sync.heal(&mut slices(&mut params)).unwrap();
            assert!(heal.was_healed);
            assert_eq!(sync.inner_step(), 3, "the source's inner step");
            for step in sync.inner_step() + 1..=steps {
                inner_step(&mut params, 2, step);
                sync.step(&mut slices(&mut params)).unwrap();
            }
            let o = outers(&sync, layout.len());
            ((params, o), heal)
        }));
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_member_that_joins_is_healed_and_a_member_sending_zeros_is_not_in_the_mean() {
    // In f32 a member that sends zeros adds nothing to the sum, and the mean is over the
    // two that sent their pseudo-gradients: the healed sync is the two-member one, to
    // the bit. Later syncs average all three.
    let opts = options("identity", Feedback::None, Strategy::Fp32Ring);
    let got = a_member_is_replaced(3, &opts);
    let want = two_from_the_start(3, &opts);
    for (member, (ended, heal)) in got.iter().enumerate() {
        assert_eq!(heal.source, 0, "member {member}");
        assert_eq!(heal.healed, vec![2]);
        assert_eq!(heal.was_healed, member == 2);
        assert_eq!(heal.retried, vec![(0, 2)]);
        assert_eq!(heal.applied, 1);
        let bits =
            |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
        assert_eq!(bits(&ended.1), bits(&want[0].1), "member {member}: outer");
        assert_eq!(bits(&ended.0), bits(&want[0].0), "member {member}: params");
    }
}

#[test]
fn after_a_member_joins_every_member_ends_each_outer_step_identical() {
    for (codec, feedback, strategy) in [
        ("int8", Feedback::Worker, Strategy::CompressedRing),
        ("fp4", Feedback::Worker, Strategy::CompressedAllGather),
        ("identity", Feedback::None, Strategy::Fp32Ring),
    ] {
        let opts = options(codec, feedback, strategy);
        let got = a_member_is_replaced(12, &opts);
        let bits =
            |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
        for ((ended, _), member) in got.iter().zip(0..) {
            assert_eq!(
                bits(&ended.1),
                bits(&got[0].0.1),
                "{codec}: member {member}'s outer"
            );
            // One fragment, alpha 0, 12 a multiple of H: the parameters are the outer copy.
            assert_eq!(
                bits(&ended.0),
                bits(&got[0].0.0),
                "{codec}: member {member}'s params"
            );
        }
        // Training moved on after the join: not the state of the heal.
        let start: Vec<u32> = init(&layout())
            .iter()
            .flatten()
            .map(|x| x.to_bits())
            .collect();
        assert_ne!(bits(&got[0].0.1), start);
    }
}

#[test]
fn healing_refuses_bad_calls_and_a_failed_sync_needs_a_new_transport() {
    let layout = layout();
    let opts = options("int8", Feedback::Worker, Strategy::CompressedRing);
    let mut one = world(1);
    let mut params = init(&layout);
    let mut sync =
        OuterSync::new(&layout, &views(&params), one.pop().unwrap(), opts.clone()).unwrap();
    // Too few tensors, or a wrong length: refused, and nothing changes.
    let e = sync.heal(&mut slices(&mut params)[..2]).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
    let mut short = params.clone();
    short[1].pop();
    assert!(matches!(
        sync.heal(&mut slices(&mut short)),
        Err(Error::LengthMismatch { .. })
    ));
    // A world of one heals with itself: nothing to send, nothing to retry.
    let heal = sync.heal(&mut slices(&mut params)).unwrap();
    assert_eq!(heal, Heal::default());
    for step in 1..=3 {
        inner_step(&mut params, 0, step);
        sync.step(&mut slices(&mut params)).unwrap();
    }
    // Re-formed onto another world of one: steps are refused until it heals.
    let old = sync.reform(world(1).pop().unwrap()).unwrap();
    drop(old);
    let e = sync.step(&mut slices(&mut params)).unwrap_err();
    assert!(e.to_string().contains("heal"), "{e}");
    let heal = sync.heal(&mut slices(&mut params)).unwrap();
    assert!(heal.healed.is_empty() && heal.retried.is_empty());
    inner_step(&mut params, 0, 4);
    sync.step(&mut slices(&mut params)).unwrap();
    assert_eq!(sync.inner_step(), 4);

    // A member whose peer left: the failed sync is refused healing on the broken
    // transport; re-formed, it heals alone and the sync runs again over one member.
    let mut two = world(2);
    drop(two.pop());
    let mut params = init(&layout);
    let mut sync = OuterSync::new(&layout, &views(&params), two.pop().unwrap(), opts).unwrap();
    let mut failed = false;
    for step in 1..=3 {
        inner_step(&mut params, 0, step);
        failed |= sync.step(&mut slices(&mut params)).is_err();
    }
    assert!(failed);
    let e = sync.heal(&mut slices(&mut params)).unwrap_err();
    assert!(e.to_string().contains("re-form"), "{e}");
    sync.reform(world(1).pop().unwrap()).unwrap();
    let heal = sync.heal(&mut slices(&mut params)).unwrap();
    assert_eq!(heal.retried, vec![(0, 1)]);
    assert_eq!(heal.applied, 1);
    // The one member's mean is its own pseudo-gradient: the outer copy moved.
    let start: Vec<u32> = init(&layout)
        .iter()
        .flatten()
        .map(|x| x.to_bits())
        .collect();
    let now: Vec<u32> = (0..layout.len())
        .flat_map(|i| sync.outer(i).unwrap().to_vec())
        .map(f32::to_bits)
        .collect();
    assert_ne!(now, start);
    assert!(sync.save().is_ok());
}

/// Three members sync at step 3; member 2 then leaves. Members 0 and 1 re-form over a
/// world of two at `reform_at` (3: at once, a planned change; 6: when the next sync
/// fails midway, after each has encoded and sent part of it) and train on to `steps`.
fn member_2_leaves_after_the_first_sync(
    reform_at: u64,
    steps: u64,
    opts: &OuterOptions,
) -> Vec<(Ended, Heal)> {
    let layout = layout();
    let first = world(3);
    let second = world(2);
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        let mut first = first.into_iter();
        for (member, t2) in second.into_iter().enumerate() {
            let (layout, opts, t1) = (&layout, opts.clone(), first.next().unwrap());
            handles.push(s.spawn(move || {
                let mut params = init(layout);
                let mut sync = OuterSync::new(layout, &views(&params), t1, opts).unwrap();
                let (mut t2, mut healed) = (Some(t2), None);
                for step in 1..=steps {
                    inner_step(&mut params, member, step);
                    let res = sync.step(&mut slices(&mut params));
                    assert_eq!(res.is_err(), step == 6 && reform_at == 6, "step {step}");
                    if step == reform_at {
                        sync.reform(t2.take().unwrap()).unwrap();
                        healed = Some(sync.heal(&mut slices(&mut params)).unwrap());
                    }
                }
                let o = outers(&sync, layout.len());
                ((params, o), healed.unwrap())
            }));
        }
        let (layout, opts, t1) = (&layout, opts.clone(), first.next().unwrap());
        s.spawn(move || {
            let mut params = init(layout);
            let mut sync = OuterSync::new(layout, &views(&params), t1, opts).unwrap();
            for step in 1..=3 {
                inner_step(&mut params, 2, step);
                sync.step(&mut slices(&mut params)).unwrap();
            }
        });
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_sync_that_fails_midway_puts_the_residuals_back_before_it_runs_again() {
    // The failed attempt encoded (and sent) part of the pseudo-gradient through the
    // residuals; they are put back, so re-forming after the failure gives the bits of
    // re-forming before the sync.
    for (codec, strategy) in [
        ("int8", Strategy::CompressedRing),
        ("qsgd:bits=8", Strategy::TwoShot),
        ("int8", Strategy::CompressedAllGather),
    ] {
        let opts = options(codec, Feedback::Worker, strategy);
        let planned = member_2_leaves_after_the_first_sync(3, 12, &opts);
        let failed = member_2_leaves_after_the_first_sync(6, 12, &opts);
        let bits =
            |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
        for m in 0..2 {
            assert!(planned[m].1.retried.is_empty());
            assert_eq!(failed[m].1.retried, vec![(0, 2)], "{codec}");
            assert_eq!(
                bits(&failed[m].0.1),
                bits(&planned[m].0.1),
                "{codec} {strategy:?}: outer"
            );
            assert_eq!(
                bits(&failed[m].0.0),
                bits(&planned[m].0.0),
                "{codec} {strategy:?}: params"
            );
        }
    }
}

/// Two members whose parameters differ heal right after they are made: member 1 ends
/// with member 0's parameters and outer copy, to the bit. Returns member 0's heal.
fn heal_at_start(opts: &OuterOptions) -> Heal {
    let layout = layout();
    let got: Vec<(Ended, Heal)> = each_of_two(opts, |member, t, layout, opts| {
        let mut params = init(layout);
        if member == 1 {
            inner_step(&mut params, 1, 1);
        }
        let mut sync = OuterSync::new(layout, &views(&params), t, opts).unwrap();
        let heal = sync.heal(&mut slices(&mut params)).unwrap();
        let o = outers(&sync, layout.len());
        ((params, o), heal)
    });
    let bits = |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
    let want = bits(&init(&layout));
    for ((ended, heal), member) in got.iter().zip(0..) {
        assert_eq!(heal.healed, vec![1]);
        assert_eq!(heal.was_healed, member == 1);
        assert_eq!(bits(&ended.0), want, "member {member}'s params");
        assert_eq!(bits(&ended.1), want, "member {member}'s outer");
    }
    got[0].1.clone()
}

#[test]
fn healing_packs_the_state_on_a_slow_link_and_keeps_every_bit() {
    let on = |bandwidth_bit_s| OuterOptions {
        strategy: StrategyChoice::Auto {
            bandwidth_bit_s,
            latency_s: 1e-5,
            profile: None,
        },
        ..options("int8", Feedback::Worker, Strategy::CompressedRing)
    };
    let slow = heal_at_start(&on(1e6)).bytes_sent;
    let fast = heal_at_start(&on(1e15)).bytes_sent;
    // The state: an outer copy and a momentum of 4,672 values each (37,376 bytes) and
    // a few fields. Packed, each value keeps its 24 bits of sign and mantissa; the
    // momentum's exponents (all zero) take next to nothing, the outer copy's (a few
    // binades) about 3 bits: about 0.8 of the bytes.
    assert!(fast > 37_376, "{fast}");
    assert!(slow * 10 < fast * 9, "packed {slow} bytes, plain {fast}");
}
