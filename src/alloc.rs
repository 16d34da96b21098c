//! Allocation that is checked before it is made: a size the caller or a frame chose
//! becomes an [`Error::OutOfMemory`] when it cannot be had, never an abort.

use crate::error::{Error, Result};

/// A vector of `n` copies of `value`, or an error naming `what` if the memory cannot be
/// reserved (or its size overflows).
pub(crate) fn filled<T: Clone>(n: usize, value: T, what: &'static str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        bytes: (n as u64).saturating_mul(core::mem::size_of::<T>() as u64),
        what,
    })?;
    v.resize(n, value);
    Ok(v)
}

/// `buf` lengthened to at least `len` elements (new ones zero), its memory reserved
/// first: an error naming `what` if it cannot be had.
pub(crate) fn lengthen<T: Clone + Default>(
    buf: &mut Vec<T>,
    len: usize,
    what: &'static str,
) -> Result<()> {
    if buf.len() < len {
        buf.try_reserve_exact(len - buf.len())
            .map_err(|_| Error::OutOfMemory {
                bytes: (len as u64).saturating_mul(core::mem::size_of::<T>() as u64),
                what,
            })?;
        buf.resize(len, T::default());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors() {
        for n in [usize::MAX, usize::MAX / 4, 1 << 62] {
            let e = filled(n, 0f32, "a test").unwrap_err();
            assert!(
                matches!(e, Error::OutOfMemory { what: "a test", .. }),
                "{e}"
            );
        }
        assert_eq!(filled(3, 7u8, "x").unwrap(), vec![7, 7, 7]);
    }
}
