//! Workers train the digits MLP alone and `DiLoCo` syncs them: every worker holds the
//! same parameters after each sync, the loss falls, streaming fragments work, and a
//! checkpoint taken mid-round (an all-reduce in flight) resumes bit for bit.

#[path = "../examples/common/mod.rs"]
mod common;

use std::time::Duration;

use gradpack::collective::{Feedback, Transport, local};
use gradpack_burn::OuterOptions;

fn config(steps: usize, seed: u64, checkpoint: bool) -> common::RunConfig {
    common::RunConfig {
        hidden: 64,
        steps,
        batch: 32,
        lr: 0.05,
        seed,
        checkpoint,
    }
}

fn run(
    cfg: &common::RunConfig,
    opts: &OuterOptions,
    workers: usize,
    resume: Option<&[common::Checkpoint]>,
) -> Vec<common::WorkerResult> {
    let d = common::digits();
    local::run(workers, Some(Duration::from_secs(60)), |comm| {
        let rank = comm.rank();
        let from = resume.map(|c| &c[rank]);
        common::diloco_worker(
            comm.into_inner(),
            rank,
            workers,
            &d,
            cfg,
            opts.clone(),
            from,
        )
        .map_err(|e| gradpack::Error::Collective(e.to_string()))
    })
    .into_iter()
    .map(|r| r.expect("worker"))
    .collect()
}

fn falls(l: &[f32]) -> bool {
    let (first, last) = (
        l[..10].iter().sum::<f32>(),
        l[l.len() - 10..].iter().sum::<f32>(),
    );
    last < first / 2.0
}

#[test]
fn workers_hold_the_same_parameters_after_every_sync_and_learn() {
    let opts = OuterOptions {
        sync_every: 5,
        codec: "int8".parse().unwrap(),
        feedback: Feedback::Worker,
        ..Default::default()
    };
    let r = run(&config(60, 3, false), &opts, 2, None);
    for s in 0..60 {
        let synced = (s + 1) % 5 == 0;
        assert_eq!(
            r[0].param_hashes[s] == r[1].param_hashes[s],
            synced,
            "step {s}: the same parameters exactly after a sync"
        );
    }
    assert!(falls(&r[0].losses), "{:?}", r[0].losses);
    assert!(r[0].bytes_sent > 0);
}

#[test]
fn streaming_fragments_with_delay_train_too() {
    let opts = OuterOptions {
        sync_every: 6,
        fragments: 3,
        delay: 1,
        alpha: 0.5,
        codec: "fp4".parse().unwrap(),
        ..Default::default()
    };
    let r = run(&config(60, 3, false), &opts, 3, None);
    assert!(falls(&r[0].losses), "{:?}", r[0].losses);
}

#[test]
fn a_checkpoint_mid_round_resumes_bit_for_bit() {
    // Fragment syncs at steps 3 and 6 of each 6, formed a step before: the checkpoint
    // after step 20 holds fragment 0's all-reduce, formed at step 20, unapplied.
    let opts = OuterOptions {
        sync_every: 6,
        fragments: 2,
        delay: 1,
        codec: "int8:rounding=stochastic".parse().unwrap(),
        feedback: Feedback::Worker,
        ..Default::default()
    };
    let whole = run(&config(40, 3, false), &opts, 2, None);
    let first = run(&config(20, 3, true), &opts, 2, None);
    assert_eq!(first[0].param_hashes[..], whole[0].param_hashes[..20]);
    let saved: Vec<common::Checkpoint> = first
        .iter()
        .map(|w| w.checkpoint.clone().expect("checkpoint"))
        .collect();
    let resumed = run(&config(40, 99, false), &opts, 2, Some(&saved));
    for (w, r) in resumed.iter().zip(&whole) {
        assert_eq!(
            w.param_hashes[..],
            r.param_hashes[20..],
            "the resumed run left the uninterrupted one"
        );
    }
}
