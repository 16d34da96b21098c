//! `codebook`: int8 codes into a 256-entry codebook of bin means per block (the scheme
//! INTELLECT-1 sent its pseudo-gradients with).
//!
//! Spec: `codebook:block=B` (default 65536: the 1 KiB codebook then costs 0.125 bits per
//! element, 8.125 in all).
//!
//! For each block, the mean `mu` and standard deviation `sigma` (f64, summed in 16 lanes) place
//! 256 bins of equal width `w = 12 sigma / 256` on `mu ± 6 sigma`; each element's code is
//! its bin (the bins at the ends also take the tails), and the block's codebook holds the
//! mean of each bin's elements (an empty bin its centre), so decoding is one lookup.
//!
//! Why bin means, not a quantile codebook: the mean of a bin's elements is the value that
//! minimises their squared error, the histogram takes one pass after the moments and no
//! sort (quantiles need a selection per block), and it is the layout INTELLECT-1 uses. A
//! quantile codebook spends its codes evenly on the elements, which suits heavy tails
//! better; uniform bins spend them evenly on the range.
//!
//! Error bounds (per element): within `w = 12 sigma / 256` (plus the f32 rounding of the
//! entry) for an element inside `mu ± 6 sigma` whose bin is not an end bin; at most twice
//! the block's absmax for any element (an end bin also holds the tails). Deterministic:
//! not unbiased, and good with error feedback.
//!
//! A block holding NaN or ±Inf gets a codebook of NaN (`0x7FC00000`) and decodes to NaN
//! in every element. A block whose elements are all equal decodes exactly.

use super::fixed::{self, FixedRate, Layout, by_mode};
use super::{
    EncodeCtx, MAX_BLOCK, Scheme, block_only_codec, block_params, check_block, check_finite_f32s,
    read_block,
};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::Result;
use crate::kernels::codebook::{self as kb, BOOK_BYTES};
use crate::wire::{HEADER_LEN, Header};

block_only_codec!(
    /// int8 codes into a per-block codebook of bin means (see the module docs).
    Codebook,
    Codebook,
    default_block = 65536
);

impl Scheme for Codebook {
    const ID: CodecId = CodecId::Codebook;
    const STAGE: bool = true;
    fixed::fixed_scheme!();

    fn read(h: &Header) -> Result<Codebook> {
        let block = read_block(h)? as u32;
        h.params_zero_from(4)?;
        h.seed_zero()?;
        let c = Codebook {
            block,
            entropy: h.entropy(),
        };
        super::stage::expect_payload(h, &c)?;
        Ok(c)
    }

    fn is_unbiased(&self) -> bool {
        false
    }
}

impl FixedRate for Codebook {
    fn staged(&self) -> bool {
        self.entropy
    }

    fn params(&self) -> [u8; 12] {
        block_params(self.block, 0)
    }

    fn seeded(&self) -> bool {
        false
    }

    fn encode_weight(&self) -> usize {
        8
    }

    fn layout(&self) -> Layout {
        Layout {
            block: self.block as usize,
            scale_bytes: BOOK_BYTES,
            bits: 8,
        }
    }

    fn encode_sections(
        &self,
        x: &[f32],
        _ctx: &EncodeCtx,
        books: &mut [u8],
        codes: &mut [u8],
    ) -> bool {
        crate::kernels::encode_codebook(x, self.block as usize, books, codes)
    }

    fn validate(&self, h: &Header, books: &[u8], _codes: &[u8]) -> Result<()> {
        // Encoders write finite entries or NaN.
        check_finite_f32s(h, books, HEADER_LEN, "codebook entry")
    }

    fn decode_sections(&self, m: u8, books: &[u8], codes: &[u8], out: &mut [f32]) {
        by_mode!(m, M => kb::decode::<M>(books, codes, self.block as usize, out))
    }
}

impl Codebook {
    /// The per-element error bound for a block absmax `absmax`: twice it (an end bin can
    /// hold both an outlier and values near the mean), plus the f32 rounding of entries.
    pub(crate) fn error_bound(&self, absmax: f64) -> f64 {
        2.0 * absmax * (1.0 + 2f64.powi(-20))
    }
}
