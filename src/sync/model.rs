//! One top-k over a whole model, for a front end that reduces in buckets of its own.
//!
//! A data-parallel framework hands its gradients over in buckets it forms itself (DDP
//! regroups them after the first step). [`ModelSelection`] takes a step's buckets
//! together and sends every compressed tensor of them, in the model's parameter order,
//! as one vector encoded by one top-k (with its error feedback over that vector when
//! on), so the largest entries are chosen over the model rather than per tensor or per
//! bucket; tensors the per-tensor policy keeps in float32 go beside it as float32
//! frames. One [`BucketGather`] call moves the message, and each part's mean over the
//! ranks is written back into its bucket. Neither the framework's bucketing nor the
//! order its buckets arrive in changes what is selected or the result.
//!
//! The error feedback's residual is kept per tensor name: when the set of compressed
//! tensors changes (a regrouping, a frozen layer), each tensor's part moves to the new
//! vector, and [`ModelSelection::residuals`] / [`ModelSelection::restore`] save and load
//! them by name.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use crate::codec::CodecSpec;
use crate::collective::{BucketGather, Comm, Part, Stats, Transport, tensor_seed};
use crate::error::{Error, Result};
use crate::feedback::ErrorFeedback;

use super::plan::laid_end_to_end;
use super::{Tensor, tensor_codec};

/// The seed key of the model-wide frame, the bytes of "model" (each float32 frame uses
/// its tensor's own).
pub const MODEL_KEY: u64 = 0x006D_6F64_656C;

/// One tensor of a held bucket: its name and shape (its place in the model and its
/// codec follow from them) and the seed key of its frame when it goes as float32.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldTensor {
    /// The tensor's name and shape.
    pub tensor: Tensor,
    /// The key its float32 frame's seed is derived from (see
    /// [`crate::collective::tensor_seed`]).
    pub key: u64,
}

/// The one error feedback over the compressed tensors `names` (of `sizes` elements)
/// laid end to end.
struct Feedback {
    names: Vec<String>,
    sizes: Vec<usize>,
    ef: ErrorFeedback,
}

/// One top-k over every compressed tensor of a step's buckets (see the module docs).
pub struct ModelSelection {
    codec: CodecSpec,
    feedback: bool,
    small_below: usize,
    dct_2d: bool,
    /// Each named tensor's place in the model.
    positions: HashMap<String, usize>,
    current: Option<Feedback>,
    /// Residuals by name not in `current`: loaded, or left by an earlier set of tensors.
    parked: HashMap<String, Vec<f32>>,
    /// The step's vector (compressed tensors, then the float32 ones), kept between steps.
    whole: Vec<f32>,
}

impl ModelSelection {
    /// A selection with `codec` (a `topk` codec), with error feedback when `feedback`,
    /// over a model whose tensors are named `order` in the model's order (a name not
    /// among them goes after every named one, in the order it arrives). `small_below`
    /// and `dct_2d` are the per-tensor policy of [`tensor_codec`]: the tensors it keeps
    /// in float32 go as float32 frames.
    pub fn new(
        codec: CodecSpec,
        feedback: bool,
        small_below: usize,
        dct_2d: bool,
        order: &[String],
    ) -> Result<ModelSelection> {
        if !matches!(codec, CodecSpec::TopK(_)) {
            return Err(Error::Collective(format!(
                "one selection over the model needs a topk codec, not {codec}"
            )));
        }
        let mut positions = HashMap::with_capacity(order.len());
        for name in order {
            let at = positions.len();
            positions.entry(name.clone()).or_insert(at);
        }
        Ok(ModelSelection {
            codec,
            feedback,
            small_below,
            dct_2d,
            positions,
            current: None,
            parked: HashMap::new(),
            whole: Vec::new(),
        })
    }

    /// The codec of the model-wide vector.
    pub fn codec(&self) -> CodecSpec {
        self.codec
    }

    /// Reduce a step's `buckets` (each a flat bucket and its tensors, laid end to end)
    /// together: every rank passes its buckets of the same step, with the same tensors,
    /// in any grouping and order (each rank's own: the vector is formed in the model's
    /// order). The message goes by `gather` over `comm` (`send`: the caller's buffer
    /// for it, kept between calls) with seeds from `seed`, `step` and this rank, sealed
    /// with a payload CRC-32 when `checksum`; each bucket then holds its mean over the
    /// ranks. A bucket whose tensors do not add up to its length, or a restored residual
    /// of another length than its tensor, is refused before anything changes. After a
    /// failure of the call itself the buckets and the residual are unspecified.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce<T: Transport + ?Sized>(
        &mut self,
        gather: &mut BucketGather,
        comm: &mut Comm<T>,
        send: &mut Vec<u8>,
        buckets: &mut [(&mut [f32], &[HeldTensor])],
        seed: u64,
        step: u64,
        checksum: bool,
    ) -> Result<Stats> {
        // Each tensor: (its place in the model, bucket, range in it, key, compressed).
        let mut comp = Vec::new();
        let mut plain = Vec::new();
        for (b, (data, tensors)) in buckets.iter().enumerate() {
            let ranges = laid_end_to_end(tensors.iter().map(|h| &h.tensor), data.len())
                .map_err(|e| Error::Collective(format!("bucket {b}: {e}")))?;
            for (t, (h, range)) in tensors.iter().zip(ranges).enumerate() {
                let c = tensor_codec(&self.codec, &h.tensor, self.small_below, self.dct_2d)?;
                let pos = self
                    .positions
                    .get(&h.tensor.name)
                    .copied()
                    .unwrap_or(self.positions.len());
                let entry = (pos, b, t, range);
                if matches!(c, CodecSpec::Identity(_)) {
                    plain.push(entry);
                } else {
                    comp.push(entry);
                }
            }
        }
        // Both in the model's order (stable: tensors of no known name keep the order
        // they came in), so the message is the same whatever the grouping.
        comp.sort_by_key(|e| e.0);
        plain.sort_by_key(|e| e.0);
        let name = |e: &(usize, usize, usize, Range<usize>)| &buckets[e.1].1[e.2].tensor.name;
        let names: Vec<String> = comp.iter().map(|e| name(e).clone()).collect();
        let sizes: Vec<usize> = comp.iter().map(|e| e.3.len()).collect();
        let total: usize = sizes.iter().sum();
        if total > 0 && self.feedback {
            self.feedback_for(names, sizes, total)?;
        }
        let n = total + plain.iter().map(|e| e.3.len()).sum::<usize>();
        crate::alloc::lengthen(&mut self.whole, n, "the model's vector")?;
        let whole = &mut self.whole[..n];
        let mut at = 0;
        for e in comp.iter().chain(&plain) {
            let m = e.3.len();
            whole[at..at + m].copy_from_slice(&buckets[e.1].0[e.3.clone()]);
            at += m;
        }
        let rank = gather.rank();
        let mut parts = Vec::with_capacity(1 + plain.len());
        if total > 0 {
            parts.push(Part {
                range: 0..total,
                codec: self.codec,
                seed: tensor_seed(&self.codec, seed, step, MODEL_KEY, rank),
                feedback: self.current.as_mut().map(|f| &mut f.ef),
            });
        }
        let mut at = total;
        let identity = CodecSpec::Identity(crate::codecs::Identity);
        for e in &plain {
            let key = buckets[e.1].1[e.2].key;
            let m = e.3.len();
            parts.push(Part {
                range: at..at + m,
                codec: identity,
                seed: tensor_seed(&identity, seed, step, key, rank),
                feedback: None,
            });
            at += m;
        }
        let stats = gather.encode_run(comm, whole, &mut parts, checksum, send)?;
        let mut at = 0;
        for e in comp.iter().chain(&plain) {
            let m = e.3.len();
            buckets[e.1].0[e.3.clone()].copy_from_slice(&whole[at..at + m]);
            at += m;
        }
        Ok(stats)
    }

    /// The error feedback over `names` (of `sizes` elements, `total` in all) in
    /// `current`: kept when they are the same, else made anew with each tensor's
    /// residual moved from where it was (checked first, so a refusal changes nothing).
    fn feedback_for(&mut self, names: Vec<String>, sizes: Vec<usize>, total: usize) -> Result<()> {
        if let Some(f) = &self.current
            && f.names == names
            && f.sizes == sizes
        {
            return Ok(());
        }
        // Where each name's residual is now: in the current vector, or parked.
        let mut held: HashMap<&str, &[f32]> = HashMap::new();
        let now = self.current.as_ref().map(|f| (f, f.ef.residual_f32()));
        if let Some((f, r)) = &now {
            let mut at = 0;
            for (name, &m) in f.names.iter().zip(&f.sizes) {
                held.insert(name, &r[at..at + m]);
                at += m;
            }
        }
        for (name, r) in &self.parked {
            held.entry(name).or_insert(r);
        }
        for (name, &m) in names.iter().zip(&sizes) {
            if let Some(r) = held.get(name.as_str())
                && r.len() != m
            {
                return Err(Error::Collective(format!(
                    "the residual of {name:?} has {} elements, the tensor {m}",
                    r.len()
                )));
            }
        }
        let mut ef = ErrorFeedback::new(self.codec, total)?;
        if names.iter().any(|n| held.contains_key(n.as_str())) {
            let mut r = crate::alloc::filled(total, 0.0f32, "the model's residual")?;
            let mut at = 0;
            for (name, &m) in names.iter().zip(&sizes) {
                if let Some(v) = held.get(name.as_str()) {
                    r[at..at + m].copy_from_slice(v);
                }
                at += m;
            }
            ef.set_residual(&r)?;
        }
        // Every residual not in the new vector stays parked by name.
        let taken: HashSet<&str> = names.iter().map(String::as_str).collect();
        let parked = held
            .into_iter()
            .filter(|(k, _)| !taken.contains(k))
            .map(|(k, v)| (k.to_string(), v.to_vec()))
            .collect();
        self.parked = parked;
        self.current = Some(Feedback { names, sizes, ef });
        Ok(())
    }

    /// Every tensor's residual by name (copies): those of the current vector and those
    /// parked or restored (never the same name: a name taken into the vector leaves the
    /// parked ones), sorted by name.
    pub fn residuals(&self) -> Vec<(String, Vec<f32>)> {
        let mut out: Vec<(String, Vec<f32>)> = self
            .parked
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if let Some(f) = &self.current {
            let r = f.ef.residual_f32();
            let mut at = 0;
            for (name, &m) in f.names.iter().zip(&f.sizes) {
                out.push((name.clone(), r[at..at + m].to_vec()));
                at += m;
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Replace every residual with `residuals` (by name; each taken up when its tensor
    /// next comes, and checked against its length then).
    pub fn restore(&mut self, residuals: Vec<(String, Vec<f32>)>) {
        self.current = None;
        self.parked = residuals.into_iter().collect();
    }
}
