//! Momentum correction for a front end that reduces in buckets of its own.
//!
//! Deep gradient compression's momentum correction keeps a velocity per tensor on every
//! rank, `u = momentum * u + g` in f32, and sends `u` in place of the gradient: what a
//! lossy codec delays or drops is then not also missing from the optimizer's momentum.
//! The optimizer is given no momentum of its own; with float32 the reduced velocities
//! are momentum SGD's update (`dampening = 0`, not Nesterov).
//!
//! [`super::SyncEngine`] keeps its velocities by tensor index
//! ([`super::SyncOptions::momentum`]). [`Momentum`] keeps them by tensor name, for a
//! framework that regroups its buckets between steps (DDP does after the first): each
//! tensor's velocity follows it into whichever bucket it comes in. Both update with
//! [`momentum_step`], so their rounding is the same.

use std::collections::HashMap;

use crate::error::{Error, Result};

use super::Tensor;
use super::plan::laid_end_to_end;

/// One momentum-correction step: `u = m * u + g` (a product and a sum, each rounded to
/// f32, never fused), and `g` replaced by `u`. The slices have the same length.
pub(crate) fn momentum_step(m: f32, u: &mut [f32], g: &mut [f32]) {
    debug_assert_eq!(u.len(), g.len());
    crate::kernels::Standard::run(|| {
        for (u, g) in u.iter_mut().zip(g) {
            *u = m * *u + *g;
            *g = *u;
        }
    });
}

/// A velocity per tensor name (see the module docs).
#[derive(Clone, Debug)]
pub struct Momentum {
    momentum: f32,
    velocity: HashMap<String, Vec<f32>>,
}

impl Momentum {
    /// Momentum correction with coefficient `momentum`, in `[0, 1)`.
    pub fn new(momentum: f32) -> Result<Momentum> {
        if !(0.0..1.0).contains(&momentum) {
            return Err(Error::Collective(format!(
                "momentum must be in [0, 1), not {momentum}"
            )));
        }
        Ok(Momentum {
            momentum,
            velocity: HashMap::new(),
        })
    }

    /// The coefficient.
    pub fn momentum(&self) -> f32 {
        self.momentum
    }

    /// Apply one step to a bucket: `bucket` holds the gradients of `tensors` laid end to
    /// end, and each is replaced by its tensor's new velocity (a tensor seen for the
    /// first time starts from zero). A bucket its tensors do not fill exactly, or a
    /// velocity of another length than its tensor, is an error and nothing changes.
    pub fn apply(&mut self, tensors: &[Tensor], bucket: &mut [f32]) -> Result<()> {
        let ranges = laid_end_to_end(tensors, bucket.len())?;
        for (t, r) in tensors.iter().zip(&ranges) {
            if let Some(u) = self.velocity.get(&t.name)
                && u.len() != r.len()
            {
                return Err(Error::Collective(format!(
                    "the velocity of {:?} has {} elements, the tensor {}",
                    t.name,
                    u.len(),
                    r.len()
                )));
            }
        }
        // Every new velocity allocated before any is changed.
        let mut new = Vec::new();
        for (t, r) in tensors.iter().zip(&ranges) {
            if !self.velocity.contains_key(&t.name) {
                new.push((
                    t.name.clone(),
                    crate::alloc::filled(r.len(), 0.0, "a velocity")?,
                ));
            }
        }
        self.velocity.extend(new);
        for (t, r) in tensors.iter().zip(ranges) {
            let u = self.velocity.get_mut(&t.name).expect("made above");
            momentum_step(self.momentum, u, &mut bucket[r]);
        }
        Ok(())
    }

    /// Every velocity by name (copies), sorted by name.
    pub fn velocities(&self) -> Vec<(String, Vec<f32>)> {
        let mut out: Vec<(String, Vec<f32>)> = self
            .velocity
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Replace every velocity with `velocities` (by name; each checked against its
    /// tensor's length when it next comes).
    pub fn restore(&mut self, velocities: Vec<(String, Vec<f32>)>) {
        self.velocity = velocities.into_iter().collect();
    }
}
