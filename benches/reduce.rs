//! The fused reduction of many frames (`reduce_frames`) against `decode` + `decode_add`
//! per frame, in GB/s of f32 output per frame-set, with a memcpy of the output in the
//! same group as the baseline.
//!
//! - `reduce/SPEC/pP/N`: `P` frames of `N` elements (8 and 9 M by default:
//!   `GRADPACK_REDUCE_FRAMES`, `GRADPACK_REDUCE_SIZES`), on a one-thread rayon pool
//!   (`_1t`) and on a pool of every core (`_Nt`, the default split threshold).
//!
//! Run: `cargo bench --bench reduce` (about 2 minutes here).

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::hint::black_box;
use std::time::Duration;

mod common;

use common::{pool, sizes};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gradpack::{Codec, CodecSpec, EncodeCtx};

fn reduce(c: &mut Criterion) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pools = [(1, pool(1)), (cores, pool(cores))];
    let frames_n = sizes("GRADPACK_REDUCE_FRAMES", &[8]);
    for n in sizes("GRADPACK_REDUCE_SIZES", &[9_000_000]) {
        let src = gradpack::synthetic::gradient(n, 3);
        for s in [
            "int8",
            "fp16",
            "qsgd:bits=4",
            "sign",
            "topk:ratio=0.01,values=fp16",
        ] {
            let spec: CodecSpec = s.parse().unwrap();
            for &p in &frames_n {
                let frames: Vec<Vec<u8>> = (0..p)
                    .map(|q| {
                        let x = gradpack::synthetic::gradient(n, 11 + q as u64);
                        spec.encode(&x, &EncodeCtx::new(q as u64)).unwrap()
                    })
                    .collect();
                let mut out = vec![0f32; n];
                let mut g = c.benchmark_group(format!("reduce/{s}/p{p}/{n}"));
                g.throughput(Throughput::Bytes(4 * n as u64));
                g.sample_size(10)
                    .warm_up_time(Duration::from_millis(300))
                    .measurement_time(Duration::from_secs(2));
                g.bench_function("memcpy", |b| {
                    b.iter(|| out.copy_from_slice(black_box(&src)))
                });
                for (t, pl) in &pools {
                    g.bench_function(format!("sequential_{t}t"), |b| {
                        b.iter(|| {
                            pl.install(|| {
                                gradpack::decode(black_box(&frames[0]), &mut out).unwrap();
                                for f in &frames[1..] {
                                    gradpack::decode_add(black_box(f), &mut out).unwrap();
                                }
                            })
                        })
                    });
                    g.bench_function(format!("fused_{t}t"), |b| {
                        b.iter(|| {
                            pl.install(|| gradpack::reduce_frames(black_box(&frames), &mut out))
                                .unwrap()
                        })
                    });
                }
                g.finish();
            }
        }
    }
}

criterion_group!(benches, reduce);
criterion_main!(benches);
