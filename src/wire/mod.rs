//! Wire format v1: the frame header (write, parse, validate).
//!
//! docs/wire-format.md is the normative specification; this module implements it. Every
//! frame is a 56-byte header followed by a codec-specific payload:
//!
//! | bytes  | field        | type    |
//! |--------|--------------|---------|
//! | 0..4   | magic        | `"GPAK"` |
//! | 4      | version      | u8 = 1  |
//! | 5      | codec        | u8      |
//! | 6..8   | flags        | u16 LE  |
//! | 8..16  | elements     | u64 LE  |
//! | 16..24 | payload_len  | u64 LE  |
//! | 24..32 | seed         | u64 LE  |
//! | 32..40 | offset       | u64 LE  |
//! | 40..52 | params       | 12 bytes, per codec |
//! | 52..56 | header_crc   | u32 LE, CRC-32 (IEEE) of bytes 0..52 |
//!
//! A frame whose flags hold [`FLAG_PAYLOAD_CRC`] ends with 4 more bytes: the CRC-32 of
//! the payload ([`seal`] adds them; every decoder checks them).

use crate::codec_id::CodecId;
use crate::error::{Error, Result};

/// Bytes 0..4 of every frame.
pub const MAGIC: [u8; 4] = *b"GPAK";
/// The wire format version this build writes and reads.
pub const VERSION: u8 = 1;
/// Length of the frame header in bytes.
pub const HEADER_LEN: usize = 56;
/// Flag bit 0: the encoder's input held at least one NaN or ±Inf.
pub const FLAG_NONFINITE: u16 = 1 << 0;
/// Flag bit 1: the payload is followed by its CRC-32 (4 bytes, little-endian), which
/// every decoder verifies. Written by [`seal`].
pub const FLAG_PAYLOAD_CRC: u16 = 1 << 1;
/// Flag bit 2: a fixed-rate codec's code section is entropy-coded (the spec's
/// `entropy=on`): the payload is the block scales, then one entropy block of the code
/// bytes. Other codecs refuse it.
pub const FLAG_ENTROPY: u16 = 1 << 2;
/// Flag bits defined by version 1; a frame with any other bit set is rejected.
pub const KNOWN_FLAGS: u16 = FLAG_NONFINITE | FLAG_PAYLOAD_CRC | FLAG_ENTROPY;
/// Length of the payload checksum that follows the payload of a sealed frame.
pub const PAYLOAD_CRC_LEN: usize = 4;

/// A parsed and validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The codec that wrote the payload.
    pub codec: CodecId,
    /// Flag bits (see [`FLAG_NONFINITE`]).
    pub flags: u16,
    /// Number of f32 elements the frame decodes to.
    pub elements: u64,
    /// Payload length in bytes (the frame is `HEADER_LEN + payload_len` bytes).
    pub payload_len: u64,
    /// Seed of the random draws, or 0 for a codec that draws none.
    pub seed: u64,
    /// Global index of the frame's first element in its tensor.
    pub offset: u64,
    /// Codec-specific parameters (docs/wire-format.md, per codec).
    pub params: [u8; 12],
}

impl Header {
    /// True when the encoder saw NaN or ±Inf in its input.
    pub fn nonfinite(&self) -> bool {
        self.flags & FLAG_NONFINITE != 0
    }

    /// True when the payload is followed by its CRC-32 (see [`seal`]).
    pub fn payload_checksum(&self) -> bool {
        self.flags & FLAG_PAYLOAD_CRC != 0
    }

    /// True when the code section is entropy-coded (see [`FLAG_ENTROPY`]).
    pub fn entropy(&self) -> bool {
        self.flags & FLAG_ENTROPY != 0
    }

    /// Total frame length in bytes: header, payload and, when sealed, the payload
    /// checksum. `None` if that overflows u64 (no such frame can exist).
    pub fn frame_len(&self) -> Option<u64> {
        let trailer = if self.payload_checksum() {
            PAYLOAD_CRC_LEN as u64
        } else {
            0
        };
        (HEADER_LEN as u64 + trailer).checked_add(self.payload_len)
    }

    /// Serialise into the first [`HEADER_LEN`] bytes of `out` (which must be that long).
    pub fn write(&self, out: &mut [u8]) {
        let h = &mut out[..HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4] = VERSION;
        h[5] = self.codec as u8;
        h[6..8].copy_from_slice(&self.flags.to_le_bytes());
        h[8..16].copy_from_slice(&self.elements.to_le_bytes());
        h[16..24].copy_from_slice(&self.payload_len.to_le_bytes());
        h[24..32].copy_from_slice(&self.seed.to_le_bytes());
        h[32..40].copy_from_slice(&self.offset.to_le_bytes());
        h[40..52].copy_from_slice(&self.params);
        let crc = crc32fast::hash(&h[0..52]);
        h[52..56].copy_from_slice(&crc.to_le_bytes());
    }

    /// Parse and validate the header at the start of `frame` (which may hold more bytes).
    ///
    /// Checks, in order: length, magic, version, checksum, codec id, reserved flags, and
    /// that `offset + elements` does not overflow. Codec parameters and the payload length
    /// are checked by the codec (see [`split`]).
    pub fn parse(frame: &[u8]) -> Result<Header> {
        if frame.len() < 5 {
            return Err(Error::Truncated {
                needed: HEADER_LEN as u64,
                got: frame.len(),
            });
        }
        if frame[0..4] != MAGIC {
            return Err(Error::BadMagic([frame[0], frame[1], frame[2], frame[3]]));
        }
        if frame[4] != VERSION {
            return Err(Error::UnsupportedVersion(frame[4]));
        }
        if frame.len() < HEADER_LEN {
            return Err(Error::Truncated {
                needed: HEADER_LEN as u64,
                got: frame.len(),
            });
        }
        let u64_at = |i: usize| u64::from_le_bytes(frame[i..i + 8].try_into().expect("8 bytes"));
        let stored = u32::from_le_bytes(frame[52..56].try_into().expect("4 bytes"));
        let computed = crc32fast::hash(&frame[0..52]);
        if stored != computed {
            return Err(Error::HeaderChecksum { stored, computed });
        }
        let codec = CodecId::from_u8(frame[5]).ok_or(Error::UnknownCodec(frame[5]))?;
        let flags = u16::from_le_bytes([frame[6], frame[7]]);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(Error::ReservedFlags(flags & !KNOWN_FLAGS));
        }
        let h = Header {
            codec,
            flags,
            elements: u64_at(8),
            payload_len: u64_at(16),
            seed: u64_at(24),
            offset: u64_at(32),
            params: frame[40..52].try_into().expect("12 bytes"),
        };
        if h.offset.checked_add(h.elements).is_none() {
            return Err(Error::BadField {
                codec,
                field: "offset",
                reason: format!(
                    "offset {} + elements {} overflows u64",
                    h.offset, h.elements
                ),
            });
        }
        Ok(h)
    }

    /// Little-endian u32 at `at` within the params.
    pub(crate) fn param_u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.params[at..at + 4].try_into().expect("4 bytes"))
    }

    /// Little-endian u64 at `at` within the params.
    pub(crate) fn param_u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.params[at..at + 8].try_into().expect("8 bytes"))
    }

    /// Error unless params bytes `from..12` are zero (unused bytes are reserved).
    pub(crate) fn params_zero_from(&self, from: usize) -> Result<()> {
        self.params_zero(from..self.params.len())
    }

    /// `params_zero_from` over the bytes `range` of the parameters only.
    pub(crate) fn params_zero(&self, range: core::ops::Range<usize>) -> Result<()> {
        let from = range.start;
        if self.params[range.clone()].iter().any(|&b| b != 0) {
            return Err(Error::BadField {
                codec: self.codec,
                field: "params",
                reason: format!(
                    "reserved parameter bytes {}..{} must be zero, found {:02x?}",
                    40 + from,
                    40 + range.end,
                    &self.params[range]
                ),
            });
        }
        Ok(())
    }

    /// Error unless the seed is zero (codecs that draw no random numbers write 0).
    pub(crate) fn seed_zero(&self) -> Result<()> {
        if self.seed != 0 {
            return Err(Error::BadField {
                codec: self.codec,
                field: "seed",
                reason: format!(
                    "must be 0 for a codec that draws no random numbers, found {}",
                    self.seed
                ),
            });
        }
        Ok(())
    }
}

/// Parse the header of a complete frame and return it with the payload slice. The frame
/// must be exactly [`Header::frame_len`] bytes long; a sealed frame's payload checksum
/// is verified here, so every decoder checks it before reading the payload.
pub fn split(frame: &[u8]) -> Result<(Header, &[u8])> {
    split_with(frame, true)
}

/// [`split`], verifying a sealed frame's payload checksum only if `verify` (a caller
/// that verified these very bytes before passes false).
pub(crate) fn split_with(frame: &[u8], verify: bool) -> Result<(Header, &[u8])> {
    let h = Header::parse(frame)?;
    let Some(total) = h.frame_len() else {
        return Err(Error::Truncated {
            needed: u64::MAX,
            got: frame.len(),
        });
    };
    if (frame.len() as u64) < total {
        return Err(Error::Truncated {
            needed: total,
            got: frame.len(),
        });
    }
    if (frame.len() as u64) > total {
        return Err(Error::TrailingBytes {
            expected: total,
            got: frame.len(),
        });
    }
    if h.payload_checksum() {
        let (payload, trailer) =
            frame[HEADER_LEN..].split_at(frame.len() - HEADER_LEN - PAYLOAD_CRC_LEN);
        if !verify {
            return Ok((h, payload));
        }
        let stored = u32::from_le_bytes(trailer.try_into().expect("4 bytes"));
        let computed = crc32fast::hash(payload);
        if stored != computed {
            return Err(Error::PayloadChecksum { stored, computed });
        }
        return Ok((h, payload));
    }
    Ok((h, &frame[HEADER_LEN..]))
}

/// Add a payload checksum to the frame in `buf[..len]`: set [`FLAG_PAYLOAD_CRC`],
/// recompute the header checksum and append the payload's CRC-32, returning the new
/// length `len + 4`. Allocates nothing; `buf` needs 4 bytes past the frame
/// ([`sealed_len`] of the codec's `max_encoded_len`).
///
/// Every decoder then verifies the payload before reading it, so a flipped payload bit
/// is rejected ([`Error::PayloadChecksum`]) instead of silently decoding to a different
/// gradient. Costs one CRC-32 pass over the payload on each side (crc32fast: PCLMULQDQ
/// on x86-64, the CRC instructions on aarch64).
///
/// Errors: `buf[..len]` is not a complete, valid unsealed frame, or `buf` is too short.
/// On error `buf` is unchanged.
pub fn seal(buf: &mut [u8], len: usize) -> Result<usize> {
    let frame = buf.get(..len).ok_or(Error::BufferTooSmall {
        needed: len,
        got: buf.len(),
    })?;
    let (mut h, _) = split(frame)?;
    if h.payload_checksum() {
        return Err(Error::BadField {
            codec: h.codec,
            field: "flags",
            reason: "the frame is already sealed (it has a payload checksum)".into(),
        });
    }
    let sealed = len + PAYLOAD_CRC_LEN;
    if buf.len() < sealed {
        return Err(Error::BufferTooSmall {
            needed: sealed,
            got: buf.len(),
        });
    }
    let crc = crc32fast::hash(&buf[HEADER_LEN..len]);
    h.flags |= FLAG_PAYLOAD_CRC;
    h.write(buf);
    buf[len..sealed].copy_from_slice(&crc.to_le_bytes());
    Ok(sealed)
}

/// The buffer length [`seal`] needs for a frame of at most `frame_len` bytes.
pub const fn sealed_len(frame_len: usize) -> usize {
    frame_len.saturating_add(PAYLOAD_CRC_LEN)
}

/// Payload length helper: `a * b + c` in u64, `None` on overflow.
pub(crate) fn mul_add(a: u64, b: u64, c: u64) -> Option<u64> {
    a.checked_mul(b)?.checked_add(c)
}

/// Bytes of an LSB-first bit stream of `n` values of `bits` bits, `None` on overflow.
pub(crate) fn packed_len(n: u64, bits: u64) -> Option<u64> {
    Some(n.checked_mul(bits)?.div_ceil(8))
}

/// The most bits a Rice-coded stream (section 3.9) of `k` gaps with parameter `b` can
/// take when every index is below `n` (`k <= n`): each gap costs `b + 1` bits plus its
/// quotient `gap >> b` in unary, and the gaps sum to at most `n - k` (0 bits if `k = 0`).
pub fn rice_max_bits(n: u64, k: u64, b: u32) -> u64 {
    if k == 0 {
        return 0;
    }
    // Saturating, so that any arguments (k > n, huge counts, b >= 64) give an answer.
    let gaps = n.saturating_sub(k).checked_shr(b).unwrap_or(0);
    k.saturating_mul(u64::from(b) + 1).saturating_add(gaps)
}

/// The Rice parameter top-k encoders use for `k` of `n` indices: 0 if `k = 0`, else the
/// `b` in `0..=31` with the smallest [`rice_max_bits`] (the smallest such `b` on ties).
/// It is near `log2((n - k) ln 2 / k)`, where the expected cost of geometric gaps is
/// least, and it bounds the index cost by about `log2(n / k) + 2` bits whatever the
/// distribution.
pub fn rice_param(n: u64, k: u64) -> u32 {
    if k == 0 {
        return 0;
    }
    (0..32).min_by_key(|&b| rice_max_bits(n, k, b)).unwrap_or(0)
}

/// Error unless the unused high bits of the last byte of an `n * bits`-bit stream are zero.
pub(crate) fn check_padding(
    codec: CodecId,
    stream: &[u8],
    stream_at: usize,
    n: u64,
    bits: u64,
) -> Result<()> {
    let used = (n * bits % 8) as u32;
    if used != 0 {
        let last = stream[stream.len() - 1];
        if last >> used != 0 {
            return Err(Error::Corrupt {
                codec,
                offset: stream_at + stream.len() - 1,
                reason: format!("padding bits {used}..8 of the last code byte are not zero"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::scalar::put_bits;

    #[test]
    fn checksum_is_crc32_iso_hdlc() {
        // The check value docs/wire-format.md gives.
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn bit_stream_example_from_the_spec() {
        let mut s = [0u8; 2];
        for (j, c) in [1u8, 3, 0, 2, 1].into_iter().enumerate() {
            put_bits(&mut s, j, 2, c);
        }
        assert_eq!(s, [0x8D, 0x01]);
    }

    #[test]
    fn header_round_trips_and_rejects_short_input() {
        let h = Header {
            codec: CodecId::Qsgd,
            flags: FLAG_NONFINITE,
            elements: 1 << 33,
            payload_len: 7,
            seed: u64::MAX,
            offset: 12,
            params: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        };
        let mut buf = [0u8; HEADER_LEN];
        h.write(&mut buf);
        assert_eq!(Header::parse(&buf), Ok(h));
        assert!(h.nonfinite());
        assert_eq!(h.frame_len(), Some(63));
        for len in 0..HEADER_LEN {
            assert!(Header::parse(&buf[..len]).is_err());
        }
        assert!(matches!(
            split(&buf),
            Err(Error::Truncated { needed: 63, .. })
        ));
    }
}
