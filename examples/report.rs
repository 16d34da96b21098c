//! The main job (for now): each codec's compression ratio, error and speed
//! on the built-in synthetic gradient.
//!
//! ```text
//! cargo run --release --example report [-- ELEMENTS]
//! ```
//!
//! Columns: bits per element and ratio measured from the frame (header included);
//! relative L2 error `||x - x'|| / ||x||`; the same after 8 steps of error feedback
//! (`||sum g - sum D|| / ||sum g||`, what the model actually receives); encode and decode
//! throughput in GB/s of f32 input (median of 7 runs).

use std::time::Instant;

use gradpack::{Codec, CodecSpec, EncodeCtx};

const SPECS: &[&str] = &[
    "identity",
    "fp16",
    "bf16",
    "int8",
    "int8:rounding=stochastic",
    "qsgd:bits=8",
    "qsgd:bits=4",
    "qsgd:bits=2",
    "natural",
    "ternary",
    "sign",
    "topk:ratio=0.01,values=fp16",
    "topk:ratio=0.1",
    "randk:ratio=0.01",
];

fn rel_l2(x: &[f32], y: &[f32]) -> f64 {
    let num: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn median_secs(mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..7)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[3]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(a) => a
            .parse()
            .map_err(|_| format!("ELEMENTS must be a positive integer, got {a:?}"))?,
        None => 1 << 20,
    };
    if n == 0 {
        return Err("ELEMENTS must be a positive integer".into());
    }
    let x = gradpack::synthetic::gradient(n, 2024);
    let steps: Vec<Vec<f32>> = (0..8)
        .map(|s| gradpack::synthetic::gradient(n, 3000 + s))
        .collect();
    let gb = (4 * n) as f64 / 1e9;
    println!(
        "gradpack {} report: {n} elements of the synthetic gradient, backend {}\n",
        env!("CARGO_PKG_VERSION"),
        gradpack::Backend::current()
    );
    println!(
        "{:<44} {:>7} {:>7} {:>10} {:>10} {:>9} {:>9}",
        "spec", "bits/el", "ratio", "rel L2", "EF rel L2", "enc GB/s", "dec GB/s"
    );
    for s in SPECS {
        let spec: CodecSpec = s.parse()?;
        let ctx = EncodeCtx::new(1);
        let mut frame = vec![0u8; spec.max_encoded_len(n)];
        let len = spec.encode_into(&x, &ctx, &mut frame)?;
        let mut d = vec![0f32; n];
        gradpack::decode(&frame[..len], &mut d)?;
        let bits = len as f64 * 8.0 / n as f64;

        // Error feedback over 8 steps of fresh gradients.
        let mut residual = vec![0f32; n];
        let (mut sum_g, mut sum_d) = (vec![0f64; n], vec![0f64; n]);
        for (step, g) in steps.iter().enumerate() {
            let ctx = EncodeCtx::new(step as u64);
            let l = spec.encode_with_residual(g, &mut residual, &ctx, &mut frame)?;
            gradpack::decode(&frame[..l], &mut d)?;
            for i in 0..n {
                sum_g[i] += g[i] as f64;
                sum_d[i] += d[i] as f64;
            }
        }
        let ef: f64 = {
            let num: f64 = sum_g.iter().zip(&sum_d).map(|(a, b)| (a - b).powi(2)).sum();
            let den: f64 = sum_g.iter().map(|a| a * a).sum();
            (num / den).sqrt()
        };

        let enc = median_secs(|| {
            spec.encode_into(&x, &ctx, &mut frame).expect("encode");
        });
        let dec = median_secs(|| {
            gradpack::decode(&frame[..len], &mut d).expect("decode");
        });
        gradpack::decode(&frame[..len], &mut d)?;
        println!(
            "{:<44} {:>7.3} {:>7.1} {:>10.3e} {:>10.3e} {:>9.2} {:>9.2}",
            spec.to_string(),
            bits,
            32.0 / bits,
            rel_l2(&x, &d),
            ef,
            gb / enc,
            gb / dec
        );
    }
    Ok(())
}
