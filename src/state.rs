//! Saved state (checkpoints): one self-describing, versioned, checksummed blob format
//! for everything that carries across steps ([`crate::ErrorFeedback::save`],
//! [`crate::collective::AllReduce::save`], [`crate::sync::SyncEngine::save`]).
//!
//! A blob is, in little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic naming what is saved (`"GPEF"` error feedback, `"GPAR"` all-reduce, `"GPSE"` sync engine, `"GPNS"` a front end's state by tensor name) |
//! | 4..6 | format version (1) |
//! | 6 | flags: bit 0 set when every run of f32 values in the body is a `lossless` frame |
//! | 7 | zero |
//! | 8..16 | body length `L` (u64) |
//! | 16..16+L | body (fields of the saved type, in order; byte strings and nested blobs are prefixed by their u64 length) |
//! | 16+L..20+L | CRC-32 of bytes 0..16+L |
//!
//! A run of f32 values is its count (u64) then the values; in a blob with flag bit 0 it
//! is its count, then the byte length (u64) of a `lossless` frame of the values: the same
//! bits, fewer bytes (what healing sends a member over a slow link).
//!
//! A blob whose length, magic, version, flags or checksum is wrong, or whose body does
//! not read exactly to its end, is refused with [`Error::Checkpoint`].

use crate::codec::{Codec, EncodeCtx};
use crate::codecs::Lossless;
use crate::error::{Error, Result};

const VERSION: u16 = 1;
const HEAD: usize = 16;
/// Header flag: the body's runs of f32 values are `lossless` frames.
const PACKED: u8 = 1;

/// Builds a blob.
pub(crate) struct BlobWriter {
    buf: Vec<u8>,
    /// Whether runs of f32 values are written as `lossless` frames.
    packed: bool,
    /// The first failure to pack a run (memory), reported by [`BlobWriter::try_finish`].
    failed: Option<Error>,
}

impl BlobWriter {
    pub(crate) fn new(magic: [u8; 4]) -> BlobWriter {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&magic);
        buf.extend_from_slice(&VERSION.to_le_bytes());
        buf.extend_from_slice(&[0, 0]);
        buf.extend_from_slice(&[0; 8]);
        BlobWriter {
            buf,
            packed: false,
            failed: None,
        }
    }

    /// A writer whose runs of f32 values are `lossless` frames (finish it with
    /// [`BlobWriter::try_finish`]).
    pub(crate) fn packed(magic: [u8; 4]) -> BlobWriter {
        let mut w = BlobWriter::new(magic);
        w.buf[6] = PACKED;
        w.packed = true;
        w
    }

    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u64(v.len() as u64);
        self.buf.extend_from_slice(v);
        self
    }

    pub(crate) fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }

    pub(crate) fn f32s(&mut self, v: &[f32]) -> &mut Self {
        self.u64(v.len() as u64);
        if self.packed {
            if let Err(e) = self.lossless(v) {
                self.failed.get_or_insert(e);
            }
            return self;
        }
        v.iter()
            .for_each(|x| self.buf.extend_from_slice(&x.to_le_bytes()));
        self
    }

    /// `v` as a length-prefixed `lossless` frame, its room reserved first.
    fn lossless(&mut self, v: &[f32]) -> Result<()> {
        let codec = Lossless::default();
        let room = codec.max_encoded_len(v.len());
        let at = self.buf.len() + 8;
        crate::alloc::lengthen(&mut self.buf, at + room, "a packed state's frame")?;
        let len = codec.encode_into(v, &EncodeCtx::new(0), &mut self.buf[at..])?;
        self.buf.truncate(at + len);
        self.buf[at - 8..at].copy_from_slice(&(len as u64).to_le_bytes());
        Ok(())
    }

    pub(crate) fn u16s(&mut self, v: &[u16]) -> &mut Self {
        self.u64(v.len() as u64);
        v.iter()
            .for_each(|x| self.buf.extend_from_slice(&x.to_le_bytes()));
        self
    }

    /// The blob, or the first failure to pack one of its runs.
    pub(crate) fn try_finish(mut self) -> Result<Vec<u8>> {
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(self.finish()),
        }
    }

    pub(crate) fn finish(mut self) -> Vec<u8> {
        debug_assert!(
            self.failed.is_none(),
            "a packed blob finishes with try_finish"
        );
        let body = (self.buf.len() - HEAD) as u64;
        self.buf[8..16].copy_from_slice(&body.to_le_bytes());
        let crc = crc32fast::hash(&self.buf);
        self.buf.extend_from_slice(&crc.to_le_bytes());
        self.buf
    }
}

/// Reads a blob's body, field by field.
pub(crate) struct BlobReader<'a> {
    body: &'a [u8],
    at: usize,
    what: &'static str,
    /// Whether runs of f32 values are `lossless` frames (header flag bit 0).
    packed: bool,
}

fn bad(what: &str, reason: impl core::fmt::Display) -> Error {
    Error::Checkpoint(format!("{what}: {reason}"))
}

impl<'a> BlobReader<'a> {
    /// Check `blob`'s frame (length, checksum, magic, version) and start on its body.
    pub(crate) fn open(blob: &'a [u8], magic: [u8; 4], what: &'static str) -> Result<Self> {
        if blob.len() < HEAD + 4 {
            return Err(bad(
                what,
                format!("{} bytes is too short to be a saved state", blob.len()),
            ));
        }
        let (data, crc) = blob.split_at(blob.len() - 4);
        let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        let computed = crc32fast::hash(data);
        if stored != computed {
            return Err(bad(
                what,
                format!(
                    "checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the saved state is corrupt"
                ),
            ));
        }
        if data[0..4] != magic {
            return Err(bad(
                what,
                format!(
                    "magic {:?}, not {:?}: this is not a saved {what}",
                    String::from_utf8_lossy(&data[0..4]),
                    String::from_utf8_lossy(&magic)
                ),
            ));
        }
        let version = u16::from_le_bytes([data[4], data[5]]);
        if version != VERSION {
            return Err(bad(
                what,
                format!("format version {version} (this build reads {VERSION})"),
            ));
        }
        if data[6] & !PACKED != 0 || data[7] != 0 {
            return Err(bad(
                what,
                format!(
                    "header bytes 6..8 are {:#04x} {:#04x}: only flag bit 0 (packed) is defined",
                    data[6], data[7]
                ),
            ));
        }
        let len = u64::from_le_bytes(data[8..16].try_into().expect("8 bytes"));
        if len != (data.len() - HEAD) as u64 {
            return Err(bad(
                what,
                format!(
                    "the body is {} bytes, the header says {len}",
                    data.len() - HEAD
                ),
            ));
        }
        Ok(BlobReader {
            body: &data[HEAD..],
            at: 0,
            what,
            packed: data[6] & PACKED != 0,
        })
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8]> {
        let left = (self.body.len() - self.at) as u64;
        if n > left {
            return Err(bad(
                self.what,
                format!(
                    "a field of {n} bytes at body byte {} runs past the end",
                    self.at
                ),
            ));
        }
        let s = &self.body[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(s)
    }

    pub(crate) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    pub(crate) fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u64()?;
        self.take(n)
    }

    pub(crate) fn str(&mut self) -> Result<&'a str> {
        let what = self.what;
        core::str::from_utf8(self.bytes()?).map_err(|_| bad(what, "a text field is not UTF-8"))
    }

    /// `n` f32 values into `out`, which must hold exactly as many.
    pub(crate) fn f32s_into(&mut self, out: &mut [f32]) -> Result<()> {
        if self.packed {
            let n = self.u64()?;
            self.expect_eq("value count", n, out.len() as u64)?;
            return self.lossless_into(out);
        }
        self.values_into(out, |b: [u8; 4]| f32::from_le_bytes(b))
    }

    /// A `lossless` frame of exactly `out.len()` values into `out`.
    fn lossless_into(&mut self, out: &mut [f32]) -> Result<()> {
        let what = self.what;
        let frame = self.bytes()?;
        Lossless::default()
            .decode_into(frame, out)
            .map_err(|e| bad(what, format!("a packed run of {} values: {e}", out.len())))
    }

    /// A length-prefixed run of f32 values, however many were saved (allocated only
    /// once the blob is seen to hold them).
    pub(crate) fn f32s_vec(&mut self) -> Result<Vec<f32>> {
        let n = self.u64()?;
        if self.packed {
            // A lossless frame keeps 3 bytes of every value: no more values than that
            // are allocated for.
            let left = (self.body.len() - self.at) as u64;
            if n.saturating_mul(3) > left {
                return Err(bad(
                    self.what,
                    format!("a packed run of {n} values in {left} bytes"),
                ));
            }
            let mut v = crate::alloc::filled(n as usize, 0.0, "a restored run of values")?;
            self.lossless_into(&mut v)?;
            return Ok(v);
        }
        let b = self.take(n.saturating_mul(4))?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }

    /// `n` u16 values into `out`, which must hold exactly as many.
    pub(crate) fn u16s_into(&mut self, out: &mut [u16]) -> Result<()> {
        self.values_into(out, |b: [u8; 2]| u16::from_le_bytes(b))
    }

    /// A length-prefixed run of `N`-byte little-endian values into `out`, which must hold
    /// exactly as many.
    fn values_into<T, const N: usize>(
        &mut self,
        out: &mut [T],
        from: impl Fn([u8; N]) -> T,
    ) -> Result<()> {
        let n = self.u64()?;
        if n != out.len() as u64 {
            return Err(bad(
                self.what,
                format!("{n} values saved, {} expected", out.len()),
            ));
        }
        let b = self.take(n.saturating_mul(N as u64))?;
        for (o, c) in out.iter_mut().zip(b.chunks_exact(N)) {
            *o = from(c.try_into().expect("N bytes"));
        }
        Ok(())
    }

    /// Error unless `got == want` (a saved field that must match this state's).
    pub(crate) fn expect_eq<V: PartialEq + core::fmt::Display>(
        &self,
        field: &str,
        got: V,
        want: V,
    ) -> Result<()> {
        if got != want {
            return Err(bad(
                self.what,
                format!("saved {field} is {got}, this state's is {want}"),
            ));
        }
        Ok(())
    }

    /// Read a u8 that must equal `want`.
    pub(crate) fn u8_eq(&mut self, field: &str, want: u8) -> Result<()> {
        let got = self.u8()?;
        self.expect_eq(field, got, want)
    }

    /// Read a u32 that must equal `want`.
    pub(crate) fn u32_eq(&mut self, field: &str, want: u32) -> Result<()> {
        let got = self.u32()?;
        self.expect_eq(field, got, want)
    }

    /// Read a u64 that must equal `want`.
    pub(crate) fn u64_eq(&mut self, field: &str, want: u64) -> Result<()> {
        let got = self.u64()?;
        self.expect_eq(field, got, want)
    }

    /// Read a string that must equal `want`.
    pub(crate) fn str_eq(&mut self, field: &str, want: &str) -> Result<()> {
        let got = self.str()?;
        self.expect_eq(field, got, want)
    }

    /// Error unless the whole body was read.
    pub(crate) fn end(&self) -> Result<()> {
        if self.at != self.body.len() {
            return Err(bad(
                self.what,
                format!(
                    "{} bytes left over after the last field",
                    self.body.len() - self.at
                ),
            ));
        }
        Ok(())
    }
}

/// Restore each of `items` from its blob, all or nothing: into copies, kept only if
/// every blob reads (and there is one per item).
pub(crate) fn restore_all<T: Clone>(
    items: &mut Vec<T>,
    blobs: &[Vec<u8>],
    restore: impl Fn(&mut T, &[u8]) -> Result<()>,
) -> Result<()> {
    if blobs.len() != items.len() {
        return Err(Error::Checkpoint(format!(
            "{} saved states for {} here",
            blobs.len(),
            items.len()
        )));
    }
    let mut copy = items.clone();
    for (item, blob) in copy.iter_mut().zip(blobs) {
        restore(item, blob)?;
    }
    *items = copy;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_round_trip_and_refuse_damage() {
        let mut w = BlobWriter::new(*b"TEST");
        w.u8(7)
            .u32(9)
            .u64(11)
            .str("hi")
            .f32s(&[1.5, -2.0])
            .u16s(&[3]);
        let blob = w.finish();
        let mut r = BlobReader::open(&blob, *b"TEST", "test").unwrap();
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u32().unwrap(), 9);
        assert_eq!(r.u64().unwrap(), 11);
        assert_eq!(r.str().unwrap(), "hi");
        let mut f = [0f32; 2];
        r.f32s_into(&mut f).unwrap();
        assert_eq!(f, [1.5, -2.0]);
        let mut u = [0u16; 1];
        r.u16s_into(&mut u).unwrap();
        assert_eq!(u, [3]);
        r.end().unwrap();
        for i in 0..blob.len() {
            let mut b = blob.clone();
            b[i] ^= 0x04;
            assert!(BlobReader::open(&b, *b"TEST", "test").is_err(), "byte {i}");
        }
        assert!(BlobReader::open(&blob, *b"OTHR", "test").is_err());
        assert!(BlobReader::open(&blob[..blob.len() - 1], *b"TEST", "test").is_err());
    }

    /// Gradient-like values with every kind of f32 among them.
    fn awkward(n: usize) -> Vec<f32> {
        let special = [0.0, -0.0, f32::MIN_POSITIVE / 3.0, f32::INFINITY, f32::NAN];
        let mut x: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.37).sin() * 1e-3) / (1.0 + (i % 17) as f32))
            .collect();
        for (i, v) in special.into_iter().enumerate() {
            x[i * 7] = v;
        }
        x[3] = f32::from_bits(0x7FC0_1234);
        x
    }

    #[test]
    fn a_packed_blob_keeps_every_bit_in_fewer_bytes() {
        let x = awkward(20_000);
        let write = |mut w: BlobWriter| {
            w.u8(7).f32s(&x).u64(9).f32s(&[]).f32s(&x[..5]);
            w
        };
        let plain = write(BlobWriter::new(*b"TEST")).finish();
        let packed = write(BlobWriter::packed(*b"TEST")).try_finish().unwrap();
        assert!(
            packed.len() < plain.len() * 9 / 10,
            "{} of {}",
            packed.len(),
            plain.len()
        );
        for blob in [&plain, &packed] {
            let mut r = BlobReader::open(blob, *b"TEST", "test").unwrap();
            assert_eq!(r.u8().unwrap(), 7);
            let mut got = vec![0f32; x.len()];
            r.f32s_into(&mut got).unwrap();
            assert!(got.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()));
            assert_eq!(r.u64().unwrap(), 9);
            assert!(r.f32s_vec().unwrap().is_empty());
            let tail = r.f32s_vec().unwrap();
            assert!(
                tail.iter()
                    .zip(&x[..5])
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            r.end().unwrap();
        }
        // A packed run read into room of another length, or a frame damaged under a
        // good checksum, is an error.
        let mut r = BlobReader::open(&packed, *b"TEST", "test").unwrap();
        r.u8().unwrap();
        assert!(r.f32s_into(&mut vec![0f32; x.len() - 1]).is_err());
        let mut bad = packed.clone();
        let body = HEAD + 1 + 16;
        bad[body + 30] ^= 0x40;
        let at = bad.len() - 4;
        let crc = crc32fast::hash(&bad[..at]);
        bad[at..].copy_from_slice(&crc.to_le_bytes());
        let mut r = BlobReader::open(&bad, *b"TEST", "test").unwrap();
        r.u8().unwrap();
        let mut got = vec![0f32; x.len()];
        let e = r.f32s_into(&mut got).unwrap_err();
        assert!(matches!(e, Error::Checkpoint(_)), "{e}");
        // A count of values the packed bytes cannot hold allocates nothing.
        let mut w = BlobWriter::packed(*b"TEST");
        w.u64(1 << 60).u64(0);
        let blob = w.try_finish().unwrap();
        let e = BlobReader::open(&blob, *b"TEST", "test")
            .unwrap()
            .f32s_vec()
            .unwrap_err();
        assert!(e.to_string().contains("packed run"), "{e}");
        // Undefined flags are refused.
        let mut odd = plain.clone();
        odd[6] = 2;
        let at = odd.len() - 4;
        let crc = crc32fast::hash(&odd[..at]);
        odd[at..].copy_from_slice(&crc.to_le_bytes());
        assert!(BlobReader::open(&odd, *b"TEST", "test").is_err());
    }
}
