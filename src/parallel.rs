//! Parallel encode, decode and error feedback for large tensors (feature `rayon`, on by
//! default).
//!
//! A fixed-rate codec's payload splits at block boundaries into independent pieces: each
//! range of whole blocks (and whole code bytes) has its own scales and codes, and its
//! random draws depend only on the global element index. So a tensor of at least
//! [`min_len`] elements is cut into ranges of [`CHUNK`] elements (rounded to whole blocks),
//! and the ranges are encoded or decoded on rayon's thread pool. The frame is
//! byte-identical to the sequential one for every thread count, because the ranges, and
//! so the work each piece does, do not depend on how many threads run them. The
//! threshold is weighted by the operation's cost (see [`DEFAULT_MIN_LEN`]).
//!
//! Random-k's payload layout depends on how many elements each range keeps: its encode
//! counts the ranges' kept elements in parallel first (their counts on the stack), then
//! encodes each range into its own part of the payload, in parallel. Top-k collects its
//! candidates in parallel (up to 64 pieces, each with an equal share of the working room,
//! a piece that overflows its share counting on and completing its candidates in a second
//! step), then selects and writes the frame on one thread: the candidates, and so the
//! frame, are the same for every split.
//!
//! The work runs on the current rayon pool: the global one (sized by `RAYON_NUM_THREADS`)
//! or whichever pool the caller `install`s. With one thread, or without the `rayon`
//! feature, everything is sequential.

use core::sync::atomic::{AtomicUsize, Ordering};

/// Elements per parallel range, before rounding to whole blocks and code bytes.
pub const CHUNK: usize = 1 << 16;

/// Default of [`min_len`], in elements times the operation's relative cost in
/// half-decodes: decodes and the memory-speed encoders (identity, fp16, bf16) split from
/// 1 Mi elements, sign encode from 2 Mi, int8 from 512 Ki, the stochastic encoders from
/// 256 Ki, and an error-feedback step at half its encoder's length. Handing work to the pool costs about 10 us here, and below these
/// sizes the fast operations did not reliably gain on this machine's 2 cores
/// (docs/benchmarks.md).
pub const DEFAULT_MIN_LEN: usize = 1 << 21;

static MIN_LEN: AtomicUsize = AtomicUsize::new(DEFAULT_MIN_LEN);

/// The weighted length (elements times relative cost) from which encode, decode and error
/// feedback run in parallel.
pub fn min_len() -> usize {
    MIN_LEN.load(Ordering::Relaxed)
}

/// Set the weighted length from which encode, decode and error feedback run in parallel
/// (0: every tensor longer than [`CHUNK`]; `usize::MAX`: never). Results do not change,
/// only speed.
pub fn set_min_len(n: usize) {
    MIN_LEN.store(n, Ordering::Relaxed);
}

/// Whether an operation on `n` elements of relative cost `weight` per element (2 for a
/// decode) is split across threads: when `n * weight >= min_len()`.
pub(crate) fn worth(n: usize, weight: usize) -> bool {
    #[cfg(feature = "rayon")]
    {
        n.saturating_mul(weight) >= min_len() && n > CHUNK && rayon::current_num_threads() > 1
    }
    #[cfg(not(feature = "rayon"))]
    {
        let _ = (n, weight);
        false
    }
}

/// The threads of the current pool (1 without the `rayon` feature).
pub(crate) fn threads() -> usize {
    #[cfg(feature = "rayon")]
    {
        rayon::current_num_threads()
    }
    #[cfg(not(feature = "rayon"))]
    {
        1
    }
}

/// Runs `f` on a thread of the current pool: a caller outside the pool hands the whole of
/// `f` over once, so that the parallel steps inside it start from a worker (cheaply)
/// instead of each handing its work over (tens of microseconds each on a virtual machine).
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    #[cfg(feature = "rayon")]
    if rayon::current_thread_index().is_none() {
        // A pool thread's floating-point mode is whatever its creator had.
        return rayon::join(|| crate::kernels::Standard::run(f), || ()).0;
    }
    f()
}

/// Runs `a` on the current pool while `b` runs on this thread, and returns both results
/// (`b`, then `a`, unless `par`, with one thread, without the `rayon` feature, and under
/// Miri, whose borrow checks rayon's pool does not pass). For work that can go on while
/// this thread waits: a decode while a collective's messages are in flight.
pub(crate) fn alongside<A: Send, B>(
    par: bool,
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B,
) -> (A, B) {
    #[cfg(all(feature = "rayon", not(miri)))]
    if par && rayon::current_num_threads() > 1 {
        let mut ra = None;
        let rb = rayon::in_place_scope(|s| {
            // A pool thread's floating-point mode is whatever its creator had.
            s.spawn(|_| ra = Some(crate::kernels::Standard::run(a)));
            b()
        });
        return (ra.expect("the scope waits for its task"), rb);
    }
    let _ = par;
    let rb = b();
    (a(), rb)
}

/// A bundle of slices that cut at a range boundary: `split(at, pieces)` cuts after `at`
/// elements, which are `pieces` whole ranges.
pub(crate) trait Split: Sized + Send {
    fn split(self, at: usize, pieces: usize) -> (Self, Self);
}

/// Runs `f(bundle, start)` on consecutive ranges of `range` elements of an `n`-element
/// bundle (the last may be shorter), `start` being each range's first element, in
/// parallel when `par`; returns whether any call returned true.
pub(crate) fn for_ranges<B: Split>(
    b: B,
    n: usize,
    range: usize,
    par: bool,
    f: &(impl Fn(B, usize) -> bool + Sync),
) -> bool {
    if par {
        halves(b, 0, n, range, f)
    } else {
        let mut any = false;
        let (mut b, mut start) = (b, 0);
        while n - start > range {
            let (head, tail) = b.split(range, 1);
            any |= f(head, start);
            b = tail;
            start += range;
        }
        f(b, start) | any
    }
}

#[cfg(feature = "rayon")]
fn halves<B: Split>(
    b: B,
    start: usize,
    n: usize,
    range: usize,
    f: &(impl Fn(B, usize) -> bool + Sync),
) -> bool {
    let pieces = n.div_ceil(range);
    if pieces <= 1 {
        return f(b, start);
    }
    let left = pieces / 2;
    let at = left * range;
    let (l, r) = b.split(at, left);
    // A pool thread's floating-point mode is whatever its creator had.
    let (a, c) = rayon::join(
        || crate::kernels::Standard::run(|| halves(l, start, at, range, f)),
        || crate::kernels::Standard::run(|| halves(r, start + at, n - at, range, f)),
    );
    a | c
}

#[cfg(not(feature = "rayon"))]
fn halves<B: Split>(
    b: B,
    start: usize,
    n: usize,
    range: usize,
    f: &(impl Fn(B, usize) -> bool + Sync),
) -> bool {
    let _ = start;
    for_ranges(b, n, range, false, f)
}

/// Runs `f` on every item, on the current pool's threads when `par` (halving the list,
/// as [`for_ranges`] halves ranges).
pub(crate) fn each_mut<T: Send>(items: &mut [T], par: bool, f: &(impl Fn(&mut T) + Sync)) {
    #[cfg(feature = "rayon")]
    if par && items.len() > 1 {
        let (a, b) = items.split_at_mut(items.len() / 2);
        // A pool thread's floating-point mode is whatever its creator had.
        rayon::join(
            || crate::kernels::Standard::run(|| each_mut(a, true, f)),
            || crate::kernels::Standard::run(|| each_mut(b, true, f)),
        );
        return;
    }
    let _ = par;
    items.iter_mut().for_each(f);
}

impl Split for &mut [f32] {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        self.split_at_mut(at)
    }
}

impl Split for &[f32] {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        self.split_at(at)
    }
}

impl<T: Sync> Split for (&[T], &[f32]) {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (r0, r1) = self.0.split_at(at);
        let (g0, g1) = self.1.split_at(at);
        ((r0, g0), (r1, g1))
    }
}

impl Split for (&mut [f32], &[f32]) {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (r0, r1) = self.0.split_at_mut(at);
        let (g0, g1) = self.1.split_at(at);
        ((r0, g0), (r1, g1))
    }
}

/// [`crate::kernels::feedback_form`] over a whole tensor, in parallel when large.
pub(crate) fn feedback_form(r: &mut [f32], g: &[f32], beta: f32, gamma: f32) {
    let n = r.len();
    for_ranges((r, g), n, CHUNK, worth(n, 2), &|(r, g), _| {
        crate::kernels::feedback_form(r, g, beta, gamma);
        false
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both results come back, and with more than one thread the two halves run at once:
    /// `b` waits until `a` has started (it would wait forever if `a` ran after it).
    #[test]
    fn alongside_returns_both_and_overlaps() {
        use std::sync::atomic::AtomicBool;
        for par in [false, true] {
            let (a, b) = alongside(par, || 2 + 2, || "b");
            assert_eq!((a, b), (4, "b"));
        }
        if cfg!(miri) || threads() < 2 {
            println!("SKIP overlap: one thread in the pool, or Miri (sequential there)");
            return;
        }
        let started = AtomicBool::new(false);
        let (_, waited) = alongside(
            true,
            || started.store(true, Ordering::SeqCst),
            || {
                let t = std::time::Instant::now();
                while !started.load(Ordering::SeqCst) {
                    assert!(t.elapsed().as_secs() < 30, "a never ran alongside b");
                    std::thread::yield_now();
                }
                true
            },
        );
        assert!(waited);
    }
}
