//! Sparsification speed, in GB/s of f32 gradient input, one thread, the default backend:
//! `sparsify/N/NAME` for the synthetic gradient (heavy-tailed, layered) at 64 Ki and
//! 1 Mi elements by default (`GRADPACK_SPARSIFY_SIZES`).
//!
//! - `select_nth_baseline`: what a plain implementation does: copy `|x|` into a buffer
//!   and `select_nth_unstable_by` the k-th largest (no frame written). The issue's
//!   reference point for the top-k targets.
//! - `topk_exact`, `topk_approx`: `topk:ratio=0.01,values=fp16` encode, exact and
//!   `select=approx` (tolerance 0.25).
//! - `threshold`: `topk:threshold=T,values=fp16` with `T` the exact top-1% magnitude.
//! - `randk`, `randk_strata`: `randk:ratio=0.01,values=fp16` encode, bernoulli and
//!   `select=strata` selection; `*_decode` and `*_decode_add`: their frames decoded
//!   (written, or added to an accumulator).
//! - `filter`: one compare-and-compress pass (`kernels::filter_mag_ge`) at the top-1%
//!   magnitude, the building block of every top-k route.
//! - `memcpy`, `read`: the same-run baselines (copy the f32 buffer; a 16-lane sum).
//!
//! Run: `cargo bench --bench sparsify` (about 2 minutes here).

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::hint::black_box;
use std::time::Duration;

mod common;

use common::{read_pass, sizes};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gradpack::{Codec, CodecSpec, EncodeCtx};

fn sparsify(c: &mut Criterion) {
    gradpack::parallel::set_min_len(usize::MAX);
    for n in sizes("GRADPACK_SPARSIFY_SIZES", &[1 << 16, 1 << 20]) {
        let x = gradpack::synthetic::gradient(n, 7);
        let k = n.div_ceil(100);
        let mut g = c.benchmark_group(format!("sparsify/{n}"));
        g.throughput(Throughput::Bytes(4 * n as u64));
        g.warm_up_time(Duration::from_millis(500));
        g.measurement_time(Duration::from_secs(2));
        let mut mags = vec![0f32; n];
        g.bench_function("select_nth_baseline", |b| {
            b.iter(|| {
                for (m, v) in mags.iter_mut().zip(&x) {
                    *m = v.abs();
                }
                let (_, t, _) =
                    mags.select_nth_unstable_by(k - 1, |a, b| b.partial_cmp(a).unwrap());
                black_box(*t)
            })
        });
        let mut sorted: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        sorted.sort_unstable_by(|a, b| b.partial_cmp(a).unwrap());
        let threshold = sorted[k - 1];
        for (name, spec) in [
            ("topk_exact", "topk:ratio=0.01,values=fp16".to_string()),
            (
                "topk_approx",
                "topk:ratio=0.01,values=fp16,select=approx".to_string(),
            ),
            (
                "threshold",
                format!("topk:threshold={threshold:e},values=fp16"),
            ),
            ("randk", "randk:ratio=0.01,values=fp16".to_string()),
            (
                "randk_strata",
                "randk:ratio=0.01,values=fp16,select=strata".to_string(),
            ),
        ] {
            let spec: CodecSpec = spec.parse().unwrap();
            let mut frame = vec![0u8; spec.max_encoded_len(n)];
            g.bench_function(name, |b| {
                b.iter(|| spec.encode_into(black_box(&x), &EncodeCtx::new(1), &mut frame))
            });
            if name.starts_with("randk") {
                let len = spec
                    .encode_into(&x, &EncodeCtx::new(1), &mut frame)
                    .unwrap();
                let mut out = vec![0f32; n];
                g.bench_function(format!("{name}_decode"), |b| {
                    b.iter(|| gradpack::decode(black_box(&frame[..len]), &mut out))
                });
                g.bench_function(format!("{name}_decode_add"), |b| {
                    b.iter(|| gradpack::decode_add(black_box(&frame[..len]), &mut out))
                });
            }
        }
        let key = gradpack::unstable::kernels::scalar::mag_key(threshold);
        g.bench_function("filter", |b| {
            b.iter(|| {
                let mut sum = 0usize;
                let x = black_box(&x[..]);
                gradpack::unstable::kernels::for_each_filtered(
                    n,
                    |pos, idx| gradpack::unstable::kernels::filter_mag_ge(&x[pos..], key, idx),
                    |i| sum += i,
                );
                sum
            })
        });
        let mut dst = vec![0f32; n];
        g.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(black_box(&x))));
        g.bench_function("read", |b| b.iter(|| read_pass(black_box(&x))));
        g.finish();
    }
}

criterion_group!(benches, sparsify);
criterion_main!(benches);
