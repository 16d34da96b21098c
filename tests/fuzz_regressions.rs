//! Replays, under plain `cargo test`, every input that ever made a fuzz target fail
//! (`tests/fuzz_regressions/TARGET/`, each named after what it found; docs/robustness.md
//! lists them) and the seed corpora built from the golden vectors, through the same
//! property functions the fuzz targets run (`tests/fuzz_checks/mod.rs`).

mod common;
mod fuzz_checks;

use std::path::Path;

type Check = fn(&[u8]);

const TARGETS: [(&str, Check); 4] = [
    ("decode_any", fuzz_checks::decode_any),
    ("header", fuzz_checks::header),
    ("output_independence", fuzz_checks::output_independence),
    ("roundtrip", fuzz_checks::roundtrip),
];

#[test]
fn every_recorded_fuzz_failure_now_passes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_regressions");
    let mut replayed = 0;
    for (target, check) in TARGETS {
        let Ok(dir) = std::fs::read_dir(root.join(target)) else {
            continue;
        };
        for entry in dir {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            eprintln!("replaying {target} {}", path.display());
            check(&data);
            replayed += 1;
        }
    }
    assert!(
        replayed > 0,
        "no regression inputs found under {}",
        root.display()
    );
}

#[test]
fn golden_vectors_pass_every_frame_check() {
    let dir = common::vectors_dir();
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let ext = path.extension().and_then(|e| e.to_str());
        if !matches!(ext, Some("gpk" | "sealed")) {
            continue;
        }
        let frame = std::fs::read(&path).unwrap();
        fuzz_checks::header(&frame);
        fuzz_checks::output_independence(&frame);
        for mode in [0u8, 3] {
            let mut d = vec![mode];
            d.extend_from_slice(&frame);
            fuzz_checks::decode_any(&d);
        }
        n += 1;
    }
    assert!(n >= 36, "found {n} golden frames in {}", dir.display());
}

#[test]
fn golden_inputs_round_trip_through_every_codec() {
    let dir = common::vectors_dir();
    for input in ["input.f32", "input-nonfinite.f32"] {
        let values = std::fs::read(dir.join(input)).unwrap();
        for codec in 0u8..10 {
            for variant in [0x00u8, 0x11, 0x1a, 0x2c, 0x48, 0x88, 0xa8] {
                // The control bytes documented in tests/fuzz_checks/mod.rs (roundtrip).
                let mut d = vec![codec, 64, 0, variant, 25, 0, 0, 0, 42, 0, 0, 0];
                d.extend_from_slice(&values);
                fuzz_checks::roundtrip(&d);
            }
        }
    }
}
