//! [`BucketGather`]: the all-gather of a bucket of tensors whose frames the caller made,
//! each tensor with a codec of its own, summed per tensor in rank order.
//!
//! [`super::AllReduce`] owns its tensor's codec, seeds and residuals. A training stack
//! that groups many parameters into one bucket (PyTorch DDP does) often wants a codec per
//! parameter (a small bias sent as it is, a matrix as int8) and keeps its residuals per
//! parameter, so that they survive a regrouping of the buckets. Then the caller encodes,
//! and this collective moves and sums: every rank sends one message, its frames for the
//! bucket's tensors concatenated in tensor order; the messages travel round the ring as
//! the frame all-gather's do; and each tensor's `p` frames are summed into its place in
//! the output in one fused pass ([`crate::reduce_frames`]), frame of rank 0 first. Every
//! rank so ends with bit-identical output.

use core::ops::Range;

use super::comm::{Comm, ENVELOPE_LEN, Phase, Place};
use super::{ReduceOp, Stats, Strategy, Transport, peer_error, ring_gather};
use crate::codec::{Codec, CodecSpec, EncodeCtx};
use crate::codecs::reduce;
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;
use crate::kernels::mode::WRITE;
use crate::wire::{self, HEADER_LEN, Header};

/// One rank's state for all-gathering and summing buckets of frames (see the module
/// docs); one per bucket, or one for many buckets run one after another.
///
/// ```
/// use gradpack::collective::{BucketGather, ReduceOp, Transport, local};
/// use gradpack::{Codec, CodecSpec, EncodeCtx};
///
/// // Two tensors in one bucket: elements 0..6 sent as int8, 6..8 as they are.
/// let results = local::run(3, None, |mut t| {
///     let rank = t.rank();
///     let x: Vec<f32> = (0..8).map(|i| (i * (rank + 1)) as f32).collect();
///     let mut msg = Vec::new();
///     for (spec, part) in [("int8", &x[..6]), ("identity", &x[6..])] {
///         let codec: CodecSpec = spec.parse()?;
///         msg.extend(codec.encode(part, &EncodeCtx::new(7))?);
///     }
///     let mut g = BucketGather::new(&t, 0, ReduceOp::Sum)?;
///     let mut out = vec![0.0f32; 8];
///     g.run(&mut t, &msg, &[0..6, 6..8], None, &mut out)?;
///     Ok(out)
/// });
/// let outs: Vec<Vec<f32>> = results.into_iter().collect::<Result<_, _>>()?;
/// assert!(outs.iter().all(|o| o == &outs[0])); // the same bits on every rank
/// assert_eq!(outs[0][7], 42.0); // 7 + 14 + 21, sent exactly
/// # Ok::<(), gradpack::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct BucketGather {
    rank: usize,
    size: usize,
    tag: u32,
    op: ReduceOp,
    /// Every rank's message, envelope first, reused from call to call.
    msgs: Vec<Vec<u8>>,
}

impl BucketGather {
    /// The state of this rank of `transport`'s world. `tag` goes into every message's
    /// envelope (a bucket index, say: another collective's message where this one's is
    /// expected is then an error); `op` sums, or averages after summing. Every rank must
    /// use the same.
    pub fn new<T: Transport + ?Sized>(transport: &T, tag: u32, op: ReduceOp) -> Result<Self> {
        let (rank, size) = (transport.rank(), transport.size());
        if size == 0 || rank >= size {
            return Err(Error::Collective(format!(
                "transport reports rank {rank} in a world of {size}"
            )));
        }
        if u32::try_from(size).is_err() {
            return Err(Error::Collective(format!(
                "a world of {size} ranks does not fit the envelope's 32-bit fields"
            )));
        }
        let mut msgs = Vec::new();
        msgs.try_reserve_exact(size)
            .map_err(|_| Error::OutOfMemory {
                bytes: (size as u64).saturating_mul(24),
                what: "the bucket all-gather's messages",
            })?;
        msgs.resize_with(size, Vec::new);
        Ok(BucketGather {
            rank,
            size,
            tag,
            op,
            msgs,
        })
    }

    /// One all-gather: `message` is this rank's frames for the tensors at `segments` of
    /// `output` (element ranges, in order; frame `i` of `segments[i].len()` elements, each
    /// a whole frame as [`crate::Codec::encode`] makes it, sealed or not), concatenated.
    /// Every rank's messages are gathered, and `output[segments[i]]` is set to the sum of
    /// the ranks' frames `i`, in rank order (the mean, with [`ReduceOp::Mean`]). Elements
    /// outside the segments are not touched.
    ///
    /// `max_message` bounds every rank's message (the same on every rank: the sum of the
    /// codecs' [`crate::Codec::max_encoded_len`], sealed, for the segments' lengths, say):
    /// a peer's message announced longer is refused before anything is allocated for
    /// it, and so is this rank's own. `None` bounds it by what any codec can write for
    /// the segments, which is far looser (a `codebook` frame of blocks of one element
    /// takes 1 KiB per element).
    ///
    /// Every rank must call it with the same segments, in the same order as its other
    /// collectives on `comm`. Each call takes the next call number of `comm`, even one that
    /// fails at once on a bad argument. A message from a peer that does not split into
    /// whole frames of the segments' lengths is an error naming the rank that made it.
    /// After an error the output is unspecified.
    pub fn run<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        message: &[u8],
        segments: &[Range<usize>],
        max_message: Option<usize>,
        output: &mut [f32],
    ) -> Result<Stats> {
        let call = comm.begin();
        let _fp = crate::kernels::Standard::new();
        if comm.rank() != self.rank || comm.size() != self.size {
            return Err(Error::Collective(format!(
                "transport is rank {} of {}, but this bucket all-gather was built for rank {} of {}",
                comm.rank(),
                comm.size(),
                self.rank,
                self.size
            )));
        }
        for (i, s) in segments.iter().enumerate() {
            if s.start > s.end || s.end > output.len() {
                return Err(Error::Collective(format!(
                    "segment {i} ({}..{}) is not inside the output of {} elements",
                    s.start,
                    s.end,
                    output.len()
                )));
            }
        }
        // This rank's own message is checked as a peer's will check it (its sealed
        // payloads but for their checksums, which its encoder has just computed).
        check_message(message, segments, false)?;
        if let Some(m) = max_message.filter(|&m| message.len() > m) {
            return Err(Error::Collective(format!(
                "this rank's message of {} bytes is longer than the bound of {m} given for \
                 every rank's",
                message.len()
            )));
        }
        let (p, r) = (self.size, self.rank);
        let own = &mut self.msgs[r];
        own.clear();
        let len = ENVELOPE_LEN
            .checked_add(message.len())
            .ok_or(Error::OutOfMemory {
                bytes: u64::MAX,
                what: "the bucket all-gather's message",
            })?;
        own.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
            bytes: len as u64,
            what: "the bucket all-gather's message",
        })?;
        own.resize(ENVELOPE_LEN, 0);
        own.extend_from_slice(message);
        let mut stats = Stats {
            strategy: Strategy::CompressedAllGather,
            bytes_sent: 0,
            messages: 0,
        };
        let (tag, left) = (self.tag, (r + p - 1) % p);
        let max = ENVELOPE_LEN.saturating_add(max_message.unwrap_or_else(|| {
            segments
                .iter()
                .fold(0, |m: usize, s| m.saturating_add(any_frame_bound(s.len())))
        }));
        ring_gather(
            comm,
            &mut self.msgs,
            r,
            |q| q,
            |hop, q| Place {
                call,
                tag,
                phase: Phase::FrameAllGather,
                hop: hop as u32,
                chunk: q as u32,
                max,
            },
            &mut stats,
            |_, msg| check_message(msg, segments, true),
        )?;
        // Each tensor's frames, in rank order, summed in one fused pass. Every message was
        // checked whole above (sealed payloads included), so the frames are split without
        // verifying their checksums again.
        let mut at = vec![ENVELOPE_LEN; p];
        let mut split = reduce::frame_list(p)?;
        for seg in segments {
            split.clear();
            for (q, a) in at.iter_mut().enumerate() {
                let msg = &self.msgs[q];
                let n = frame_len_at(&msg[*a..])?;
                split.push(wire::split_with(&msg[*a..*a + n], false)?);
                *a += n;
            }
            reduce::reduce_split::<WRITE>(&split, &mut output[seg.clone()])
                .map_err(|(q, e)| peer_error(q, Phase::FrameAllGather, left, e))?;
            if self.op == ReduceOp::Mean {
                super::divide_by_ranks(&mut output[seg.clone()], p);
            }
        }
        Ok(stats)
    }

    /// Encode each of `parts` (a tensor of `x` at its range, with its codec and seed,
    /// through its error feedback where it has one; sealed with a payload CRC-32 when
    /// `checksum`) into one message, in order, and [`BucketGather::run`] it with the
    /// parts' ranges: each part's sum or mean over the ranks is written back into `x`.
    /// The message is bounded by the parts' longest frames, and so is a peer's. `send`
    /// is the caller's buffer for the message, kept between calls (it grows to the
    /// bound once). Every rank must pass the same ranges and codecs. On an error `x`
    /// and the residuals of the parts encoded before it are unspecified.
    pub fn encode_run<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        x: &mut [f32],
        parts: &mut [Part<'_>],
        checksum: bool,
        send: &mut Vec<u8>,
    ) -> Result<Stats> {
        match encode_parts(x, parts, checksum, send) {
            Ok((len, cap)) => {
                let ranges: Vec<Range<usize>> = parts.iter().map(|p| p.range.clone()).collect();
                self.run(comm, &send[..len], &ranges, Some(cap), x)
            }
            Err(e) => {
                comm.skip(); // the call's number is taken, as `run`'s is on an error
                Err(e)
            }
        }
    }
}

/// [`BucketGather::encode_run`]'s message written into `send`: its length and bound.
fn encode_parts(
    x: &[f32],
    parts: &mut [Part<'_>],
    checksum: bool,
    send: &mut Vec<u8>,
) -> Result<(usize, usize)> {
    let crc = if checksum { wire::PAYLOAD_CRC_LEN } else { 0 };
    let mut cap = 0usize;
    for (i, p) in parts.iter().enumerate() {
        if p.range.start > p.range.end || p.range.end > x.len() {
            return Err(Error::Collective(format!(
                "part {i} ({:?}) is not inside the bucket of {} elements",
                p.range,
                x.len()
            )));
        }
        if let Some(ef) = &p.feedback
            && (ef.codec() != p.codec || ef.len() != p.range.len())
        {
            return Err(Error::Collective(format!(
                "part {i}: its error feedback is for {} over {} elements, the part {} \
                     over {}",
                ef.codec(),
                ef.len(),
                p.codec,
                p.range.len()
            )));
        }
        cap = cap
            .checked_add(p.codec.max_encoded_len(p.range.len()) + crc)
            .ok_or_else(|| Error::Collective("a bucket's message overflows".into()))?;
    }
    crate::alloc::lengthen(send, cap, "a bucket's message")?;
    let mut at = 0;
    for p in parts.iter_mut() {
        let src = &x[p.range.clone()];
        let ctx = EncodeCtx::new(p.seed);
        let out = &mut send[at..at + p.codec.max_encoded_len(p.range.len()) + crc];
        let limit = out.len() - crc;
        let len = match &mut p.feedback {
            Some(ef) => ef.encode_into(src, &ctx, &mut out[..limit])?,
            None => {
                p.codec.check_encode(src.len(), &ctx)?;
                p.codec.encode_into(src, &ctx, &mut out[..limit])?
            }
        };
        at += if checksum { wire::seal(out, len)? } else { len };
    }
    Ok((at, cap))
}

impl BucketGather {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }
}

/// The length of the whole frame at the start of `buf` (its header read, its length
/// checked against what `buf` holds).
fn frame_len_at(buf: &[u8]) -> Result<usize> {
    let h = Header::parse(buf)?;
    let total = h.frame_len().unwrap_or(u64::MAX);
    if (buf.len() as u64) < total {
        return Err(Error::Truncated {
            needed: total,
            got: buf.len(),
        });
    }
    Ok(total as usize)
}

/// `msg` is whole frames, one per segment, of the segments' lengths, and nothing more
/// (sealed payloads' checksums verified if `verify`).
/// At least the bytes of a frame of `n` elements of any codec, sealed: a header, a
/// checksum and 1040 bytes per element (the widest, `codebook` with blocks of one
/// element, writes a table of 1 KiB per block) plus 4 KiB.
fn any_frame_bound(n: usize) -> usize {
    (HEADER_LEN + wire::PAYLOAD_CRC_LEN + 4096).saturating_add(n.saturating_mul(1040))
}

fn check_message(msg: &[u8], segments: &[Range<usize>], verify: bool) -> Result<()> {
    let mut at = 0;
    for (i, s) in segments.iter().enumerate() {
        let rest = &msg[at..];
        if rest.len() < HEADER_LEN {
            return Err(Error::Collective(format!(
                "the message holds {i} frames where the bucket has {} tensors",
                segments.len()
            )));
        }
        let n = frame_len_at(rest)?;
        let (h, _) = wire::split_with(&rest[..n], verify)?;
        if h.elements != s.len() as u64 {
            return Err(Error::Collective(format!(
                "frame {i} of the message has {} elements; its tensor has {}",
                h.elements,
                s.len()
            )));
        }
        at += n;
    }
    if at != msg.len() {
        return Err(Error::TrailingBytes {
            expected: at as u64,
            got: msg.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
// Buckets of one tensor are written `&[0..n]`, a slice of one range, as `run` takes them.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use crate::codec::{Codec, CodecSpec, EncodeCtx};
    use crate::collective::local;

    fn spec(s: &str) -> CodecSpec {
        s.parse().unwrap()
    }

    /// Rank `rank`'s input of `n` elements (basic arithmetic only: Miri perturbs the
    /// results of `sin` and its kind, so they could differ from call to call).
    fn input(rank: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7 + rank * 13) % 101) as f32 * 0.37 - 18.0) * (1.0 + rank as f32))
            .collect()
    }

    #[test]
    fn the_bound_on_a_peer_message_holds_every_codecs_widest_frames() {
        // The widest parameters of every codec: one element per block, every element
        // kept, the widest values and indices, tables per block.
        let widest = [
            "identity",
            "int8:block=1",
            "qsgd:bits=8,block=1",
            "sign:block=1",
            "ternary:block=1",
            "natural:block=1",
            "topk:ratio=1,values=f32",
            "topk:k=1000000,values=f32",
            "randk:ratio=1,values=f32",
            "dct:chunk=1,k=1",
            "fp8:block=1,scale=f32",
            "fp4:block=2,scale=f32",
            "codebook:block=1",
            "chunktopk:chunk=1,k=1",
        ];
        for s in widest {
            let c = spec(s);
            // Under Miri (interpreted), the small sizes only.
            let sizes: &[usize] = if cfg!(miri) {
                &[0, 1, 7]
            } else {
                &[0, 1, 2, 7, 64, 5000]
            };
            for &n in sizes {
                let x = input(1, n);
                let mut out = vec![0u8; c.max_encoded_len(n)];
                let len = c.encode_into(&x, &EncodeCtx::new(3), &mut out).unwrap();
                let sealed = wire::sealed_len(len);
                assert!(sealed <= any_frame_bound(n), "{s} n={n}: {sealed} bytes");
            }
        }
    }

    /// The bucket's segments and codecs: a mix of fixed-rate, sparse, sealed and empty.
    fn bucket() -> (Vec<Range<usize>>, Vec<(CodecSpec, bool)>) {
        let parts = [
            (1000, "int8", true),
            (0, "fp16", false),
            (333, "topk:ratio=0.1", true),
            (7, "identity", false),
            (4096, "fp8", false),
            (515, "sign", true),
        ];
        // Under Miri (minutes at these sizes), a tenth of each.
        let parts = parts.map(|(n, s, sealed)| (if cfg!(miri) { n / 10 } else { n }, s, sealed));
        let mut at = 0;
        let mut segs = Vec::new();
        let mut codecs = Vec::new();
        for (n, s, sealed) in parts {
            // A gap of 3 untouched elements before each segment.
            segs.push(at + 3..at + 3 + n);
            codecs.push((spec(s), sealed));
            at += 3 + n;
        }
        (segs, codecs)
    }

    fn message(
        rank: usize,
        x: &[f32],
        segs: &[Range<usize>],
        codecs: &[(CodecSpec, bool)],
    ) -> Vec<u8> {
        let mut msg = Vec::new();
        for (s, (c, sealed)) in segs.iter().zip(codecs) {
            let ctx = EncodeCtx::new(rank as u64 + 11);
            let mut f = vec![0u8; c.max_encoded_len(s.len()) + 4];
            let len = c.encode_into(&x[s.clone()], &ctx, &mut f).unwrap();
            let len = if *sealed {
                wire::seal(&mut f, len).unwrap()
            } else {
                len
            };
            msg.extend_from_slice(&f[..len]);
        }
        msg
    }

    #[test]
    fn every_rank_gets_each_tensors_sum_in_rank_order() {
        let (segs, codecs) = bucket();
        let n = segs.last().unwrap().end + 2;
        let (worlds, ops): (&[usize], &[ReduceOp]) = if cfg!(miri) {
            (&[1, 3], &[ReduceOp::Mean])
        } else {
            (&[1, 2, 3, 4], &[ReduceOp::Sum, ReduceOp::Mean])
        };
        for &p in worlds {
            for &op in ops {
                let (segs2, codecs2) = (segs.clone(), codecs.clone());
                let outs = local::run(p, None, move |mut t| {
                    let r = t.rank();
                    let x = input(r, n);
                    let msg = message(r, &x, &segs2, &codecs2);
                    let mut g = BucketGather::new(&t, 5, op)?;
                    let mut out = vec![-1.5f32; n];
                    // Every rank's bound: the codecs' largest frames (top-k's frames vary
                    // in length with the data), sealed where they are.
                    let bound = segs2
                        .iter()
                        .zip(&codecs2)
                        .map(|(s, (c, sealed))| {
                            let m = c.max_encoded_len(s.len());
                            if *sealed { wire::sealed_len(m) } else { m }
                        })
                        .sum();
                    let st = g.run(&mut t, &msg, &segs2, Some(bound), &mut out)?;
                    assert_eq!(st.messages, (p - 1) as u64);
                    // A second call on the same state gives the same bits.
                    let mut again = vec![-1.5f32; n];
                    g.run(&mut t, &msg, &segs2, None, &mut again)?;
                    assert_eq!(
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        again.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                    Ok(out)
                });
                // The definition: frame of rank 0 decoded, the others added in rank order.
                let mut want = vec![-1.5f32; n];
                for (s, (c, sealed)) in segs.iter().zip(&codecs) {
                    let w = &mut want[s.clone()];
                    for q in 0..p {
                        let x = input(q, n);
                        let msg = message(q, &x, std::slice::from_ref(s), &[(*c, *sealed)]);
                        if q == 0 {
                            crate::decode(&msg, w).unwrap();
                        } else {
                            crate::decode_add(&msg, w).unwrap();
                        }
                    }
                    if op == ReduceOp::Mean && p > 1 {
                        w.iter_mut().for_each(|v| *v /= p as f32);
                    }
                }
                for out in outs {
                    let out = out.unwrap();
                    assert_eq!(
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{p} ranks, {op:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_bad_message_names_the_rank_that_made_it() {
        let segs = vec![0..100, 100..164];
        let outs = local::run(3, Some(std::time::Duration::from_secs(5)), move |mut t| {
            let r = t.rank();
            let x = input(r, 164);
            let codecs = [(spec("int8"), true), (spec("fp16"), false)];
            let mut msg = message(r, &x, &segs, &codecs);
            if r == 1 {
                // Rank 1 sends frames for the wrong lengths: 100 + 60 elements.
                msg = message(r, &x, &[0..100, 100..160], &codecs);
                let mut g = BucketGather::new(&t, 0, ReduceOp::Sum)?;
                // Its own check refuses the message before anything is sent.
                let e = g
                    .run(&mut t, &msg, &segs, None, &mut vec![0.0; 164])
                    .unwrap_err();
                assert!(e.to_string().contains("60 elements"), "{e}");
                // Then it sends the bad message by the back door: the segments it claims.
                let mut g = BucketGather::new(&t, 0, ReduceOp::Sum)?;
                let mut o = vec![0.0; 164];
                return g
                    .run(&mut t, &msg, &[0..100, 100..160], None, &mut o)
                    .map(|_| o);
            }
            let mut g = BucketGather::new(&t, 0, ReduceOp::Sum)?;
            // Rank 1's first call failed at once: skip a call number to stay in step.
            t.begin();
            let mut o = vec![0.0; 164];
            g.run(&mut t, &msg, &segs, None, &mut o).map(|_| o)
        });
        // Rank 2 receives rank 1's message first (its left neighbour) and names it.
        let e = outs[2].as_ref().unwrap_err();
        assert!(matches!(e, Error::Peer { peer: 1, .. }), "{e}");
        assert!(outs[0].is_err());
    }

    #[test]
    fn a_message_longer_than_the_bound_is_refused_naming_its_sender() {
        let outs = local::run(2, Some(std::time::Duration::from_secs(5)), |mut t| {
            let r = t.rank();
            let x = input(r, 64);
            let fp16 = spec("fp16").encode(&x, &EncodeCtx::new(1)).unwrap();
            let bound = fp16.len();
            // Rank 1 sends its tensor as float32: a whole frame, twice the bound.
            let (msg, max) = if r == 1 {
                let f = spec("identity").encode(&x, &EncodeCtx::new(1)).unwrap();
                let n = f.len();
                (f, n)
            } else {
                (fp16, bound)
            };
            let mut g = BucketGather::new(&t, 0, ReduceOp::Sum)?;
            let mut o = vec![0.0; 64];
            g.run(&mut t, &msg, &[0..64], Some(max), &mut o)
        });
        let e = outs[0].as_ref().unwrap_err();
        assert!(
            matches!(e, Error::Peer { peer: 1, source, .. }
                if matches!(**source, Error::MessageTooLong { peer: 1, .. })),
            "{e}"
        );
    }

    #[test]
    fn bad_arguments_are_errors() {
        let outs = local::run(1, None, |mut t| {
            let mut g = BucketGather::new(&t, 0, ReduceOp::Sum)?;
            let x = input(0, 10);
            let f = spec("fp16").encode(&x, &EncodeCtx::new(1)).unwrap();
            let mut out = vec![0.0f32; 10];
            let errs = [
                g.run(&mut t, &f, &[0..11], None, &mut out).unwrap_err(),
                g.run(&mut t, &f, &[0..10, 10..10], None, &mut out)
                    .unwrap_err(),
                g.run(&mut t, &f[..f.len() - 1], &[0..10], None, &mut out)
                    .unwrap_err(),
                g.run(
                    &mut t,
                    &[f.clone(), vec![0]].concat(),
                    &[0..10],
                    None,
                    &mut out,
                )
                .unwrap_err(),
                g.run(&mut t, &f, &[], None, &mut out).unwrap_err(),
                g.run(&mut t, &f, &[0..10], Some(f.len() - 1), &mut out)
                    .unwrap_err(),
            ];
            assert!(out.iter().all(|&v| v == 0.0));
            g.run(&mut t, &f, &[0..10], Some(f.len()), &mut out)?;
            assert_eq!(t.calls(), 7);
            Ok(errs.iter().map(|e| e.to_string()).collect::<Vec<_>>())
        });
        let errs = outs.into_iter().next().unwrap().unwrap();
        assert!(errs[0].contains("not inside"), "{}", errs[0]);
        assert!(errs[1].contains("1 frames"), "{}", errs[1]);
        assert!(errs.iter().all(|e| !e.is_empty()));
    }

    #[test]
    fn encode_run_is_the_caller_encoding_and_run() {
        // Three tensors (int8 through error feedback, identity, top-k), sealed: the
        // crate's encode-and-gather gives the bits of the caller encoding each part and
        // running the gather, and the residual moves alike.
        let parts = [
            (0..40, "int8:block=16"),
            (40..43, "identity"),
            (43..107, "topk:k=5"),
        ];
        let res = local::run(3, None, |t| {
            let rank = t.rank();
            let mut comm = Comm::new(t);
            let mut g1 = BucketGather::new(&comm, 1, ReduceOp::Mean)?;
            let mut g2 = BucketGather::new(&comm, 2, ReduceOp::Mean)?;
            let mut ef1 = ErrorFeedback::new(spec("int8:block=16"), 40)?;
            let mut ef2 = ef1.clone();
            let mut send = Vec::new();
            for step in 0..3u64 {
                let x = input(rank + step as usize, 107);
                let mut a = x.clone();
                let mut ps: Vec<Part<'_>> = parts
                    .iter()
                    .enumerate()
                    .map(|(i, (r, c))| Part {
                        range: r.clone(),
                        codec: spec(c),
                        seed: 9 + step + i as u64,
                        feedback: None,
                    })
                    .collect();
                ps[0].feedback = Some(&mut ef1);
                g1.encode_run(&mut comm, &mut a, &mut ps, true, &mut send)?;
                let mut msg = Vec::new();
                let mut cap = 0;
                for (i, (r, c)) in parts.iter().enumerate() {
                    let ctx = EncodeCtx::new(9 + step + i as u64);
                    let c = spec(c);
                    let mut f = vec![0u8; c.max_encoded_len(r.len()) + 4];
                    cap += f.len();
                    let n = if i == 0 {
                        ef2.encode_into(&x[r.clone()], &ctx, &mut f[..c.max_encoded_len(r.len())])?
                    } else {
                        c.encode_into(&x[r.clone()], &ctx, &mut f)?
                    };
                    let n = wire::seal(&mut f, n)?;
                    msg.extend_from_slice(&f[..n]);
                }
                let mut b = x.clone();
                let ranges: Vec<_> = parts.iter().map(|p| p.0.clone()).collect();
                g2.run(&mut comm, &msg, &ranges, Some(cap), &mut b)?;
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "step {step}");
                assert_eq!(bits(&ef1.residual_f32()), bits(&ef2.residual_f32()));
            }
            // Feedback for another codec or length is refused.
            let mut wrong = ErrorFeedback::new(spec("int8:block=16"), 39)?;
            let mut ps = vec![Part {
                range: 0..40,
                codec: spec("int8:block=16"),
                seed: 0,
                feedback: Some(&mut wrong),
            }];
            let mut x = input(rank, 107);
            assert!(
                g1.encode_run(&mut comm, &mut x, &mut ps, false, &mut send)
                    .is_err()
            );
            Ok(())
        });
        for r in res {
            r.unwrap();
        }
    }
}

/// One tensor of a bucket for [`BucketGather::encode_run`].
#[derive(Debug)]
pub struct Part<'a> {
    /// Where it sits in the bucket.
    pub range: Range<usize>,
    /// Its codec.
    pub codec: CodecSpec,
    /// The seed its frame is encoded with (this rank's: see [`super::rank_seed`]).
    pub seed: u64,
    /// Its error feedback (for `codec`, over the range's length), if any.
    pub feedback: Option<&'a mut ErrorFeedback>,
}
