//! Arbitrary bytes into every decoder with an arbitrary output length: `Ok` or `Err`,
//! never a panic, an abort or an allocation beyond the documented bound.
//!
//! Input: byte 0 chooses the output length (even: the header's element count, odd: the
//! byte times 7, usually wrong), the rest is the frame.
//!
//! The property lives in `tests/fuzz_checks/mod.rs`, shared with the regression tests.

#![no_main]

#[path = "../../tests/fuzz_checks/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::decode_any(data));
