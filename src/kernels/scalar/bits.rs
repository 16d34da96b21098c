//! The oracle's bit packing: fixed-width fields (`put_bits`, `get_bits`) and streams of
//! any width with Rice codes (`BitWriter`, `BitReader`), LSB first.

/// Write `code` (of `width` bits, 1..=8) as element `j` of an LSB-first bit stream in `out`.
/// The stream must have been zeroed. Element `j` occupies stream bits
/// `[j*width, (j+1)*width)`; stream bit `b` is bit `b % 8` of byte `b / 8`.
#[inline(always)]
pub fn put_bits(out: &mut [u8], j: usize, width: u32, code: u8) {
    let bit = j * width as usize;
    out[bit / 8] |= code << (bit % 8);
}

/// Read element `j` of width 1, 2, 4 or 8 from an LSB-first bit stream.
#[inline(always)]
pub fn get_bits(p: &[u8], j: usize, width: u32) -> u8 {
    let bit = j * width as usize;
    (p[bit / 8] >> (bit % 8)) & ((1u16 << width) - 1) as u8
}

/// Writer of an LSB-first bit stream of values of any width 0..=32 (same layout as
/// `put_bits`), for index deltas.
pub struct BitWriter<'a> {
    out: &'a mut [u8],
    pos: usize,
    acc: u64,
    nacc: u32,
}

impl<'a> BitWriter<'a> {
    /// A writer at the start of `out`.
    pub fn new(out: &'a mut [u8]) -> Self {
        BitWriter {
            out,
            pos: 0,
            acc: 0,
            nacc: 0,
        }
    }

    /// A writer whose stream starts `lead` (0..8) bits into `out[0]`: those bits are
    /// written as zeros, for another writer's bits to be OR-ed in (a stream written in
    /// parts).
    pub fn with_lead(out: &'a mut [u8], lead: u32) -> Self {
        debug_assert!(lead < 8);
        BitWriter {
            out,
            pos: 0,
            acc: 0,
            nacc: lead,
        }
    }

    /// Append the low `width` bits of `v`. Bits gather in a 64-bit accumulator and leave
    /// it 32 at a time (bytes one by one only at the end of `out`).
    #[inline]
    pub fn put(&mut self, v: u32, width: u32) {
        debug_assert!(width <= 32 && (width == 32 || v >> width == 0));
        self.acc |= (v as u64) << self.nacc;
        self.nacc += width;
        if self.nacc >= 32 {
            if let Some(dst) = self.out.get_mut(self.pos..self.pos + 4) {
                dst.copy_from_slice(&(self.acc as u32).to_le_bytes());
                self.pos += 4;
                self.acc >>= 32;
                self.nacc -= 32;
            } else {
                while self.nacc >= 8 {
                    self.out[self.pos] = self.acc as u8;
                    self.pos += 1;
                    self.acc >>= 8;
                    self.nacc -= 8;
                }
            }
        }
    }

    /// Append `v` Rice-coded with parameter `b` (`b <= 31`): `v >> b` zero bits, a one
    /// bit, then the low `b` bits of `v`.
    #[inline]
    pub fn put_rice(&mut self, v: u64, b: u32) {
        let q = v >> b;
        let low = v & ((1u64 << b) - 1);
        if q + 1 + b as u64 <= 32 {
            // The common case in one put: the one bit after q zeros, then the low bits.
            self.put(((low << (q + 1)) | (1 << q)) as u32, (q + 1) as u32 + b);
            return;
        }
        let mut q = q;
        while q >= 31 {
            self.put(0, 31);
            q -= 31;
        }
        self.put(1 << q, q as u32 + 1);
        self.put(low as u32, b);
    }

    /// Write every whole byte and return the last partial one (its high bits zero; 0 if
    /// the stream ends on a byte boundary), which belongs to the next part's first byte.
    pub fn finish_open(mut self) -> u8 {
        while self.nacc >= 8 {
            self.out[self.pos] = self.acc as u8;
            self.pos += 1;
            self.acc >>= 8;
            self.nacc -= 8;
        }
        self.acc as u8
    }

    /// Flush the last partial bytes (high bits zero); returns bytes written.
    pub fn finish(mut self) -> usize {
        while self.nacc > 0 {
            self.out[self.pos] = self.acc as u8;
            self.pos += 1;
            self.acc >>= 8;
            self.nacc = self.nacc.saturating_sub(8);
        }
        self.pos
    }
}

/// Reader of an LSB-first bit stream written by [`BitWriter`]. Reading past the end
/// yields zero bits (callers check lengths first).
pub struct BitReader<'a> {
    p: &'a [u8],
    pos: usize,
    acc: u64,
    nacc: u32,
}

impl<'a> BitReader<'a> {
    /// A reader at the start of `p`.
    pub fn new(p: &'a [u8]) -> Self {
        BitReader {
            p,
            pos: 0,
            acc: 0,
            nacc: 0,
        }
    }

    /// The next `width` (0..=32) bits.
    #[inline]
    pub fn get(&mut self, width: u32) -> u32 {
        while self.nacc < width {
            let b = self.p.get(self.pos).copied().unwrap_or(0);
            self.acc |= (b as u64) << self.nacc;
            self.pos += 1;
            self.nacc += 8;
        }
        let v = if width == 32 {
            self.acc as u32
        } else {
            (self.acc & ((1u64 << width) - 1)) as u32
        };
        self.acc >>= width;
        self.nacc -= width;
        v
    }

    /// The next Rice-coded value with parameter `b` (`b <= 31`; see
    /// [`BitWriter::put_rice`]), or `None` if the stream ends first or the value
    /// exceeds `u64`. Reads only the bytes the value occupies.
    #[inline]
    pub fn get_rice(&mut self, b: u32) -> Option<u64> {
        let mut q = 0u64;
        loop {
            if self.acc != 0 {
                let z = self.acc.trailing_zeros();
                q += z as u64;
                self.acc >>= z + 1;
                self.nacc -= z + 1;
                break;
            }
            q += self.nacc as u64;
            self.nacc = 0;
            let byte = *self.p.get(self.pos)?;
            self.pos += 1;
            self.acc = byte as u64;
            self.nacc = 8;
        }
        if self.bits_left() < b as u64 {
            return None;
        }
        let r = self.get(b) as u64;
        q.checked_mul(1 << b).map(|h| h | r)
    }

    /// Bits not yet read.
    #[inline]
    pub fn bits_left(&self) -> u64 {
        8 * (self.p.len() - self.pos.min(self.p.len())) as u64 + self.nacc as u64
    }

    /// Bytes the reads so far have touched.
    pub fn bytes_touched(&self) -> usize {
        self.pos
    }

    /// Whether every bit left in the byte being read is zero.
    pub fn rest_of_byte_is_zero(&self) -> bool {
        self.acc == 0
    }
}
