//! The DCT-II of the `dct` codec: its basis, the forward transform of a tile, and the
//! inverse of a sparse set of coefficients.
//!
//! One plain implementation serves every backend: each result is a fixed sequence of f32
//! multiplications and additions (no fused multiply-add, no reordering), which the
//! compiler may vectorise across independent outputs but cannot change, so every CPU
//! decodes the same bits.
//!
//! The basis of length `N` (1 to [`MAX_N`]: tiles at a tensor's edge are shorter than the
//! chunk) is the orthonormal DCT-II matrix rounded to f32: `B_N[k][n]` is the f32 nearest to
//! `s_k cos(pi (2n + 1) k / (2N))`, with `s_0 = sqrt(1/N)` and `s_k = sqrt(2/N)`.
//! [`basis`] evaluates it in f64 with the cosine's argument reduced to at most `pi/4`
//! (a sine past it), which puts every entry's f64 value within a few parts in 2^53 of
//! the real number; a test checks that every entry of every basis lies at least 2^-46
//! (relative) from an f32 rounding boundary, so any careful evaluation rounds to the same
//! table.

use std::sync::OnceLock;

/// The longest transform: tiles are at most this many elements on a side.
pub const MAX_N: usize = 64;

/// `cos(pi j / (2 n))` in f64 for any `j`, by quadrant: the argument handed to `cos` or
/// `sin` is at most `pi / 4`.
fn cos_quarter(j: u64, n: u64) -> f64 {
    let period = 4 * n;
    let mut j = j % period;
    // cos is even and 2 pi periodic: fold into [0, pi].
    if j > 2 * n {
        j = period - j;
    }
    // cos(pi - x) = -cos(x): fold into [0, pi / 2].
    let (j, sign) = if j > n { (2 * n - j, -1.0) } else { (j, 1.0) };
    let v = if 2 * j <= n {
        (core::f64::consts::PI * j as f64 / (2 * n) as f64).cos()
    } else {
        // cos(x) = sin(pi / 2 - x), with pi / 2 - x at most pi / 4.
        (core::f64::consts::PI * (n - j) as f64 / (2 * n) as f64).sin()
    };
    sign * v
}

/// The entry `B_n[k][i]` in f64, before rounding to f32.
fn entry_f64(n: usize, k: usize, i: usize) -> f64 {
    let s = if k == 0 {
        (1.0 / n as f64).sqrt()
    } else {
        (2.0 / n as f64).sqrt()
    };
    s * cos_quarter(((2 * i + 1) * k) as u64, n as u64)
}

/// The tables of one length: the basis row-major (`b[k * n + i] = B_n[k][i]`) and its
/// transpose (`t[i * n + k]`).
struct Tables {
    b: Vec<f32>,
    t: Vec<f32>,
}

fn tables(n: usize) -> &'static Tables {
    static ALL: [OnceLock<Tables>; MAX_N + 1] = [const { OnceLock::new() }; MAX_N + 1];
    assert!((1..=MAX_N).contains(&n), "DCT length {n}");
    ALL[n].get_or_init(|| {
        let mut b = vec![0f32; n * n];
        let mut t = vec![0f32; n * n];
        for k in 0..n {
            for i in 0..n {
                let v = entry_f64(n, k, i) as f32;
                b[k * n + i] = v;
                t[i * n + k] = v;
            }
        }
        Tables { b, t }
    })
}

/// The basis of length `n` (1 to [`MAX_N`]), row-major:
/// `basis(n)[k * n + i] = B_n[k][i]`.
pub fn basis(n: usize) -> &'static [f32] {
    &tables(n).b
}

/// The forward transform of a tile of `h` rows of `w` elements (row `i` is
/// `x[i * stride..i * stride + w]`): `out[a * w + b] = X[a][b]`, computed as the format
/// specifies: first `Y[i][b] = sum_n x[i][n] B_w[b][n]`, then `X[a][b] = sum_i Y[i][b]
/// B_h[a][i]`, each sum in f32 from +0 in increasing index order. `y` is scratch of at
/// least `h * w`; `h` and `w` are 1 to [`MAX_N`]. Runs compiled for the current backend
/// (the same operations in the same order on every one, so the same bits).
pub fn forward(x: &[f32], stride: usize, h: usize, w: usize, y: &mut [f32], out: &mut [f32]) {
    super::dct_forward(x, stride, h, w, y, out)
}

/// [`forward`], inlined into each backend's compilation.
#[inline(always)]
pub(super) fn forward_impl(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    // Full tiles of the usual chunks run with the accumulators in fixed arrays
    // (registers): the same sums in the same order as the general loops.
    match w {
        64 => forward_fixed::<64>(x, stride, h, y, out),
        32 => forward_fixed::<32>(x, stride, h, y, out),
        16 => forward_fixed::<16>(x, stride, h, y, out),
        8 => forward_fixed::<8>(x, stride, h, y, out),
        _ => forward_any(x, stride, h, w, y, out),
    }
}

/// [`forward_impl`] for tiles `W` wide.
#[inline(always)]
fn forward_fixed<const W: usize>(
    x: &[f32],
    stride: usize,
    h: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    let bw = &tables(W).t;
    let y = &mut y[..h * W];
    for (i, yr) in y.chunks_exact_mut(W).enumerate() {
        let xr = &x[i * stride..i * stride + W];
        let mut acc = [0f32; W];
        for (n, &xv) in xr.iter().enumerate() {
            let col: &[f32; W] = bw[n * W..n * W + W].try_into().expect("a basis row");
            for b in 0..W {
                acc[b] += xv * col[b];
            }
        }
        yr.copy_from_slice(&acc);
    }
    let out = &mut out[..h * W];
    if h == 1 {
        return one_row(y, out);
    }
    let bh = &tables(h).b;
    for (a, orow) in out.chunks_exact_mut(W).enumerate() {
        let mut acc = [0f32; W];
        for (i, yr) in y.chunks_exact(W).enumerate() {
            let c = bh[a * h + i];
            let yr: &[f32; W] = yr.try_into().expect("a row of Y");
            for b in 0..W {
                acc[b] += yr[b] * c;
            }
        }
        orow.copy_from_slice(&acc);
    }
}

/// The column pass of a one-row tile: `B_1 = [1]`, so `X = 0 + Y * 1`.
#[inline(always)]
fn one_row(y: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(y).for_each(|(o, &v)| *o = 0.0 + v);
}

/// [`forward_impl`] for tiles of any width.
#[inline(always)]
fn forward_any(x: &[f32], stride: usize, h: usize, w: usize, y: &mut [f32], out: &mut [f32]) {
    let bw = &tables(w).t;
    let y = &mut y[..h * w];
    for (i, yr) in y.chunks_exact_mut(w).enumerate() {
        let xr = &x[i * stride..i * stride + w];
        yr.fill(0.0);
        for (n, &xv) in xr.iter().enumerate() {
            let col = &bw[n * w..n * w + w];
            yr.iter_mut().zip(col).for_each(|(acc, &c)| *acc += xv * c);
        }
    }
    let out = &mut out[..h * w];
    if h == 1 {
        return one_row(y, out);
    }
    let bh = &tables(h).b;
    for (a, orow) in out.chunks_exact_mut(w).enumerate() {
        orow.fill(0.0);
        for (i, yr) in y.chunks_exact(w).enumerate() {
            let c = bh[a * h + i];
            orow.iter_mut().zip(yr).for_each(|(acc, &v)| *acc += v * c);
        }
    }
}

/// The inverse transform of a tile of `h x w` coefficients of which only `kept` are
/// non-zero (positions `a * w + b`, strictly increasing, with their values), as the
/// format specifies: `T[i][b] = sum_j v_j B_h[a_j][i]` over the kept `j` of column `b` in
/// order, then `x[i][n] = sum_b T[i][b] B_w[b][n]` in increasing `b`, each from +0 in f32.
/// Columns with no kept coefficient add exactly nothing (their `T` is +0 and `x` is never
/// -0), so they are skipped. Calls `emit(i, row)` with each output row `i` (`w` values).
/// `t` and `x` are scratch of at least `h * w`; `cols` of at least `w`. The second pass
/// runs compiled for the current backend (the same operations in the same order).
#[allow(clippy::too_many_arguments)]
pub fn inverse(
    kept: impl Iterator<Item = (usize, f32)>,
    h: usize,
    w: usize,
    t: &mut [f32],
    cols: &mut [bool],
    x: &mut [f32],
    mut emit: impl FnMut(usize, &[f32]),
) {
    let t = &mut t[..h * w];
    let cols = &mut cols[..w];
    t.fill(0.0);
    cols.fill(false);
    if h == 1 {
        for (p, v) in kept {
            // B_1 = [1]: T = 0 + v * 1.
            t[p] = 0.0 + v;
            cols[p] = true;
        }
    } else {
        let bh = &tables(h).b;
        for (p, v) in kept {
            let (a, b) = (p / w, p % w);
            cols[b] = true;
            for i in 0..h {
                t[i * w + b] += v * bh[a * h + i];
            }
        }
    }
    let x = &mut x[..h * w];
    super::dct_inverse_rows(t, cols, h, w, x);
    for (i, r) in x.chunks_exact(w).enumerate() {
        emit(i, r);
    }
}

/// The second pass of [`inverse`] (`x[i][n] = sum_b T[i][b] B_w[b][n]` over the kept
/// columns), inlined into each backend's compilation.
#[inline(always)]
pub(super) fn inverse_rows_impl(t: &[f32], cols: &[bool], h: usize, w: usize, x: &mut [f32]) {
    // Rows of the usual chunk widths with the accumulators in a fixed array (registers):
    // the same sums in the same order.
    match w {
        64 => inverse_rows::<64>(t, cols, h, x),
        32 => inverse_rows::<32>(t, cols, h, x),
        16 => inverse_rows::<16>(t, cols, h, x),
        8 => inverse_rows::<8>(t, cols, h, x),
        _ => inverse_rows_any(t, cols, h, w, x),
    }
}

/// [`inverse_rows_impl`] for rows of any width.
#[inline(always)]
fn inverse_rows_any(t: &[f32], cols: &[bool], h: usize, w: usize, x: &mut [f32]) {
    let bw = &tables(w).b;
    for (i, row) in x.chunks_exact_mut(w).enumerate().take(h) {
        row.fill(0.0);
        for b in 0..w {
            if cols[b] {
                let c = t[i * w + b];
                let basis_row = &bw[b * w..b * w + w];
                row.iter_mut()
                    .zip(basis_row)
                    .for_each(|(acc, &q)| *acc += c * q);
            }
        }
    }
}

/// [`inverse_rows_impl`] for rows `W` wide.
#[inline(always)]
fn inverse_rows<const W: usize>(t: &[f32], cols: &[bool], h: usize, x: &mut [f32]) {
    let bw = &tables(W).b;
    for (i, row) in x.chunks_exact_mut(W).enumerate().take(h) {
        let mut acc = [0f32; W];
        for b in 0..W {
            if cols[b] {
                let c = t[i * W + b];
                let basis_row: &[f32; W] = bw[b * W..b * W + W].try_into().expect("a basis row");
                for n in 0..W {
                    acc[n] += c * basis_row[n];
                }
            }
        }
        row.copy_from_slice(&acc);
    }
}

#[cfg(test)]
mod tests {
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
            let (mut t, mut cols, mut tile) =
                (vec![0f32; h * w], vec![false; w], vec![0f32; h * w]);
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
}
