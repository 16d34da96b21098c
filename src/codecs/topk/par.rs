//! Writing a top-k frame from its kept candidates, and updating the error-feedback
//! residual from it, on all threads.
//!
//! The kept candidates (indices ascending, with their values' bits) are cut into at most
//! [`MAX_PARTS`] parts of whole int8 value blocks. Each part's values go to their own
//! bytes of the value section. The index stream is written in parts too: a first parallel
//! step measures each part's bits (a Rice code's length is `(gap >> b) + b + 1`, a fixed
//! width's is the width), so each part knows the bit at which its codes start; each part
//! then writes the bytes from that bit's byte on, with the bits before it in that byte as
//! zeros, and hands its last, partial byte back to be OR-ed into the next part's first
//! byte. The bytes are those the sequential writer produces, for any number of threads:
//! the parts depend only on the candidate count.

use super::IndexCoding;
use super::index::{IndexSink, gap_bits};
use crate::codecs::values::{INT8_VALUE_BLOCK, ValueSlab, ValueType};
use crate::kernels::scalar::{BitWriter, mode, put};
use crate::parallel;

/// Most parts (their bit counts live on the stack).
const MAX_PARTS: usize = 64;

/// Fewest candidates per part: a part's work is a few nanoseconds per candidate, and
/// handing it to another thread costs about 10 us.
const MIN_PART: usize = 8192;

/// Whether `k` kept candidates are written (and the residual updated) on all threads:
/// with more than one thread, from 64 Ki of them (a candidate costs about 32 elements of
/// a pass; [`parallel::min_len`] scales this).
pub(super) fn worth(k: usize) -> bool {
    parallel::worth(k.saturating_mul(32), 1)
}

/// Candidates per part for `k` kept ones: whole int8 value blocks, at most
/// [`MAX_PARTS`] parts.
fn part_len(k: usize) -> usize {
    k.div_ceil(MAX_PARTS)
        .max(MIN_PART)
        .next_multiple_of(INT8_VALUE_BLOCK)
}

/// One part of the frame being written.
struct Part<'a> {
    /// Its candidates' indices and value bits.
    idx: &'a [u32],
    bits: &'a [u32],
    /// One past the index kept before it (0 for the first part).
    next: usize,
    values: ValueSlab<'a>,
    /// Its index bytes, from the byte holding its first bit; `lead` bits of that byte
    /// belong to the part before.
    stream: &'a mut [u8],
    lead: u32,
    last: bool,
    /// Results: the partial byte it hands on, and NaN or ±Inf among its values.
    tail: u8,
    nonfinite: bool,
}

/// Writes the values of the kept candidates (`idx`, `bits`) into `vals` (their section,
/// `idx.len()` values) and their indices into `stream` (coded as `coding` with its
/// parameter, `param`), on all threads. Returns whether a value was NaN or ±Inf and the
/// index bytes written; `None`, with nothing written, if the stream does not fit (the
/// caller's bound was short) or the coding is a bitmap.
pub(super) fn write(
    t: ValueType,
    vals: &mut [u8],
    stream: &mut [u8],
    coding: IndexCoding,
    param: u32,
    (idx, bits): (&[u32], &[u32]),
) -> Option<(bool, usize)> {
    if coding == IndexCoding::Bitmap {
        return None;
    }
    let k = idx.len();
    let len = part_len(k);
    let parts = k.div_ceil(len);
    // The bits of each part's codes, measured in parallel.
    let mut sizes = [(0usize, 0u64); MAX_PARTS];
    for (p, s) in sizes[..parts].iter_mut().enumerate() {
        s.0 = p;
    }
    // One past the index kept before position j0 (0 for the first).
    let next_of = |j0: usize| if j0 == 0 { 0 } else { idx[j0 - 1] as usize + 1 };
    parallel::each_mut(&mut sizes[..parts], true, &|(p, bits)| {
        let j0 = *p * len;
        let mut next = next_of(j0);
        *bits = 0;
        for &i in &idx[j0..(j0 + len).min(k)] {
            *bits += gap_bits(coding, param, (i as usize - next) as u64);
            next = i as usize + 1;
        }
    });
    let total: u64 = sizes[..parts].iter().map(|s| s.1).sum();
    if total.div_ceil(8) > stream.len() as u64 {
        return None;
    }
    let stream = &mut stream[..total.div_ceil(8) as usize];
    // Cut the candidates, the value section and the stream into the parts.
    let mut list: [Option<Part>; MAX_PARTS] = [const { None }; MAX_PARTS];
    let (mut values, mut rest, mut at) = (t.slab(vals, k), &mut *stream, 0u64);
    let mut byte0 = 0usize;
    for p in 0..parts {
        let j0 = p * len;
        let j1 = (j0 + len).min(k);
        let (v, v_rest) = values.split_at(j1 - j0);
        values = v_rest;
        let end = at + sizes[p].1;
        // This part's bytes end where the next part's first byte starts.
        let last = p + 1 == parts;
        let cut = if last {
            rest.len()
        } else {
            (end / 8) as usize - byte0
        };
        let (s, s_rest) = rest.split_at_mut(cut);
        rest = s_rest;
        list[p] = Some(Part {
            idx: &idx[j0..j1],
            bits: &bits[j0..j1],
            next: next_of(j0),
            values: v,
            stream: s,
            lead: (at % 8) as u32,
            last,
            tail: 0,
            nonfinite: false,
        });
        byte0 += cut;
        at = end;
    }
    parallel::each_mut(&mut list[..parts], true, &|part| {
        let part = part.as_mut().expect("every part is set");
        let mut batch = [0f32; INT8_VALUE_BLOCK];
        for (j, b) in part.bits.chunks(INT8_VALUE_BLOCK).enumerate() {
            let batch = &mut batch[..b.len()];
            for (v, &b) in batch.iter_mut().zip(b) {
                *v = f32::from_bits(b);
            }
            part.nonfinite |= part.values.put(j * INT8_VALUE_BLOCK, batch);
        }
        let w = BitWriter::with_lead(&mut *part.stream, part.lead);
        let mut sink = IndexSink::Stream(w, coding, param);
        let mut next = part.next;
        for &i in part.idx {
            sink.push(i as usize, next);
            next = i as usize + 1;
        }
        let IndexSink::Stream(w, ..) = sink else {
            unreachable!("made as a stream")
        };
        if part.last {
            w.finish();
        } else {
            part.tail = w.finish_open();
        }
    });
    // Each part's partial last byte into the next part's first byte.
    let (mut nonfinite, mut tails) = (false, [0u8; MAX_PARTS]);
    for (p, t) in list[..parts].iter().flatten().zip(&mut tails) {
        nonfinite |= p.nonfinite;
        *t = p.tail;
    }
    let mut at = 0u64;
    for (size, &tail) in sizes[..parts - 1].iter().zip(&tails) {
        at += size.1;
        stream[(at / 8) as usize] |= tail;
    }
    Some((nonfinite, total.div_ceil(8) as usize))
}

/// The error-feedback residual update of the kept candidates' indices `idx` from the
/// frame's value section `vals` (`idx.len()` values of type `t`): `r[i]` becomes the
/// residual of its formed value and the decoded one, as decoding the frame onto `r` in
/// residual mode does for the kept elements. In parts on all threads when they are many
/// ([`worth`]), else in one.
pub(super) fn residual(t: ValueType, vals: &[u8], idx: &[u32], r: &mut [f32]) {
    let k = idx.len();
    let len = part_len(k);
    let parts = k.div_ceil(len);
    let mut list: [Option<(usize, usize, &mut [f32])>; MAX_PARTS] = [const { None }; MAX_PARTS];
    let (mut rest, mut base) = (r, 0usize);
    for (p, slot) in list[..parts].iter_mut().enumerate() {
        let j0 = p * len;
        let end = if p + 1 == parts {
            base + rest.len()
        } else {
            idx[j0 + len] as usize
        };
        let (head, tail) = rest.split_at_mut(end - base);
        *slot = Some((j0, base, head));
        rest = tail;
        base = end;
    }
    parallel::each_mut(&mut list[..parts], worth(k), &|slot| {
        let (j0, base, r) = slot.as_mut().expect("every part is set");
        let part = &idx[*j0..(*j0 + len).min(k)];
        let mut batch = [0f32; INT8_VALUE_BLOCK];
        for (j, ix) in part.chunks(INT8_VALUE_BLOCK).enumerate() {
            let batch = &mut batch[..ix.len()];
            t.get_slice(vals, k, *j0 + j * INT8_VALUE_BLOCK, batch);
            for (&i, &v) in ix.iter().zip(batch.iter()) {
                put::<{ mode::RESIDUAL }>(&mut r[i as usize - *base], v);
            }
        }
    });
}
