//! [`Comm`]: a [`Transport`] plus what binds every message of a collective to its place.
//!
//! Each message a collective sends starts with an envelope of [`ENVELOPE_LEN`] bytes:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `"GPKE"` |
//! | 4..8 | sender rank (u32 LE) |
//! | 8..16 | call: the sequence number of the collective call on the sender's [`Comm`] (u64 LE) |
//! | 16..20 | tag: which collective ([`super::AllReduceOptions::tag`], e.g. a bucket index) |
//! | 20..24 | hop: the message's index among those the call sends from sender to receiver |
//! | 24..28 | chunk: the chunk the frame carries (ring), or the rank whose frame it is (all-gather) |
//! | 28 | phase: 0 reduce-scatter, 1 ring all-gather, 2 frame all-gather, 3 and 4 the reduce-scatter and all-gather inside a node ([`super::hier`]), 5 an agreement on options ([`Comm::agree`]) |
//! | 29 | version of the envelope: 2 |
//! | 30..32 | zero |
//! | 32..36 | CRC-32C of bytes 0..32 followed by the frame (every byte after the envelope) |
//!
//! The CRC covers the frame too, so a frame is bound to its envelope: the bytes of one
//! call, chunk or sender under the envelope of another (a buffer sent twice, a message
//! relabelled) fail it, for every codec, also those whose frames record no seed.
//! Every call of a collective on a [`Comm`] takes the next sequence number, whether it
//! succeeds or not, so ranks that make the same calls in the same order agree on it with
//! no message exchanged. A receive compares the envelope with what it expects, by
//! `(call, hop)`:
//! - **stale** (earlier): left over from a call that failed somewhere; dropped, and the
//!   receive goes on to the next message;
//! - **early** (later): the peer gave up on this call and went on to a later one; kept for
//!   that call and this one fails with an error naming the peer;
//! - **the expected place** but another tag, phase or chunk, a sender that is not the
//!   peer, or a damaged envelope: an error naming the peer (the message is dropped).
//!
//! So a frame is never summed into the wrong call, and after a failure every rank is back
//! in step by the next call that every rank completes.

use std::collections::VecDeque;

use super::Transport;
use super::hold::{self, Point};
use crate::alloc;
use crate::error::{Error, Result};

/// Bytes of the envelope in front of every message a collective sends.
pub const ENVELOPE_LEN: usize = 36;

const MAGIC: [u8; 4] = *b"GPKE";

/// The envelope's version (byte 29). Version 1 (gradpack before this one) had 0 there
/// and a CRC over the envelope alone.
pub const ENVELOPE_VERSION: u8 = 2;

/// CRC-32C of the envelope's first 32 bytes followed by the frame. Castagnoli's
/// polynomial, not the frames' CRC-32: a frame ends its header and its (sealed) payload
/// with CRC-32s of what precedes them, and a CRC-32 running over such a segment comes out
/// the same whatever the segment holds, so with one polynomial the envelope would not
/// depend on the frame's content at all.
fn envelope_crc(msg: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&msg[0..32]), &msg[ENVELOPE_LEN..])
}

/// Phases of a collective, as recorded in envelopes and named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    ReduceScatter = 0,
    RingAllGather = 1,
    FrameAllGather = 2,
    NodeReduceScatter = 3,
    NodeAllGather = 4,
    Agreement = 5,
    TwoShotScatter = 6,
    TwoShotGather = 7,
    StateTransfer = 8,
}

impl Phase {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Phase::ReduceScatter => "reduce-scatter",
            Phase::RingAllGather => "all-gather",
            Phase::FrameAllGather => "frame all-gather",
            Phase::NodeReduceScatter => "reduce-scatter inside the node",
            Phase::NodeAllGather => "all-gather inside the node",
            Phase::Agreement => "agreement on the options",
            Phase::TwoShotScatter => "two-shot scatter to the owners",
            Phase::TwoShotGather => "two-shot gather of the owners' sums",
            Phase::StateTransfer => "state transfer",
        }
    }
}

/// Where a message belongs, and the most bytes it may have (envelope included): what
/// its collective can send there, so that a peer's claim of more is refused before
/// anything is allocated for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    pub call: u64,
    pub tag: u32,
    pub hop: u32,
    pub chunk: u32,
    pub phase: Phase,
    pub max: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Envelope {
    sender: u32,
    call: u64,
    tag: u32,
    hop: u32,
    chunk: u32,
    phase: u8,
}

impl Envelope {
    /// Write the envelope into `out[..ENVELOPE_LEN]`; `out` is the whole message, the
    /// frame after the envelope already in place (the CRC covers it).
    fn write(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&MAGIC);
        out[4..8].copy_from_slice(&self.sender.to_le_bytes());
        out[8..16].copy_from_slice(&self.call.to_le_bytes());
        out[16..20].copy_from_slice(&self.tag.to_le_bytes());
        out[20..24].copy_from_slice(&self.hop.to_le_bytes());
        out[24..28].copy_from_slice(&self.chunk.to_le_bytes());
        out[28] = self.phase;
        out[29] = ENVELOPE_VERSION;
        out[30..32].fill(0);
        let crc = envelope_crc(out);
        out[32..36].copy_from_slice(&crc.to_le_bytes());
    }

    fn parse(msg: &[u8]) -> core::result::Result<Envelope, String> {
        if msg.len() < ENVELOPE_LEN {
            return Err(format!(
                "a message of {} bytes is shorter than the {ENVELOPE_LEN}-byte envelope",
                msg.len()
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(msg[i..i + 4].try_into().expect("4 bytes"));
        if msg[0..4] == MAGIC && msg[29] != ENVELOPE_VERSION && msg[30..32] == [0; 2] {
            return Err(format!(
                "envelope version {} (this gradpack speaks version {ENVELOPE_VERSION}; every \
                 rank must run the same protocol version)",
                msg[29]
            ));
        }
        let stored = u32_at(32);
        let computed = envelope_crc(msg);
        if msg[0..4] != MAGIC || msg[30..32] != [0; 2] || stored != computed {
            return Err(format!(
                "damaged message: its envelope (magic {:02x?}, CRC stored {stored:#010x}, \
                 computed {computed:#010x} over the envelope and frame) does not match the \
                 bytes that came with it",
                &msg[0..4]
            ));
        }
        Ok(Envelope {
            sender: u32_at(4),
            call: u64::from_le_bytes(msg[8..16].try_into().expect("8 bytes")),
            tag: u32_at(16),
            hop: u32_at(20),
            chunk: u32_at(24),
            phase: msg[28],
        })
    }
}

/// A [`Transport`] with the state that binds each collective's messages to their call:
/// the sequence number of the next call and, per peer, messages that arrived early (see
/// the module docs). The collectives of this crate ([`super::AllReduce::run`]) run on a
/// `Comm`; every rank builds one per transport and runs its collectives on it in the
/// same order.
///
/// A `Comm` is itself a [`Transport`] (the raw one, without envelopes), so it can be
/// passed wherever only the rank and world size are needed.
#[derive(Debug)]
pub struct Comm<T: ?Sized> {
    calls: u64,
    /// Messages from each peer that belong to a later place than the one asked for.
    early: Vec<VecDeque<Vec<u8>>>,
    /// Messages dropped as stale since this `Comm` was built.
    dropped: u64,
    transport: T,
}

impl<T: Transport> Comm<T> {
    /// A `Comm` over `transport`, before its first call.
    pub fn new(transport: T) -> Comm<T> {
        let size = transport.size();
        Comm {
            calls: 0,
            early: (0..size).map(|_| VecDeque::new()).collect(),
            dropped: 0,
            transport,
        }
    }

    /// The transport, giving up the state (messages kept for later calls are dropped).
    pub fn into_inner(self) -> T {
        self.transport
    }
}

impl<T: Transport + ?Sized> Comm<T> {
    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport, mutably (to change its timeout, say). Sending on it directly
    /// between collective calls is allowed; the collectives' messages carry envelopes
    /// that such messages lack, so a collective receiving one reports it as damaged.
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Collective calls begun on this `Comm` (every call counts, failed ones too).
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Messages dropped as stale (left over from calls that failed) so far.
    pub fn stale_dropped(&self) -> u64 {
        self.dropped
    }

    /// Messages received early and kept for a later call.
    pub fn early_kept(&self) -> usize {
        self.early.iter().map(VecDeque::len).sum()
    }

    /// Check that every rank of the world was made with the same `settings`: words
    /// `key=value` separated by spaces, every option the ranks must share (the
    /// arithmetic, the schedule, the codec). One call of this `Comm`, made at the same
    /// point on every rank (before the first collective that depends on the options,
    /// say): each rank sends its settings to every other rank and compares what each
    /// sends with its own, so a difference fails the call on every rank, naming the rank
    /// and the first option that differs. `tag` goes into the envelopes. Settings of
    /// more than [`MAX_SETTINGS`] bytes are refused.
    pub fn agree(&mut self, tag: u32, settings: &str) -> Result<()> {
        let call = self.begin();
        if settings.len() > MAX_SETTINGS {
            return Err(Error::Collective(format!(
                "settings of {} bytes to agree on: at most {MAX_SETTINGS}",
                settings.len()
            )));
        }
        // Every peer's settings are received before a difference is reported, so that
        // no rank leaves while a peer may still send to it.
        let all = self.all_to_all(call, tag, settings.as_bytes(), MAX_SETTINGS)?;
        // The first difference in the order the messages came: from rank r - 1 down.
        let (r, p) = (self.transport.rank(), self.transport.size());
        let differ = (1..p).map(|k| (r + p - k) % p).find_map(|from| {
            let theirs = String::from_utf8_lossy(&all[from]);
            (theirs != settings).then(|| Error::Peer {
                peer: from,
                phase: Phase::Agreement.name(),
                forwarded_by: None,
                source: Box::new(Error::Collective(differs(&theirs, settings))),
            })
        });
        // This rank's settings have left it before it reports, agreed or not: a rank that
        // ends its process on a difference must not take its messages with it.
        let flushed = self.transport.flush();
        differ.map_or(flushed, Err)
    }

    /// Every rank's `values` (the same count on every rank), indexed by rank: one call
    /// of this `Comm`, made at the same point on every rank, exchanged as the agreement
    /// on options is (each rank sends to every other and receives from every other,
    /// phase 5, `tag` in the envelopes) with `values` as little-endian f64 after the
    /// envelope. A peer that sends another count fails the call, naming it. What the
    /// measured trials of [`crate::sync::Tuner`] share.
    pub(crate) fn gather_f64(&mut self, tag: u32, values: &[f64]) -> Result<Vec<Vec<f64>>> {
        let len = values.len().checked_mul(8).filter(|&l| l <= MAX_SETTINGS);
        let Some(len) = len else {
            self.skip();
            return Err(Error::Collective(format!(
                "{} values to share: at most {}",
                values.len(),
                MAX_SETTINGS / 8
            )));
        };
        let body: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.gather_bytes(tag, &body, len)?
            .into_iter()
            .enumerate()
            .map(|(from, b)| {
                if b.len() != len {
                    return Err(Error::Peer {
                        peer: from,
                        phase: Phase::Agreement.name(),
                        forwarded_by: None,
                        source: Box::new(Error::Collective(format!(
                            "sent {} bytes of values, expected {len}",
                            b.len()
                        ))),
                    });
                }
                Ok(b.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect())
            })
            .collect()
    }

    /// Every rank's `body` (at most `max` bytes, and `max` at most [`MAX_SETTINGS`];
    /// the lengths may differ), indexed by rank: one call, exchanged as the agreement on
    /// options is (phase 5, `tag` in the envelopes).
    pub(crate) fn gather_bytes(
        &mut self,
        tag: u32,
        body: &[u8],
        max: usize,
    ) -> Result<Vec<Vec<u8>>> {
        let call = self.begin();
        let max = max.min(MAX_SETTINGS);
        if body.len() > max {
            return Err(Error::Collective(format!(
                "{} bytes to share: at most {max}",
                body.len()
            )));
        }
        let all = self.all_to_all(call, tag, body, max)?;
        self.transport.flush()?;
        Ok(all)
    }

    /// One call in which rank `root` sends `body` to every rank of `to` (phase 8,
    /// `tag`, hop and chunk 0): on those ranks the body received (at most `max` bytes),
    /// on the others (the root included) `None`. Every rank of the world makes the call,
    /// so that call numbers stay in step.
    pub(crate) fn transfer(
        &mut self,
        tag: u32,
        root: usize,
        to: &[usize],
        body: &[u8],
        max: usize,
    ) -> Result<Option<Vec<u8>>> {
        let call = self.begin();
        let place = Place {
            call,
            tag,
            phase: Phase::StateTransfer,
            hop: 0,
            chunk: 0,
            max: ENVELOPE_LEN.saturating_add(max),
        };
        let r = self.transport.rank();
        if r == root {
            let mut msg = Vec::new();
            alloc::lengthen(&mut msg, ENVELOPE_LEN + body.len(), "a state message")?;
            msg[ENVELOPE_LEN..].copy_from_slice(body);
            for &q in to.iter().filter(|&&q| q != root) {
                self.post(&mut msg, q, place)?;
            }
            self.transport.flush()?;
            return Ok(None);
        }
        if !to.contains(&r) {
            return Ok(None);
        }
        let mut got = Vec::new();
        self.expect(&mut got, root, place)?;
        got.drain(..ENVELOPE_LEN);
        Ok(Some(got))
    }

    /// Call `call`'s exchange of the agreement's kind (section 6.10): `body` after an
    /// envelope to every other rank, then every other rank's body (at most `max` bytes)
    /// received; each rank's body indexed by rank, this rank's own included.
    fn all_to_all(&mut self, call: u64, tag: u32, body: &[u8], max: usize) -> Result<Vec<Vec<u8>>> {
        let (r, p) = (self.transport.rank(), self.transport.size());
        let place = |from: usize| Place {
            call,
            tag,
            phase: Phase::Agreement,
            hop: 0,
            chunk: from as u32,
            max: ENVELOPE_LEN + max,
        };
        let mut msg = vec![0u8; ENVELOPE_LEN];
        msg.extend_from_slice(body);
        for k in 1..p {
            self.post(&mut msg, (r + k) % p, place(r))?;
        }
        let mut out = vec![Vec::new(); p];
        out[r] = body.to_vec();
        let mut got = Vec::new();
        for k in 1..p {
            let from = (r + p - k) % p;
            self.expect(&mut got, from, place(from))?;
            out[from] = got[ENVELOPE_LEN..].to_vec();
        }
        Ok(out)
    }

    /// Take a call number without running the call (a collective skipped after an earlier
    /// failure; its peers see its messages missing, as they would a failed call's).
    pub(crate) fn skip(&mut self) {
        self.calls += 1;
    }

    /// Start a collective call: its sequence number.
    pub(crate) fn begin(&mut self) -> u64 {
        let c = self.calls;
        self.calls += 1;
        c
    }

    /// Write `place`'s envelope into `msg[..ENVELOPE_LEN]`, send `msg` to `to`, and
    /// receive the message for `expect` from `from` into `recv` (envelope included), of
    /// `len` bytes where the caller knows its length ([`Transport::send_recv_len`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn exchange(
        &mut self,
        msg: &mut [u8],
        to: usize,
        place: Place,
        recv: &mut Vec<u8>,
        from: usize,
        expect: Place,
        len: Option<usize>,
    ) -> Result<()> {
        self.stamp(msg, place)?;
        self.exchange_stamped(msg, to, recv, from, expect, len)
    }

    /// [`Comm::exchange`] of a message already stamped by [`Comm::stamp`] (so that the
    /// caller can read it meanwhile).
    pub(crate) fn exchange_stamped(
        &mut self,
        msg: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        expect: Place,
        len: Option<usize>,
    ) -> Result<()> {
        super::check_rank(from, self.early.len())?;
        let me = self.transport.rank();
        hold::at(me, Point::Send, expect.call, u64::from(expect.hop));
        hold::at(me, Point::Recv, expect.call, u64::from(expect.hop));
        if self.early[from].is_empty() {
            match len {
                Some(len) => {
                    let max = expect.max.max(len);
                    let got = self.transport.send_recv_len(msg, to, recv, from, len, max);
                    got.map_err(|e| refused(e, expect))?
                }
                None => self
                    .transport
                    .send_recv(msg, to, recv, from, expect.max)
                    .map_err(|e| refused(e, expect))?,
            }
        } else {
            self.transport.send(msg, to)?;
            *recv = self.early[from].pop_front().expect("not empty");
        }
        self.settle(recv, from, expect)
    }

    /// Write `place`'s envelope into `msg[..ENVELOPE_LEN]` and send `msg` to `to`.
    pub(crate) fn post(&mut self, msg: &mut [u8], to: usize, place: Place) -> Result<()> {
        self.stamp(msg, place)?;
        hold::at(
            self.transport.rank(),
            Point::Send,
            place.call,
            u64::from(place.hop),
        );
        self.transport.send(msg, to)
    }

    /// Receive the message for `expect` from `from` into `recv` (envelope included).
    pub(crate) fn expect(&mut self, recv: &mut Vec<u8>, from: usize, expect: Place) -> Result<()> {
        super::check_rank(from, self.early.len())?;
        hold::at(
            self.transport.rank(),
            Point::Recv,
            expect.call,
            u64::from(expect.hop),
        );
        self.next_from(recv, from, expect)?;
        self.settle(recv, from, expect)
    }

    /// The next message from `from` into `recv`: one kept early, or the transport's
    /// (at most `expect.max` bytes).
    fn next_from(&mut self, recv: &mut Vec<u8>, from: usize, expect: Place) -> Result<()> {
        match self.early[from].pop_front() {
            Some(m) => *recv = m,
            None => self
                .transport
                .recv(recv, from, expect.max)
                .map_err(|e| refused(e, expect))?,
        }
        Ok(())
    }

    pub(crate) fn stamp(&self, msg: &mut [u8], place: Place) -> Result<()> {
        let sender = u32::try_from(self.transport.rank()).map_err(|_| {
            Error::Collective("a rank above u32::MAX cannot send an envelope".into())
        })?;
        Envelope {
            sender,
            call: place.call,
            tag: place.tag,
            hop: place.hop,
            chunk: place.chunk,
            phase: place.phase as u8,
        }
        .write(msg);
        Ok(())
    }

    /// `recv` holds the next message from `from`: drop it and take the next while it is
    /// stale, keep it if it is early, accept it if it is the one expected.
    fn settle(&mut self, recv: &mut Vec<u8>, from: usize, expect: Place) -> Result<()> {
        loop {
            match self.classify(recv, from, expect)? {
                Order::Here => return Ok(()),
                Order::Stale => {
                    self.dropped += 1;
                    self.next_from(recv, from, expect)?;
                }
                Order::Early(got) => {
                    self.early[from].push_front(core::mem::take(recv));
                    return Err(misplaced(
                        from,
                        expect.phase,
                        format!(
                            "it sent a message of call {} hop {} while this rank waits for call {} hop {}: \
                             the peer gave up this call (its message is kept for its own call)",
                            got.0, got.1, expect.call, expect.hop
                        ),
                    ));
                }
            }
        }
    }

    fn classify(&self, msg: &[u8], from: usize, expect: Place) -> Result<Order> {
        let e = Envelope::parse(msg).map_err(|r| misplaced(from, expect.phase, r))?;
        if e.sender as usize != from {
            return Err(misplaced(
                from,
                expect.phase,
                format!(
                    "the message came from rank {from} but its envelope names rank {}",
                    e.sender
                ),
            ));
        }
        let (got, want) = ((e.call, e.hop), (expect.call, expect.hop));
        if got < want {
            return Ok(Order::Stale);
        }
        if got > want {
            return Ok(Order::Early(got));
        }
        if e.tag != expect.tag || e.phase != expect.phase as u8 || e.chunk != expect.chunk {
            return Err(misplaced(
                from,
                expect.phase,
                format!(
                    "call {} hop {} carries tag {}, phase {}, chunk {}; this rank expects tag {}, \
                     phase {}, chunk {} (do all ranks run the same collectives in the same order, \
                     with the same options?)",
                    e.call,
                    e.hop,
                    e.tag,
                    e.phase,
                    e.chunk,
                    expect.tag,
                    expect.phase as u8,
                    expect.chunk
                ),
            ));
        }
        Ok(Order::Here)
    }
}

enum Order {
    Here,
    Stale,
    Early((u64, u32)),
}

/// The most bytes of settings [`Comm::agree`] takes.
pub const MAX_SETTINGS: usize = 16 << 10;

/// `v` as the value of one `key=value` word of [`Comm::agree`]'s settings: its debug
/// form without spaces.
pub(crate) fn setting(v: &impl core::fmt::Debug) -> String {
    format!("{v:?}").replace(' ', "")
}

/// What differs between a peer's settings and this rank's: the first option, by name.
fn differs(theirs: &str, mine: &str) -> String {
    let pairs = |s: &str| -> Vec<(String, String)> {
        s.split_whitespace()
            .map(|w| match w.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (w.to_string(), String::new()),
            })
            .collect()
    };
    let (a, b) = (pairs(theirs), pairs(mine));
    for (k, v) in &b {
        match a.iter().find(|(k2, _)| k2 == k) {
            Some((_, v2)) if v2 != v => {
                return format!(
                    "made with {k}={v2} where this rank has {k}={v}: every rank must use the same"
                );
            }
            None => return format!("made without option {k} (this rank has {k}={v})"),
            _ => {}
        }
    }
    for (k, v) in &a {
        if !b.iter().any(|(k2, _)| k2 == k) {
            return format!("made with option {k}={v}, which this rank lacks");
        }
    }
    format!("made with the settings {theirs:?}, this rank with {mine:?} (in another order)")
}

/// A transport's refusal of an over-long message, as a rejected message of the phase
/// that expected it; other errors as they are.
fn refused(e: Error, expect: Place) -> Error {
    match e {
        Error::MessageTooLong { peer, .. } => Error::Peer {
            peer,
            phase: expect.phase.name(),
            forwarded_by: None,
            source: Box::new(e),
        },
        e => e,
    }
}

fn misplaced(peer: usize, phase: Phase, reason: String) -> Error {
    Error::Peer {
        peer,
        phase: phase.name(),
        forwarded_by: None,
        source: Box::new(Error::Misplaced(reason)),
    }
}

impl<T: Transport + ?Sized> Transport for Comm<T> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }
    fn size(&self) -> usize {
        self.transport.size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        self.transport.send(msg, to)
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        self.transport.recv(buf, from, max)
    }
    fn send_recv(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        max: usize,
    ) -> Result<()> {
        self.transport.send_recv(send, to, recv, from, max)
    }
    fn send_recv_len(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        len: usize,
        max: usize,
    ) -> Result<()> {
        self.transport.send_recv_len(send, to, recv, from, len, max)
    }
    fn flush(&mut self) -> Result<()> {
        self.transport.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_and_refuses_damage() {
        let e = Envelope {
            sender: 3,
            call: u64::MAX - 1,
            tag: 7,
            hop: 2,
            chunk: 5,
            phase: 1,
        };
        let mut buf = [0u8; ENVELOPE_LEN + 5];
        buf[ENVELOPE_LEN..].copy_from_slice(b"frame");
        e.write(&mut buf);
        assert_eq!(buf[29], ENVELOPE_VERSION);
        assert_eq!(Envelope::parse(&buf), Ok(e));
        // Every bit of the envelope and of the frame after it is covered.
        for i in 0..buf.len() {
            for bit in 0..8 {
                let mut b = buf;
                b[i] ^= 1 << bit;
                assert!(Envelope::parse(&b).is_err(), "byte {i} bit {bit}");
            }
        }
        assert!(Envelope::parse(&buf[..ENVELOPE_LEN - 1]).is_err());
        // Two frames that end their segments with CRC-32s of them (as every frame's
        // header does, and a sealed payload) give different envelopes.
        let mut other = buf;
        other[ENVELOPE_LEN..].copy_from_slice(b"fraME");
        e.write(&mut other);
        assert_ne!(buf[32..36], other[32..36]);
        // A version-1 envelope (0 at byte 29, CRC of the envelope alone) is named.
        let mut old = buf;
        old[29] = 0;
        let crc = crc32fast::hash(&old[0..32]);
        old[32..36].copy_from_slice(&crc.to_le_bytes());
        assert!(Envelope::parse(&old).unwrap_err().contains("version 0"));
    }
}
