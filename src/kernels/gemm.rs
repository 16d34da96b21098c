//! Small dense products for low-rank compression (PowerSGD): the thin products of
//! ranks up to [`THIN_MAX_RANK`] ([`thin_mq`], [`thin_mtp`]: one pass over the gradient,
//! in a stated order, the same bits on every backend), and the `matrixmultiply` crate's
//! f32 GEMM for the rest.
//!
//! `matrixmultiply` is a small, dependency-light GEMM (packing and register-blocked
//! micro-kernels picked at run time for AVX2/FMA, AVX-512 or NEON) that takes any row and
//! column strides, so a transposed operand is a view, not a copy. PowerSGD's products
//! are tall and skinny (an n x m gradient times an m x r matrix, r of 1 to a few dozen):
//! they read the gradient once at memory speed, which is all a heavier linear-algebra
//! crate would give too. Its results may differ in the last bits between CPUs (FMA or
//! not, block order): PowerSGD only ever feeds them to an all-reduce, whose result is the
//! same on every rank, so replicas still agree.

/// A read-only strided view of a row-major buffer: element `(i, j)` is
/// `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    /// The elements.
    pub data: &'a [f32],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Elements between rows.
    pub rs: usize,
    /// Elements between columns.
    pub cs: usize,
}

impl<'a> View<'a> {
    /// The `rows x cols` row-major matrix in `data`.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> View<'a> {
        View {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> View<'a> {
        View {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// Whether every element's index lies inside `data` and the strides fit an isize.
    fn fits(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1).checked_mul(self.rs).and_then(|a| {
            (self.cols - 1)
                .checked_mul(self.cs)
                .and_then(|b| a.checked_add(b))
        });
        matches!(last, Some(l) if l < self.data.len())
            && isize::try_from(self.rs).is_ok()
            && isize::try_from(self.cs).is_ok()
    }
}

/// `c = a b`, with `c` the row-major `a.rows x b.cols` matrix.
///
/// # Panics
/// If the shapes disagree, a view reaches outside its buffer, or `c` has not exactly
/// `a.rows * b.cols` elements (the callers size every buffer from the same shapes).
pub fn matmul(a: View<'_>, b: View<'_>, c: &mut [f32]) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "matmul: inner dimensions differ");
    assert!(
        a.fits() && b.fits(),
        "matmul: a view reaches outside its buffer"
    );
    assert_eq!(Some(c.len()), m.checked_mul(n), "matmul: output size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    // SAFETY: `fits` checked that every element (i, j) of `a` (i < m, j < k) and of `b`
    // (i < k, j < n) lies inside its slice, and the strides fit an isize (so do the
    // casts below); `c` is an exclusively borrowed, densely packed m x n buffer (row
    // stride n, column stride 1: its last index m n - 1 is inside it). `matrixmultiply`
    // reads only those elements, writes only those of `c`, and with beta = 0 does not
    // read `c`. The slices outlive the call and `c` does not overlap `a` or `b` (it is a
    // `&mut`).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Largest rank the thin products take (their accumulators live on the stack); PowerSGD
/// at higher ranks uses [`matmul`].
pub const THIN_MAX_RANK: usize = 8;

/// Accumulators [`thin_mtp`] takes at most at a time (32 KiB of f32, on the stack, so
/// they stay in the first-level cache): a range of columns of `Q = M^T P` at rank `r` is
/// at most `THIN_ACC / r` columns wide.
pub const THIN_ACC: usize = 8192;

/// `$body` with the const `$R` set to the rank `$r` when it is 1 to [`THIN_MAX_RANK`],
/// else `$other`: the thin kernels' ranks as compile-time constants (their sums then
/// live in registers).
macro_rules! by_rank {
    ($r:expr, $R:ident => $body:expr, _ => $other:expr) => {
        match $r {
            1 => {
                const $R: usize = 1;
                $body
            }
            2 => {
                const $R: usize = 2;
                $body
            }
            3 => {
                const $R: usize = 3;
                $body
            }
            4 => {
                const $R: usize = 4;
                $body
            }
            5 => {
                const $R: usize = 5;
                $body
            }
            6 => {
                const $R: usize = 6;
                $body
            }
            7 => {
                const $R: usize = 7;
                $body
            }
            8 => {
                const $R: usize = 8;
                $body
            }
            _ => $other,
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(super) use by_rank;

/// The lanes of a dot product ([`thin_mq_rows`]) added by halves: lane `l` and lane
/// `l + 8`, then `l + 4`, `l + 2`, `l + 1`. Kept out of line: inlined, it led the compiler
/// to split the 16-lane loop into pieces of two lanes.
#[inline(never)]
fn halves(mut acc: [f32; 16]) -> f32 {
    let mut w = 8;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Rows of `P = M Q` without packing `M`: `x` holds whole rows of `M` (`cols` each),
/// `qt` the `r` columns of `Q` back to back (`Q^T`, `r x cols`), and row `i` of `p`
/// (`r` each) gets the dot product of row `i` with each column, in a fixed order: element
/// `j` is added to lane `j % 16` (a rounded product, then a rounded sum: never fused),
/// lanes in order of `j`; then lane `l` and lane `l + 8` are added, and so on by halves
/// (8, 4, 2, 1). The same bits on every CPU and at every SIMD width. With `e` (as long as
/// `x`), the rows first become `x + e` in place (PowerSGD's error-feedback input; the
/// callers pass a piece of the matrix small enough to stay in cache for the products).
#[inline(always)]
pub(super) fn thin_mq_rows(
    x: &mut [f32],
    e: Option<&[f32]>,
    qt: &[f32],
    cols: usize,
    p: &mut [f32],
) {
    if x.is_empty() || p.is_empty() {
        return;
    }
    let r = p.len() / (x.len() / cols).max(1);
    by_rank!(r, R => mq_rows::<R>(x, e, qt, cols, p), _ => {
        panic!("thin_mq: rank {r} above {THIN_MAX_RANK}")
    })
}

/// Elements ahead of the products' reads that they ask the cache for.
const AHEAD: usize = 2048;

/// [`thin_mq_rows`] at rank `R`: the `R` dot products of a row in one pass over it, each
/// in the stated order (lane `l` of product `k` sees the same additions whatever the
/// other products do), so the row is read from memory once and the `R` sums run side by
/// side instead of one dependent chain after another.
#[inline(always)]
fn mq_rows<const R: usize>(
    x: &mut [f32],
    e: Option<&[f32]>,
    qt: &[f32],
    cols: usize,
    p: &mut [f32],
) {
    if let Some(e) = e {
        for (v, &d) in x.iter_mut().zip(e) {
            *v += d;
        }
    }
    let q: [&[f32]; R] = core::array::from_fn(|k| &qt[k * cols..(k + 1) * cols]);
    let full = cols / 16 * 16;
    let qc: [&[[f32; 16]]; R] = core::array::from_fn(|k| q[k][..full].as_chunks::<16>().0);
    for (i, pr) in p.chunks_exact_mut(R).enumerate() {
        let row = &x[i * cols..(i + 1) * cols];
        let mut acc = [[0f32; 16]; R];
        let (rc, rt) = row.as_chunks::<16>();
        for (c, xv) in rc.iter().enumerate() {
            super::prefetch(x, i * cols + c * 16 + AHEAD);
            for k in 0..R {
                let qv = &qc[k][c];
                for l in 0..16 {
                    acc[k][l] += xv[l] * qv[l];
                }
            }
        }
        // The tail as one more block padded with zeros: a lane's sum is never -0 (it
        // starts at +0, and exact cancellation rounds to +0), so adding +0 leaves it.
        let mut tx = [0f32; 16];
        tx[..rt.len()].copy_from_slice(rt);
        for k in 0..R {
            let mut ty = [0f32; 16];
            ty[..rt.len()].copy_from_slice(&q[k][full..]);
            for l in 0..16 {
                acc[k][l] += tx[l] * ty[l];
            }
            pr[k] = halves(acc[k]);
        }
    }
}

/// `acc[k * w + c] = sum over rows i of p[i, k] * m[i, j0 + c]` for `c < w`, rows in order
/// (a rounded product, then a rounded sum): columns `j0..j0 + w` of `Q = M^T P` for the
/// row-major `m` (`cols` wide) and `p` (`r` wide), transposed. Each element's sum runs over
/// the rows in order whatever the columns around it, so any split into column ranges
/// gives the same bits, on every backend.
#[inline(always)]
pub(super) fn thin_mtp_cols(
    m: &[f32],
    cols: usize,
    j0: usize,
    p: &[f32],
    r: usize,
    acc: &mut [f32],
) {
    let w = acc.len() / r;
    acc.fill(0.0);
    let rows = m.len() / cols;
    let seg = |i: usize| &m[i * cols + j0..i * cols + j0 + w];
    // Eight rows at a time, each accumulator loaded and stored once per eight: the same
    // sums, in the same order, as one row at a time.
    let mut i = 0;
    while i + 8 <= rows {
        let s: [&[f32]; 8] = core::array::from_fn(|t| seg(i + t));
        for k in 0..r {
            let pk: [f32; 8] = core::array::from_fn(|t| p[(i + t) * r + k]);
            let acc = &mut acc[k * w..(k + 1) * w];
            for c in 0..w {
                let mut a = acc[c];
                a += pk[0] * s[0][c];
                a += pk[1] * s[1][c];
                a += pk[2] * s[2][c];
                a += pk[3] * s[3][c];
                a += pk[4] * s[4][c];
                a += pk[5] * s[5][c];
                a += pk[6] * s[6][c];
                a += pk[7] * s[7][c];
                acc[c] = a;
            }
        }
        i += 8;
    }
    for i in i..rows {
        let row = seg(i);
        for k in 0..r {
            let pk = p[i * r + k];
            for (a, &v) in acc[k * w..(k + 1) * w].iter_mut().zip(row) {
                *a += pk * v;
            }
        }
    }
}

/// `thin_mq_rows` compiled for the current backend: rows of `P = M Q` (and, with `e`,
/// `M = x + e` formed in place first). `x` holds whole rows of `cols`, `qt` is `Q^T`
/// (`r x cols`), `p` gets `r` values per row.
///
/// # Panics
/// If `r` is above [`THIN_MAX_RANK`] (PowerSGD takes [`matmul`] there).
pub fn thin_mq(x: &mut [f32], e: Option<&[f32]>, qt: &[f32], cols: usize, p: &mut [f32]) {
    super::gemm_thin_mq(x, e, qt, cols, p)
}

/// Rows of `P Q^T` (PowerSGD's reconstruction), `cols` wide: element `b` of row `i` is
/// `((p[i,0] Q[b,0] + p[i,1] Q[b,1]) + ...)` in f32, in that order and never fused, so the
/// same on every CPU; `qt` is `Q^T` (`r` columns of `Q` back to back) and `p` holds `r`
/// values per row. The product goes to `out`. With `e`, the residual `M - P Q^T` goes to
/// `e`, with `M` read from `x`, or from `out` before it is overwritten when `x` is `None`
/// (the gradient reduced in place). One pass over the rows.
#[inline(always)]
pub(super) fn thin_pqt_rows(
    x: Option<&[f32]>,
    out: &mut [f32],
    e: Option<&mut [f32]>,
    p: &[f32],
    qt: &[f32],
    cols: usize,
) {
    if out.is_empty() || p.is_empty() {
        return;
    }
    let r = p.len() / (out.len() / cols).max(1);
    by_rank!(r, R => pqt_rows::<R>(x, out, e, p, qt, cols), _ => {
        pqt_rows_any(r, x, out, e, p, qt, cols)
    })
}

/// [`thin_pqt_rows`] at any rank (above [`THIN_MAX_RANK`]): each row built up in `r`
/// passes over its destination, `k` in order, which gives each element the same sum.
/// Reduced in place with a residual, the product goes to the residual's row first (`M`
/// is still in `out`), then the two are exchanged as `e = M - P Q^T`.
#[inline(always)]
fn pqt_rows_any(
    r: usize,
    x: Option<&[f32]>,
    out: &mut [f32],
    mut e: Option<&mut [f32]>,
    p: &[f32],
    qt: &[f32],
    cols: usize,
) {
    let product = |pa: &[f32], row: &mut [f32]| {
        for (v, &q) in row.iter_mut().zip(&qt[..cols]) {
            *v = pa[0] * q;
        }
        for (k, &pk) in pa.iter().enumerate().skip(1) {
            for (v, &q) in row.iter_mut().zip(&qt[k * cols..(k + 1) * cols]) {
                *v += pk * q;
            }
        }
    };
    let rows = out.chunks_exact_mut(cols).zip(p.chunks_exact(r));
    for (i, (o, pa)) in rows.enumerate() {
        let span = i * cols..(i + 1) * cols;
        match (x, e.as_deref_mut()) {
            (Some(x), Some(e)) => {
                product(pa, o);
                for ((d, &m), &v) in e[span.clone()].iter_mut().zip(&x[span]).zip(&*o) {
                    *d = m - v;
                }
            }
            (None, Some(e)) => {
                let e = &mut e[span];
                product(pa, e);
                for (m, d) in o.iter_mut().zip(e.iter_mut()) {
                    let v = *d;
                    *d = *m - v;
                    *m = v;
                }
            }
            (_, None) => product(pa, o),
        }
    }
}

/// Element `j` of a row of `P Q^T` ([`thin_pqt_rows`]' order; also the x86 streaming
/// kernels' edges).
#[inline(always)]
pub(super) fn pqt_one<const R: usize>(pa: &[f32; R], q: &[&[f32]; R], j: usize) -> f32 {
    let mut v = pa[0] * q[0][j];
    for k in 1..R {
        v += pa[k] * q[k][j];
    }
    v
}

/// [`thin_pqt_rows`] at rank `R`: one loop over a row's elements (the compiler's lanes run
/// along the row), each element's `R` products summed in order.
#[inline(always)]
fn pqt_rows<const R: usize>(
    x: Option<&[f32]>,
    out: &mut [f32],
    mut e: Option<&mut [f32]>,
    p: &[f32],
    qt: &[f32],
    cols: usize,
) {
    for (i, (o, pa)) in out
        .chunks_exact_mut(cols)
        .zip(p.chunks_exact(R))
        .enumerate()
    {
        let pa: &[f32; R] = pa.try_into().expect("R values per row");
        let n = o.len();
        let q: [&[f32]; R] = core::array::from_fn(|k| &qt[k * cols..][..n]);
        let span = i * cols..(i + 1) * cols;
        match (x, e.as_deref_mut()) {
            (Some(x), Some(e)) => {
                let (x, e) = (&x[span.clone()][..n], &mut e[span][..n]);
                for j in 0..n {
                    let v = pqt_one(pa, &q, j);
                    o[j] = v;
                    e[j] = x[j] - v;
                }
            }
            (None, Some(e)) => {
                let e = &mut e[span][..n];
                for j in 0..n {
                    let v = pqt_one(pa, &q, j);
                    e[j] = o[j] - v;
                    o[j] = v;
                }
            }
            (_, None) => {
                for (j, o) in o.iter_mut().enumerate() {
                    *o = pqt_one(pa, &q, j);
                }
            }
        }
    }
}

/// Rows of `P Q^T` (PowerSGD's reconstruction), `cols` wide, into `out`, compiled for the
/// current backend: element `b` of row `i` is `((p[i,0] Q[b,0] + p[i,1] Q[b,1]) + ...)` in
/// f32, in that order and never fused, so the same on every CPU (`qt` is `Q^T`, `p` holds
/// `r` values per row). With `e`, the residual `M - P Q^T` goes to `e` (`M` from `x`, or
/// from `out` before it is overwritten when `x` is `None`). With `stream`, the x86
/// backends write them with non-temporal stores (for matrices larger than the caches: the
/// rows are not read in before being overwritten, nor left dirty in the cache for the
/// next pass to evict); the bits are the same.
pub fn thin_pqt(
    x: Option<&[f32]>,
    out: &mut [f32],
    e: Option<&mut [f32]>,
    p: &[f32],
    qt: &[f32],
    cols: usize,
    stream: bool,
) {
    super::gemm_thin_pqt(x, out, e, p, qt, cols, stream)
}

/// `thin_mtp_cols` compiled for the current backend: columns `j0..j0 + acc.len() / r`
/// of `Q = M^T P`, transposed (`r` rows of them), from the row-major `m` (`cols` wide)
/// and `p` (`r` wide).
pub fn thin_mtp(m: &[f32], cols: usize, j0: usize, p: &[f32], r: usize, acc: &mut [f32]) {
    super::gemm_thin_mtp(m, cols, j0, p, r, acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thin_products_match_the_triple_loop_on_every_backend() {
        // Small integers: every product and sum is exact in f32, whatever the order.
        let (n, m) = (37, 45);
        let x: Vec<f32> = (0..n * m)
            .map(|i| ((i * 7919) % 101) as f32 - 50.0)
            .collect();
        let e: Vec<f32> = (0..n * m).map(|i| ((i * 17) % 7) as f32 - 3.0).collect();
        for r in 1..=THIN_MAX_RANK {
            let q: Vec<f32> = (0..m * r).map(|i| ((i * 31) % 17) as f32 - 8.0).collect();
            let mut qt = vec![0f32; m * r];
            for (b, row) in q.chunks_exact(r).enumerate() {
                for (k, &v) in row.iter().enumerate() {
                    qt[k * m + b] = v;
                }
            }
            let formed: Vec<f32> = x.iter().zip(&e).map(|(a, b)| a + b).collect();
            let want_p = naive(View::rows(&formed, n, m), View::rows(&q, m, r));
            for b in crate::kernels::Backend::available() {
                b.run(|| {
                    let mut xf = x.clone();
                    let mut p = vec![f32::NAN; n * r];
                    thin_mq(&mut xf, Some(&e), &qt, m, &mut p);
                    assert_eq!(xf, formed, "{b}");
                    assert!(
                        p.iter().zip(&want_p).all(|(&a, &b)| f64::from(a) == b),
                        "{b}"
                    );
                    let want_q = naive(View::rows(&formed, n, m).t(), View::rows(&p, n, r));
                    // Two column ranges: [0, 16) and [16, m).
                    for (j0, w) in [(0, 16), (16, m - 16)] {
                        let mut acc = vec![f32::NAN; r * w];
                        thin_mtp(&formed, m, j0, &p, r, &mut acc);
                        for k in 0..r {
                            for c in 0..w {
                                let got = f64::from(acc[k * w + c]);
                                assert_eq!(got, want_q[(j0 + c) * r + k], "{b} r={r}");
                            }
                        }
                    }
                });
            }
        }
    }

    /// A value that rounds when multiplied and added: magnitudes 1e-3 to 1e3, both signs.
    fn rough(i: usize, salt: u32) -> f32 {
        let h = (i as u32)
            .wrapping_mul(2_654_435_761)
            .wrapping_add(salt.wrapping_mul(40_503));
        let h = h ^ (h >> 15);
        let unit = (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
        unit * 10f32.powi((h % 7) as i32 - 3)
    }

    #[test]
    fn thin_products_add_in_their_stated_order_on_every_backend() {
        // Values whose products and sums round, so a changed order changes bits: every
        // backend against the stated order written out in scalar f32.
        // Under Miri (the scalar backend, slowly): fewer rows and ranks.
        let (n, m) = if cfg!(miri) { (3, 37) } else { (21, 45) };
        let x: Vec<f32> = (0..n * m).map(|i| rough(i, 1)).collect();
        let ranks = if cfg!(miri) {
            vec![1, 3, 9]
        } else {
            (1..=THIN_MAX_RANK + 2).collect()
        };
        for r in ranks {
            let p: Vec<f32> = (0..n * r).map(|i| rough(i, 2)).collect();
            let qt: Vec<f32> = (0..m * r).map(|i| rough(i, 3)).collect();
            // Q = M^T P: each element sums over the rows in order, from +0.
            let want_q: Vec<f32> = (0..r * m)
                .map(|kc| {
                    let (k, c) = (kc / m, kc % m);
                    (0..n).fold(0f32, |a, i| a + p[i * r + k] * x[i * m + c])
                })
                .collect();
            // P Q^T: ((p0 q0 + p1 q1) + ...), and the residual M - P Q^T.
            let want_out: Vec<f32> = (0..n * m)
                .map(|ib| {
                    let (i, b) = (ib / m, ib % m);
                    (1..r).fold(p[i * r] * qt[b], |v, k| v + p[i * r + k] * qt[k * m + b])
                })
                .collect();
            let want_e: Vec<f32> = x.iter().zip(&want_out).map(|(a, b)| a - b).collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for b in crate::kernels::Backend::available() {
                b.run(|| {
                    for (j0, w) in [(0, m), (0, 16), (16, m - 16)] {
                        let mut acc = vec![f32::NAN; r * w];
                        thin_mtp(&x, m, j0, &p, r, &mut acc);
                        for k in 0..r {
                            for c in 0..w {
                                let (got, want) = (acc[k * w + c], want_q[k * m + j0 + c]);
                                assert_eq!(got.to_bits(), want.to_bits(), "{b} r={r}");
                            }
                        }
                    }
                    // Plain and streaming stores; `x` and `e` one element off the
                    // output's alignment too, so the residual takes both its stores.
                    for (stream, off) in [(false, 0), (true, 0), (true, 1)] {
                        let xs: Vec<f32> = [0.0].repeat(off).into_iter().chain(x.clone()).collect();
                        let xo = &xs[off..];
                        let mut out = vec![f32::NAN; n * m];
                        let mut es = vec![f32::NAN; n * m + off];
                        thin_pqt(Some(xo), &mut out, Some(&mut es[off..]), &p, &qt, m, stream);
                        assert_eq!(bits(&out), bits(&want_out), "{b} r={r} {stream}");
                        assert_eq!(bits(&es[off..]), bits(&want_e), "{b} r={r} {stream}");
                        let mut out = vec![f32::NAN; n * m];
                        thin_pqt(Some(xo), &mut out, None, &p, &qt, m, stream);
                        assert_eq!(bits(&out), bits(&want_out), "{b} r={r} {stream}");
                        let mut inplace = x.clone();
                        let mut es = vec![f32::NAN; n * m + off];
                        thin_pqt(None, &mut inplace, Some(&mut es[off..]), &p, &qt, m, stream);
                        assert_eq!(bits(&inplace), bits(&want_out), "{b} r={r} {stream}");
                        assert_eq!(bits(&es[off..]), bits(&want_e), "{b} r={r} {stream}");
                        let mut inplace = x.clone();
                        thin_pqt(None, &mut inplace, None, &p, &qt, m, stream);
                        assert_eq!(bits(&inplace), bits(&want_out), "{b} r={r} {stream}");
                    }
                });
            }
        }
    }

    #[test]
    fn dot_products_add_in_their_stated_order() {
        // Values whose sum depends on the order: the lanes' order, written out.
        let a: Vec<f32> = (0..37).map(|i| 1.0 + (i as f32) * 1e-3).collect();
        let b: Vec<f32> = (0..37)
            .map(|i| if i % 3 == 0 { 1e7 } else { -0.3 })
            .collect();
        let mut lanes = [0f32; 16];
        for j in 0..37 {
            lanes[j % 16] += a[j] * b[j];
        }
        let mut w = 8;
        while w > 0 {
            for l in 0..w {
                lanes[l] += lanes[l + w];
            }
            w /= 2;
        }
        for be in crate::kernels::Backend::available() {
            be.run(|| {
                let mut p = [0f32; 1];
                let mut x = a.clone();
                thin_mq(&mut x, None, &b, 37, &mut p);
                assert_eq!(p[0].to_bits(), lanes[0].to_bits(), "{be}");
            });
        }
    }

    /// The plain triple loop in f64.
    fn naive(a: View<'_>, b: View<'_>) -> Vec<f64> {
        let mut c = vec![0f64; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                c[i * b.cols + j] = (0..a.cols)
                    .map(|p| {
                        f64::from(a.data[i * a.rs + p * a.cs])
                            * f64::from(b.data[p * b.rs + j * b.cs])
                    })
                    .sum();
            }
        }
        c
    }

    #[test]
    fn matmul_matches_the_triple_loop_plain_and_transposed() {
        let (n, m, r) = (37, 23, 3);
        let x: Vec<f32> = (0..n * m)
            .map(|i| ((i * 7919) % 101) as f32 - 50.0)
            .collect();
        let q: Vec<f32> = (0..m * r).map(|i| ((i * 31) % 17) as f32 - 8.0).collect();
        let p: Vec<f32> = (0..n * r).map(|i| ((i * 13) % 11) as f32 - 5.0).collect();
        let mut c = vec![f32::NAN; n * r];
        matmul(View::rows(&x, n, m), View::rows(&q, m, r), &mut c);
        // Small integers: every product and sum is exact in f32.
        let want = naive(View::rows(&x, n, m), View::rows(&q, m, r));
        assert!(c.iter().zip(&want).all(|(&a, &b)| f64::from(a) == b));
        let mut d = vec![f32::NAN; m * r];
        matmul(View::rows(&x, n, m).t(), View::rows(&p, n, r), &mut d);
        let want = naive(View::rows(&x, n, m).t(), View::rows(&p, n, r));
        assert!(d.iter().zip(&want).all(|(&a, &b)| f64::from(a) == b));
    }

    #[test]
    fn empty_inner_dimension_gives_zeros() {
        let mut c = vec![f32::NAN; 6];
        matmul(View::rows(&[], 2, 0), View::rows(&[], 0, 3), &mut c);
        assert!(c.iter().all(|&v| v == 0.0));
    }

    #[test]
    #[should_panic(expected = "outside its buffer")]
    fn a_short_buffer_is_refused() {
        let mut c = vec![0f32; 4];
        matmul(
            View::rows(&[1.0; 3], 2, 2),
            View::rows(&[1.0; 4], 2, 2),
            &mut c,
        );
    }
}
