//! `codebook`'s encoder against a reference written from its definition alone (the
//! codec's module docs): a plain reading with a separate finiteness scan, one histogram
//! of sums and one of counts per residue `j % 4`, and the bins' sums in element order. The
//! crate's encoder fuses passes and packs its histograms for speed; the bytes must not
//! move, on every backend the CPU has, at lengths around its internal steps.

mod common;

use common::{every_kernel_set, sample};
use gradpack::{Codec, CodecSpec, EncodeCtx, HEADER_LEN};

/// The reference encoding of `x` in blocks of `block`: every block's codebook (256
/// little-endian f32), then every element's code.
fn reference(x: &[f32], block: usize) -> (Vec<u8>, Vec<u8>) {
    let (mut books, mut codes) = (Vec::new(), Vec::new());
    for xb in x.chunks(block) {
        if xb.iter().any(|v| !v.is_finite()) {
            for _ in 0..256 {
                books.extend(0x7FC0_0000u32.to_le_bytes());
            }
            codes.extend(std::iter::repeat_n(0u8, xb.len()));
            continue;
        }
        let lane_sum = |f: &dyn Fn(f32) -> f64| {
            let mut l = [0f64; 16];
            for (j, &v) in xb.iter().enumerate() {
                l[j % 16] += f(v);
            }
            for w in [8, 4, 2, 1] {
                for j in 0..w {
                    l[j] += l[j + w];
                }
            }
            l[0]
        };
        let n = xb.len() as f64;
        let mu = lane_sum(&|v| v as f64) / n;
        let sigma = (lane_sum(&|v| (v as f64 - mu) * (v as f64 - mu)) / n).sqrt();
        if sigma == 0.0 {
            books.extend((mu as f32).to_le_bytes());
            books.extend([0u8; 255 * 4]);
            codes.extend(std::iter::repeat_n(0u8, xb.len()));
            continue;
        }
        let lo = mu - 6.0 * sigma;
        let (w, r) = (12.0 * sigma / 256.0, 256.0 / (12.0 * sigma));
        let (mut sum, mut count) = ([[0f64; 256]; 4], [[0u64; 256]; 4]);
        for (j, &v) in xb.iter().enumerate() {
            let c = ((v as f64 - lo) * r).floor().clamp(0.0, 255.0) as usize;
            codes.push(c as u8);
            sum[j % 4][c] += v as f64;
            count[j % 4][c] += 1;
        }
        for k in 0..256 {
            let m = count.iter().map(|c| c[k]).sum::<u64>();
            let e = if m > 0 {
                (((sum[0][k] + sum[1][k]) + (sum[2][k] + sum[3][k])) / m as f64) as f32
            } else {
                let max = f32::MAX as f64;
                (lo + (k as f64 + 0.5) * w).clamp(-max, max) as f32
            };
            books.extend(e.to_le_bytes());
        }
    }
    (books, codes)
}

/// Inputs that stress the bins: the crate's test sample (mixed scales and specials), a
/// narrow distribution whose elements mostly share a few bins (consecutive elements in
/// one bin), constant runs, and non-finite values in some blocks.
fn inputs(n: usize, salt: u32) -> Vec<Vec<f32>> {
    let mixed = sample(n, salt);
    let narrow: Vec<f32> = mixed
        .iter()
        .enumerate()
        .map(|(i, v)| {
            if i % 97 == 0 {
                1e3 * v
            } else {
                1.0 + (v * 1e-3)
            }
        })
        .collect();
    let runs: Vec<f32> = (0..n).map(|i| ((i / 37) % 5) as f32 - 2.0).collect();
    let mut specials = mixed.clone();
    for (i, v) in specials.iter_mut().enumerate() {
        if i % 1000 == 999 {
            *v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][i / 1000 % 3];
        }
    }
    vec![mixed, narrow, runs, specials]
}

#[test]
fn codebook_encoder_matches_its_definition_on_every_backend() {
    for block in [1, 3, 64, 255, 256, 257, 300, 1023, 4096, 65536] {
        let spec: CodecSpec = format!("codebook:block={block}").parse().unwrap();
        for n in [0, 1, 4, 5, 255, 256, 257, 1000, 3 * block + 7, 70_001] {
            for (t, x) in inputs(n, block as u32).iter().enumerate() {
                let (books, codes) = reference(x, block);
                for backend in every_kernel_set() {
                    let frame = backend
                        .run(|| spec.encode(x, &EncodeCtx::new(0)))
                        .expect("encode");
                    let payload = &frame[HEADER_LEN..];
                    let at = format!("block {block}, n {n}, input {t}, {backend}");
                    assert_eq!(payload.len(), books.len() + codes.len(), "{at}");
                    assert!(
                        payload[..books.len()] == books[..],
                        "codebooks differ: {at}"
                    );
                    assert!(payload[books.len()..] == codes[..], "codes differ: {at}");
                }
            }
        }
    }
}
