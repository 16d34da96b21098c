//! `report --json`: the whole report as one document.

use std::io::Write;

use super::format::stable;
use super::measure::{cpu_model, today};
use super::{Output, Verdict};
use crate::Res;

impl Output<'_> {
    /// `--json`: one document.
    pub(super) fn json(&self) -> Res<()> {
        let Output {
            a,
            s,
            model,
            cands,
            verdicts,
            rec,
            trained,
        } = self;
        let (rows, lowrank, fp32, fp32_strategy, reduce) = (
            &model.rows,
            &model.lowrank,
            model.fp32,
            model.fp32_strategy,
            model.reduce,
        );
        let (backend, names, net, n, source) = (s.backend, &s.names, &s.net, s.x.len(), &s.source);
        let train_json = |i: usize| {
            let v = &verdicts[i];
            serde_json::json!({
                "feedback": cands[i].feedback,
                // Test accuracy minus fp32's in the training run (points; null: not
                // trained or diverged).
                "accuracy_delta_points": cands[i].accuracy_delta.filter(|d| d.is_finite()),
                "diverged": cands[i].accuracy_delta.is_some_and(f64::is_nan),
                "tracks": v.short(),
                "tracks_reasons": match v { Verdict::Fails(w) => w.clone(), _ => Vec::new() },
            })
        };
        let merge = |mut a: serde_json::Value, b: serde_json::Value| {
            if let (Some(a), serde_json::Value::Object(b)) = (a.as_object_mut(), b) {
                a.extend(b);
            }
            a
        };
        let codecs: Vec<serde_json::Value> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                merge(
                    serde_json::json!({
                        "spec": r.m.spec.to_string(),
                        "name": names[i],
                        "bits_per_element": r.m.bits,
                        "ratio": 32.0 / r.m.bits,
                        "rel_l2_error": r.m.rel_l2,
                        "ef_rel_l2_error": r.m.ef_rel_l2,
                        "unbiased": r.m.spec.unbiased(),
                        "encode_gb_s": r.m.enc / 1e9,
                        "decode_gb_s": r.m.dec / 1e9,
                        "decode_add_gb_s": r.m.add / 1e9,
                        "backend": backend.name(),
                        "strategy": r.strategy.name(),
                        // The link speed below which the codec pays, when it pays there and
                        // only there (null otherwise: see pays_at_gbit_s).
                        "break_even_gbit_s": r.be.map(|b| b.0 / 1e9),
                        // The lowest and highest of it and the timing rounds' break-evens.
                        "break_even_range_gbit_s": r.be.map(|b| [b.1.0 / 1e9, b.1.1 / 1e9]),
                        // Whether the rounds agree within 25% (the table marks it `?` if not).
                        "break_even_stable": r.be.map(|b| stable(b.1)),
                        // Whether the timing rounds give the same intervals within 25%.
                        "pays_stable": r.pays_stable,
                        // Every interval of link speeds where it pays (null: no upper end).
                        "pays_at_gbit_s": r.pays.iter().map(|&(lo, hi)| {
                            [Some(lo / 1e9), hi.is_finite().then_some(hi / 1e9)]
                        }).collect::<Vec<_>>(),
                        "allreduce_s": r.t,
                        "speedup": fp32 / r.t,
                    }),
                    train_json(i),
                )
            })
            .collect();
        let doc = serde_json::json!({
            "gradpack_version": env!("CARGO_PKG_VERSION"),
            "date": today(),
            "cpu": cpu_model(),
            "backend": backend.name(),
            "elements": n,
            "input": source,
            "nodes": net.nodes,
            "bandwidth_bit_s": net.bandwidth,
            "latency_s": net.latency,
            "fp32_reduce_gb_s": reduce / 1e9,
            "fp32_allreduce_s": fp32,
            "fp32_strategy": fp32_strategy.name(),
            "fp32_train_accuracy": trained.map(|t| t.fp32 / 100.0),
            "tolerance_points": a.tolerance,
            "codecs": codecs,
            // PowerSGD on one rows x cols matrix of the same elements (fp32 factors).
            "powersgd": lowrank.iter().enumerate().map(|(k, l)| merge(serde_json::json!({
                "rank": l.rank, "rows": l.rows, "cols": l.cols,
                "bits_per_element": l.bits, "ratio": 32.0 / l.bits,
                "compute_s": l.compute_s, "allreduce_s": l.t, "speedup": fp32 / l.t,
                "break_even_gbit_s": l.break_even.is_finite().then_some(l.break_even / 1e9),
            }), train_json(rows.len() + k))).collect::<Vec<_>>(),
            // The fastest candidate that tracks fp32 (null: plain fp32), and the faster
            // ones passed over.
            "recommendation": rec.pick.map(|i| serde_json::json!({
                "name": cands[i].name, "strategy": cands[i].strategy,
                "feedback": cands[i].feedback, "allreduce_s": cands[i].time_s,
                "speedup": fp32 / cands[i].time_s,
            })),
            "passed_over": rec.passed_over.iter().map(|(i, why)| serde_json::json!({
                "name": cands[*i].name, "allreduce_s": cands[*i].time_s, "reasons": why,
            })).collect::<Vec<_>>(),
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?
        );
        Ok(())
    }
}
