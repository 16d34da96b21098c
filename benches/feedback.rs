//! Error feedback and the parallel split, in GB/s of f32 gradient input.
//!
//! - `ef/SPEC/N`: the codec's plain `encode_into` and a fused error-feedback step with an
//!   f32 and (fixed-rate codecs) a bf16 residual, on one thread, at 64 Ki elements by
//!   default (`GRADPACK_EF_SIZES`).
//! - `par/SPEC/N`: encode, decode and an error-feedback step on a one-thread rayon pool
//!   (`1t`) and on a two-thread pool with the split forced on (`2t`), at 64 Ki to 64 Mi
//!   elements by default (`GRADPACK_PAR_SIZES`). The `2t`/`1t` ratio below
//!   `parallel::DEFAULT_MIN_LEN` is what sets that threshold.
//!
//! - `auto/SPEC/N`: direct calls on the main thread, sequential against the default
//!   threshold, at 256 Ki to 1 Mi elements (`GRADPACK_AUTO_SIZES`).
//!
//! Run: `cargo bench --bench feedback` (about 20 minutes here), or a filter such as
//! `cargo bench --bench feedback -- ef/`.

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::hint::black_box;
use std::time::Duration;

mod common;

use common::{SPECS, pool, sizes};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gradpack::{Codec, CodecSpec, EncodeCtx, ErrorFeedback, FeedbackOptions, ResidualPrecision};

/// These benchmarks measure speed, not convergence: every codec is accepted, including
/// the non-contractive ones error feedback refuses by default (QSGD at 2 and 4 bits).
fn any_codec() -> FeedbackOptions {
    FeedbackOptions {
        allow_non_contractive: true,
        ..Default::default()
    }
}

fn bf16_options() -> FeedbackOptions {
    FeedbackOptions {
        precision: ResidualPrecision::Bf16,
        ..any_codec()
    }
}

fn feedback(c: &mut Criterion) {
    gradpack::parallel::set_min_len(usize::MAX);
    for n in sizes("GRADPACK_EF_SIZES", &[1 << 16]) {
        let x = gradpack::synthetic::gradient(n, 7);
        for s in SPECS {
            let spec: CodecSpec = s.parse().unwrap();
            let ctx = EncodeCtx::new(1);
            let mut frame = vec![0u8; spec.max_encoded_len(n)];
            let mut g = c.benchmark_group(format!("ef/{s}/{n}"));
            g.throughput(Throughput::Bytes(4 * n as u64));
            g.bench_function("encode", |b| {
                b.iter(|| spec.encode_into(black_box(&x), &ctx, &mut frame).unwrap())
            });
            let mut ef = ErrorFeedback::with_options(spec, n, any_codec()).unwrap();
            g.bench_function("ef_f32", |b| {
                b.iter(|| ef.encode_into(black_box(&x), &ctx, &mut frame).unwrap())
            });
            if let Ok(mut ef) = ErrorFeedback::with_options(spec, n, bf16_options()) {
                g.bench_function("ef_bf16", |b| {
                    b.iter(|| ef.encode_into(black_box(&x), &ctx, &mut frame).unwrap())
                });
            }
            g.finish();
        }
    }
}

fn parallel(c: &mut Criterion) {
    let sizes = sizes(
        "GRADPACK_PAR_SIZES",
        &[1 << 16, 1 << 17, 1 << 18, 1 << 20, 1 << 26],
    );
    let pools = [(1, pool(1)), (2, pool(2))];
    gradpack::parallel::set_min_len(0);
    for n in sizes {
        let x = gradpack::synthetic::gradient(n, 7);
        for s in SPECS {
            let spec: CodecSpec = s.parse().unwrap();
            let ctx = EncodeCtx::new(1);
            let mut frame = vec![0u8; spec.max_encoded_len(n)];
            let len = spec.encode_into(&x, &ctx, &mut frame).unwrap();
            let mut out = vec![0f32; n];
            let mut ef = ErrorFeedback::with_options(spec, n, any_codec()).unwrap();
            let mut g = c.benchmark_group(format!("par/{s}/{n}"));
            g.throughput(Throughput::Bytes(4 * n as u64));
            if n >= 1 << 24 {
                g.sample_size(10).warm_up_time(Duration::from_millis(500));
            }
            for (t, p) in &pools {
                g.bench_function(format!("encode_{t}t"), |b| {
                    b.iter(|| {
                        p.install(|| spec.encode_into(black_box(&x), &ctx, &mut frame).unwrap())
                    })
                });
                g.bench_function(format!("decode_{t}t"), |b| {
                    b.iter(|| {
                        p.install(|| gradpack::decode(black_box(&frame[..len]), &mut out).unwrap())
                    })
                });
                g.bench_function(format!("ef_{t}t"), |b| {
                    b.iter(|| {
                        p.install(|| ef.encode_into(black_box(&x), &ctx, &mut frame).unwrap())
                    })
                });
            }
            g.finish();
        }
    }
}

/// Direct calls from the main thread: sequential (`seq`, split off) against the default
/// threshold (`auto`, which hands large tensors to rayon's global pool), around the
/// threshold: what decides `parallel::DEFAULT_MIN_LEN`.
fn threshold(c: &mut Criterion) {
    let sizes = sizes("GRADPACK_AUTO_SIZES", &[1 << 18, 1 << 19, 1 << 20, 1 << 21]);
    for n in sizes {
        let x = gradpack::synthetic::gradient(n, 7);
        for s in [
            "identity",
            "fp16",
            "sign",
            "int8",
            "int8:rounding=stochastic",
            "qsgd:bits=4",
        ] {
            let spec: CodecSpec = s.parse().unwrap();
            let ctx = EncodeCtx::new(1);
            let mut frame = vec![0u8; spec.max_encoded_len(n)];
            let len = spec.encode_into(&x, &ctx, &mut frame).unwrap();
            let mut out = vec![0f32; n];
            let mut ef = ErrorFeedback::with_options(spec, n, any_codec()).unwrap();
            let mut g = c.benchmark_group(format!("auto/{s}/{n}"));
            g.throughput(Throughput::Bytes(4 * n as u64));
            for (name, min) in [
                ("seq", usize::MAX),
                ("auto", gradpack::parallel::DEFAULT_MIN_LEN),
            ] {
                gradpack::parallel::set_min_len(min);
                g.bench_function(format!("encode_{name}"), |b| {
                    b.iter(|| spec.encode_into(black_box(&x), &ctx, &mut frame).unwrap())
                });
                g.bench_function(format!("decode_{name}"), |b| {
                    b.iter(|| gradpack::decode(black_box(&frame[..len]), &mut out).unwrap())
                });
                g.bench_function(format!("ef_{name}"), |b| {
                    b.iter(|| ef.encode_into(black_box(&x), &ctx, &mut frame).unwrap())
                });
            }
            g.finish();
        }
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

criterion_group! { name = benches; config = config(); targets = feedback, parallel, threshold }
criterion_main!(benches);
