//! Encode, decode and decode_add throughput of every codec, in GB/s of f32 input, with
//! same-run baselines in every group: memcpy of the f32 buffer, a read-only pass (sum),
//! and half's slice conversions to and from f16 and bf16.
//!
//! Each codec operation runs once per backend this CPU has (forced with `Backend::run`),
//! so the benchmark id is `CODEC/SIZE/OP/BACKEND`.
//!
//! `cargo bench --bench codecs` runs everything (several minutes);
//! `cargo bench --bench codecs -- 65536` one size; `GRADPACK_BENCH_SIZES=65536,16777216`
//! chooses the sizes (default 64 Ki, 1 Mi, 16 Mi and 64 Mi elements; the two DRAM sizes
//! take 10 samples each, and the whole run about 40 minutes here);
//! `GRADPACK_BENCH_BACKENDS=scalar,avx512` restricts the backends. Everything runs on one
//! thread (the parallel split is off); `benches/feedback.rs` measures the parallel path.

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::hint::black_box;
use std::time::Duration;

mod common;

use common::{SPECS, read_pass};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gradpack::unstable::kernels::Backend;
use gradpack::{Codec, CodecSpec, EncodeCtx};
use half::slice::HalfFloatSliceExt;

fn sizes() -> Vec<usize> {
    common::sizes(
        "GRADPACK_BENCH_SIZES",
        &[1 << 16, 1 << 20, 1 << 24, 1 << 26],
    )
}

/// The backends to run: all this CPU has, or those named in `GRADPACK_BENCH_BACKENDS`
/// (comma-separated, e.g. `scalar,avx512`).
fn backends() -> Vec<Backend> {
    let all = Backend::available();
    match std::env::var("GRADPACK_BENCH_BACKENDS") {
        Ok(list) => all
            .into_iter()
            .filter(|b| list.split(',').any(|n| n.trim() == b.name()))
            .collect(),
        Err(_) => all,
    }
}

/// `len` zeroed items starting on a 4096-byte boundary. Heap buffers otherwise land at
/// arbitrary distances from each other, and when an output sits just behind its input
/// modulo 4096 the loads falsely wait on the stores (4K aliasing): a plain copy loop ran
/// 13x slower at 64 Ki elements than at 1 Mi here for that reason alone.
fn page_aligned<T: Copy + Default>(storage: &mut Vec<T>, len: usize) -> &mut [T] {
    let size = std::mem::size_of::<T>();
    *storage = vec![T::default(); len + 4096 / size];
    let skip = storage.as_ptr().align_offset(4096);
    &mut storage[skip..skip + len]
}

fn baselines(c: &mut Criterion, n: usize, x: &[f32]) {
    let mut g = c.benchmark_group(format!("baseline/{n}"));
    g.throughput(Throughput::Bytes(4 * n as u64));
    dram_sampling(&mut g, n);
    let mut dbuf = Vec::new();
    let dst = page_aligned::<f32>(&mut dbuf, n);
    g.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(black_box(x))));
    // A read-only pass at memory speed: 16 independent lanes, so it vectorises.
    g.bench_function("read_sum", |b| b.iter(|| read_pass(black_box(x))));
    let mut h16 = vec![half::f16::ZERO; n];
    let mut hb16 = vec![half::bf16::ZERO; n];
    g.bench_function("half_f16_from_f32", |b| {
        b.iter(|| h16.convert_from_f32_slice(black_box(x)))
    });
    g.bench_function("half_f16_to_f32", |b| {
        b.iter(|| h16.convert_to_f32_slice(dst))
    });
    g.bench_function("half_bf16_from_f32", |b| {
        b.iter(|| hb16.convert_from_f32_slice(black_box(x)))
    });
    g.bench_function("half_bf16_to_f32", |b| {
        b.iter(|| hb16.convert_to_f32_slice(dst))
    });
    g.finish();
}

fn codecs(c: &mut Criterion) {
    // One thread: these are the kernels' figures (benches/feedback.rs measures the
    // parallel split).
    gradpack::parallel::set_min_len(usize::MAX);
    for n in sizes() {
        let mut xbuf = Vec::new();
        let x = page_aligned::<f32>(&mut xbuf, n);
        x.copy_from_slice(&gradpack::synthetic::gradient(n, 7));
        let x = &*x;
        baselines(c, n, x);
        for s in SPECS {
            let spec: CodecSpec = s.parse().unwrap();
            let ctx = EncodeCtx::new(1);
            let (mut fbuf, mut obuf) = (Vec::new(), Vec::new());
            let frame = page_aligned::<u8>(&mut fbuf, spec.max_encoded_len(n));
            let len = spec.encode_into(x, &ctx, frame).unwrap();
            let out = page_aligned::<f32>(&mut obuf, n);
            let mut g = c.benchmark_group(format!("{s}/{n}"));
            g.throughput(Throughput::Bytes(4 * n as u64));
            dram_sampling(&mut g, n);
            for backend in backends() {
                let name = backend.name();
                g.bench_function(BenchmarkId::new("encode", name), |b| {
                    b.iter(|| backend.run(|| spec.encode_into(black_box(x), &ctx, frame).unwrap()))
                });
                g.bench_function(BenchmarkId::new("decode", name), |b| {
                    b.iter(|| {
                        backend.run(|| gradpack::decode(black_box(&frame[..len]), out).unwrap())
                    })
                });
                g.bench_function(BenchmarkId::new("decode_add", name), |b| {
                    b.iter(|| {
                        backend.run(|| gradpack::decode_add(black_box(&frame[..len]), out).unwrap())
                    })
                });
            }
            g.finish();
        }
    }
}

/// Fewer, longer samples for the DRAM sizes (one iteration of a slow scalar encoder at
/// 64 Mi elements takes about a second).
fn dram_sampling<M: criterion::measurement::Measurement>(
    g: &mut criterion::BenchmarkGroup<'_, M>,
    n: usize,
) {
    if n >= 1 << 24 {
        g.sample_size(10).warm_up_time(Duration::from_millis(500));
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

criterion_group! { name = benches; config = config(); targets = codecs }
criterion_main!(benches);
