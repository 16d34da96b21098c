//! The fused reduction of many frames (`reduce_frames`, `reduce_frames_add`) is
//! bit-identical to decoding the first frame and `decode_add`ing the others in order: for
//! every codec, on every backend this CPU has, at the boundary lengths and across tiles,
//! for lists mixing codecs, with non-finite inputs, and for any thread count. Bad frames
//! are errors naming their position, and leave the output as the docs promise.

mod common;

use common::*;
use gradpack::unstable::kernels::{Backend, BackendKind};
use gradpack::{Codec, CodecSpec, EncodeCtx, Error};

fn backends() -> Vec<Backend> {
    for kind in BackendKind::ALL {
        if Backend::of(kind).is_none() {
            println!("SKIP backend {}: not supported on this CPU", kind.name());
        }
    }
    every_kernel_set()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// `p` frames of `n` elements, frame `q` encoded with `specs[q % len]` from its own input.
fn frames_of(specs: &[CodecSpec], n: usize, p: usize, salt: u32) -> Vec<Vec<u8>> {
    (0..p)
        .map(|q| {
            let spec = &specs[q % specs.len()];
            let x = sample(n, salt.wrapping_add(q as u32 * 7919));
            spec.encode(&x, &EncodeCtx::new(q as u64 + 1).with_offset(0))
                .unwrap_or_else(|e| panic!("{spec}: {e}"))
        })
        .collect()
}

/// The reference: decode the first frame, decode_add the others (ADD: all added onto
/// `fill`), on the scalar oracle.
fn sequential(frames: &[Vec<u8>], n: usize, add: bool, fill: f32) -> Vec<u32> {
    let mut out = vec![fill; n];
    Backend::scalar().run(|| {
        for (q, f) in frames.iter().enumerate() {
            if q == 0 && !add {
                gradpack::decode(f, &mut out).unwrap();
            } else {
                gradpack::decode_add(f, &mut out).unwrap();
            }
        }
    });
    if frames.is_empty() && !add {
        out.fill(0.0);
    }
    bits(&out)
}

fn check_all_modes(frames: &[Vec<u8>], n: usize, what: &str, bs: &[Backend]) {
    let want = sequential(frames, n, false, 0.0);
    let want_add = sequential(frames, n, true, -2.5);
    for &b in bs {
        let mut out = vec![f32::from_bits(0x7FC0_1234); n];
        b.run(|| gradpack::reduce_frames(frames, &mut out)).unwrap();
        assert!(
            bits(&out) == want,
            "{what} on {b}: reduce_frames differs (n = {n})"
        );
        let mut acc = vec![-2.5f32; n];
        b.run(|| gradpack::reduce_frames_add(frames, &mut acc))
            .unwrap();
        assert!(
            bits(&acc) == want_add,
            "{what} on {b}: reduce_frames_add differs (n = {n})"
        );
    }
}

#[test]
fn every_codec_matches_sequential_decode_add_on_every_backend() {
    let bs = backends();
    for spec in specs() {
        let b = block_of(&spec);
        let mut lens = boundary_lengths(b);
        // Across several tiles (4096 elements) and a partial one, below the parallel split.
        lens.extend([4095, 4096, 4097, 3 * 4096 + 65, 20_000]);
        for &n in &lens {
            for p in [1, 2, 3, 8] {
                let frames = frames_of(std::slice::from_ref(&spec), n, p, n as u32);
                check_all_modes(&frames, n, &format!("{spec} x {p}"), &bs);
            }
        }
    }
}

#[test]
fn mixed_codecs_keep_the_list_order() {
    // Fixed-rate runs with unaligned blocks (sign:block=3, int8:block=1), sparse and dct
    // frames between them: each element is summed in list order.
    let mix: Vec<CodecSpec> = [
        "int8:block=64",
        "sign:block=3",
        "topk:ratio=0.1,values=fp16",
        "fp16",
        "qsgd:bits=4,block=64",
        "int8:block=1,rounding=stochastic",
        "dct:chunk=16,k=3",
        "randk:ratio=0.3,values=f32",
        "natural:block=64",
        "ternary:block=64",
        "bf16",
        "identity",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let bs = backends();
    for n in [0, 1, 191, 192, 193, 4097, 9000] {
        for rot in 0..mix.len() {
            let mut specs = mix.clone();
            specs.rotate_left(rot);
            let frames = frames_of(&specs, n, specs.len(), 31 + rot as u32);
            check_all_modes(&frames, n, &format!("mix rotated {rot}"), &bs);
        }
    }
}

#[test]
fn nonfinite_inputs_reduce_to_the_same_bits() {
    let bs = backends();
    for spec in specs() {
        let n = 3000;
        let frames: Vec<Vec<u8>> = (0..4)
            .map(|q| {
                let mut x = sample(n, 5 + q);
                x[17 * q as usize] = f32::NAN;
                x[100 + q as usize] = if q % 2 == 0 {
                    f32::INFINITY
                } else {
                    f32::NEG_INFINITY
                };
                spec.encode(&x, &EncodeCtx::new(9)).unwrap()
            })
            .collect();
        check_all_modes(&frames, n, &format!("{spec} with NaN/Inf"), &bs);
    }
}

#[test]
fn any_thread_count_gives_the_same_bits() {
    // Large enough to split into many ranges with the threshold at 0.
    let n = 5 * 65536 + 1234;
    let cases: Vec<Vec<CodecSpec>> = [
        vec!["int8"],
        vec!["int8:block=64", "sign:block=3"],
        vec!["fp16", "topk:ratio=0.01,values=fp16", "bf16"],
        vec!["qsgd:bits=2,block=512"],
    ]
    .into_iter()
    .map(|v| v.iter().map(|s| s.parse().unwrap()).collect())
    .collect();
    let before = gradpack::parallel::min_len();
    gradpack::parallel::set_min_len(0);
    for specs in &cases {
        let frames = frames_of(specs, n, 8, 77);
        let want = sequential(&frames, n, false, 0.0);
        for threads in [1, 2, 3, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut out = vec![0.0f32; n];
            pool.install(|| gradpack::reduce_frames(&frames, &mut out))
                .unwrap();
            assert!(
                bits(&out) == want,
                "{specs:?} on {threads} threads differs from the sequential decode"
            );
        }
    }
    gradpack::parallel::set_min_len(before);
}

#[test]
fn no_frames_is_zero_or_nothing() {
    let none: [Vec<u8>; 0] = [];
    let mut out = vec![3.0f32; 10];
    gradpack::reduce_frames(&none, &mut out).unwrap();
    assert_eq!(out, vec![0.0; 10]);
    let mut acc = vec![3.0f32; 10];
    gradpack::reduce_frames_add(&none, &mut acc).unwrap();
    assert_eq!(acc, vec![3.0; 10]);
}

fn index_of(e: &Error) -> usize {
    match e {
        Error::InFrame { index, .. } => *index,
        other => panic!("expected InFrame, got {other:?}"),
    }
}

#[test]
fn bad_frames_are_named_and_leave_the_output_unchanged() {
    let n = 1000;
    let int8: CodecSpec = "int8:block=64".parse().unwrap();
    let good = frames_of(std::slice::from_ref(&int8), n, 4, 3);
    let sentinel = vec![f32::from_bits(0x7FC0_0BAD); n];

    // A frame of another length, a truncated one, a corrupt header, trailing bytes.
    let other_len = int8.encode(&sample(n + 1, 1), &EncodeCtx::new(1)).unwrap();
    let mut bad_header = good[0].clone();
    bad_header[20] ^= 1;
    let mut trailing = good[0].clone();
    trailing.push(0);
    // A qsgd frame whose first step is +Inf: refused by the fixed-rate validation.
    let qsgd: CodecSpec = "qsgd:bits=4,block=64".parse().unwrap();
    let mut inf_step = qsgd.encode(&sample(n, 2), &EncodeCtx::new(1)).unwrap();
    inf_step[gradpack::HEADER_LEN..gradpack::HEADER_LEN + 4]
        .copy_from_slice(&f32::INFINITY.to_le_bytes());
    // A sealed frame whose payload was changed after sealing.
    let mut sealed = gradpack::Checksummed(int8)
        .encode(&sample(n, 4), &EncodeCtx::new(1))
        .unwrap();
    sealed[gradpack::HEADER_LEN + 10] ^= 0x40;
    for (what, bad) in [
        ("another length", other_len),
        ("a truncated frame", good[0][..good[0].len() - 1].to_vec()),
        ("a corrupt header", bad_header),
        ("trailing bytes", trailing),
        ("an infinite qsgd step", inf_step),
        ("a corrupt sealed payload", sealed),
    ] {
        for pos in [0, 2, 4] {
            let mut list = good.clone();
            list.insert(pos, bad.clone());
            for add in [false, true] {
                let mut out = sentinel.clone();
                let e = if add {
                    gradpack::reduce_frames_add(&list, &mut out)
                } else {
                    gradpack::reduce_frames(&list, &mut out)
                }
                .expect_err(what);
                assert_eq!(index_of(&e), pos, "{what}: {e}");
                assert!(
                    bits(&out) == bits(&sentinel),
                    "{what} at {pos}: the output was written"
                );
                assert!(e.to_string().starts_with(&format!("frame {pos}: ")), "{e}");
            }
        }
    }
}

#[test]
fn a_corrupt_sparse_payload_is_named() {
    // Top-k's indices are checked as the frame is decoded: the error names the frame.
    let n = 1000;
    let topk: CodecSpec = "topk:ratio=0.1,values=f32,index=gaps".parse().unwrap();
    let mut list = frames_of(std::slice::from_ref(&topk), n, 3, 8);
    let f = &mut list[1];
    // Point every index past the end: gap bits all ones.
    let k = 100;
    let vals = 4 * k;
    for b in &mut f[gradpack::HEADER_LEN + vals..] {
        *b = 0xFF;
    }
    let mut out = vec![0.0f32; n];
    let e = gradpack::reduce_frames(&list, &mut out).expect_err("corrupt indices");
    assert_eq!(index_of(&e), 1, "{e}");
}
