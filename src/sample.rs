//! Deterministic samples drawn from the crate's counter-based hash: uniforms, normals,
//! and the gradient-like vectors that [`crate::synthetic::gradient`] describes. The sync
//! engine's planner calibrates codecs on them, the demo's task and data are made from
//! them, and tests use them; none of these depend on each other through this module.

use crate::rng::{STREAM_ROUNDING, draw};

/// The elements of one "layer" of a gradient-like sample (one scale each).
pub(crate) const LAYER: usize = 4096;

/// A 32-bit uniform in (0, 1) for index `i` of stream `k` of `seed`: never exactly 0, so
/// `ln()` is finite.
pub(crate) fn unit(seed: u64, i: u64, k: u64) -> f64 {
    (draw(
        seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        STREAM_ROUNDING,
        i,
    ) as f64
        + 0.5)
        / 4_294_967_296.0
}

/// A standard normal (Box-Muller over streams `2k` and `2k + 1`) for index `i`.
pub(crate) fn normal(seed: u64, i: u64, k: u64) -> f64 {
    let (u1, u2) = (unit(seed, i, 2 * k), unit(seed, i, 2 * k + 1));
    (-2.0 * u1.ln()).sqrt() * (core::f64::consts::TAU * u2).cos()
}

/// Fill `x` with the gradient-like sample of `seed` (element `i` of `x` is element `i`
/// of `crate::synthetic::gradient(n, seed)` for any `n > i`).
pub(crate) fn gradient_into(x: &mut [f32], seed: u64) {
    for (i, v) in x.iter_mut().enumerate() {
        let i = i as u64;
        let layer = i / LAYER as u64;
        let s = 4 + (unit(seed, layer, 100) * 11.0) as i32;
        *v = if unit(seed, i, 101) < 0.02 {
            0.0
        } else {
            let z = normal(seed, i, 0);
            let chi2 = (1..=3).map(|k| normal(seed, i, k).powi(2)).sum::<f64>();
            let t = z / (chi2 / 3.0).sqrt();
            (t * 2f64.powi(-s)) as f32
        };
    }
}
