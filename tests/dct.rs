//! The `dct` codec against an f64 model of it: each tile keeps its largest coefficients
//! (by an f64 DCT from the cosine formula), the frame's values are those coefficients,
//! and the decoding is the f64 inverse DCT of exactly the kept set; and the reason to
//! use it: on smooth gradients it keeps far more of the energy than top-k of the raw
//! elements at the same bytes.

mod common;

use common::{dct_basis_f64, dct_tiles, dct2_f64};
use gradpack::{Codec, CodecSpec, Dct, EncodeCtx};

/// The f64 inverse of `dct2_f64` (the transpose of the orthonormal transform).
fn idct2_f64(c: &[f64], h: usize, w: usize) -> Vec<f64> {
    let basis = dct_basis_f64;
    let mut x = vec![0f64; h * w];
    for i in 0..h {
        for j in 0..w {
            x[i * w + j] = (0..h * w)
                .map(|p| c[p] * basis(h, p / w, i) * basis(w, p % w, j))
                .sum();
        }
    }
    x
}

/// The kept positions and values of each tile, read from the frame (f32 values).
fn kept_of(frame: &[u8], d: &Dct, n: usize) -> Vec<Vec<(usize, f32)>> {
    let p = &frame[gradpack::HEADER_LEN..];
    let full = if d.width() == 0 {
        d.chunk()
    } else {
        d.chunk() * d.chunk()
    };
    let ib = if full <= 256 { 1 } else { 2 };
    let mut at = 0;
    let mut out = Vec::new();
    for (_, h, w, _) in dct_tiles(d, n) {
        let kt = d.k().min(h * w);
        let pos: Vec<usize> = (0..kt)
            .map(|j| {
                if ib == 1 {
                    p[at + j] as usize
                } else {
                    u16::from_le_bytes([p[at + 2 * j], p[at + 2 * j + 1]]) as usize
                }
            })
            .collect();
        at += kt * ib;
        let vals: Vec<f32> = (0..kt)
            .map(|j| f32::from_le_bytes(p[at + 4 * j..at + 4 * j + 4].try_into().unwrap()))
            .collect();
        at += 4 * kt;
        out.push(pos.into_iter().zip(vals).collect());
    }
    out
}

#[test]
fn each_tile_keeps_its_largest_coefficients_and_decodes_to_their_inverse() {
    for (spec, n) in [
        ("dct:chunk=64,k=5", 1000),
        ("dct:chunk=64,k=5,transform=fast", 1000),
        ("dct:chunk=16,k=3", 333),
        ("dct:chunk=16,k=12,width=64,transform=fast", 64 * 40),
        ("dct:chunk=8,k=10,width=40", 40 * 21),
        ("dct:chunk=32,k=70,width=50", 50 * 40),
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        let CodecSpec::Dct(d) = spec else {
            unreachable!()
        };
        let x = gradpack::synthetic::gradient(n, 17);
        let frame = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
        let decoded = spec.decode(&frame).unwrap();
        let kept = kept_of(&frame, &d, n);
        for ((first, h, w, len), kept) in dct_tiles(&d, n).into_iter().zip(kept) {
            let tile: Vec<f64> = (0..h * w)
                .map(|p| x[first + (p / w) * len + p % w] as f64)
                .collect();
            let c = dct2_f64(&tile, h, w);
            let norm = c.iter().map(|v| v * v).sum::<f64>().sqrt();
            // The kept positions are the largest |c|: every one at least as large as
            // any dropped one (up to f32 rounding, which can swap near-ties), and each
            // value is its coefficient to f32 precision.
            let kt = kept.len();
            assert_eq!(kt, d.k().min(h * w));
            let is_kept = |p: usize| kept.iter().any(|&(q, _)| q == p);
            let least = kept
                .iter()
                .map(|&(p, _)| c[p].abs())
                .fold(f64::INFINITY, f64::min);
            let most_dropped = (0..h * w)
                .filter(|&p| !is_kept(p))
                .map(|p| c[p].abs())
                .fold(0f64, f64::max);
            assert!(
                least >= most_dropped - 2e-6 * norm,
                "{spec}: tile at {first}: kept {least}, dropped {most_dropped}"
            );
            assert!(kept.windows(2).all(|w| w[0].0 < w[1].0));
            for &(p, v) in &kept {
                assert!(
                    (v as f64 - c[p]).abs() <= 2e-6 * norm,
                    "{spec}: value at {p}"
                );
            }
            // The decoding is the f64 inverse of the kept set (as sent).
            let mut sparse = vec![0f64; h * w];
            kept.iter().for_each(|&(p, v)| sparse[p] = v as f64);
            let back = idct2_f64(&sparse, h, w);
            let scale = sparse.iter().map(|v| v * v).sum::<f64>().sqrt();
            for (p, want) in back.iter().enumerate() {
                let got = decoded[first + (p / w) * len + p % w] as f64;
                assert!(
                    (got - want).abs() <= 1e-6 * scale + 1e-30,
                    "{spec}: tile at {first}, element {p}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn on_smooth_gradients_dct_keeps_more_energy_than_top_k_at_the_same_bytes() {
    // A gradient that varies slowly along its rows (a sum of a few low-frequency waves per
    // row, plus 5% noise), as the gradients of neighbouring weights often do.
    let (rows, cols) = (64, 256);
    let noise = gradpack::synthetic::gradient(rows * cols, 3);
    let rms = (noise.iter().map(|v| v * v).sum::<f32>() / noise.len() as f32).sqrt();
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let (r, c) = ((i / cols) as f32, (i % cols) as f32);
            let t = c / cols as f32 * std::f32::consts::TAU;
            (t * (1.0 + r % 3.0)).sin() + 0.5 * (2.0 * t + r).cos() + 0.05 * noise[i] / rms
        })
        .collect();
    let energy = |v: &[f32]| v.iter().map(|&a| (a as f64).powi(2)).sum::<f64>();
    let kept = |spec: &str| {
        let spec: CodecSpec = spec.parse().unwrap();
        let frame = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
        let d = spec.decode(&frame).unwrap();
        let err: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a - b).collect();
        (1.0 - energy(&err) / energy(&x), frame.len())
    };
    // 4 of 64 coefficients (one-byte positions, f32 values: 20 bytes per 64 elements)
    // against top-k of 1/16 of the elements (f32 values and Rice-coded gaps).
    let (dct, dct_bytes) = kept("dct:chunk=64,k=4");
    let (topk, topk_bytes) = kept("topk:ratio=0.0625");
    assert!(
        dct_bytes as f64 <= 1.2 * topk_bytes as f64,
        "{dct_bytes} vs {topk_bytes}"
    );
    assert!(dct > 0.9, "dct keeps {dct}");
    assert!(topk < 0.5, "top-k keeps {topk}");
}

#[test]
fn frames_of_other_widths_and_bad_positions_are_rejected() {
    let spec: CodecSpec = "dct:chunk=8,k=3,width=10".parse().unwrap();
    let x = gradpack::synthetic::gradient(100, 1);
    assert!(spec.encode(&x[..95], &EncodeCtx::new(0)).is_err());
    let frame = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
    let mut out = vec![0f32; 100];
    spec.decode_into(&frame, &mut out).unwrap();
    // Swap the first tile's first two positions: out of order, refused before writing.
    let mut bad = frame.clone();
    bad.swap(gradpack::HEADER_LEN, gradpack::HEADER_LEN + 1);
    let mut acc = vec![1.5f32; 100];
    assert!(matches!(
        spec.decode_add(&bad, &mut acc),
        Err(gradpack::Error::Corrupt { .. })
    ));
    assert!(acc.iter().all(|&v| v == 1.5));
}

#[test]
fn the_sync_engine_gives_each_matrix_2d_tiles_which_keep_more_of_it() -> gradpack::Result<()> {
    // Gradients smooth down each column and random along each row (a random row vector
    // scaled by a smooth profile, another per rank), as a layer's gradient is when its
    // input features differ and its output units move together. Through the engine with
    // `dct:chunk=8,k=4` and `dct_2d`, the matrices go in 8 x 8 tiles of their own buckets (all-gathered),
    // the vector in tiles along its row. Each matrix's result is the mean of the ranks'
    // frames of its width, and its error is well under half that of the 1-D tiles of
    // about the same bytes (`chunk=64,k=4` along the flat tensor; measured 0.12 against
    // 0.69 on `w`).
    use gradpack::collective::{Strategy, Transport, local};
    use gradpack::sync::{Policy, SyncEngine, SyncOptions, Tensor};
    let layout = [
        Tensor::new("w", &[128, 96]),
        Tensor::new("b", &[128]),
        Tensor::new("conv", &[32, 4, 3, 3]),
    ];
    let grad = |rank: usize, t: &Tensor| -> Vec<f32> {
        let n = t.shape[0];
        let m: usize = t.shape[1..].iter().product();
        let v = gradpack::synthetic::gradient(m, 40 + rank as u64);
        (0..n * m)
            .map(|i| {
                let a = (i / m) as f32 / n as f32;
                (3.0 * a + rank as f32).cos() * v[i % m]
            })
            .collect()
    };
    let spec: CodecSpec = "dct:chunk=8,k=4".parse()?;
    let opts = SyncOptions {
        policy: Policy {
            dct_2d: true,
            ..Policy::uniform(spec)
        },
        ..Default::default()
    };
    let res = local::run(2, None, |comm| {
        let rank = comm.rank();
        let mut e = SyncEngine::new(&layout, comm.into_inner(), opts.clone())?;
        for (i, t) in layout.iter().enumerate() {
            e.ready(i, &grad(rank, t))?;
        }
        e.finish()?;
        let outs: Vec<Vec<f32>> = (0..layout.len())
            .map(|i| e.grad(i).map(<[f32]>::to_vec))
            .collect::<gradpack::Result<_>>()?;
        Ok((e.plan().clone(), outs))
    });
    let (plan, outs) = res.into_iter().next().unwrap()?;
    let method = |t: usize| {
        let b = plan
            .buckets
            .iter()
            .find(|b| b.tensors.contains(&t))
            .unwrap();
        (b.tensors.len(), b.codec.to_string(), b.strategy)
    };
    let ag = Strategy::CompressedAllGather;
    assert_eq!(
        method(0),
        (1, "dct:chunk=8,k=4,values=f32,width=96".into(), ag)
    );
    assert_eq!(
        method(2),
        (1, "dct:chunk=8,k=4,values=f32,width=36".into(), ag)
    );
    assert_eq!(method(1).1, "dct:chunk=8,k=4,values=f32,width=0");
    for (t, width) in [(0usize, 96u32), (2, 36)] {
        let tensor = &layout[t];
        let two_d = Dct::new(8, 4, width, gradpack::DctValues::F32)?;
        let one_d = Dct::new(64, 4, 0, gradpack::DctValues::F32)?;
        let ctx = EncodeCtx::default();
        let mean_of = |c: &Dct| -> Vec<f64> {
            let d: Vec<Vec<f32>> = (0..2)
                .map(|r| {
                    let g = grad(r, tensor);
                    common::decode(&common::encode(c, &g, &ctx), g.len())
                })
                .collect();
            d[0].iter()
                .zip(&d[1])
                .map(|(&a, &b)| (f64::from(a) + f64::from(b)) / 2.0)
                .collect()
        };
        let want = mean_of(&two_d);
        let got = &outs[t];
        assert!(
            got.iter()
                .zip(&want)
                .all(|(&g, &w)| (f64::from(g) - w).abs() <= 1e-6 * (1.0 + w.abs())),
            "{}: the engine's result is not the mean of the 2-D frames",
            tensor.name
        );
        // The same bytes, but for the edge tiles of a width that is not a multiple of 8
        // (36: 20 tiles of up to 64 elements against 18 of 64).
        let bytes = |c: &Dct| common::encode(c, &grad(0, tensor), &ctx).len() as f64;
        assert!(bytes(&two_d) <= 1.12 * bytes(&one_d));
        let exact: Vec<f64> = grad(0, tensor)
            .iter()
            .zip(&grad(1, tensor))
            .map(|(&a, &b)| (f64::from(a) + f64::from(b)) / 2.0)
            .collect();
        let err = |y: &[f64]| {
            let e: f64 = y.iter().zip(&exact).map(|(a, b)| (a - b).powi(2)).sum();
            e / exact.iter().map(|v| v * v).sum::<f64>()
        };
        let (e2, e1) = (err(&want), err(&mean_of(&one_d)));
        eprintln!(
            "{}: relative squared error 2-D {e2:.3}, 1-D {e1:.3}",
            tensor.name
        );
        assert!(e2 < 0.5 * e1, "{}: 2-D {e2}, 1-D {e1}", tensor.name);
    }
    Ok(())
}

#[test]
fn one_row_tiles_decode_in_batches_only_for_a_single_row() {
    // Tiles of one row go through the batched decoder; with `width > 0` and `chunk = 1`
    // the tiles are one element high too, but the matrix has several rows (or none: an
    // empty matrix made the batch read a tile past the payload, found by fuzzing). Every
    // coefficient of a 1 x 1 tile is kept, so the frame decodes to its input.
    for spec in [
        "dct:chunk=1,k=1,width=7",
        "dct:chunk=1,k=1,width=7,values=sign,scale=frame",
    ] {
        let c: gradpack::CodecSpec = spec.parse().unwrap();
        let frame = common::encode(&c, &[], &EncodeCtx::new(0));
        assert!(common::decode(&frame, 0).is_empty(), "{spec}");
    }
    let x: Vec<f32> = (0..3 * 7).map(|i| i as f32 * 0.25 - 2.0).collect();
    for spec in [
        "dct:chunk=1,k=1,width=7",
        "dct:chunk=1,k=1,width=7,values=fp16",
        "dct:chunk=8,k=8,width=0",
        "dct:chunk=4,k=4",
    ] {
        let c: gradpack::CodecSpec = spec.parse().unwrap();
        let frame = common::encode(&c, &x, &EncodeCtx::new(0));
        let got = common::decode(&frame, x.len());
        for (i, (&a, &b)) in x.iter().zip(&got).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                "{spec} element {i}: {a} vs {b}"
            );
        }
    }
}
