//! Replays, under plain `cargo test`, every input that ever made a fuzz target fail
//! (`tests/fuzz_regressions/TARGET/`, each named after what it found; docs/robustness.md
//! lists them) and the seed corpora built from the golden vectors, through the same
//! property functions the fuzz targets run (`tests/fuzz_checks/mod.rs`).

mod common;
mod fuzz_checks;

use std::path::Path;

type Check = fn(&[u8]);

const TARGETS: [(&str, Check); 6] = [
    ("collective_recv", fuzz_checks::collective_recv),
    ("npy", fuzz_checks::npy),
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

#[test]
fn collective_seeds_run_clean_and_survive_damage() {
    // The seeds are real message streams: replayed to rank 0 they give the fault-free
    // sums (checked by running the property, which must not panic), and every byte
    // flip and cut of them is survived.
    let seeds = fuzz_checks::collective_seeds();
    assert_eq!(seeds.len(), 3 * fuzz_checks::CASES);
    for (name, data) in &seeds {
        assert_eq!(
            fuzz_checks::collective_run(data),
            3,
            "{name}: a clean stream fails"
        );
        for i in (4..data.len()).step_by(97) {
            let mut d = data.clone();
            d[i] ^= 0x41;
            fuzz_checks::collective_recv(&d);
            fuzz_checks::collective_recv(&data[..i]);
        }
        write_seed("collective_recv", name, data);
    }
}

#[test]
fn npy_reader_survives_damage() {
    let x: Vec<f32> = (0..50).map(|i| i as f32 * 0.25 - 3.0).collect();
    let file = fuzz_checks::npy_write_for_tests(&x);
    fuzz_checks::npy(&file);
    write_seed("npy", "f32-50", &file);
    write_seed("npy", "f32-0", &fuzz_checks::npy_write_for_tests(&[]));
    for i in 0..file.len() {
        for bit in [0x01u8, 0x10, 0x80] {
            let mut d = file.clone();
            d[i] ^= bit;
            fuzz_checks::npy(&d);
        }
        fuzz_checks::npy(&file[..i]);
    }
}

/// With `GRADPACK_FUZZ_SEEDS=DIR` (what `fuzz/seed.sh` sets), write a seed input for a
/// fuzz target to `DIR/TARGET/NAME`.
fn write_seed(target: &str, name: &str, data: &[u8]) {
    if let Some(root) = std::env::var_os("GRADPACK_FUZZ_SEEDS") {
        let dir = Path::new(&root).join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), data).unwrap();
    }
}
