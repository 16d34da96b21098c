//! Output independence: decoding into outputs pre-filled with two different sentinels
//! gives the same result, and on `Ok` the same bits, on every backend this CPU has (the
//! decoders never read the output and every backend writes the scalar oracle's bits).
//!
//! Input: the frame.
//!
//! The property lives in `tests/fuzz_checks/mod.rs`, shared with the regression tests.

#![no_main]

#[path = "../../tests/fuzz_checks/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::output_independence(data));
