//! The entropy stage of the fixed-rate codecs (`entropy=on` in a spec, the ENTROPY flag
//! in a frame): the block scales as they are, then the code section as one entropy block
//! of its bytes. Decoded values are bit-identical to the frame without the stage.
//!
//! The block's four streams start on whole units of the layout (whole blocks and whole
//! code bytes, [`Layout::unit`]), so a decoder turns each piece of decoded code bytes
//! into values as it goes, without a buffer for the whole code section: the stage needs
//! a unit of at most [`PIECE`] code bytes (int8 and fp8 blocks up to 4096 elements).
//! Encoders write the codes into working room past the frame's largest size and code them
//! from there, so [`crate::Codec::max_encoded_len`] adds the code section once more.

use super::fixed::{FixedRate, Layout};
use super::{EncodeCtx, Encoded, payload_buf};
use crate::codec::{Args, CodecId};
use crate::error::{Error, Result};
use crate::kernels::entropy;
use crate::wire::{HEADER_LEN, Header};

/// Most code bytes per decoded piece, and so the largest unit a staged layout may have.
pub(crate) const PIECE: usize = 4096;

/// The code bytes of one unit: the block's stream alignment.
fn align(l: Layout) -> usize {
    l.unit() * l.bits / 8
}

/// Error unless `l` can take the stage (its unit fits a piece).
pub(crate) fn check(codec: CodecId, l: Layout) -> Result<()> {
    if align(l) > PIECE {
        return Err(Error::Param {
            codec,
            name: "entropy",
            reason: format!(
                "the stage codes whole blocks of at most {PIECE} code bytes; a block of {} \
                 elements takes {}",
                l.block,
                align(l)
            ),
        });
    }
    Ok(())
}

/// The spec's `entropy=` (`off` by default), checked against the layout `l` the other
/// parameters give.
pub(crate) fn from_args(
    a: &mut Args,
    codec: CodecId,
    l: Layout,
) -> core::result::Result<bool, String> {
    let on = a.choice("entropy", "off", &["off", "on"])? == "on";
    if on {
        check(codec, l).map_err(|e| match e {
            Error::Param { reason, .. } => format!("`entropy=on`: {reason}"),
            e => e.to_string(),
        })?;
    }
    Ok(on)
}

/// What `Display` appends for the stage: `,entropy=on`, or nothing.
pub(crate) fn suffix(on: bool) -> &'static str {
    if on { ",entropy=on" } else { "" }
}

/// The largest frame payload of a staged layout for `n` elements (saturating).
fn frame_payload(l: Layout, n: u64) -> u64 {
    let scales = n
        .div_ceil(l.block as u64)
        .saturating_mul(l.scale_bytes as u64);
    let codes = n.saturating_mul(l.bits as u64).div_ceil(8);
    scales.saturating_add(entropy::max_len(codes))
}

/// `max_payload` of a staged codec: the largest frame and the working room for its codes.
pub(crate) fn max_payload(l: Layout, n: u64) -> u64 {
    let codes = n.saturating_mul(l.bits as u64).div_ceil(8);
    frame_payload(l, n).saturating_add(codes)
}

/// Check a staged frame's header against `l`: its unit and its payload length (the
/// scales and at least one byte of entropy block, at most the largest frame).
pub(crate) fn read(h: &Header, l: Layout) -> Result<()> {
    check(h.codec, l).map_err(|e| Error::BadField {
        codec: h.codec,
        field: "flags.entropy",
        reason: e.to_string(),
    })?;
    let n = h.elements;
    let least = n
        .div_ceil(l.block as u64)
        .saturating_mul(l.scale_bytes as u64)
        .saturating_add(1);
    let most = frame_payload(l, n);
    if h.payload_len < least || h.payload_len > most {
        return Err(Error::Corrupt {
            codec: h.codec,
            offset: HEADER_LEN,
            reason: format!(
                "a staged payload of {} bytes for {n} elements (from {least} to {most})",
                h.payload_len
            ),
        });
    }
    Ok(())
}

/// `with_entropy` and `entropy` of a codec with an `entropy: bool` field.
macro_rules! stage_methods {
    ($T:ident) => {
        impl $T {
            /// The codec with its code section entropy-coded (`on`) or not: smaller
            /// frames, the same decoded values. Errors if a unit of whole blocks and
            /// whole code bytes takes over 4096 code bytes.
            pub fn with_entropy(self, on: bool) -> $crate::error::Result<$T> {
                let c = $T {
                    entropy: on,
                    ..self
                };
                if on {
                    $crate::codecs::stage::check(
                        <$T as $crate::codecs::Scheme>::ID,
                        $crate::codecs::fixed::FixedRate::layout(&c),
                    )?;
                }
                Ok(c)
            }

            /// Whether the code section is entropy-coded.
            pub fn entropy(&self) -> bool {
                self.entropy
            }
        }
    };
}
pub(crate) use stage_methods;

/// Check a fixed-rate frame's payload length against `f`, read from its header, with or
/// without the stage.
pub(crate) fn expect_payload<F: FixedRate>(h: &Header, f: &F) -> Result<()> {
    let l = f.layout();
    if f.staged() {
        read(h, l)
    } else {
        super::expect_payload(h, l.payload_len(h.elements))
    }
}

/// Encode `x` with the stage: scales in place, codes into the working room, then the
/// codes entropy-coded after the scales.
pub(crate) fn encode<F: FixedRate + ?Sized>(
    f: &F,
    x: &[f32],
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<Encoded> {
    staged(f, x.len(), ctx, out, |scales, codes| {
        super::fixed::encode_sections_into(f, x, ctx, scales, codes)
    })
}

/// An error-feedback step with the stage: the fused tiles of the codec write the scales
/// in place and the codes into the working room, then the codes are entropy-coded.
pub(crate) fn feedback<F: FixedRate + ?Sized>(
    f: &F,
    g: &[f32],
    r: super::fixed::ResidualMut<'_>,
    beta_gamma: (f32, f32),
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<Encoded> {
    staged(f, g.len(), ctx, out, |scales, codes| {
        super::fixed::feedback_sections(f, g, r, beta_gamma, ctx, scales, codes)
    })
}

/// A staged payload for `n` elements: `sections` fills the scales in place and the codes
/// in the working room (returning whether its input held NaN or ±Inf), then the codes
/// are entropy-coded after the scales.
fn staged<F: FixedRate + ?Sized>(
    f: &F,
    n: usize,
    ctx: &EncodeCtx,
    out: &mut [u8],
    sections: impl FnOnce(&mut [u8], &mut [u8]) -> bool,
) -> Result<Encoded> {
    let l = f.layout();
    let (sl, cl) = (l.scales_len(n), l.codes_len(n));
    let frame = frame_payload(l, n as u64) as usize;
    let p = payload_buf(out, max_payload(l, n as u64))?;
    let (head, room) = p.split_at_mut(frame);
    let codes = &mut room[..cl];
    let (scales, coded) = head.split_at_mut(sl);
    let nonfinite = sections(scales, codes);
    let codes = &*codes;
    let len = entropy::encode(codes, align(l), coded);
    Ok(super::fixed::encoded(f, (sl + len) as u64, nonfinite, ctx))
}

/// Validate a staged payload (its length checked by [`read`]) and decode it into `out` in
/// mode `M`: the scales and the whole entropy block are checked before `out` is written,
/// except in write mode (`decode_into`, which may write before an error), where the
/// block's streams and the codes' padding are checked as they are decoded.
pub(crate) fn decode<F: FixedRate + ?Sized, const M: u8>(
    f: &F,
    h: &Header,
    p: &[u8],
    out: &mut [f32],
) -> Result<()> {
    let l = f.layout();
    let n = out.len();
    let (scales, rest) = p.split_at(l.scales_len(n));
    f.validate(h, scales, &[])?;
    let at = HEADER_LEN + scales.len();
    let corrupt = |offset: usize, reason: String| Error::Corrupt {
        codec: h.codec,
        offset,
        reason,
    };
    let cl = l.codes_len(n);
    let write = M == crate::kernels::mode::WRITE;
    let block = entropy::Block::for_mode::<M>(rest, cl, align(l))
        .map_err(|(o, why)| corrupt(at + o, why))?;
    if block.bytes() != rest.len() {
        return Err(corrupt(
            at + block.bytes(),
            format!(
                "{} bytes after the entropy block of the codes",
                rest.len() - block.bytes()
            ),
        ));
    }
    // The last code byte's padding, as without the stage (its offset: the block's).
    let padding = |last: Option<u8>| match last {
        Some(b) => crate::wire::check_padding(h.codec, &[b], at, n as u64, l.bits as u64),
        None => Ok(()),
    };
    if !write {
        padding(block.last())?;
    }
    let alphabet = block.alphabet();
    if let Some(c) = (0..=255u8).find(|&c| alphabet[c as usize] && f.refuses_code(c)) {
        return Err(corrupt(
            at,
            format!("the entropy block holds code {c:#04x}, which encoders never write"),
        ));
    }
    let piece = PIECE / align(l) * align(l);
    let mut last = None;
    block
        .for_each_chunk(piece, |start, codes| {
            let s = start * 8 / l.bits;
            let e = ((start + codes.len()) * 8 / l.bits).min(n);
            let scales = &scales[l.scales_len(s)..l.scales_len(e)];
            f.decode_sections(M, scales, codes, &mut out[s..e]);
            if start + codes.len() == cl {
                last = codes.last().copied();
            }
        })
        .map_err(|(o, why)| corrupt(at + o, why))?;
    // Write mode's padding, known now (the others checked it first).
    if write { padding(last) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use crate::{Codec, CodecSpec, EncodeCtx};

    fn spec(s: &str) -> CodecSpec {
        s.parse().unwrap()
    }

    #[test]
    fn unit_must_fit_a_piece() {
        assert!("int8:block=4096,entropy=on".parse::<CodecSpec>().is_ok());
        let e = "int8:block=8192,entropy=on"
            .parse::<CodecSpec>()
            .unwrap_err();
        assert!(e.to_string().contains("entropy=on"), "{e}");
        // Sign's unit of 8 blocks of 4096 elements is 4096 code bytes.
        assert!("sign:block=4096,entropy=on".parse::<CodecSpec>().is_ok());
    }

    #[test]
    #[cfg_attr(miri, ignore = "safe code only, and long under Miri; run natively")]
    fn staged_decode_equals_plain_decode_for_every_alignment() {
        let x: Vec<f32> = (0..5000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
            .collect();
        for s in [
            "int8:block=32",
            "int8:block=100",
            "int8:block=4096",
            "sign:block=24",
            "fp4:block=32",
            "fp8:block=48",
            "qsgd:bits=2,block=12",
            "ternary:block=20",
            "natural:block=16",
            "codebook:block=64",
        ] {
            let (plain, staged) = (spec(s), spec(&format!("{s},entropy=on")));
            for n in [0, 1, 7, 31, 32, 33, 999, 4096, 4097, 5000] {
                let ctx = EncodeCtx::new(3);
                let a = plain.encode(&x[..n], &ctx).unwrap();
                let b = staged.encode(&x[..n], &ctx).unwrap();
                let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                let (da, db) = (plain.decode(&a).unwrap(), staged.decode(&b).unwrap());
                assert_eq!(bits(da), bits(db), "{s} {n}");
                assert!(b.len() <= staged.max_encoded_len(n), "{s} {n}");
            }
        }
    }
}
