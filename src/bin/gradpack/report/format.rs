//! The report's formatting: where a codec pays, its rows, the wide tables and the plot.

use std::io::Write;
use std::path::Path;

use gradpack::Backend;
use gradpack::cost::{self, CodecProfile, Strategy};

use super::measure::{EF_STEPS, LowRankRow, Measured, ROUNDS};
use crate::model::speedup;
use crate::recommend::Verdict;
use crate::{Network, Res, plot};

/// Where a codec pays, in Gbit/s: `always`, `never`, or intervals such as `<120.5`,
/// `>480`, `<120.5, >480` (three significant digits from 100 up, so that two intervals
/// fit the report's column).
pub(super) fn fmt_pays(pays: &[(f64, f64)]) -> String {
    pays_parts(pays).join(", ")
}

/// The intervals of [`fmt_pays`], one string each.
pub(super) fn pays_parts(pays: &[(f64, f64)]) -> Vec<String> {
    let g = |bps: f64| {
        let v = bps / 1e9;
        if v >= 100.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    };
    match pays {
        [] => vec!["never".into()],
        [(lo, hi)] if *lo == 0.0 && hi.is_infinite() => vec!["always".into()],
        _ => pays
            .iter()
            .map(|&(lo, hi)| match (lo == 0.0, hi.is_infinite()) {
                (true, _) => format!("<{}", g(hi)),
                (false, true) => format!(">{}", g(lo)),
                (false, false) => format!("{}-{}", g(lo), g(hi)),
            })
            .collect(),
    }
}

/// [`fmt_pays`] in at most `width` characters (the narrow table's column): the first
/// intervals that fit, then `…` for the rest.
pub(super) fn fit_pays(pays: &[(f64, f64)], width: usize) -> String {
    let parts = pays_parts(pays);
    let all = parts.join(", ");
    if all.chars().count() <= width {
        return all;
    }
    let mut out = String::new();
    for part in &parts {
        let next = if out.is_empty() {
            part.clone()
        } else {
            format!("{out}, {part}")
        };
        if next.chars().count() + ", …".chars().count() > width {
            break;
        }
        out = next;
    }
    if out.is_empty() {
        "…".to_string()
    } else {
        format!("{out}, …")
    }
}

/// A break-even and, when the timing rounds disagree, their range.
pub(super) fn fmt_be(be: f64, (lo, hi): (f64, f64)) -> String {
    if fmt_bw(lo) == fmt_bw(hi) {
        fmt_bw(be)
    } else {
        format!("{} ({}-{})", fmt_bw(be), fmt_bw(lo), fmt_bw(hi))
    }
}

/// A bandwidth in Gbit/s for a label: `10`, `2.5`, `0.1`.
pub(super) fn short_bw(gbit: f64) -> String {
    let s = format!("{gbit:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A bandwidth in Gbit/s.
pub(super) fn fmt_bw(b: f64) -> String {
    format!("{:.1}", b / 1e9)
}

/// A codec row of the report: its measurements and what the model makes of them.
pub(super) struct Row<'a> {
    pub(super) m: &'a Measured,
    pub(super) strategy: Strategy,
    pub(super) t: f64,
    /// Where the codec pays (bit/s intervals), from the fastest speeds.
    pub(super) pays: Vec<(f64, f64)>,
    /// Whether every timing round's own speeds give the same intervals within 25%.
    pub(super) pays_stable: bool,
    /// When it pays below a break-even and only there: that break-even, and the lowest
    /// and highest of it and the timing rounds' break-evens.
    pub(super) be: Option<(f64, (f64, f64))>,
}

/// Whether the intervals `r` (one timing round's) are those of `pays` within 25% at
/// every finite end: the same count, each end within a factor of 1.25.
pub(super) fn same_region(r: &[(f64, f64)], pays: &[(f64, f64)]) -> bool {
    let close = |a: f64, b: f64| {
        (a == b)
            || (a.is_finite() && b.is_finite() && a.min(b) > 0.0 && a.max(b) <= 1.25 * a.min(b))
    };
    r.len() == pays.len()
        && r.iter()
            .zip(pays)
            .all(|(x, y)| close(x.0, y.0) && close(x.1, y.1))
}

/// Whether a break-even's range (lowest, highest) is within 25%: the short table marks
/// the others `?`.
pub(super) fn stable((lo, hi): (f64, f64)) -> bool {
    hi <= 1.25 * lo
}

/// An error figure in at most 7 characters: `0.57`, `6.4e-3`.
pub(super) fn fmt_err(v: f64) -> String {
    if v >= 0.01 || v == 0.0 || !v.is_finite() {
        format!("{v:.2}")
    } else {
        format!("{v:.1e}")
    }
}

/// A PowerSGD row's break-even (Gbit/s), or `always`.
pub(super) fn fmt_lowrank_be(be: f64) -> String {
    if be.is_finite() {
        fmt_bw(be)
    } else {
        "always".into()
    }
}

/// `--wide`: every measured column of every codec row, then the PowerSGD table.
#[allow(clippy::too_many_arguments)]
pub(super) fn wide_tables(
    rows: &[Row],
    lowrank: &[LowRankRow],
    verdicts: &[Verdict],
    acc: &dyn Fn(usize) -> String,
    backend: Backend,
    fp32: f64,
    (mrows, mcols): (usize, usize),
    net: &Network,
) -> Res<()> {
    // The spec column fits the longest spec.
    let w = rows
        .iter()
        .map(|r| r.m.spec.to_string().len())
        .max()
        .unwrap_or(0)
        .max(4);
    outln!(
        "{:<w$} {:>7} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7} {:>9} {:>22} {:>9} {:>8} {:>8} {:>6}",
        "spec",
        "bits/el",
        "ratio",
        "rel L2",
        "EF rel L2",
        "enc GB/s",
        "dec GB/s",
        "add GB/s",
        "backend",
        "strategy",
        "break-even (range)",
        "time ms",
        "speedup",
        "acc",
        "tracks"
    );
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| rows[a].t.total_cmp(&rows[b].t));
    for i in order {
        let r = &rows[i];
        outln!(
            "{:<w$} {:>7.3} {:>6.1} {:>9.2e} {:>9} {:>8.2} {:>8.2} {:>8.2} {:>7} {:>9} {:>22} {:>9.3} {:>8} {:>8} {:>6}",
            r.m.spec.to_string(),
            r.m.bits,
            32.0 / r.m.bits,
            r.m.rel_l2,
            r.m.ef_rel_l2
                .map_or("-".to_string(), |v| format!("{v:.2e}")),
            r.m.enc / 1e9,
            r.m.dec / 1e9,
            r.m.add / 1e9,
            backend.name(),
            r.strategy.name(),
            match r.be {
                Some((be, range)) => fmt_be(be, range),
                None if r.pays_stable => fmt_pays(&r.pays),
                None => format!("{}?", fmt_pays(&r.pays)),
            },
            r.t * 1e3,
            speedup(fp32, r.t),
            acc(i),
            verdicts[i].short()
        );
    }
    outln!(
        "\nrel L2: ||x - D(x)|| / ||x||; EF rel L2: ||sum g - sum D|| / ||sum g|| after {EF_STEPS} steps of error feedback\n\
         (- where error feedback refuses a non-contractive codec);\n\
         break-even: the link speed (Gbit/s) below which the codec's all-reduce beats the fastest fp32 one, from\n\
         the fastest speeds of {ROUNDS} interleaved timing rounds, each timing the codec beside the fp32 sum (range:\n\
         with each round's own); where latency dominates, where it pays (<X, X-Y, >X, always, never; ?: the\n\
         rounds' own speeds give other intervals, by more than 25%);\n\
         time: the modelled all-reduce at {:.1} Gbit/s with the best strategy (ring or allgather); acc and\n\
         tracks: as in the short table (without --wide).",
        net.bandwidth / 1e9
    );
    // With --codec, no PowerSGD rows were asked for.
    if !lowrank.is_empty() {
        outln!(
            "\nPowerSGD on a {mrows} x {mcols} matrix of the same gradient (fp32 factors, warm start, error feedback):"
        );
        outln!(
            "{:>4} {:>7} {:>6} {:>10} {:>10} {:>9} {:>8} {:>8} {:>6}",
            "rank",
            "bits/el",
            "ratio",
            "compute ms",
            "break-even",
            "time ms",
            "speedup",
            "acc",
            "tracks"
        );
        for (k, l) in lowrank.iter().enumerate() {
            outln!(
                "{:>4} {:>7.3} {:>6.1} {:>10.3} {:>10} {:>9.3} {:>8} {:>8} {:>6}",
                l.rank,
                l.bits,
                32.0 / l.bits,
                l.compute_s * 1e3,
                fmt_lowrank_be(l.break_even),
                l.t * 1e3,
                speedup(fp32, l.t),
                acc(rows.len() + k),
                verdicts[rows.len() + k].short()
            );
        }
        outln!(
            "compute: one step on this CPU (M Q, M^T P, Gram-Schmidt, P Q^T and the residual), the fastest of {ROUNDS};\n\
             break-even: the link speed (Gbit/s) below which it beats the fp32 ring; time: the compute plus its\n\
             two fp32 ring all-reduces (of {mrows} r and {mcols} r values) at {:.1} Gbit/s.",
            net.bandwidth / 1e9
        );
    }
    Ok(())
}

/// All-reduce time against link bandwidth (1 to 400 Gbit/s, or wider to take in the
/// bandwidth asked about, which is marked; log-log), one line per codec (best strategy at
/// each bandwidth) and fp32.
pub(super) fn plot(
    path: &Path,
    codecs: &[CodecProfile],
    base: &CodecProfile,
    net: &Network,
    elements: f64,
    reduce: f64,
) -> Res<()> {
    let asked = net.bandwidth / 1e9;
    let (x0, x1) = ((asked / 1.5).min(1.0), (asked * 1.5).max(400.0));
    let bws: Vec<f64> = (0..=200)
        .map(|i| 1e9 * x0 * (x1 / x0).powf(i as f64 / 200.0))
        .collect();
    let cluster = |b| cost::Cluster {
        nodes: net.nodes,
        bandwidth_bit_s: b,
        latency_s: net.latency,
    };
    // fp32: the faster of its ring and an all-gather of fp32 frames, as the report.
    let reference = plot::Series {
        name: "fp32".into(),
        pts: bws
            .iter()
            .map(|&b| {
                let t = cost::best_fp32(base, &cluster(b), elements, reduce).1;
                (b / 1e9, t * 1e3)
            })
            .collect(),
        dashed: false,
        variant: usize::MAX,
    };
    let mut per_family: Vec<&'static str> = Vec::new();
    let series = codecs
        .iter()
        .map(|c| {
            let fam = plot::family(&c.spec);
            let variant = per_family.iter().filter(|f| **f == fam).count();
            per_family.push(fam);
            let pts = bws
                .iter()
                .map(|&b| {
                    (
                        b / 1e9,
                        cost::best_strategy(c, &cluster(b), elements, reduce).1 * 1e3,
                    )
                })
                .collect();
            let s = plot::Series {
                name: c.spec.clone(),
                pts,
                dashed: false,
                variant,
            };
            (c.spec.clone(), s)
        })
        .collect();
    plot::small_multiples(
        path,
        &format!(
            "modelled all-reduce of {:.1} MiB on {} nodes, {:.0} us latency (best strategy; lower is faster)",
            elements * 4.0 / 1048576.0,
            net.nodes,
            net.latency * 1e6
        ),
        &plot::by_family(series),
        &reference,
        &plot::Axes {
            x: (x0, x1),
            x_log: true,
            x_label: "link bandwidth (Gbit/s)".into(),
            y_label: "time (ms)".into(),
            mark_x: Some((asked, format!(" {} Gbit/s asked", short_bw(asked)))),
        },
    )
}
#[cfg(test)]
mod tests {
    use super::{fit_pays, fmt_pays, same_region};

    #[test]
    fn rounds_that_move_a_region_by_more_than_a_quarter_mark_it() {
        let inf = f64::INFINITY;
        let below = [(0.0, 100e9)];
        assert!(same_region(&[(0.0, 120e9)], &below));
        assert!(!same_region(&[(0.0, 130e9)], &below));
        assert!(!same_region(&[], &below), "never against <100");
        assert!(
            !same_region(&[(0.0, 100e9), (200e9, inf)], &below),
            "another interval"
        );
        assert!(
            same_region(&[(0.0, inf)], &[(0.0, inf)]),
            "always both times"
        );
        assert!(same_region(&[], &[]), "never both times");
        assert!(!same_region(&[(90e9, inf)], &[(50e9, inf)]));
    }

    #[test]
    fn where_a_codec_pays_fits_its_column() {
        let inf = f64::INFINITY;
        assert_eq!(fmt_pays(&[]), "never");
        assert_eq!(fmt_pays(&[(0.0, inf)]), "always");
        assert_eq!(fmt_pays(&[(0.0, 4.56e9)]), "<4.6");
        assert_eq!(fmt_pays(&[(480.2e9, inf)]), ">480");
        assert_eq!(fmt_pays(&[(2.5e9, 12.0e9)]), "2.5-12.0");
        // Two intervals, as a run at 16 nodes measured for fp16 (17 characters before).
        assert_eq!(fmt_pays(&[(0.0, 248.8e9), (1584.3e9, inf)]), "<249, >1584");
        // The narrow table's column of 10: what fits, then an ellipsis.
        let two = [(0.0, 242.0e9), (358.0e9, 2599.0e9)];
        assert_eq!(fmt_pays(&two), "<242, 358-2599");
        assert_eq!(fit_pays(&two, 10), "<242, …");
        assert_eq!(fit_pays(&[(0.0, 4.56e9)], 10), "<4.6");
        assert_eq!(fit_pays(&[(1234.5e9, 56789.0e9)], 5), "…");
        for pays in [
            &two[..],
            &[(0.0, 248.8e9), (1584.3e9, inf)],
            &[(2.5e9, 12.0e9)],
        ] {
            assert!(fit_pays(pays, 10).chars().count() <= 10, "{pays:?}");
        }
    }
}
