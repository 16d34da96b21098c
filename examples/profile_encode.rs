//! A tight encode loop for profilers: `perf record target/release/examples/profile_encode
//! SPEC [ELEMENTS] [ITERATIONS] [ef|add|decode|reduce]` encodes the synthetic gradient repeatedly with the
//! current backend (set `GRADPACK_BACKEND` to choose) and prints the throughput; with `ef`,
//! each encode is an error-feedback step; with `add`, the loop is `decode_add` of one
//! frame instead, with `decode` its `decode`, and with `reduce`, `reduce_frames` of eight (throughput in f32 output).

use gradpack::{Backend, Codec, CodecSpec, EncodeCtx, ErrorFeedback, FeedbackOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let spec: CodecSpec = args
        .next()
        .ok_or("usage: profile_encode SPEC [ELEMENTS] [ITERATIONS] [ef|add|decode|reduce]")?
        .parse()?;
    let n: usize = args.next().map_or(Ok(1 << 16), |a| a.parse())?;
    let iters: u32 = args.next().map_or(Ok(20_000), |a| a.parse())?;
    let mode = args.next().unwrap_or_default();
    let (ef, add, reduce) = (mode == "ef", mode == "add", mode == "reduce");
    let decode = mode == "decode";
    let x = gradpack::synthetic::gradient(n, 7);
    let mut frame = vec![0u8; spec.max_encoded_len(n)];
    let any = FeedbackOptions {
        allow_non_contractive: true,
        ..Default::default()
    };
    let mut feedback = ErrorFeedback::with_options(spec, n, any)?;
    let len = spec.encode_into(&x, &EncodeCtx::new(1), &mut frame)?;
    let mut sum = vec![0f32; n];
    let frames: Vec<Vec<u8>> = (0..8)
        .map(|q| {
            spec.encode(
                &gradpack::synthetic::gradient(n, 100 + q),
                &EncodeCtx::new(q),
            )
        })
        .collect::<Result<_, _>>()?;
    let start = std::time::Instant::now();
    for _ in 0..iters {
        if reduce {
            gradpack::reduce_frames(&frames, &mut sum)?;
        } else if add {
            gradpack::decode_add(&frame[..len], &mut sum)?;
        } else if decode {
            gradpack::decode(&frame[..len], &mut sum)?;
        } else if ef {
            feedback.encode_into(&x, &EncodeCtx::new(1), &mut frame)?;
        } else {
            spec.encode_into(&x, &EncodeCtx::new(1), &mut frame)?;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{spec}{} on {}: {:.2} GB/s of f32 input",
        match (ef, add, reduce) {
            (true, ..) => " (error feedback)",
            (_, true, _) => " decode_add",
            (.., true) => " reduce_frames of 8",
            _ if decode => " decode",
            _ => "",
        },
        Backend::current(),
        iters as f64 * 4.0 * n as f64 / secs / 1e9
    );
    Ok(())
}
