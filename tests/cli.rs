//! The `gradpack` command-line tool, run as a user runs it: round trips through raw and
//! `.npy` files, inspect, the model, the report's JSON and plot, and one clear error with
//! exit status 2 for every kind of bad input.

#![cfg(feature = "cli")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gradpack::{Codec, CodecSpec, EncodeCtx};

fn gradpack(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gradpack"))
        .args(args)
        .output()
        .expect("run gradpack")
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gradpack-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A failed run: status 2, exactly one line on stderr, no panic.
fn assert_clean_error(o: &Output, needle: &str) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(2), "status; stderr: {e}");
    assert!(!e.contains("panicked"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "one line: {e:?}");
    assert!(e.contains(needle), "{e:?} lacks {needle:?}");
}

fn npy_f32(x: &[f32]) -> Vec<u8> {
    // Written independently of the tool: a version 1.0 header padded to 64 bytes.
    let data: Vec<u8> = x.iter().flat_map(|f| f.to_le_bytes()).collect();
    npy_with_shape(&format!("{},", x.len()), &data)
}

#[test]
fn encode_decode_round_trip_through_raw_and_npy_files() {
    let d = dir("roundtrip");
    let x = gradpack::synthetic::gradient(5000, 11);
    let raw = d.join("g.f32");
    let npy = d.join("g.npy");
    std::fs::write(&raw, bytemuck::cast_slice::<f32, u8>(&x)).unwrap();
    std::fs::write(&npy, npy_f32(&x)).unwrap();
    // A .npy under another name is still read as one (by its magic).
    let renamed = d.join("g.bin");
    std::fs::write(&renamed, npy_f32(&x)).unwrap();
    let spec: CodecSpec = "int8:rounding=stochastic".parse().unwrap();
    let want_frame = spec
        .encode(&x, &EncodeCtx::new(9).with_offset(100))
        .unwrap();
    let want = gradpack::decode_to_vec(&want_frame).unwrap();
    for input in [&raw, &npy, &renamed] {
        let frame = d.join("g.gpk");
        let o = gradpack(&[
            "encode",
            "--codec",
            "int8:rounding=stochastic",
            "--seed",
            "9",
            "--offset",
            "100",
            p(input),
            p(&frame),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(
            std::fs::read(&frame).unwrap(),
            want_frame,
            "frame from {input:?}"
        );

        let out_raw = d.join("out.f32");
        let o = gradpack(&["decode", p(&frame), p(&out_raw)]);
        assert!(o.status.success(), "{}", stderr(&o));
        let got: Vec<f32> = std::fs::read(&out_raw)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, want);

        let out_npy = d.join("out.npy");
        let o = gradpack(&["decode", p(&frame), p(&out_npy)]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(std::fs::read(&out_npy).unwrap(), npy_f32(&want));
    }
}

#[test]
fn inspect_shows_header_validity_and_statistics() {
    let d = dir("inspect");
    let x: Vec<f32> = (0..1000).map(|i| i as f32 - 500.0).collect();
    let frame = d.join("f.gpk");
    std::fs::write(
        &frame,
        CodecSpec::parse("fp16")
            .unwrap()
            .encode(&x, &EncodeCtx::new(0))
            .unwrap(),
    )
    .unwrap();
    let o = gradpack(&["inspect", p(&frame)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8(o.stdout).unwrap();
    for want in [
        "codec       fp16",
        "elements    1000",
        "valid       decodes",
        "the payload is not checksummed: encode with --checksum to seal it",
        "min -5.000000e2",
        "max 4.990000e2",
    ] {
        assert!(s.contains(want), "{want:?} not in\n{s}");
    }
    // A sealed frame: its payload is checked too.
    let sealed = d.join("sealed.gpk");
    let spec = CodecSpec::parse("fp16").unwrap();
    std::fs::write(
        &sealed,
        gradpack::Checksummed(spec)
            .encode(&x, &EncodeCtx::new(0))
            .unwrap(),
    )
    .unwrap();
    let o = gradpack(&["inspect", p(&sealed)]);
    let s = String::from_utf8(o.stdout).unwrap();
    assert!(
        s.contains("valid       yes (header checksum, payload checksum"),
        "{s}"
    );
    // From stdin.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gradpack"))
        .args(["inspect", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&std::fs::read(&frame).unwrap())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success());
    assert!(
        String::from_utf8(o.stdout)
            .unwrap()
            .contains("elements    1000")
    );
}

#[test]
fn encode_with_checksum_seals_and_inspect_reports_it() {
    let d = dir("checksum");
    let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.01).collect();
    let raw = d.join("x.f32");
    std::fs::write(&raw, bytemuck::cast_slice(&x)).unwrap();
    let (plain, sealed) = (d.join("plain.gpk"), d.join("sealed.gpk"));
    for (out, extra) in [(&plain, None), (&sealed, Some("--checksum"))] {
        let mut args = vec!["encode", "--codec", "int8"];
        args.extend(extra);
        args.extend([p(&raw), p(out)]);
        let o = gradpack(&args);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let (a, b) = (
        std::fs::read(&plain).unwrap(),
        std::fs::read(&sealed).unwrap(),
    );
    assert_eq!(b.len(), a.len() + 4);
    let o = gradpack(&["inspect", p(&sealed)]);
    let s = String::from_utf8(o.stdout).unwrap();
    assert!(s.contains("(payload checksum)"), "{s}");
    assert!(s.contains("payload checksum, fields"), "{s}");
    // One payload bit flipped: a clear error naming the checksum.
    let mut bad = b.clone();
    bad[100] ^= 4;
    let f = d.join("bad.gpk");
    std::fs::write(&f, &bad).unwrap();
    let o = gradpack(&["inspect", p(&f)]);
    assert_clean_error(&o, "payload checksum mismatch");
}

#[test]
fn bad_input_gives_one_clear_error_and_status_2() {
    let d = dir("errors");
    let x = gradpack::synthetic::gradient(300, 1);
    let raw = d.join("g.f32");
    std::fs::write(&raw, bytemuck::cast_slice::<f32, u8>(&x)).unwrap();
    let out = d.join("o");
    let frame = d.join("f.gpk");
    std::fs::write(
        &frame,
        CodecSpec::parse("int8")
            .unwrap()
            .encode(&x, &EncodeCtx::new(0))
            .unwrap(),
    )
    .unwrap();

    assert_clean_error(
        &gradpack(&["encode", "--codec", "int9", p(&raw), p(&out)]),
        "int9",
    );
    assert_clean_error(
        &gradpack(&["model", "--bandwidth", "10Gbsp"]),
        "--bandwidth",
    );
    assert_clean_error(&gradpack(&["model", "--latency", "5 parsecs"]), "--latency");
    assert_clean_error(&gradpack(&["model", "--nodes", "0"]), "--nodes");
    assert_clean_error(&gradpack(&["model", "--size", "lots"]), "--size");
    assert_clean_error(&gradpack(&["report", "--backend", "sse9"]), "--backend");
    assert_clean_error(
        &gradpack(&[
            "encode",
            "--codec",
            "int8",
            p(&d.join("missing.f32")),
            p(&out),
        ]),
        "missing.f32",
    );
    // Not a whole number of f32, and a malformed .npy.
    let odd = d.join("odd.f32");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    assert_clean_error(
        &gradpack(&["encode", "--codec", "int8", p(&odd), p(&out)]),
        "whole number",
    );
    let bad_npy = d.join("bad.npy");
    std::fs::write(&bad_npy, b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f8'}").unwrap();
    assert_clean_error(
        &gradpack(&["encode", "--codec", "int8", p(&bad_npy), p(&out)]),
        ".npy",
    );
    // The bytes decide, not the name: a zip archive (.npz) and a frame are refused as
    // input arrays whatever they are called.
    let npz = d.join("grads.f32");
    std::fs::write(&npz, b"PK\x03\x04\x14\x00\x00\x00").unwrap();
    assert_clean_error(
        &gradpack(&["encode", "--codec", "int8", p(&npz), p(&out)]),
        "zip archive",
    );
    assert_clean_error(
        &gradpack(&["encode", "--codec", "int8", p(&frame), p(&out)]),
        "gradpack frame",
    );
    // Corrupt frames: a flipped header bit, a flipped payload bit, a truncation.
    let good = std::fs::read(&frame).unwrap();
    for (name, bytes) in [
        ("header", {
            let mut b = good.clone();
            b[20] ^= 4;
            b
        }),
        ("truncated", good[..good.len() - 3].to_vec()),
        ("garbage", vec![0x47; 10]),
    ] {
        let f = d.join(format!("{name}.gpk"));
        std::fs::write(&f, &bytes).unwrap();
        assert_clean_error(&gradpack(&["inspect", p(&f)]), "invalid frame");
        assert_clean_error(&gradpack(&["decode", p(&f), p(&out)]), p(&f));
    }
}

#[test]
fn model_prints_every_algorithm_and_codec() {
    let o = gradpack(&[
        "model",
        "--nodes",
        "8",
        "--size",
        "4MiB",
        "--bandwidth",
        "10Gbit/s",
        "--latency",
        "1ms",
        "--codec",
        "fp16",
        "--codec",
        "int8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8(o.stdout).unwrap();
    for want in [
        "ring",
        "binomial tree",
        "recursive doubling",
        "halving-doubling",
        "fp16",
        "int8",
    ] {
        assert!(s.contains(want), "{want:?} not in\n{s}");
    }
}

#[test]
fn report_json_and_plot() {
    let d = dir("report");
    let svg = d.join("t.svg");
    let o = gradpack(&[
        "report",
        "--elements",
        "65536",
        "--codec",
        "int8",
        "--codec",
        "sign",
        "--json",
        "--plot",
        p(&svg),
        "--backend",
        "scalar",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(v["backend"], "scalar");
    assert_eq!(v["gradpack_version"], env!("CARGO_PKG_VERSION"));
    assert!(v["cpu"].is_string() && v["date"].as_str().unwrap().len() == 10);
    let codecs = v["codecs"].as_array().unwrap();
    assert_eq!(codecs.len(), 2);
    for c in codecs {
        for key in [
            "spec",
            "bits_per_element",
            "ratio",
            "rel_l2_error",
            "encode_gb_s",
            "decode_gb_s",
            "break_even_gbit_s",
        ] {
            assert!(c.get(key).is_some(), "{key} missing in {c}");
        }
        assert!(c["encode_gb_s"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(codecs[0]["spec"], "int8:block=256,rounding=nearest");
    let bits = codecs[0]["bits_per_element"].as_f64().unwrap();
    assert!((8.0..8.2).contains(&bits), "{bits}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("fp32") && svg.contains("int8"),
        "{}",
        &svg[..200.min(svg.len())]
    );
}

/// The break-even and the speedup agree, also where latency dominates (1000 elements:
/// the all-gather of frames and of fp32 frames beat the rings): the codec is faster than
/// fp32 exactly at the link speeds where the report says it pays.
#[test]
fn report_break_even_agrees_with_speedup() {
    for bw in ["1Gbit/s", "10Gbit/s", "100Gbit/s", "1Tbit/s"] {
        let o = gradpack(&[
            "report",
            "--elements",
            "1000",
            "--codec",
            "int8",
            "--codec",
            "sign",
            "--codec",
            "topk",
            "--bandwidth",
            bw,
            "--json",
            "--no-train",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
        let b = v["bandwidth_bit_s"].as_f64().unwrap() / 1e9;
        for c in v["codecs"].as_array().unwrap() {
            let pays = c["pays_at_gbit_s"].as_array().unwrap();
            let mut inside = false;
            for iv in pays {
                let lo = iv[0].as_f64().unwrap();
                let hi = iv[1].as_f64().unwrap_or(f64::INFINITY);
                // Within 0.1% of an end, either answer is a tie.
                if (b / lo - 1.0).abs() < 1e-3 || (b / hi - 1.0).abs() < 1e-3 {
                    continue;
                }
                inside |= lo < b && b < hi;
            }
            let speedup = c["speedup"].as_f64().unwrap();
            assert_eq!(inside, speedup > 1.0, "{bw}: {c}");
            if let Some(be) = c["break_even_gbit_s"].as_f64() {
                assert_eq!(pays.len(), 1);
                assert_eq!(pays[0][1].as_f64(), Some(be));
            }
        }
    }
}

#[test]
fn train_json_plot_and_refusals() {
    let d = dir("train");
    let svg = d.join("curves.svg");
    let o = gradpack(&[
        "train",
        "--model",
        "softmax",
        "--epochs",
        "2",
        "--codec",
        "int8",
        "--codec",
        "qsgd:bits=2",
        "--json",
        "--plot",
        p(&svg),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(doc["model"], "softmax");
    let base = &doc["baseline"];
    assert_eq!(base["strategy"], "fp32-ring");
    assert_eq!(base["curve"].as_array().unwrap().len(), 2);
    let acc = base["curve"][1]["test_accuracy"].as_f64().unwrap();
    assert!(acc > 0.3 && acc <= 1.0, "{acc}");
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4); // two codecs, without and with error feedback
    assert!(runs[0]["bytes_per_worker"].as_u64().unwrap() > 0);
    // QSGD 2-bit with error feedback is refused, with the reason.
    assert!(
        runs[3]["refused"].as_str().unwrap().contains("contractive"),
        "{:?}",
        runs[3]
    );
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.contains("<svg") && svg.contains("int8"), "plot");

    assert_clean_error(&gradpack(&["train", "--model", "cnn"]), "--model");
    assert_clean_error(&gradpack(&["train", "--strategy", "tree"]), "--strategy");
    assert_clean_error(&gradpack(&["train", "--lr", "0"]), "--lr");
    assert_clean_error(&gradpack(&["train", "--codec", "int9"]), "int9");
}

/// A `.npy` header with any shape text and the given data bytes.
fn npy_with_shape(shape: &str, data: &[u8]) -> Vec<u8> {
    npy_of("<f4", false, shape, data)
}

/// A version 1.0 `.npy` of any dtype and memory order, written independently of the tool.
fn npy_of(descr: &str, fortran: bool, shape: &str, data: &[u8]) -> Vec<u8> {
    let order = if fortran { "True" } else { "False" };
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': {order}, 'shape': ({shape}), }}");
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut v = b"\x93NUMPY\x01\x00".to_vec();
    v.extend_from_slice(&(h.len() as u16).to_le_bytes());
    v.extend_from_slice(h.as_bytes());
    v.extend_from_slice(data);
    v
}

#[test]
fn npy_shapes_are_multiplied_in_checked_arithmetic() {
    let d = dir("npyshape");
    let out = d.join("x.gpk");
    for (shape, data, needle) in [
        // 2^62 elements with no data: 2^64 bytes, which wraps to 0 unchecked.
        ("4611686018427387904,", &[][..], "more than 2^64 bytes"),
        // 2^62 + 1 elements with 4 bytes of data: wraps to 4 bytes unchecked.
        (
            "4611686018427387905,",
            &[0u8; 4][..],
            "more than 2^64 bytes",
        ),
        (
            "65536, 65536, 65536, 65536",
            &[][..],
            "more than 2^64 elements",
        ),
        ("3,", &[0u8; 8][..], "needs 12 data bytes"),
        // No elements, but strides of 2^80: npyz would multiply them unchecked.
        (
            "0, 1099511627776, 1099511627776",
            &[][..],
            "more than 2^64 elements",
        ),
    ] {
        let f = d.join("bad.npy");
        std::fs::write(&f, npy_with_shape(shape, data)).unwrap();
        let o = gradpack(&["encode", "--codec", "fp16", p(&f), p(&out)]);
        assert_clean_error(&o, needle);
    }
}

#[test]
fn frames_are_read_header_first() {
    let d = dir("headerfirst");
    // 64 MiB of zeros: refused on its first 4 bytes.
    let zeros = d.join("zeros.gpk");
    std::fs::write(&zeros, vec![0u8; 64 << 20]).unwrap();
    for cmd in ["inspect", "decode"] {
        let mut args = vec![cmd, p(&zeros)];
        let out = d.join("out.bin");
        if cmd == "decode" {
            args.push(p(&out));
        }
        assert_clean_error(&gradpack(&args), "not the gradpack magic");
    }
    // A valid frame with one byte more, and one with one byte less.
    let codec: CodecSpec = "int8".parse().unwrap();
    let frame = codec.encode(&[1.0; 300], &EncodeCtx::new(1)).unwrap();
    let mut long = frame.clone();
    long.push(7);
    let f = d.join("long.gpk");
    std::fs::write(&f, &long).unwrap();
    assert_clean_error(&gradpack(&["inspect", p(&f)]), "trailing");
    std::fs::write(&f, &frame[..frame.len() - 1]).unwrap();
    assert_clean_error(&gradpack(&["inspect", p(&f)]), "truncated");
}

#[test]
fn degenerate_options_are_refused_or_shown_plainly() {
    // One node sends nothing: no NaN speedup.
    let o = gradpack(&["model", "--nodes", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(!s.contains("NaN"), "{s}");
    let negative: [&[&str]; 2] = [
        &["model", "--latency=-1us"],
        &["model", "--latency", "-1us"],
    ];
    for args in negative {
        assert_clean_error(&gradpack(args), "\"-1us\" is negative");
    }
    assert_clean_error(&gradpack(&["model", "--bandwidth", "-5Gbit/s"]), "negative");
    assert_clean_error(
        &gradpack(&["train", "--hidden", "0", "--epochs", "1", "--codec", "fp16"]),
        "at least one hidden unit",
    );
}

#[test]
fn a_closed_stdout_is_not_a_panic_nor_an_error() {
    // `gradpack train | head -0`: the reader is gone before the table is printed; the
    // command stops quietly, as other tools do.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gradpack"))
        .args([
            "train",
            "--epochs",
            "1",
            "--codec",
            "fp16",
            "--workers",
            "2",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run gradpack");
    drop(child.stdout.take());
    let o = child.wait_with_output().expect("wait");
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    assert!(!e.contains("error"), "{e}");
}

#[test]
fn a_very_sparse_frame_decodes_when_asked_with_max_elements() {
    let d = dir("sparse");
    let n = 1 << 20;
    let x = gradpack::synthetic::gradient(n, 5);
    let raw = d.join("g.f32");
    std::fs::write(&raw, bytemuck::cast_slice::<f32, u8>(&x)).unwrap();
    let frame = d.join("g.gpk");
    let o = gradpack(&["encode", "--codec", "topk:k=10", p(&raw), p(&frame)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let len = std::fs::metadata(&frame).unwrap().len();
    assert!(
        4096 * len < n as u64,
        "the frame ({len} bytes) is under the default limit"
    );
    let out = d.join("out.f32");
    // Refused by default, with the way out in the message ...
    assert_clean_error(
        &gradpack(&["decode", p(&frame), p(&out)]),
        "--max-elements 1048576",
    );
    assert_clean_error(&gradpack(&["inspect", p(&frame)]), "--max-elements");
    // ... and decoded when asked: the same values as the library's decode.
    let o = gradpack(&["decode", "--max-elements", "1048576", p(&frame), p(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want =
        gradpack::decode_to_vec_with_limit(&std::fs::read(&frame).unwrap(), n as u64).unwrap();
    let got: Vec<f32> = std::fs::read(&out)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(got.len(), n);
    assert!(
        got.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    assert_eq!(got.iter().filter(|v| **v != 0.0).count(), 10);
    let o = gradpack(&["inspect", "--max-elements", "1048576", p(&frame)]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A limit below the frame's count is refused, however it was given.
    assert_clean_error(
        &gradpack(&["decode", "--max-elements", "1000", p(&frame), p(&out)]),
        "--max-elements",
    );
}

/// Shapes come back with `--shape`, and every float dtype, byte order and memory order
/// numpy writes is read as float32 in C order, with a note saying what was converted.
#[test]
fn npy_shapes_dtypes_and_orders_round_trip() {
    let d = dir("npykinds");
    // A 2 x 3 array, C order values 0..6 (scaled), as float32.
    let c: Vec<f32> = (0..6).map(|i| i as f32 * 0.25 - 0.5).collect();
    // Its Fortran-order storage: column by column.
    let f: Vec<f32> = [0, 3, 1, 4, 2, 5].iter().map(|&i| c[i]).collect();
    let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let be = |v: &[f32]| v.iter().flat_map(|x| x.to_be_bytes()).collect::<Vec<u8>>();
    let f64le: Vec<u8> = c.iter().flat_map(|&x| (x as f64).to_le_bytes()).collect();
    let f16le: Vec<u8> = c
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    for (name, file, note) in [
        ("c", npy_of("<f4", false, "2, 3", &le(&c)), None),
        (
            "fortran",
            npy_of("<f4", true, "2, 3", &le(&f)),
            Some("Fortran order"),
        ),
        (
            "big",
            npy_of(">f4", false, "2, 3", &be(&c)),
            Some("big-endian"),
        ),
        (
            "f64",
            npy_of("<f8", false, "2, 3", &f64le),
            Some("<f8 converted to float32"),
        ),
        (
            "f16",
            npy_of("<f2", false, "2, 3", &f16le),
            Some("<f2 converted to float32"),
        ),
    ] {
        let input = d.join(format!("{name}.npy"));
        std::fs::write(&input, file).unwrap();
        let frame = d.join(format!("{name}.gpk"));
        let o = gradpack(&["encode", "--codec", "identity", p(&input), p(&frame)]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains("--shape \"2,3\""), "{name}: {err}");
        match note {
            Some(n) => assert!(err.contains(n), "{name}: no note {n:?} in {err}"),
            None => assert!(!err.contains("note:"), "{name}: {err}"),
        }
        // Decoded with the shape, the .npy has it and the C-order values.
        let out = d.join(format!("{name}.out.npy"));
        let o = gradpack(&["decode", "--shape", "2,3", p(&frame), p(&out)]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let bytes = std::fs::read(&out).unwrap();
        let text = String::from_utf8_lossy(&bytes[10..74]);
        assert!(text.contains("'shape': (2, 3)"), "{name}: {text}");
        assert_eq!(&bytes[bytes.len() - 24..], &le(&c)[..], "{name}");
    }
    // A 0-d array, a shape that does not fit, and a dtype that is not a float.
    let scalar = d.join("scalar.npy");
    std::fs::write(&scalar, npy_of("<f4", false, "", &1.5f32.to_le_bytes())).unwrap();
    let frame = d.join("scalar.gpk");
    assert!(
        gradpack(&["encode", "--codec", "fp16", p(&scalar), p(&frame)])
            .status
            .success()
    );
    let out = d.join("scalar.out.npy");
    let o = gradpack(&["decode", "--shape", "", p(&frame), p(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&std::fs::read(&out).unwrap()).contains("'shape': ()"));
    assert_clean_error(
        &gradpack(&["decode", "--shape", "4,4", p(&frame), p(&out)]),
        "--shape 4,4: 16 elements, the frame holds 1",
    );
    let ints = d.join("ints.npy");
    std::fs::write(&ints, npy_of("<i4", false, "2,", &[0u8; 8])).unwrap();
    assert_clean_error(
        &gradpack(&["encode", "--codec", "fp16", p(&ints), p(&frame)]),
        "astype(np.float32)",
    );
}

#[test]
fn a_closed_stdout_ends_quietly() {
    // `gradpack model | head -1`: the reader closes the pipe after one line; the command
    // stops with status 0 and nothing on stderr (it said "Broken pipe", status 2).
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    for args in [
        &["model", "--nodes", "8", "--bandwidth", "10Gbit/s"][..],
        &[
            "model",
            "--nodes",
            "64",
            "--bandwidth",
            "1Gbit/s",
            "--size",
            "1GiB",
        ][..],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gradpack"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(!first.is_empty());
        // The pipe's read end is dropped here, as `head` closes it.
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
        assert!(err.is_empty(), "{args:?}: {err}");
    }
}

#[test]
fn encode_help_names_every_input_it_reads() {
    let o = gradpack(&["encode", "--help"]);
    assert!(o.status.success());
    let h = String::from_utf8_lossy(&o.stdout);
    for word in ["float16", "float32", "float64", "Fortran"] {
        assert!(h.contains(word), "{word} missing from:\n{h}");
    }
    assert!(!h.contains(".npy float32)"), "{h}");
}

#[test]
fn a_refused_codec_is_explained_in_the_command_lines_terms() {
    // Error feedback refuses a non-contractive codec; the note names what a command-line
    // user can do, not the Rust option.
    let o = gradpack(&[
        "train",
        "--codec",
        "randk:ratio=0.1,scale=unbiased",
        "--epochs",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("refused"), "{out}");
    assert!(out.contains("scale=none"), "{out}");
    assert!(!out.contains("FeedbackOptions"), "{out}");
}

/// The report answers "which codec on my cluster": the default table fits 100 columns,
/// ranks every candidate by modelled time, and the recommendation is the fastest one that
/// tracks fp32; every faster one is passed over with its reasons. `--wide` has every
/// column.
#[test]
fn report_recommends_the_fastest_codec_that_tracks_and_fits_a_terminal() {
    let base = [
        "report",
        "--elements",
        "65536",
        "--nodes",
        "16",
        "--bandwidth",
        "10Gbit/s",
        "--codec",
        "randk:ratio=0.01,select=strata",
        "--codec",
        "topk:ratio=0.01,values=fp16",
        "--codec",
        "sign",
        "--codec",
        "int8",
        "--codec",
        "fp16",
    ];
    let o = gradpack(&base);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    for line in text.lines() {
        assert!(
            line.chars().count() <= 100,
            "{} columns: {line}",
            line.len()
        );
    }
    assert!(
        text.contains("recommended for 16 nodes at 10.0 Gbit/s: "),
        "{text}"
    );
    assert!(
        text.contains(" tracks ") && !text.contains("enc GB/s"),
        "{text}"
    );
    // Ranked: the times in the table never decrease.
    let times: Vec<f64> = text
        .lines()
        .skip_while(|l| !l.starts_with("spec "))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().nth(6).unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        times.len(),
        5 + 1,
        "5 codecs and fp32 (--codec: no PowerSGD rows): {text}"
    );
    assert!(!text.contains("powersgd"), "{text}");
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    // Random-k drops 98% of each step: never recommended, shown as not tracking.
    let randk = text.lines().find(|l| l.starts_with("randk:")).unwrap();
    assert!(randk.contains(" no "), "{randk}");

    let mut args = base.to_vec();
    args.push("--json");
    let o = gradpack(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let acc = v["fp32_train_accuracy"].as_f64().unwrap();
    assert!((0.5..1.0).contains(&acc), "{acc}");
    let all: Vec<&serde_json::Value> = v["codecs"]
        .as_array()
        .unwrap()
        .iter()
        .chain(v["powersgd"].as_array().unwrap())
        .collect();
    let name = |c: &serde_json::Value| {
        c.get("name")
            .and_then(|n| n.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| format!("powersgd:rank={}", c["rank"]))
    };
    for c in &all {
        // A codec tracks exactly when both tests pass.
        let ef_ok = c["ef_rel_l2_error"].as_f64().is_none_or(|e| e < 0.9);
        let acc_ok = c["accuracy_delta_points"]
            .as_f64()
            .is_some_and(|d| d >= -0.5);
        assert_eq!(c["tracks"] == "yes", ef_ok && acc_ok, "{c}");
        assert_eq!(
            c["tracks_reasons"].as_array().unwrap().is_empty(),
            ef_ok && acc_ok
        );
    }
    let fp32 = v["fp32_allreduce_s"].as_f64().unwrap();
    let rec_t = match &v["recommendation"] {
        serde_json::Value::Null => fp32,
        r => {
            let c = all
                .iter()
                .find(|c| name(c) == r["name"])
                .expect("a candidate");
            assert_eq!(c["tracks"], "yes", "{c}");
            assert_eq!(r["allreduce_s"], c["allreduce_s"]);
            r["allreduce_s"].as_f64().unwrap()
        }
    };
    assert_ne!(
        v["recommendation"]["name"],
        "randk:ratio=0.01,select=strata"
    );
    // Every faster candidate is passed over, with its reasons.
    let passed: Vec<&str> = v["passed_over"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    for c in &all {
        if c["allreduce_s"].as_f64().unwrap() < rec_t {
            assert_eq!(c["tracks"], "no", "{c}");
            assert!(
                passed.contains(&name(c).as_str()),
                "{} not in {passed:?}",
                name(c)
            );
        }
    }

    let mut args = base.to_vec();
    args.extend(["--wide", "--no-train"]);
    let o = gradpack(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    for col in ["enc GB/s", "break-even (range)", "yes?"] {
        assert!(text.contains(col), "{col} missing in\n{text}");
    }
    assert!(
        !text.contains("PowerSGD on a"),
        "--codec asks for no PowerSGD rows:\n{text}"
    );
    assert!(
        text.contains("no training run confirmed it (--no-train)") || text.contains("plain fp32"),
        "{text}"
    );
}

/// `report --input`: the error columns on the user's own gradient; bad inputs are one
/// clear error each.
#[test]
fn report_measures_the_users_gradient() {
    let d = dir("report-input");
    // Values fp16 holds exactly: its error is 0 here (not on the synthetic gradient).
    let x: Vec<f32> = (0..4096)
        .map(|i| ((i % 200) as f32 - 100.0) * 0.25)
        .collect();
    let f = d.join("g.npy");
    std::fs::write(&f, npy_f32(&x)).unwrap();
    let o = gradpack(&[
        "report",
        "--input",
        p(&f),
        "--codec",
        "fp16",
        "--codec",
        "int8",
        "--json",
        "--no-train",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(v["elements"], 4096);
    assert!(
        v["input"].as_str().unwrap().contains("g.npy"),
        "{}",
        v["input"]
    );
    assert_eq!(v["codecs"][0]["rel_l2_error"], 0.0);
    assert_eq!(v["codecs"][0]["ef_rel_l2_error"], 0.0);
    assert!(v["codecs"][1]["rel_l2_error"].as_f64().unwrap() > 0.0);
    // The synthetic gradient is not exact in fp16: the column did change.
    let o = gradpack(&[
        "report",
        "--elements",
        "4096",
        "--codec",
        "fp16",
        "--json",
        "--no-train",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert!(v["codecs"][0]["rel_l2_error"].as_f64().unwrap() > 0.0);

    let short = d.join("short.npy");
    std::fs::write(&short, npy_f32(&x[..100])).unwrap();
    assert_clean_error(
        &gradpack(&[
            "report",
            "--input",
            p(&f),
            "--input",
            p(&short),
            "--no-train",
        ]),
        "same size",
    );
    let mut bad = x.clone();
    bad[7] = f32::NAN;
    let nan = d.join("nan.npy");
    std::fs::write(&nan, npy_f32(&bad)).unwrap();
    assert_clean_error(&gradpack(&["report", "--input", p(&nan)]), "value 7 is NaN");
    let empty = d.join("empty.f32");
    std::fs::write(&empty, b"").unwrap();
    assert_clean_error(
        &gradpack(&["report", "--input", p(&empty)]),
        "holds no values",
    );
    assert_clean_error(
        &gradpack(&["report", "--tolerance=-1", "--no-train"]),
        "--tolerance",
    );
}

/// Runs `gradpack` with `stdin` piped in.
fn gradpack_with_stdin(args: &[&str], stdin: &[u8]) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_gradpack"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run gradpack");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

/// `-` is stdin for every input and stdout for every output that can be; `--plot -`
/// (stdout carries the table) is one clear error.
#[test]
fn a_dash_is_stdin_and_stdout_everywhere() {
    let d = dir("dash");
    let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
    let npy = npy_f32(&x);
    let raw: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    // encode - -: a .npy on stdin (by its magic) to a frame on stdout.
    let o = gradpack_with_stdin(&["encode", "--codec", "fp16", "-", "-"], &npy);
    assert!(o.status.success(), "{}", stderr(&o));
    let frame = o.stdout.clone();
    let want = "fp16"
        .parse::<CodecSpec>()
        .unwrap()
        .encode(&x, &EncodeCtx::new(0))
        .unwrap();
    assert_eq!(frame, want);
    assert!(
        stderr(&o).starts_with("stdout: 1000 elements"),
        "{}",
        stderr(&o)
    );
    // Raw f32 on stdin gives the same frame.
    let o = gradpack_with_stdin(&["encode", "--codec", "fp16", "-", "-"], &raw);
    assert_eq!(o.stdout, want);
    // decode - -: raw f32 on stdout, or .npy with --format npy (and a shape).
    let o = gradpack_with_stdin(&["decode", "-", "-"], &frame);
    assert!(o.status.success(), "{}", stderr(&o));
    let back: Vec<f32> = o
        .stdout
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let mut dec = vec![0f32; 1000];
    gradpack::decode(&frame, &mut dec).unwrap();
    assert_eq!(back, dec);
    let o = gradpack_with_stdin(
        &[
            "decode",
            "-",
            "-",
            "--format",
            "npy",
            "--shape",
            "(10, 100)",
        ],
        &frame,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(o.stdout.starts_with(b"\x93NUMPY"));
    assert!(String::from_utf8_lossy(&o.stdout[..128]).contains("(10, 100)"));
    // report --input - reads the gradient from stdin.
    let o = gradpack_with_stdin(
        &[
            "report",
            "--input",
            "-",
            "--codec",
            "fp16",
            "--json",
            "--no-train",
        ],
        &npy,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["elements"], 1000);
    // inspect --reference - reads the original from stdin.
    let f = d.join("f.gp");
    std::fs::write(&f, &frame).unwrap();
    let o = gradpack_with_stdin(&["inspect", p(&f), "--reference", "-"], &npy);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("reference   stdin (1000 values)"));
    assert_clean_error(
        &gradpack(&["report", "--plot", "-", "--no-train"]),
        "--plot -",
    );
    assert_clean_error(&gradpack(&["train", "--plot", "-"]), "--plot -");
}

/// `--shape` takes the form `encode` prints and Python's `(256, 300)`; a shape with a
/// raw output, a format that does not exist, and a transposed shape of a 2-D dct frame
/// are clear errors.
#[test]
fn decode_shapes_in_every_printed_form_and_refuses_what_cannot_hold() {
    let d = dir("shapes");
    let x: Vec<f32> = (0..12 * 8).map(|i| (i as f32 * 0.1).cos()).collect();
    let input = d.join("m.npy");
    std::fs::write(
        &input,
        npy_with_shape(
            "12, 8",
            &x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
        ),
    )
    .unwrap();
    let f = d.join("m.gp");
    let o = gradpack(&["encode", "--codec", "int8", p(&input), p(&f)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the input's shape is (12, 8)"),
        "{}",
        stderr(&o)
    );
    for shape in ["12,8", "(12, 8)", "[12, 8]", " ( 12 ,8 ) "] {
        let out = d.join("o.npy");
        let o = gradpack(&["decode", p(&f), p(&out), "--shape", shape]);
        assert!(o.status.success(), "{shape}: {}", stderr(&o));
        let b = std::fs::read(&out).unwrap();
        assert!(
            String::from_utf8_lossy(&b[..100]).contains("(12, 8)"),
            "{shape}"
        );
    }
    let out = d.join("v.npy");
    let o = gradpack(&["decode", p(&f), p(&out), "--shape", "(96,)"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&std::fs::read(&out).unwrap()[..100]).contains("(96,)"));
    assert_clean_error(
        &gradpack(&["decode", p(&f), p(&d.join("o.f32")), "--shape", "12,8"]),
        "raw f32, which has no shape",
    );
    assert_clean_error(
        &gradpack(&["decode", p(&f), "-", "--shape", "12,8"]),
        "--format npy",
    );
    assert_clean_error(
        &gradpack(&["decode", p(&f), p(&out), "--format", "csv"]),
        "accepted values are raw, npy",
    );
    assert_clean_error(
        &gradpack(&["decode", p(&f), p(&out), "--shape", "(12; 8)"]),
        "whole numbers",
    );
    // dct on a 2-D array: its tiles follow the rows, and the frame knows them.
    let g = d.join("dct.gp");
    let o = gradpack(&["encode", "--codec", "dct:chunk=4,k=2", p(&input), p(&g)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("width=8"), "{}", stderr(&o));
    let (_, spec) = gradpack::inspect(&std::fs::read(&g).unwrap()).unwrap();
    let want: CodecSpec = "dct:chunk=4,k=2,width=8".parse().unwrap();
    assert_eq!(spec, want);
    assert_clean_error(
        &gradpack(&["decode", p(&g), p(&out), "--shape", "8,12"]),
        "rows are 8 long",
    );
    let o = gradpack(&["decode", p(&g), p(&out), "--shape", "12,8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // An explicit width=0 keeps tiles along the flat array.
    let o = gradpack(&[
        "encode",
        "--codec",
        "dct:chunk=4,k=2,width=0",
        p(&input),
        p(&g),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, spec) = gradpack::inspect(&std::fs::read(&g).unwrap()).unwrap();
    assert_eq!(spec, "dct:chunk=4,k=2".parse::<CodecSpec>().unwrap());
}

/// `inspect` prints a ratio as it was written, an empty frame without a made-up bits per
/// element, and `--reference` the frame's error against its original and the codec's
/// bound (also for a chunk of a larger tensor, at its offset).
#[test]
fn inspect_reads_plainly_and_measures_against_a_reference() {
    let d = dir("inspect-ref");
    let x: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.013).sin() * 3.0).collect();
    let orig = d.join("x.npy");
    std::fs::write(&orig, npy_f32(&x)).unwrap();
    let f = d.join("r.gp");
    let o = gradpack(&["encode", "--codec", "randk:ratio=0.01", p(&orig), p(&f)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(gradpack(&["inspect", p(&f)]).stdout).unwrap();
    assert!(
        out.contains("codec       randk:ratio=0.01,values=f32"),
        "{out}"
    );

    let empty = d.join("e.f32");
    std::fs::write(&empty, b"").unwrap();
    let e = d.join("e.gp");
    let o = gradpack(&["encode", "--codec", "int8", p(&empty), p(&e)]);
    assert!(o.status.success());
    assert!(
        stderr(&o).contains("0 elements -> 56 bytes (no elements,"),
        "{}",
        stderr(&o)
    );
    let out = String::from_utf8(gradpack(&["inspect", p(&e)]).stdout).unwrap();
    // (The frame's 448 bits are not a rate; the path, with the process id, may hold
    // the digits.)
    assert!(
        out.lines().any(|l| l == "bits/elem   - (no elements)")
            && !out
                .lines()
                .any(|l| l.starts_with("bits/elem") && l.contains("448")),
        "{out}"
    );

    let g = d.join("i.gp");
    assert!(
        gradpack(&["encode", "--codec", "int8", p(&orig), p(&g)])
            .status
            .success()
    );
    let out =
        String::from_utf8(gradpack(&["inspect", p(&g), "--reference", p(&orig)]).stdout).unwrap();
    let mut dec = vec![0f32; x.len()];
    gradpack::decode(&std::fs::read(&g).unwrap(), &mut dec).unwrap();
    let worst = x
        .iter()
        .zip(&dec)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        out.contains(&format!("max |x - D(x)| {:.3e}", worst as f64)),
        "{out}\n{worst}"
    );
    assert!(out.contains("bound       within"), "{out}");
    // A chunk at offset 1000: compared with elements 1000..1500 of the whole tensor.
    let chunk = d.join("chunk.f32");
    std::fs::write(
        &chunk,
        x[1000..1500]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let c = d.join("c.gp");
    assert!(
        gradpack(&[
            "encode",
            "--codec",
            "fp16",
            "--offset",
            "1000",
            p(&chunk),
            p(&c)
        ])
        .status
        .success()
    );
    let out =
        String::from_utf8(gradpack(&["inspect", p(&c), "--reference", p(&orig)]).stdout).unwrap();
    assert!(out.contains("(5000 values, elements 1000..1500)"), "{out}");
    assert!(out.contains("bound       within"), "{out}");
    // A reference of another size is a clear error.
    assert_clean_error(
        &gradpack(&["inspect", p(&g), "--reference", p(&chunk)]),
        "--reference",
    );
}

/// `model` aligns its table for specs of any length.
#[test]
fn model_table_aligns_long_specs() {
    let o = gradpack(&[
        "model",
        "--codec",
        "randk:ratio=0.01,values=f32,scale=none,select=strata",
        "--codec",
        "int8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    let rows: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("spec")).collect();
    assert_eq!(rows.len(), 3, "{out}");
    // Every row ends at the same column, and the bits column starts after the spec.
    assert!(rows.iter().all(|l| l.len() == rows[0].len()), "{out}");
}

#[test]
fn mistakes_a_newcomer_makes_get_one_line_at_once() {
    let d = dir("newcomer");
    let missing = d.join("no-such-dir").join("plot.svg");
    let started = std::time::Instant::now();
    for (args, needle) in [
        (vec!["report", "--nodes", "1"], "--nodes 1"),
        (vec!["report", "--plot", p(&missing)], "cannot write there"),
        (vec!["train", "--plot", p(&missing)], "cannot write there"),
        (vec!["report", "--tolerance", "-1"], "--tolerance -1"),
        (vec!["model", "--size", "-5MiB"], "negative"),
    ] {
        assert_clean_error(&gradpack(&args), needle);
    }
    // Refused before any timing or training run.
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    assert!(!missing.exists());
    // A seed the codec never reads, and non-finite input, each get a note.
    let x = d.join("x.f32");
    let vals: Vec<u8> = [1.0f32, 0.3, 3.0, -2.0, 0.77, 1.1]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(&x, &vals).unwrap();
    let out = d.join("x.gpk");
    let o = gradpack(&["encode", "--codec", "int8", "--seed", "7", p(&x), p(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--seed changes nothing"),
        "{}",
        stderr(&o)
    );
    let o = gradpack(&[
        "encode",
        "--codec",
        "int8:rounding=stochastic",
        "--seed",
        "7",
        p(&x),
        p(&out),
    ]);
    assert!(
        !stderr(&o).contains("--seed changes nothing"),
        "{}",
        stderr(&o)
    );
    let mut nan = vals.clone();
    nan[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&x, &nan).unwrap();
    let o = gradpack(&["encode", "--codec", "fp16", p(&x), p(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("1 NaN or infinite"), "{}", stderr(&o));
}

#[test]
fn the_default_report_has_powersgd_rows_and_codec_lists_do_not() {
    // Without --codec the report shows PowerSGD beside its representative codecs (ranks
    // 1 and 4); with --codec, only what was asked for (tested above).
    let o = gradpack(&["report", "--elements", "4096", "--no-train", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let ranks: Vec<u64> = v["powersgd"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_u64().unwrap())
        .collect();
    assert_eq!(ranks, [1, 4]);
}
