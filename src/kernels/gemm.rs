//! Small dense products for low-rank compression (PowerSGD), on the `matrixmultiply`
//! crate's f32 GEMM.
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

#[cfg(test)]
mod tests {
    use super::*;

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
