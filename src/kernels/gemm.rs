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

/// Columns of `M` that [`thin_mtp`] accumulates at a time (per rank, on the stack).
pub const THIN_COLS: usize = 256;

/// The dot product of `a` and `b` (equal lengths) in a fixed order: element `j` is
/// added to lane `j % 16` (a rounded product, then a rounded sum: never fused), lanes
/// in order of `j`; then lane `l` and lane `l + 8` are added, and so on by halves (8, 4,
/// 2, 1). The same bits on every CPU and at every SIMD width.
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let b = &b[..a.len()];
    let (ac, at) = a.as_chunks::<16>();
    let (bc, bt) = b.as_chunks::<16>();
    for (x, y) in ac.iter().zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    // The tail as one more block padded with zeros: a lane's sum is never -0 (it starts
    // at +0, and exact cancellation rounds to +0), so adding +0 leaves it as it is.
    let (mut tx, mut ty) = ([0f32; 16], [0f32; 16]);
    tx[..at.len()].copy_from_slice(at);
    ty[..bt.len()].copy_from_slice(bt);
    for l in 0..16 {
        acc[l] += tx[l] * ty[l];
    }
    halves(acc)
}

/// The lanes of [`dot_lanes`] added by halves: lane `l` and lane `l + 8`, then `l + 4`,
/// `l + 2`, `l + 1`. Kept out of line: inlined, it led the compiler to split the 16-lane
/// loop above into pieces of two lanes.
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
/// (`r` each) gets the [`dot_lanes`] of row `i` with each column. With `e` (as long as
/// `x`), each row first becomes `x + e` in place (PowerSGD's error-feedback input), while
/// it is in cache. The same bits on every backend.
#[inline(always)]
pub(super) fn thin_mq_rows(
    x: &mut [f32],
    e: Option<&[f32]>,
    qt: &[f32],
    cols: usize,
    p: &mut [f32],
) {
    let r = p.len() / (x.len() / cols).max(1);
    for (i, row) in x.chunks_exact_mut(cols).enumerate() {
        if let Some(e) = e {
            for (v, &d) in row.iter_mut().zip(&e[i * cols..(i + 1) * cols]) {
                *v += d;
            }
        }
        for k in 0..r {
            p[i * r + k] = dot_lanes(row, &qt[k * cols..(k + 1) * cols]);
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
    // Four rows at a time, each accumulator loaded and stored once per four: the same
    // sums, in the same order, as one row at a time.
    let mut i = 0;
    while i + 4 <= rows {
        let (r0, r1, r2, r3) = (seg(i), seg(i + 1), seg(i + 2), seg(i + 3));
        for k in 0..r {
            let (p0, p1, p2, p3) = (
                p[i * r + k],
                p[(i + 1) * r + k],
                p[(i + 2) * r + k],
                p[(i + 3) * r + k],
            );
            let acc = &mut acc[k * w..(k + 1) * w];
            for c in 0..w {
                let mut a = acc[c];
                a += p0 * r0[c];
                a += p1 * r1[c];
                a += p2 * r2[c];
                a += p3 * r3[c];
                acc[c] = a;
            }
        }
        i += 4;
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
pub fn thin_mq(x: &mut [f32], e: Option<&[f32]>, qt: &[f32], cols: usize, p: &mut [f32]) {
    super::gemm_thin_mq(x, e, qt, cols, p)
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

    #[test]
    fn dot_lanes_adds_in_its_stated_order() {
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
