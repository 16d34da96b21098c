//! Backend selection: detected once, stored, forceable.
//!
//! A [`Backend`] value can only be built after the CPU check for its instruction set has
//! passed (the constructors return `Option`), so kernels may use its instructions without
//! re-checking. The default backend is the best one the CPU has, or the one named by the
//! environment variable `GRADPACK_BACKEND` (`scalar`, `avx2`, `avx512`, `neon`); it is
//! chosen on first use and kept. [`Backend::run`] forces a backend on the current thread
//! for the duration of a closure, which is how tests and benchmarks exercise every path.

use core::cell::Cell;
use core::fmt;
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The instruction set a [`Backend`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum BackendKind {
    /// The scalar kernels: the specification, available everywhere.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C (x86-64-v3).
    Avx2,
    /// x86-64 AVX-512 F/BW/CD/DQ/VL, with F16C (x86-64-v4).
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl BackendKind {
    /// Every kind, in order of preference from worst to best.
    pub const ALL: [BackendKind; 4] = [
        BackendKind::Scalar,
        BackendKind::Avx2,
        BackendKind::Avx512,
        BackendKind::Neon,
    ];

    /// The name used by `GRADPACK_BACKEND` and in reports.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Scalar => "scalar",
            BackendKind::Avx2 => "avx2",
            BackendKind::Avx512 => "avx512",
            BackendKind::Neon => "neon",
        }
    }
}

/// A kernel backend this CPU supports (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Backend {
    kind: BackendKind,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.name())
    }
}

/// The operations with hand-written x86 kernels: the rows of [`x86_route`] (only
/// consulted by x86 builds; elsewhere every row routes to `X86::None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Op {
    FeedbackF16,
    /// int8's fused error-feedback step: an AVX2 kernel and an AVX-512 one.
    FeedbackInt8,
    /// int8's fused ring hop (a decode added to local values, then encoded): as
    /// `FeedbackInt8`.
    HopInt8,
    /// fp16's fused ring hop: an AVX2 (F16C) kernel only.
    HopF16,
    EncodeF16,
    /// fp16 decode into the output.
    DecodeF16,
    /// fp16 decode added into the output.
    AddF16,
    EncodeBf16,
    /// int8 encode: an AVX2 kernel and an AVX-512 one.
    EncodeInt8,
    EncodeSign,
    DecodeSign,
    EncodeSignmag,
    DecodeSignmag,
    EncodeNatural,
    DecodeNatural,
    FilterMagGe,
    /// The selection bound of `chunktopk` (each of 16 groups' few largest keys): an
    /// AVX-512 kernel (float minima and maxima); elsewhere portable code, as `DecodeF32`.
    LaneBound,
    /// The positions and keys of the elements reaching a key (`chunktopk`'s candidates):
    /// an AVX-512 kernel of 16 lanes a compress; elsewhere `FilterMagGe`'s kernels.
    FilterKeys,
    FilterDrawLt,
    CountDrawLt,
    DrawMasks,
    CompressMasks,
    /// The f32 decode (identity): portable code, compiled for AVX2 or AVX-512 by pulp.
    DecodeF32,
    /// The bf16 decode: portable code, as `DecodeF32`.
    DecodeBf16,
    /// The forward DCT of the `dct` codec: portable code, as `DecodeF32`.
    DctForward,
    /// The inverse DCT's second pass (the dense rows): portable code, as `DecodeF32`.
    DctInverse,
    /// Lee's forward DCT of a 64 x 64 tile: portable code, as `DecodeF32`.
    DctLee64x64,
    /// The factorised forward DCT of batched one-row tiles of 16 or 32: portable code, as
    /// `DecodeF32`.
    DctFastRows16Or32,
    /// The multi-frame reduction of f32 frames: portable code, as `DecodeF32`.
    ReduceF32,
    /// The multi-frame reduction of fp16 frames (F16C).
    ReduceF16,
    /// The multi-frame reduction of bf16 frames: portable code, as `DecodeF32`.
    ReduceBf16,
    /// The multi-frame reduction of int8 frames: portable code, as `DecodeF32`.
    ReduceInt8,
    /// fp8 encode (branch-free conversions): portable code, as `DecodeF32`.
    EncodeFp8,
    /// fp8 encode with nearest rounding, 8-bit codes and an f32 or E8M0 scale: an AVX2
    /// kernel of 32 elements a step.
    EncodeFp8Nearest,
    /// fp4 encode of E2M1 or E3M0 codes with nearest rounding and a scale: an AVX2
    /// kernel of 32 elements a step.
    EncodeFp4Nearest,
    /// fp8 decode: portable code, as `DecodeF32`.
    DecodeFp8,
    /// fp4 encode: portable code, as `DecodeF32`.
    EncodeFp4,
    /// fp4 decode: lookups in registers for blocks of 16 and 32, else portable code.
    DecodeFp4,
    /// PowerSGD's reconstruction of a large matrix, written by non-temporal stores.
    StreamPqt,
    /// PowerSGD's `M Q` (the thin product's dot products): portable code, as `DecodeF32`.
    ThinMq,
    /// `codebook` encode (moments, bins and the bins' sums): portable code, as
    /// `DecodeF32`.
    EncodeCodebook,
    /// Error feedback's input `beta * r + gamma * g` of the fixed-rate codecs without a
    /// fused step: portable code, as `DecodeF32`.
    FeedbackForm,
}

impl Op {
    /// Every row of the routing table.
    #[cfg(test)]
    pub(crate) const ALL: [Op; 42] = [
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
        Op::DctLee64x64,
        Op::DctFastRows16Or32,
        Op::ReduceF32,
        Op::ReduceF16,
        Op::ReduceBf16,
        Op::ReduceInt8,
        Op::EncodeFp8,
        Op::EncodeFp8Nearest,
        Op::EncodeFp4Nearest,
        Op::DecodeFp8,
        Op::EncodeFp4,
        Op::DecodeFp4,
        Op::StreamPqt,
        Op::ThinMq,
        Op::EncodeCodebook,
        Op::FeedbackForm,
    ];
}

/// The hand-written x86 kernel family an operation runs on a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum X86 {
    /// None: the scalar, portable (pulp) or NEON path of the backend.
    None,
    /// The AVX2 kernel (AVX2, FMA, F16C, BMI1, POPCNT).
    Avx2,
    /// The AVX-512 kernel.
    Avx512,
}

/// The routing table: which x86 kernel `op` runs on a backend of `kind` on a CPU of the
/// vendor `cpu` (five rows of the AVX-512 backend differ between Intel's and AMD's cores:
/// three of fp16 and two of int8; see the first arms below).
///
/// An AVX-512 CPU also runs every AVX2 kernel (the AVX-512 backend is only detected on a
/// CPU that has everything the AVX2 backend needs), so the AVX-512 backend takes, for
/// each operation, the faster of its own kernel and the AVX2 one: its own where one
/// exists and measured faster (fp16 encode, decode and error-feedback step, bf16 encode,
/// sign encode, qsgd and ternary encode: 1.1 to 1.3 times AVX2's at 64 Ki and 1 Mi
/// elements, the magnitude filter), the AVX2 kernel everywhere else (fp16's
/// decode_add too: 9% faster with AVX2 at 1 Mi elements, while its plain decode is 8%
/// faster with AVX-512). Measured with
/// `cargo run --release --example backend_race` on a Zen 5 (docs/benchmarks-history.md,
/// 2026-11-24, commit a6cfab8): before this table the AVX-512 backend ran the portable kernels on the other
/// rows, 1.1 to 3.3 times slower than AVX2 (natural encode 3.3x, random-k decode_add
/// 2.4x, sign decode_add 2.3x, QSGD 1.4 to 2.0x). Two rows are portable code that pulp
/// compiles for either instruction set: the f32 and bf16 decodes, whose AVX2 builds
/// were up to 12% (f32) and 2 to 5% (bf16, at 1 Mi elements) faster, and the forward
/// DCT of `dct`, whose AVX2 build was 1.5 times as fast on 64 x 64 tiles at 64 Ki
/// elements (and level on one-row tiles); the inverse DCT's dense rows run the AVX2 build
/// too (level with the AVX-512 one, within 2 to 7%, on 1-D and 2-D tiles). The fused
/// reduction of many frames (`reduce x8` in that example, on a Zen 4/5 EPYC, commit 651ecff)
/// runs its AVX-512 builds: 1.5 times AVX2's for int8, 1.1 to 1.4 for bf16, 1.07 to 1.12
/// for fp16 (F16C), and level (within 3%) for f32 frames. fp8 and fp4 (portable code,
/// `cargo bench --bench codecs` at 1 Mi elements, 2026-11-26): the AVX-512 builds encode
/// fp8 1.8 times as fast as AVX2's and decode it 1.7 times, and encode fp4 1.8 times.
/// fp8's nearest encode of 8-bit codes with an f32 or E8M0 scale, and fp4's of E2M1
/// and E3M0 codes with any scale, have hand-written AVX2 kernels (32 elements a step,
/// packed by saturation; 1.45 to 1.7 times the portable AVX2 build on a 2-core Zen 3,
/// 2026-11-27, E3M0 2 to 3.3 times, 2026-11-28), and AVX-512 ones (2026-11-29, sixteen
/// lanes, 64 elements a step), which Intel's cores run (see the table) and AMD's do not
/// yet (unmeasured: they run the AVX2 kernels). The portable AVX-512 builds, 1.8 times the
/// portable AVX2 ones on the Zen 5, do not beat them on a 2-core Intel Xeon (2026-11-29,
/// `backend_race`, the rows rerouted for the run): the AVX2 kernels encode fp8 1.3 times
/// as fast at 64 Ki elements (level at 1 Mi) and fp4 2.5 to 3.3 times; AMD's cores not
/// measured.
/// fp8's decode of blocks of a multiple of 16 goes through half precision in registers
/// (2026-11-27, commit 842321e, a 2-core Intel Xeon, `backend_race` at 64 Ki
/// elements; AMD's cores not yet measured): AVX-512's E4M3 decode_add 1.15 to 1.25 times
/// AVX2's, its decode 1.12 to 1.16, E5M2's decode_add 1.04 to 1.13; E5M2's plain decode
/// runs the AVX2 build, 0 to 20% faster than AVX-512's in seven runs.
/// fp4's decode of blocks of 16 and 32 looks codes up in registers (one permute per 16
/// on AVX-512; 2026-11-27, a 2-core Intel Xeon, `backend_race` at 64 Ki elements):
/// AVX-512's was 2.3 times AVX2's for blocks of 32, 1.45 times for 16, when AVX2 took two
/// permutes and a blend per 8 codes. AVX2's now takes two byte lookups per 32 (every
/// 4-bit value is a bfloat16) and computes 16 E4M3 block scales at a time, 2.0 to 2.4
/// times as fast on a 2-core Zen 3 (2026-11-28); it has not been measured against
/// AVX-512's on an AVX-512 CPU since. Other block lengths and the residual mode (a nibble
/// per element) run the AVX2 build, 1.2 to 1.5 times as fast as AVX-512's.
/// PowerSGD (`examples/scaling`'s step, rank 2 on 4096 x 2304, one thread, 2026-11-26):
/// `M Q` runs the AVX2 build, 1.5 times as fast (its 16-lane sums are two registers there,
/// so twice as many independent chains of additions); the reconstruction of large
/// matrices streams with AVX-512's kernel (level with AVX2's); `M^T P` runs the backend's
/// own build (AVX-512's 10% faster). Lee's forward DCT (`dct`'s default encoder,
/// 2026-11-27, a 2-core Intel Xeon, `backend_race` at 1 Mi elements): 64 x 64 tiles run
/// the AVX2 build (8 to 11% faster in two runs of three; level in the third); smaller
/// tiles and one-row batches the AVX-512 build (1.7 times as fast on 32 x 32 tiles, 1.4
/// on 16 x 16, 1.3 to 1.4 on one-row tiles of 64). The factorised transform
/// (`transform=fast`) of one-row tiles of 16 and 32 runs the AVX2 build there (1.2 to 1.3
/// times as fast; the AVX-512 build wins at 8 and 64).
/// `codebook`'s encode runs the AVX2 build (2026-11-29, a 2-core Intel Xeon,
/// `backend_race`: 1.25 to 1.3 times AVX-512's at 64 Ki and 1 Mi elements, whose f64
/// bins take 512-bit conversions and packs; AMD's cores not measured).
/// Error feedback's input (`beta r + gamma g`, the step of every fixed-rate codec without
/// a fused one) runs the AVX2 build (2026-12-02, a 2-core Zen 5, `backend_race 65536`):
/// with AVX-512's, the steps of fp8 and fp4 in blocks of 10 ran 7%, natural's 5% and
/// bf16's 2% slower than on the AVX2 backend; with AVX2's they are level, and the codecs
/// whose encoders AVX-512 speeds up keep their lead (sign 1.33, ternary 1.12, fp4 1.09).
pub(crate) const fn x86_route_on(op: Op, kind: BackendKind, cpu: Cpu) -> X86 {
    match kind {
        // Every row has an AVX2 kernel.
        BackendKind::Avx2 => X86::Avx2,
        BackendKind::Avx512 => match op {
            // Intel's cores (a Xeon with AVX-512 FP16 and AMX, 2026-11-26), where a Zen 5
            // runs AVX-512's fp16 kernels 7 to 12% faster: the AVX2 build decodes fp16 8 to
            // 14% faster at 64 Ki elements and sums eight fp16 frames 11 to 14% faster
            // (level at 1 Mi). Its fp16 encode is level with AVX-512's on dense tensors
            // (within 5% either way), but top-k's encode, whose few kept values are a
            // short burst of 512-bit work among 256-bit and scalar code, is 4 to 9% faster
            // with it.
            Op::DecodeF16 | Op::ReduceF16 | Op::EncodeF16 if matches!(cpu, Cpu::Intel) => X86::Avx2,
            // int8's encode, fused error-feedback step and ring hop (a 2-core Intel Xeon,
            // 2026-11-29, `backend_race`): with nearest rounding AVX-512's encode 1.23 to
            // 1.40 times AVX2's at 64 Ki elements (blocks of 64, 256 and 4096) and 1.14 to
            // 1.26 at 1 Mi, its step 1.24 to 1.33 and 1.06 to 1.14, its hop 1.17 to 1.25
            // at 64 Ki and level at 1 Mi (a 4 Mi int8 ring of two ranks about 8% faster);
            // with stochastic rounding the encode 1.25 to 1.40 and the step 1.24 to 1.40.
            // For blocks of a multiple of 64 only (the kernels' step): `kernels::block_route`
            // sends the others to AVX2, 1.1 to 1.3 times faster at blocks of 32 and 40.
            // AMD's cores are not measured: their rows stay on AVX2 (the kernels are still
            // tested there).
            Op::EncodeInt8 | Op::FeedbackInt8 | Op::HopInt8 if matches!(cpu, Cpu::Intel) => {
                X86::Avx512
            }
            // `chunktopk`'s bound pass and candidate filter (a 2-core Intel Xeon,
            // 2026-11-29, chunks of 4096 at 1 Mi elements): the AVX-512 bound, by float
            // minima and maxima on two ports where the 512-bit integer ones take one, 660
            // against the AVX2 build's 800 ns a chunk; the compress filter with its keys
            // 430 against 660 ns (in L1). AMD's cores are not measured: their rows stay on
            // AVX2 (for `FilterKeys`, `FilterMagGe`'s kernel and the keys read again).
            Op::LaneBound | Op::FilterKeys if matches!(cpu, Cpu::Intel) => X86::Avx512,
            // fp8's and fp4's nearest encode (a 2-core Intel Xeon, 2026-11-29, 64 Ki
            // elements, one thread): the AVX-512 kernels
            // take eight blocks of a multiple of 16 at a time, 64 elements a step; fp8
            // with E8M0 scales 1.3 to 1.4 times AVX2's, with f32 scales 1.1 (the division
            // bounds both widths), at blocks of 48 2.5 times (AVX2 groups multiples of 32
            // only); MXFP4 1.3 to 1.4 times, blocks of 16 1.45, E3M0 1.6. AMD's cores are
            // not measured: their rows stay on AVX2.
            Op::EncodeFp8Nearest | Op::EncodeFp4Nearest if matches!(cpu, Cpu::Intel) => X86::Avx512,
            // Of these, sign's encode takes blocks of at least 128 only, sign-magnitude's
            // blocks of a multiple of 64, and the fp8 and fp4 decoders the blocks, scales
            // and modes they were measured faster on; the others go to AVX2
            // (`kernels::block_route`, `kernels::float_decode_takes_avx512`).
            Op::FeedbackF16
            | Op::EncodeF16
            | Op::DecodeF16
            | Op::EncodeBf16
            | Op::EncodeSign
            | Op::EncodeSignmag
            | Op::FilterMagGe
            | Op::ReduceF32
            | Op::ReduceF16
            | Op::ReduceBf16
            | Op::ReduceInt8
            | Op::EncodeFp8
            | Op::DecodeFp8
            | Op::EncodeFp4
            | Op::DecodeFp4
            | Op::StreamPqt => X86::Avx512,
            Op::AddF16
            | Op::EncodeInt8
            | Op::FeedbackInt8
            | Op::HopInt8
            | Op::HopF16
            | Op::DecodeSign
            | Op::DecodeSignmag
            | Op::EncodeNatural
            | Op::DecodeNatural
            | Op::LaneBound
            | Op::FilterKeys
            | Op::FilterDrawLt
            | Op::CountDrawLt
            | Op::DrawMasks
            | Op::CompressMasks
            | Op::DecodeF32
            | Op::DecodeBf16
            | Op::DctForward
            | Op::DctInverse
            | Op::DctLee64x64
            | Op::DctFastRows16Or32
            | Op::EncodeFp8Nearest
            | Op::EncodeFp4Nearest
            | Op::ThinMq
            | Op::EncodeCodebook
            | Op::FeedbackForm => X86::Avx2,
        },
        BackendKind::Scalar | BackendKind::Neon => X86::None,
    }
}

/// The x86 vendor whose measurements a routing-table row follows where the two differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Cpu {
    /// AMD (and any vendor other than Intel): the table measured on Zen 4 and Zen 5.
    Amd,
    /// Intel.
    Intel,
}

impl Cpu {
    /// This machine's vendor, read once from CPUID leaf 0.
    pub(crate) fn this() -> Cpu {
        static CPU: OnceLock<Cpu> = OnceLock::new();
        *CPU.get_or_init(|| {
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            {
                // SAFETY: CPUID exists on every x86-64 processor; leaf 0 gives the vendor
                // string in EBX, EDX, ECX. (The intrinsic is safe on newer compilers than
                // the crate's minimum, hence the allowance.)
                #[allow(unused_unsafe)]
                let id = unsafe { core::arch::x86_64::__cpuid(0) };
                // "GenuineIntel".
                if (id.ebx, id.edx, id.ecx) == (0x756e_6547, 0x4965_6e69, 0x6c65_746e) {
                    return Cpu::Intel;
                }
            }
            Cpu::Amd
        })
    }
}

/// [`x86_route_on`] for this machine's vendor.
#[inline]
pub(crate) fn x86_route(op: Op, kind: BackendKind) -> X86 {
    x86_route_on(op, kind, Cpu::this())
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
fn has_avx2() -> bool {
    pulp::x86::V3::try_new().is_some() && std::arch::is_x86_feature_detected!("f16c")
}

/// AVX-512 is only ever detected together with everything AVX2 needs, so the
/// AVX-512 backend may run the AVX2 kernels ([`x86_route`]).
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn has_avx512() -> bool {
    has_avx2() && pulp::x86::V4::try_new().is_some()
}

impl Backend {
    /// The scalar backend (always available).
    pub const fn scalar() -> Backend {
        Backend {
            kind: BackendKind::Scalar,
        }
    }

    /// The backend of `kind` without the CPU check: for the dispatch table's entries,
    /// which run only on a CPU whose backend of that kind exists.
    ///
    /// # Safety
    /// The CPU must support `kind`'s instruction set (as [`Backend::of`] checks).
    pub(crate) const unsafe fn assume(kind: BackendKind) -> Backend {
        Backend { kind }
    }

    /// The AVX2 backend, if this CPU has AVX2, FMA and F16C.
    pub fn avx2() -> Option<Backend> {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if has_avx2() {
            return Some(Backend {
                kind: BackendKind::Avx2,
            });
        }
        None
    }

    /// The AVX-512 backend, if this CPU has AVX-512 F/BW/CD/DQ/VL and F16C.
    pub fn avx512() -> Option<Backend> {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if has_avx512() {
            return Some(Backend {
                kind: BackendKind::Avx512,
            });
        }
        None
    }

    /// The NEON backend, if this is an aarch64 CPU with Advanced SIMD.
    pub fn neon() -> Option<Backend> {
        #[cfg(all(target_arch = "aarch64", not(miri)))]
        if pulp::aarch64::Neon::try_new().is_some() {
            return Some(Backend {
                kind: BackendKind::Neon,
            });
        }
        None
    }

    /// The backend of `kind`, if this CPU supports it.
    pub fn of(kind: BackendKind) -> Option<Backend> {
        match kind {
            BackendKind::Scalar => Some(Backend::scalar()),
            BackendKind::Avx2 => Backend::avx2(),
            BackendKind::Avx512 => Backend::avx512(),
            BackendKind::Neon => Backend::neon(),
        }
    }

    /// The backend named `name` (`scalar`, `avx2`, `avx512`, `neon`): `Ok(None)` if the
    /// CPU lacks it, an error if the name is unknown.
    pub fn by_name(name: &str) -> Result<Option<Backend>> {
        let kind = BackendKind::ALL
            .into_iter()
            .find(|k| k.name() == name.trim())
            .ok_or_else(|| Error::Backend {
                name: name.to_string(),
                reason: "unknown backend; accepted: scalar, avx2, avx512, neon".into(),
            })?;
        Ok(Backend::of(kind))
    }

    /// Every backend this CPU supports, scalar first.
    pub fn available() -> Vec<Backend> {
        BackendKind::ALL
            .into_iter()
            .filter_map(Backend::of)
            .collect()
    }

    /// The best backend this CPU supports (always scalar under Miri).
    pub fn best() -> Backend {
        Backend::available()
            .into_iter()
            .max_by_key(|b| b.kind)
            .unwrap_or(Backend::scalar())
    }

    /// The instruction set.
    pub fn kind(self) -> BackendKind {
        self.kind
    }

    /// The name (`scalar`, `avx2`, ...).
    pub fn name(self) -> &'static str {
        self.kind.name()
    }

    /// The backend kernels use on this thread now: the one forced by [`Backend::run`],
    /// else the process default ([`Backend::default_backend`]).
    pub fn current() -> Backend {
        FORCED
            .with(Cell::get)
            .unwrap_or_else(Backend::default_backend)
    }

    /// The process default: `GRADPACK_BACKEND` if set (and supported), else [`Backend::best`].
    /// Chosen on first use and kept. An unknown or unsupported name falls back to the best
    /// backend with one line on stderr; [`Backend::from_env`] reports it as an error.
    pub fn default_backend() -> Backend {
        *DEFAULT.get_or_init(|| match Backend::from_env() {
            Ok(Some(b)) => b,
            Ok(None) => Backend::best(),
            Err(e) => {
                eprintln!("gradpack: {e}; using {}", Backend::best());
                Backend::best()
            }
        })
    }

    /// The backend `GRADPACK_BACKEND` names: `Ok(None)` when it is unset, an error when it
    /// names an unknown backend or one this CPU lacks.
    pub fn from_env() -> Result<Option<Backend>> {
        match std::env::var("GRADPACK_BACKEND") {
            Err(_) => Ok(None),
            Ok(name) => match Backend::by_name(&name)? {
                Some(b) => Ok(Some(b)),
                None => Err(Error::Backend {
                    name,
                    reason: "GRADPACK_BACKEND names a backend this CPU does not support".into(),
                }),
            },
        }
    }

    /// Run `f` with this backend forced on the current thread (restored afterwards, also
    /// on panic). Kernels called from other threads are not affected.
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<Backend>);
        impl Drop for Restore {
            fn drop(&mut self) {
                FORCED.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(FORCED.with(|c| c.replace(Some(self))));
        f()
    }
}

static DEFAULT: OnceLock<Backend> = OnceLock::new();

thread_local! {
    static FORCED: Cell<Option<Backend>> = const { Cell::new(None) };
}

/// The pulp dispatcher for instruction set `kind` (the baseline one where this CPU
/// lacks it).
#[inline]
pub(crate) fn pulp_arch_of(kind: BackendKind) -> pulp::Arch {
    match kind {
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx512 => pulp::x86::V4::try_new().map_or(pulp::Arch::Scalar, pulp::Arch::V4),
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx2 => pulp::x86::V3::try_new().map_or(pulp::Arch::Scalar, pulp::Arch::V3),
        #[cfg(target_arch = "aarch64")]
        BackendKind::Neon => {
            pulp::aarch64::Neon::try_new().map_or(pulp::Arch::Scalar, pulp::Arch::Neon)
        }
        _ => pulp::Arch::Scalar,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avx512_never_takes_a_path_avx2_beats() {
        for op in Op::ALL {
            // Every row has an AVX2 kernel, so AVX2 always runs it ...
            assert_eq!(x86_route(op, BackendKind::Avx2), X86::Avx2, "{op:?}");
            // ... and so does the AVX-512 backend unless its own kernel is faster: it
            // never falls back to the portable path of a row.
            assert_ne!(x86_route(op, BackendKind::Avx512), X86::None, "{op:?}");
            assert_eq!(x86_route(op, BackendKind::Scalar), X86::None);
            assert_eq!(x86_route(op, BackendKind::Neon), X86::None);
        }
        // The rows where the AVX-512 kernel won the measurement (see x86_route_on), on
        // AMD's cores and on Intel's.
        let own = |cpu| -> Vec<Op> {
            Op::ALL
                .into_iter()
                .filter(|&op| x86_route_on(op, BackendKind::Avx512, cpu) == X86::Avx512)
                .collect()
        };
        let amd = [
            Op::FeedbackF16,
            Op::EncodeF16,
            Op::DecodeF16,
            Op::EncodeBf16,
            Op::EncodeSign,
            Op::EncodeSignmag,
            Op::FilterMagGe,
            Op::ReduceF32,
            Op::ReduceF16,
            Op::ReduceBf16,
            Op::ReduceInt8,
            Op::EncodeFp8,
            Op::DecodeFp8,
            Op::EncodeFp4,
            Op::DecodeFp4,
            Op::StreamPqt,
        ];
        assert_eq!(own(Cpu::Amd), amd);
        let mut intel: Vec<Op> = amd
            .into_iter()
            .filter(|op| !matches!(op, Op::DecodeF16 | Op::ReduceF16 | Op::EncodeF16))
            .collect();
        intel.extend([
            Op::FeedbackInt8,
            Op::HopInt8,
            Op::EncodeInt8,
            Op::LaneBound,
            Op::FilterKeys,
            Op::EncodeFp8Nearest,
            Op::EncodeFp4Nearest,
        ]);
        let mut own_intel = own(Cpu::Intel);
        own_intel.sort_by_key(|op| format!("{op:?}"));
        intel.sort_by_key(|op| format!("{op:?}"));
        assert_eq!(own_intel, intel);
        // Only the AVX-512 backend's rows depend on the vendor.
        for op in Op::ALL {
            for kind in BackendKind::ALL {
                if kind != BackendKind::Avx512 {
                    assert_eq!(
                        x86_route_on(op, kind, Cpu::Intel),
                        x86_route_on(op, kind, Cpu::Amd)
                    );
                }
            }
        }
    }

    #[test]
    fn the_route_follows_this_machines_vendor() {
        let cpu = Cpu::this();
        for op in Op::ALL {
            for kind in BackendKind::ALL {
                assert_eq!(x86_route(op, kind), x86_route_on(op, kind, cpu), "{op:?}");
            }
        }
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            let intel = std::fs::read_to_string("/proc/cpuinfo")
                .ok()
                .map(|t| t.contains("GenuineIntel"));
            if let Some(intel) = intel {
                assert_eq!(cpu == Cpu::Intel, intel);
            }
        }
    }

    /// The AVX-512 int8 kernels (encode, the fused error-feedback step and the ring hop),
    /// which AMD's table does not route to, are still checked on AMD's
    /// machines: against the AVX2 kernels (tested against the definition through the
    /// public path), bit for bit, over blocks of 16-lane, 64-element and odd lengths with
    /// zero, tiny (below 2^-100) and non-finite blocks, in both roundings, with draws from
    /// index 0 (steps on aligned groups of 64), 5 and where blocks cross a 2^32 window.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    #[test]
    fn unrouted_avx512_int8_kernels_match_the_avx2_ones() {
        use super::super::{scalar::Round, x86_64};
        use crate::rng::Draws;
        /// One backend's int8 encode, fused error-feedback step and ring hop.
        type Int8Kernels = (
            unsafe fn(&[f32], usize, Round, &Draws, u64, &mut [u8], &mut [u8]) -> bool,
            unsafe fn(
                &mut [f32],
                &[f32],
                (f32, f32),
                usize,
                (Round, &Draws, u64),
                &mut [u8],
                &mut [u8],
            ) -> bool,
            unsafe fn(
                &[f32],
                &[u8],
                &[u8],
                usize,
                Round,
                &Draws,
                u64,
                &mut [f32],
                &mut [u8],
                &mut [u8],
            ) -> bool,
        );
        if Backend::avx512().is_none() {
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let input = |n: usize, salt: u32| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let h = (i as u32 ^ salt).wrapping_mul(2_654_435_761);
                    let v = (h >> 8) as f32 / 8_388_608.0 - 1.0;
                    match ((i / 64) % 7, h % 229) {
                        (2, _) => 0.0,
                        (4, _) => v * 1.0e-33,
                        (_, 0) => f32::NAN,
                        (_, 1) => f32::NEG_INFINITY,
                        (_, 2) => f32::MAX,
                        _ => v,
                    }
                })
                .collect()
        };
        let draws = Draws::new(3, 0, 0);
        for block in [1usize, 15, 16, 40, 64, 100, 256] {
            for n in [0usize, 1, 17, 63, 64, 65, 1000, 4099] {
                let nb = n.div_ceil(block);
                let (g, other) = (input(n, 5), input(n, 6));
                let (mut is, mut ic) = (vec![0u8; 4 * nb], vec![0u8; n]);
                // SAFETY: the AVX-512 backend exists, so AVX-512 F/BW and AVX2 were detected.
                unsafe {
                    x86_64::blocks::encode_int8_avx2(
                        &other,
                        block,
                        Round::Nearest,
                        &draws,
                        0,
                        &mut is,
                        &mut ic,
                    )
                };
                for (round, first) in [Round::Nearest, Round::Stochastic]
                    .into_iter()
                    .flat_map(|r| [(r, 0), (r, 5), (r, (1u64 << 32) - 100)])
                {
                    let what = format!("block {block}, n {n}, {round:?}, from {first}");
                    let run = |(encode, feedback, hop): Int8Kernels| {
                        let (mut es, mut ec) = (vec![0u8; 4 * nb], vec![0u8; n]);
                        let mut r = input(n, 7);
                        let (mut s, mut c) = (vec![0u8; 4 * nb], vec![0u8; n]);
                        let mut sum = vec![0f32; n];
                        let (mut hs, mut hc) = (vec![0u8; 4 * nb], vec![0u8; n]);
                        let (w, d) = ((0.9, 1.0), (round, &draws, first));
                        // SAFETY: as above.
                        let flags = unsafe {
                            (
                                feedback(&mut r, &g, w, block, d, &mut s, &mut c),
                                hop(
                                    &g, &is, &ic, block, round, &draws, first, &mut sum, &mut hs,
                                    &mut hc,
                                ),
                            )
                        };
                        // SAFETY: as above.
                        let encoded =
                            unsafe { encode(&g, block, round, &draws, first, &mut es, &mut ec) };
                        ((encoded, es, ec), flags, bits(&r), s, c, bits(&sum), hs, hc)
                    };
                    let avx2: Int8Kernels = (
                        x86_64::blocks::encode_int8_avx2,
                        x86_64::blocks::feedback_int8_avx2,
                        x86_64::blocks::hop_int8_avx2,
                    );
                    let avx512: Int8Kernels = (
                        x86_64::blocks512::encode_int8_avx512,
                        x86_64::blocks512::feedback_int8_avx512,
                        x86_64::blocks512::hop_int8_avx512,
                    );
                    let (want, got) = (run(avx2), run(avx512));
                    assert!(got.0 == want.0, "{what}: encode");
                    assert_eq!(got.1, want.1, "{what}: non-finite flags");
                    assert!(got.2 == want.2, "{what}: residuals differ");
                    assert!(got.3 == want.3 && got.4 == want.4, "{what}: feedback frame");
                    assert!(got.5 == want.5, "{what}: hop sums differ");
                    assert!(got.6 == want.6 && got.7 == want.7, "{what}: hop frame");
                }
            }
        }
    }

    /// The AVX-512 fp16 kernels that one vendor's table does not route to are still
    /// checked on that vendor's machines: against the AVX2 kernels and the scalar
    /// definition, bit for bit; the decodes on every 16-bit pattern (NaN payloads,
    /// infinities, subnormals), at lengths around the 16-lane and 8-lane steps.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    #[test]
    fn unrouted_avx512_fp16_kernels_match_the_scalar_definition() {
        use super::super::{mode, portable, scalar, x86_64};
        if Backend::avx512().is_none() {
            return;
        }
        let codes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let base: Vec<f32> = (0..65536).map(|i| (i as f32 - 3000.5) * 0.25).collect();
        for n in [0, 1, 7, 15, 16, 17, 31, 33, 1000, 65536] {
            let p = &codes[2 * (65536 - n)..];
            let mut want = base[..n].to_vec();
            scalar::decode_u16::<{ mode::WRITE }>(p, &mut want, scalar::f16_to_f32);
            let mut got = base[..n].to_vec();
            // SAFETY: the AVX-512 backend exists, so AVX-512F, AVX2 and F16C were detected.
            unsafe { x86_64::decode_f16_avx512::<{ mode::WRITE }>(p, &mut got) };
            assert_eq!(bits(&got), bits(&want), "decode, {n} elements");
            let mut want = base[..n].to_vec();
            scalar::decode_u16::<{ mode::ADD }>(p, &mut want, scalar::f16_to_f32);
            let mut got = base[..n].to_vec();
            // SAFETY: as above.
            unsafe { x86_64::decode_f16_avx512::<{ mode::ADD }>(p, &mut got) };
            assert_eq!(bits(&got), bits(&want), "decode_add, {n} elements");
        }
        // Encode: f32 patterns from a xorshift sequence (every exponent, NaN payloads,
        // infinities, subnormals, rounding ties by chance) and the exact ties and limits.
        let mut z = 0x9e37_79b9_u32;
        let mut xs: Vec<f32> = (0..20000)
            .map(|_| {
                z ^= z << 13;
                z ^= z >> 17;
                z ^= z << 5;
                f32::from_bits(z)
            })
            .collect();
        xs.extend([
            65504.0,
            65520.0,
            65519.99,
            -0.0,
            5.96e-8,
            2.98e-8,
            1.0 + 1.0 / 2048.0,
        ]);
        for n in [0, 1, 15, 16, 17, 33, 1000, xs.len()] {
            for finite in [false, true] {
                let x: Vec<f32> = xs[xs.len() - n..]
                    .iter()
                    .map(|&v| if finite && !v.is_finite() { 1.5 } else { v })
                    .collect();
                let mut want = vec![0u8; 2 * n];
                let want_flag = scalar::encode_u16(&x, &mut want, scalar::f32_to_f16);
                let mut got = vec![0u8; 2 * n];
                // SAFETY: as above.
                let got_flag = unsafe { x86_64::encode_f16_avx512(&x, &mut got) };
                assert_eq!(got, want, "encode, {n} elements");
                assert_eq!(
                    got_flag, want_flag,
                    "encode's non-finite flag, {n} elements"
                );
            }
        }
        // Three frames of 4096 elements, summed from element 0 and from 1024: the
        // definition (the portable kernel outside any SIMD build), AVX2 and AVX-512.
        fn reduce_three<const M: u8>(frames: &[&[u8]], start: usize, outs: &mut [Vec<f32>; 3]) {
            let [want, avx2, got] = outs;
            portable::reduce_u16::<M>(frames, start, want, scalar::f16_to_f32);
            // SAFETY: called only where the AVX-512 backend exists, so AVX-512F, AVX2 and
            // F16C were detected.
            unsafe {
                x86_64::reduce_f16_avx2::<M>(frames, start, avx2);
                x86_64::reduce_f16_avx512::<M>(frames, start, got);
            }
        }
        let frames: Vec<&[u8]> = (0..3).map(|q| &codes[8192 * (q * 5)..][..8192]).collect();
        for start in [0, 1024] {
            for write in [true, false] {
                let mut outs: [Vec<f32>; 3] =
                    core::array::from_fn(|_| base[..4096 - start].to_vec());
                if write {
                    reduce_three::<{ mode::WRITE }>(&frames, start, &mut outs);
                } else {
                    reduce_three::<{ mode::ADD }>(&frames, start, &mut outs);
                }
                let [want, avx2, got] = &outs;
                assert_eq!(bits(avx2), bits(want), "reduce avx2, from {start}");
                assert_eq!(bits(got), bits(want), "reduce avx512, from {start}");
            }
        }
    }

    #[test]
    fn run_forces_and_restores() {
        let before = Backend::current();
        let inside = Backend::scalar().run(Backend::current);
        assert_eq!(inside, Backend::scalar());
        assert_eq!(Backend::current(), before);
        let r = std::panic::catch_unwind(|| Backend::scalar().run(|| panic!("x")));
        assert!(r.is_err());
        assert_eq!(Backend::current(), before);
    }

    #[test]
    fn names_round_trip() {
        for b in Backend::available() {
            assert_eq!(Backend::by_name(b.name()).unwrap(), Some(b));
        }
        let e = Backend::by_name("sse9").unwrap_err();
        assert!(
            matches!(&e, Error::Backend { name, .. } if name == "sse9"),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .starts_with("backend \"sse9\": unknown backend"),
            "{e}"
        );
        assert_eq!(Backend::available()[0], Backend::scalar());
    }
}
