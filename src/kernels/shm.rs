//! A file mapped into memory that several processes share: the storage under
//! [`crate::collective::shm::SharedMemory`]. It lives here because reading and writing
//! memory that another process changes at the same time needs raw pointers, and this
//! module tree is the crate's one place for `unsafe`.
//!
//! Every access is bounds-checked. Which bytes a process may touch when is the business
//! of the protocol above (single-producer, single-consumer rings whose positions are
//! published with release stores and read with acquire loads); this layer only promises
//! that no access leaves the mapping and that positions are read and written atomically.

use std::fs::File;
use std::io;
use std::sync::atomic::AtomicU64;

/// A whole file mapped shared, read and write.
#[derive(Debug)]
pub(crate) struct Mapped {
    map: memmap2::MmapRaw,
}

impl Mapped {
    /// Map all of `file` (opened for reading and writing; not empty).
    pub(crate) fn new(file: &File) -> io::Result<Mapped> {
        let map = memmap2::MmapOptions::new().map_raw(file)?;
        Ok(Mapped { map })
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// That `bytes` bytes at `offset` (a multiple of `align`) lie inside the mapping.
    fn check(&self, offset: usize, bytes: usize, align: usize) {
        assert!(
            offset.is_multiple_of(align)
                && offset.checked_add(bytes).is_some_and(|e| e <= self.len()),
            "shared access of {bytes} bytes at {offset} (alignment {align}) outside a mapping of {} bytes",
            self.len()
        );
    }

    /// The little-endian u64 at `offset` as an atomic.
    ///
    /// # Panics
    /// If `offset` is not a multiple of 8 or the word does not lie inside the mapping
    /// (offsets come from the protocol's fixed layout, never from a peer).
    pub(crate) fn atomic(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8, 8);
        // SAFETY: the mapping starts on a page boundary and `offset` is a multiple of 8,
        // so the pointer is aligned for u64; the 8 bytes lie inside the mapping (checked
        // above), which lives as long as `self`, so the reference cannot outlive it.
        // AtomicU64 has the size and alignment of u64, and every process accesses these
        // words only through atomics, so no non-atomic access races with them.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(offset).cast::<u64>()) }
    }

    /// Copy `src` into the mapping at `offset`.
    ///
    /// # Panics
    /// If the range does not lie inside the mapping.
    pub(crate) fn write(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len(), 1);
        // SAFETY: the destination range lies inside the mapping (checked above), which is
        // valid for writes while `self` lives, and cannot overlap `src`, a Rust slice
        // outside it. The ring protocol gives this range to the writer alone until it
        // publishes it with a release store, so no reader copies it concurrently.
        unsafe {
            core::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                src.len(),
            );
        }
    }

    /// Copy from the mapping at `offset` into `dst`.
    ///
    /// # Panics
    /// If the range does not lie inside the mapping.
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len(), 1);
        // SAFETY: the source range lies inside the mapping (checked above), valid for
        // reads while `self` lives; `dst` is a distinct Rust slice. The ring protocol
        // hands this range to the reader only after the writer's release store of it
        // (the reader's acquire load came first), and the writer does not touch it again
        // until the reader releases it.
        unsafe {
            core::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
    }

    /// Copy (`add` false) or add, element by element in f32 (`add` true), the f32 values
    /// at `offset` (a multiple of 4) into `out`.
    ///
    /// # Panics
    /// If `offset` is not a multiple of 4 or the values do not lie inside the mapping.
    pub(crate) fn read_f32(&self, offset: usize, out: &mut [f32], add: bool) {
        self.check(offset, out.len().saturating_mul(4), 4);
        // SAFETY: the mapping starts on a page boundary and `offset` is a multiple of 4,
        // so the pointer is aligned for f32; the values lie inside the mapping (checked
        // above), which lives while `self` does, and every bit pattern is an f32. The
        // two-level all-reduce's barriers keep every writer of this range out until every
        // reader has passed the next barrier, so nothing writes it while the slice lives.
        let src = unsafe {
            core::slice::from_raw_parts(self.map.as_ptr().add(offset).cast::<f32>(), out.len())
        };
        if add {
            out.iter_mut().zip(src).for_each(|(o, &v)| *o += v);
        } else {
            out.copy_from_slice(src);
        }
    }
}
