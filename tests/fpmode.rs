//! Frames, decodes, error-feedback steps and the fused reduction do not depend on the
//! calling thread's floating-point mode: with flush-to-zero and subnormals-are-zero set
//! (FTZ/DAZ on x86-64, FZ/FZ16 on aarch64, as `torch.set_flush_denormal(True)` sets
//! them), every codec on every backend this CPU has gives the bytes and bits it gives in
//! the standard mode, on inputs full of subnormals and of values whose scaled codes,
//! products and sums are subnormal; and the caller's mode is set again afterwards. So
//! is a thread pool whose threads were created under the flushing mode.

mod common;

use common::*;
use gradpack::unstable::kernels::Backend;
use gradpack::unstable::kernels::fpmode::{flushes_subnormals, set_flush_subnormals};
use gradpack::{Codec, CodecSpec, EncodeCtx, ErrorFeedback};

fn backends() -> Vec<Backend> {
    every_kernel_set()
}

/// Subnormals of both signs, the smallest normals, tiny normals whose quotients by a
/// block scale or products with the DCT basis are subnormal, and ordinary values (so
/// every block has a different mix).
fn input(n: usize, salt: u32) -> Vec<f32> {
    let base = sample(n, salt);
    (0..n)
        .map(|i| {
            let h = gradpack::rng::lowbias32(i as u32 ^ salt.wrapping_mul(0x85EB_CA6B));
            let sign = if h & 1 == 1 { -1.0f32 } else { 1.0 };
            match (i / 7 + h as usize) % 5 {
                0 => sign * f32::from_bits(1 + (h >> 9) % 0x007F_FFFF), // subnormal
                1 => sign * f32::MIN_POSITIVE * (1.0 + (h >> 20) as f32 / 4096.0),
                2 => base[i] * 1e-37,
                3 => base[i] * 1e-30,
                _ => base[i],
            }
        })
        .collect()
}

/// Whether flushing is on: a subnormal product comes out zero. Not inlined, so the
/// product is computed between the calls around it.
#[inline(never)]
fn flushing_now() -> bool {
    core::hint::black_box(core::hint::black_box(f32::MIN_POSITIVE) * core::hint::black_box(0.25f32))
        == 0.0
}

/// `x * 0.5` element by element, as a kernel without the guard would compute it (not
/// inlined, so it runs between the mode changes around its call).
#[inline(never)]
fn halved(x: &[f32]) -> Vec<u32> {
    core::hint::black_box(
        x.iter()
            .map(|&v| (core::hint::black_box(v) * 0.5).to_bits())
            .collect(),
    )
}

struct Results {
    frame: Vec<u8>,
    decoded: Vec<u32>,
    added: Vec<u32>,
    reduced: Vec<u32>,
    feedback: Vec<Vec<u8>>,
    residual: Vec<u32>,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn run_all(spec: &CodecSpec, x: &[f32], acc0: &[f32]) -> Results {
    let ctx = EncodeCtx::new(0x5EED);
    let frame = spec.encode(x, &ctx).unwrap();
    let mut decoded = vec![0f32; x.len()];
    gradpack::decode(&frame, &mut decoded).unwrap();
    let mut added = acc0.to_vec();
    gradpack::decode_add(&frame, &mut added).unwrap();
    let other = spec.encode(acc0, &EncodeCtx::new(0xA11CE)).unwrap();
    let mut reduced = vec![0f32; x.len()];
    gradpack::reduce_frames(&[&frame, &other, &frame], &mut reduced).unwrap();
    let (mut feedback, mut residual) = (Vec::new(), Vec::new());
    if let Ok(mut ef) = ErrorFeedback::new(*spec, x.len()) {
        for step in 0..3u64 {
            feedback.push(ef.encode(x, &EncodeCtx::new(step)).unwrap());
        }
        residual = bits(&ef.residual_f32());
    }
    Results {
        frame,
        decoded: bits(&decoded),
        added: bits(&added),
        reduced: bits(&reduced),
        feedback,
        residual,
    }
}

fn same(spec: &CodecSpec, b: Backend, what: &str, want: &Results, got: &Results) {
    assert_eq!(want.frame, got.frame, "{spec} on {b} ({what}): frame");
    assert_eq!(want.decoded, got.decoded, "{spec} on {b} ({what}): decode");
    assert_eq!(want.added, got.added, "{spec} on {b} ({what}): decode_add");
    assert_eq!(
        want.reduced, got.reduced,
        "{spec} on {b} ({what}): reduce_frames"
    );
    assert_eq!(
        want.feedback, got.feedback,
        "{spec} on {b} ({what}): feedback frames"
    );
    assert_eq!(
        want.residual, got.residual,
        "{spec} on {b} ({what}): residual"
    );
}

#[test]
fn every_codec_ignores_flush_to_zero_on_every_backend() {
    if !set_flush_subnormals(true) {
        println!("SKIP: this target has no flush-to-zero mode");
        return;
    }
    assert!(flushing_now(), "the mode set really flushes");
    set_flush_subnormals(false);
    assert!(!flushing_now());

    for b in backends() {
        for spec in specs() {
            for (n, salt) in [(1000usize, 1u32), (4099, 2)] {
                let x = input(n, salt);
                let acc0 = input(n, salt + 7);
                let want = b.run(|| run_all(&spec, &x, &acc0));
                set_flush_subnormals(true);
                let got = b.run(|| run_all(&spec, &x, &acc0));
                // The register itself (no float arithmetic here: the compiler may move
                // that across the mode changes, which it assumes never happen).
                let still = flushes_subnormals();
                set_flush_subnormals(false);
                assert!(still, "{spec} on {b}: the caller's mode was not restored");
                same(&spec, b, "flushing caller", &want, &got);
            }
        }
    }
}

#[test]
fn the_standard_mode_really_differs_on_these_inputs() {
    // The test above would prove nothing if these inputs rounded the same under both
    // modes anyway: plain arithmetic on them (as a kernel without the guard would do)
    // differs.
    let x = input(4099, 1); // made in the standard mode
    if !set_flush_subnormals(true) {
        return;
    }
    let flushed = halved(&x);
    set_flush_subnormals(false);
    let kept = halved(&x);
    // Subnormals, and the smallest normals (whose halves are subnormal): two fifths.
    let differ = flushed.iter().zip(&kept).filter(|(a, b)| a != b).count();
    assert!(differ > x.len() / 4, "only {differ} of {} differ", x.len());
}

#[cfg(feature = "rayon")]
#[test]
fn pool_threads_made_under_flushing_give_the_same_frames() {
    // Threads inherit their creator's mode: a pool built while flushing has flushing
    // workers. Large tensors split across them (the threshold lowered to split).
    let n = 5 * gradpack::parallel::CHUNK + 77;
    let x = input(n, 9);
    let acc0 = input(n, 10);
    if !set_flush_subnormals(true) {
        return;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    set_flush_subnormals(false);
    assert!(pool.install(flushing_now), "the workers flush");
    gradpack::parallel::set_min_len(0);
    for spec in [
        "int8:block=64",
        "fp16",
        "topk:ratio=0.01,values=fp16",
        "qsgd:bits=4,block=64",
        "dct:chunk=64,k=4",
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        let want = run_all(&spec, &x, &acc0);
        let got = pool.install(|| run_all(&spec, &x, &acc0));
        same(&spec, Backend::current(), "flushing pool", &want, &got);
    }
    gradpack::parallel::set_min_len(gradpack::parallel::DEFAULT_MIN_LEN);
}

#[test]
fn a_rank_that_flushes_stays_identical_to_the_others() {
    // Three in-process ranks run the compressed collectives with error feedback on
    // inputs full of subnormals; in the second world rank 1 flushes (as a framework
    // would have set it). Every rank's output and residual are the bits of the first
    // world's.
    use gradpack::collective::{
        AllReduce, AllReduceOptions, Feedback, Strategy, StrategyChoice, Transport, local,
    };
    if !set_flush_subnormals(true) {
        return;
    }
    set_flush_subnormals(false);
    let n = 3000;
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| input(n, 20 + r)).collect();
    for (spec, strategy, feedback) in [
        (
            "int8:block=64",
            Strategy::CompressedRing,
            Feedback::WorkerAndOwner,
        ),
        ("fp16", Strategy::CompressedAllGather, Feedback::Worker),
        ("sign:block=64", Strategy::SignMajority, Feedback::Worker),
        ("dct:chunk=64,k=4", Strategy::CompressedRing, Feedback::None),
        ("identity", Strategy::Fp32Ring, Feedback::None),
    ] {
        let codec: CodecSpec = spec.parse().unwrap();
        let o = AllReduceOptions {
            strategy: StrategyChoice::Forced(strategy),
            feedback,
            ..Default::default()
        };
        let world = |flusher: Option<usize>| {
            local::run(3, Some(std::time::Duration::from_secs(30)), |mut t| {
                let rank = t.rank();
                if Some(rank) == flusher {
                    set_flush_subnormals(true);
                }
                let mut ar = AllReduce::new(codec, n, &t, o.clone())?;
                let mut outs = Vec::new();
                for step in 0..3u64 {
                    let mut out = vec![0f32; n];
                    ar.run(&mut t, &inputs[rank], &mut out, 5 + step)?;
                    outs.push(bits(&out));
                }
                let flushed = flushes_subnormals();
                set_flush_subnormals(false);
                Ok((outs, bits(&ar.residual_f32()), flushed))
            })
        };
        let want = world(None);
        let got = world(Some(1));
        for (r, (w, g)) in want.into_iter().zip(got).enumerate() {
            let (w, g) = (w.unwrap(), g.unwrap());
            assert_eq!(g.2, r == 1, "{spec}: rank {r}'s mode after the runs");
            assert_eq!(w.0, g.0, "{spec} by {strategy:?}: rank {r}'s outputs");
            assert_eq!(w.1, g.1, "{spec} by {strategy:?}: rank {r}'s residual");
        }
    }
}
