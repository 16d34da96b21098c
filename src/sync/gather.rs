//! The all-gather of a framework's bucket, each tensor with its own codec and its error
//! feedback kept by tensor name.
//!
//! [`TensorGather`] encodes every tensor of a bucket with its codec (through its
//! residual where error feedback is on), all-gathers the message with one
//! [`BucketGather`] call and writes each tensor's mean over the ranks back. The
//! residuals are kept by tensor name, so a framework that regroups its buckets (DDP does
//! after the first step) keeps each tensor's residual; [`TensorGather::residuals`] and
//! [`TensorGather::restore`] save and load them by name.

use std::collections::{HashMap, HashSet};

use crate::codec::CodecSpec;
use crate::collective::{BucketGather, Comm, Part, Stats, Transport, tensor_seed};
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;

use super::plan::laid_end_to_end;
use super::{HeldTensor, wants_feedback};

/// A bucket's all-gather with residuals by tensor name (see the module docs).
#[derive(Default)]
pub struct TensorGather {
    feedback: Option<bool>,
    residuals: HashMap<String, ErrorFeedback>,
    /// Residuals loaded by name and not yet taken up.
    parked: HashMap<String, Vec<f32>>,
}

impl TensorGather {
    /// Residuals kept by name; error feedback as [`wants_feedback`] says with `choice`.
    pub fn new(choice: Option<bool>) -> TensorGather {
        TensorGather {
            feedback: choice,
            ..TensorGather::default()
        }
    }

    /// Reduce a bucket: `x` holds `tensors` laid end to end, each with the codec it goes
    /// with (`None`: left as it is, for a caller that reduces it otherwise). Each is
    /// encoded through its residual where [`wants_feedback`] says so (a tensor whose
    /// codec or length changed starts a new one, from a restored residual of its name if
    /// there is one), with a seed from `seed`, `step`, the tensor's key and this rank;
    /// the frames go as one message by `gather` over `comm` (`send`: the caller's
    /// buffer, kept between calls), sealed with a payload CRC-32 when `checksum`, and
    /// each tensor's mean over the ranks is written back into `x`. Every rank passes the
    /// same tensors and codecs. A bucket its tensors do not fill, or a restored residual
    /// of another length than its tensor, is refused before anything changes.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce<T: Transport + ?Sized>(
        &mut self,
        gather: &mut BucketGather,
        comm: &mut Comm<T>,
        send: &mut Vec<u8>,
        x: &mut [f32],
        tensors: &[(HeldTensor, Option<CodecSpec>)],
        seed: u64,
        step: u64,
        checksum: bool,
    ) -> Result<Stats> {
        // Each sent tensor's range and codec, and whether its residual is new.
        let mut sent = Vec::new();
        let mut with_feedback = HashSet::new();
        let ranges = laid_end_to_end(tensors.iter().map(|(h, _)| &h.tensor), x.len())?;
        for ((h, codec), range) in tensors.iter().zip(ranges) {
            let n = range.len();
            if let Some(c) = codec {
                let name = &h.tensor.name;
                let ef = wants_feedback(c, self.feedback);
                if ef && !with_feedback.insert(name.as_str()) {
                    return Err(Error::Collective(format!("{name:?} twice in one bucket")));
                }
                let fresh = ef
                    && !self
                        .residuals
                        .get(name)
                        .is_some_and(|f| f.len() == n && f.codec() == *c);
                if fresh
                    && let Some(r) = self.parked.get(name)
                    && r.len() != n
                {
                    return Err(Error::Collective(format!(
                        "the restored residual of {name:?} has {} elements, the tensor {n}",
                        r.len()
                    )));
                }
                sent.push((h, range, *c, ef, fresh));
            }
        }
        // New residuals, each from its restored one if any.
        let mut made = Vec::new();
        for (h, r, c, _, fresh) in &sent {
            if *fresh {
                let mut ef = ErrorFeedback::new(*c, r.len())?;
                if let Some(saved) = self.parked.get(&h.tensor.name) {
                    ef.set_residual(saved)?;
                }
                made.push((h.tensor.name.clone(), ef));
            }
        }
        for (name, ef) in made {
            self.parked.remove(&name);
            self.residuals.insert(name, ef);
        }
        let rank = gather.rank();
        // Each tensor's residual, borrowed once (no name is twice among them).
        let mut fbs: HashMap<&str, &mut ErrorFeedback> = self
            .residuals
            .iter_mut()
            .filter(|(k, _)| with_feedback.contains(k.as_str()))
            .map(|(k, v)| (k.as_str(), v))
            .collect();
        let mut parts = Vec::with_capacity(sent.len());
        for (h, range, codec, ef, _) in &sent {
            let feedback = if *ef {
                let f = fbs.remove(h.tensor.name.as_str());
                debug_assert!(f.is_some(), "every residual made above");
                f
            } else {
                None
            };
            parts.push(Part {
                range: range.clone(),
                codec: *codec,
                seed: tensor_seed(codec, seed, step, h.key, rank),
                feedback,
            });
        }
        gather.encode_run(comm, x, &mut parts, checksum, send)
    }

    /// Every residual by name (copies): those in use and those restored and not yet
    /// taken up, sorted by name.
    pub fn residuals(&self) -> Vec<(String, Vec<f32>)> {
        let mut out: Vec<(String, Vec<f32>)> = self
            .parked
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(
                self.residuals
                    .iter()
                    .map(|(k, f)| (k.clone(), f.residual_f32())),
            )
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Replace every residual with `residuals` (by name; each taken up, and checked
    /// against its tensor's length, when its tensor next goes with error feedback).
    pub fn restore(&mut self, residuals: Vec<(String, Vec<f32>)>) {
        self.residuals.clear();
        self.parked = residuals.into_iter().collect();
    }
}
