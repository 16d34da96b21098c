//! Every backend this CPU has, on every codec's encode, decode, decode_add and error-
//! feedback step, in one process, alternated: the check that no backend is slower than
//! another on an operation it can run (an AVX-512 CPU also runs the AVX2 kernels, so its
//! backend must route each operation to the faster of the two).
//!
//! ```text
//! cargo run --release --example backend_race [ELEMENTS...] [SPEC...]
//! ```
//!
//! Sizes default to 65536 and 1048576, codecs to a representative list.
//!
//! `reduce x8` is [`gradpack::reduce_frames`] of eight frames of the codec, in GB/s of its
//! f32 output (one eighth of the elements decoded).
//!
//! Prints, per size, codec and operation, the best of 8 rounds (each round times every
//! backend once, 0.1 s of repetitions each, in an order that alternates between rounds) in GB/s of f32, the same run's
//! memcpy and read pass (a 16-lane sum, as the criterion benches' `read_sum`), and each
//! backend's ratio to the fastest.

use std::time::Instant;

/// The criterion benches' helpers: `read_pass`, the same-run read baseline.
#[path = "../benches/common/mod.rs"]
mod common;
use common::read_pass;

use gradpack::codec::REPRESENTATIVE_SPECS;
use gradpack::{Backend, BackendKind, Codec, CodecSpec, EncodeCtx, ErrorFeedback};

/// Beside the representative set: top-k's approximate selection and plain f32.
const EXTRA_SPECS: [&str; 2] = ["topk:ratio=0.01,values=fp16,select=approx", "identity"];

/// Seconds per call of `f`, best over repetitions filling about 0.1 s.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut reps = 0u32;
    let mut best = f64::INFINITY;
    while start.elapsed().as_secs_f64() < 0.1 || reps < 3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        reps += 1;
    }
    best
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sizes: Vec<usize> = {
        let v: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
        if v.is_empty() {
            vec![1 << 16, 1 << 20]
        } else {
            v
        }
    };
    let specs: Vec<&str> = {
        let v: Vec<&str> = args
            .iter()
            .filter(|a| a.parse::<usize>().is_err())
            .map(String::as_str)
            .collect();
        if v.is_empty() {
            REPRESENTATIVE_SPECS
                .iter()
                .chain(&EXTRA_SPECS)
                .copied()
                .collect()
        } else {
            v
        }
    };
    let backends: Vec<Backend> = BackendKind::ALL
        .into_iter()
        .filter(|k| *k != BackendKind::Scalar)
        .filter_map(Backend::of)
        .collect();
    gradpack::parallel::set_min_len(usize::MAX);
    println!(
        "backends: {:?}; best of 8 rounds in alternating order, GB/s of f32 input, one thread\n",
        backends.iter().map(|b| b.kind().name()).collect::<Vec<_>>()
    );
    for &n in &sizes {
        let x = gradpack::synthetic::gradient(n, 3);
        let src: Vec<u8> = bytemuck::cast_slice(&x).to_vec();
        let mut dst = vec![0u8; src.len()];
        let memcpy = (0..7)
            .map(|_| time(|| dst.copy_from_slice(&src)))
            .fold(f64::INFINITY, f64::min);
        let read = (0..7)
            .map(|_| time(|| _ = std::hint::black_box(read_pass(std::hint::black_box(&x)))))
            .fold(f64::INFINITY, f64::min);
        let gbs = |t: f64| 4.0 * n as f64 / t / 1e9;
        println!(
            "## {n} elements (memcpy {:.1} GB/s, read pass {:.1} GB/s)\n",
            gbs(memcpy),
            gbs(read)
        );
        print!("| codec | operation |");
        for b in &backends {
            print!(" {} GB/s |", b.kind().name());
        }
        println!(" slowest / fastest |");
        println!("|---|---|{}---:|", "---:|".repeat(backends.len()));
        for &spec in &specs {
            let codec: CodecSpec = spec.parse().expect("spec");
            let ctx = EncodeCtx::new(9);
            let mut frame = vec![0u8; codec.max_encoded_len(n)];
            let len = codec.encode_into(&x, &ctx, &mut frame).expect("encode");
            let frame_ok = frame[..len].to_vec();
            // Eight frames of the same codec for the fused reduction.
            let eight: Vec<Vec<u8>> = (0..8u64)
                .map(|q| {
                    let xq = gradpack::synthetic::gradient(n, 20 + q);
                    codec.encode(&xq, &EncodeCtx::new(q)).expect("encode")
                })
                .collect();
            let mut out = vec![0f32; n];
            let mut ef = ErrorFeedback::new(codec, n).ok();
            let ops: [&str; 5] = ["encode", "decode", "decode_add", "feedback", "reduce x8"];
            for op in ops {
                if op == "feedback" && ef.is_none() {
                    continue;
                }
                let mut best = vec![f64::INFINITY; backends.len()];
                for round in 0..8 {
                    // Alternate the order, so that neither backend always goes first.
                    let mut order: Vec<usize> = (0..backends.len()).collect();
                    if round % 2 == 1 {
                        order.reverse();
                    }
                    for i in order {
                        let b = &backends[i];
                        let t = b.run(|| match op {
                            "encode" => time(|| {
                                codec.encode_into(&x, &ctx, &mut frame).expect("encode");
                            }),
                            "decode" => {
                                time(|| codec.decode_into(&frame_ok, &mut out).expect("decode"))
                            }
                            "decode_add" => {
                                time(|| codec.decode_add(&frame_ok, &mut out).expect("decode_add"))
                            }
                            "reduce x8" => time(|| {
                                gradpack::reduce_frames(&eight, &mut out).expect("reduce");
                            }),
                            _ => {
                                let ef = ef.as_mut().expect("feedback state");
                                time(|| {
                                    ef.encode_into(&x, &ctx, &mut frame).expect("feedback");
                                })
                            }
                        });
                        best[i] = best[i].min(t);
                    }
                }
                print!("| {spec} | {op} |");
                for t in &best {
                    print!(" {:.1} |", gbs(*t));
                }
                let (lo, hi) = best
                    .iter()
                    .fold((f64::INFINITY, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
                println!(" {:.2} |", hi / lo);
            }
        }
        println!();
    }
}
