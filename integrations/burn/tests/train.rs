//! Two workers train the digits MLP through `GradSync` for a few dozen steps: their
//! parameters are bit-identical after every step, the loss falls, and a checkpoint of
//! the sync state restores.

#[path = "../examples/common/mod.rs"]
mod common;

use std::time::Duration;

use gradpack::collective::{Feedback, Transport, local};
use gradpack::sync::{Policy, SyncOptions};

fn train(spec: &str, feedback: Feedback, workers: usize) -> Vec<common::WorkerResult> {
    let d = common::digits();
    let cfg = common::RunConfig {
        hidden: 64,
        steps: 60,
        batch: 32,
        lr: 0.05,
        seed: 3,
    };
    let opts = SyncOptions {
        policy: Policy::with_rules(spec.parse().unwrap()),
        feedback,
        ..SyncOptions::default()
    };
    local::run(workers, Some(Duration::from_secs(60)), |comm| {
        let rank = comm.rank();
        common::worker(comm.into_inner(), rank, workers, &d, &cfg, opts.clone())
            .map_err(|e| gradpack::Error::Collective(e.to_string()))
    })
    .into_iter()
    .map(|r| r.expect("worker"))
    .collect()
}

fn check(results: &[common::WorkerResult]) {
    for w in &results[1..] {
        assert_eq!(w.param_hashes, results[0].param_hashes, "workers diverged");
    }
    let l = &results[0].losses;
    let (first, last) = (
        l[..10].iter().sum::<f32>(),
        l[l.len() - 10..].iter().sum::<f32>(),
    );
    assert!(last < first / 2.0, "loss did not fall: {first} -> {last}");
}

#[test]
fn two_workers_stay_identical_and_learn_with_int8() {
    check(&train("int8", Feedback::None, 2));
}

#[test]
fn three_workers_stay_identical_and_learn_with_top_k_and_error_feedback() {
    check(&train("topk:ratio=0.01,values=fp16", Feedback::Worker, 3));
}

#[test]
fn layout_names_the_parameters_by_their_paths() {
    let m = common::model(16, 1);
    let names: Vec<String> = gradpack_burn::layout::<common::TB, _>(&m)
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(
        names,
        [
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
            "fc2.bias",
            "fc3.weight",
            "fc3.bias"
        ]
    );
}
