//! The floating-point mode gradpack computes in: subnormals kept, whatever the caller set.
//!
//! A thread may flush subnormal results to zero and read subnormal inputs as zero: FTZ
//! and DAZ in x86's MXCSR, FZ (and FZ16) in Arm's FPCR. Frameworks set them
//! (`torch.set_flush_denormal(True)`), threads created afterwards inherit them, and every
//! float operation of a kernel would then round differently from the spec on subnormal
//! values, so a rank that flushes would silently diverge from the others.
//!
//! [`Standard`] clears those bits for its lifetime and restores the caller's mode when
//! dropped. Every public operation that does float arithmetic holds one (the codecs'
//! encode, decode and decode_add, error feedback, the fused reduction, the collectives
//! and the sync engine), and so does every task handed to the thread pool, whose threads
//! may have been created under any mode. Reading the mode costs a few cycles; it is
//! written only when a flush bit is set, so callers in the standard mode pay one read per
//! operation. Nested guards find the mode already standard and write nothing.
//!
//! The rounding mode is left as it is: Rust itself assumes round-to-nearest-even, so a
//! caller that changed it has broken more than gradpack.

/// MXCSR bits: DAZ (6) and FTZ (15).
#[cfg(all(target_arch = "x86_64", not(miri)))]
const FLUSH: u32 = (1 << 6) | (1 << 15);

/// FPCR bits: FZ16 (19) and FZ (24).
#[cfg(all(target_arch = "aarch64", not(miri)))]
const FLUSH: u64 = (1 << 19) | (1 << 24);

/// The control register's value at the guard's creation, when it had to be changed.
#[cfg(all(target_arch = "x86_64", not(miri)))]
type Saved = u32;
#[cfg(all(target_arch = "aarch64", not(miri)))]
type Saved = u64;
#[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri))))]
type Saved = ();

#[cfg(all(target_arch = "x86_64", not(miri)))]
#[inline(always)]
fn read() -> u32 {
    let mut csr = 0u32;
    // SAFETY: `stmxcsr` stores the 4-byte MXCSR to the address given, which is that of a
    // live local `u32`; it changes no register or flag.
    unsafe {
        core::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
    }
    csr
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
#[inline(always)]
fn write(csr: u32) {
    // SAFETY: `ldmxcsr` loads MXCSR from a live local; the values written are the
    // caller's own MXCSR with only the FTZ/DAZ bits changed, or that value restored, so
    // every bit it sets is one the CPU accepted before (no reserved bit, no fault).
    unsafe {
        core::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags));
    }
}

#[cfg(all(target_arch = "aarch64", not(miri)))]
#[inline(always)]
fn read() -> u64 {
    let fpcr: u64;
    // SAFETY: reading FPCR has no side effect and is allowed at EL0.
    unsafe {
        core::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack, preserves_flags));
    }
    fpcr
}

#[cfg(all(target_arch = "aarch64", not(miri)))]
#[inline(always)]
fn write(fpcr: u64) {
    // SAFETY: writing FPCR is allowed at EL0; the value is the caller's FPCR with only the
    // FZ/FZ16 bits changed, or that value restored.
    unsafe {
        core::arch::asm!("msr fpcr, {}", in(reg) fpcr, options(nostack, preserves_flags));
    }
}

/// Subnormals kept (no flush to zero, no inputs read as zero) until dropped, then the
/// caller's mode back. See the module documentation.
#[must_use = "the mode is restored when the guard is dropped"]
pub struct Standard {
    // Read by `drop` where there is a mode register (not elsewhere, nor under Miri).
    #[cfg_attr(
        not(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri))),
        allow(dead_code)
    )]
    saved: Option<Saved>,
}

impl Standard {
    /// Clear the flush bits of this thread's floating-point mode, if any is set.
    #[inline]
    pub fn new() -> Standard {
        #[cfg(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri)))]
        {
            let mode = read();
            if mode & FLUSH != 0 {
                write(mode & !FLUSH);
                return Standard { saved: Some(mode) };
            }
        }
        Standard { saved: None }
    }

    /// Run `f` in the standard mode. `f` runs in a call the compiler cannot move float
    /// arithmetic out of, so none of it happens before the mode is set or after it is
    /// restored.
    #[inline]
    pub fn run<R>(f: impl FnOnce() -> R) -> R {
        let _g = Standard::new();
        call(f)
    }
}

impl Default for Standard {
    fn default() -> Self {
        Standard::new()
    }
}

impl Drop for Standard {
    #[inline]
    fn drop(&mut self) {
        #[cfg(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri)))]
        if let Some(mode) = self.saved {
            write(mode);
        }
    }
}

#[inline(never)]
fn call<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Set or clear this thread's flush-to-zero and subnormals-are-zero bits (FTZ and DAZ on
/// x86-64, FZ and FZ16 on aarch64), as a framework would; for tests. Returns whether the
/// target has such bits (false elsewhere and under Miri, where nothing changes).
pub fn set_flush_subnormals(on: bool) -> bool {
    #[cfg(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri)))]
    {
        let mode = read();
        write(if on { mode | FLUSH } else { mode & !FLUSH });
        true
    }
    #[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri))))]
    {
        let _ = on;
        false
    }
}

/// Whether this thread flushes subnormals now (for tests).
pub fn flushes_subnormals() -> bool {
    #[cfg(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri)))]
    {
        read() & FLUSH != 0
    }
    #[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri))))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_keeps_subnormals_and_restores_the_mode() {
        if !set_flush_subnormals(true) {
            return;
        }
        let tiny = core::hint::black_box(f32::MIN_POSITIVE);
        let half = core::hint::black_box(0.5f32);
        // Flushing: a subnormal product is zero.
        assert_eq!(core::hint::black_box(tiny * half), 0.0);
        let kept = Standard::run(|| core::hint::black_box(tiny) * core::hint::black_box(half));
        assert_eq!(kept.to_bits(), 0x0040_0000);
        assert!(flushes_subnormals(), "the caller's mode is back");
        {
            let _g = Standard::new();
            assert!(!flushes_subnormals());
            let _inner = Standard::new();
            assert!(!flushes_subnormals());
        }
        assert!(flushes_subnormals());
        set_flush_subnormals(false);
        assert!(!flushes_subnormals());
    }
}
