//! The `collective_recv` property of `tests/fuzz_checks/mod.rs` (see its docs there), shared with
//! the regression tests.

#![no_main]

#[path = "../../tests/fuzz_checks/mod.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::collective_recv(data));
