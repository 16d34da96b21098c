//! Unbiasedness of the stochastic codecs, with stated confidence.
//!
//! For each element, the mean of N independent decodings (seeds 0..N) is compared to
//! the input. Each decoding lies in an interval of width `w` (one rounding gap), so its
//! variance is at most `w^2 / 4`, and the mean's standard error at most `w / (2 sqrt N)`.
//! We allow 5.5 standard errors per element; over the 2 x 10^3 elements checked, a
//! false failure has probability below 2e3 * 4e-8 < 1e-4 for a truly unbiased codec
//! (Gaussian tail; seeds are fixed, so the test is deterministic).

mod common;

use common::*;
use gradpack::{Codec, CodecSpec, EncodeCtx};

const N: u64 = 4000;

/// Mean decoding over N seeds.
fn mean_decoding(spec: &CodecSpec, x: &[f32]) -> Vec<f64> {
    let mut sum = vec![0f64; x.len()];
    for seed in 0..N {
        let d = decode(&spec.encode(x, &EncodeCtx::new(seed)).unwrap(), x.len());
        for (s, v) in sum.iter_mut().zip(&d) {
            *s += *v as f64;
        }
    }
    sum.iter().map(|s| s / N as f64).collect()
}

fn check_unbiased(spec: &str, x: &[f32], gap: impl Fn(usize) -> f64) {
    let spec: CodecSpec = spec.parse().unwrap();
    assert!(spec.unbiased(), "{spec} does not claim to be unbiased");
    let mean = mean_decoding(&spec, x);
    for i in 0..x.len() {
        let se = gap(i) / (2.0 * (N as f64).sqrt());
        let dev = (mean[i] - x[i] as f64).abs();
        assert!(
            dev <= 5.5 * se + 1e-12,
            "{spec} element {i}: mean {} vs x {} ({:.1} se)",
            mean[i],
            x[i],
            dev / se
        );
    }
}

fn gaussianish(n: usize, salt: u32) -> Vec<f32> {
    // Sum of four uniforms: bell-shaped, with a few larger values mixed in.
    (0..n)
        .map(|i| {
            let u = |k: u32| {
                gradpack::rng::lowbias32((i as u32) * 4 + k + salt * 7919) as f32 / 4.294_967e9
                    - 0.5
            };
            let g = u(0) + u(1) + u(2) + u(3);
            if i % 97 == 0 { g * 8.0 } else { g }
        })
        .collect()
}

#[test]
fn stochastic_int8_is_unbiased() {
    let x = gaussianish(500, 1);
    let b = 128;
    let m: Vec<f32> = x
        .chunks(b)
        .map(|c| c.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect();
    check_unbiased("int8:block=128,rounding=stochastic", &x, |i| {
        m[i / b] as f64 / 127.0
    });
}

#[test]
fn qsgd_is_unbiased() {
    for bits in [2u32, 4, 8] {
        let x = gaussianish(400, bits);
        let b = 100;
        let s = ((1u32 << (bits - 1)) - 1) as f64;
        let norm: Vec<f64> = x
            .chunks(b)
            .map(|c| c.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt())
            .collect();
        check_unbiased(&format!("qsgd:bits={bits},block={b}"), &x, |i| {
            norm[i / b] / s
        });
    }
}

#[test]
fn ternary_is_unbiased() {
    let x = gaussianish(400, 9);
    let b = 64;
    let m: Vec<f32> = x
        .chunks(b)
        .map(|c| c.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect();
    check_unbiased("ternary:block=64", &x, |i| m[i / b] as f64);
}

#[test]
fn natural_is_unbiased() {
    let x = gaussianish(400, 4);
    // The rounding gap is 2^floor(log2 |x|).
    check_unbiased("natural:block=64", &x, |i| {
        2f64.powi((x[i].abs() as f64).log2().floor() as i32)
    });
}

#[test]
fn scaled_randk_is_unbiased() {
    let x = gaussianish(200, 2);
    // Each decoding is 0 or x / p: an interval of width |x| / p.
    check_unbiased("randk:ratio=0.25,scale=unbiased", &x, |i| {
        x[i].abs() as f64 / 0.25
    });
}

#[test]
fn randk_keeps_about_ratio_n_and_the_same_indices_across_ranks() {
    let spec: CodecSpec = "randk:ratio=0.01".parse().unwrap();
    let n = 1_000_000;
    let x = vec![1.0f32; n];
    let a = decode(&spec.encode(&x, &EncodeCtx::new(11)).unwrap(), n);
    let kept = a.iter().filter(|v| **v != 0.0).count() as f64;
    // Binomial(n, 0.01): sd = sqrt(n p (1-p)) ~ 99.5; allow 5 sd.
    assert!((kept - 10_000.0).abs() < 5.0 * 99.5, "kept {kept}");
    // Another rank with the same seed and different values keeps the same indices.
    let y: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
    let b = decode(&spec.encode(&y, &EncodeCtx::new(11)).unwrap(), n);
    assert!(a.iter().zip(&b).all(|(p, q)| (*p == 0.0) == (*q == 0.0)));
}
