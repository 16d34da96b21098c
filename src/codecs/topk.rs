//! `topk`: the `k` elements of largest magnitude, with delta-coded, bit-packed indices.
//!
//! `k` is `ceil(ratio * n)` or a fixed count (at most `n`). Selection is exact: the k-th
//! largest magnitude is found by a radix select on |x| bit patterns (no allocation), and
//! ties at that magnitude keep the lowest indices. Kept elements are sent in index order.
//!
//! Payload: `k` values (f32 LE, or fp16 LE rounded to nearest even), then the `k` index
//! gaps as an LSB-first stream of `width`-bit values: the first gap is the first index,
//! each next gap is `index - previous index - 1`, and `width` is the fewest bits that hold
//! the largest gap (0 when all gaps are 0). Unsent elements decode to 0.
//!
//! Error: kept elements are exact (f32) or fp16-rounded; dropped elements lose their whole
//! value, which is why top-k is used with error feedback. Biased.
//!
//! NaN and ±Inf have the largest magnitudes (NaN above Inf), so they are always kept and
//! decode as themselves; with fp16 values, a finite value above 65504 becomes ±Inf.
//! With `k = 0` nothing is kept: the header's NONFINITE flag is then their only trace.
//! A frame holds at most 2^32 elements (indices are 32-bit): chunk larger tensors.

use core::fmt;

use super::{EncodeCtx, Encoded, Scheme, expect_payload, sparse_prepare};
use crate::codec::{Args, CodecId, CodecSpec, payload_buf};
use crate::error::{Error, Result};
use crate::kernels::{
    self,
    scalar::{self, BitReader, BitWriter, INF_BITS, mag_key, put},
};
use crate::wire::{self, HEADER_LEN, Header};

/// Largest element count of a top-k frame.
pub const TOPK_MAX_ELEMENTS: u64 = 1 << 32;

/// How sparse-codec values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ValueType {
    /// f32 LE (exact).
    #[default]
    F32,
    /// IEEE binary16 LE, round to nearest even.
    Fp16,
}

impl ValueType {
    pub(crate) fn bytes(self) -> u64 {
        match self {
            ValueType::F32 => 4,
            ValueType::Fp16 => 2,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            ValueType::F32 => "f32",
            ValueType::Fp16 => "fp16",
        }
    }

    pub(crate) fn parse(a: &mut Args) -> core::result::Result<ValueType, String> {
        Ok(match a.choice("values", "f32", &["f32", "fp16"])? {
            "fp16" => ValueType::Fp16,
            _ => ValueType::F32,
        })
    }

    pub(crate) fn from_byte(h: &Header, b: u8) -> Result<ValueType> {
        match b {
            0 => Ok(ValueType::F32),
            1 => Ok(ValueType::Fp16),
            _ => Err(Error::BadField {
                codec: h.codec,
                field: "params.values",
                reason: format!("{b} is not 0 (f32) or 1 (fp16)"),
            }),
        }
    }

    /// Write value `j`.
    #[inline]
    pub(crate) fn put(self, vals: &mut [u8], j: usize, v: f32) {
        match self {
            ValueType::F32 => vals[4 * j..4 * j + 4].copy_from_slice(&v.to_le_bytes()),
            ValueType::Fp16 => {
                vals[2 * j..2 * j + 2].copy_from_slice(&scalar::f32_to_f16(v).to_le_bytes())
            }
        }
    }

    /// Read value `j`.
    #[inline]
    pub(crate) fn get(self, vals: &[u8], j: usize) -> f32 {
        match self {
            ValueType::F32 => {
                f32::from_le_bytes(vals[4 * j..4 * j + 4].try_into().expect("4 bytes"))
            }
            ValueType::Fp16 => {
                scalar::f16_to_f32(u16::from_le_bytes([vals[2 * j], vals[2 * j + 1]]))
            }
        }
    }
}

/// How many elements top-k keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TopKSelect {
    /// `ceil(ratio * n)` elements, ratio in (0, 1].
    Ratio(f64),
    /// A fixed count (capped at `n`).
    Count(u64),
}

/// Exact top-k by magnitude.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopK {
    select: TopKSelect,
    values: ValueType,
}

impl Default for TopK {
    fn default() -> Self {
        TopK {
            select: TopKSelect::Ratio(0.01),
            values: ValueType::F32,
        }
    }
}

impl TopK {
    /// Top-k keeping `select` elements, values stored as `values`.
    pub fn new(select: TopKSelect, values: ValueType) -> Result<TopK> {
        if let TopKSelect::Ratio(r) = select
            && !(r > 0.0 && r <= 1.0)
        {
            return Err(Error::Param {
                codec: CodecId::TopK,
                name: "ratio",
                reason: format!("{r} is not in (0, 1]"),
            });
        }
        Ok(TopK { select, values })
    }

    /// How many elements are kept.
    pub fn select(&self) -> TopKSelect {
        self.select
    }

    /// How values are stored.
    pub fn values(&self) -> ValueType {
        self.values
    }

    /// Elements kept out of `n`.
    pub fn k_for(&self, n: u64) -> u64 {
        match self.select {
            TopKSelect::Ratio(r) => ((r * n as f64).ceil() as u64).min(n),
            TopKSelect::Count(c) => c.min(n),
        }
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<TopK, String> {
        let ratio = a.ratio("ratio")?;
        let count = a.take("k");
        let select = match (ratio, count) {
            (Some(_), Some(_)) => return Err("give either `ratio` or `k`, not both".into()),
            (Some(r), None) => TopKSelect::Ratio(r),
            (None, Some(k)) => TopKSelect::Count(
                k.parse::<u64>()
                    .map_err(|_| format!("`k={k}`: expected a non-negative integer"))?,
            ),
            (None, None) => TopKSelect::Ratio(0.01),
        };
        let values = ValueType::parse(a)?;
        Ok(TopK { select, values })
    }
}

impl fmt::Display for TopK {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.select {
            TopKSelect::Ratio(r) => write!(f, "topk:ratio={r}")?,
            TopKSelect::Count(k) => write!(f, "topk:k={k}")?,
        }
        write!(f, ",values={}", self.values.name())
    }
}

impl From<TopK> for CodecSpec {
    fn from(c: TopK) -> CodecSpec {
        CodecSpec::TopK(c)
    }
}

/// Bits needed to hold `v` (0 for 0).
fn bit_width(v: u64) -> u32 {
    64 - v.leading_zeros()
}

/// Call `f(index)` for each kept element in index order: keys above `t`, then the first
/// `need_eq` keys equal to `t`.
#[inline]
fn for_each_kept(x: &[f32], t: u32, mut need_eq: usize, mut f: impl FnMut(usize)) {
    let candidates = |pos: usize, idx: &mut [u32]| kernels::filter_mag_ge(&x[pos..], t, idx);
    kernels::for_each_filtered(x.len(), candidates, |i| {
        if mag_key(x[i]) > t {
            f(i);
        } else if need_eq > 0 {
            need_eq -= 1;
            f(i);
        }
    });
}

impl Scheme for TopK {
    const ID: CodecId = CodecId::TopK;

    fn check_elements(&self, n: u64) -> Result<()> {
        if n > TOPK_MAX_ELEMENTS {
            return Err(Error::Param {
                codec: CodecId::TopK,
                name: "elements",
                reason: format!(
                    "{n} elements exceed the top-k frame limit of 2^32; chunk the tensor"
                ),
            });
        }
        Ok(())
    }

    fn max_payload(&self, n: u64) -> u64 {
        let k = self.k_for(n);
        let w = bit_width(n.saturating_sub(1)) as u64;
        wire::mul_add(
            k,
            self.values.bytes(),
            wire::packed_len(k, w).unwrap_or(u64::MAX),
        )
        .unwrap_or(u64::MAX)
    }

    fn encode_payload(&self, x: &[f32], _ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
        let n = x.len() as u64;
        let k = self.k_for(n) as usize;
        let mut params = [0u8; 12];
        params[0..8].copy_from_slice(&(k as u64).to_le_bytes());
        params[8] = self.values as u8;
        if k == 0 {
            payload_buf(out, 0)?;
            return Ok(Encoded {
                payload_len: 0,
                params,
                // Nothing is kept, so the flag is the only trace of a NaN or Inf.
                nonfinite: x.iter().any(|v| !v.is_finite()),
                seed: 0,
            });
        }
        let t = scalar::kth_largest_key(x, k);
        let above = x.iter().filter(|&&v| mag_key(v) > t).count();
        let need_eq = k - above;
        // Pass A: widest gap and largest kept key.
        let (mut prev, mut max_gap, mut max_key) = (None::<usize>, 0u64, 0u32);
        for_each_kept(x, t, need_eq, |i| {
            let gap = match prev {
                None => i,
                Some(p) => i - p - 1,
            } as u64;
            max_gap = max_gap.max(gap);
            max_key = max_key.max(mag_key(x[i]));
            prev = Some(i);
        });
        let w = bit_width(max_gap);
        let vbytes = k as u64 * self.values.bytes();
        let len = vbytes + wire::packed_len(k as u64, w as u64).expect("k < 2^32");
        let p = payload_buf(out, len)?;
        let (vals, idx) = p.split_at_mut(vbytes as usize);
        idx.fill(0);
        // Pass B: values and gaps.
        let mut bw = BitWriter::new(idx);
        let (mut j, mut prev) = (0usize, None::<usize>);
        let values = self.values;
        for_each_kept(x, t, need_eq, |i| {
            values.put(vals, j, x[i]);
            let gap = match prev {
                None => i,
                Some(p) => i - p - 1,
            };
            bw.put(gap as u32, w);
            prev = Some(i);
            j += 1;
        });
        bw.finish();
        params[9] = w as u8;
        Ok(Encoded {
            payload_len: len,
            params,
            nonfinite: max_key >= INF_BITS,
            seed: 0,
        })
    }

    fn read(h: &Header) -> Result<TopK> {
        let bad = |field, reason: String| Error::BadField {
            codec: h.codec,
            field,
            reason,
        };
        if h.elements > TOPK_MAX_ELEMENTS {
            return Err(bad(
                "elements",
                format!("{} exceeds the top-k limit of 2^32", h.elements),
            ));
        }
        let k = h.param_u64(0);
        if k > h.elements {
            return Err(bad(
                "params.k",
                format!("k = {k} exceeds the element count {}", h.elements),
            ));
        }
        let values = ValueType::from_byte(h, h.params[8])?;
        let w = h.params[9] as u64;
        if w > 32 || (k == 0 && w != 0) {
            return Err(bad(
                "params.width",
                format!("index width {w} is not in 0..=32 (and 0 when k = 0)"),
            ));
        }
        h.params_zero_from(10)?;
        h.seed_zero()?;
        let expected = wire::mul_add(
            k,
            values.bytes(),
            wire::packed_len(k, w).unwrap_or(u64::MAX),
        );
        expect_payload(h, expected)?;
        Ok(TopK {
            select: TopKSelect::Count(k),
            values,
        })
    }

    fn decode_payload<const M: u8>(&self, h: &Header, p: &[u8], out: &mut [f32]) -> Result<()> {
        let k = h.param_u64(0) as usize;
        let w = h.params[9] as u32;
        let vbytes = k * self.values.bytes() as usize;
        let (vals, idx) = p.split_at(vbytes);
        let n = out.len() as u64;
        // Validate every index before touching `out`.
        if k > 0 {
            wire::check_padding(h.codec, idx, HEADER_LEN + vbytes, k as u64, w as u64)?;
        }
        let mut r = BitReader::new(idx);
        let mut next = 0u64; // smallest index the next element may have
        for j in 0..k {
            let i = next + r.get(w) as u64;
            if i >= n {
                return Err(Error::Corrupt {
                    codec: h.codec,
                    offset: HEADER_LEN + vbytes + (j * w as usize) / 8,
                    reason: format!("index of kept element {j} is {i}, past the {n} elements"),
                });
            }
            next = i + 1;
        }
        sparse_prepare::<M>(h, out);
        let mut r = BitReader::new(idx);
        let mut next = 0usize;
        for j in 0..k {
            let i = next + r.get(w) as usize;
            put::<M>(&mut out[i], self.values.get(vals, j));
            next = i + 1;
        }
        Ok(())
    }

    fn expected_payload(&self, n: u64) -> f64 {
        let k = self.k_for(n);
        if k == 0 {
            return 0.0;
        }
        // Gaps of evenly spread indices need about log2(n / k) + 1 bits.
        let w = ((n as f64 / k as f64).log2().ceil() + 1.0).min(32.0);
        k as f64 * (self.values.bytes() as f64 + w / 8.0)
    }

    fn is_unbiased(&self) -> bool {
        false
    }
}
