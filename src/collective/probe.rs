//! Measuring the link a collective runs on: [`measure_link`], for the cost model's
//! bandwidth and latency when a front end does not know them.

use std::time::Instant;

use super::{AllReduce, AllReduceOptions, Comm, ReduceOp, StrategyChoice, Transport};
use crate::cost::Strategy;
use crate::{CodecSpec, Error, Identity, Result};

/// A link between ranks as the cost model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bit/s of one rank's port.
    pub bandwidth_bit_s: f64,
    /// Seconds per message.
    pub latency_s: f64,
}

/// Estimate the link between the ranks of `comm` by timing float32 ring all-reduces
/// (messages tagged `tag`) of `small` and `large` elements, the best of `repeats` each
/// after one that warms the connections, and solving the ring's model,
/// `2 (p - 1) latency + 2 (p - 1) / p * 32 n / bandwidth`, for both. Each rank's best
/// times are averaged over the ranks (by one more all-reduce), so every rank returns the
/// same figures. A collective: every rank calls it at the same point of its sequence on
/// `comm`, with the same arguments. Needs two ranks, `small < large` and `repeats >= 1`.
pub fn measure_link<T: Transport + ?Sized>(
    comm: &mut Comm<T>,
    tag: u32,
    small: usize,
    large: usize,
    repeats: usize,
) -> Result<Link> {
    let world = comm.transport().size();
    if world < 2 || small >= large || repeats == 0 {
        return Err(Error::Collective(format!(
            "measure_link needs 2 ranks or more, small < large and repeats >= 1 (got {world} \
             ranks, small {small}, large {large}, repeats {repeats})"
        )));
    }
    let opts = AllReduceOptions {
        op: ReduceOp::Mean,
        strategy: StrategyChoice::Forced(Strategy::Fp32Ring),
        checksum: false,
        tag,
        ..AllReduceOptions::default()
    };
    let identity = CodecSpec::Identity(Identity);
    let mut best = [f32::INFINITY; 2];
    for (i, n) in [small, large].into_iter().enumerate() {
        let mut ar = AllReduce::new(identity, n, comm.transport(), opts.clone())?;
        let mut x = crate::alloc::filled(n, 0f32, "measure_link's tensor")?;
        ar.run_in_place(comm, &mut x, 0)?; // warm the connections
        for _ in 0..repeats {
            let t0 = Instant::now();
            ar.run_in_place(comm, &mut x, 0)?;
            best[i] = best[i].min(t0.elapsed().as_secs_f32());
        }
    }
    let mut ar = AllReduce::new(identity, 2, comm.transport(), opts)?;
    ar.run_in_place(comm, &mut best, 0)?;
    Ok(ring_link(
        world,
        small,
        large,
        f64::from(best[0]),
        f64::from(best[1]),
    ))
}

/// The link that makes the float32 ring of `world` ranks take `t_small` s for `small`
/// elements and `t_large` s for `large` (at most about 1e15 bit/s, and no negative
/// latency).
pub fn ring_link(world: usize, small: usize, large: usize, t_small: f64, t_large: f64) -> Link {
    let hops = 2.0 * (world as f64 - 1.0);
    let bits = |n: usize| hops / world as f64 * 4.0 * n as f64 * 8.0;
    let per_bit = ((t_large - t_small) / (bits(large) - bits(small))).max(1e-15);
    let latency = ((t_small - bits(small) * per_bit) / hops).max(0.0);
    Link {
        bandwidth_bit_s: 1.0 / per_bit,
        latency_s: latency,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local;

    #[test]
    fn the_model_inverts_exactly() {
        // A 10 Gbit/s link with 20 us per message, 4 ranks: the ring's times for 1 Ki
        // and 4 Mi elements give it back.
        let (w, bw, lat) = (4usize, 10e9, 20e-6);
        let t = |n: usize| {
            let hops = 2.0 * (w as f64 - 1.0);
            hops * lat + hops / w as f64 * 32.0 * n as f64 / bw
        };
        let l = ring_link(w, 1 << 10, 4 << 20, t(1 << 10), t(4 << 20));
        assert!((l.bandwidth_bit_s / bw - 1.0).abs() < 1e-9, "{l:?}");
        assert!((l.latency_s / lat - 1.0).abs() < 1e-9, "{l:?}");
        // A large all-reduce no slower than a small one: the bandwidth is capped and the
        // latency is not negative.
        let l = ring_link(w, 10, 100, 1e-3, 1e-3);
        assert!((l.bandwidth_bit_s / 1e15 - 1.0).abs() < 1e-12, "{l:?}");
        assert!(l.latency_s >= 0.0);
    }

    #[cfg_attr(miri, ignore = "timing loops of thousands of elements; no unsafe code")]
    #[test]
    fn every_rank_gets_the_same_figures() {
        let got = local::run(3, None, |mut comm| {
            measure_link(&mut comm, 7, 1 << 8, 1 << 14, 2)
        });
        let first = got[0].as_ref().expect("measured");
        for g in &got {
            assert_eq!(g.as_ref().expect("measured"), first);
        }
        assert!(
            first.bandwidth_bit_s > 0.0 && first.latency_s >= 0.0,
            "{first:?}"
        );
        // Refused: one rank, sizes out of order, no repeats.
        let bad = local::run(2, None, |mut comm| {
            Ok((
                measure_link(&mut comm, 7, 100, 10, 2).is_err(),
                measure_link(&mut comm, 7, 10, 100, 0).is_err(),
            ))
        });
        assert!(bad.iter().all(|b| matches!(b, Ok((true, true)))));
        let alone = local::run(1, None, |mut comm| {
            Ok(measure_link(&mut comm, 7, 10, 100, 2).is_err())
        });
        assert!(matches!(alone[0], Ok(true)));
    }
}
