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
    /// Whether the AVX-512 backend follows the routing table (`false`: its own code
    /// everywhere, for measuring the table; see `routing::unrouted`).
    routed: bool,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.name())?;
        if !self.routed {
            f.write_str(" (unrouted)")?;
        }
        Ok(())
    }
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
fn has_avx2() -> bool {
    pulp::x86::V3::try_new().is_some() && std::arch::is_x86_feature_detected!("f16c")
}

/// AVX-512 is only ever detected together with everything AVX2 needs, so the
/// AVX-512 backend may run the AVX2 kernels (`routing`).
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn has_avx512() -> bool {
    has_avx2() && pulp::x86::V4::try_new().is_some()
}

impl Backend {
    /// The scalar backend (always available).
    pub const fn scalar() -> Backend {
        Backend {
            kind: BackendKind::Scalar,
            routed: true,
        }
    }

    /// The backend of `kind` without the CPU check: for the dispatch table's entries,
    /// which run only on a CPU whose backend of that kind exists.
    ///
    /// # Safety
    /// The CPU must support `kind`'s instruction set (as [`Backend::of`] checks).
    pub(crate) const unsafe fn assume(kind: BackendKind) -> Backend {
        Backend { kind, routed: true }
    }

    /// The AVX2 backend, if this CPU has AVX2, FMA and F16C.
    pub fn avx2() -> Option<Backend> {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if has_avx2() {
            return Some(Backend {
                kind: BackendKind::Avx2,
                routed: true,
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
                routed: true,
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
                routed: true,
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

    /// This backend with the routing table followed (`true`, as every constructor
    /// gives it) or not (`false`: the AVX-512 backend then runs its own code everywhere;
    /// other backends have no routing and are unchanged).
    pub(crate) fn with_routing(self, routed: bool) -> Backend {
        Backend {
            routed: routed || self.kind != BackendKind::Avx512,
            ..self
        }
    }

    /// Whether this backend follows the routing table (see [`Backend::with_routing`]).
    pub(crate) fn routed(self) -> bool {
        self.routed
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
        let current = Backend::current;
        let before = current();
        let inside = Backend::scalar().run(current);
        assert_eq!(inside, Backend::scalar());
        assert_eq!(current(), before);
        let r = std::panic::catch_unwind(|| Backend::scalar().run(|| panic!("x")));
        assert!(r.is_err());
        assert_eq!(current(), before);
        // An unrouted backend is forced and restored the same way.
        for b in Backend::available() {
            let off = b.with_routing(false);
            assert_eq!(off.run(current), off);
            assert_eq!(current(), before);
        }
    }

    /// Only the AVX-512 backend has routing to turn off; the unrouted one is another
    /// backend of the same kind, named as such.
    #[test]
    fn only_the_avx512_backend_can_run_unrouted() {
        for b in Backend::available() {
            let off = b.with_routing(false);
            assert_eq!(off.kind(), b.kind());
            assert!(b.routed());
            assert_eq!(off.with_routing(true), b);
            if b.kind() == BackendKind::Avx512 {
                assert_ne!(off, b);
                assert!(!off.routed());
                assert_eq!(off.to_string(), "avx512 (unrouted)");
            } else {
                assert_eq!(off, b);
                assert_eq!(off.to_string(), b.name());
            }
        }
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
