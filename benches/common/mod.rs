//! What the criterion benches share: the codec list and the size lists from the
//! environment.

#![allow(dead_code)] // each bench uses a part

/// One spec per codec family (and int8's rounding modes, qsgd's widths).
pub const SPECS: &[&str] = &[
    "identity",
    "fp16",
    "bf16",
    "fp8",
    "fp8:rounding=stochastic",
    "fp8:format=e5m2,scale=e8m0,block=32",
    "fp4",
    "fp4:rounding=stochastic",
    "codebook",
    "int8",
    "int8:rounding=stochastic",
    "qsgd:bits=4",
    "qsgd:bits=8",
    "sign",
    "ternary",
    "natural",
    "topk:ratio=0.01",
    "randk:ratio=0.01",
    "randk:ratio=0.01,select=strata",
];

/// Element counts from the comma-separated environment variable `var`, or `default`.
pub fn sizes(var: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(var)
        .ok()
        .map(|s| {
            s.split(',')
                .map(|v| {
                    v.trim()
                        .parse()
                        .unwrap_or_else(|_| panic!("{var}: integers"))
                })
                .collect()
        })
        .unwrap_or_else(|| default.to_vec())
}

/// The read-only baseline: a 16-lane f32 sum (vectorises; one pass over `x`).
pub fn read_pass(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// A rayon pool of `threads` threads.
pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}
