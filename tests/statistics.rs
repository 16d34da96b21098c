//! Unbiasedness and variance of the stochastic codecs, with stated confidence.
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
fn scaled_strata_randk_is_unbiased() {
    let x = gaussianish(200, 3);
    // Ratio 0.4: strata of 2 or 3 elements; each decoding is 0 or x times its stratum's
    // length, an interval of width at most 3 |x|. (Scaling by 1 / ratio = 2.5 instead
    // would put the mean of an element of a 2-stratum at 1.25 x: 10 standard errors.)
    check_unbiased("randk:ratio=0.4,scale=unbiased,select=strata", &x, |i| {
        x[i].abs() as f64 * 3.0
    });
}

#[test]
fn strata_randk_keeps_ratio_n_within_one_and_the_same_indices_across_ranks() {
    let spec: CodecSpec = "randk:ratio=0.01,select=strata".parse().unwrap();
    let n = 1_000_000;
    let x = vec![1.0f32; n];
    for seed in 0..5 {
        let a = decode(&spec.encode(&x, &EncodeCtx::new(seed)).unwrap(), n);
        let kept = a.iter().filter(|v| **v != 0.0).count() as f64;
        // One per stratum of 2^32 / t = 99.99999 elements: n p = 10000.0007, give or take one.
        assert!((kept - 10_000.0).abs() <= 1.0, "kept {kept}");
        let y: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
        let b = decode(&spec.encode(&y, &EncodeCtx::new(seed)).unwrap(), n);
        assert!(a.iter().zip(&b).all(|(p, q)| (*p == 0.0) == (*q == 0.0)));
    }
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

// ---------------------------------------------------------------- variance
//
// Each stochastic codec rounds an element `x` to one of two neighbours `gap` apart, up
// with probability `f` (its position between them), so the variance of one decoded
// element is exactly `gap^2 f (1 - f)`. For each block we compare the mean squared error
// over N draws with that exact sum, and with the paper's bound. The squared error of a
// block is a bounded random variable, so its mean over N = 4000 independent draws is
// normal to a very good approximation; we allow 6 standard errors (Gaussian two-sided
// tail 2e-9 per block, under 1e-6 over every block checked; seeds are fixed, so the test
// is deterministic).

/// Per block of `block` elements: the mean over N draws of `sum (d_i - x_i)^2` and its
/// standard error.
fn block_mse(spec: &CodecSpec, x: &[f32], block: usize) -> Vec<(f64, f64)> {
    let nb = x.len().div_ceil(block);
    let (mut s1, mut s2) = (vec![0f64; nb], vec![0f64; nb]);
    for seed in 0..N {
        let d = decode(&spec.encode(x, &EncodeCtx::new(seed)).unwrap(), x.len());
        for b in 0..nb {
            let r = b * block..((b + 1) * block).min(x.len());
            let e: f64 = r.map(|i| (d[i] as f64 - x[i] as f64).powi(2)).sum();
            s1[b] += e;
            s2[b] += e * e;
        }
    }
    let n = N as f64;
    (0..nb)
        .map(|b| {
            let mean = s1[b] / n;
            let var = (s2[b] / n - mean * mean).max(0.0) * n / (n - 1.0);
            (mean, (var / n).sqrt())
        })
        .collect()
}

/// Check the per-block mean squared error of `spec` on `x` against the exact variance
/// `sum gap_i^2 f_i (1 - f_i)` (from `gap_f(i) = (gap, f)`) and the paper's `bound(block)`.
fn check_variance(
    spec: &str,
    x: &[f32],
    block: usize,
    gap_f: impl Fn(usize) -> (f64, f64),
    bound: impl Fn(std::ops::Range<usize>) -> f64,
    bound_name: &str,
) {
    let spec: CodecSpec = spec.parse().unwrap();
    for (b, (mse, se)) in block_mse(&spec, x, block).into_iter().enumerate() {
        let r = b * block..((b + 1) * block).min(x.len());
        let exact: f64 = r
            .clone()
            .map(|i| {
                let (g, f) = gap_f(i);
                g * g * f * (1.0 - f)
            })
            .sum();
        let bnd = bound(r);
        let tol = 6.0 * se + 1e-9 * exact;
        assert!(
            (mse - exact).abs() <= tol,
            "{spec} block {b}: mean squared error {mse:e}, exact variance {exact:e} ({:.1} se)",
            (mse - exact).abs() / se
        );
        assert!(
            exact <= bnd * (1.0 + 1e-9),
            "{spec} block {b}: exact {exact:e} above {bound_name} {bnd:e}"
        );
        assert!(
            mse <= bnd + 6.0 * se,
            "{spec} block {b}: {mse:e} above {bound_name} {bnd:e}"
        );
    }
}

fn frac(v: f64) -> f64 {
    v - v.floor()
}

fn norm2(x: &[f32]) -> f64 {
    x.iter().map(|v| (*v as f64).powi(2)).sum()
}

fn absmax(x: &[f32]) -> f64 {
    x.iter().fold(0f64, |m, v| m.max(v.abs() as f64))
}

#[test]
fn qsgd_variance_within_the_papers_bound() {
    // E||Q(v) - v||^2 <= min(n / s^2, sqrt(n) / s) ||v||^2 (Alistarh et al. 2017, Lemma 3.1).
    for (bits, b) in [(2u32, 100usize), (4, 64), (8, 256)] {
        let x = gaussianish(2 * b + 17, 20 + bits);
        let s = ((1u32 << (bits - 1)) - 1) as f64;
        let step = |i: usize| {
            let blk = &x[i / b * b..((i / b + 1) * b).min(x.len())];
            norm2(blk).sqrt() / s
        };
        check_variance(
            &format!("qsgd:bits={bits},block={b}"),
            &x,
            b,
            |i| (step(i), frac(x[i].abs() as f64 / step(i))),
            |r| {
                let n = r.len() as f64;
                (n / (s * s)).min(n.sqrt() / s) * norm2(&x[r])
            },
            "min(n/s^2, sqrt(n)/s) ||v||^2",
        );
    }
}

#[test]
fn natural_variance_at_most_an_eighth_of_x_squared() {
    // Var = |x|^2 f (1 - f) / (1 + f)^2 <= |x|^2 / 8 per element (Horvath et al. 2019),
    // with equality at f = 1/3; the input includes such elements.
    let mut x = gaussianish(300, 31);
    for (i, e) in [(3usize, 0i32), (50, -3), (120, 2)] {
        x[i] = 2f32.powi(e) * (4.0 / 3.0);
    }
    check_variance(
        "natural:block=64",
        &x,
        64,
        |i| {
            let a = x[i].abs() as f64;
            let g = 2f64.powi(a.log2().floor() as i32);
            (g, a / g - 1.0)
        },
        |r| norm2(&x[r]) / 8.0,
        "||v||^2 / 8",
    );
    // Per element at f = 1/3: the mean squared error sits at the bound.
    let spec: CodecSpec = "natural:block=64".parse().unwrap();
    let mse = block_mse(&spec, &x[3..4], 1);
    let a2 = (x[3] as f64).powi(2);
    assert!(
        (mse[0].0 - a2 / 8.0).abs() <= 6.0 * mse[0].1,
        "{mse:?} vs {}",
        a2 / 8.0
    );
}

#[test]
fn ternary_variance_is_terngrads() {
    // TernGrad: Q(x) = s sign(x) b, P(b = 1) = |x| / s with s the block's max |x|, so
    // E||Q(v) - v||^2 = s ||v||_1 - ||v||^2 <= s ||v||_1 (Wen et al. 2017).
    let x = gaussianish(400, 41);
    let b = 128;
    let s = |i: usize| absmax(&x[i / b * b..((i / b + 1) * b).min(x.len())]);
    check_variance(
        "ternary:block=128",
        &x,
        b,
        |i| (s(i), x[i].abs() as f64 / s(i)),
        |r| absmax(&x[r.clone()]) * x[r].iter().map(|v| v.abs() as f64).sum::<f64>(),
        "s ||v||_1",
    );
}

#[test]
fn stochastic_int8_variance_at_most_a_quarter_step_squared() {
    // Stochastic rounding to steps of m / 127: variance step^2 f (1 - f) <= step^2 / 4.
    let x = gaussianish(600, 51);
    let b = 256;
    let step = |i: usize| absmax(&x[i / b * b..((i / b + 1) * b).min(x.len())]) / 127.0;
    check_variance(
        "int8:block=256,rounding=stochastic",
        &x,
        b,
        |i| (step(i), frac(x[i].abs() as f64 / step(i))),
        |r| r.len() as f64 * step(r.start).powi(2) / 4.0,
        "n step^2 / 4",
    );
}

/// The fp8 grid spacing around `x / s` times `s`, for a block scale `s` (module docs of
/// `fp8`: `2^(E - M)` with `E = max(floor(log2 |y|), 1 - B)`).
fn fp8_gap(x: f32, s: f64, mbits: i32, bias: i32) -> f64 {
    let y = x.abs() as f64 / s;
    let e = if y > 0.0 {
        y.log2().floor() as i32
    } else {
        1 - bias
    }
    .max(1 - bias);
    pow2(e - mbits) * s
}

/// Each block's scale as the `fp8` docs define it (f32 or E8M0).
fn fp8_scales(x: &[f32], b: usize, fmax: f64, e8m0: bool) -> Vec<f64> {
    x.chunks(b)
        .map(|c| {
            let m = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            if e8m0 {
                let mut k = -127;
                while m as f64 > fmax * pow2(k) {
                    k += 1;
                }
                pow2(k)
            } else {
                (m / fmax as f32).max(f32::MIN_POSITIVE) as f64
            }
        })
        .collect()
}

#[test]
fn stochastic_fp8_is_unbiased() {
    let x = gaussianish(500, 3);
    for (spec, mbits, bias, fmax, e8m0) in [
        (
            "fp8:format=e4m3,block=64,rounding=stochastic",
            3,
            7,
            448.0,
            false,
        ),
        (
            "fp8:format=e5m2,block=64,rounding=stochastic",
            2,
            15,
            57344.0,
            false,
        ),
        (
            "fp8:format=e4m3,block=32,scale=e8m0,rounding=stochastic",
            3,
            7,
            448.0,
            true,
        ),
        (
            "fp8:format=e5m2,scale=none,rounding=stochastic",
            2,
            15,
            57344.0,
            false,
        ),
    ] {
        let none = spec.contains("scale=none");
        let b = if none {
            1
        } else if e8m0 {
            32
        } else {
            64
        };
        let s = if none {
            vec![1.0; x.len()]
        } else {
            fp8_scales(&x, b, fmax, e8m0)
        };
        check_unbiased(spec, &x, |i| fp8_gap(x[i], s[i / b], mbits, bias));
    }
}

/// The error of the mean of N decodings of stochastic fp8 falls as 1 / sqrt(N): from
/// N = 250 to N = 4000 (16 times the draws) it shrinks 4x. Each element's error is taken
/// in units of its own decoding's standard deviation (estimated from the 4000 draws;
/// elements that decode exactly are left out), so the ~500 standardised errors are
/// independent with variance 1 / N: their RMS is within about 3% of 1 / sqrt(N) (one
/// standard deviation of a chi-square with 500 degrees of freedom), and the accepted
/// ratio, 3.2 to 5, is more than 4 such deviations wide on each side.
#[test]
fn stochastic_fp8_error_of_the_mean_falls_as_one_over_sqrt_n() {
    let x = gaussianish(500, 4);
    for spec in [
        "fp8:format=e4m3,block=64,rounding=stochastic",
        "fp8:format=e5m2,block=32,scale=e8m0,rounding=stochastic",
        "fp4:block=32,rounding=stochastic",
        "fp4:scale=e4m3,rounding=stochastic",
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        // Mean and mean square of the decodings over `seeds`.
        let moments = |seeds: std::ops::Range<u64>| {
            let n = (seeds.end - seeds.start) as f64;
            let (mut s1, mut s2) = (vec![0f64; x.len()], vec![0f64; x.len()]);
            for seed in seeds {
                let d = decode(&spec.encode(&x, &EncodeCtx::new(seed)).unwrap(), x.len());
                for i in 0..x.len() {
                    s1[i] += d[i] as f64;
                    s2[i] += (d[i] as f64).powi(2);
                }
            }
            let mean: Vec<f64> = s1.iter().map(|s| s / n).collect();
            let var: Vec<f64> = s2.iter().zip(&mean).map(|(s, m)| s / n - m * m).collect();
            (mean, var)
        };
        let (few, _) = moments(10_000..10_250);
        let (many, var) = moments(20_000..24_000);
        let rms = |mean: &[f64]| {
            let z: Vec<f64> = (0..x.len())
                .filter(|&i| var[i] > 0.0)
                .map(|i| (mean[i] - x[i] as f64) / var[i].sqrt())
                .collect();
            assert!(z.len() > 400, "{spec}: {} elements round", z.len());
            (z.iter().map(|v| v * v).sum::<f64>() / z.len() as f64).sqrt()
        };
        let ratio = rms(&few) / rms(&many);
        assert!(
            (3.2..=5.0).contains(&ratio),
            "{spec}: standardised RMS error of the mean, N = 250 against N = 4000: ratio {ratio}"
        );
    }
}
