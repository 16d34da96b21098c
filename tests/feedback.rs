//! Error feedback: the fused step against an unfused reference built from the plain
//! codec API, the sum invariant, the sign-code identity, the non-finite policy, and
//! determinism across backends, thread counts and chunking.

mod common;

use common::*;
use gradpack::unstable::kernels::{Backend, residual_of, scalar};
use gradpack::{
    Codec, CodecSpec, EncodeCtx, Error, ErrorFeedback, FeedbackOptions, Residual, ResidualPrecision,
};

/// Specs usable with error feedback (random-k with `scale=unbiased` is refused), plus odd
/// block sizes whose tiles and parallel ranges are not powers of two.
fn ef_specs() -> Vec<CodecSpec> {
    let mut v: Vec<CodecSpec> = specs()
        .into_iter()
        .filter(|s| !s.to_string().contains("scale=unbiased"))
        .collect();
    for s in [
        "int8:block=3",
        "int8:block=40",
        "qsgd:bits=2,block=7",
        "sign:block=5",
        "natural:block=1000",
    ] {
        v.push(s.parse().unwrap());
    }
    v
}

/// Options that accept every codec: these tests check the arithmetic of the step, not
/// convergence, so they cover the non-contractive codecs (QSGD at 2 and 4 bits) too.
fn permissive() -> FeedbackOptions {
    FeedbackOptions {
        allow_non_contractive: true,
        ..Default::default()
    }
}

fn fixed_rate(spec: &CodecSpec) -> bool {
    !matches!(
        spec,
        CodecSpec::TopK(_)
            | CodecSpec::RandK(_)
            | CodecSpec::Dct(_)
            | CodecSpec::ChunkTopK(_)
            | CodecSpec::Lossless(_)
    )
}

/// The unfused definition of one step, on the scalar backend with the plain codec API:
/// `p = beta * r + gamma * g`, frame = encode(p), `r = residual_of(p, decode(frame))`
/// (then rounded to bf16 for a bf16 residual).
struct Reference {
    r32: Vec<f32>,
    r16: Option<Vec<u16>>,
}

impl Reference {
    fn new(n: usize, precision: ResidualPrecision) -> Self {
        Reference {
            r32: vec![0.0; n],
            r16: (precision == ResidualPrecision::Bf16).then(|| vec![0; n]),
        }
    }

    fn step(
        &mut self,
        spec: &CodecSpec,
        g: &[f32],
        o: &FeedbackOptions,
        ctx: &EncodeCtx,
    ) -> Vec<u8> {
        let r: Vec<f32> = match &self.r16 {
            Some(h) => h.iter().map(|&b| scalar::bf16_to_f32(b)).collect(),
            None => self.r32.clone(),
        };
        let p: Vec<f32> = r
            .iter()
            .zip(g)
            .map(|(&r, &g)| o.beta * r + o.gamma * g)
            .collect();
        let frame = Backend::scalar().run(|| spec.encode(&p, ctx).unwrap());
        let d = decode(&frame, p.len());
        let e: Vec<f32> = p.iter().zip(&d).map(|(&p, &d)| residual_of(p, d)).collect();
        match &mut self.r16 {
            Some(h) => {
                for (h, &e) in h.iter_mut().zip(&e) {
                    *h = scalar::residual_bf16(e, scalar::f32_to_bf16);
                }
            }
            None => self.r32 = e,
        }
        frame
    }

    fn matches(&self, ef: &ErrorFeedback) -> bool {
        match (ef.residual(), &self.r16) {
            (Residual::F32(r), None) => r
                .iter()
                .map(|v| v.to_bits())
                .eq(self.r32.iter().map(|v| v.to_bits())),
            (Residual::Bf16(r), Some(h)) => r == h.as_slice(),
            _ => false,
        }
    }
}

fn check_against_reference(spec: &CodecSpec, n: usize, o: FeedbackOptions, steps: u64) {
    check_steps(spec, n, o, steps, |step| sample(n, 1000 + step as u32));
}

/// [`check_against_reference`] with each step's gradient from `grad`; the residual is
/// also checked finite after every step.
fn check_steps(
    spec: &CodecSpec,
    n: usize,
    o: FeedbackOptions,
    steps: u64,
    grad: impl Fn(u64) -> Vec<f32>,
) {
    for b in every_kernel_set() {
        let mut ef = ErrorFeedback::with_options(*spec, n, o).unwrap();
        let mut reference = Reference::new(n, o.precision);
        for step in 0..steps {
            let g = grad(step);
            let ctx = EncodeCtx::new(step * 7 + 1).with_offset(step * 1000);
            let want = reference.step(spec, &g, &o, &ctx);
            let got = b.run(|| ef.encode(&g, &ctx)).unwrap();
            assert!(
                got == want,
                "{spec} on {b}, n = {n}, step {step}: frame differs from the reference"
            );
            assert!(
                reference.matches(&ef),
                "{spec} on {b}, n = {n}, step {step}: residual differs from the reference"
            );
            assert!(
                ef.residual_f32().iter().all(|v| v.is_finite()),
                "{spec} on {b}, n = {n}, step {step}: residual holds NaN or Inf"
            );
        }
    }
}

#[test]
fn fused_step_equals_the_unfused_definition_on_every_backend() {
    for b in every_kernel_set() {
        eprintln!("backend tested: {b}");
    }
    for spec in ef_specs() {
        let mut lengths = boundary_lengths(block_of(&spec));
        lengths.push(5000); // several tiles
        for n in lengths {
            check_against_reference(&spec, n, permissive(), 3);
        }
        let weighted = FeedbackOptions {
            beta: 0.9,
            gamma: -0.37,
            ..permissive()
        };
        check_against_reference(&spec, 4099, weighted, 3);
    }
}

#[test]
fn fused_step_handles_non_finite_values_as_the_definition_on_every_backend() {
    // NaN and ±Inf in the gradient (p not finite: the residual is 0), and the largest
    // finite values two steps running at the same elements (p = r + g overflows, or its
    // decode does), so every branch of the residual's definition is taken by the SIMD
    // decoders' residual mode, against the unfused definition on the scalar backend.
    let n = 4099;
    let grad = |step: u64| {
        let mut g = sample(n, 77 + step as u32);
        for (i, v) in g.iter_mut().enumerate() {
            match (i % 97, step) {
                (3, 0) => *v = f32::NAN,
                (5, _) => *v = f32::INFINITY,
                (8, 1) => *v = f32::NEG_INFINITY,
                (11 | 12, _) => *v = f32::MAX,
                (13, _) => *v = f32::MIN,
                (40..=47, 2) => *v = f32::NAN,
                _ => {}
            }
        }
        g
    };
    // And `chunktopk`, whose step writes its kept elements' residuals itself.
    let fused = |s: &&CodecSpec| fixed_rate(s) || matches!(s, CodecSpec::ChunkTopK(_));
    for spec in ef_specs().iter().filter(fused) {
        check_steps(spec, n, permissive(), 4, grad);
    }
}

#[test]
fn bf16_residual_equals_the_unfused_definition() {
    for spec in ef_specs().into_iter().filter(fixed_rate) {
        for n in [0, 1, 63, 64, 65, 2048, 5000] {
            let o = FeedbackOptions {
                precision: ResidualPrecision::Bf16,
                ..permissive()
            };
            check_against_reference(&spec, n, o, 3);
        }
    }
}

/// Runs `steps` error-feedback steps of finite gradients (salted by `salt`) and asserts
/// that sum(decoded) + residual = sum(gradients) per element within a tolerance that adds,
/// each step, `2^-23 * (|g| + |D| + 2 |r'|)` (the f32 rounding of p = r + g and
/// r' = p - D) plus `2 * bf16_rel * |r'|` (the rounding of the stored residual).
fn check_sum(spec: CodecSpec, n: usize, steps: u64, salt: u32, precision: ResidualPrecision) {
    let bf16_rel = match precision {
        ResidualPrecision::F32 => 0.0,
        ResidualPrecision::Bf16 => 2f64.powi(-9),
    };
    let o = FeedbackOptions {
        precision,
        ..permissive()
    };
    let mut ef = ErrorFeedback::with_options(spec, n, o).unwrap();
    let (mut sent, mut total, mut tol) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
    for step in 0..steps {
        let g: Vec<f32> = sample(n, step as u32 + salt)
            .iter()
            .map(|v| v.clamp(-1e3, 1e3))
            .collect();
        let frame = ef.encode(&g, &EncodeCtx::new(step)).unwrap();
        let d = decode(&frame, n);
        let r = ef.residual_f32();
        for i in 0..n {
            sent[i] += d[i] as f64;
            total[i] += g[i] as f64;
            let (g, d, r) = (g[i].abs() as f64, d[i].abs() as f64, r[i].abs() as f64);
            tol[i] += (g + d + 2.0 * r) * 2f64.powi(-23) + 2.0 * r * bf16_rel;
        }
    }
    let r = ef.residual_f32();
    for i in 0..n {
        let lhs = sent[i] + r[i] as f64;
        assert!(
            (lhs - total[i]).abs() <= tol[i] + 1e-30,
            "{spec} ({precision:?} residual) element {i}: {lhs} vs {} (tolerance {})",
            total[i],
            tol[i]
        );
    }
}

#[test]
fn frames_plus_residual_equal_the_sum_of_gradients() {
    // With beta = gamma = 1 and finite inputs, after any number of steps
    // sum(decoded) + residual = sum(gradients), up to f32 rounding.
    for spec in ef_specs() {
        check_sum(spec, 1500, 20, 100, ResidualPrecision::F32);
    }
}

#[test]
fn bf16_residual_keeps_the_sum_within_bf16_rounding() {
    // Each step rounds the residual to bf16: |error| <= 2^-9 |r'| per step on top of the
    // f32 terms.
    for spec in ef_specs().into_iter().filter(fixed_rate) {
        check_sum(spec, 1000, 10, 7, ResidualPrecision::Bf16);
    }
}

#[test]
fn sign_residual_meets_the_mean_abs_identity() {
    // For a block p of d elements coded as ±mean|p|: ||p - D||^2 = ||p||^2 - ||p||_1^2 / d.
    let d = 64;
    let spec: CodecSpec = format!("sign:block={d}").parse().unwrap();
    let n = 10 * d + 17;
    let mut ef = ErrorFeedback::with_options(spec, n, permissive()).unwrap();
    let mut reference = Reference::new(n, ResidualPrecision::F32);
    let o = FeedbackOptions::default();
    for step in 0..4u64 {
        let g: Vec<f32> = sample(n, 50 + step as u32)
            .iter()
            .map(|v| v.clamp(-10.0, 10.0))
            .collect();
        let p: Vec<f32> = reference.r32.iter().zip(&g).map(|(r, g)| r + g).collect();
        let ctx = EncodeCtx::new(step);
        reference.step(&spec, &g, &o, &ctx);
        ef.encode(&g, &ctx).unwrap();
        let r = ef.residual_f32();
        for (pb, rb) in p.chunks(d).zip(r.chunks(d)) {
            let l2: f64 = pb.iter().map(|&v| (v as f64).powi(2)).sum();
            let l1: f64 = pb.iter().map(|&v| (v as f64).abs()).sum();
            let lhs: f64 = rb.iter().map(|&v| (v as f64).powi(2)).sum();
            let rhs = l2 - l1 * l1 / pb.len() as f64;
            // Rounding: each residual element is within 2^-23 of exact, so the sum of
            // squares moves by at most about 2^-21 * ||p||^2.
            assert!(
                (lhs - rhs).abs() <= l2 * 1e-6 + 1e-30,
                "step {step}: {lhs} vs {rhs}"
            );
        }
    }
}

#[test]
fn non_finite_inputs_stay_visible_and_never_reach_the_residual() {
    for spec in ef_specs() {
        let n = 300;
        let mut ef = ErrorFeedback::with_options(spec, n, permissive()).unwrap();
        let mut g = sample(n, 3);
        g[5] = f32::NAN;
        g[70] = f32::INFINITY;
        g[200] = f32::NEG_INFINITY;
        let frame = ef.encode(&g, &EncodeCtx::new(1)).unwrap();
        let (h, _) = gradpack::inspect(&frame).unwrap();
        assert!(
            h.flags & gradpack::wire::FLAG_NONFINITE != 0,
            "{spec}: flag not set"
        );
        let r = ef.residual_f32();
        assert!(
            r.iter().all(|v| v.is_finite()),
            "{spec}: residual holds NaN or Inf"
        );
        assert_eq!(r[5], 0.0, "{spec}");
        // The next finite step is clean again.
        let frame = ef.encode(&sample(n, 4), &EncodeCtx::new(2)).unwrap();
        let (h, _) = gradpack::inspect(&frame).unwrap();
        assert!(
            h.flags & gradpack::wire::FLAG_NONFINITE == 0,
            "{spec}: non-finite carried over"
        );
    }
}

#[test]
fn bad_arguments_are_errors_and_leave_the_state_alone() {
    let spec: CodecSpec = "sign".parse().unwrap();
    let mut ef = ErrorFeedback::with_options(spec, 10, permissive()).unwrap();
    ef.encode(&[0.25; 10], &EncodeCtx::new(0)).unwrap();
    let before = ef.residual_f32();
    assert!(before.iter().any(|&v| v != 0.0) || before.iter().all(|&v| v == 0.0));
    let mut buf = vec![0u8; 1024];
    let r = ef.encode_into(&[1.0; 11], &EncodeCtx::new(0), &mut buf);
    assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
    let r = ef.encode_into(
        &[1.0; 10],
        &EncodeCtx::new(0),
        &mut buf[..gradpack::HEADER_LEN],
    );
    assert!(matches!(r, Err(Error::BufferTooSmall { .. })), "{r:?}");
    let r = ef.encode_into(
        &[1.0; 10],
        &EncodeCtx::new(0).with_offset(u64::MAX - 3),
        &mut buf,
    );
    assert!(matches!(r, Err(Error::Param { .. })), "{r:?}");
    assert_eq!(ef.residual_f32(), before);

    for (spec, o) in [
        (
            "sign",
            FeedbackOptions {
                beta: f32::NAN,
                ..Default::default()
            },
        ),
        (
            "sign",
            FeedbackOptions {
                gamma: f32::INFINITY,
                ..Default::default()
            },
        ),
        (
            "topk:ratio=0.1",
            FeedbackOptions {
                precision: ResidualPrecision::Bf16,
                ..Default::default()
            },
        ),
        ("randk:ratio=0.1,scale=unbiased", FeedbackOptions::default()),
        ("qsgd", FeedbackOptions::default()),
        ("qsgd:bits=2,block=4", FeedbackOptions::default()),
        ("qsgd:bits=4,block=49", FeedbackOptions::default()),
        ("qsgd:bits=8,block=16129", FeedbackOptions::default()),
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        let r = ErrorFeedback::with_options(spec, 10, o);
        assert!(matches!(r, Err(Error::Param { .. })), "{spec}: {r:?}");
        // ... unless non-contractive codecs are asked for (the bf16 / top-k and
        // non-finite weight refusals stay).
        if o.beta.is_finite() && o.gamma.is_finite() && o.precision == ResidualPrecision::F32 {
            let o = FeedbackOptions {
                allow_non_contractive: true,
                ..o
            };
            assert!(ErrorFeedback::with_options(spec, 10, o).is_ok(), "{spec}");
        }
    }
    // The contractive side of the QSGD line.
    for spec in ["qsgd:bits=4,block=48", "qsgd:bits=8,block=16128"] {
        let spec: CodecSpec = spec.parse().unwrap();
        assert!(ErrorFeedback::new(spec, 10).is_ok(), "{spec}");
    }

    ef.reset();
    assert!(ef.residual_f32().iter().all(|&v| v == 0.0));
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

#[test]
fn any_thread_count_gives_identical_frames_decodes_and_residuals() {
    // Parallel from the smallest size on, so that every tensor here is split.
    gradpack::parallel::set_min_len(0);
    let n = 3 * gradpack::parallel::CHUNK + 1234;
    let mut specs = ef_specs();
    for s in [
        "randk:ratio=0.3,values=fp16,scale=unbiased",
        "randk:ratio=0.01,values=bf16",
        "randk:ratio=0.01,select=strata",
        "randk:ratio=0.3,values=fp16,scale=unbiased,select=strata",
        // Top-k with enough kept elements to be written, and its residual updated, in
        // parts on several threads.
        "topk:ratio=0.3,values=int8,index=rice",
        "topk:ratio=0.1,values=bf16,select=approx",
        "topk:ratio=0.05,index=gaps",
    ] {
        specs.push(s.parse().unwrap());
    }
    for spec in specs {
        let g = sample(n, 9);
        let ctx = EncodeCtx::new(5).with_offset(77);
        let run = |threads: usize| {
            pool(threads).install(|| {
                let frame = spec.encode(&g, &ctx).unwrap();
                let d = decode(&frame, n);
                let mut acc = vec![0.5f32; n];
                gradpack::decode_add(&frame, &mut acc).unwrap();
                let ef = ErrorFeedback::with_options(spec, n, permissive())
                    .ok()
                    .map(|mut ef| {
                        let f1 = ef.encode(&g, &ctx).unwrap();
                        let f2 = ef.encode(&sample(n, 10), &ctx.with_offset(0)).unwrap();
                        (
                            f1,
                            f2,
                            ef.residual_f32()
                                .iter()
                                .map(|v| v.to_bits())
                                .collect::<Vec<_>>(),
                        )
                    });
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                (frame, bits(&d), bits(&acc), ef)
            })
        };
        let one = run(1);
        for threads in [2, 3, 4] {
            assert!(
                run(threads) == one,
                "{spec}: {threads} threads differ from one"
            );
        }
    }
}

#[test]
fn top_k_frames_do_not_depend_on_threads_or_where_the_large_values_sit() {
    // Split from the smallest size on: 4 pieces of 64 Ki here, each with an equal share
    // of the candidate room. Large values crowded into one piece overflow its share;
    // ties beyond the room send the encode to the multi-pass engine. Every route and
    // thread count must write the frame the multi-pass engine writes.
    gradpack::parallel::set_min_len(0);
    let n = 3 * gradpack::parallel::CHUNK + 1234;
    let base = sample(n, 31);
    let mut inputs: Vec<(&str, Vec<f32>)> = vec![("sample", base.clone())];
    let mut crowded = base.clone();
    for v in &mut crowded[70_000..90_000] {
        *v *= 1000.0;
    }
    inputs.push(("crowded in one piece", crowded));
    let mut last = base.clone();
    for v in &mut last[n - 3000..] {
        *v *= 1000.0;
    }
    inputs.push(("crowded at the end", last));
    let mut ties = base.clone();
    for v in ties.iter_mut().step_by(7) {
        *v = 0.75;
    }
    inputs.push(("ties", ties));
    inputs.push(("all equal", vec![-0.5; n]));
    let mut nonfinite = base.clone();
    nonfinite[5] = f32::NAN;
    nonfinite[n - 1] = f32::NEG_INFINITY;
    inputs.push(("non-finite", nonfinite));
    inputs.push(("zeros", vec![0.0; n]));
    for spec in [
        "topk:ratio=0.01,values=fp16",
        "topk:ratio=0.01,values=fp16,select=approx",
        "topk:ratio=0.05,values=int8,select=approx,tolerance=0.1",
        "topk:k=3,values=f32",
        "topk:ratio=0.3,values=bf16,index=bitmap",
        "topk:ratio=0.002,index=gaps",
        // Enough kept elements to be written in parts on several threads.
        "topk:ratio=0.3,values=int8,index=rice",
        "topk:ratio=0.2,values=fp16,index=gaps,select=approx",
        "topk:ratio=0.1",
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        for (name, x) in &inputs {
            let ctx = EncodeCtx::new(3);
            let len = pool(1).install(|| spec.encode(x, &ctx).unwrap().len());
            // A buffer that fits only the frame: no working room, the multi-pass engine.
            let mut reference = vec![0u8; len];
            let multi = spec.encode_into(x, &ctx, &mut reference).unwrap();
            assert_eq!(multi, len, "{spec} {name}");
            for threads in [1, 2, 3, 4] {
                let frame = pool(threads).install(|| spec.encode(x, &ctx).unwrap());
                assert!(
                    frame == reference,
                    "{spec} {name}: {threads} threads differ from the multi-pass engine"
                );
            }
            // Error feedback: top-k forms `beta r + gamma g` inside its filter pass, on
            // one thread or in parallel pieces, and updates the residual from its kept
            // candidates (in parallel parts where they are many). Every thread count
            // must match the unfused definition, step after step.
            let o = FeedbackOptions {
                beta: 0.9,
                gamma: -0.37,
                ..permissive()
            };
            for threads in [1, 2, 3] {
                let mut ef = ErrorFeedback::with_options(spec, n, o).unwrap();
                let mut unfused = Reference::new(n, ResidualPrecision::F32);
                for step in 0..2 {
                    let want = unfused.step(&spec, x, &o, &ctx);
                    let got = pool(threads).install(|| ef.encode(x, &ctx).unwrap());
                    assert!(
                        got == want && unfused.matches(&ef),
                        "{spec} {name}: error feedback on {threads} threads, step {step}"
                    );
                }
            }
        }
    }
}

#[test]
fn chunked_encoding_decodes_like_whole_encoding() {
    // Block-aligned chunks, each encoded as its own frame with its global offset, decode to
    // the same values as the whole tensor (top-k excepted: it selects within each frame;
    // and the codecs with a scale per frame).
    let n = 4000;
    let x = sample(n, 21);
    for spec in ef_specs()
        .into_iter()
        .filter(|s| !matches!(s, CodecSpec::TopK(_)) && !scaled_per_frame(s))
    {
        let ctx = EncodeCtx::new(99).with_offset(1 << 20);
        let whole = decode(&spec.encode(&x, &ctx).unwrap(), n);
        let chunk = block_of(&spec) * 7;
        let mut parts = Vec::with_capacity(n);
        for (i, xc) in x.chunks(chunk).enumerate() {
            let c = ctx.with_offset(ctx.offset + (i * chunk) as u64);
            parts.extend(decode(&spec.encode(xc, &c).unwrap(), xc.len()));
        }
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&whole) == bits(&parts),
            "{spec}: chunked decode differs"
        );
    }
}

#[test]
fn zero_length_and_state_accessors() {
    let spec: CodecSpec = "int8".parse().unwrap();
    let mut ef = ErrorFeedback::with_options(spec, 0, permissive()).unwrap();
    assert!(ef.is_empty());
    let f = ef.encode(&[], &EncodeCtx::new(0)).unwrap();
    assert_eq!(decode(&f, 0).len(), 0);
    let ef = ErrorFeedback::with_options(spec, 1000, permissive()).unwrap();
    assert_eq!(ef.len(), 1000);
    assert_eq!(ef.memory_bytes(), 4000);
    assert_eq!(ef.codec(), spec);
    assert_eq!(ef.max_encoded_len(), spec.max_encoded_len(1000));
    // A bf16 residual of 1 Mi elements: 2 bytes each plus one 2048-float tile per
    // 64 Ki-element range (1/32 of an f32 per element).
    let n = 1 << 20;
    let o = FeedbackOptions {
        precision: ResidualPrecision::Bf16,
        ..permissive()
    };
    let ef = ErrorFeedback::with_options(spec, n, o).unwrap();
    assert_eq!(ef.memory_bytes(), 2 * n + 4 * n / 32);
}

#[test]
fn a_residual_moved_through_set_residual_continues_identically() {
    // Two states of one codec: the second gets the first's residual and must then encode
    // every later step to the same frames, for f32 and bf16 residuals.
    for precision in [ResidualPrecision::F32, ResidualPrecision::Bf16] {
        let spec: CodecSpec = "int8".parse().unwrap();
        let o = FeedbackOptions {
            precision,
            ..FeedbackOptions::default()
        };
        let n = 1000;
        let mut a = ErrorFeedback::with_options(spec, n, o).unwrap();
        let mut b = ErrorFeedback::with_options(spec, n, o).unwrap();
        for step in 0..3 {
            a.encode(&grad(n, step), &EncodeCtx::new(step as u64))
                .unwrap();
        }
        assert!(a.residual_f32().iter().any(|&v| v != 0.0));
        b.set_residual(&a.residual_f32()).unwrap();
        assert_eq!(
            a.residual_f32()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>(),
            b.residual_f32()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
        for step in 3..6 {
            let ctx = EncodeCtx::new(step as u64);
            assert_eq!(
                a.encode(&grad(n, step), &ctx).unwrap(),
                b.encode(&grad(n, step), &ctx).unwrap()
            );
        }
        // A wrong length is refused and changes nothing.
        let before = b.residual_f32();
        let r = b.set_residual(&[1.0; 999]);
        assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
        assert_eq!(before, b.residual_f32());
    }
}

fn grad(n: usize, step: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32) * 0.37 + step as f32).sin() * 0.01)
        .collect()
}
