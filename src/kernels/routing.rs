//! The routing table, as data: which x86 code runs each operation on the AVX-512 backend.
//!
//! An AVX-512 CPU also runs every AVX2 kernel (the AVX-512 backend is only detected on a
//! CPU that has everything the AVX2 backend needs), so the AVX-512 backend takes, for each
//! operation and each class of calls, whichever of its own code and the AVX2 code was
//! measured faster: no backend is slower than another on an operation it can run. The
//! AVX2 backend runs its own code everywhere; the scalar and NEON backends have no x86
//! code ([`X86::None`]).
//!
//! [`ROWS`] holds the choices, one [`Row`] per operation, CPU vendor and class of calls
//! (block length, element count, mode), each with the date and CPU it was measured on and
//! the codec operation that measures it ([`Probe`]). The first row that matches a call
//! decides; every operation ends with a row for any vendor and any call. Rows are
//! produced by measurement: `cargo run --release --example backend_race -- --routing`
//! times each row's probe on the AVX2 backend and on the AVX-512 backend with routing off
//! ([`unrouted`]), on the CPU at hand, and prints the rows for that CPU's vendor.
//!
//! What the entries decide themselves is what a kernel can do (a mode or a block length
//! it lacks), never which is faster.

use super::backend::{Backend, BackendKind};
use std::sync::OnceLock;

/// An operation, or a part of one, whose x86 code differs between the AVX2 and AVX-512
/// backends: a row key of [`ROWS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// fp16's fused error-feedback step.
    FeedbackF16,
    /// int8's fused error-feedback step.
    FeedbackInt8,
    /// int8's fused ring hop (a decode added to local values, then encoded).
    HopInt8,
    /// fp16's fused ring hop (an AVX2 kernel; the AVX-512 backend's own code is the
    /// unfused steps).
    HopF16,
    /// fp16 encode.
    EncodeF16,
    /// fp16 decode into the output (and its residual mode).
    DecodeF16,
    /// fp16 decode added into the output.
    AddF16,
    /// bf16 encode.
    EncodeBf16,
    /// int8 encode.
    EncodeInt8,
    /// sign encode.
    EncodeSign,
    /// sign decode.
    DecodeSign,
    /// qsgd's and ternary's encode (sign-magnitude codes).
    EncodeSignmag,
    /// qsgd's and ternary's decode.
    DecodeSignmag,
    /// natural compression's encode.
    EncodeNatural,
    /// natural compression's decode.
    DecodeNatural,
    /// The magnitude filter of top-k (the elements reaching a threshold).
    FilterMagGe,
    /// The selection bound of `chunktopk` (each of 16 groups' few largest keys).
    LaneBound,
    /// The positions and keys of the elements reaching a key (`chunktopk`'s candidates).
    FilterKeys,
    /// random-k's filter of the draws below a threshold.
    FilterDrawLt,
    /// random-k's count of the draws below a threshold.
    CountDrawLt,
    /// random-k's stratified masks of draws.
    DrawMasks,
    /// random-k's positions from stored masks.
    CompressMasks,
    /// The f32 decode (identity).
    DecodeF32,
    /// The bf16 decode.
    DecodeBf16,
    /// The direct forward DCT of a tile (`dct`'s `transform=direct`).
    DctForward,
    /// The inverse DCT's second pass (the dense rows).
    DctInverse,
    /// Lee's forward DCT of a tile (`dct`'s default transform); the block is the tile's
    /// element count.
    DctLee,
    /// The factorised forward DCT of batched one-row tiles (`transform=fast`); the block
    /// is the tile's width.
    DctFastRows,
    /// The multi-frame reduction of f32 frames.
    ReduceF32,
    /// The multi-frame reduction of fp16 frames.
    ReduceF16,
    /// The multi-frame reduction of bf16 frames.
    ReduceBf16,
    /// The multi-frame reduction of int8 frames.
    ReduceInt8,
    /// fp8 encode by the portable build (the cases no hand-written kernel takes).
    EncodeFp8,
    /// fp4 encode by the portable build (as `EncodeFp8`).
    EncodeFp4,
    /// fp8 encode with nearest rounding, 8-bit codes and an f32 or E8M0 scale.
    EncodeFp8Nearest,
    /// fp4 encode of E2M1 or E3M0 codes with nearest rounding and a scale.
    EncodeFp4Nearest,
    /// fp8 encode with stochastic rounding and a block scale: `Avx512` is the
    /// hand-written AVX-512 kernel, `None` the backend's portable build, `Avx2` the
    /// AVX2 build.
    EncodeFp8Stochastic,
    /// fp4 encode with stochastic rounding and a block scale (as `EncodeFp8Stochastic`).
    EncodeFp4Stochastic,
    /// fp8 decode of E4M3 codes without a scale.
    DecodeE4m3Unscaled,
    /// fp8 decode of E5M2 codes without a scale.
    DecodeE5m2Unscaled,
    /// fp8 decode of E4M3 codes with a scale, in blocks of a multiple of 16.
    DecodeE4m3Blocks,
    /// fp8 decode of E5M2 codes with a scale, in blocks of a multiple of 16.
    DecodeE5m2Blocks,
    /// fp8 decode with a scale of the blocks no kernel above takes (the portable build).
    DecodeFp8Rest,
    /// fp4 decode of blocks of 16 and 32 with a power-of-two or f32 scale.
    DecodeFp4Blocks,
    /// fp4 decode of blocks of 16 and 32 with E4M3 scales (NVFP4).
    DecodeFp4E4m3Blocks,
    /// fp4 decode of other blocks (the portable build).
    DecodeFp4Rest,
    /// PowerSGD's reconstruction of a large matrix, written by non-temporal stores.
    StreamPqt,
    /// PowerSGD's `M Q` (the thin product's dot products).
    ThinMq,
    /// `codebook` encode (moments, bins and the bins' sums).
    EncodeCodebook,
    /// Error feedback's input `beta * r + gamma * g` of the codecs without a fused step.
    FeedbackForm,
}

impl Op {
    /// Every operation, each of which has rows in [`ROWS`].
    pub const ALL: [Op; 50] = [
        Op::FeedbackF16,
        Op::FeedbackInt8,
        Op::HopInt8,
        Op::HopF16,
        Op::EncodeF16,
        Op::DecodeF16,
        Op::AddF16,
        Op::EncodeBf16,
        Op::EncodeInt8,
        Op::EncodeSign,
        Op::DecodeSign,
        Op::EncodeSignmag,
        Op::DecodeSignmag,
        Op::EncodeNatural,
        Op::DecodeNatural,
        Op::FilterMagGe,
        Op::LaneBound,
        Op::FilterKeys,
        Op::FilterDrawLt,
        Op::CountDrawLt,
        Op::DrawMasks,
        Op::CompressMasks,
        Op::DecodeF32,
        Op::DecodeBf16,
        Op::DctForward,
        Op::DctInverse,
        Op::DctLee,
        Op::DctFastRows,
        Op::ReduceF32,
        Op::ReduceF16,
        Op::ReduceBf16,
        Op::ReduceInt8,
        Op::EncodeFp8,
        Op::EncodeFp4,
        Op::EncodeFp8Nearest,
        Op::EncodeFp4Nearest,
        Op::EncodeFp8Stochastic,
        Op::EncodeFp4Stochastic,
        Op::DecodeE4m3Unscaled,
        Op::DecodeE5m2Unscaled,
        Op::DecodeE4m3Blocks,
        Op::DecodeE5m2Blocks,
        Op::DecodeFp8Rest,
        Op::DecodeFp4Blocks,
        Op::DecodeFp4E4m3Blocks,
        Op::DecodeFp4Rest,
        Op::StreamPqt,
        Op::ThinMq,
        Op::EncodeCodebook,
        Op::FeedbackForm,
    ];
}

/// The x86 code an operation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum X86 {
    /// No hand-written x86 kernel: the backend's portable build (scalar and NEON
    /// backends: their own code).
    None,
    /// The AVX2 code: the hand-written AVX2 kernel, or the portable source's AVX2 build.
    Avx2,
    /// The AVX-512 backend's own code: its hand-written kernel where one takes the call,
    /// else its portable build.
    Avx512,
}

impl X86 {
    /// The name in [`ROWS`]' printed form.
    pub fn name(self) -> &'static str {
        match self {
            X86::None => "None",
            X86::Avx2 => "Avx2",
            X86::Avx512 => "Avx512",
        }
    }
}

/// The CPUs a row is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Vendor {
    /// Every x86 CPU the rows before it did not take.
    Any,
    /// Intel's.
    Intel,
    /// AMD's (and any vendor other than Intel).
    Amd,
}

impl Vendor {
    /// This machine's vendor ([`Vendor::Intel`] or [`Vendor::Amd`]), read once from CPUID
    /// leaf 0.
    pub fn this() -> Vendor {
        static VENDOR: OnceLock<Vendor> = OnceLock::new();
        *VENDOR.get_or_init(|| {
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            {
                // SAFETY: CPUID exists on every x86-64 processor; leaf 0 gives the vendor
                // string in EBX, EDX, ECX. (The intrinsic is safe on newer compilers than
                // the crate's minimum, hence the allowance.)
                #[allow(unused_unsafe)]
                let id = unsafe { core::arch::x86_64::__cpuid(0) };
                // "GenuineIntel".
                if (id.ebx, id.edx, id.ecx) == (0x756e_6547, 0x4965_6e69, 0x6c65_746e) {
                    return Vendor::Intel;
                }
            }
            Vendor::Amd
        })
    }

    /// Whether a row for `self` applies on a CPU of `cpu`'s vendor.
    pub const fn covers(self, cpu: Vendor) -> bool {
        matches!(
            (self, cpu),
            (Vendor::Any, _) | (Vendor::Intel, Vendor::Intel) | (Vendor::Amd, Vendor::Amd)
        )
    }
}

/// What a call of an operation is, as far as its route depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    /// The block length (the tile's element count or width for the DCT rows; 0 where the
    /// operation has none).
    pub block: usize,
    /// The element count.
    pub elements: usize,
    /// The mode (`mode::WRITE`, `ADD`, `RESIDUAL`), `WRITE` where the operation has none.
    pub mode: u8,
}

impl Call {
    /// A call whose route depends on nothing but the operation.
    pub const ANY: Call = Call {
        block: 0,
        elements: 0,
        mode: 0,
    };

    /// A call of blocks of `block`.
    pub const fn blocks(block: usize) -> Call {
        Call { block, ..Call::ANY }
    }
}

/// The calls a row takes: every field must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct When {
    /// The modes, bit `m` for mode `m`.
    pub modes: u8,
    /// The blocks of at least this length ...
    pub block_from: usize,
    /// ... and below this one ...
    pub block_below: usize,
    /// ... whose length is a multiple of this.
    pub block_multiple_of: usize,
    /// At least this many elements.
    pub elements_from: usize,
}

impl When {
    /// Every call.
    pub const ALWAYS: When = When {
        modes: 0b111,
        block_from: 0,
        block_below: usize::MAX,
        block_multiple_of: 1,
        elements_from: 0,
    };

    /// Blocks of a length in `from..below`.
    pub const fn blocks(from: usize, below: usize) -> When {
        When {
            block_from: from,
            block_below: below,
            ..When::ALWAYS
        }
    }

    /// Blocks of a multiple of `m` elements.
    pub const fn multiple_of(m: usize) -> When {
        When {
            block_multiple_of: m,
            ..When::ALWAYS
        }
    }

    /// These calls, in the modes of bit set `modes` only.
    pub const fn in_modes(self, modes: u8) -> When {
        When { modes, ..self }
    }

    /// These calls, of at least `n` elements only.
    pub const fn from_elements(self, n: usize) -> When {
        When {
            elements_from: n,
            ..self
        }
    }

    /// Whether `call` is one of these calls.
    pub const fn holds(&self, call: Call) -> bool {
        self.modes & (1 << call.mode) != 0
            && call.block >= self.block_from
            && call.block < self.block_below
            && call.block.is_multiple_of(self.block_multiple_of)
            && call.elements >= self.elements_from
    }

    /// Whether every call is one of these.
    pub const fn is_always(&self) -> bool {
        self.modes == 0b111
            && self.block_from == 0
            && self.block_below == usize::MAX
            && self.block_multiple_of == 1
            && self.elements_from == 0
    }
}

/// The codec operation `backend_race --routing` times for a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// `encode_into`.
    Encode,
    /// `decode_into`.
    Decode,
    /// `decode_add`.
    DecodeAdd,
    /// The error-feedback step (`ErrorFeedback::encode_into`).
    Step,
    /// `reduce_frames` of eight frames.
    Reduce,
}

/// A row's measurement: `measure` of codec `spec` on `elements` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// The codec spec.
    pub spec: &'static str,
    /// The operation timed.
    pub measure: Measure,
    /// The element count.
    pub elements: usize,
}

/// One routing choice: on the AVX-512 backend of a `cpu` CPU, the calls of `op` that
/// `when` holds for run `takes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// The operation.
    pub op: Op,
    /// The CPUs it is for.
    pub cpu: Vendor,
    /// The calls it is for.
    pub when: When,
    /// The code they run.
    pub takes: X86,
    /// The codec operation that measures it; `None` where none isolates it (the ring
    /// hops, PowerSGD's products).
    pub probe: Option<Probe>,
    /// When, on what, and what was measured.
    pub measured: &'static str,
}

const K64: usize = 1 << 16;
const M1: usize = 1 << 20;

/// A row.
const fn row(op: Op, cpu: Vendor, when: When, takes: X86, measured: &'static str) -> Row {
    Row {
        op,
        cpu,
        when,
        takes,
        probe: None,
        measured,
    }
}

/// A row with its probe.
const fn probed(
    op: Op,
    cpu: Vendor,
    when: When,
    takes: X86,
    (spec, measure, elements): (&'static str, Measure, usize),
    measured: &'static str,
) -> Row {
    Row {
        probe: Some(Probe {
            spec,
            measure,
            elements,
        }),
        ..row(op, cpu, when, takes, measured)
    }
}

use Measure::{Decode, DecodeAdd, Encode, Reduce, Step};
use Vendor::{Any, Intel};
use X86::{Avx2, Avx512, None as Portable};

/// The modes' bits: writing, adding, the residual.
const WRITE: u8 = 1;
const ADD: u8 = 2;

const ZEN5_1124: &str = "2026-11-24, Zen 5 (a6cfab8)";
const XEON_1126: &str = "2026-11-26, Intel Xeon with AVX-512 FP16";
const XEON_1127: &str = "2026-11-27, 2-core Intel Xeon";
const XEON_1129: &str = "2026-11-29, 2-core Intel Xeon";
const ZEN5_1202: &str = "2026-12-02, 2-core Zen 5";
const ZEN5_1203: &str = "2026-12-03, 2-core Zen 5";
const XEON_1203: &str = "2026-12-03, 2-core Intel Xeon (AVX-512 without FP16)";

/// The routing table (see the module docs): for each operation, its rows in order; the
/// first that matches the CPU and the call decides.
#[rustfmt::skip]
pub const ROWS: &[Row] = &[
    // fp16: AVX-512's kernels 7 to 12% faster on a Zen 5; on Intel's cores the AVX2 ones
    // decode 8 to 14% faster at 64 Ki and sum eight frames 11 to 14% faster, and top-k's
    // few kept values encode 4 to 9% faster.
    probed(Op::FeedbackF16, Any, When::ALWAYS, Avx512, ("fp16", Step, K64), ZEN5_1124),
    probed(Op::EncodeF16, Intel, When::ALWAYS, Avx2, ("fp16", Encode, K64), XEON_1126),
    probed(Op::EncodeF16, Any, When::ALWAYS, Avx512, ("fp16", Encode, K64), ZEN5_1124),
    probed(Op::DecodeF16, Intel, When::ALWAYS, Avx2, ("fp16", Decode, K64), XEON_1126),
    probed(Op::DecodeF16, Any, When::ALWAYS, Avx512, ("fp16", Decode, K64), ZEN5_1124),
    // Adding: AVX2's 9% faster at 1 Mi.
    probed(Op::AddF16, Any, When::ALWAYS, Avx2, ("fp16", DecodeAdd, M1), ZEN5_1124),
    row(Op::HopF16, Any, When::ALWAYS, Avx2, ZEN5_1124),
    probed(Op::EncodeBf16, Any, When::ALWAYS, Avx512, ("bf16", Encode, K64), ZEN5_1124),
    // The f32 and bf16 decodes' AVX2 builds up to 12% and 2 to 5% faster.
    probed(Op::DecodeF32, Any, When::ALWAYS, Avx2, ("identity", Decode, M1), ZEN5_1124),
    probed(Op::DecodeBf16, Any, When::ALWAYS, Avx2, ("bf16", Decode, M1), ZEN5_1124),
    // With AVX-512's build, the steps of fp8 and fp4 in blocks of 10 ran 7% slower.
    probed(Op::FeedbackForm, Any, When::ALWAYS, Avx2, ("fp8:block=10", Step, K64), ZEN5_1202),
    // Reducing eight frames: AVX-512 1.5 times AVX2 for int8, 1.1 to 1.4 for bf16, 1.07
    // to 1.12 for fp16, level for f32.
    probed(Op::ReduceF32, Any, When::ALWAYS, Avx512, ("identity", Reduce, K64), ZEN5_1124),
    probed(Op::ReduceF16, Intel, When::ALWAYS, Avx2, ("fp16", Reduce, K64), XEON_1126),
    probed(Op::ReduceF16, Any, When::ALWAYS, Avx512, ("fp16", Reduce, K64), ZEN5_1124),
    probed(Op::ReduceBf16, Any, When::ALWAYS, Avx512, ("bf16", Reduce, K64), ZEN5_1124),
    probed(Op::ReduceInt8, Any, When::ALWAYS, Avx512, ("int8", Reduce, K64), ZEN5_1124),
    // int8: AVX-512's encode 1.23 to 1.40 times AVX2's at 64 Ki, its step 1.24 to 1.33,
    // its hop 1.17 to 1.25, for blocks of a multiple of 64 (its step); blocks of 32 and
    // 40 1.1 to 1.3 times slower.
    probed(Op::EncodeInt8, Intel, When::multiple_of(64), Avx512, ("int8", Encode, K64), XEON_1129),
    probed(Op::EncodeInt8, Any, When::ALWAYS, Avx2, ("int8:block=40", Encode, K64), XEON_1129),
    probed(Op::FeedbackInt8, Intel, When::multiple_of(64), Avx512, ("int8", Step, K64), XEON_1129),
    probed(Op::FeedbackInt8, Any, When::ALWAYS, Avx2, ("int8:block=40", Step, K64), XEON_1129),
    row(Op::HopInt8, Intel, When::multiple_of(64), Avx512, XEON_1129),
    row(Op::HopInt8, Any, When::ALWAYS, Avx2, XEON_1129),
    // sign: AVX-512's encode 1.3 to 1.7 times slower on blocks of 16 to 64 (its per-block
    // lane sums), level at 128, faster from 192.
    probed(Op::EncodeSign, Any, When::blocks(128, usize::MAX), Avx512, ("sign", Encode, K64), XEON_1129),
    probed(Op::EncodeSign, Any, When::ALWAYS, Avx2, ("sign:block=64", Encode, K64), XEON_1129),
    probed(Op::DecodeSign, Any, When::ALWAYS, Avx2, ("sign", DecodeAdd, K64), ZEN5_1124),
    // qsgd and ternary: blocks of 96, 100 and 160 1.15 to 1.27 times slower on AVX-512
    // (its 64s, the rest on AVX2's 32s), 64 and its multiples faster.
    probed(Op::EncodeSignmag, Any, When::multiple_of(64), Avx512, ("qsgd:bits=4", Encode, K64), XEON_1129),
    probed(Op::EncodeSignmag, Any, When::ALWAYS, Avx2, ("qsgd:bits=4,block=96", Encode, K64), XEON_1129),
    probed(Op::DecodeSignmag, Any, When::ALWAYS, Avx2, ("qsgd:bits=4", DecodeAdd, K64), ZEN5_1124),
    // natural: AVX-512's portable build 3.3 times slower.
    probed(Op::EncodeNatural, Any, When::ALWAYS, Avx2, ("natural", Encode, K64), ZEN5_1124),
    probed(Op::DecodeNatural, Any, When::ALWAYS, Avx2, ("natural", DecodeAdd, K64), ZEN5_1124),
    // top-k's filters; chunktopk's bound 660 against 800 ns a chunk, its candidates 430
    // against 660 on Intel's cores.
    probed(Op::FilterMagGe, Any, When::ALWAYS, Avx512, ("topk:ratio=0.01,values=fp16", Encode, K64), ZEN5_1124),
    probed(Op::LaneBound, Intel, When::ALWAYS, Avx512, ("chunktopk", Encode, M1), XEON_1129),
    probed(Op::LaneBound, Any, When::ALWAYS, Avx2, ("chunktopk", Encode, M1), ZEN5_1124),
    probed(Op::FilterKeys, Intel, When::ALWAYS, Avx512, ("chunktopk", Encode, M1), XEON_1129),
    probed(Op::FilterKeys, Any, When::ALWAYS, Avx2, ("chunktopk", Encode, M1), ZEN5_1124),
    // random-k's draws: AVX-512's portable builds up to 2.4 times slower.
    probed(Op::FilterDrawLt, Any, When::ALWAYS, Avx2, ("randk:ratio=0.01", Encode, K64), ZEN5_1124),
    probed(Op::CountDrawLt, Any, When::ALWAYS, Avx2, ("randk:ratio=0.01", Encode, K64), ZEN5_1124),
    probed(Op::DrawMasks, Any, When::ALWAYS, Avx2, ("randk:ratio=0.01,select=strata", Encode, K64), ZEN5_1124),
    probed(Op::CompressMasks, Any, When::ALWAYS, Avx2, ("randk:ratio=0.01,select=strata", Encode, K64), ZEN5_1124),
    // The DCT: the direct transform's AVX2 build 1.5 times as fast on 64 x 64 tiles on a
    // Zen 5, its AVX-512 build 1.62 to 1.64 times on a Xeon (three runs); Lee's transform
    // 1.16 to 1.24 times as fast on AVX-512 on one-row tiles, 1.6 to 1.9 on 64 x 64 (an
    // earlier Xeon measurement of 64 x 64 tiles, AVX2 8 to 11% faster in two runs of
    // three, did not hold); the factorised one-row tiles of 16 and 32 1.2 to 1.3 on AVX2.
    probed(Op::DctForward, Intel, When::ALWAYS, Avx512, ("dct:chunk=64,width=64,k=16,transform=direct", Encode, K64), XEON_1203),
    probed(Op::DctForward, Any, When::ALWAYS, Avx2, ("dct:chunk=64,width=64,k=16,transform=direct", Encode, K64), ZEN5_1124),
    probed(Op::DctInverse, Any, When::ALWAYS, Avx2, ("dct:k=4,values=sign", Decode, K64), ZEN5_1124),
    probed(Op::DctLee, Any, When::ALWAYS, Avx512, ("dct:chunk=64,width=64,k=16", Encode, M1), XEON_1203),
    probed(Op::DctFastRows, Any, When::blocks(16, 17), Avx2, ("dct:chunk=16,k=2,transform=fast", Encode, K64), XEON_1127),
    probed(Op::DctFastRows, Any, When::blocks(32, 33), Avx2, ("dct:chunk=32,k=2,transform=fast", Encode, K64), XEON_1127),
    probed(Op::DctFastRows, Any, When::ALWAYS, Avx512, ("dct:k=4,transform=fast", Encode, K64), XEON_1127),
    // PowerSGD: `M Q` 1.5 times as fast on AVX2 (twice the independent sums); the
    // streamed reconstruction level.
    row(Op::StreamPqt, Any, When::ALWAYS, Avx512, ZEN5_1124),
    row(Op::ThinMq, Any, When::ALWAYS, Avx2, ZEN5_1124),
    // codebook: AVX2's build 1.25 to 1.3 times AVX-512's on 2026-11-29; since the bins
    // became (sum, count) pairs, 1.04 (AVX-512's 0.96, within a run's spread).
    probed(Op::EncodeCodebook, Any, When::ALWAYS, Avx2, ("codebook", Encode, K64), XEON_1203),
    // fp8 and fp4 encode: the portable AVX-512 builds 1.8 times the AVX2 ones; the
    // nearest kernels' AVX-512 forms 1.1 to 1.6 times AVX2's on Intel's cores.
    probed(Op::EncodeFp8, Any, When::ALWAYS, Avx512, ("fp8:scale=none", Encode, K64), ZEN5_1124),
    probed(Op::EncodeFp4, Any, When::ALWAYS, Avx512, ("fp4:scale=e8m0,scale_rule=ocp", Encode, K64), ZEN5_1124),
    probed(Op::EncodeFp8Nearest, Intel, When::ALWAYS, Avx512, ("fp8", Encode, K64), XEON_1129),
    probed(Op::EncodeFp8Nearest, Any, When::ALWAYS, Avx2, ("fp8", Encode, K64), XEON_1129),
    probed(Op::EncodeFp4Nearest, Intel, When::ALWAYS, Avx512, ("fp4", Encode, K64), XEON_1129),
    probed(Op::EncodeFp4Nearest, Any, When::ALWAYS, Avx2, ("fp4", Encode, K64), XEON_1129),
    // Stochastic rounding: the AVX-512 kernel 1.03 to 1.21 times the portable AVX-512
    // build from blocks of 64 (fp8) and 128 (fp4), slower below; blocks of 2, 3 and 8 to
    // 11 1.1 to 1.5 times as fast on the AVX2 build.
    probed(Op::EncodeFp8Stochastic, Intel, When::blocks(64, usize::MAX), Avx512, ("fp8:rounding=stochastic", Encode, K64), XEON_1129),
    probed(Op::EncodeFp8Stochastic, Intel, When::blocks(0, 4), Avx2, ("fp8:rounding=stochastic,block=3", Encode, K64), XEON_1129),
    probed(Op::EncodeFp8Stochastic, Intel, When::blocks(8, 12), Avx2, ("fp8:rounding=stochastic,block=10", Encode, K64), XEON_1129),
    probed(Op::EncodeFp8Stochastic, Any, When::ALWAYS, Portable, ("fp8:rounding=stochastic,block=32", Encode, K64), XEON_1129),
    probed(Op::EncodeFp4Stochastic, Intel, When::blocks(128, usize::MAX), Avx512, ("fp4:rounding=stochastic,block=128", Encode, K64), XEON_1129),
    probed(Op::EncodeFp4Stochastic, Intel, When::blocks(0, 4), Avx2, ("fp4:rounding=stochastic,block=2", Encode, K64), XEON_1129),
    probed(Op::EncodeFp4Stochastic, Intel, When::blocks(8, 12), Avx2, ("fp4:rounding=stochastic,block=10", Encode, K64), XEON_1129),
    probed(Op::EncodeFp4Stochastic, Any, When::ALWAYS, Portable, ("fp4:rounding=stochastic", Encode, K64), XEON_1129),
    // fp8 without a scale: writing past L2, AVX2's 256-bit stores 1.05 to 1.1 times as
    // fast; below, and adding, AVX-512 1.2 to 1.7 times.
    probed(Op::DecodeE4m3Unscaled, Any, When::ALWAYS.in_modes(WRITE).from_elements(M1), Avx2, ("fp8:scale=none", Decode, M1), ZEN5_1203),
    probed(Op::DecodeE4m3Unscaled, Any, When::ALWAYS, Avx512, ("fp8:scale=none", Decode, K64), ZEN5_1203),
    probed(Op::DecodeE5m2Unscaled, Any, When::ALWAYS.in_modes(WRITE).from_elements(M1 / 2), Avx2, ("fp8:format=e5m2,scale=none", Decode, M1), ZEN5_1203),
    probed(Op::DecodeE5m2Unscaled, Any, When::ALWAYS, Avx512, ("fp8:format=e5m2,scale=none", Decode, K64), ZEN5_1203),
    // fp8 with a scale, blocks of a multiple of 16: under 64 AVX2 1.15 to 1.7 times as
    // fast (one or two steps a block); from 64 AVX-512 level writing, 1.15 to 1.2 adding;
    // E5M2's plain decode 0 to 20% faster on AVX2. The residual mode: AVX2's.
    probed(Op::DecodeE4m3Blocks, Any, When::blocks(64, usize::MAX).in_modes(WRITE | ADD), Avx512, ("fp8", DecodeAdd, K64), XEON_1129),
    probed(Op::DecodeE4m3Blocks, Any, When::ALWAYS, Avx2, ("fp8:block=32", DecodeAdd, K64), XEON_1129),
    probed(Op::DecodeE5m2Blocks, Any, When::blocks(64, usize::MAX).in_modes(ADD), Avx512, ("fp8:format=e5m2", DecodeAdd, K64), XEON_1129),
    probed(Op::DecodeE5m2Blocks, Any, When::ALWAYS, Avx2, ("fp8:format=e5m2", Decode, K64), XEON_1129),
    // The other fp8 blocks: AVX-512's build of blocks of 10 10 to 15% slower, level at 24,
    // 1.13 to 1.15 times as fast at 40.
    probed(Op::DecodeFp8Rest, Any, When::blocks(0, 24), Avx2, ("fp8:block=10", Decode, K64), ZEN5_1202),
    probed(Op::DecodeFp8Rest, Any, When::ALWAYS, Avx512, ("fp8:block=40", Decode, K64), ZEN5_1202),
    // fp4 blocks of 16 and 32: AVX-512 adds blocks of 32 1.05 to 1.15 times as fast; its
    // plain decode 1.09 to 1.16 times slower, blocks of 16 or E4M3 scales 1.12 to 1.9.
    // Other blocks: AVX2's build 1.2 to 1.5 times as fast.
    probed(Op::DecodeFp4Blocks, Any, When::blocks(32, 33).in_modes(ADD), Avx512, ("fp4", DecodeAdd, K64), XEON_1129),
    probed(Op::DecodeFp4Blocks, Any, When::ALWAYS, Avx2, ("fp4", Decode, K64), XEON_1129),
    probed(Op::DecodeFp4E4m3Blocks, Any, When::ALWAYS, Avx2, ("fp4:scale=e4m3", DecodeAdd, K64), XEON_1129),
    probed(Op::DecodeFp4Rest, Any, When::ALWAYS, Avx2, ("fp4:block=10", Decode, K64), XEON_1129),
];

/// The code `op` runs for `call` on a backend of `kind` on a CPU of vendor `cpu`: the
/// AVX2 backend its own, the AVX-512 backend the first matching row's, the others none.
pub fn route_on(op: Op, kind: BackendKind, cpu: Vendor, call: Call) -> X86 {
    match kind {
        BackendKind::Avx2 => Avx2,
        BackendKind::Avx512 => ROWS[rows_of(op)]
            .iter()
            .find(|r| r.cpu.covers(cpu) && r.when.holds(call))
            .map_or(Avx512, |r| r.takes),
        _ => Portable,
    }
}

/// The rows of `op` in [`ROWS`] (contiguous, a unit test checks): found once for every
/// operation, so that a call routed per block or per tile scans its operation's one to
/// four rows, not the table (a scan of the whole table per call made AVX-512's fp4 sum
/// of eight frames 10 to 20% slower).
fn rows_of(op: Op) -> core::ops::Range<usize> {
    static INDEX: OnceLock<[(u16, u16); Op::ALL.len()]> = OnceLock::new();
    let index = INDEX.get_or_init(|| {
        let mut index = [(0, 0); Op::ALL.len()];
        for (at, r) in ROWS.iter().enumerate() {
            let (start, end) = &mut index[r.op as usize];
            if *end == 0 {
                *start = at as u16;
            }
            *end = at as u16 + 1;
        }
        index
    });
    let (start, end) = index[op as usize];
    start as usize..end as usize
}

/// [`route_on`] on this machine's vendor, for the table of backend `K` (`table::kind`;
/// the unrouted AVX-512 backend's, `table::UNROUTED`, takes its own code everywhere).
#[inline]
pub(super) fn route<const K: u8>(op: Op, call: Call) -> X86 {
    if K == super::table::UNROUTED {
        return Avx512;
    }
    route_on(op, super::table::kind::<K>(), Vendor::this(), call)
}

/// `backend` with routing off: an AVX-512 backend then runs its own code (its
/// hand-written kernel, else its portable build) for every operation, never the AVX2
/// code the routing table would choose. This is what `backend_race --routing` measures
/// the table with, and what the tests run to check every AVX-512 kernel whatever the
/// table says. Any other backend is returned as it is (it has no routing).
pub fn unrouted(backend: Backend) -> Backend {
    backend.with_routing(false)
}

/// A row in the form [`ROWS`] is written in (`op, cpu, when, takes`), for
/// `backend_race --routing`.
pub fn row_source(r: &Row) -> String {
    format!(
        "Op::{:?}, {:?}, {}, {}",
        r.op,
        r.cpu,
        r.when.source(),
        r.takes.name()
    )
}

impl When {
    /// These calls as the constructors above write them.
    pub fn source(&self) -> String {
        let mut s = match (self.block_from, self.block_below, self.block_multiple_of) {
            (0, usize::MAX, 1) => "When::ALWAYS".to_string(),
            (from, below, 1) => {
                let below = if below == usize::MAX {
                    "usize::MAX".to_string()
                } else {
                    below.to_string()
                };
                format!("When::blocks({from}, {below})")
            }
            (0, usize::MAX, m) => format!("When::multiple_of({m})"),
            (from, below, m) => format!(
                "When {{ block_from: {from}, block_below: {below}, ..When::multiple_of({m}) }}"
            ),
        };
        if self.modes != 0b111 {
            s += &format!(".in_modes({:#05b})", self.modes);
        }
        if self.elements_from != 0 {
            s += &format!(".from_elements({})", self.elements_from);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Vendor::Amd;

    #[test]
    fn every_operation_has_a_last_row_for_every_call_and_no_row_is_shadowed() {
        for op in Op::ALL {
            let rows: Vec<&Row> = ROWS.iter().filter(|r| r.op == op).collect();
            assert!(!rows.is_empty(), "{op:?} has no row");
            let last = rows.last().unwrap();
            assert!(
                last.cpu == Any && last.when.is_always(),
                "{op:?}: the last row must take any CPU and any call"
            );
            // Only the last row takes every call of every vendor: a row after such a
            // row would never be reached.
            for r in &rows[..rows.len() - 1] {
                assert!(
                    !(r.cpu == Any && r.when.is_always()),
                    "{op:?}: a row before the last takes every call"
                );
            }
            // The rows of one operation are contiguous.
            let at = ROWS.iter().position(|r| r.op == op).unwrap();
            assert!(
                ROWS[at..at + rows.len()].iter().all(|r| r.op == op),
                "{op:?}"
            );
        }
        assert!(ROWS.iter().all(|r| Op::ALL.contains(&r.op)));
        // `Op::ALL` lists the operations in declaration order (the index is by
        // discriminant), and each one's rows are the ones `rows_of` gives.
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, i, "{op:?}");
            let rows = rows_of(op);
            assert!(ROWS[rows.clone()].iter().all(|r| r.op == op), "{op:?}");
            assert_eq!(rows.len(), ROWS.iter().filter(|r| r.op == op).count());
        }
    }

    #[test]
    fn every_probe_is_a_codec_and_its_operation_exists() {
        for r in ROWS {
            let Some(p) = r.probe else { continue };
            let spec: crate::CodecSpec = p.spec.parse().unwrap_or_else(|e| {
                panic!("{:?}: probe {} is not a codec: {e}", r.op, p.spec);
            });
            if p.measure == Measure::Step {
                assert!(
                    crate::ErrorFeedback::new(spec, p.elements).is_ok(),
                    "{:?}: {} has no error-feedback step",
                    r.op,
                    p.spec
                );
            }
            assert!(p.elements > 0);
        }
    }

    #[test]
    fn only_the_avx512_backend_routes_and_the_portable_value_is_for_the_stochastic_rows() {
        let calls = [
            Call::ANY,
            Call::blocks(10),
            Call::blocks(32),
            Call::blocks(64),
            Call::blocks(4096),
            Call {
                block: 128,
                elements: M1,
                mode: 1,
            },
        ];
        for op in Op::ALL {
            for cpu in [Intel, Amd] {
                for call in calls {
                    assert_eq!(route_on(op, BackendKind::Avx2, cpu, call), Avx2);
                    assert_eq!(route_on(op, BackendKind::Scalar, cpu, call), Portable);
                    assert_eq!(route_on(op, BackendKind::Neon, cpu, call), Portable);
                }
            }
        }
        for r in ROWS {
            if r.takes == Portable {
                assert!(
                    matches!(r.op, Op::EncodeFp8Stochastic | Op::EncodeFp4Stochastic),
                    "{:?}: only the stochastic encoders choose between a kernel and a build",
                    r.op
                );
            }
        }
    }

    /// The measured rules, case by case: the rows give each call the code it was
    /// measured faster on.
    #[test]
    fn the_classes_pick_the_rows_they_name() {
        let avx512 = |op, cpu, block, elements, mode| {
            route_on(
                op,
                BackendKind::Avx512,
                cpu,
                Call {
                    block,
                    elements,
                    mode,
                },
            )
        };
        let (write, add, residual) = (0, 1, 2);
        // AVX-512's int8 kernels on Intel's cores for blocks of a multiple of 64 only; its
        // sign-magnitude encoder on any CPU likewise; its sign encoder from 128.
        for block in [1, 16, 32, 40, 48, 64, 96, 127, 128, 256, 4096] {
            for op in [Op::EncodeInt8, Op::FeedbackInt8, Op::HopInt8] {
                let want = if block % 64 == 0 { Avx512 } else { Avx2 };
                assert_eq!(avx512(op, Intel, block, K64, write), want, "{op:?} {block}");
                assert_eq!(avx512(op, Amd, block, K64, write), Avx2, "{op:?} {block}");
            }
            let want = if block % 64 == 0 { Avx512 } else { Avx2 };
            for cpu in [Intel, Amd] {
                assert_eq!(avx512(Op::EncodeSignmag, cpu, block, K64, write), want);
                let sign = if block >= 128 { Avx512 } else { Avx2 };
                assert_eq!(avx512(Op::EncodeSign, cpu, block, K64, write), sign);
            }
        }
        // fp8 without a scale: adding and the residual mode always on AVX-512, writing
        // while the output fits the core's L2.
        for cpu in [Intel, Amd] {
            let e4 = |elements, mode| avx512(Op::DecodeE4m3Unscaled, cpu, 0, elements, mode);
            let e5 = |elements, mode| avx512(Op::DecodeE5m2Unscaled, cpu, 0, elements, mode);
            assert_eq!(e4(1 << 24, add), Avx512);
            assert_eq!(e4(1 << 24, residual), Avx512);
            assert_eq!(e4(M1 - 1, write), Avx512);
            assert_eq!(e4(M1, write), Avx2);
            assert_eq!(e5(M1 / 2 - 1, write), Avx512);
            assert_eq!(e5(M1 / 2, write), Avx2);
            assert_eq!(e5(1 << 24, residual), Avx512);
        }
        // fp8 with a scale: blocks of 64 and more; E5M2's plain decode and the residual
        // mode not. fp4: adding blocks of 32 with an f32 or E8M0 scale only.
        let cases = [
            (Op::DecodeE4m3Blocks, 16, write, Avx2),
            (Op::DecodeE4m3Blocks, 48, add, Avx2),
            (Op::DecodeE4m3Blocks, 64, write, Avx512),
            (Op::DecodeE4m3Blocks, 128, add, Avx512),
            (Op::DecodeE4m3Blocks, 128, residual, Avx2),
            (Op::DecodeE5m2Blocks, 128, write, Avx2),
            (Op::DecodeE5m2Blocks, 128, add, Avx512),
            (Op::DecodeE5m2Blocks, 32, add, Avx2),
            (Op::DecodeFp4Blocks, 32, add, Avx512),
            (Op::DecodeFp4Blocks, 32, write, Avx2),
            (Op::DecodeFp4Blocks, 16, add, Avx2),
            (Op::DecodeFp4Blocks, 32, residual, Avx2),
            (Op::DecodeFp4E4m3Blocks, 32, add, Avx2),
            (Op::DecodeFp4E4m3Blocks, 16, add, Avx2),
            // The rest of a decode: fp8 blocks under 24 and fp4's on the AVX2 build.
            (Op::DecodeFp8Rest, 10, write, Avx2),
            (Op::DecodeFp8Rest, 23, add, Avx2),
            (Op::DecodeFp8Rest, 24, write, Avx512),
            (Op::DecodeFp8Rest, 40, residual, Avx512),
            (Op::DecodeFp4Rest, 10, write, Avx2),
            (Op::DecodeFp4Rest, 100, add, Avx2),
        ];
        for (op, block, mode, want) in cases {
            for cpu in [Intel, Amd] {
                assert_eq!(
                    avx512(op, cpu, block, K64, mode),
                    want,
                    "{op:?} {block} {mode}"
                );
            }
        }
        // Stochastic fp8 and fp4 on Intel's cores: the AVX-512 kernel from blocks of 64
        // (fp8) or 128 (fp4), the AVX2 build for 2, 3 and 8 to 11, AVX-512's build
        // otherwise; AMD's cores AVX-512's build throughout.
        for (op, least) in [
            (Op::EncodeFp8Stochastic, 64),
            (Op::EncodeFp4Stochastic, 128),
        ] {
            for block in 1..=300 {
                let intel = if block >= least {
                    Avx512
                } else if matches!(block, 1..=3 | 8..=11) {
                    Avx2
                } else {
                    Portable
                };
                assert_eq!(
                    avx512(op, Intel, block, K64, write),
                    intel,
                    "{op:?} {block}"
                );
                assert_eq!(
                    avx512(op, Amd, block, K64, write),
                    Portable,
                    "{op:?} {block}"
                );
            }
        }
        // The DCT: Lee's tiles on AVX-512; the direct transform on AVX-512 on Intel's
        // cores only; the factorised rows of 16 and 32 on AVX2.
        for tile in [64, 1024, 4096] {
            assert_eq!(avx512(Op::DctLee, Amd, tile, K64, write), Avx512);
        }
        assert_eq!(avx512(Op::DctForward, Intel, 4096, K64, write), Avx512);
        assert_eq!(avx512(Op::DctForward, Amd, 4096, K64, write), Avx2);
        for (w, want) in [(8, Avx512), (16, Avx2), (32, Avx2), (64, Avx512)] {
            assert_eq!(avx512(Op::DctFastRows, Intel, w, K64, write), want);
        }
    }

    #[test]
    fn the_vendor_is_this_machines() {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if let Ok(t) = std::fs::read_to_string("/proc/cpuinfo") {
            assert_eq!(Vendor::this() == Intel, t.contains("GenuineIntel"));
        }
    }
}
