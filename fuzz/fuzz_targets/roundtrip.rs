//! Round trip of every codec on arbitrary f32 values (all bit patterns) and parameters:
//! encode gives byte-identical frames on every backend; the frame decodes on every
//! backend to the same bits, within the codec's documented error bound
//! (`CodecSpec::error_bound`) when the input is finite, and with NaN or Inf still visible
//! when it is not; re-encoding from nothing but the frame's header reproduces it byte for
//! byte; a sealed frame carries the same payload and decodes the same.
//!
//! Input: 12 control bytes, then the values (little-endian f32, any bit patterns).
//! - byte 0: codec (`% 16`, in wire-format id order);
//! - bytes 1..3: block size (`u16 % 4096 + 1`); bit 7 of byte 2 also the entropy stage
//!   (`entropy=on`, for the codecs that take it);
//! - byte 3: bit 0 stochastic rounding (int8), bits 1..3 QSGD bits (2, 4, 8), bit 3 fp16
//!   values (top-k, random-k), bit 4 unbiased scale (random-k), bit 5 an explicit `k`
//!   (top-k) or strata selection (random-k); for fp8: bit 0 stochastic, bit 1 E5M2,
//!   bits 2..4 the scale (f32, E8M0, none, f32); for fp4: bit 0 stochastic, bit 1 E3M0,
//!   bit 2 an f32 scale;
//! - byte 4: ratio `(b + 1) / 256` (top-k, random-k), or `k = b` (top-k with bit 5);
//! - bytes 5..8: offset (u24); bytes 8..12: seed (u32).
//!
//! The property lives in `tests/fuzz_checks/mod.rs`, shared with the regression tests.

#![no_main]

#[path = "../../tests/fuzz_checks/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::roundtrip(data));
