//! Two workers train the digits MLP through `GradSync` for a few dozen steps: their
//! parameters are bit-identical after every step, the loss falls, and a checkpoint of
//! model, optimizer and sync state resumes bit-identically.

#[path = "../examples/common/mod.rs"]
mod common;

use std::time::Duration;

use gradpack::collective::{Feedback, Transport, local};
use gradpack::sync::{Policy, PowerSgd, SyncOptions};

fn config(steps: usize, seed: u64, checkpoint: bool) -> common::RunConfig {
    common::RunConfig {
        // fc2 (192 x 192) is above the engine's small-tensor size: it goes compressed.
        hidden: 192,
        steps,
        batch: 32,
        lr: 0.05,
        seed,
        checkpoint,
    }
}

fn options(spec: &str, feedback: Feedback) -> SyncOptions {
    SyncOptions {
        policy: Policy::with_rules(spec.parse().unwrap()),
        feedback,
        ..SyncOptions::default()
    }
}

/// Runs `workers` workers to `cfg.steps`, worker `r` resuming from `resume[r]` if given.
fn run(
    cfg: &common::RunConfig,
    opts: &SyncOptions,
    workers: usize,
    resume: Option<&[common::Checkpoint]>,
) -> Vec<common::WorkerResult> {
    let d = common::digits();
    local::run(workers, Some(Duration::from_secs(60)), |comm| {
        let rank = comm.rank();
        let from = resume.map(|c| &c[rank]);
        common::worker(
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

fn train(spec: &str, feedback: Feedback, workers: usize) -> Vec<common::WorkerResult> {
    run(
        &config(60, 3, false),
        &options(spec, feedback),
        workers,
        None,
    )
}

fn check(results: &[common::WorkerResult]) {
    assert_eq!(results[0].compressed_elements, 192 * 192, "fc2 compressed");
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
fn momentum_correction_in_the_engine_trains_and_resumes_bit_identically() {
    // The engine keeps the velocity (SyncOptions::momentum 0.9) and SGD has none: sign
    // with error feedback on 2 workers stays identical and learns, and a checkpoint of
    // model, optimizer and engine (its velocities too) resumes bit for bit.
    let opts = SyncOptions {
        momentum: 0.9,
        ..options("sign", Feedback::Worker)
    };
    let results = run(&config(60, 3, false), &opts, 2, None);
    check(&results);
    let half = run(&config(30, 3, true), &opts, 2, None);
    let ckpts: Vec<_> = half.into_iter().map(|w| w.checkpoint.unwrap()).collect();
    let resumed = run(&config(60, 99, false), &opts, 2, Some(&ckpts));
    for (r, w) in resumed.iter().enumerate() {
        assert_eq!(
            w.param_hashes[..],
            results[r].param_hashes[30..],
            "worker {r} resumed differently"
        );
    }
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
fn two_workers_stay_identical_and_learn_with_powersgd() {
    // Every weight matrix as rank-2 factors (with error feedback), the biases in fp32.
    let opts = SyncOptions {
        policy: Policy::powersgd(PowerSgd::rank(2)),
        ..SyncOptions::default()
    };
    let results = run(&config(60, 3, false), &opts, 2, None);
    assert_eq!(
        results[0].compressed_elements,
        64 * 192 + 192 * 192 + 192 * 10,
        "every weight matrix as factors"
    );
    assert_eq!(
        results[0].param_hashes, results[1].param_hashes,
        "workers diverged"
    );
    let l = &results[0].losses;
    let (first, last) = (
        l[..10].iter().sum::<f32>(),
        l[l.len() - 10..].iter().sum::<f32>(),
    );
    assert!(last < first / 2.0, "loss did not fall: {first} -> {last}");
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

/// Training stopped at step 20, its model, optimizer and sync state saved, and resumed in a
/// fresh model (made from another seed), optimizer and `GradSync` continues bit for bit as
/// the run that never stopped. Without the sync state (error-feedback residuals) it does
/// not: the check can fail.
#[test]
fn a_checkpoint_of_model_optimizer_and_sync_state_resumes_bit_identically() {
    let opts = options("topk:ratio=0.01,values=fp16", Feedback::Worker);
    let whole = run(&config(40, 3, false), &opts, 2, None);
    assert_eq!(whole[0].compressed_elements, 192 * 192, "fc2 compressed");
    let first = run(&config(20, 3, true), &opts, 2, None);
    assert_eq!(first[0].param_hashes[..], whole[0].param_hashes[..20]);
    let saved: Vec<common::Checkpoint> = first
        .iter()
        .map(|w| w.checkpoint.clone().expect("checkpoint"))
        .collect();
    assert!(saved.iter().all(|c| c.step == 20));
    let resumed = run(&config(40, 99, false), &opts, 2, Some(&saved));
    for w in &resumed {
        assert_eq!(
            w.param_hashes[..],
            whole[0].param_hashes[20..],
            "the resumed run left the uninterrupted one"
        );
    }
    let mut no_sync = saved.clone();
    for c in &mut no_sync {
        c.sync = None;
    }
    let lost = run(&config(40, 3, false), &opts, 2, Some(&no_sync));
    assert_eq!(lost[0].param_hashes, lost[1].param_hashes);
    assert_ne!(
        lost[0].param_hashes[..],
        whole[0].param_hashes[20..],
        "dropping the residuals changed nothing: the test cannot tell a restore from none"
    );
}

#[test]
fn measured_auto_in_the_engine_trains_and_resumes_bit_identically() {
    // Each bucket's codec and route measured (float32, then the model's two best of
    // fp16 and int8, two steps each; the crate's Tuner decides, as for the PyTorch
    // hook): the workers stay identical and learn, and resumed from a checkpoint taken
    // after the decision they stay identical (the engine's own tests check that a
    // restored plan continues bit for bit).
    let opts = SyncOptions {
        policy: Policy::auto(vec!["fp16".parse().unwrap(), "int8".parse().unwrap()]),
        trials: 2,
        trial_steps: 2,
        ..SyncOptions::default()
    };
    let results = run(&config(60, 3, false), &opts, 2, None);
    assert_eq!(
        results[0].param_hashes, results[1].param_hashes,
        "workers diverged"
    );
    let l = &results[0].losses;
    let (first, last) = (l[..10].iter().sum::<f32>(), l[50..].iter().sum::<f32>());
    assert!(last < first / 2.0, "loss did not fall: {first} -> {last}");
    let half = run(&config(30, 3, true), &opts, 2, None);
    let ckpts: Vec<_> = half.into_iter().map(|w| w.checkpoint.unwrap()).collect();
    let resumed = run(&config(60, 99, false), &opts, 2, Some(&ckpts));
    for (r, w) in resumed.iter().enumerate() {
        assert_eq!(w.param_hashes.len(), 30);
        assert_eq!(w.param_hashes, resumed[0].param_hashes, "worker {r}");
    }
}
