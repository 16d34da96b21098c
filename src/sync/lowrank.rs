//! PowerSGD over a framework's own buckets, each matrix's state kept by tensor name.
//!
//! [`PowerSgdBucket`] holds the state of the matrices of one bucket. A framework that
//! regroups its buckets between steps (DDP does after the first) needs each matrix's
//! warm-start `Q` and residual to follow it into its new bucket: [`PowerSgdByName`]
//! keeps one [`PowerSgdBucket`] per set of matrix names and moves each matrix's state
//! by name when a new set forms; [`PowerSgdByName::states`] and
//! [`PowerSgdByName::restore`] save and load them by name.

use std::collections::{HashMap, HashSet};

use crate::error::{Error, Result};
use crate::rng::splitmix64;

use super::{PowerSgd, PowerSgdBucket};

/// The seed of a step's PowerSGD draws for the bucket of the matrices `names`, from the
/// caller's `base` seed and the `step`: `splitmix64(base ^ splitmix64(step) ^
/// splitmix64(crc32(names joined by NUL)))`, the same on every rank (a fresh `Q` is drawn
/// from it where a matrix has none).
pub fn step_seed(base: u64, step: u64, names: &[String]) -> u64 {
    let crc = crc32fast::hash(names.join("\0").as_bytes());
    splitmix64(base ^ splitmix64(step) ^ splitmix64(u64::from(crc)))
}

/// One matrix's state: its warm-start `Q` (`m x r`, if set) and its residual.
pub type MatrixState = (Option<Vec<f32>>, Vec<f32>);

/// PowerSGD buckets by the names of their matrices (see the module docs).
pub struct PowerSgdByName {
    settings: PowerSgd,
    buckets: HashMap<Vec<String>, PowerSgdBucket>,
    /// Each matrix's bucket: the names of that bucket's matrices.
    owner: HashMap<String, Vec<String>>,
    /// States loaded by name and not yet taken up.
    parked: HashMap<String, MatrixState>,
}

impl PowerSgdByName {
    /// Buckets with `settings` (checked).
    pub fn new(settings: PowerSgd) -> Result<PowerSgdByName> {
        settings.check()?;
        Ok(PowerSgdByName {
            settings,
            buckets: HashMap::new(),
            owner: HashMap::new(),
            parked: HashMap::new(),
        })
    }

    /// The settings.
    pub fn settings(&self) -> &PowerSgd {
        &self.settings
    }

    /// The bucket of the matrices `names`, each `(offset, (n, m, r))` in a buffer of
    /// `len` elements (as [`PowerSgdBucket::at_offsets`] takes them): the one made for
    /// these names and length before, else a new one in which each matrix starts from
    /// its restored state, or from its state in the bucket it was in before (a bucket
    /// none of whose matrices is left in it is dropped). A state that does not fit its
    /// matrix is an error, and nothing changes.
    pub fn bucket(
        &mut self,
        names: &[String],
        matrices: &[(usize, (usize, usize, usize))],
        len: usize,
    ) -> Result<&mut PowerSgdBucket> {
        if names.len() != matrices.len() {
            return Err(Error::Collective(format!(
                "{} names for {} PowerSGD matrices",
                names.len(),
                matrices.len()
            )));
        }
        let key = names.to_vec();
        if self.buckets.get(&key).is_some_and(|b| b.len() == len) {
            return Ok(self.buckets.get_mut(&key).expect("just found"));
        }
        let mut b = PowerSgdBucket::at_offsets(self.settings, matrices, len)?;
        let mut taken = Vec::new();
        let mut left = HashSet::new();
        for (i, name) in names.iter().enumerate() {
            let state = match self.parked.get(name) {
                Some((q, e)) => Some((q.as_deref(), e.as_slice())),
                None => match self
                    .owner
                    .get(name)
                    .and_then(|o| Some((o, self.buckets.get(o)?)))
                {
                    Some((old, ob)) => {
                        let at = old
                            .iter()
                            .position(|n| n == name)
                            .expect("an owner names it");
                        left.insert(old.clone());
                        Some(ob.matrix_state(at)?)
                    }
                    None => None,
                },
            };
            if let Some((q, e)) = state {
                b.set_matrix_state(i, q, e).map_err(|e| {
                    Error::Collective(format!(
                        "the PowerSGD state of {name:?} does not fit it: {e}"
                    ))
                })?;
                taken.push(name);
            }
        }
        for name in taken {
            self.parked.remove(name);
        }
        for name in names {
            self.owner.insert(name.clone(), key.clone());
        }
        for old in left {
            if !old.iter().any(|n| self.owner.get(n) == Some(&old)) {
                self.buckets.remove(&old);
            }
        }
        Ok(self.buckets.entry(key).insert_entry(b).into_mut())
    }

    /// Every matrix's state by name (copies): those in buckets and those restored and
    /// not yet taken up, sorted by name.
    pub fn states(&self) -> Result<Vec<(String, MatrixState)>> {
        let mut out: Vec<(String, MatrixState)> = self
            .parked
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (name, names) in &self.owner {
            let Some(b) = self.buckets.get(names) else {
                continue;
            };
            let at = names
                .iter()
                .position(|n| n == name)
                .expect("an owner names it");
            let (q, e) = b.matrix_state(at)?;
            out.push((name.clone(), (q.map(<[f32]>::to_vec), e.to_vec())));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Replace every matrix's state with `states` (by name; each taken up, and checked
    /// against its matrix, when its bucket next forms).
    pub fn restore(&mut self, states: Vec<(String, MatrixState)>) {
        self.buckets.clear();
        self.owner.clear();
        self.parked = states.into_iter().collect();
    }
}
