//! The DCT's unit tests: each transform against the f64 definition, the selection and
//! the inverse.

use super::*;

/// The distance of `v` from the nearest f32 rounding boundary (the midpoint between
/// two neighbouring f32 values), relative to `|v|`.
fn boundary_margin(v: f64) -> f64 {
    let f = v as f32;
    let up = f64::from(f32::from_bits(f.to_bits() + 1));
    let down = f64::from(f32::from_bits(f.to_bits() - 1));
    let mid_up = (f64::from(f) + up) / 2.0;
    let mid_down = (f64::from(f) + down) / 2.0;
    ((v - mid_up).abs().min((v - mid_down).abs())) / v.abs()
}

#[test]
#[cfg_attr(miri, ignore = "89,440 cosines: minutes under Miri")]
fn every_basis_entry_rounds_the_same_for_any_careful_evaluation() {
    let mut worst = f64::INFINITY;
    for n in 1..=MAX_N {
        for k in 0..n {
            for i in 0..n {
                let v = entry_f64(n, k, i);
                // cos is exactly 0 where (2i + 1) k is an odd multiple of n; the
                // quadrant reduction evaluates those as sin(0), exactly.
                let zero = ((2 * i + 1) * k) % (2 * n) == n;
                assert_eq!(v == 0.0, zero, "B_{n}[{k}][{i}] = {v}");
                if !zero {
                    worst = worst.min(boundary_margin(v));
                }
            }
        }
    }
    assert!(
        worst > 2f64.powi(-46),
        "an entry lies {worst} from a rounding boundary"
    );
}

#[test]
#[cfg_attr(miri, ignore = "cubic in the length: minutes under Miri")]
fn the_basis_is_orthonormal_to_f32_precision() {
    for n in (1..=MAX_N).step_by(7).chain([32, 64]) {
        let b = basis(n);
        for k in 0..n {
            for l in 0..n {
                let d: f64 = (0..n)
                    .map(|i| f64::from(b[k * n + i]) * f64::from(b[l * n + i]))
                    .sum();
                let want = if k == l { 1.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-5, "n {n}: rows {k}, {l}: {d}");
            }
        }
    }
    assert_eq!(basis(1), &[1.0]);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "safe code on the scalar backend (Miri's only one); natively on every backend"
)]
fn batched_rows_keep_the_largest_coefficients_lower_position_first() {
    // Tiles whose coefficients tie (a constant tile, a tile of repeated magnitudes of
    // both signs), hold NaN or are zero, in groups that fill 1 to all of the batch's
    // rows, on every backend: each tile's kept positions and values against the
    // selection's definition written out (largest |bits|, then the lower position;
    // increasing positions; NaN as 0x7FC00000), on the transform's own output.
    let widths: &[usize] = if cfg!(miri) {
        &[2, 16]
    } else {
        &[2, 4, 8, 16, 32, 64]
    };
    for &w in widths {
        let mut x = Vec::new();
        x.extend((0..w).map(|_| 1.5f32));
        x.extend((0..w).map(|i| if i % 2 == 0 { 2.0 } else { -2.0 }));
        x.extend((0..w).map(|_| 0.0f32));
        x.extend((0..w).map(|i| if i == w / 2 { f32::NAN } else { i as f32 }));
        x.extend((0..w).map(|i| [3.0, -3.0, 0.25, 7.0][i % 4]));
        x.extend((0..3 * w).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.37));
        let tiles = x.len() / w;
        let kts: Vec<usize> = [1, 2, 4, 5, 8, 15, 16]
            .into_iter()
            .filter(|&k| k < w)
            .collect();
        // Both batched encoders, each against its own transform of one row.
        type Encode = fn(&[f32], usize, usize, &mut [u16], &mut [f32]);
        type Row = fn(&[f32], usize, &mut [f32]);
        let fast: Row = |x, w, out| {
            let mut y = [0f32; MAX_N];
            y[..w].copy_from_slice(x);
            fast_row(&mut y, w, out)
        };
        let lee_row: Row = |x, w, out| {
            let (mut a, mut b) = ([[0f32; 1]; MAX_N], [[0f32; 1]; MAX_N]);
            a.iter_mut().zip(x).for_each(|(a, &v)| a[0] = v);
            lee(&mut a, &mut b, w);
            out.iter_mut().zip(&a[..w]).for_each(|(o, a)| *o = a[0]);
        };
        let encoders: [(&str, Encode, Row); 2] = [
            ("fast", encode_rows_fast, fast),
            ("lee", encode_rows_lee, lee_row),
        ];
        for (&kt, (name, encode, row)) in kts
            .iter()
            .flat_map(|kt| encoders.iter().map(move |e| (kt, e)))
        {
            // Miri: one kt of each selection (slow under it).
            let miri_skip = cfg!(miri) && ![1, 4, 15].contains(&kt);
            for n in (1..=tiles).filter(|_| !miri_skip) {
                let xs = &x[..n * w];
                for backend in crate::kernels::Backend::available() {
                    let (mut pos, mut vals) = (vec![0u16; n * kt], vec![0f32; n * kt]);
                    backend.run(|| encode(xs, w, kt, &mut pos, &mut vals));
                    for t in 0..n {
                        let mut coef = [0f32; MAX_N];
                        row(&xs[t * w..(t + 1) * w], w, &mut coef);
                        let coef: Vec<f32> = coef[..w]
                            .iter()
                            .map(|&v| if v.is_nan() { CANONICAL_NAN } else { v })
                            .collect();
                        let mut order: Vec<usize> = (0..w).collect();
                        order.sort_by_key(|&i| {
                            (core::cmp::Reverse(coef[i].to_bits() & 0x7FFF_FFFF), i)
                        });
                        let mut want: Vec<usize> = order[..kt].to_vec();
                        want.sort_unstable();
                        let got: Vec<usize> = pos[t * kt..(t + 1) * kt]
                            .iter()
                            .map(|&p| p as usize)
                            .collect();
                        let ctx = format!("{name} {} w={w} kt={kt} n={n} tile {t}", backend.name());
                        assert_eq!(got, want, "{ctx}");
                        for (j, &p) in want.iter().enumerate() {
                            assert_eq!(vals[t * kt + j].to_bits(), coef[p].to_bits(), "{ctx}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn fixed_width_tiles_give_the_bits_of_the_general_loops() {
    // The register-accumulator paths for widths 8, 16, 32 and 64 of the forward
    // transform and of the inverse's rows against the general loops (the format's
    // order), on every backend the CPU has, for tall, flat and square tiles; Miri runs
    // the small widths.
    let widths: &[usize] = if cfg!(miri) {
        &[8, 16]
    } else {
        &[8, 16, 32, 64]
    };
    let stride = 70;
    let x: Vec<f32> = (0..64 * stride)
        .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.37)
        .collect();
    for backend in crate::kernels::Backend::available() {
        for &w in widths {
            for h in [1, 3, w] {
                let (mut y, mut out) = (vec![0f32; h * w], vec![0f32; h * w]);
                backend.run(|| forward(&x, stride, h, w, &mut y, &mut out));
                let (mut y2, mut want) = (vec![0f32; h * w], vec![0f32; h * w]);
                forward_any(&x, stride, h, w, &mut y2, &mut want);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&want), "{} {h}x{w}", backend.name());
                // The inverse's rows, with every third column left out.
                let cols: Vec<bool> = (0..w).map(|b| b % 3 != 1).collect();
                let (mut back, mut back_any) = (vec![0f32; h * w], vec![0f32; h * w]);
                backend.run(|| super::super::dct_inverse_rows(&out, &cols, h, w, &mut back));
                inverse_rows_any(&out, &cols, h, w, &mut back_any);
                assert_eq!(bits(&back), bits(&back_any), "{} {h}x{w}", backend.name());
            }
        }
    }
}

/// The factorised transform of one vector as the format states it, written plainly
/// (separate butterfly arrays, each coefficient's sum from +0 in increasing `i`).
fn spec_fast_1d(x: &[f64], n: usize, f32_mode: bool) -> Vec<f64> {
    let r = |v: f64| if f32_mode { v as f32 as f64 } else { v };
    let b = basis(n);
    let mut out = vec![0f64; n];
    let mut z: Vec<f64> = x.to_vec();
    let mut m = n;
    while m >= 2 {
        let half = m / 2;
        let s: Vec<f64> = (0..half).map(|i| r(z[i] + z[m - 1 - i])).collect();
        let d: Vec<f64> = (0..half).map(|i| r(z[i] - z[m - 1 - i])).collect();
        for j in 0..half {
            let k = (n / m) * (2 * j + 1);
            let mut acc = 0f64;
            for (i, &dv) in d.iter().enumerate() {
                let c = if f32_mode {
                    f64::from(b[k * n + i])
                } else {
                    super::entry_f64(n, k, i)
                };
                acc = r(acc + r(dv * c));
            }
            out[k] = acc;
        }
        z = s;
        m = half;
    }
    let c0 = if f32_mode {
        f64::from(b[0])
    } else {
        super::entry_f64(n, 0, 0)
    };
    out[0] = r(0.0 + r(z[0] * c0));
    out
}

/// One side's statement: the transform of a vector whose length is a power of two.
type Side = fn(&[f64]) -> Vec<f64>;
/// A tile's forward transform, as [`forward`].
type Forward = fn(&[f32], usize, usize, usize, &mut [f32], &mut [f32]);
/// A further check on a backend's run: `(backend, x, h, w, want)`.
type Also<'a> = &'a dyn Fn(crate::kernels::Backend, &[f32], usize, usize, &[f32]);

/// `forward` against the format's statement of its transform (`side` along each
/// power-of-two side, rows then columns, the direct sums in f32 elsewhere) on test
/// tiles: the same bits on every backend (and `also(backend, x, h, w, want)` for any
/// further check); returns the worst error against the exact transform (f64), as a
/// fraction of the tile's largest coefficient.
fn check_stated_order(side: Side, forward: Forward, also: Also) -> f64 {
    let shapes: &[(usize, usize)] = if cfg!(miri) {
        &[(1, 8), (4, 8), (3, 8)]
    } else {
        &[
            (1, 64),
            (1, 32),
            (1, 2),
            (1, 4),
            (64, 64),
            (32, 32),
            (20, 16),
            (8, 8),
            (16, 4),
            (16, 8),
            (3, 8),
            (8, 5),
            (1, 36),
        ]
    };
    let stride = 70;
    let x: Vec<f32> = (0..64 * stride)
        .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.37)
        .collect();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let along = |v: &[f64]| -> Vec<f64> {
        let n = v.len();
        if n >= 2 && n.is_power_of_two() {
            return side(v);
        }
        let b = basis(n);
        (0..n)
            .map(|k| {
                let mut acc = 0f32;
                for (i, &u) in v.iter().enumerate() {
                    acc += u as f32 * b[k * n + i];
                }
                f64::from(acc)
            })
            .collect()
    };
    let mut worst = 0f64;
    for &(h, w) in shapes {
        let mut y = vec![0f64; h * w];
        for i in 0..h {
            let row: Vec<f64> = (0..w).map(|n| f64::from(x[i * stride + n])).collect();
            y[i * w..(i + 1) * w].copy_from_slice(&along(&row));
        }
        let mut want = vec![0f32; h * w];
        for b in 0..w {
            let col: Vec<f64> = (0..h).map(|i| y[i * w + b]).collect();
            let t = if h == 1 {
                vec![col[0] + 0.0]
            } else {
                along(&col)
            };
            for a in 0..h {
                want[a * w + b] = t[a] as f32;
            }
        }
        let mut exact = vec![0f64; h * w];
        for a in 0..h {
            for b in 0..w {
                for i in 0..h {
                    for n in 0..w {
                        exact[a * w + b] += f64::from(x[i * stride + n])
                            * super::entry_f64(h, a, i)
                            * super::entry_f64(w, b, n);
                    }
                }
            }
        }
        let scale = exact.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (o, e) in want.iter().zip(&exact) {
            worst = worst.max((f64::from(*o) - e).abs() / scale);
        }
        for backend in crate::kernels::Backend::available() {
            let (mut yy, mut out) = (vec![0f32; h * w], vec![f32::NAN; h * w]);
            backend.run(|| forward(&x, stride, h, w, &mut yy, &mut out));
            assert_eq!(bits(&out), bits(&want), "{} {h}x{w}", backend.name());
            also(backend, &x, h, w, &want);
        }
    }
    worst
}

#[test]
fn the_factorised_transform_follows_its_stated_order_on_every_backend() {
    let worst = check_stated_order(
        |v| spec_fast_1d(v, v.len(), true),
        forward_fast,
        &|_, _, _, _, _| {},
    );
    assert!(
        worst <= 1e-5,
        "worst error {worst:e} of the largest coefficient"
    );
    // The factorised statement in exact arithmetic is the transform itself.
    let x: Vec<f64> = (0..64)
        .map(|i| ((i * 7919 % 1013) as f64 - 506.0) * 0.37)
        .collect();
    for w in [2, 4, 32, 64] {
        let exact: Vec<f64> = (0..w)
            .map(|b| (0..w).map(|n| x[n] * super::entry_f64(w, b, n)).sum())
            .collect();
        let scale = exact.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (v, e) in spec_fast_1d(&x[..w], w, false).iter().zip(&exact) {
            assert!((v - e).abs() <= 1e-9 * scale, "exact {w}");
        }
    }
}

#[test]
fn forward_then_inverse_of_every_coefficient_gives_the_tile_back() {
    // Miri runs the small tiles only (a 64 x 64 tile takes minutes there).
    let all = [
        (1, 64),
        (64, 64),
        (4, 8),
        (8, 8),
        (2, 16),
        (3, 5),
        (1, 36),
        (7, 1),
    ];
    let shapes = if cfg!(miri) { &all[2..] } else { &all[..] };
    for &(h, w) in shapes {
        let x: Vec<f32> = (0..h * w)
            .map(|i| ((i * 7919) % 97) as f32 / 10.0 - 4.8)
            .collect();
        let mut y = vec![0f32; h * w];
        let mut c = vec![f32::NAN; h * w];
        forward(&x, w, h, w, &mut y, &mut c);
        let mut back = vec![f32::NAN; h * w];
        let (mut t, mut cols, mut tile) = (vec![0f32; h * w], vec![false; w], vec![0f32; h * w]);
        inverse(
            c.iter().copied().enumerate(),
            h,
            w,
            &mut t,
            &mut cols,
            &mut tile,
            |i, r| back[i * w..i * w + w].copy_from_slice(r),
        );
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() < 1e-4, "{h}x{w}: {a} vs {b}");
        }
    }
}

/// Lee's transform of one side as the format states it, recursively, in f64 or (with
/// `f32_mode`) with every operation rounded to f32 and the f32 constants.
fn spec_lee_1d(x: &[f64], f32_mode: bool) -> Vec<f64> {
    let r = |v: f64| if f32_mode { v as f32 as f64 } else { v };
    fn unscaled(z: &[f64], r: &dyn Fn(f64) -> f64, f32_mode: bool) -> Vec<f64> {
        let m = z.len();
        if m == 1 {
            return z.to_vec();
        }
        let half = m / 2;
        let c = |i: usize| {
            let v = super::lee_const_f64(m, i);
            if f32_mode { f64::from(v as f32) } else { v }
        };
        let g: Vec<f64> = (0..half).map(|i| r(z[i] + z[m - 1 - i])).collect();
        let h: Vec<f64> = (0..half)
            .map(|i| r(r(z[i] - z[m - 1 - i]) * c(i)))
            .collect();
        let (gt, ht) = (unscaled(&g, r, f32_mode), unscaled(&h, r, f32_mode));
        let mut out = vec![0f64; m];
        for k in 0..half {
            out[2 * k] = gt[k];
            out[2 * k + 1] = if k + 1 < half {
                r(ht[k] + ht[k + 1])
            } else {
                ht[k]
            };
        }
        out
    }
    let n = x.len();
    let (s0, s) = if f32_mode {
        let (a, b) = lee_scales(n);
        (f64::from(a), f64::from(b))
    } else {
        ((1.0 / n as f64).sqrt(), (2.0 / n as f64).sqrt())
    };
    unscaled(x, &r, f32_mode)
        .iter()
        .enumerate()
        .map(|(k, &v)| r(v * if k == 0 { s0 } else { s }))
        .collect()
}

#[test]
fn every_lee_constant_rounds_the_same_for_any_careful_evaluation() {
    // The 63 constants and the irrational scales lie far from an f32 rounding
    // boundary, so any evaluation within a few f64 ulps rounds to the same f32.
    let mut worst = f64::INFINITY;
    let mut m = 2;
    while m <= MAX_N {
        for i in 0..m / 2 {
            let v = lee_const_f64(m, i);
            assert_eq!(lee_consts()[m / 2 - 1 + i], v as f32);
            worst = worst.min(boundary_margin(v));
        }
        for v in [(1.0 / m as f64).sqrt(), (2.0 / m as f64).sqrt()] {
            if f64::from(v as f32) != v {
                worst = worst.min(boundary_margin(v));
            }
        }
        m *= 2;
    }
    assert!(worst > 2f64.powi(-40), "closest to a boundary: {worst:e}");
}

#[test]
fn lee_follows_its_stated_order_on_every_backend() {
    // Through the tile transform and, on one-row tiles, the batched encoder's.
    let batched = |backend: crate::kernels::Backend, x: &[f32], h, w: usize, want: &[f32]| {
        if h == 1 && factorised(w) && w > 2 {
            // All coefficients kept but one: the batched encoder's values.
            let kt = (w - 1).min(SELECT_MAX);
            let (mut pos, mut vals) = (vec![0u16; kt], vec![0f32; kt]);
            backend.run(|| encode_rows_lee(&x[..w], w, kt, &mut pos, &mut vals));
            for (&p, v) in pos.iter().zip(&vals) {
                assert_eq!(v.to_bits(), want[p as usize].to_bits(), "{h}x{w}");
            }
        }
    };
    let worst = check_stated_order(|v| spec_lee_1d(v, true), forward_lee, &batched);
    // f32 rounding through up to 12 levels of Lee's recursion per side, with its
    // constants up to 20: within a part in a million of the largest coefficient (2e-7
    // when written).
    assert!(
        worst < 1e-6,
        "worst error {worst:e} of the largest coefficient"
    );
}

/// Every value Lee's transform of `x` computes (splits, merges, outputs), in f64, in
/// an order that depends on the length only.
fn lee_values(z: &[f64], all: &mut Vec<f64>) -> Vec<f64> {
    let m = z.len();
    if m == 1 {
        return z.to_vec();
    }
    let half = m / 2;
    let g: Vec<f64> = (0..half).map(|i| z[i] + z[m - 1 - i]).collect();
    let h: Vec<f64> = (0..half)
        .map(|i| (z[i] - z[m - 1 - i]) * lee_const_f64(m, i))
        .collect();
    all.extend(g.iter().chain(&h));
    let (gt, ht) = (lee_values(&g, all), lee_values(&h, all));
    let mut out = vec![0f64; m];
    for k in 0..half {
        out[2 * k] = gt[k];
        out[2 * k + 1] = if k + 1 < half {
            ht[k] + ht[k + 1]
        } else {
            ht[k]
        };
    }
    all.extend(&out);
    out
}

#[test]
#[cfg_attr(
    miri,
    ignore = "64 x 64 tiles and every length's gains: minutes under Miri"
)]
fn lee_stays_finite_below_its_documented_bound() {
    // Each value is linear in the input: its largest magnitude over inputs within M is
    // M times the L1 norm of its coefficients. Rows: every value within f32's range for
    // M = 2^117; a 2-D tile: the columns' values too, on rows of scaled outputs (each
    // at most the L1 norm of a basis row times M). The format's documents promise no
    // overflow below 2^117.
    let bound = 2f64.powi(117);
    let max = f64::from(f32::MAX);
    let mut n = 2;
    while n <= MAX_N {
        let mut gains: Vec<f64> = Vec::new();
        for j in 0..n {
            let mut e = vec![0f64; n];
            e[j] = 1.0;
            let mut all = Vec::new();
            lee_values(&e, &mut all);
            gains.resize(all.len(), 0.0);
            gains.iter_mut().zip(&all).for_each(|(g, v)| *g += v.abs());
        }
        let gain = gains.iter().fold(0f64, |m, &g| m.max(g));
        let b = basis(n);
        let out = (0..n)
            .map(|k| (0..n).map(|i| f64::from(b[k * n + i]).abs()).sum::<f64>())
            .fold(0f64, f64::max);
        assert!(gain * bound < max / 1.01, "rows of {n}: gain {gain}");
        assert!(
            gain * out * bound < max / 1.01,
            "tiles of {n}: {gain} x {out}"
        );
        n *= 2;
    }
    // And f32 itself: tiles of 2^117 (all one sign, alternating, a spike) transform
    // to finite coefficients.
    let m = 2f32.powi(117) * 0.999;
    for pattern in 0..3 {
        let x: Vec<f32> = (0..64 * 64)
            .map(|i| match pattern {
                0 => m,
                1 => {
                    if (i + i / 64) % 2 == 0 {
                        m
                    } else {
                        -m
                    }
                }
                _ => {
                    if i == 2080 {
                        m
                    } else {
                        1.0
                    }
                }
            })
            .collect();
        for &(h, w) in &[(1usize, 64usize), (64, 64), (8, 8)] {
            let (mut y, mut out) = (vec![0f32; h * w], vec![0f32; h * w]);
            forward_lee(&x, w, h, w, &mut y, &mut out);
            assert!(out.iter().all(|v| v.is_finite()), "{pattern} {h}x{w}");
        }
    }
}

#[test]
#[cfg_attr(miri, ignore = "whole groups of sixteen tiles: slow under Miri")]
fn full_groups_of_lanes_give_the_same_frames_on_every_backend() {
    // Groups of sixteen tiles of 8 to 64 (the AVX2 and AVX-512 builds' in-register
    // transposes), then a partial group; the scalar backend's positions and values.
    for w in [8, 16, 32, 64] {
        let tiles = 2 * LANES + 3;
        let x: Vec<f32> = (0..tiles * w)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.37)
            .collect();
        for kt in [1, 4, 9].into_iter().filter(|&k| k < w) {
            let run = |b: crate::kernels::Backend| {
                let (mut pos, mut vals) = (vec![0u16; tiles * kt], vec![0f32; tiles * kt]);
                b.run(|| encode_rows_lee(&x, w, kt, &mut pos, &mut vals));
                (pos, vals.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
            };
            let want = run(crate::kernels::Backend::scalar());
            for backend in crate::kernels::Backend::available() {
                assert!(run(backend) == want, "{} w={w} kt={kt}", backend.name());
            }
        }
    }
}
