//! The two-level all-reduce: identical results on every rank, the flat sum within the
//! codec's bound on the leg between nodes, nodes of unequal size, error feedback between
//! nodes, a failed rank.

use std::time::{Duration, Instant};

use gradpack::collective::{
    AllReduceOptions, Feedback, Hierarchical, Nodes, ReduceOp, Strategy, StrategyChoice, Transport,
    error_bound, local,
};
use gradpack::{CodecSpec, Error};

fn spec(s: &str) -> CodecSpec {
    s.parse().unwrap()
}

fn input(rank: usize, n: usize, step: u64) -> Vec<f32> {
    (0..n)
        .map(|j| {
            ((j as f32 * 0.173 + rank as f32 * 1.31 + step as f32 * 0.7).sin())
                * (1.0 + rank as f32 * 0.25)
        })
        .collect()
}

fn opts(strategy: Option<Strategy>, feedback: Feedback, pieces: usize) -> AllReduceOptions {
    AllReduceOptions {
        op: ReduceOp::Sum,
        strategy: strategy.map(StrategyChoice::Forced).unwrap_or_default(),
        feedback,
        pieces,
        ..Default::default()
    }
}

/// Every rank's output of `steps` runs.
fn run(
    nodes: &Nodes,
    codec: &str,
    node_codec: &str,
    n: usize,
    o: &AllReduceOptions,
    steps: u64,
) -> Vec<Vec<Vec<f32>>> {
    run_by(nodes, codec, node_codec, n, o, steps, false)
}

/// [`run`] through `run`, or (`in_place`) through `run_in_place` on a copy of the input.
fn run_by(
    nodes: &Nodes,
    codec: &str,
    node_codec: &str,
    n: usize,
    o: &AllReduceOptions,
    steps: u64,
    in_place: bool,
) -> Vec<Vec<Vec<f32>>> {
    local::run(nodes.world(), Some(Duration::from_secs(20)), |mut comm| {
        let r = comm.rank();
        let mut h = Hierarchical::new(
            spec(codec),
            spec(node_codec),
            n,
            &comm,
            nodes.clone(),
            o.clone(),
        )?;
        let mut outs = Vec::new();
        for step in 0..steps {
            let x = input(r, n, step);
            let out = if in_place {
                let mut data = x;
                h.run_in_place(&mut comm, &mut data, 1000 + step)?;
                data
            } else {
                let mut out = vec![f32::NAN; n];
                h.run(&mut comm, &x, &mut out, 1000 + step)?;
                out
            };
            outs.push(out);
        }
        Ok(outs)
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .unwrap()
}

/// The exact sum (f64) of every rank's input at `step`, and per shard the sum over nodes
/// of each node sum's largest magnitude.
fn exact(nodes: &Nodes, n: usize, step: u64) -> (Vec<f64>, f64) {
    let mut sum = vec![0f64; n];
    let mut a = 0f64;
    for k in 0..nodes.count() {
        let mut node = vec![0f64; n];
        for &r in nodes.members(k) {
            for (j, v) in input(r, n, step).into_iter().enumerate() {
                node[j] += v as f64;
            }
        }
        a += node.iter().fold(0f64, |m, v| m.max(v.abs()));
        sum.iter_mut().zip(&node).for_each(|(s, v)| *s += v);
    }
    (sum, a)
}

#[test]
fn every_rank_ends_with_the_same_sum_within_the_codec_bound_between_nodes() {
    let maps = [
        Nodes::uniform(8, 4).unwrap(),
        Nodes::uniform(6, 2).unwrap(),
        Nodes::new(vec![0, 0, 0, 1, 2, 2]).unwrap(), // 3, 1 and 2 ranks
        Nodes::new(vec![1, 0, 1, 0, 1]).unwrap(),    // interleaved, unequal
        Nodes::uniform(4, 4).unwrap(),               // one node
        Nodes::uniform(3, 1).unwrap(),               // a rank per node
    ];
    let n = 1037;
    for nodes in &maps {
        for (codec, strategy, pieces) in [
            ("identity", Some(Strategy::Fp32Ring), 1),
            ("int8", Some(Strategy::CompressedRing), 2),
            ("int8", Some(Strategy::CompressedAllGather), 1),
            ("int8", Some(Strategy::TwoShot), 2),
            ("fp16", None, 1),
        ] {
            let o = opts(strategy, Feedback::None, pieces);
            let outs = run(nodes, codec, "identity", n, &o, 2);
            for (step, _) in outs[0].iter().enumerate() {
                for r in 1..outs.len() {
                    assert!(
                        outs[r][step]
                            .iter()
                            .zip(&outs[0][step])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{nodes:?} {codec}: rank {r} differs at step {step}"
                    );
                }
                let (sum, a) = exact(nodes, n, step as u64);
                let s = strategy.unwrap_or(Strategy::CompressedRing);
                let s = if codec == "identity" {
                    Strategy::Fp32Ring
                } else {
                    s
                };
                // The leg between nodes, plus f32 rounding of the sums inside a node.
                let bound = error_bound(&spec(codec), s, nodes.count(), a)
                    + nodes.world() as f64 * f32::EPSILON as f64 * a;
                for (j, (&got, &want)) in outs[0][step].iter().zip(&sum).enumerate() {
                    assert!(
                        (got as f64 - want).abs() <= bound,
                        "{nodes:?} {codec}: element {j} {got} vs {want} (bound {bound})"
                    );
                }
            }
        }
    }
}

/// In place, the same bits as with a separate output: nodes of equal and unequal size,
/// a node of one rank, codecs inside and between nodes, error feedback, pieces.
#[test]
fn in_place_runs_give_the_same_bits() {
    let maps = [
        Nodes::uniform(6, 3).unwrap(),
        Nodes::new(vec![0, 0, 1, 1, 1, 2]).unwrap(),
        Nodes::uniform(3, 1).unwrap(),
        Nodes::uniform(4, 4).unwrap(),
    ];
    for nodes in &maps {
        for (codec, node_codec, o) in [
            ("int8", "identity", opts(None, Feedback::None, 1)),
            (
                "fp16",
                "bf16",
                opts(Some(Strategy::CompressedRing), Feedback::WorkerAndOwner, 2),
            ),
            (
                "topk:ratio=0.1",
                "identity",
                opts(None, Feedback::Worker, 1),
            ),
        ] {
            for n in [0, 5, 1001] {
                let a = run_by(nodes, codec, node_codec, n, &o, 2, false);
                let b = run_by(nodes, codec, node_codec, n, &o, 2, true);
                let bits = |v: &Vec<Vec<Vec<f32>>>| -> Vec<Vec<Vec<u32>>> {
                    v.iter()
                        .map(|r| {
                            r.iter()
                                .map(|s| s.iter().map(|x| x.to_bits()).collect())
                                .collect()
                        })
                        .collect()
                };
                assert!(bits(&a) == bits(&b), "{codec}/{node_codec} n={n} {nodes:?}");
            }
        }
    }
}

#[test]
fn bf16_inside_nodes_keeps_every_rank_identical() {
    let nodes = Nodes::new(vec![0, 0, 1, 1, 1]).unwrap();
    let outs = run(
        &nodes,
        "int8",
        "bf16",
        999,
        &opts(None, Feedback::None, 1),
        1,
    );
    for r in 1..outs.len() {
        assert_eq!(outs[r], outs[0], "rank {r}");
    }
    let (sum, a) = exact(&nodes, 999, 0);
    for (got, want) in outs[0][0].iter().zip(&sum) {
        // bf16 (8 bits of mantissa) on every partial and on the result, and int8 between.
        assert!(
            (*got as f64 - want).abs() <= a * (5.0 / 256.0 + 2.0 / 127.0),
            "{got} vs {want}"
        );
    }
}

#[test]
fn error_feedback_between_nodes_keeps_the_running_sum_on_track() {
    // The same input every step: int8 rounding is then the same every step, and without
    // feedback its error piles up; with it, the running sum of outputs stays within one
    // step's error of the running sum of inputs.
    let nodes = Nodes::uniform(4, 2).unwrap();
    let n = 4096;
    let steps = 12u64;
    let cum = |fb: Feedback| {
        let o = opts(Some(Strategy::CompressedRing), fb, 1);
        let outs = local::run(4, Some(Duration::from_secs(20)), |mut comm| {
            let r = comm.rank();
            let mut h = Hierarchical::new(
                spec("int8"),
                spec("identity"),
                n,
                &comm,
                nodes.clone(),
                o.clone(),
            )?;
            let x = input(r, n, 0);
            let mut total = vec![0f64; n];
            for step in 0..steps {
                let mut out = vec![0f32; n];
                h.run(&mut comm, &x, &mut out, step)?;
                total
                    .iter_mut()
                    .zip(&out)
                    .for_each(|(t, &v)| *t += v as f64);
            }
            Ok(total)
        });
        let total = outs.into_iter().next().unwrap().unwrap();
        let (sum, _) = exact(&nodes, n, 0);
        total
            .iter()
            .zip(&sum)
            .map(|(t, s)| (t - steps as f64 * s).abs())
            .fold(0f64, f64::max)
    };
    let (without, with) = (cum(Feedback::None), cum(Feedback::WorkerAndOwner));
    assert!(
        with * 4.0 < without,
        "with feedback {with}, without {without}"
    );
}

#[test]
fn a_failed_rank_inside_a_node_is_an_error_on_every_rank_within_the_timeout() {
    let nodes = Nodes::uniform(6, 3).unwrap();
    let timeout = Duration::from_millis(500);
    let t0 = Instant::now();
    let res = local::run(6, Some(timeout), |mut comm| {
        let r = comm.rank();
        let mut h = Hierarchical::new(
            spec("int8"),
            spec("identity"),
            600,
            &comm,
            nodes.clone(),
            opts(None, Feedback::None, 1),
        )?;
        if r == 4 {
            return Ok(()); // dies before the call
        }
        let x = input(r, 600, 0);
        let mut out = vec![0f32; 600];
        h.run(&mut comm, &x, &mut out, 1).map(|_| ())
    });
    assert!(t0.elapsed() < timeout * 12, "{:?}", t0.elapsed());
    for (r, x) in res.iter().enumerate() {
        if r != 4 {
            assert!(
                matches!(x, Err(Error::Transport { .. }) | Err(Error::Peer { .. })),
                "rank {r}: {x:?}"
            );
        }
    }
}

#[test]
fn bad_arguments_are_errors() {
    assert!(Nodes::new(vec![]).is_err());
    assert!(Nodes::new(vec![0, 2]).is_err(), "node 1 missing");
    assert!(Nodes::uniform(4, 0).is_err());
    let keyed = Nodes::from_keys(&["b", "a", "b", "c"]).unwrap();
    assert_eq!((keyed.count(), keyed.members(0)), (3, &[0usize, 2][..]));
    let res = local::run(2, None, |mut comm| {
        // A map of another world, and a lossy codec inside nodes.
        assert!(
            Hierarchical::new(
                spec("int8"),
                spec("identity"),
                10,
                &comm,
                Nodes::uniform(3, 1)?,
                opts(None, Feedback::None, 1)
            )
            .is_err()
        );
        assert!(
            Hierarchical::new(
                spec("int8"),
                spec("int8"),
                10,
                &comm,
                Nodes::uniform(2, 1)?,
                opts(None, Feedback::None, 1)
            )
            .is_err()
        );
        let mut h = Hierarchical::new(
            spec("int8"),
            spec("identity"),
            10,
            &comm,
            Nodes::uniform(2, 1)?,
            opts(None, Feedback::None, 1),
        )?;
        let mut out = vec![0f32; 10];
        assert!(matches!(
            h.run(&mut comm, &[0.0; 9], &mut out, 0),
            Err(Error::LengthMismatch { .. })
        ));
        // Both ranks made the same failed call: the next one works.
        h.run(&mut comm, &[1.0; 10], &mut out, 1)?;
        assert!(out.iter().all(|&v| (v - 2.0).abs() < 0.05));
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}
