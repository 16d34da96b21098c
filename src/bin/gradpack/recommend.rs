//! The report's recommendation: the fastest codec and strategy that still tracks fp32.
//!
//! A candidate tracks fp32 when
//! - its accumulated error after error feedback stays clearly below the accumulated
//!   gradient ([`MAX_EF_ERROR`]): a codec whose error-feedback error is near 1 after
//!   several steps leaves most of every step unsent, and
//! - a short data-parallel training run with it (`gradpack train`'s task) ends within
//!   the accuracy tolerance of the same run in fp32.
//!
//! Codecs that refuse error feedback (non-contractive ones) have no error-feedback error;
//! their single-step error is the variance of an unbiased estimate, so only the
//! training run decides for them.

/// The error-feedback error (`||sum g - sum D|| / ||sum g||` after the report's steps)
/// from which a codec is taken not to track fp32.
pub(crate) const MAX_EF_ERROR: f64 = 0.9;

/// One way to all-reduce the gradient, as the recommendation sees it.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    /// The spec as the user gave it (or the report's short name).
    pub name: String,
    /// The all-reduce strategy the model chose for it.
    pub strategy: &'static str,
    /// Modelled all-reduce time on the network asked about (seconds).
    pub time_s: f64,
    /// Error after error feedback (`None`: not measured, or error feedback refused).
    pub ef_error: Option<f64>,
    /// Whether it runs with error feedback.
    pub feedback: bool,
    /// The training run's final test accuracy minus fp32's, in percentage points
    /// (`None`: not trained; `Some(NaN)`: diverged).
    pub accuracy_delta: Option<f64>,
}

/// Whether a candidate tracks fp32, and why not.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Verdict {
    /// It tracks fp32 on every test that ran.
    Tracks,
    /// It tracks on the error test; no training run confirmed it.
    Unconfirmed,
    /// It does not, for these reasons.
    Fails(Vec<String>),
}

impl Verdict {
    /// The short form of the table's `tracks` column.
    pub fn short(&self) -> &'static str {
        match self {
            Verdict::Tracks => "yes",
            Verdict::Unconfirmed => "yes?",
            Verdict::Fails(_) => "no",
        }
    }
}

/// Judge `c` with an accuracy tolerance of `tolerance` percentage points.
pub(crate) fn judge(c: &Candidate, tolerance: f64) -> Verdict {
    let mut why = Vec::new();
    if let Some(e) = c.ef_error
        && (e >= MAX_EF_ERROR || e.is_nan())
    {
        why.push(format!(
            "error after error feedback {e:.2} (>= {MAX_EF_ERROR}): most of each step is never sent"
        ));
    }
    match c.accuracy_delta {
        Some(d) if d.is_nan() => why.push("training diverged".into()),
        Some(d) if d < -tolerance => why.push(format!(
            "accuracy {d:+.2} points against fp32 (tolerance {tolerance})"
        )),
        _ => {}
    }
    if !why.is_empty() {
        Verdict::Fails(why)
    } else if c.accuracy_delta.is_none() {
        Verdict::Unconfirmed
    } else {
        Verdict::Tracks
    }
}

/// What the report recommends.
#[derive(Debug)]
pub(crate) struct Recommendation {
    /// The index of the recommended candidate, `None` for plain fp32.
    pub pick: Option<usize>,
    /// Faster candidates passed over, with their reasons.
    pub passed_over: Vec<(usize, Vec<String>)>,
}

/// The fastest candidate that tracks fp32 (or is unconfirmed, when nothing was trained)
/// and is faster than `fp32_s`; `None` when none is. Ties go to the earlier candidate.
pub(crate) fn recommend(cands: &[Candidate], fp32_s: f64, tolerance: f64) -> Recommendation {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by(|&a, &b| cands[a].time_s.total_cmp(&cands[b].time_s));
    let mut passed_over = Vec::new();
    for i in order {
        if cands[i].time_s >= fp32_s || cands[i].time_s.is_nan() {
            break;
        }
        match judge(&cands[i], tolerance) {
            Verdict::Tracks | Verdict::Unconfirmed => {
                return Recommendation {
                    pick: Some(i),
                    passed_over,
                };
            }
            Verdict::Fails(why) => passed_over.push((i, why)),
        }
    }
    Recommendation {
        pick: None,
        passed_over,
    }
}

/// The recommendation in words: what to use, why it tracks, what faster candidates were
/// passed over and why. `network` names the network (`16 nodes at 10.0 Gbit/s`),
/// `fp32` is fp32's (time, strategy) and `fp32_accuracy` its trained accuracy.
pub(crate) fn explain(
    cands: &[Candidate],
    r: &Recommendation,
    network: &str,
    fp32: (f64, &str),
    fp32_accuracy: Option<f64>,
    tolerance: f64,
) -> Vec<String> {
    let mut out = Vec::new();
    let speed = |c: &Candidate| {
        format!(
            "{:.3} ms against fp32's {:.3} ms ({:.2}x)",
            c.time_s * 1e3,
            fp32.0 * 1e3,
            fp32.0 / c.time_s
        )
    };
    match r.pick {
        Some(i) => {
            let c = &cands[i];
            out.push(format!("recommended for {network}: {}", c.name));
            out.push(format!(
                "  {}{} all-reduce, modelled {}",
                if c.feedback {
                    "with error feedback, "
                } else {
                    ""
                },
                c.strategy,
                speed(c)
            ));
            out.push("  it tracks fp32:".into());
            if let Some(e) = c.ef_error {
                out.push(format!(
                    "    its error after error feedback is {e:.2} (< {MAX_EF_ERROR})"
                ));
            }
            match (c.accuracy_delta, fp32_accuracy) {
                (Some(d), Some(a)) => out.push(format!(
                    "    it trained to {:.2}% against fp32's {:.2}% ({d:+.2} points, tolerance {tolerance})",
                    a + d,
                    a
                )),
                _ => out.push("    no training run confirmed it (--no-train)".into()),
            }
        }
        None => {
            let faster = cands.iter().any(|c| c.time_s < fp32.0);
            out.push(format!(
                "recommended for {network}: plain fp32 ({} all-reduce, {:.3} ms): {}",
                fp32.1,
                fp32.0 * 1e3,
                if faster {
                    "every faster candidate fails to track fp32"
                } else {
                    "no candidate is faster here"
                }
            ));
        }
    }
    if !r.passed_over.is_empty() {
        out.push("  faster, but passed over:".into());
        for (i, why) in &r.passed_over {
            out.push(format!(
                "    {}, {:.3} ms:",
                cands[*i].name,
                cands[*i].time_s * 1e3
            ));
            out.extend(why.iter().map(|w| format!("      {w}")));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(name: &str, ms: f64, ef: Option<f64>, acc: Option<f64>) -> Candidate {
        Candidate {
            name: name.into(),
            strategy: "ring",
            time_s: ms / 1e3,
            ef_error: ef,
            feedback: ef.is_some(),
            accuracy_delta: acc,
        }
    }

    /// The profile the report printed at 16 nodes and 10 Gbit/s: random-k strata is the
    /// fastest but drops most of each step, top-k tracks.
    fn profile() -> Vec<Candidate> {
        vec![
            cand("fp16", 13.1, Some(7e-5), Some(0.0)),
            cand("int8", 7.0, Some(6.4e-3), Some(0.0)),
            cand("qsgd:bits=2", 2.6, None, Some(-2.12)),
            cand("sign", 1.40, Some(0.54), Some(-0.10)),
            cand("topk:ratio=0.01,values=fp16", 1.24, Some(0.57), Some(-0.15)),
            cand(
                "randk:ratio=0.01,select=strata",
                0.83,
                Some(0.979),
                Some(-2.78),
            ),
            cand("dct:k=4,values=sign", 37.5, Some(0.58), Some(0.0)),
        ]
    }

    #[test]
    fn the_fastest_candidate_that_tracks_is_recommended_and_faster_ones_explained() {
        let c = profile();
        let r = recommend(&c, 25.5e-3, 0.5);
        assert_eq!(r.pick, Some(4), "top-k");
        assert_eq!(r.passed_over.len(), 1);
        assert_eq!(r.passed_over[0].0, 5, "random-k");
        assert_eq!(r.passed_over[0].1.len(), 2, "both tests fail");
        let text = explain(
            &c,
            &r,
            "16 nodes at 10.0 Gbit/s",
            (25.5e-3, "ring"),
            Some(77.29),
            0.5,
        )
        .join("\n");
        assert!(text.contains("recommended for 16 nodes at 10.0 Gbit/s: topk:ratio=0.01,values=fp16\n  with error feedback, ring all-reduce, modelled 1.240 ms against fp32's 25.500 ms (20.56x)"), "{text}");
        assert!(
            text.contains("77.14% against fp32's 77.29% (-0.15 points"),
            "{text}"
        );
        assert!(
            text.contains(
                "randk:ratio=0.01,select=strata, 0.830 ms:\n      error after error feedback 0.98"
            ),
            "{text}"
        );
        assert!(text.contains("accuracy -2.78 points"), "{text}");
    }

    #[test]
    fn a_tighter_tolerance_moves_the_pick_and_each_test_can_fail_alone() {
        let c = profile();
        // 0.12 points: top-k (-0.15) fails on accuracy alone, sign (-0.10) tracks.
        let r = recommend(&c, 25.5e-3, 0.12);
        assert_eq!(r.pick, Some(3));
        assert_eq!(r.passed_over.len(), 2);
        assert_eq!(r.passed_over[1].0, 4);
        assert_eq!(r.passed_over[1].1.len(), 1);
        assert!(r.passed_over[1].1[0].starts_with("accuracy"));
        // An error-only failure: accuracy fine, error feedback error too high.
        let v = judge(&cand("x", 1.0, Some(0.95), Some(0.0)), 0.5);
        assert!(matches!(v, Verdict::Fails(ref w) if w.len() == 1 && w[0].starts_with("error")));
        // Diverged runs never track.
        let v = judge(&cand("x", 1.0, Some(0.1), Some(f64::NAN)), 0.5);
        assert_eq!(v, Verdict::Fails(vec!["training diverged".into()]));
        // Without training, the error test alone gives an unconfirmed yes.
        assert_eq!(
            judge(&cand("x", 1.0, Some(0.1), None), 0.5),
            Verdict::Unconfirmed
        );
        // Without error feedback and training, nothing is known against it.
        assert_eq!(
            judge(&cand("x", 1.0, None, None), 0.5),
            Verdict::Unconfirmed
        );
    }

    #[test]
    fn fp32_is_recommended_when_nothing_faster_tracks() {
        let c = profile();
        // On a fast network fp32 takes 1 ms: only random-k is faster, and it fails.
        let r = recommend(&c, 1.0e-3, 0.5);
        assert_eq!(r.pick, None);
        assert_eq!(r.passed_over.len(), 1);
        let text = explain(&c, &r, "8 nodes", (1.0e-3, "ring"), Some(77.0), 0.5).join("\n");
        assert!(
            text.contains("plain fp32 (ring all-reduce, 1.000 ms): every faster candidate fails"),
            "{text}"
        );
        // Nothing faster at all.
        let r = recommend(&c, 0.5e-3, 0.5);
        assert_eq!((r.pick, r.passed_over.len()), (None, 0));
        let text = explain(&c, &r, "8 nodes", (0.5e-3, "ring"), Some(77.0), 0.5).join("\n");
        assert!(text.contains("no candidate is faster here"), "{text}");
    }
}
