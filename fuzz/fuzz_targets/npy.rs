//! Any bytes into the CLI's `.npy` reader (the `npy` property of `tests/fuzz_checks/mod.rs`),
//! shared with the regression tests.

#![no_main]

#[path = "../../tests/fuzz_checks/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::npy(data));
