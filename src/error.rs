//! The one error type of the crate.
//!
//! Every variant says what was wrong and, for frames, where: a byte offset into the
//! frame, a field name, or a parameter. Decoding never panics; it returns one of these.

use core::fmt;

use crate::codec_id::CodecId;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = core::result::Result<T, E>;

/// Everything that can go wrong in gradpack.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A codec spec string could not be parsed.
    Spec {
        /// The whole spec as given.
        spec: String,
        /// What was wrong, naming the bad key or value and what is accepted.
        reason: String,
    },
    /// A backend name (`GRADPACK_BACKEND`, `--backend`) is unknown, or names an
    /// instruction set this CPU lacks.
    Backend {
        /// The name as given.
        name: String,
        /// What was wrong and what is accepted.
        reason: String,
    },
    /// A codec parameter is out of range (when building a codec in code).
    Param {
        /// The codec.
        codec: CodecId,
        /// The parameter name as it appears in a spec.
        name: &'static str,
        /// What was wrong and what is accepted.
        reason: String,
    },
    /// The frame is shorter than its header or than the length its header declares.
    Truncated {
        /// Bytes needed.
        needed: u64,
        /// Bytes present.
        got: usize,
    },
    /// The frame is longer than header plus declared payload.
    TrailingBytes {
        /// Bytes expected (header plus payload length).
        expected: u64,
        /// Bytes present.
        got: usize,
    },
    /// Bytes 0..4 are not the gradpack magic.
    BadMagic([u8; 4]),
    /// Byte 4: a version this build does not read.
    UnsupportedVersion(u8),
    /// Byte 5: a codec id this build does not know.
    UnknownCodec(u8),
    /// Bytes 52..56: the header checksum does not match bytes 0..52.
    HeaderChecksum {
        /// The CRC-32 stored in the frame.
        stored: u32,
        /// The CRC-32 computed over bytes 0..52.
        computed: u32,
    },
    /// Bytes 6..8: flag bits that are reserved in this version are set.
    ReservedFlags(u16),
    /// The last 4 bytes of a sealed frame (flag `PAYLOAD_CRC`) do not match the CRC-32
    /// of its payload: the payload was corrupted in transit.
    PayloadChecksum {
        /// The CRC-32 stored after the payload.
        stored: u32,
        /// The CRC-32 computed over the payload.
        computed: u32,
    },
    /// A header field holds a value the codec does not allow.
    BadField {
        /// The codec named by the header.
        codec: CodecId,
        /// The header field (as named in docs/wire-format.md).
        field: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The declared payload length is not the one the header's codec, parameters and
    /// element count imply.
    PayloadLength {
        /// The codec named by the header.
        codec: CodecId,
        /// Length implied by the header.
        expected: u64,
        /// Length declared in bytes 16..24.
        declared: u64,
    },
    /// The payload is inconsistent with the header (for example an index past the end).
    Corrupt {
        /// The codec named by the header.
        codec: CodecId,
        /// Byte offset into the frame where the problem was found.
        offset: usize,
        /// What was wrong.
        reason: String,
    },
    /// The output slice passed to a decoder does not have the frame's element count.
    OutputLength {
        /// Elements in the frame.
        expected: u64,
        /// Elements in the output slice.
        got: usize,
    },
    /// The buffer passed to an encoder is too small for the frame.
    BufferTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// Two slices that must have equal length do not (e.g. gradient and residual).
    LengthMismatch {
        /// What the slices are.
        what: &'static str,
        /// Length of the first.
        left: usize,
        /// Length of the second.
        right: usize,
    },
    /// A frame claims more elements than the caller allowed to be allocated.
    TooLarge {
        /// Elements claimed by the frame.
        elements: u64,
        /// The limit in force.
        limit: u64,
    },
    /// The frame is valid but belongs to a different codec than the one asked to decode it.
    WrongCodec {
        /// The codec asked to decode.
        expected: CodecId,
        /// The codec named by the frame.
        found: CodecId,
    },
    /// A collective could not exchange a message with a peer: the peer hung up, nothing
    /// arrived within the transport's timeout, or the engine reported a failure.
    Transport {
        /// Rank of the peer.
        peer: usize,
        /// What happened.
        reason: String,
    },
    /// A peer's message, or the length it announced ahead of it, is longer than the
    /// collective can be sent there: refused before anything was allocated for it.
    MessageTooLong {
        /// Rank of the peer.
        peer: usize,
        /// Bytes the message has or claims.
        len: u64,
        /// The most the collective expects.
        max: usize,
    },
    /// A message received from a peer during a collective was rejected: a frame that
    /// does not decode, one of the wrong codec, length, offset or seed, or a message that
    /// belongs to another call, hop or collective ([`Error::Misplaced`]).
    Peer {
        /// The rank whose frame it was: the sender, or for a frame forwarded unchanged
        /// round a ring, the rank that encoded it.
        peer: usize,
        /// The phase of the collective (e.g. `"reduce-scatter"`, `"all-gather"`).
        phase: &'static str,
        /// The neighbour a forwarded frame arrived from, if it is not `peer`.
        forwarded_by: Option<usize>,
        /// What was wrong with it.
        source: Box<Error>,
    },
    /// A collective's message does not belong where it arrived: its envelope is damaged,
    /// names another sender, or places it in another collective, phase or chunk. (Stale
    /// messages are dropped and early ones kept; see `collective::Comm`.)
    Misplaced(String),
    /// Saved state (a checkpoint) was refused: corrupt, of another format version, or
    /// saved from a state of another codec, layout or options.
    Checkpoint(String),
    /// An allocation of this many bytes failed (or could not even be sized).
    OutOfMemory {
        /// Bytes asked for.
        bytes: u64,
        /// What the memory was for.
        what: &'static str,
    },
    /// A collective was asked for something it cannot do (e.g. a rank outside the
    /// world, or options the ranks must agree on that are inconsistent).
    Collective(String),
    /// One frame of several given together (to [`crate::reduce_frames`]) was refused.
    InFrame {
        /// The frame's position in the list given.
        index: usize,
        /// What was wrong with it.
        source: Box<Error>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Spec { spec, reason } => write!(f, "invalid codec spec {spec:?}: {reason}"),
            Error::Backend { name, reason } => write!(f, "backend {name:?}: {reason}"),
            Error::Param {
                codec,
                name,
                reason,
            } => write!(f, "invalid {codec} parameter `{name}`: {reason}"),
            Error::Truncated { needed, got } => {
                write!(f, "frame truncated: {got} bytes present, {needed} needed")
            }
            Error::TrailingBytes { expected, got } => write!(
                f,
                "frame has {} trailing bytes: header and payload take {expected} bytes, {got} present",
                *got as u64 - expected
            ),
            Error::BadMagic(m) => write!(
                f,
                "bytes 0..4 are {m:02x?}, not the gradpack magic \"GPAK\": not a gradpack frame"
            ),
            Error::UnsupportedVersion(v) => {
                write!(
                    f,
                    "byte 4: wire format version {v} is not supported (this build reads 1)"
                )
            }
            Error::UnknownCodec(c) => write!(f, "byte 5: unknown codec id {c}"),
            Error::HeaderChecksum { stored, computed } => write!(
                f,
                "bytes 52..56: header checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the header is corrupt"
            ),
            Error::PayloadChecksum { stored, computed } => write!(
                f,
                "last 4 bytes: payload checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the payload is corrupt"
            ),
            Error::ReservedFlags(bits) => {
                write!(f, "bytes 6..8: reserved flag bits {bits:#06x} are set")
            }
            Error::BadField {
                codec,
                field,
                reason,
            } => write!(f, "{codec} frame: header field `{field}`: {reason}"),
            Error::PayloadLength {
                codec,
                expected,
                declared,
            } => write!(
                f,
                "{codec} frame: bytes 16..24 declare a payload of {declared} bytes, but the header implies {expected}"
            ),
            Error::Corrupt {
                codec,
                offset,
                reason,
            } => write!(
                f,
                "{codec} frame: corrupt payload at byte {offset}: {reason}"
            ),
            Error::OutputLength { expected, got } => write!(
                f,
                "output slice has {got} elements but the frame holds {expected}"
            ),
            Error::BufferTooSmall { needed, got } => write!(
                f,
                "encode buffer too small: {needed} bytes needed, {got} given (see max_encoded_len)"
            ),
            Error::LengthMismatch { what, left, right } => {
                write!(f, "length mismatch: {what} ({left} vs {right})")
            }
            Error::TooLarge { elements, limit } => write!(
                f,
                "frame claims {elements} elements, more than the allocation limit of {limit}"
            ),
            Error::WrongCodec { expected, found } => {
                write!(f, "frame is {found}, not {expected}")
            }
            Error::Transport { peer, reason } => write!(f, "rank {peer}: {reason}"),
            Error::MessageTooLong { peer, len, max } => write!(
                f,
                "rank {peer} sent a message of {len} bytes where at most {max} are expected: \
                 refused"
            ),
            Error::Peer {
                peer,
                phase,
                forwarded_by: None,
                source,
            } => write!(f, "{phase}: message from rank {peer} rejected: {source}"),
            Error::Peer {
                peer,
                phase,
                forwarded_by: Some(via),
                source,
            } => write!(
                f,
                "{phase}: frame of rank {peer} (forwarded by rank {via}) rejected: {source}"
            ),
            Error::Misplaced(reason) => write!(f, "misplaced message: {reason}"),
            Error::Checkpoint(reason) => write!(f, "saved state refused: {reason}"),
            Error::OutOfMemory { bytes, what } => {
                write!(f, "could not allocate {bytes} bytes for {what}")
            }
            Error::Collective(reason) => write!(f, "collective: {reason}"),
            Error::InFrame { index, source } => write!(f, "frame {index}: {source}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Peer { source, .. } | Error::InFrame { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}
