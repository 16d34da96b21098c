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

use super::scalar::CANONICAL_NAN;

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

/// The factorised forward transform's tables of length `n` (a power of two, 2 to
/// [`MAX_N`]): per level `l = 1, 2, ...` (`M = n >> (l - 1)` values left, `M / 2` of
/// them differences), `T[i][j] = B_n[(n / M) (2 j + 1)][i]` for `i, j < M / 2`, the
/// levels back to back.
fn fast_table(n: usize) -> &'static [f32] {
    static ALL: [OnceLock<Vec<f32>>; MAX_N + 1] = [const { OnceLock::new() }; MAX_N + 1];
    assert!(
        n >= 2 && n.is_power_of_two() && n <= MAX_N,
        "factorised DCT length {n}"
    );
    ALL[n].get_or_init(|| {
        let b = basis(n);
        let mut t = Vec::new();
        let mut m = n;
        while m >= 2 {
            let half = m / 2;
            for i in 0..half {
                for j in 0..half {
                    t.push(b[(n / m) * (2 * j + 1) * n + i]);
                }
            }
            m = half;
        }
        t
    })
}

/// Whether the factorised transform applies to length `n`: a power of two from 2.
#[inline(always)]
fn factorised(n: usize) -> bool {
    n >= 2 && n.is_power_of_two()
}

/// The factorised DCT-II of one row `z` (length `n`, [`factorised`]) into `out`, `z`
/// being overwritten, as the format specifies: while `M >= 2` values are left, the
/// butterflies `s_i = z_i + z_{M-1-i}` and `d_i = z_i - z_{M-1-i}` (`i < M / 2`, each
/// rounded); the coefficients `k = (n / M) (2 j + 1)` are `0 + sum over i < M / 2 of
/// d_i B_n[k][i]` in increasing `i`; the `s_i` go on as the next level's values; last,
/// `X[0] = 0 + s_0 B_n[0][0]`.
#[inline(always)]
fn fast_row(z: &mut [f32], n: usize, out: &mut [f32]) {
    let t = fast_table(n);
    let (mut m, mut off, mut stride) = (n, 0, 1);
    while m >= 2 {
        let half = m / 2;
        let t = &t[off..off + half * half];
        match half {
            32 => level::<32>(z, t, out, stride),
            16 => level::<16>(z, t, out, stride),
            8 => level::<8>(z, t, out, stride),
            4 => level::<4>(z, t, out, stride),
            2 => level::<2>(z, t, out, stride),
            _ => level::<1>(z, t, out, stride),
        }
        off += half * half;
        m = half;
        stride *= 2;
    }
    out[0] = 0.0 + z[0] * basis(n)[0];
}

/// One level of [`fast_row`] on the `2 H` values `z[..2 H]`: the butterflies (the sums
/// left in `z[..H]` for the next level), then the `H` coefficients `k = stride (2 j + 1)`
/// from the differences and the level's table `t` (`H x H`), with the accumulators in a
/// fixed array (registers).
#[inline(always)]
fn level<const H: usize>(z: &mut [f32], t: &[f32], out: &mut [f32], stride: usize) {
    let (lo, hi) = z[..2 * H].split_at_mut(H);
    let lo: &mut [f32; H] = lo.try_into().expect("H values");
    let hi: &[f32; H] = (&*hi).try_into().expect("H values");
    let mut d = [0f32; H];
    for i in 0..H {
        let (a, b) = (lo[i], hi[H - 1 - i]);
        lo[i] = a + b;
        d[i] = a - b;
    }
    let mut acc = [0f32; H];
    for (i, &di) in d.iter().enumerate() {
        let row: &[f32; H] = t[i * H..(i + 1) * H].try_into().expect("a table row");
        for j in 0..H {
            acc[j] += di * row[j];
        }
    }
    for (j, &a) in acc.iter().enumerate() {
        out[stride * (2 * j + 1)] = a;
    }
}

/// Rows transformed at once by [`encode_rows_fast`]: their sums are independent, so the
/// processor overlaps their chains of additions (one row alone waits on each addition).
const ROWS: usize = 4; // level_rows names each row's accumulators

/// [`level`] on [`ROWS`] rows at once: for each row, the same operations in the same
/// order.
#[inline(always)]
fn level_rows<const H: usize>(
    z: &mut [[f32; MAX_N]; ROWS],
    t: &[f32],
    out: &mut [[f32; MAX_N]; ROWS],
    stride: usize,
) {
    let mut d = [[0f32; H]; ROWS];
    for (z, d) in z.iter_mut().zip(d.iter_mut()) {
        let (lo, hi) = z[..2 * H].split_at_mut(H);
        for i in 0..H {
            let (a, b) = (lo[i], hi[H - 1 - i]);
            lo[i] = a + b;
            d[i] = a - b;
        }
    }
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; H], [0f32; H], [0f32; H], [0f32; H]);
    for i in 0..H {
        let row: &[f32; H] = t[i * H..(i + 1) * H].try_into().expect("a table row");
        let (d0, d1, d2, d3) = (d[0][i], d[1][i], d[2][i], d[3][i]);
        for j in 0..H {
            a0[j] += d0 * row[j];
            a1[j] += d1 * row[j];
            a2[j] += d2 * row[j];
            a3[j] += d3 * row[j];
        }
    }
    for (o, acc) in out.iter_mut().zip([&a0, &a1, &a2, &a3]) {
        for (j, &a) in acc.iter().enumerate() {
            o[stride * (2 * j + 1)] = a;
        }
    }
}

/// The `dct` encoder's work for tiles of one row: `x` holds tiles of `w` elements back
/// to back (`w` a power of two from 2 to [`MAX_N`]); each goes through the factorised
/// transform ([`forward_fast`]'s arithmetic) and keeps `kt` coefficients (1 to
/// [`SELECT_MAX`], below `w`) as [`select`] chooses them: tile `t`'s positions go to
/// `pos[t * kt..]`, increasing, and their coefficients (NaN as `0x7FC00000`) to
/// `vals[t * kt..]`. One call for many tiles, compiled for the current backend, with
/// four tiles transformed at once.
pub fn encode_rows_fast(x: &[f32], w: usize, kt: usize, pos: &mut [u16], vals: &mut [f32]) {
    super::dct_encode_rows_fast(x, w, kt, pos, vals)
}

/// [`encode_rows_fast`], inlined into each backend's compilation.
#[inline(always)]
pub(super) fn encode_rows_fast_impl(
    x: &[f32],
    w: usize,
    kt: usize,
    pos: &mut [u16],
    vals: &mut [f32],
) {
    assert!(factorised(w) && w <= MAX_N && (1..=SELECT_MAX).contains(&kt) && kt < w);
    let t = fast_table(w);
    let b00 = basis(w)[0];
    let tiles = x.len() / w;
    let mut keys = [0u64; MAX_N];
    // Reused from group to group: every level writes its own positions of `out` (odd
    // multiples of its stride, and position 0 after the last), so all `w` are written
    // before they are read, and the rows of a last, partial group past `group` are
    // transformed but never read. (Zeroing both per group had cost twice the input's
    // bytes in stores.)
    let mut z = [[0f32; MAX_N]; ROWS];
    let mut out = [[0f32; MAX_N]; ROWS];
    let mut first = 0;
    while first < tiles {
        let group = (tiles - first).min(ROWS);
        for (r, z) in z.iter_mut().enumerate().take(group) {
            z[..w].copy_from_slice(&x[(first + r) * w..(first + r + 1) * w]);
        }
        let (mut m, mut off, mut stride) = (w, 0, 1);
        while m >= 2 {
            let half = m / 2;
            let tl = &t[off..off + half * half];
            match half {
                32 => level_rows::<32>(&mut z, tl, &mut out, stride),
                16 => level_rows::<16>(&mut z, tl, &mut out, stride),
                8 => level_rows::<8>(&mut z, tl, &mut out, stride),
                4 => level_rows::<4>(&mut z, tl, &mut out, stride),
                2 => level_rows::<2>(&mut z, tl, &mut out, stride),
                _ => level_rows::<1>(&mut z, tl, &mut out, stride),
            }
            off += half * half;
            m = half;
            stride *= 2;
        }
        for r in 0..group {
            out[r][0] = 0.0 + z[r][0] * b00;
        }
        select_into(&mut out, group, w, kt, &mut keys, first, pos, vals);
        first += group;
    }
}

/// The factorised transform down the `h` rows (`h` [`factorised`]) of `y` (`h` rows of
/// `w`), rows being the values of [`fast_row`]'s butterflies and sums (each element of a
/// row on its own): `out` row `k` gets coefficient row `k`. `y` is overwritten.
#[inline(always)]
fn fast_cols(y: &mut [f32], h: usize, w: usize, out: &mut [f32]) {
    let bh = basis(h);
    let (mut m, mut stride) = (h, 1);
    while m >= 2 {
        let half = m / 2;
        for i in 0..half {
            let (top, bottom) = y.split_at_mut((m - 1 - i) * w);
            let (a, b) = (&mut top[i * w..(i + 1) * w], &mut bottom[..w]);
            for (a, b) in a.iter_mut().zip(b.iter_mut()) {
                let (x, v) = (*a, *b);
                *a = x + v;
                *b = x - v;
            }
        }
        for j in 0..half {
            let k = stride * (2 * j + 1);
            let orow = &mut out[k * w..(k + 1) * w];
            orow.fill(0.0);
            for i in 0..half {
                let c = bh[k * h + i];
                let d = &y[(m - 1 - i) * w..(m - i) * w];
                orow.iter_mut().zip(d).for_each(|(o, &v)| *o += v * c);
            }
        }
        m = half;
        stride *= 2;
    }
    let c = bh[0];
    out[..w]
        .iter_mut()
        .zip(&y[..w])
        .for_each(|(o, &v)| *o = 0.0 + v * c);
}

/// [`forward`] by the factorised transform where a dimension's length is a power of two
/// from 2 (`fast_row` along the rows, `fast_cols` down them), by the direct sums
/// elsewhere; `y` is scratch of at least `h * w`.
pub fn forward_fast(x: &[f32], stride: usize, h: usize, w: usize, y: &mut [f32], out: &mut [f32]) {
    super::dct_forward_fast(x, stride, h, w, y, out)
}

/// [`forward_fast`], inlined into each backend's compilation.
#[inline(always)]
pub(super) fn forward_fast_impl(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    if !factorised(w) && !factorised(h) {
        return forward_impl(x, stride, h, w, y, out);
    }
    let y = &mut y[..h * w];
    let out = &mut out[..h * w];
    if factorised(w) {
        let mut z = [0f32; MAX_N];
        for (i, yr) in y.chunks_exact_mut(w).enumerate() {
            let z = &mut z[..w];
            z.copy_from_slice(&x[i * stride..i * stride + w]);
            fast_row(z, w, yr);
        }
    } else {
        rows_direct(x, stride, w, y);
    }
    if h == 1 {
        return one_row(y, out);
    }
    if factorised(h) {
        return fast_cols(y, h, w, out);
    }
    cols_direct(y, h, w, out);
}

/// Lee's constants of every power-of-two length `m` from 2 to [`MAX_N`], back to back:
/// `c_m[i]` (`i < m / 2`) is at `m / 2 - 1 + i`, the f32 nearest to
/// `1 / (2 cos(pi (2 i + 1) / (2 m)))` (evaluated in f64, the cosine's argument below
/// `pi / 2`; a test checks that every one lies far from an f32 rounding boundary).
fn lee_consts() -> &'static [f32; MAX_N - 1] {
    static C: OnceLock<[f32; MAX_N - 1]> = OnceLock::new();
    C.get_or_init(|| {
        let mut c = [0f32; MAX_N - 1];
        let mut m = 2;
        while m <= MAX_N {
            for i in 0..m / 2 {
                c[m / 2 - 1 + i] = lee_const_f64(m, i) as f32;
            }
            m *= 2;
        }
        c
    })
}

/// `1 / (2 cos(pi (2 i + 1) / (2 m)))` in f64, before rounding to f32.
fn lee_const_f64(m: usize, i: usize) -> f64 {
    0.5 / cos_quarter((2 * i + 1) as u64, m as u64)
}

/// The orthonormal scales of Lee's transform of length `n`: `(s_0, s)`, the f32 nearest
/// to `sqrt(1 / n)` and to `sqrt(2 / n)`.
#[inline(always)]
fn lee_scales(n: usize) -> (f32, f32) {
    (
        (1.0 / n as f64).sqrt() as f32,
        (2.0 / n as f64).sqrt() as f32,
    )
}

/// Lee's DCT-II of `n` values (`n` a power of two, 2 to [`MAX_N`]), each value a vector
/// of `L` lanes transformed independently (`a[v][j]` is value `v` of lane `j`), in place
/// in `a[..n]`, `b` being scratch of the same length. For each lane the operations are
/// those the format states, in f32 without fused multiply-adds:
///
/// 1. splitting, for block sizes `m = n, n / 2, ..., 2`: each block of `m` values `z`
///    becomes `g_i = z_i + z_{m-1-i}` then `h_i = (z_i - z_{m-1-i}) c_m[i]` (`i < m / 2`);
/// 2. merging, for `m = 2, 4, ..., n`: a block whose halves hold the transforms `G` of its
///    `g` and `H` of its `h` becomes `C_{2k} = G_k`, `C_{2k+1} = H_k + H_{k+1}`
///    (`k < m / 2 - 1`) and `C_{m-1} = H_{m/2-1}`;
/// 3. scaling: `U_0 = C_0 s_0`, `U_k = C_k s` (`k >= 1`) with [`lee_scales`].
#[inline(always)]
fn lee<const L: usize>(a: &mut [[f32; L]], b: &mut [[f32; L]], n: usize) {
    match n {
        64 => lee_n::<64, L>(a, b),
        32 => lee_n::<32, L>(a, b),
        16 => lee_n::<16, L>(a, b),
        8 => lee_n::<8, L>(a, b),
        4 => lee_n::<4, L>(a, b),
        _ => lee_n::<2, L>(a, b),
    }
}

/// [`lee`] of `N` values.
#[inline(always)]
fn lee_n<const N: usize, const L: usize>(a: &mut [[f32; L]], b: &mut [[f32; L]]) {
    let c = lee_consts();
    let a: &mut [[f32; L]; N] = (&mut a[..N]).try_into().expect("N values");
    let b: &mut [[f32; L]; N] = (&mut b[..N]).try_into().expect("N values");
    let mut m = N;
    let mut into_b = true;
    while m >= 2 {
        let half = m / 2;
        let cm = &c[half - 1..m - 1];
        let (src, dst) = if into_b {
            (&*a, &mut *b)
        } else {
            (&*b, &mut *a)
        };
        for o in (0..N).step_by(m) {
            for i in 0..half {
                let (x, y, ci) = (src[o + i], src[o + m - 1 - i], cm[i]);
                let (mut g, mut h) = ([0f32; L], [0f32; L]);
                for j in 0..L {
                    g[j] = x[j] + y[j];
                    h[j] = (x[j] - y[j]) * ci;
                }
                dst[o + i] = g;
                dst[o + half + i] = h;
            }
        }
        into_b = !into_b;
        m = half;
    }
    let (s0, s) = lee_scales(N);
    let mut m = 2;
    while m <= N {
        let half = m / 2;
        let last = m == N;
        let (src, dst) = if into_b {
            (&*a, &mut *b)
        } else {
            (&*b, &mut *a)
        };
        for o in (0..N).step_by(m) {
            for k in 0..half {
                let (g, h) = (src[o + k], src[o + half + k]);
                let mut odd = h;
                if k + 1 < half {
                    let h1 = src[o + half + k + 1];
                    for j in 0..L {
                        odd[j] = h[j] + h1[j];
                    }
                }
                let mut even = g;
                if last {
                    let se = if k > 0 { s } else { s0 };
                    for j in 0..L {
                        even[j] = g[j] * se;
                        odd[j] *= s;
                    }
                }
                dst[o + 2 * k] = even;
                dst[o + 2 * k + 1] = odd;
            }
        }
        into_b = !into_b;
        m *= 2;
    }
    // 2 log2(N) passes, an even number: the result is back in `a`, the next pass would
    // write into `b`.
    debug_assert!(into_b);
}

/// [`lee`] down the `h` rows of `y` (`h` rows of `w`; `h` [`factorised`]) into `out`, `W`
/// of a row's elements at a time as the lanes.
#[inline(always)]
fn lee_cols<const W: usize>(y: &[f32], h: usize, out: &mut [f32]) {
    let w = y.len() / h;
    let (mut a, mut b) = ([[0f32; W]; MAX_N], [[0f32; W]; MAX_N]);
    for c0 in (0..w).step_by(W) {
        for (a, row) in a.iter_mut().zip(y.chunks_exact(w)) {
            a.copy_from_slice(&row[c0..c0 + W]);
        }
        lee(&mut a, &mut b, h);
        for (a, row) in a.iter().zip(out.chunks_exact_mut(w)) {
            row[c0..c0 + W].copy_from_slice(a);
        }
    }
}

/// Tiles transformed at once, as lanes, by [`encode_rows_lee`].
pub(super) const LANES: usize = 16;

/// A backend's faster way, where it has one, to put [`LANES`] rows of `w` (row `t` at
/// `rows[t * stride..]`; arguments `rows, stride, w, a`) into lanes (`a[n][t]` = element
/// `n` of row `t`): returns whether it did (else the plain loop does).
pub(super) type LoadLanes<'a> =
    &'a dyn Fn(&[f32], usize, usize, &mut [[f32; LANES]; MAX_N]) -> bool;

/// [`encode_rows_fast`] with Lee's transform ([`forward_lee`]'s arithmetic): sixteen
/// tiles at once, each a lane of the transform's vectors, each keeping the `kt`
/// coefficients [`select`] chooses (up to 8 in one insertion pass over the lanes).
pub fn encode_rows_lee(x: &[f32], w: usize, kt: usize, pos: &mut [u16], vals: &mut [f32]) {
    super::dct_encode_rows_lee(x, w, kt, pos, vals)
}

/// [`encode_rows_lee`], inlined into each backend's compilation.
#[inline(always)]
pub(super) fn encode_rows_lee_impl(
    x: &[f32],
    w: usize,
    kt: usize,
    pos: &mut [u16],
    vals: &mut [f32],
    load: LoadLanes,
) {
    assert!(factorised(w) && w <= MAX_N && (1..=SELECT_MAX).contains(&kt) && kt < w);
    let tiles = x.len() / w;
    let mut a = [[0f32; LANES]; MAX_N];
    let mut b = [[0f32; LANES]; MAX_N];
    let mut out = [[0f32; MAX_N]; ROWS];
    let mut keys = [0u64; MAX_N];
    let mut first = 0;
    while first < tiles {
        let group = (tiles - first).min(LANES);
        // Lanes past `group` (a last, partial group) hold earlier values: transformed,
        // never read.
        let xs = &x[first * w..(first + group) * w];
        if group < LANES || !load(xs, w, w, &mut a) {
            for (t, tile) in xs.chunks_exact(w).enumerate() {
                for (n, &v) in tile.iter().enumerate() {
                    a[n][t] = v;
                }
            }
        }
        lee(&mut a, &mut b, w);
        if kt <= LANE_SELECT_MAX {
            let mut at = [[0u8; LANES]; LANE_SELECT_MAX];
            match kt {
                1 => select_lanes::<1>(&a[..w], &mut at),
                2 => select_lanes::<2>(&a[..w], &mut at),
                3 => select_lanes::<3>(&a[..w], &mut at),
                4 => select_lanes::<4>(&a[..w], &mut at),
                5 => select_lanes::<5>(&a[..w], &mut at),
                6 => select_lanes::<6>(&a[..w], &mut at),
                7 => select_lanes::<7>(&a[..w], &mut at),
                _ => select_lanes::<8>(&a[..w], &mut at),
            }
            for t in 0..group {
                let o = (first + t) * kt;
                for (j, at) in at[..kt].iter().enumerate() {
                    let c = at[t];
                    pos[o + j] = u16::from(c);
                    vals[o + j] = canonical(a[c as usize][t]);
                }
            }
            first += group;
            continue;
        }
        for r0 in (0..group).step_by(ROWS) {
            let rows = (group - r0).min(ROWS);
            for (r, o) in out.iter_mut().enumerate().take(rows) {
                for (n, o) in o[..w].iter_mut().enumerate() {
                    *o = a[n][r0 + r];
                }
            }
            select_into(&mut out, rows, w, kt, &mut keys, first + r0, pos, vals);
        }
        first += group;
    }
}

/// Most coefficients per tile that [`select_lanes`] keeps.
const LANE_SELECT_MAX: usize = 8;

/// The selection of [`select`] (the `K` largest keys `bits & 0x7FFFFFFF`, a NaN's being
/// `0x7FC00000`'s, the lower position first among equal keys) for each of the [`LANES`]
/// tiles whose coefficient `n` is `c[n][t]`, as one pass of insertions into a list of the
/// `K` best so far, kept in order, in every lane at once. A key is taken plus one, so that
/// every coefficient, +0 too, beats the list's initial zeros. Last, each lane's `K`
/// positions are sorted: `at[i][t]` is then tile `t`'s `i`-th chosen position in
/// increasing order.
#[inline(always)]
fn select_lanes<const K: usize>(c: &[[f32; LANES]], at: &mut [[u8; LANES]; LANE_SELECT_MAX]) {
    let mut best = [[0i32; LANES]; K];
    let mut pos = [[0i32; LANES]; K];
    for (n, v) in c.iter().enumerate() {
        let mut key = [0i32; LANES];
        for j in 0..LANES {
            let b = (v[j].to_bits() & 0x7FFF_FFFF) as i32;
            key[j] = if b > 0x7F80_0000 { 0x7FC0_0001 } else { b + 1 };
        }
        // Against the list as it was: the key beats entries `r..K` (`r` being how many
        // are at least as large: a tie keeps the earlier position ahead). Those move down
        // by one, the last dropping off, and the key takes place `r`. Written as selects
        // of values, which compilers vectorise across the lanes.
        // Masks are all ones or zeros in i32 lanes (not bools), which compilers keep in
        // vector registers on every backend.
        let n = n as i32;
        let mut beats = [[0i32; LANES]; K];
        for (m, b) in beats.iter_mut().zip(&best) {
            for j in 0..LANES {
                m[j] = -i32::from(key[j] > b[j]);
            }
        }
        for i in (0..K).rev() {
            let (up_key, up_pos, up_beats) = if i > 0 {
                (best[i - 1], pos[i - 1], beats[i - 1])
            } else {
                ([0; LANES], [0; LANES], [0; LANES])
            };
            let (bk, bp, m) = (best[i], pos[i], beats[i]);
            for j in 0..LANES {
                // The entry above moves down where the key beats it too, else the key
                // comes in; either only where the key beats this entry.
                let k = (up_key[j] & up_beats[j]) | (key[j] & !up_beats[j]);
                let p = (up_pos[j] & up_beats[j]) | (n & !up_beats[j]);
                best[i][j] = (k & m[j]) | (bk[j] & !m[j]);
                pos[i][j] = (p & m[j]) | (bp[j] & !m[j]);
            }
        }
    }
    // Into increasing position, by odd-even transposition (K rounds of compare-exchange
    // of neighbours), in every lane at once.
    for round in 0..K {
        for i in (round % 2..K.saturating_sub(1)).step_by(2) {
            let (lo, hi) = (pos[i], pos[i + 1]);
            for j in 0..LANES {
                pos[i][j] = lo[j].min(hi[j]);
                pos[i + 1][j] = lo[j].max(hi[j]);
            }
        }
    }
    for (o, p) in at.iter_mut().zip(&pos) {
        for j in 0..LANES {
            o[j] = p[j] as u8;
        }
    }
}

/// The selection of [`encode_rows_fast`] and [`encode_rows_lee`] on `rows` tiles of `w`
/// coefficients in `out`, tile `tile0 + r`'s positions and values written at
/// `(tile0 + r) * kt`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn select_into(
    out: &mut [[f32; MAX_N]; ROWS],
    rows: usize,
    w: usize,
    kt: usize,
    keys: &mut [u64; MAX_N],
    tile0: usize,
    pos: &mut [u16],
    vals: &mut [f32],
) {
    let mut chosen = [[0u16; SELECT_MAX]; ROWS];
    match w {
        64 => select_rows::<64>(out, rows, kt, &mut chosen),
        32 => select_rows::<32>(out, rows, kt, &mut chosen),
        16 => select_rows::<16>(out, rows, kt, &mut chosen),
        _ => {
            for r in 0..rows {
                select_impl(&mut out[r][..w], kt, keys, &mut chosen[r]);
            }
        }
    }
    for r in 0..rows {
        let tile = tile0 + r;
        for (j, &c) in chosen[r][..kt].iter().enumerate() {
            pos[tile * kt + j] = c;
            vals[tile * kt + j] = out[r][c as usize];
        }
    }
}

/// [`forward`] by Lee's transform along each side whose length is a power of two from 2,
/// by the direct sums along the others (and `U_0 = 0 + u_0 * 1` along a side of 1); `y`
/// is scratch of at least `h * w`.
pub fn forward_lee(x: &[f32], stride: usize, h: usize, w: usize, y: &mut [f32], out: &mut [f32]) {
    super::dct_forward_lee(x, stride, h, w, y, out)
}

/// [`forward_lee`], inlined into each backend's compilation.
#[inline(always)]
pub(super) fn forward_lee_impl(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
    load: LoadLanes,
) {
    if !factorised(w) && !factorised(h) {
        return forward_impl(x, stride, h, w, y, out);
    }
    let y = &mut y[..h * w];
    let out = &mut out[..h * w];
    if factorised(w) {
        // Along the rows, up to [`LANES`] rows at once as the lanes.
        let (mut a, mut b) = ([[0f32; LANES]; MAX_N], [[0f32; LANES]; MAX_N]);
        for r0 in (0..h).step_by(LANES) {
            let rows = (h - r0).min(LANES);
            let xs = &x[r0 * stride..(r0 + rows - 1) * stride + w];
            if rows < LANES || !load(xs, stride, w, &mut a) {
                for t in 0..rows {
                    let xr = &xs[t * stride..t * stride + w];
                    xr.iter().zip(a.iter_mut()).for_each(|(&v, a)| a[t] = v);
                }
            }
            lee(&mut a, &mut b, w);
            for t in 0..rows {
                let yr = &mut y[(r0 + t) * w..(r0 + t + 1) * w];
                yr.iter_mut().zip(&a).for_each(|(y, a)| *y = a[t]);
            }
        }
    } else {
        rows_direct(x, stride, w, y);
    }
    if h == 1 {
        return one_row(y, out);
    }
    if factorised(h) {
        // Down the columns, the elements of a row being the lanes.
        // (Sixteen at most, so that the two buffers stay 4 KiB each.)
        return match w {
            64 | 32 | 16 => lee_cols::<16>(y, h, out),
            8 => lee_cols::<8>(y, h, out),
            _ => lee_cols::<1>(y, h, out),
        };
    }
    cols_direct(y, h, w, out);
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
    let y = &mut y[..h * w];
    rows_direct(x, stride, w, y);
    let out = &mut out[..h * w];
    if h == 1 {
        return one_row(y, out);
    }
    cols_direct(y, h, w, out);
}

/// The direct sums along each row: `y` row `i` (`w` wide) gets `Y[i][b] = 0 + sum over n
/// of x[i][n] B_w[b][n]` in increasing `n`, `x` row `i` being `x[i * stride..]`.
#[inline(always)]
fn rows_direct(x: &[f32], stride: usize, w: usize, y: &mut [f32]) {
    let bw = &tables(w).t;
    for (i, yr) in y.chunks_exact_mut(w).enumerate() {
        let xr = &x[i * stride..i * stride + w];
        yr.fill(0.0);
        for (n, &xv) in xr.iter().enumerate() {
            let col = &bw[n * w..n * w + w];
            yr.iter_mut().zip(col).for_each(|(acc, &c)| *acc += xv * c);
        }
    }
}

/// The direct sums down each column of the `h` rows of `y`: `out` row `a` gets
/// `X[a][b] = 0 + sum over i of Y[i][b] B_h[a][i]` in increasing `i`.
#[inline(always)]
fn cols_direct(y: &[f32], h: usize, w: usize, out: &mut [f32]) {
    let bh = &tables(h).b;
    for (a, orow) in out.chunks_exact_mut(w).enumerate() {
        orow.fill(0.0);
        for (i, yr) in y.chunks_exact(w).enumerate() {
            let c = bh[a * h + i];
            orow.iter_mut().zip(yr).for_each(|(acc, &v)| *acc += v * c);
        }
    }
}

/// Most coefficients per tile that [`select`] keeps; more go through a general selection.
pub const SELECT_MAX: usize = 16;

/// The `kt` (1 to [`SELECT_MAX`], below `coef.len()`) coefficients of a tile with the
/// largest keys `bits & 0x7FFFFFFF`, the lower position first among equal keys, as
/// positions in increasing order in `chosen[..kt]`; NaN coefficients become the quiet NaN
/// `0x7FC00000` first (in `coef` too). Each coefficient is one `u64` that orders like the
/// selection (its key, then its position reversed) in `keys` (scratch, as long as `coef`),
/// and the largest is taken `kt` times: no branch on the data. Runs compiled for the
/// current backend.
pub fn select(coef: &mut [f32], kt: usize, keys: &mut [u64], chosen: &mut [u16]) {
    super::dct_select(coef, kt, keys, chosen)
}

/// The selection's key of the coefficient at position `i` (made the quiet NaN
/// `0x7FC00000` first if it is NaN): its `bits & 0x7FFFFFFF`, then its position reversed,
/// so the largest key is the largest magnitude, the lower position first among equals.
#[inline(always)]
fn select_key(c: &mut f32, i: usize) -> u64 {
    if c.is_nan() {
        *c = CANONICAL_NAN;
    }
    (u64::from(c.to_bits() & 0x7FFF_FFFF) << 16) | (0xFFFF - i as u64)
}

/// [`select`], inlined into each backend's compilation.
#[inline(always)]
pub(super) fn select_impl(coef: &mut [f32], kt: usize, keys: &mut [u64], chosen: &mut [u16]) {
    let keys = &mut keys[..coef.len()];
    for (i, (c, k)) in coef.iter_mut().zip(keys.iter_mut()).enumerate() {
        *k = select_key(c, i);
    }
    // Every entry is distinct (its position is in it), so each round removes exactly one;
    // a removed entry (0) is below every real one (whose low bits are at least 0xF000).
    for o in chosen[..kt].iter_mut() {
        let top = keys.iter().copied().fold(0, u64::max);
        let pos = 0xFFFF - (top & 0xFFFF) as usize;
        keys[pos] = 0;
        *o = pos as u16;
    }
    chosen[..kt].sort_unstable();
}

/// The `dct` decoder's work for tiles of one row: `out` holds tiles of `w` elements
/// back to back (`w` from 1 to [`MAX_N`]), tile `t` keeping `kt` coefficients at the
/// increasing positions `pos[t * kt..]` with the values `vals[t * kt..]`. Each tile
/// decodes as [`inverse`] does (`T[b] = 0 + v * 1`, then `x[n] = 0 + sum over the kept
/// b, increasing, of T[b] B_w[b][n]`), a NaN as `0x7FC00000`, into `out` by mode `M`
/// (write, add or residual). One call for many tiles, compiled for the current backend.
pub fn decode_rows<const M: u8>(w: usize, kt: usize, pos: &[u16], vals: &[f32], out: &mut [f32]) {
    super::dct_decode_rows::<M>(w, kt, pos, vals, out)
}

/// [`decode_rows`], inlined into each backend's compilation.
#[inline(always)]
pub(super) fn decode_rows_impl<const M: u8>(
    w: usize,
    kt: usize,
    pos: &[u16],
    vals: &[f32],
    out: &mut [f32],
) {
    match w {
        64 => decode_rows_fixed::<M, 64>(kt, pos, vals, out),
        32 => decode_rows_fixed::<M, 32>(kt, pos, vals, out),
        16 => decode_rows_fixed::<M, 16>(kt, pos, vals, out),
        8 => decode_rows_fixed::<M, 8>(kt, pos, vals, out),
        _ => {
            let bw = &tables(w).b;
            for (t, o) in out.chunks_exact_mut(w).enumerate() {
                let mut acc = [0f32; MAX_N];
                let acc = &mut acc[..w];
                for j in t * kt..(t + 1) * kt {
                    let (b, c) = (pos[j] as usize, 0.0 + vals[j]);
                    let row = &bw[b * w..(b + 1) * w];
                    acc.iter_mut().zip(row).for_each(|(a, &q)| *a += c * q);
                }
                o.iter_mut()
                    .zip(acc.iter())
                    .for_each(|(o, &v)| store::<M>(o, v));
            }
        }
    }
}

/// [`decode_rows_impl`] for tiles `W` wide, the accumulators in a fixed array.
#[inline(always)]
fn decode_rows_fixed<const M: u8, const W: usize>(
    kt: usize,
    pos: &[u16],
    vals: &[f32],
    out: &mut [f32],
) {
    let bw = &tables(W).b;
    for (t, o) in out.chunks_exact_mut(W).enumerate() {
        let mut acc = [0f32; W];
        for j in t * kt..(t + 1) * kt {
            let (b, c) = (pos[j] as usize, 0.0 + vals[j]);
            let row: &[f32; W] = bw[b * W..(b + 1) * W].try_into().expect("a basis row");
            for n in 0..W {
                acc[n] += c * row[n];
            }
        }
        let o: &mut [f32; W] = o.try_into().expect("a tile");
        for n in 0..W {
            store::<M>(&mut o[n], acc[n]);
        }
    }
}

/// `v`, or the quiet NaN `0x7FC00000` if it is a NaN.
#[inline(always)]
pub(crate) fn canonical(v: f32) -> f32 {
    if v.is_nan() { CANONICAL_NAN } else { v }
}

/// `o` stored from the decoded value `v` by mode `M`, a NaN `v` as `0x7FC00000`; for
/// [`super::mode::ADD`], a NaN `o` stays itself (quieted) whatever `v` is: the sum of two
/// NaNs is the first one on x86 and Arm alike, but a vectorised addition may be
/// commuted, so the first operand is chosen explicitly. Every `dct` decode stores so.
#[inline(always)]
pub(crate) fn store<const M: u8>(o: &mut f32, v: f32) {
    let v = canonical(v);
    if M == super::mode::ADD {
        let (a, s) = (*o, *o + v);
        *o = if a.is_nan() { a + 0.0 } else { s };
    } else {
        super::scalar::put::<M>(o, v);
    }
}

/// [`select_impl`] on the first `group` of [`ROWS`] tiles of `N` coefficients at once,
/// with the keys in fixed arrays (registers), each round's winner cleared by a compare,
/// not a store, and the tiles taken round by round: their selections are independent,
/// so the processor overlaps their chains of comparisons (one tile alone waits on each
/// round's maximum). The same choices as one tile at a time.
#[inline(always)]
fn select_rows<const N: usize>(
    out: &mut [[f32; MAX_N]; ROWS],
    group: usize,
    kt: usize,
    chosen: &mut [[u16; SELECT_MAX]; ROWS],
) {
    const { assert!(N <= 64, "positions as bits of a u64") };
    let mut keys = [[0u64; N]; ROWS];
    for (o, k) in out.iter_mut().zip(keys.iter_mut()).take(group) {
        for i in 0..N {
            k[i] = select_key(&mut o[i], i);
        }
    }
    // The chosen positions as bits (N <= 64), read back in increasing order.
    let mut taken = [0u64; ROWS];
    for _ in 0..kt {
        for (k, t) in keys.iter_mut().zip(taken.iter_mut()).take(group) {
            let top = k.iter().copied().fold(0, u64::max);
            for v in k.iter_mut() {
                *v = if *v == top { 0 } else { *v };
            }
            *t |= 1 << (0xFFFF - (top & 0xFFFF));
        }
    }
    for (c, mut t) in chosen.iter_mut().zip(taken).take(group) {
        for o in c[..kt].iter_mut() {
            *o = t.trailing_zeros() as u16;
            t &= t - 1;
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

/// The kept columns of `cols`, in increasing order, into `list`; returns how many. No
/// branch on the data (a few kept among many columns mispredicted nearly every time).
#[inline(always)]
fn kept_columns(cols: &[bool], list: &mut [u8; MAX_N]) -> usize {
    let mut n = 0;
    for (b, &c) in cols.iter().enumerate() {
        list[n] = b as u8;
        n += c as usize;
    }
    n
}

/// [`inverse_rows_impl`] for rows of any width.
#[inline(always)]
fn inverse_rows_any(t: &[f32], cols: &[bool], h: usize, w: usize, x: &mut [f32]) {
    let bw = &tables(w).b;
    let mut list = [0u8; MAX_N];
    let kept = kept_columns(&cols[..w], &mut list);
    for (i, row) in x.chunks_exact_mut(w).enumerate().take(h) {
        row.fill(0.0);
        for &b in &list[..kept] {
            let b = b as usize;
            let c = t[i * w + b];
            let basis_row = &bw[b * w..b * w + w];
            row.iter_mut()
                .zip(basis_row)
                .for_each(|(acc, &q)| *acc += c * q);
        }
    }
}

/// [`inverse_rows_impl`] for rows `W` wide.
#[inline(always)]
fn inverse_rows<const W: usize>(t: &[f32], cols: &[bool], h: usize, x: &mut [f32]) {
    let bw = &tables(W).b;
    let mut list = [0u8; MAX_N];
    let kept = kept_columns(&cols[..W], &mut list);
    for (i, row) in x.chunks_exact_mut(W).enumerate().take(h) {
        let mut acc = [0f32; W];
        for &b in &list[..kept] {
            let b = b as usize;
            let c = t[i * W + b];
            let basis_row: &[f32; W] = bw[b * W..b * W + W].try_into().expect("a basis row");
            for n in 0..W {
                acc[n] += c * basis_row[n];
            }
        }
        row.copy_from_slice(&acc);
    }
}

#[cfg(test)]
mod tests;
