//! A byte entropy coder: canonical Huffman codes of at most [`MAX_LEN`] bits, four
//! interleaved streams, table-driven decoding. Used by the lossless codec for the
//! exponents of floats.
//!
//! A coded block (what [`encode`] writes and [`Block::open`] reads) starts with its mode:
//!
//! - `0` stored: the `n` symbols follow as bytes;
//! - `1` one symbol: a byte, the symbol every one of the `n` is;
//! - `2` Huffman: 128 bytes of code lengths (symbol `2k` in the low nibble of byte `k`,
//!   `2k + 1` in the high one; 0 for a symbol without a code, else 1 to
//!   [`MAX_LEN`]), then four u32 LE, the byte lengths of streams 0 to 3, then the four
//!   streams. Stream `j` holds symbols `j q .. min((j + 1) q, n)`, `q` being
//!   `ceil(n / 4)` rounded up to a multiple of the block's alignment `a` (a property of
//!   its user, not written in the block: 1 for the lossless codec's exponents, the code
//!   bytes of a whole unit of blocks for a fixed-rate codec's entropy stage), so that
//!   every stream starts on a unit.
//!
//! The code of a symbol is canonical: codes are given in order of (length, symbol),
//! each the previous one plus one, shifted left when the length grows. A stream holds
//! its codes back to back, LSB first: the first bit of a code (its most significant) is
//! the lowest unused bit. A stream ends at its last code's byte, padded with zero bits.
//!
//! A decoder refuses lengths above [`MAX_LEN`], lengths that do not make a complete
//! prefix code (the sum of `2^-len` must be 1, with at least two symbols), a stream that
//! ends before its symbols do, and a stream with bytes or nonzero bits past its last
//! code; so a coded block has one valid form for its symbols and lengths.

use super::table::{self, call};

/// Why a coded block was refused: the byte offset into the block and the reason.
pub type Refused = (usize, String);

/// Longest code, in bits.
pub const MAX_LEN: u32 = 11;
/// The most symbols [`Block::for_each_chunk`] hands over at once.
pub const PIECE: usize = 4096;
/// Bytes of a Huffman block before its streams.
pub const HUFFMAN_HEADER: usize = 1 + 128 + 16;

const STORED: u8 = 0;
const ONE: u8 = 1;
const HUFFMAN: u8 = 2;

/// Upper bound of [`encode`]'s output for `n` symbols (saturating).
pub fn max_len(n: u64) -> u64 {
    n.saturating_add(1)
}

/// Count the symbols of each quarter `syms[lo..hi]` of `bounds` (eight tables, two per
/// quarter, so that runs of one value do not wait on one counter).
#[inline(always)]
fn histograms(bounds: [(usize, usize); 4], syms: &[u8]) -> [[u64; 256]; 4] {
    let mut h = [[0u64; 256]; 8];
    let q = bounds.map(|(lo, hi)| &syms[lo..hi]);
    // The quarters are equally long but maybe the last ones: all four in step over the
    // shortest, then each on its own.
    let both = q.iter().map(|q| q.len()).min().unwrap_or(0) & !1;
    for i in (0..both).step_by(2) {
        for j in 0..4 {
            h[2 * j][q[j][i] as usize] += 1;
            h[2 * j + 1][q[j][i + 1] as usize] += 1;
        }
    }
    for j in 0..4 {
        for &s in &q[j][both..] {
            h[2 * j][s as usize] += 1;
        }
    }
    std::array::from_fn(|j| std::array::from_fn(|s| h[2 * j][s] + h[2 * j + 1][s]))
}

/// Huffman code lengths of at most [`MAX_LEN`] bits for the counts `h` (0 for a count
/// of 0). Needs at least two symbols that occur. When the optimal code is longer, the
/// counts are halved (a count stays at least 1) until it fits.
fn code_lengths(h: &[u64; 256]) -> [u8; 256] {
    let mut counts = *h;
    loop {
        let lens = huffman_lengths(&counts);
        if lens.iter().all(|&l| l as u32 <= MAX_LEN) {
            return lens;
        }
        for c in counts.iter_mut().filter(|c| **c > 0) {
            *c = (*c / 2).max(1);
        }
    }
}

/// Optimal (unlimited) Huffman code lengths; ties broken by symbol, so the result
/// depends on the counts alone.
fn huffman_lengths(counts: &[u64; 256]) -> [u8; 256] {
    // Nodes: leaves 0..256, inner nodes after; a sorted queue of leaves and a queue of
    // inner nodes (built in increasing weight) merged in the classic two-queue way.
    let mut leaves = [(0u64, 0usize); 256];
    let mut nleaves = 0;
    for (sym, &c) in counts.iter().enumerate().filter(|(_, c)| **c > 0) {
        leaves[nleaves] = (c, sym);
        nleaves += 1;
    }
    let leaves = &mut leaves[..nleaves];
    leaves.sort_unstable();
    let mut parent = [0usize; 512];
    let mut inner_buf = [(0u64, 0usize); 256];
    let (mut li, mut ii) = (0, 0);
    let mut next = 256;
    // The lighter of the two queues' heads (a leaf on a tie).
    fn take(
        leaves: &[(u64, usize)],
        inner: &[(u64, usize)],
        li: &mut usize,
        ii: &mut usize,
    ) -> (u64, usize) {
        if *li < leaves.len() && (*ii >= inner.len() || leaves[*li].0 <= inner[*ii].0) {
            *li += 1;
            leaves[*li - 1]
        } else {
            *ii += 1;
            inner[*ii - 1]
        }
    }
    for ninner in 0..leaves.len() - 1 {
        let a = take(leaves, &inner_buf[..ninner], &mut li, &mut ii);
        let b = take(leaves, &inner_buf[..ninner], &mut li, &mut ii);
        parent[a.1] = next;
        parent[b.1] = next;
        inner_buf[ninner] = (a.0 + b.0, next);
        next += 1;
    }
    let mut lens = [0u8; 256];
    let root = next - 1;
    let mut depth = [0u32; 512];
    for node in (256..root).rev() {
        depth[node] = depth[parent[node]] + 1;
    }
    for &(_, s) in leaves.iter() {
        let d = depth[parent[s]] + 1;
        lens[s] = d.min(255) as u8;
    }
    lens
}

/// Canonical codes (bit-reversed, ready to write LSB first) of `lens`.
fn canonical(lens: &[u8; 256]) -> [u16; 256] {
    let mut codes = [0u16; 256];
    let mut code = 0u32;
    let mut prev = 0u32;
    for len in 1..=MAX_LEN {
        for s in 0..256 {
            if lens[s] as u32 == len {
                code <<= len - prev;
                prev = len;
                codes[s] = (code.reverse_bits() >> (32 - len)) as u16;
                code += 1;
            }
        }
    }
    codes
}

/// Entropy-code the symbols `syms` into `out` (at least [`max_len`]`(syms.len())` bytes),
/// in the smallest of the three modes, with streams aligned to `align` symbols (at
/// least 1); returns the bytes written. The same bytes on every backend (each runs one
/// definition, built for its instruction set).
pub fn encode(syms: &[u8], align: usize, out: &mut [u8]) -> usize {
    call!(entropy_encode(syms, align, None, out))
}

/// [`encode`] with the code lengths made from `estimate` instead of counts: how often
/// each symbol occurs, roughly, nonzero for every symbol that occurs (a symbol that
/// does not occur may have a code too; it then costs a little code space). For a
/// caller that knows the symbols' spread without counting every one: the streams are
/// sized as they are written. Falls back to the stored mode where the streams would
/// not be smaller.
pub fn encode_estimated(syms: &[u8], align: usize, estimate: &[u64; 256], out: &mut [u8]) -> usize {
    call!(entropy_encode(syms, align, Some(estimate), out))
}

simd_op!(encode_on => EncodeOp {
    syms: &'a [u8], align: usize, estimate: Option<&'a [u64; 256]>, out: &'a mut [u8],
} -> usize = encode_with(syms, align, estimate, out));

/// [`encode`]'s definition (with `estimate`, [`encode_estimated`]'s), inlined into each
/// backend's build.
#[inline(always)]
pub(super) fn encode_with(
    syms: &[u8],
    align: usize,
    estimate: Option<&[u64; 256]>,
    out: &mut [u8],
) -> usize {
    let n = syms.len();
    let bounds = quarters(n, align);
    let (h, hq) = match estimate {
        Some(e) => {
            debug_assert!(
                syms.iter().all(|&s| e[s as usize] > 0),
                "an estimate for each symbol"
            );
            (*e, None)
        }
        None => {
            let hq = histograms(bounds, syms);
            let h: [u64; 256] = std::array::from_fn(|s| hq.iter().map(|q| q[s]).sum());
            (h, Some(hq))
        }
    };
    let used = h.iter().filter(|&&c| c > 0).count();
    if used == 1 {
        out[0] = ONE;
        out[1] = syms[0];
        return 2;
    }
    let stored = 1 + n;
    let store = |out: &mut [u8]| {
        out[0] = STORED;
        out[1..stored].copy_from_slice(syms);
        stored
    };
    if used == 0 || n < HUFFMAN_HEADER {
        return store(out);
    }
    let lens = code_lengths(&h);
    // Counted: the streams' lengths are known before they are written.
    let counted = hq.map(|hq| hq.map(|q| (0..256).map(|s| q[s] * lens[s] as u64).sum::<u64>()));
    let counted = counted.map(|bits| bits.map(|b| b.div_ceil(8) as usize));
    if let Some(sizes) = counted
        && HUFFMAN_HEADER + sizes.iter().sum::<usize>() >= stored
    {
        return store(out);
    }
    // Smaller than stored: the streams end by byte `n` of the block.
    let Some(sizes) = write_streams(syms, bounds, &lens, &mut out[HUFFMAN_HEADER..n]) else {
        return store(out);
    };
    debug_assert!(counted.is_none_or(|c| c == sizes), "the counted lengths");
    out[0] = HUFFMAN;
    for k in 0..128 {
        out[1 + k] = lens[2 * k] | (lens[2 * k + 1] << 4);
    }
    for (j, &size) in sizes.iter().enumerate() {
        out[129 + 4 * j..133 + 4 * j].copy_from_slice(&(size as u32).to_le_bytes());
    }
    HUFFMAN_HEADER + sizes.iter().sum::<usize>()
}

/// Write the four streams of `syms` (quarters `bounds`) with the codes of lengths `lens`
/// back to back into `room`; their byte lengths, or `None` where they do not fit.
#[inline(always)]
fn write_streams(
    syms: &[u8],
    bounds: [(usize, usize); 4],
    lens: &[u8; 256],
    room: &mut [u8],
) -> Option<[usize; 4]> {
    let codes = canonical(lens).map(u64::from);
    let lens = lens.map(u64::from);
    let mut sizes = [0; 4];
    let mut at = 0;
    for (j, (lo, hi)) in bounds.into_iter().enumerate() {
        let mut w = Writer::new(room.get_mut(at..)?);
        // Five symbols at a time while there is room for a whole word (one word written
        // per five codes; what it writes past the stream's end, the next stream
        // overwrites); then to its end.
        let q = &syms[lo..hi];
        let (fives, _) = q.as_chunks::<5>();
        let mut i = 0;
        for &five in fives {
            if w.pos + 8 > w.out.len() {
                break;
            }
            w.put5(five, &codes, &lens);
            i += 5;
        }
        sizes[j] = w.finish(&q[i..], &codes, &lens)?;
        at += sizes[j];
    }
    Some(sizes)
}

/// An LSB-first bit writer of one stream into the room from its start on.
struct Writer<'a> {
    out: &'a mut [u8],
    acc: u64,
    /// Bits in `acc` not yet written whole (at most 7 between calls).
    nacc: u32,
    pos: usize,
}

impl<'a> Writer<'a> {
    #[inline(always)]
    fn new(out: &'a mut [u8]) -> Writer<'a> {
        Writer {
            out,
            acc: 0,
            nacc: 0,
            pos: 0,
        }
    }

    /// The codes of five symbols (at most 55 bits beside at most 7 pending), then the
    /// whole bytes written: one word stored; needs 8 bytes of room at `pos`.
    #[inline(always)]
    fn put5(&mut self, syms: [u8; 5], codes: &[u64; 256], lens: &[u64; 256]) {
        // The five joined first, apart from the pending bits: the chain from one call
        // to the next is then one shift, one or and one add.
        let c = syms.map(|s| codes[s as usize]);
        let l = syms.map(|s| lens[s as usize]);
        let (l01, l23) = (l[0] + l[1], l[2] + l[3]);
        let joined = c[0] | c[1] << l[0] | c[2] << l01 | c[3] << (l01 + l[2]) | c[4] << (l01 + l23);
        let acc = self.acc | joined << self.nacc;
        let nacc = self.nacc as u64 + (l01 + l23 + l[4]);
        let at = self.pos;
        self.out[at..at + 8].copy_from_slice(&acc.to_le_bytes());
        self.pos = at + (nacc / 8) as usize;
        // At most 62 bits were pending: a shift of at most 56.
        self.acc = acc >> (nacc & !7);
        self.nacc = (nacc & 7) as u32;
    }

    /// The codes of `syms`, then the last partial byte: the stream's length, or `None`
    /// where `out` has no room for it.
    #[inline(always)]
    fn finish(&mut self, syms: &[u8], codes: &[u64; 256], lens: &[u64; 256]) -> Option<usize> {
        for &s in syms {
            self.acc |= codes[s as usize] << self.nacc;
            self.nacc += lens[s as usize] as u32;
            while self.nacc >= 8 {
                *self.out.get_mut(self.pos)? = self.acc as u8;
                self.pos += 1;
                self.acc >>= 8;
                self.nacc -= 8;
            }
        }
        if self.nacc > 0 {
            *self.out.get_mut(self.pos)? = self.acc as u8;
            self.pos += 1;
        }
        Some(self.pos)
    }
}

fn corrupt(at: usize, reason: impl Into<String>) -> Refused {
    (at, reason.into())
}

/// A coded block of `n` symbols, checked whole by [`Block::open`]: reading it cannot
/// fail.
pub struct Block<'a> {
    kind: Kind<'a>,
    /// The Huffman decode table (zeros in the other modes).
    table: [u16; 1 << MAX_LEN],
    /// Up to three symbols per lookup (see [`multi_table`]; zeros in the other modes).
    multi: [u32; 1 << MAX_LEN],
    /// Whether a lookup in `multi` takes 1.75 symbols or more on average (else decoding
    /// takes one symbol per lookup, in a loop with no data-dependent stores).
    use_multi: bool,
    /// The Huffman code lengths (zeros in the other modes).
    lens: [u8; 256],
    n: usize,
    align: usize,
    len: usize,
    /// The last symbol, if `n > 0`.
    last: Option<u8>,
}

enum Kind<'a> {
    Stored(&'a [u8]),
    One(u8),
    Huffman([&'a [u8]; 4]),
}

impl<'a> Block<'a> {
    /// Check the coded block of `n` symbols, streams aligned to `align` (at least 1), at
    /// the start of `p`: its mode, its code lengths and every stream, decoded once (the
    /// symbols dropped, but the last). Reading it then cannot fail.
    pub fn open(p: &'a [u8], n: usize, align: usize) -> Result<Block<'a>, Refused> {
        let mut b = Block::parse(p, n, align)?;
        b.check()?;
        Ok(b)
    }

    /// [`Block::parse`] in write mode (a caller that may write before an error), else
    /// [`Block::open`]: for a decoder of mode `M` (`kernels::mode`).
    pub fn for_mode<const M: u8>(
        p: &'a [u8],
        n: usize,
        align: usize,
    ) -> Result<Block<'a>, Refused> {
        if M == super::mode::WRITE {
            Block::parse(p, n, align)
        } else {
            Block::open(p, n, align)
        }
    }

    /// Read the header of the coded block of `n` symbols, streams aligned to `align`, at
    /// the start of `p`: its mode, code lengths and stream lengths, but not the streams,
    /// which [`Block::for_each_chunk`] then checks as it decodes them (a caller that may
    /// write before an error), and whose last symbol [`Block::last`] does not know.
    pub fn parse(p: &'a [u8], n: usize, align: usize) -> Result<Block<'a>, Refused> {
        let mut table = [0u16; 1 << MAX_LEN];
        let mut multi = [0u32; 1 << MAX_LEN];
        let mut use_multi = false;
        let mut lens = [0u8; 256];
        let mut last = None;
        let (kind, len) = match p.first() {
            Some(&STORED) => {
                let s = p
                    .get(1..1 + n)
                    .ok_or_else(|| corrupt(1, "entropy block: stored bytes cut short"))?;
                last = s.last().copied();
                (Kind::Stored(s), 1 + n)
            }
            Some(&ONE) => {
                let &s = p
                    .get(1)
                    .ok_or_else(|| corrupt(1, "entropy block: symbol missing"))?;
                last = (n > 0).then_some(s);
                (Kind::One(s), 2)
            }
            Some(&HUFFMAN) => {
                let h = Self::huffman(p, &mut table, &mut lens)?;
                multi = multi_table(&table);
                // Stream bits are near uniform, so the mean over the entries is the mean
                // symbols per lookup.
                let symbols: u32 = multi.iter().map(|e| e >> 30).sum();
                use_multi = symbols >= (7 << MAX_LEN) / 4;
                h
            }
            Some(&m) => return Err(corrupt(0, format!("entropy block: unknown mode {m}"))),
            None => return Err(corrupt(0, "entropy block: empty")),
        };
        Ok(Block {
            kind,
            table,
            multi,
            use_multi,
            lens,
            n,
            align,
            len,
            last,
        })
    }

    fn huffman(
        p: &'a [u8],
        table: &mut [u16; 1 << MAX_LEN],
        lens: &mut [u8; 256],
    ) -> Result<(Kind<'a>, usize), Refused> {
        let head = p
            .get(..HUFFMAN_HEADER)
            .ok_or_else(|| corrupt(0, "entropy block: Huffman header cut short"))?;
        for k in 0..128 {
            lens[2 * k] = head[1 + k] & 15;
            lens[2 * k + 1] = head[1 + k] >> 4;
        }
        *table = decode_table(lens)?;
        let sizes: [usize; 4] = std::array::from_fn(|j| {
            let b = &head[129 + 4 * j..133 + 4 * j];
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
        });
        let rest = &p[HUFFMAN_HEADER..];
        let total = sizes
            .iter()
            .try_fold(0usize, |a, &s| a.checked_add(s))
            .filter(|&s| s <= rest.len())
            .ok_or_else(|| corrupt(129, "entropy block: stream lengths beyond the frame"))?;
        let mut at = 0;
        let streams: [&[u8]; 4] = std::array::from_fn(|j| {
            at += sizes[j];
            &rest[at - sizes[j]..at]
        });
        Ok((Kind::Huffman(streams), HUFFMAN_HEADER + total))
    }

    /// Decode every stream once, the symbols dropped but the last, and check where each
    /// ends.
    fn check(&mut self) -> Result<(), Refused> {
        if !matches!(self.kind, Kind::Huffman(_)) {
            return Ok(());
        }
        let (mut last, n) = (None, self.n);
        self.for_each_chunk(PIECE, |start, syms| {
            if start + syms.len() == n {
                last = syms.last().copied();
            }
        })?;
        self.last = last;
        Ok(())
    }

    /// Bytes the block takes.
    pub fn bytes(&self) -> usize {
        self.len
    }

    /// The last symbol (`None` for a block of no symbols, or a Huffman block only
    /// parsed).
    pub fn last(&self) -> Option<u8> {
        self.last
    }

    /// Which symbols the block may hold: those with a code (Huffman), the one symbol, or
    /// the stored bytes (scanned).
    pub fn alphabet(&self) -> [bool; 256] {
        let mut a = [false; 256];
        match &self.kind {
            Kind::Stored(s) => s.iter().for_each(|&b| a[b as usize] = true),
            Kind::One(sym) => a[*sym as usize] = self.n > 0,
            Kind::Huffman(_) => {
                for (a, &l) in a.iter_mut().zip(&self.lens) {
                    *a = l > 0;
                }
            }
        }
        a
    }

    /// Decode the symbols in pieces of at most `piece` (at most [`PIECE`], a multiple of
    /// the block's alignment), in some order: `f(start, symbols)` for each piece,
    /// `symbols` being symbols `start .. start + len`. Every piece starts on a multiple
    /// of the alignment. Then check where each stream ends: an error only for a block
    /// [`Block::parse`]d and not opened, after every piece was handed over.
    pub fn for_each_chunk(
        &self,
        piece: usize,
        mut f: impl FnMut(usize, &[u8]),
    ) -> Result<(), Refused> {
        let n = self.n;
        let piece = piece.clamp(1, PIECE);
        match &self.kind {
            Kind::Stored(s) => {
                for (c, bytes) in s.chunks(piece).enumerate() {
                    f(c * piece, bytes);
                }
            }
            Kind::One(sym) => {
                let run = [*sym; PIECE];
                for start in (0..n).step_by(piece) {
                    f(start, &run[..piece.min(n - start)]);
                }
            }
            Kind::Huffman(streams) => {
                let (table, multi) = (&self.table, &self.multi);
                // Where each stream's next code starts, in bits.
                let mut bits = [0u64; 4];
                let bounds = quarters(n, self.align);
                // A lookup writes three symbols and keeps one to three (the loop leaves
                // room for them).
                let mut bufs = [[0u8; PIECE]; 4];
                let q = bounds[0].1;
                for start in (0..q).step_by(piece) {
                    let lens = bounds.map(|(lo, hi)| (hi - lo).saturating_sub(start).min(piece));
                    // The four streams in step (their chains of lookups interleave) while
                    // each has room; then each on its own, a symbol at a time.
                    let k = if self.use_multi {
                        multi4(*streams, &mut bits, multi, &mut bufs, lens)
                    } else {
                        let both = lens[3] / 5 * 5;
                        let mut k = 0;
                        while k < both {
                            let mut five = [[0u8; 5]; 4];
                            step4(streams, &mut bits, table, &mut five);
                            for (b, v) in bufs.iter_mut().zip(&five) {
                                b[k..k + 5].copy_from_slice(v);
                            }
                            k += 5;
                        }
                        [k; 4]
                    };
                    for j in 0..4 {
                        for s in &mut bufs[j][k[j]..lens[j]] {
                            *s = next(streams[j], &mut bits[j], table);
                        }
                        if lens[j] > 0 {
                            f(bounds[j].0 + start, &bufs[j][..lens[j]]);
                        }
                    }
                }
                return finish(streams, &bits);
            }
        }
        Ok(())
    }
}

/// Check that every stream of a Huffman block ended exactly where its last code did
/// (`bits`: where each one's next code would start).
fn finish(streams: &[&[u8]; 4], bits: &[u64; 4]) -> Result<(), Refused> {
    let mut at = HUFFMAN_HEADER;
    for (j, (s, &bit)) in streams.iter().zip(bits).enumerate() {
        end(s, bit).map_err(|why| corrupt(at, format!("entropy block: stream {j}: {why}")))?;
        at += s.len();
    }
    Ok(())
}

/// Where the four streams' symbols lie among `n`: `j q .. min((j + 1) q, n)`, `q`
/// being `ceil(n / 4)` rounded up to a multiple of `align`.
pub fn quarters(n: usize, align: usize) -> [(usize, usize); 4] {
    let align = align.max(1);
    let q = n.div_ceil(4).div_ceil(align).saturating_mul(align);
    std::array::from_fn(|j| ((j * q).min(n), ((j + 1) * q).min(n)))
}

/// Five symbols from each of the four streams (at bits `bits`, moved on) into `out[j]`
/// (the four chains of lookups interleave).
#[inline(always)]
fn step4(
    streams: &[&[u8]; 4],
    bits: &mut [u64; 4],
    table: &[u16; 1 << MAX_LEN],
    out: &mut [[u8; 5]; 4],
) {
    let mut acc: [u64; 4] = std::array::from_fn(|j| peek(streams[j], bits[j]));
    for i in 0..5 {
        for (j, o) in out.iter_mut().enumerate() {
            let e = table[(acc[j] & ((1 << MAX_LEN) - 1)) as usize];
            acc[j] >>= e >> 8;
            bits[j] += (e >> 8) as u64;
            o[i] = e as u8;
        }
    }
}

/// Decode the four streams (at bits `bits`, moved on) with multi-symbol lookups into
/// `bufs`, five lookups per refill, while every stream has room for five more of three
/// symbols (`lens[j]` symbols in all); returns how many each decoded. A table operation,
/// so that each backend's build has its shifts (BMI2's on x86-64).
fn multi4(
    streams: [&[u8]; 4],
    bits: &mut [u64; 4],
    multi: &[u32; 1 << MAX_LEN],
    bufs: &mut [[u8; PIECE]; 4],
    lens: [usize; 4],
) -> [usize; 4] {
    call!(entropy_multi4(streams, bits, multi, bufs, lens))
}

simd_op!(multi4_on => Multi4 {
    streams: [&'a [u8]; 4], bits: &'a mut [u64; 4], multi: &'a [u32; 1 << MAX_LEN],
    bufs: &'a mut [[u8; PIECE]; 4], lens: [usize; 4],
} -> [usize; 4] = multi4_with(streams, bits, multi, bufs, lens));

/// [`multi4`]'s definition.
#[inline(always)]
pub(super) fn multi4_with(
    streams: [&[u8]; 4],
    bits: &mut [u64; 4],
    multi: &[u32; 1 << MAX_LEN],
    bufs: &mut [[u8; PIECE]; 4],
    lens: [usize; 4],
) -> [usize; 4] {
    // The streams by reference: slices held whole in registers would crowd out the
    // loop's twelve counters.
    let [r0, r1, r2, r3] = streams.each_ref();
    let [b0, b1, b2, b3] = bufs;
    let lens = lens.map(|l| l.min(PIECE));
    let (mut k0, mut k1, mut k2, mut k3) = (0usize, 0usize, 0usize, 0usize);
    // One lookup in `$acc` (a refill of stream bits) into `$b` at `$k`: four bytes
    // written, one to three symbols kept.
    macro_rules! take {
        ($acc:ident, $b:ident, $k:ident) => {
            let e = multi[($acc & ((1 << MAX_LEN) - 1)) as usize];
            // A shift takes the low six bits of its count: the length's four and two
            // zeros.
            $acc = $acc.wrapping_shr(e >> 24);
            // SAFETY: every loop below looks up while `$k + 4 <= lens[j] <= PIECE`
            // (those of five lookups start at `$k + 16 <= lens[j]`, and a lookup moves
            // `$k` on by at most 3): each store's four bytes lie within `$b`, which is
            // `PIECE` long.
            unsafe {
                $b.as_mut_ptr()
                    .add($k)
                    .cast::<[u8; 4]>()
                    .write_unaligned(e.to_le_bytes())
            };
            $k += (e >> 30) as usize;
        };
    }
    // A refill's top bit is a mark (at most five lookups take at most 55 of its at least
    // 57 bits, so bit 63 is not one of theirs): however far they shift it down, its
    // leading zeros are the bits they took. The chains keep no bit positions.
    const MARK: u64 = 1 << 63;
    let [mut t0, mut t1, mut t2, mut t3] = *bits;
    while k0 + 16 <= lens[0] && k1 + 16 <= lens[1] && k2 + 16 <= lens[2] && k3 + 16 <= lens[3] {
        let (mut a0, mut a1) = (peek(r0, t0) | MARK, peek(r1, t1) | MARK);
        let (mut a2, mut a3) = (peek(r2, t2) | MARK, peek(r3, t3) | MARK);
        for _ in 0..5 {
            take!(a0, b0, k0);
            take!(a1, b1, k1);
            take!(a2, b2, k2);
            take!(a3, b3, k3);
        }
        t0 += u64::from(a0.leading_zeros());
        t1 += u64::from(a1.leading_zeros());
        t2 += u64::from(a2.leading_zeros());
        t3 += u64::from(a3.leading_zeros());
    }
    let t = [t0, t1, t2, t3];
    // The streams drift apart (a lookup takes one to three symbols): each goes on alone
    // while it has room, so that few symbols are left to the one-symbol loop.
    macro_rules! drain {
        ($r:ident, $b:ident, $k:ident, $j:expr) => {
            let (len, mut t) = (lens[$j], t[$j]);
            while $k + 16 <= len {
                let mut a = peek($r, t) | MARK;
                for _ in 0..5 {
                    take!(a, $b, $k);
                }
                t += u64::from(a.leading_zeros());
            }
            while $k + 4 <= len {
                let mut a = peek($r, t) | MARK;
                take!(a, $b, $k);
                t += u64::from(a.leading_zeros());
            }
            bits[$j] = t;
        };
    }
    drain!(r0, b0, k0, 0);
    drain!(r1, b1, k1, 1);
    drain!(r2, b2, k2, 2);
    drain!(r3, b3, k3, 3);
    [k0, k1, k2, k3]
}

/// The multi-symbol decode table: for the next MAX_LEN stream bits, the symbols of the
/// codes that lie whole within them, up to three: symbols in bits 0..24 (the first in the
/// low byte), their total length in bits 24..28 (bits 28 and 29 zero) and their count in
/// bits 30..32. A complete code always has the first.
fn multi_table(table: &[u16; 1 << MAX_LEN]) -> [u32; 1 << MAX_LEN] {
    std::array::from_fn(|i| {
        let (mut e, mut used, mut count) = (0u32, 0u32, 0u32);
        while count < 3 {
            let t = table[(i >> used) & ((1 << MAX_LEN) - 1)];
            let l = (t >> 8) as u32;
            if used + l > MAX_LEN {
                break;
            }
            e |= ((t & 0xFF) as u32) << (8 * count);
            used += l;
            count += 1;
        }
        e | used << 24 | count << 30
    })
}

/// Decode table: entry for the next MAX_LEN stream bits = symbol | length << 8.
fn decode_table(lens: &[u8; 256]) -> Result<[u16; 1 << MAX_LEN], Refused> {
    let mut kraft = 0u64;
    let mut used = 0;
    for &l in lens.iter() {
        if l as u32 > MAX_LEN {
            return Err(corrupt(
                1,
                format!("entropy block: code length {l} over {MAX_LEN}"),
            ));
        }
        if l > 0 {
            kraft += 1 << (MAX_LEN - l as u32);
            used += 1;
        }
    }
    if used < 2 || kraft != 1 << MAX_LEN {
        return Err(corrupt(
            1,
            "entropy block: code lengths do not make a complete prefix code",
        ));
    }
    let codes = canonical(lens);
    let mut table = [0u16; 1 << MAX_LEN];
    for s in 0..256 {
        let l = lens[s] as u32;
        if l == 0 {
            continue;
        }
        let e = s as u16 | ((l as u16) << 8);
        let mut k = codes[s] as usize;
        while k < table.len() {
            table[k] = e;
            k += 1 << l;
        }
    }
    Ok(table)
}

/// Stream `s`'s bits from bit `bit` on, LSB first: at least 57 of them (zeros past the
/// end).
#[inline(always)]
fn peek(s: &[u8], bit: u64) -> u64 {
    let i = (bit >> 3) as usize;
    let w = match s.get(i..i + 8) {
        Some(w) => u64::from_le_bytes(w.try_into().expect("8 bytes")),
        None => {
            let rest = s.get(i..).unwrap_or_default();
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            u64::from_le_bytes(w)
        }
    };
    w >> (bit & 7)
}

/// The symbol whose code starts at bit `*bit` of stream `s`; `*bit` moved past it.
#[inline(always)]
fn next(s: &[u8], bit: &mut u64, table: &[u16; 1 << MAX_LEN]) -> u8 {
    let e = table[(peek(s, *bit) & ((1 << MAX_LEN) - 1)) as usize];
    *bit += (e >> 8) as u64;
    e as u8
}

/// Stream `s`, its codes ending at bit `bit`, must end at its last code's byte, padded
/// with zero bits.
fn end(s: &[u8], bit: u64) -> Result<(), &'static str> {
    let len = s.len() as u64;
    if bit > 8 * len {
        return Err("it ends before its symbols");
    }
    if bit.div_ceil(8) != len {
        return Err("bytes past its last code");
    }
    let pad = (8 * len - bit) as u32;
    if pad > 0 && s[len as usize - 1] >> (8 - pad) != 0 {
        return Err("nonzero padding bits");
    }
    Ok(())
}
