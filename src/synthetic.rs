//! A built-in synthetic gradient for examples, benchmarks and the report.
//!
//! Real gradients are roughly Gaussian within a layer, heavy-tailed overall, differ in
//! scale by orders of magnitude between layers, and hold some exact zeros (dead ReLU
//! units, unused embeddings). [`gradient`] imitates that, deterministically from a seed:
//!
//! - the tensor is cut into "layers" of 4096 elements, each with a scale `2^-s`,
//!   `s` drawn uniformly from 4..=14;
//! - each element is a Student-t variate with 3 degrees of freedom (Gaussian numerator
//!   over the root of a chi-square / 3, from Box-Muller normals) times the layer scale;
//! - 2% of elements are exactly zero.
//!
//! Draws come from the crate's counter-based hash, so the same `(n, seed)` gives the same
//! vector on every platform up to the last bit of `f64::ln`/`sqrt`/`cos` (used in f64 and
//! rounded to f32 once).

/// A synthetic gradient of `n` elements (see the module docs).
pub fn gradient(n: usize, seed: u64) -> Vec<f32> {
    let mut x = vec![0f32; n];
    crate::sample::gradient_into(&mut x, seed);
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::LAYER;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "Miri perturbs ln/cos results on each call, and 300k elements are slow"
    )]
    fn deterministic_heavy_tailed_and_sparse() {
        let g = gradient(100_000, 1);
        assert_eq!(g, gradient(100_000, 1));
        assert_ne!(g, gradient(100_000, 2));
        let zeros = g.iter().filter(|v| **v == 0.0).count();
        assert!((1500..2500).contains(&zeros), "zeros {zeros}");
        assert!(g.iter().all(|v| v.is_finite()));
        // Heavy tails: excess kurtosis of a t(3) sample is large (a Gaussian's is 0).
        let layer = &g[0..LAYER];
        let m = layer.iter().map(|&v| v as f64).sum::<f64>() / LAYER as f64;
        let var = layer.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / LAYER as f64;
        let k4 = layer.iter().map(|&v| (v as f64 - m).powi(4)).sum::<f64>() / LAYER as f64;
        assert!(
            k4 / (var * var) - 3.0 > 1.0,
            "kurtosis {}",
            k4 / (var * var)
        );
    }
}

/// The 161 parameter tensors of ResNet-50 (He et al. 2016, as torchvision builds it:
/// 25,557,032 parameters) with their names and shapes, in the order their gradients
/// become ready in the backward pass (the classifier first, the stem last): a
/// model-sized workload for the sync engine.
pub fn resnet50() -> Vec<crate::sync::Tensor> {
    use crate::sync::Tensor;
    let mut t: Vec<Tensor> = Vec::with_capacity(161);
    let bn = |t: &mut Vec<Tensor>, name: &str, c: usize| {
        t.push(Tensor::new(format!("{name}.weight"), &[c]));
        t.push(Tensor::new(format!("{name}.bias"), &[c]));
    };
    // Forward order first.
    t.push(Tensor::new("conv1.weight", &[64, 3, 7, 7]));
    bn(&mut t, "bn1", 64);
    let mut inplanes = 64;
    for (layer, (planes, blocks)) in [(64, 3), (128, 4), (256, 6), (512, 3)]
        .into_iter()
        .enumerate()
    {
        for b in 0..blocks {
            let p = format!("layer{}.{b}", layer + 1);
            t.push(Tensor::new(
                format!("{p}.conv1.weight"),
                &[planes, inplanes, 1, 1],
            ));
            bn(&mut t, &format!("{p}.bn1"), planes);
            t.push(Tensor::new(
                format!("{p}.conv2.weight"),
                &[planes, planes, 3, 3],
            ));
            bn(&mut t, &format!("{p}.bn2"), planes);
            t.push(Tensor::new(
                format!("{p}.conv3.weight"),
                &[planes * 4, planes, 1, 1],
            ));
            bn(&mut t, &format!("{p}.bn3"), planes * 4);
            if b == 0 {
                t.push(Tensor::new(
                    format!("{p}.downsample.0.weight"),
                    &[planes * 4, inplanes, 1, 1],
                ));
                bn(&mut t, &format!("{p}.downsample.1"), planes * 4);
            }
            inplanes = planes * 4;
        }
    }
    t.push(Tensor::new("fc.weight", &[1000, 2048]));
    t.push(Tensor::new("fc.bias", &[1000]));
    t.reverse();
    t
}

#[cfg(test)]
mod resnet_tests {
    #[test]
    fn resnet50_has_its_161_tensors_and_25_6_m_parameters() {
        let l = super::resnet50();
        assert_eq!(l.len(), 161);
        let n: usize = l.iter().map(|t| t.len().unwrap()).sum();
        assert_eq!(n, 25_557_032);
        assert_eq!(l[0].name, "fc.bias");
        assert_eq!(l[160].name, "conv1.weight");
    }
}
