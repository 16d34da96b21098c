//! Shared helpers for the integration tests: the codec list, boundary lengths, special
//! values, and an independent checker of each codec's documented error bound.
#![allow(dead_code)]

use gradpack::{Codec, CodecSpec, EncodeCtx};

/// Specs covering every codec and the parameter choices that change the layout.
pub const SPECS: &[&str] = &[
    "identity",
    "lossless",
    "fp16",
    "bf16",
    "int8:block=64",
    "int8:block=64,rounding=stochastic",
    "int8:block=1",
    "qsgd:bits=2,block=64",
    "qsgd:bits=4,block=64",
    "qsgd:bits=8,block=64",
    "sign:block=64",
    "sign:block=3",
    "ternary:block=64",
    "natural:block=64",
    "topk:ratio=0.1,values=f32",
    "topk:k=5,values=fp16",
    "topk:ratio=0.05,values=fp16,select=approx,tolerance=0.2",
    "topk:threshold=0.5,values=f32",
    "topk:ratio=0.4,values=int8",
    "topk:ratio=0.02,values=int8,select=approx,index=gaps",
    "randk:ratio=0.3,values=f32",
    "randk:ratio=0.3,values=fp16,scale=unbiased",
    "randk:ratio=0.3,values=f32,select=strata",
    "randk:ratio=0.05,values=bf16,scale=unbiased,select=strata",
    "dct:chunk=64,k=4",
    "dct:chunk=16,k=3,values=fp16",
    "dct:chunk=8,k=5,values=sign",
    "dct:chunk=8,k=3,values=sign,scale=frame,width=1",
    "dct:chunk=16,k=3,values=fp16,transform=direct",
    "dct:chunk=4,k=5,values=sign,width=1,transform=direct",
    "dct:chunk=32,k=6,values=fp16,transform=fast",
    "dct:chunk=8,k=5,values=sign,width=1,transform=fast",
    "fp8:block=64",
    "fp8:format=e5m2,block=64,rounding=stochastic",
    "fp8:format=e5m2,block=100",
    "fp8:scale=e8m0,block=32",
    "fp8:format=e5m2,scale=e8m0,block=45",
    "fp8:format=e5m2,scale=e8m0,block=3,rounding=stochastic",
    "fp8:scale=e8m0,block=32,scale_rule=ocp",
    "fp8:format=e5m2,scale=e8m0,block=45,rounding=stochastic,scale_rule=ocp",
    "fp8:scale=none",
    "fp8:format=e5m2,scale=none,rounding=stochastic",
    "fp4",
    "fp4:block=16,scale=f32,rounding=stochastic",
    "fp4:block=40,scale=f32",
    "fp4:format=e3m0,block=6",
    "fp4:format=e3m0,block=32,rounding=stochastic",
    "fp4:scale_rule=ocp",
    "fp4:format=e3m0,block=10,rounding=stochastic,scale_rule=ocp",
    "fp4:scale=e4m3",
    "fp4:scale=e4m3,format=e3m0,block=10,rounding=stochastic",
    "codebook:block=64",
    "codebook:block=7",
    "chunktopk:chunk=64,k=5",
    "chunktopk:chunk=7,k=7",
    "chunktopk",
    // The entropy stage (decoded values identical to the same spec without it); every
    // staged codec in tests/stage.rs and the golden vectors, a few layouts here.
    "int8:block=64,entropy=on",
    "qsgd:bits=2,block=64,entropy=on",
    "sign:block=3,entropy=on",
    "fp8:format=e5m2,scale=e8m0,block=45,rounding=stochastic,entropy=on",
    "fp4:scale=e4m3,format=e3m0,block=10,rounding=stochastic,entropy=on",
    "codebook:block=7,entropy=on",
];

/// Whether a codec's frames carry a scale taken from the whole input (dct's sign values
/// with one scale per frame; fp4's E4M3 block scales relative to a frame scale): pieces
/// encoded separately then differ from the whole encoding.
#[allow(dead_code)]
pub fn scaled_per_frame(spec: &CodecSpec) -> bool {
    matches!(spec, CodecSpec::Dct(c) if c.values() == gradpack::DctValues::SignFrame)
        || matches!(spec, CodecSpec::Fp4(c) if c.scale() == gradpack::Fp4Scale::E4m3)
}

pub fn specs() -> Vec<CodecSpec> {
    SPECS
        .iter()
        .map(|s| s.parse().expect("valid spec"))
        .collect()
}

/// Lengths every round-trip test runs for a block size `b` (BLAKE3 style).
pub fn boundary_lengths(b: usize) -> Vec<usize> {
    let mut v = vec![0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65];
    v.extend([b.saturating_sub(1), b, b + 1, 3 * b + 5, 7 * b]);
    v.sort_unstable();
    v.dedup();
    v
}

/// The block size of a block codec, or 64 for the others.
pub fn block_of(spec: &CodecSpec) -> usize {
    match spec {
        CodecSpec::Int8(c) => c.block(),
        CodecSpec::Qsgd(c) => c.block(),
        CodecSpec::Sign(c) => c.block(),
        CodecSpec::Ternary(c) => c.block(),
        CodecSpec::Natural(c) => c.block(),
        CodecSpec::Fp8(c) if c.block() > 1 => c.block(),
        CodecSpec::Fp4(c) => c.block(),
        CodecSpec::Codebook(c) => c.block(),
        CodecSpec::ChunkTopK(c) => c.chunk(),
        // A band of whole tiles.
        CodecSpec::Dct(c) => c.chunk() * (c.width() as usize).max(1),
        _ => 64,
    }
}

/// Finite special values.
pub const SPECIALS: &[f32] = &[
    0.0,
    -0.0,
    1.0e-45,
    -1.0e-45,
    1.1754942e-38,
    -5.0e-39,
    f32::MIN_POSITIVE,
    f32::MAX,
    f32::MIN,
    1.0,
    -1.0,
    65504.0,
    65520.0,
    1.0e-8,
];

/// A deterministic finite test vector of length `n` mixing scales, zeros and specials.
pub fn sample(n: usize, salt: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = gradpack::rng::lowbias32(i as u32 ^ salt.wrapping_mul(0x9E37_79B9));
            match h % 17 {
                0 => SPECIALS[(h >> 8) as usize % SPECIALS.len()],
                _ => {
                    let m = (h as i32) as f32 / 2_147_483_648.0;
                    m * pow2(((h >> 5) % 24) as i32 - 16) as f32
                }
            }
        })
        .collect()
}

pub fn encode(c: &dyn Codec, x: &[f32], ctx: &EncodeCtx) -> Vec<u8> {
    c.encode(x, ctx).expect("encode")
}

pub fn decode(frame: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![f32::from_bits(0x7FA5_A5A5); n];
    gradpack::decode(frame, &mut out).expect("decode");
    out
}

/// `2^k`, built from its bits (`powi`'s precision is unspecified; Miri perturbs it).
pub fn pow2(k: i32) -> f64 {
    assert!((-1022..=1023).contains(&k));
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// `floor(log2(a))` for a positive normal `a`, from its exponent bits.
pub fn floor_log2(a: f64) -> i32 {
    assert!(a.is_normal() && a > 0.0);
    ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023
}

fn ulp_slack(m: f64) -> f64 {
    m * pow2(-22) + pow2(-142)
}

/// Check the documented error bound of `spec` for input `x` and decoding `d`; returns a
/// description of the first violation.
pub fn check_bound(spec: &CodecSpec, x: &[f32], d: &[f32], ctx: &EncodeCtx) -> Result<(), String> {
    assert_eq!(x.len(), d.len());
    if x.iter().any(|v| !v.is_finite()) {
        return Err(format!("{spec}: bounds apply to finite inputs only"));
    }
    let err = |i: usize, what: &str| {
        Err(format!(
            "{spec}: element {i}: x = {:e} ({:#010x}), decoded {:e}: {what}",
            x[i],
            x[i].to_bits(),
            d[i]
        ))
    };
    match spec {
        CodecSpec::Identity(_) | CodecSpec::Lossless(_) => {
            for i in 0..x.len() {
                if x[i].to_bits() != d[i].to_bits() {
                    return err(i, "not bit-exact");
                }
            }
        }
        CodecSpec::Fp16(_) => {
            for i in 0..x.len() {
                if half::f16::from_f32(x[i]).to_f32().to_bits() != d[i].to_bits() {
                    return err(i, "differs from half's round trip");
                }
                let a = x[i].abs() as f64;
                let e = (x[i] as f64 - d[i] as f64).abs();
                if a <= 65504.0 && e > (a * pow2(-11)).max(pow2(-25)) {
                    return err(i, "fp16 error bound");
                }
            }
        }
        CodecSpec::Bf16(_) => {
            for i in 0..x.len() {
                if half::bf16::from_f32(x[i]).to_f32().to_bits() != d[i].to_bits() {
                    return err(i, "differs from half's round trip");
                }
            }
        }
        CodecSpec::Int8(c) => {
            let stochastic = c.rounding() == gradpack::Rounding::Stochastic;
            for (b, xb) in x.chunks(c.block()).enumerate() {
                let m = xb.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                let bound = if stochastic { m / 127.0 } else { m / 254.0 } + ulp_slack(m);
                for (j, &v) in xb.iter().enumerate() {
                    let i = b * c.block() + j;
                    let e = (v as f64 - d[i] as f64).abs();
                    if (stochastic && e >= bound) || e > bound {
                        return err(i, &format!("error {e:e} exceeds bound {bound:e}"));
                    }
                    if m == 0.0 && d[i].to_bits() != 0 {
                        return err(i, "all-zero block must decode to +0");
                    }
                }
            }
        }
        CodecSpec::Qsgd(c) => {
            let s = c.levels() as f64;
            for (b, xb) in x.chunks(c.block()).enumerate() {
                let norm = xb
                    .iter()
                    .map(|&v| (v as f64) * (v as f64))
                    .sum::<f64>()
                    .sqrt()
                    .min(f32::MAX as f64);
                let step = norm / s;
                let bound = step * (1.0 + pow2(-20)) + pow2(-142);
                for (j, &v) in xb.iter().enumerate() {
                    let i = b * c.block() + j;
                    let e = (v as f64 - d[i] as f64).abs();
                    if e >= bound {
                        return err(i, &format!("error {e:e} not below one step {step:e}"));
                    }
                    // A whole number of steps (checkable while the f32 step is normal).
                    let q = d[i] as f64 / step;
                    if step > 1e-30 && (q.abs() - q.abs().round()).abs() > 1e-3 {
                        return err(i, "not an integer number of steps");
                    }
                }
            }
        }
        CodecSpec::Fp8(c) => return check_fp8(c, x, d),
        CodecSpec::Fp4(c) => return check_fp4(c, x, d),
        CodecSpec::Codebook(c) => return check_codebook(c, x, d),
        CodecSpec::ChunkTopK(c) => return check_chunktopk(c, x, d),
        CodecSpec::Ternary(c) => {
            for (b, xb) in x.chunks(c.block()).enumerate() {
                let m = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (j, &v) in xb.iter().enumerate() {
                    let i = b * c.block() + j;
                    let ok = d[i] == 0.0
                        || (d[i].abs() == m && d[i].is_sign_negative() == v.is_sign_negative());
                    if !ok {
                        return err(i, &format!("not 0 or sign(x) * {m:e}"));
                    }
                }
            }
        }
        CodecSpec::Sign(c) => {
            for (b, xb) in x.chunks(c.block()).enumerate() {
                let mean = xb.iter().map(|v| v.abs() as f64).sum::<f64>() / xb.len() as f64;
                for (j, &v) in xb.iter().enumerate() {
                    let i = b * c.block() + j;
                    if d[i].is_sign_negative() != v.is_sign_negative() {
                        return err(i, "sign bit not kept");
                    }
                    if ((d[i].abs() as f64) - mean).abs() > mean * 1e-5 + 1e-44 {
                        return err(i, &format!("|decoded| is not mean |x| = {mean:e}"));
                    }
                }
            }
        }
        CodecSpec::Natural(c) => {
            for (b, xb) in x.chunks(c.block()).enumerate() {
                let m = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let r = if m == 0.0 {
                    -23
                } else {
                    (floor_log2(m as f64) + 1).clamp(-23, 127)
                };
                let smallest = pow2(r - 126);
                for (j, &v) in xb.iter().enumerate() {
                    let i = b * c.block() + j;
                    let a = v.abs() as f64;
                    let got = d[i].abs() as f64;
                    if got != 0.0 && d[i].is_sign_negative() != v.is_sign_negative() {
                        return err(i, "sign not kept");
                    }
                    let ok = if a == 0.0 {
                        got == 0.0
                    } else if a < smallest {
                        got == 0.0 || got == smallest
                    } else {
                        let lo = pow2(floor_log2(a));
                        got == lo || (got == 2.0 * lo && 2.0 * lo <= pow2(r))
                    };
                    if !ok {
                        return err(i, "not a neighbouring power of two");
                    }
                }
            }
        }
        CodecSpec::TopK(c) => {
            // Oracle: sort by (magnitude key desc, index asc); exact selection keeps the
            // first k; approx keeps the first k and none past ceil((1 + tolerance) k), and
            // may keep those in between; a threshold keeps exactly the keys >= its own.
            let n = x.len() as u64;
            let key = |v: f32| v.to_bits() & 0x7FFF_FFFF;
            let mut order: Vec<usize> = (0..x.len()).collect();
            order.sort_by(|&a, &b| key(x[b]).cmp(&key(x[a])).then(a.cmp(&b)));
            let (sure, most) = match c.select() {
                gradpack::TopKSelect::Threshold(t) => {
                    let m = x.iter().filter(|&&v| key(v) >= key(t)).count();
                    (m, m)
                }
                _ => (c.k_for(n) as usize, c.max_kept(n) as usize),
            };
            let mut rank = vec![0usize; x.len()];
            for (r, &i) in order.iter().enumerate() {
                rank[i] = r;
            }
            // int8 values: within half a step of the largest block that can hold them
            // (the largest kept magnitude over 127, rounded to nearest).
            let amax = order[..most]
                .iter()
                .fold(0f64, |m, &i| m.max(x[i].abs() as f64));
            let int8_ok = |i: usize| {
                let e = (d[i] as f64 - x[i] as f64).abs();
                e <= amax / 254.0 * (1.0 + pow2(-20)) + pow2(-142)
            };
            for i in 0..x.len() {
                let stored = |i: usize| match c.values() {
                    gradpack::ValueType::Int8 => int8_ok(i),
                    t => d[i].to_bits() == stored_value(t, x[i]).to_bits(),
                };
                let ok = if rank[i] < sure {
                    stored(i)
                } else if rank[i] >= most {
                    d[i].to_bits() == 0
                } else {
                    d[i].to_bits() == 0 || stored(i)
                };
                if !ok {
                    return err(
                        i,
                        &format!("rank {} of the magnitudes (keeps {sure}..={most})", rank[i]),
                    );
                }
            }
        }
        CodecSpec::RandK(c) => {
            let t = c.threshold();
            let mul = if c.scale() == gradpack::RandKScale::Unbiased {
                (4_294_967_296.0 / t as f64) as f32
            } else {
                1.0
            };
            let strata = c.select() == gradpack::RandKSelect::Strata;
            for i in 0..x.len() {
                let g = ctx.offset + i as u64;
                let (kept, mul) = if strata {
                    // The stratum j holding g (b(j) <= g < b(j + 1), b(j) = floor(j 2^32 / t)),
                    // found from below, and the index it keeps (wire format 3.10).
                    let b = |j: u128| (j << 32) / t as u128;
                    let mut j = (g as u128 * t as u128) >> 32;
                    while b(j + 1) <= g as u128 {
                        j += 1;
                    }
                    let len = b(j + 1) - b(j);
                    let r = gradpack::rng::draw(ctx.seed, gradpack::rng::STREAM_STRATA, j as u64);
                    let pick = b(j) + ((r as u128 * len) >> 32);
                    let unbiased = c.scale() == gradpack::RandKScale::Unbiased;
                    (pick == g as u128, if unbiased { len as f32 } else { 1.0 })
                } else {
                    let r = gradpack::rng::draw(ctx.seed, gradpack::rng::STREAM_SELECT, g);
                    ((r as u64) < t, mul)
                };
                let want = if kept {
                    stored_value(c.values(), x[i] * mul)
                } else {
                    0.0
                };
                if want.to_bits() != d[i].to_bits() {
                    return err(i, &format!("expected {want:e} (kept = {kept})"));
                }
            }
        }
        CodecSpec::Dct(c) => return check_dct(c, x, d).map_err(|e| format!("{spec}: {e}")),
        _ => unreachable!("unknown codec"),
    }
    Ok(())
}

/// `B_n[k][i]` of the orthonormal DCT-II in f64, from the cosine formula (an oracle
/// independent of the crate's f32 basis).
pub fn dct_basis_f64(n: usize, k: usize, i: usize) -> f64 {
    let s = if k == 0 {
        (1.0 / n as f64).sqrt()
    } else {
        (2.0 / n as f64).sqrt()
    };
    s * (std::f64::consts::PI * ((2 * i + 1) * k) as f64 / (2 * n) as f64).cos()
}

/// The orthonormal DCT-II of a tile of `h x w` (row-major) in f64.
pub fn dct2_f64(x: &[f64], h: usize, w: usize) -> Vec<f64> {
    let basis = dct_basis_f64;
    let mut out = vec![0f64; h * w];
    for a in 0..h {
        for b in 0..w {
            let mut sum = 0f64;
            for i in 0..h {
                for j in 0..w {
                    sum += x[i * w + j] * basis(h, a, i) * basis(w, b, j);
                }
            }
            out[a * w + b] = sum;
        }
    }
    out
}

/// The tiles of a `dct` frame of `n` elements: `(first element, rows, columns, row
/// length)` (wire format 3.11, restated).
pub fn dct_tiles(c: &gradpack::Dct, n: usize) -> Vec<(usize, usize, usize, usize)> {
    let (rows, len, th) = if c.width() == 0 {
        (1, n, 1)
    } else {
        (n / c.width() as usize, c.width() as usize, c.chunk())
    };
    let mut v = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let mut c0 = 0;
        while c0 < len {
            v.push((
                r0 * len + c0,
                th.min(rows - r0),
                c.chunk().min(len - c0),
                len,
            ));
            c0 += c.chunk();
        }
        r0 += th;
    }
    v
}

/// `dct`'s decoding, checked in the coefficient domain against the f64 transform of the
/// input: at most `k` coefficients per tile survive, they are (up to near-ties) the
/// largest, and each holds the input's coefficient (f32), its fp16 rounding, or its sign
/// times a scale shared by the tile (or frame) that is the mean kept magnitude.
fn check_dct(c: &gradpack::Dct, x: &[f32], d: &[f32]) -> Result<(), String> {
    use gradpack::DctValues;
    let tiles = dct_tiles(c, x.len());
    let (mut frame_scale, mut frame_sum, mut frame_kept) = (None::<f64>, 0f64, 0usize);
    for &(first, h, w, len) in &tiles {
        let get = |v: &[f32]| -> Vec<f64> {
            (0..h * w)
                .map(|p| v[first + (p / w) * len + p % w] as f64)
                .collect()
        };
        let (xs, ds) = (dct2_f64(&get(x), h, w), dct2_f64(&get(d), h, w));
        let norm = xs.iter().map(|v| v * v).sum::<f64>().sqrt();
        if xs.iter().any(|v| v.abs() > 6.0e4) && c.values() == DctValues::Fp16 {
            continue; // fp16 overflow: the bound is infinite
        }
        // f32 rounding of the transforms, relative to the larger of the input's and the
        // decoding's norms (a frame scale can exceed a quiet tile's norm).
        let dnorm = ds.iter().map(|v| v * v).sum::<f64>().sqrt();
        let tol = 4e-5 * (norm + dnorm) + 1e-38;
        let kt = c.k().min(h * w);
        let kept: Vec<usize> = (0..h * w).filter(|&p| ds[p].abs() > tol).collect();
        let at = |p: usize| format!("tile at {first}, coefficient {p}");
        if kept.len() > kt {
            return Err(format!(
                "{}: {} coefficients survive, k = {kt}",
                at(0),
                kept.len()
            ));
        }
        let least = kept
            .iter()
            .map(|&p| xs[p].abs())
            .fold(f64::INFINITY, f64::min);
        if kept.len() == kt {
            for p in (0..h * w).filter(|p| !kept.contains(p)) {
                if xs[p].abs() > least + 2.0 * tol {
                    return Err(format!("{}: |{:e}| dropped, {least:e} kept", at(p), xs[p]));
                }
            }
        }
        let mut sum = 0f64;
        for &p in &kept {
            let (want, got) = (xs[p], ds[p]);
            let ok = match c.values() {
                DctValues::F32 => (got - want).abs() <= tol,
                // The f16 nearest the f32 coefficient, which can sit on the other side of a
                // rounding midpoint than the f64 one: within one f16 ulp (2^-10 relative).
                DctValues::Fp16 => {
                    let r = half::f16::from_f64(want).to_f64();
                    (got - r).abs() <= tol || (got - want).abs() <= tol + want.abs() * pow2(-10)
                }
                _ => want.abs() <= tol || (got < 0.0) == (want < 0.0),
            };
            if !ok {
                return Err(format!("{}: decoded {got:e}, input's {want:e}", at(p)));
            }
            sum += want.abs();
        }
        if matches!(c.values(), DctValues::SignChunk | DctValues::SignFrame) {
            let mags: Vec<f64> = kept.iter().map(|&p| ds[p].abs()).collect();
            let scale = mags.first().copied().unwrap_or(0.0);
            if mags.iter().any(|m| (m - scale).abs() > tol) {
                return Err(format!("tile at {first}: kept magnitudes differ: {mags:?}"));
            }
            if c.values() == DctValues::SignChunk {
                if !kept.is_empty() && (scale - sum / kept.len() as f64).abs() > tol {
                    return Err(format!(
                        "tile at {first}: scale {scale:e}, mean kept {:e}",
                        sum / kept.len() as f64
                    ));
                }
            } else if !kept.is_empty() {
                if frame_scale.is_some_and(|f| (f - scale).abs() > 4e-5 * f.max(scale)) {
                    return Err(format!(
                        "tile at {first}: scale {scale:e} differs from the frame's"
                    ));
                }
                frame_scale = Some(scale);
                frame_sum += sum;
                frame_kept += kept.len();
            }
        }
    }
    if let Some(f) = frame_scale {
        let mean = frame_sum / frame_kept as f64;
        if (f - mean).abs() > 1e-4 * mean.max(1e-38) {
            return Err(format!("frame scale {f:e}, mean kept magnitude {mean:e}"));
        }
    }
    Ok(())
}

/// `v` as a sparse codec stores it (rounded by the `half` crate, an independent oracle).
fn stored_value(t: gradpack::ValueType, v: f32) -> f32 {
    match t {
        gradpack::ValueType::F32 => v,
        gradpack::ValueType::Fp16 => half::f16::from_f32(v).to_f32(),
        gradpack::ValueType::Bf16 => half::bf16::from_f32(v).to_f32(),
        v => unreachable!("value type {v:?}"),
    }
}

// ------------------------------------------------------------------ golden vectors

/// One golden vector: file stem, spec, seed, offset.
pub const GOLDEN: &[(&str, &str, u64, u64)] = &[
    ("identity", "identity", 0, 0),
    ("fp16", "fp16", 0, 0),
    ("bf16", "bf16", 0, 0),
    ("int8_b64", "int8:block=64", 0, 0),
    ("int8_b256", "int8", 0, 0),
    (
        "int8_b64_stochastic",
        "int8:block=64,rounding=stochastic",
        42,
        0,
    ),
    (
        "int8_b64_stochastic_offset",
        "int8:block=64,rounding=stochastic",
        7,
        5_000_000_000,
    ),
    ("qsgd2_b64", "qsgd:bits=2,block=64", 42, 0),
    ("qsgd4_b64", "qsgd:bits=4,block=64", 42, 0),
    ("qsgd8_b64", "qsgd:bits=8,block=64", 42, 0),
    ("sign_b64", "sign:block=64", 0, 0),
    ("sign_b1024", "sign", 0, 0),
    ("ternary_b64", "ternary:block=64", 42, 0),
    ("natural_b64", "natural:block=64", 42, 0),
    ("topk_r005_f32", "topk:ratio=0.05,index=gaps", 0, 0),
    ("topk_k10_fp16", "topk:k=10,values=fp16,index=gaps", 0, 0),
    ("topk_r005_f32_rice", "topk:ratio=0.05", 0, 0),
    ("topk_r05_bf16_bitmap", "topk:ratio=0.5,values=bf16", 0, 0),
    (
        "topk_k10_fp16_rice",
        "topk:k=10,values=fp16,index=rice",
        0,
        0,
    ),
    ("topk_r09_int8", "topk:ratio=0.9,values=int8", 0, 0),
    ("dct_c64_k4_f32", "dct:chunk=64,k=4,transform=direct", 0, 0),
    (
        "dct_c16_k3_fp16",
        "dct:chunk=16,k=3,values=fp16,transform=direct",
        0,
        0,
    ),
    (
        "dct_c8_k5_sign_w20",
        "dct:chunk=8,k=5,values=sign,width=20,transform=direct",
        0,
        0,
    ),
    (
        "dct_c32_k40_signframe_w20",
        "dct:chunk=32,k=40,values=sign,scale=frame,width=20,transform=direct",
        0,
        0,
    ),
    (
        "dct_fast_c64_k4_f32",
        "dct:chunk=64,k=4,transform=fast",
        0,
        0,
    ),
    (
        "dct_fast_c16_k3_fp16",
        "dct:chunk=16,k=3,values=fp16,transform=fast",
        0,
        0,
    ),
    (
        "dct_fast_c8_k5_sign_w20",
        "dct:chunk=8,k=5,values=sign,width=20,transform=fast",
        0,
        0,
    ),
    (
        "dct_fast_c4_k2_w4",
        "dct:chunk=4,k=2,width=4,transform=fast",
        0,
        0,
    ),
    // The entropy stage (wire format 3.17).
    ("int8_b64_entropy", "int8:block=64,entropy=on", 0, 0),
    ("qsgd_b2_entropy", "qsgd:bits=2,block=64,entropy=on", 7, 0),
    ("sign_b3_entropy", "sign:block=3,entropy=on", 0, 0),
    ("ternary_b64_entropy", "ternary:block=64,entropy=on", 9, 0),
    ("natural_b64_entropy", "natural:block=64,entropy=on", 5, 0),
    ("fp8_b32_entropy", "fp8:block=32,entropy=on", 0, 0),
    (
        "fp8_e5m2_none_entropy",
        "fp8:format=e5m2,scale=none,entropy=on",
        0,
        0,
    ),
    ("fp4_entropy", "fp4:entropy=on", 0, 0),
    ("codebook_b7_entropy", "codebook:block=7,entropy=on", 0, 0),
    ("dct_lee_c64_k4_f32", "dct:chunk=64,k=4,transform=lee", 0, 0),
    (
        "dct_lee_c16_k3_fp16",
        "dct:chunk=16,k=3,values=fp16,transform=lee",
        0,
        0,
    ),
    (
        "dct_lee_c8_k5_sign_w20",
        "dct:chunk=8,k=5,values=sign,width=20,transform=lee",
        0,
        0,
    ),
    (
        "dct_lee_c4_k2_w4",
        "dct:chunk=4,k=2,width=4,transform=lee",
        0,
        0,
    ),
    (
        "dct_lee_c32_k7_signframe",
        "dct:chunk=32,k=7,values=sign,scale=frame,transform=lee",
        0,
        0,
    ),
    ("fp8_e4m3_b64", "fp8:block=64", 0, 0),
    (
        "fp8_e5m2_b64_stochastic",
        "fp8:format=e5m2,block=64,rounding=stochastic",
        42,
        0,
    ),
    ("fp8_e4m3_e8m0_b32", "fp8:scale=e8m0,block=32", 0, 0),
    (
        "fp8_e4m3_e8m0_b32_ocp",
        "fp8:scale=e8m0,block=32,scale_rule=ocp",
        0,
        0,
    ),
    (
        "fp8_e5m2_e8m0_b32_stochastic",
        "fp8:format=e5m2,scale=e8m0,block=32,rounding=stochastic",
        42,
        1000,
    ),
    ("fp8_e4m3_none", "fp8:scale=none", 0, 0),
    ("fp8_e5m2_none", "fp8:format=e5m2,scale=none", 0, 0),
    ("fp4_e2m1_b32", "fp4", 0, 0),
    ("fp4_e2m1_b32_ocp", "fp4:scale_rule=ocp", 0, 0),
    (
        "fp4_e2m1_f32_b14_stochastic",
        "fp4:block=14,scale=f32,rounding=stochastic",
        42,
        0,
    ),
    ("fp4_e3m0_b16", "fp4:format=e3m0,block=16", 0, 0),
    ("fp4_e2m1_e4m3_b16", "fp4:scale=e4m3", 0, 0),
    (
        "fp4_e3m0_e4m3_b32_stochastic",
        "fp4:format=e3m0,scale=e4m3,block=32,rounding=stochastic",
        42,
        1000,
    ),
    ("codebook_b64", "codebook:block=64", 0, 0),
    ("codebook_b300", "codebook:block=300", 0, 0),
    ("chunktopk_c64_k5", "chunktopk:chunk=64,k=5", 0, 0),
    ("chunktopk_c4096_k64", "chunktopk", 0, 0),
    ("chunktopk_c7_k7", "chunktopk:chunk=7,k=7", 0, 0),
    ("lossless", "lossless", 0, 0),
    ("randk_r01_f32", "randk:ratio=0.1", 42, 0),
    ("randk_r01_bf16", "randk:ratio=0.1,values=bf16", 42, 0),
    (
        "randk_r01_fp16_unbiased",
        "randk:ratio=0.1,values=fp16,scale=unbiased",
        42,
        1000,
    ),
    (
        "randk_r01_f32_strata",
        "randk:ratio=0.1,select=strata",
        42,
        0,
    ),
    (
        // Stratum numbers cross 2^32 (a new draw key) inside the frame.
        "randk_r03_fp16_unbiased_strata",
        "randk:ratio=0.3,values=fp16,scale=unbiased,select=strata",
        42,
        14_316_557_600,
    ),
];

/// The finite golden input (tests/vectors/README.md gives the same definition).
pub fn golden_input() -> Vec<f32> {
    (0..300u32)
        .map(|i| match i {
            7 => 1.0e-40,
            8 => -1.0e-45,
            128..=191 => {
                if i % 2 == 0 {
                    0.0
                } else {
                    -0.0
                }
            }
            250 => 65520.0,
            299 => f32::MAX,
            _ => {
                let h = gradpack::rng::lowbias32(i);
                (h as i32) as f32 * (pow2(-31) as f32) * (pow2((i * 37 % 23) as i32 - 12) as f32)
            }
        })
        .collect()
}

/// The non-finite golden input: the first 40 finite values with NaN at 3, +Inf at 17
/// and -Inf at 30.
pub fn golden_input_nonfinite() -> Vec<f32> {
    let mut x = golden_input();
    x.truncate(40);
    x[3] = f32::NAN;
    x[17] = f32::INFINITY;
    x[30] = f32::NEG_INFINITY;
    x
}

pub fn vectors_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors")
}

pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Every stored golden frame: (file name, frame bytes).
pub fn golden_frames() -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    for (stem, ..) in GOLDEN {
        for suffix in ["", ".nonfinite"] {
            let name = format!("{stem}{suffix}.gpk");
            let bytes = std::fs::read(vectors_dir().join(&name))
                .unwrap_or_else(|e| panic!("{name}: {e} (see tests/vectors/README.md)"));
            v.push((name, bytes));
        }
    }
    v
}

/// Every finite value of an 8-bit float with `m` mantissa bits and exponent bias `bias`,
/// from the format's definition (positive ones; E4M3 drops its NaN code 0x7F, E5M2 its
/// exponent 31).
pub fn fp8_values(m: u32, bias: i32, e4m3: bool) -> Vec<f64> {
    float_values(7, m, bias, e4m3)
}

/// The finite non-negative values of a float with `bits` magnitude bits (7 for FP8, 3 for
/// FP4); `e4m3` drops the all-ones code (E4M3's NaN), and with 7 bits and not `e4m3` the
/// top exponent (E5M2's infinities and NaN).
pub fn float_values(bits: u32, m: u32, bias: i32, e4m3: bool) -> Vec<f64> {
    let mut v = Vec::new();
    let top = (1u32 << (bits - m)) - 1;
    for code in 0u32..(1 << bits) {
        let (e, f) = ((code >> m) as i32, (code & ((1 << m) - 1)) as f64);
        if bits == 7 && ((e4m3 && code == 0x7F) || (!e4m3 && e as u32 == top)) {
            continue;
        }
        v.push(if e == 0 {
            f * pow2(1 - bias - m as i32)
        } else {
            (1.0 + f / (1 << m) as f64) * pow2(e - bias)
        });
    }
    v
}

/// How a small-float codec scales its blocks, as the checker sees it.
#[derive(Clone, Copy, PartialEq)]
enum FloatScale {
    None,
    F32,
    E8m0,
    /// E8M0 by the OCP MX rule, `2^max(floor(log2 m) - emax, -127)`: the largest
    /// quotients clamped to FMAX.
    E8m0Ocp,
    /// An E4M3 value per block times the frame scale `g` (fp4's NVFP4-like layout).
    E4m3,
}

/// A small-float codec (`fp8`, `fp4`) described independently of the crate's kernels.
struct SmallFloat {
    name: String,
    block: usize,
    /// Its finite non-negative values, ascending (`float_values`).
    values: Vec<f64>,
    m: u32,
    bias: i32,
    scale: FloatScale,
    stochastic: bool,
    /// Without a scale past FMAX: E4M3 saturates, E5M2 may also give ±Inf.
    saturates: bool,
}

fn check_fp8(c: &gradpack::Fp8, x: &[f32], d: &[f32]) -> Result<(), String> {
    let e4m3 = c.format() == gradpack::Fp8Format::E4m3;
    let (m, bias) = (c.format().mantissa_bits(), c.format().bias());
    let scale = match c.scale() {
        gradpack::Fp8Scale::None => FloatScale::None,
        gradpack::Fp8Scale::F32 => FloatScale::F32,
        _ if c.scale_rule() == gradpack::ScaleRule::Ocp => FloatScale::E8m0Ocp,
        _ => FloatScale::E8m0,
    };
    check_small_float(
        &SmallFloat {
            name: c.to_string(),
            block: c.block(),
            values: fp8_values(m, bias, e4m3),
            m,
            bias,
            scale,
            stochastic: c.rounding() == gradpack::Rounding::Stochastic,
            saturates: e4m3,
        },
        x,
        d,
    )
}

fn check_fp4(c: &gradpack::Fp4, x: &[f32], d: &[f32]) -> Result<(), String> {
    let (m, bias) = (c.format().mantissa_bits(), c.format().bias());
    let scale = match c.scale() {
        gradpack::Fp4Scale::F32 => FloatScale::F32,
        gradpack::Fp4Scale::E4m3 => FloatScale::E4m3,
        _ if c.scale_rule() == gradpack::ScaleRule::Ocp => FloatScale::E8m0Ocp,
        _ => FloatScale::E8m0,
    };
    check_small_float(
        &SmallFloat {
            name: c.to_string(),
            block: c.block(),
            values: float_values(3, m, bias, false),
            m,
            bias,
            scale,
            stochastic: c.rounding() == gradpack::Rounding::Stochastic,
            saturates: true,
        },
        x,
        d,
    )
}

/// The small-float checks: each decoded value is a value of the format times its block's
/// scale (the scale recomputed from the module docs' definition), with the sign kept,
/// within the documented error.
fn check_small_float(c: &SmallFloat, x: &[f32], d: &[f32]) -> Result<(), String> {
    let fmax = *c.values.last().unwrap();
    let (m, bias) = (c.m as i32, c.bias);
    // E4M3: the frame scale from the largest finite magnitude, and E4M3's positive
    // values (codes 1 to 0x7E).
    let frame_max = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let g = (frame_max / (448.0 * fmax as f32)).max(f32::MIN_POSITIVE);
    let e4m3 = fp8_values(3, 7, true);
    for (b, xb) in x.chunks(c.block).enumerate() {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let s: f64 = match c.scale {
            FloatScale::E4m3 => {
                let t = amax / (fmax as f32 * g);
                let v = e4m3[1..]
                    .iter()
                    .copied()
                    .find(|&v| v >= t as f64)
                    .unwrap_or(448.0);
                (v as f32 * g) as f64
            }
            FloatScale::None => 1.0,
            FloatScale::F32 => (amax / fmax as f32).max(f32::MIN_POSITIVE) as f64,
            FloatScale::E8m0 => {
                let mut k = -127;
                while (amax as f64) > fmax * pow2(k) {
                    k += 1;
                }
                pow2(k)
            }
            // floor(log2 amax) - emax, emax = floor(log2 FMAX), both from exponent bits
            // (a libm log2 may be off by an ulp: Miri makes it so on purpose).
            FloatScale::E8m0Ocp if amax == 0.0 => 1.0,
            FloatScale::E8m0Ocp => pow2((floor_log2(amax as f64) - floor_log2(fmax)).max(-127)),
        };
        for (j, &v) in xb.iter().enumerate() {
            let i = b * c.block + j;
            let what = |w: String| {
                Err(format!(
                    "{}: element {i}: x = {v:e}, decoded {:e} (block scale {s:e}): {w}",
                    c.name, d[i]
                ))
            };
            if amax == 0.0 {
                if d[i] != 0.0 {
                    return what("an all-zero block decodes to 0".into());
                }
                continue;
            }
            let a = v.abs() as f64;
            // E8M0: past half of f32's range the decoded product may overflow (documented).
            if 2.0 * amax as f64 > f32::MAX as f64 && c.scale == FloatScale::E8m0 {
                continue;
            }
            if c.scale == FloatScale::None && a > fmax {
                // Saturation (E4M3) or overflow (E5M2): the sign is kept.
                let ok = d[i].abs() as f64 == fmax || (!c.saturates && d[i].is_infinite());
                if !ok || d[i].is_sign_negative() != v.is_sign_negative() {
                    return what("overflow not saturated (E4M3) or infinite (E5M2)".into());
                }
                continue;
            }
            if c.scale == FloatScale::E8m0Ocp && a / s > fmax {
                // The OCP rule's clamp: the quotient past FMAX decodes to FMAX.
                if d[i].abs() as f64 != fmax * s || d[i].is_sign_negative() != v.is_sign_negative()
                {
                    return what("a quotient past FMAX not clamped to it".into());
                }
                continue;
            }
            let q = d[i].abs() as f64 / s;
            let near = c
                .values
                .iter()
                .any(|&w| (q - w).abs() <= w * pow2(-22) + pow2(-150) / s);
            if !near {
                return what(format!("{q:e} is not a value of the format"));
            }
            if d[i] != 0.0 && d[i].is_sign_negative() != v.is_sign_negative() {
                return what("sign not kept".into());
            }
            let (rel, sub) = if c.stochastic {
                (pow2(-m), s * pow2(1 - bias - m))
            } else {
                (pow2(-m - 1), s * pow2(-bias - m))
            };
            let bound = (rel * a + sub) * (1.0 + pow2(-20)) + pow2(-22) * a + pow2(-149);
            let e = (v as f64 - d[i] as f64).abs();
            if e > bound {
                return what(format!("error {e:e} exceeds {bound:e}"));
            }
        }
    }
    Ok(())
}

/// The `chunktopk` checks, from its definition: in every chunk the `k` largest
/// magnitudes (ties to the lower index) decode to `s * level`, `s = absmax / 3` of them
/// and the level the nearest of -3, -1, 1, 3 by the thresholds `-2s`, `0`, `2s`; every
/// other element decodes to +0.
fn check_chunktopk(c: &gradpack::ChunkTopK, x: &[f32], d: &[f32]) -> Result<(), String> {
    let key = |v: f32| v.to_bits() & 0x7FFF_FFFF;
    for (q, (xc, dc)) in x.chunks(c.chunk()).zip(d.chunks(c.chunk())).enumerate() {
        let at = q * c.chunk();
        let mut order: Vec<usize> = (0..xc.len()).collect();
        order.sort_by(|&a, &b| key(xc[b]).cmp(&key(xc[a])).then(a.cmp(&b)));
        let kept = &order[..c.k().min(xc.len())];
        let s = kept.iter().fold(0f32, |m, &i| m.max(xc[i].abs())) / 3.0;
        let mut is_kept = vec![false; xc.len()];
        for &i in kept {
            is_kept[i] = true;
            let v = xc[i];
            let t = 2.0 * s;
            let code = (v >= -t) as usize + (v >= 0.0) as usize + (v >= t) as usize;
            let want = s * [-3.0f32, -1.0, 1.0, 3.0][code];
            if dc[i].to_bits() != want.to_bits() {
                return Err(format!(
                    "element {}: {:e} decodes to {:e}, not {want:e}",
                    at + i,
                    v,
                    dc[i]
                ));
            }
        }
        for (i, &v) in dc.iter().enumerate() {
            if !is_kept[i] && v.to_bits() != 0 {
                return Err(format!("element {}: dropped but decodes to {v:e}", at + i));
            }
        }
    }
    Ok(())
}

/// The `codebook` checks, from its definition: each decoded value is the mean of the
/// elements sharing its code (so within their range), the same code gives the same
/// value, and an element inside mean ± 6 sd in an interior bin is within one bin width.
fn check_codebook(c: &gradpack::Codebook, x: &[f32], d: &[f32]) -> Result<(), String> {
    for (b, (xb, db)) in x.chunks(c.block()).zip(d.chunks(c.block())).enumerate() {
        let n = xb.len() as f64;
        let mu = xb.iter().map(|&v| v as f64).sum::<f64>() / n;
        let sd = (xb.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / n).sqrt();
        let amax = xb.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        if sd > 0.0 {
            // Each decoded value is the f32 mean of the elements that decode to it,
            // summed in f64 as the definition does: four interleaved sums (the element
            // at block position j goes to sum j mod 4), added as (s0 + s1) + (s2 + s3).
            let mut groups: std::collections::BTreeMap<u32, ([f64; 4], f64)> = Default::default();
            for (j, (&v, &y)) in xb.iter().zip(db).enumerate() {
                let g = groups.entry(y.to_bits()).or_default();
                g.0[j % 4] += v as f64;
                g.1 += 1.0;
            }
            for (y, (s, count)) in groups {
                let sum = (s[0] + s[1]) + (s[2] + s[3]);
                if ((sum / count) as f32).to_bits() != y {
                    return Err(format!(
                        "{c}: block {b}: {:e} is not the mean of its {count} elements ({:e})",
                        f32::from_bits(y),
                        sum / count
                    ));
                }
            }
        }
        for (j, (&v, &y)) in xb.iter().zip(db).enumerate() {
            let i = b * c.block() + j;
            let e = (v as f64 - y as f64).abs();
            let what = |w: String| Err(format!("{c}: element {i}: x = {v:e}, decoded {y:e}: {w}"));
            if sd == 0.0 {
                if y != v {
                    return what("a constant block decodes exactly".into());
                }
                continue;
            }
            if e > 2.0 * amax * (1.0 + pow2(-20)) {
                return what(format!("error {e:e} above twice the absmax"));
            }
            let w = 12.0 * sd / 256.0;
            let t = (v as f64 - (mu - 6.0 * sd)) / w;
            // Well inside an interior bin (clear of its edges by a little, so the f64
            // binning of this check and of the encoder agree).
            if t > 1.01
                && t < 254.99
                && (t - t.floor()).min(t.ceil() - t) > 1e-6
                && e > w * (1.0 + 1e-6) + (y.abs() as f64) * pow2(-23)
            {
                return what(format!("error {e:e} above the bin width {w:e}"));
            }
        }
    }
    Ok(())
}

/// Every backend this CPU has, and beside an AVX-512 backend the same backend with its
/// routing off (its own kernels for every operation, the ones its routing table hands to
/// AVX2 included), so that every hand-written kernel is checked whatever the table says.
pub fn every_kernel_set() -> Vec<gradpack::Backend> {
    use gradpack::unstable::kernels::routing::unrouted;
    let mut v = Vec::new();
    for b in gradpack::Backend::available() {
        v.push(b);
        if unrouted(b) != b {
            v.push(unrouted(b));
        }
    }
    v
}
