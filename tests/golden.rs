//! Golden vectors: one frame per codec and parameter choice, made from a fixed input,
//! pin the wire format. `GRADPACK_BLESS=1 cargo test --test golden` regenerates them
//! (only do that for a deliberate, versioned format change; see tests/vectors/README.md).

mod common;

use common::*;
use gradpack::{Codec, CodecSpec, EncodeCtx};

fn bless() -> bool {
    std::env::var_os("GRADPACK_BLESS").is_some_and(|v| v == "1")
}

fn check_or_write(name: &str, bytes: &[u8]) {
    let path = vectors_dir().join(name);
    if bless() {
        std::fs::write(&path, bytes).unwrap();
        return;
    }
    let stored = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run GRADPACK_BLESS=1 cargo test --test golden",
            path.display()
        )
    });
    assert!(
        stored == bytes,
        "{name} differs from what this build produces"
    );
}

#[test]
fn inputs_match_their_documented_generator() {
    check_or_write("input.f32", &f32_bytes(&golden_input()));
    check_or_write("input-nonfinite.f32", &f32_bytes(&golden_input_nonfinite()));
}

#[test]
fn every_vector_encodes_decodes_and_reencodes_identically() {
    for (stem, spec, seed, offset) in GOLDEN {
        let spec: CodecSpec = spec.parse().unwrap();
        for (suffix, x) in [
            ("", golden_input()),
            (".nonfinite", golden_input_nonfinite()),
        ] {
            let ctx = EncodeCtx::new(*seed).with_offset(*offset);
            let frame = spec.encode(&x, &ctx).unwrap();
            check_or_write(&format!("{stem}{suffix}.gpk"), &frame);
            let decoded = decode(&frame, x.len());
            check_or_write(&format!("{stem}{suffix}.out.f32"), &f32_bytes(&decoded));
            if suffix.is_empty() {
                // The same frame sealed with a payload checksum (wire format 1.3).
                let sealed = gradpack::Checksummed(spec).encode(&x, &ctx).unwrap();
                check_or_write(&format!("{stem}.sealed"), &sealed);
            }
            if bless() {
                continue;
            }
            // Decode the stored frame (not ours): it gives the stored output...
            let stored = std::fs::read(vectors_dir().join(format!("{stem}{suffix}.gpk"))).unwrap();
            assert_eq!(
                f32_bytes(&decode(&stored, x.len())),
                f32_bytes(&decoded),
                "{stem}{suffix}"
            );
            // ... and re-encoding the input with only what the frame's header says
            // (codec, parameters, seed, offset) reproduces it byte for byte.
            let (h, from_header) = gradpack::inspect(&stored).unwrap();
            let again = from_header
                .encode(&x, &EncodeCtx::new(*seed).with_offset(h.offset))
                .unwrap();
            assert_eq!(again, stored, "{stem}{suffix}: re-encode from header");
            if h.seed != 0 {
                assert_eq!(h.seed, *seed);
            }
            check_bound(&spec, &x, &decoded, &ctx).unwrap_or_else(|e| {
                assert!(suffix == ".nonfinite", "{e}");
            });
        }
    }
}
