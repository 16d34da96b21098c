//! [`NamedState`]: what a front end that forms its own buckets carries across steps, by
//! tensor name, as one saved blob that any front end reads.

use crate::error::{Error, Result};
use crate::state::{BlobReader, BlobWriter};

use super::lowrank::MatrixState;

const NAMED_MAGIC: [u8; 4] = *b"GPNS";

/// The state of a front end that reduces buckets of its own making (the PyTorch hook,
/// or a Rust program over [`super::TensorGather`], [`super::ModelSelection`],
/// [`super::Momentum`], [`super::PowerSgdByName`] and [`super::Tuner`]), by tensor name,
/// so it does not depend on how the tensors are grouped: one front end saves it, another
/// restores it (each object's `restore` takes its part), and bit-identical continuation
/// holds wherever both reduce the same tensors alike.
///
/// [`NamedState::save`] writes a versioned blob with a CRC-32 (the crate's checkpoint
/// format, magic `"GPNS"`); [`NamedState::restore`] refuses a damaged one, and allocates
/// nothing a damaged length claims beyond the blob's own size. The body, in order (`n`
/// a u64 count, text and byte strings prefixed by their u64 length, f32 runs by their
/// u64 element count, all little-endian): `n` settings (key, value); the step (u64);
/// `n` residuals (name, f32 run); `n` velocities (name, f32 run); `n` PowerSGD states
/// (name, a u8 flag, the `Q` f32 run when the flag is 1, the residual f32 run); `n`
/// collectives (name, `n` byte strings); a u8 flag and, when 1, the plan's byte string.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NamedState {
    /// The options the state belongs to, as `(key, value)` pairs; a front end compares
    /// the ones it cares about with [`NamedState::check`] before restoring (the PyTorch
    /// hook writes `codec`, `seed`, `powersgd` and `momentum`).
    pub settings: Vec<(String, String)>,
    /// Steps taken (the seeds of stochastic codecs follow it).
    pub step: u64,
    /// Error-feedback residuals by tensor name.
    pub residuals: Vec<(String, Vec<f32>)>,
    /// Momentum correction's velocities by tensor name.
    pub velocities: Vec<(String, Vec<f32>)>,
    /// PowerSGD's warm-start `Q` (if set) and residual by matrix name.
    pub low_rank: Vec<(String, MatrixState)>,
    /// Saved collectives that run on a whole bucket (the ring, two-shot, majority and
    /// two-level all-reduces), by their bucket's tensor names joined with `,`: the
    /// collective's blobs (one for an all-reduce, one per stream for the two-level one).
    pub collectives: Vec<(String, Vec<Vec<u8>>)>,
    /// Measured `auto`'s decisions ([`super::Tuner::save`]), if any.
    pub plan: Option<Vec<u8>>,
}

fn named_f32s(w: &mut BlobWriter, all: &[(String, Vec<f32>)]) {
    w.u64(all.len() as u64);
    for (name, v) in all {
        w.str(name).f32s(v);
    }
}

fn read_named_f32s(r: &mut BlobReader<'_>) -> Result<Vec<(String, Vec<f32>)>> {
    let n = r.u64()?;
    let mut out = Vec::new(); // grown as entries are read: a damaged count allocates nothing
    for _ in 0..n {
        let name = r.str()?.to_string();
        out.push((name, r.f32s_vec()?));
    }
    Ok(out)
}

impl NamedState {
    /// The state as one blob.
    pub fn save(&self) -> Vec<u8> {
        let mut w = BlobWriter::new(NAMED_MAGIC);
        w.u64(self.settings.len() as u64);
        for (k, v) in &self.settings {
            w.str(k).str(v);
        }
        w.u64(self.step);
        named_f32s(&mut w, &self.residuals);
        named_f32s(&mut w, &self.velocities);
        w.u64(self.low_rank.len() as u64);
        for (name, (q, e)) in &self.low_rank {
            w.str(name).u8(u8::from(q.is_some()));
            if let Some(q) = q {
                w.f32s(q);
            }
            w.f32s(e);
        }
        w.u64(self.collectives.len() as u64);
        for (name, blobs) in &self.collectives {
            w.str(name).u64(blobs.len() as u64);
            for b in blobs {
                w.bytes(b);
            }
        }
        w.u8(u8::from(self.plan.is_some()));
        if let Some(p) = &self.plan {
            w.bytes(p);
        }
        w.finish()
    }

    /// Read a blob written by [`NamedState::save`]; a damaged or truncated one, or
    /// another kind of saved state, is [`Error::Checkpoint`].
    pub fn restore(blob: &[u8]) -> Result<NamedState> {
        let mut r = BlobReader::open(blob, NAMED_MAGIC, "named state")?;
        let mut s = NamedState::default();
        for _ in 0..r.u64()? {
            let k = r.str()?.to_string();
            s.settings.push((k, r.str()?.to_string()));
        }
        s.step = r.u64()?;
        s.residuals = read_named_f32s(&mut r)?;
        s.velocities = read_named_f32s(&mut r)?;
        for _ in 0..r.u64()? {
            let name = r.str()?.to_string();
            let q = match r.u8()? {
                0 => None,
                1 => Some(r.f32s_vec()?),
                f => return Err(Error::Checkpoint(format!("named state: Q flag {f}"))),
            };
            s.low_rank.push((name, (q, r.f32s_vec()?)));
        }
        for _ in 0..r.u64()? {
            let name = r.str()?.to_string();
            let mut blobs = Vec::new();
            for _ in 0..r.u64()? {
                blobs.push(r.bytes()?.to_vec());
            }
            s.collectives.push((name, blobs));
        }
        s.plan = match r.u8()? {
            0 => None,
            1 => Some(r.bytes()?.to_vec()),
            f => return Err(Error::Checkpoint(format!("named state: plan flag {f}"))),
        };
        r.end()?;
        Ok(s)
    }

    /// The value saved for `key`, if any.
    pub fn setting(&self, key: &str) -> Option<&str> {
        self.settings
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Error unless the state was saved with each of `mine` (`(key, value)` pairs),
    /// naming the first that differs or is missing.
    pub fn check(&self, mine: &[(&str, &str)]) -> Result<()> {
        for &(key, want) in mine {
            match self.setting(key) {
                Some(got) if got == want => {}
                got => {
                    return Err(Error::Checkpoint(format!(
                        "the state was saved with {key} {}; this one has {want}",
                        got.unwrap_or("unset")
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> NamedState {
        NamedState {
            settings: vec![("codec".into(), "int8".into()), ("seed".into(), "3".into())],
            step: 41,
            residuals: vec![
                ("w".into(), vec![1.0, -2.5, f32::MIN_POSITIVE]),
                ("b".into(), vec![]),
            ],
            velocities: vec![("w".into(), vec![0.5; 3])],
            low_rank: vec![
                ("m".into(), (Some(vec![1.0, 2.0]), vec![3.0; 4])),
                ("n".into(), (None, vec![0.0])),
            ],
            collectives: vec![("w,b".into(), vec![vec![1, 2, 3], vec![]])],
            plan: Some(vec![9, 8, 7]),
        }
    }

    #[test]
    fn a_saved_state_reads_back_whole() {
        let s = sample();
        assert_eq!(NamedState::restore(&s.save()).expect("reads"), s);
        let empty = NamedState::default();
        assert_eq!(NamedState::restore(&empty.save()).expect("reads"), empty);
    }

    #[test]
    fn damage_is_refused() {
        let blob = sample().save();
        for at in [0, 5, 20, blob.len() / 2, blob.len() - 1] {
            let mut bad = blob.clone();
            bad[at] ^= 0x40;
            assert!(
                matches!(NamedState::restore(&bad), Err(Error::Checkpoint(_))),
                "{at}"
            );
        }
        assert!(NamedState::restore(&blob[..blob.len() - 3]).is_err());
        // Another kind of saved state.
        let ef = crate::ErrorFeedback::new(crate::CodecSpec::Identity(crate::Identity), 4)
            .map(|e| e.save());
        if let Ok(other) = ef {
            assert!(NamedState::restore(&other).is_err());
        }
    }

    #[test]
    fn settings_are_checked_by_key() {
        let s = sample();
        assert!(s.check(&[("codec", "int8"), ("seed", "3")]).is_ok());
        let e = s.check(&[("seed", "4")]).expect_err("differs").to_string();
        assert!(e.contains("seed 3") && e.contains("has 4"), "{e}");
        let e = s
            .check(&[("momentum", "0.9")])
            .expect_err("unset")
            .to_string();
        assert!(e.contains("unset"), "{e}");
    }
}
