//! The hot loops, by operation.
//!
//! `scalar` is the oracle and the fallback (DESIGN rule 1): every kernel has a plain
//! scalar version, and any vectorised backend must produce byte-identical frames and
//! bit-identical decoded floats. Codecs in `crate::codecs` compose these kernels; they
//! hold parameters and layout, not arithmetic.
//!
//! This module is the only place where `unsafe` may appear (for `core::arch` intrinsics),
//! and every such block must carry a `// SAFETY:` comment.

pub mod scalar;
