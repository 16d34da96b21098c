//! `Header::parse` and `inspect` on arbitrary bytes: a parsed header writes back to the
//! same 56 bytes; `inspect` agrees with `parse` and gives a spec whose canonical string
//! parses back to it; sealing a valid frame keeps it valid and decoding to the same bits.
//!
//! Input: the frame.
//!
//! The property lives in `tests/fuzz_checks/mod.rs`, shared with the regression tests.

#![no_main]

#[path = "../../tests/fuzz_checks/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::header(data));
