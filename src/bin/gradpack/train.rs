//! `train`: data-parallel SGD of a small model with each codec, against fp32.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use gradpack::CodecSpec;
use gradpack::cost::Strategy;

use crate::{Res, plot, progress, specs};

#[derive(Args)]
pub(crate) struct TrainArgs {
    /// Model: softmax (regression) or mlp (one hidden ReLU layer).
    #[arg(long, default_value = "mlp")]
    model: String,
    /// Hidden units of the MLP.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Simulated workers (threads exchanging gradients through gradpack::collective).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Passes over the 16384 training samples.
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Samples per worker per step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
    /// Seed of the data set, the initial weights, the batch order and the codecs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// All-reduce strategy for the compressed runs: allgather, ring, twoshot or majority.
    #[arg(long, default_value = "allgather")]
    strategy: String,
    /// Codec spec (repeatable; default: a representative set).
    #[arg(long = "codec")]
    codecs: Vec<String>,
    /// Also train with the weight matrices sent as PowerSGD factors of this rank (fp32
    /// factors, biases in fp32; repeatable), with and without its error feedback.
    #[arg(long = "powersgd")]
    powersgd: Vec<usize>,
    /// Send the weight matrices of `dct` runs in 2-D tiles (`chunk x chunk` squares of
    /// each matrix) instead of tiles along the flat tensor.
    #[arg(long)]
    dct_2d: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an SVG of the test-loss curves to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// One row of `gradpack train`: a finished run, or why it did not run.
enum TrainRow {
    Done(gradpack::train::TrainResult),
    Refused { codec: CodecSpec, reason: String },
}

pub(crate) fn train(a: TrainArgs) -> Res<()> {
    let (cfg, specs) = config(&a)?;
    let runs = run_all(&a, cfg, &specs)?;
    if a.json {
        runs.json()?;
    } else {
        runs.table()?;
    }
    if let Some(path) = &a.plot {
        runs.plot(path)?;
    }
    Ok(())
}

/// What `train` trained: the data set and configuration, the fp32 baseline, and every
/// codec's and PowerSGD rank's run without and with error feedback.
struct Runs {
    ds: gradpack::train::Dataset,
    cfg: gradpack::train::TrainConfig,
    base: gradpack::train::TrainResult,
    rows: Vec<(bool, TrainRow)>,
}

/// The run's configuration and codecs, from the arguments checked (every refusal before
/// the training runs).
fn config(a: &TrainArgs) -> Res<(gradpack::train::TrainConfig, Vec<CodecSpec>)> {
    use gradpack::train::{ModelKind, TrainConfig};
    let model = match a.model.as_str() {
        "softmax" => ModelKind::Softmax,
        "mlp" => ModelKind::Mlp { hidden: a.hidden },
        m => return Err(format!("--model {m:?}: accepted values are softmax, mlp")),
    };
    let strategy = match Strategy::from_name(&a.strategy) {
        Some(
            s @ (Strategy::CompressedAllGather
            | Strategy::CompressedRing
            | Strategy::TwoShot
            | Strategy::SignMajority),
        ) => s,
        _ => {
            return Err(format!(
                "--strategy {:?}: accepted values are allgather, ring, twoshot, majority",
                a.strategy
            ));
        }
    };
    if a.workers == 0 || a.epochs == 0 || a.batch == 0 {
        return Err("--workers, --epochs and --batch must be at least 1".into());
    }
    if !(a.lr.is_finite() && a.lr > 0.0) {
        return Err(format!("--lr {}: expected a positive number", a.lr));
    }
    if a.plot.as_ref().is_some_and(|p| crate::io::is_std(p)) {
        return Err("--plot -: stdout carries the table; give the SVG a file name".into());
    }
    if let Some(p) = &a.plot {
        crate::io::check_writable(p, "--plot")?; // before the training runs
    }
    let specs = specs(&a.codecs)?;
    let cfg = TrainConfig {
        model,
        workers: a.workers,
        epochs: a.epochs,
        batch: a.batch,
        lr: a.lr,
        seed: a.seed,
        strategy,
        powersgd: None,
        dct_2d: a.dct_2d,
    };
    Ok((cfg, specs))
}

/// The fp32 baseline, then every codec without and with error feedback, then every
/// PowerSGD rank without and with its error feedback.
fn run_all(a: &TrainArgs, cfg: gradpack::train::TrainConfig, specs: &[CodecSpec]) -> Res<Runs> {
    use gradpack::train::TrainConfig;
    let ds = gradpack::train::Dataset::synthetic(a.seed);
    let runs = 1 + 2 * (specs.len() + a.powersgd.len());
    let bar = progress(runs as u64, a.json);
    let base_cfg = TrainConfig {
        strategy: Strategy::Fp32Ring,
        ..cfg.clone()
    };
    let identity = CodecSpec::Identity(gradpack::Identity);
    let base = gradpack::train::train(&ds, &base_cfg, identity, false)
        .map_err(|e| format!("fp32 baseline: {e}"))?;
    bar.inc(1);
    let mut rows = Vec::with_capacity(runs);
    for spec in specs {
        for ef in [false, true] {
            bar.set_message(format!("{spec}{}", if ef { " + EF" } else { "" }));
            let row = match gradpack::train::train(&ds, &cfg, *spec, ef) {
                Ok(r) => TrainRow::Done(r),
                Err(e @ (gradpack::Error::Param { .. } | gradpack::Error::Collective(_))) => {
                    TrainRow::Refused {
                        codec: *spec,
                        reason: crate::cli_message(&e.to_string()),
                    }
                }
                Err(e) => return Err(format!("{spec}: {e}")),
            };
            rows.push((ef, row));
            bar.inc(1);
        }
    }
    for &rank in &a.powersgd {
        let p = gradpack::sync::PowerSgd::rank(rank);
        for ef in [false, true] {
            bar.set_message(format!(
                "powersgd:rank={rank}{}",
                if ef { " + EF" } else { "" }
            ));
            let ps_cfg = TrainConfig {
                powersgd: Some(p),
                ..cfg.clone()
            };
            let r = gradpack::train::train(&ds, &ps_cfg, identity, ef)
                .map_err(|e| format!("powersgd:rank={rank}: {e}"))?;
            rows.push((ef, TrainRow::Done(r)));
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    Ok(Runs {
        ds,
        cfg,
        base,
        rows,
    })
}

/// A run's last test loss, accuracy and accuracy against the baseline's, as the table
/// prints them.
fn fmt_run(r: &gradpack::train::TrainResult, base: &gradpack::train::TrainResult) -> String {
    let b = base.last();
    let l = r.last();
    if l.test_loss.is_finite() {
        format!(
            "{:>9.4} {:>8.2}% {:>+8.2}",
            l.test_loss,
            100.0 * l.test_accuracy,
            100.0 * (l.test_accuracy - b.test_accuracy)
        )
    } else {
        format!("{:>9} {:>9} {:>8}", "diverged", "-", "-")
    }
}

impl Runs {
    /// `--json`: the baseline and every run with its curve.
    fn json(&self) -> Res<()> {
        use gradpack::train::TrainResult;
        let Runs {
            ds,
            cfg,
            base,
            rows,
        } = self;
        let model = cfg.model;
        let curve = |r: &TrainResult| {
            r.curve
                .iter()
                .map(|p| {
                    serde_json::json!({
                        "epoch": p.epoch, "train_loss": p.train_loss,
                        "test_loss": p.test_loss, "test_accuracy": p.test_accuracy,
                    })
                })
                .collect::<Vec<_>>()
        };
        let run = |r: &TrainResult| {
            serde_json::json!({
                "codec": r.method(), "strategy": r.strategy.name(),
                "feedback": r.feedback, "bytes_per_worker": r.bytes_per_worker,
                "steps": r.steps, "curve": curve(r),
            })
        };
        let runs: Vec<serde_json::Value> = rows
            .iter()
            .map(|(ef, row)| match row {
                TrainRow::Done(r) => run(r),
                TrainRow::Refused { codec, reason } => serde_json::json!({
                    "codec": codec.to_string(), "feedback": ef, "refused": reason,
                }),
            })
            .collect();
        let doc = serde_json::json!({
            "model": model.name(), "parameters": model.params(ds.features, ds.classes),
            "workers": cfg.workers, "epochs": cfg.epochs, "batch": cfg.batch, "lr": cfg.lr,
            "seed": cfg.seed, "baseline": run(base), "runs": runs,
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?
        );
        Ok(())
    }

    /// The table: the baseline, then every run, refusals noted below it.
    fn table(&self) -> Res<()> {
        let Runs {
            ds,
            cfg,
            base,
            rows,
        } = self;
        let (model, strategy) = (cfg.model, cfg.strategy);
        outln!(
            "gradpack train: {} ({} parameters), {} workers x {} samples per step, {} epochs ({} steps), lr {}, seed {}, {} strategy",
            model.name(),
            model.params(ds.features, ds.classes),
            cfg.workers,
            cfg.batch,
            cfg.epochs,
            base.steps,
            cfg.lr,
            cfg.seed,
            strategy.name()
        );
        // The codec column fits the longest spec.
        let w = rows
            .iter()
            .map(|(_, r)| match r {
                TrainRow::Done(r) => r.method().len(),
                TrainRow::Refused { codec, .. } => codec.to_string().len(),
            })
            .max()
            .unwrap_or(0)
            .max(30);
        outln!(
            "\n{:<w$} {:>3} {:>9} {:>9} {:>8} {:>13} {:>8}",
            "codec",
            "EF",
            "test loss",
            "accuracy",
            "vs fp32",
            "bytes/worker",
            "vs fp32"
        );
        outln!(
            "{:<w$} {:>3} {} {:>13} {:>8.3}",
            "fp32 (ring of identity frames)",
            "-",
            fmt_run(base, base),
            base.bytes_per_worker,
            1.0
        );
        let mut notes: Vec<&str> = Vec::new();
        for (ef, row) in rows {
            let ef_s = if *ef { "yes" } else { "no" };
            match row {
                TrainRow::Done(r) => outln!(
                    "{:<w$} {:>3} {} {:>13} {:>8.3}",
                    r.method(),
                    ef_s,
                    fmt_run(r, base),
                    r.bytes_per_worker,
                    r.bytes_per_worker as f64 / base.bytes_per_worker as f64
                ),
                TrainRow::Refused { codec, reason } => {
                    let k = match notes.iter().position(|n| n == reason) {
                        Some(k) => k,
                        None => {
                            notes.push(reason);
                            notes.len() - 1
                        }
                    };
                    outln!("{:<w$} {:>3} refused [{}]", codec.to_string(), ef_s, k + 1)
                }
            }
        }
        for (k, n) in notes.iter().enumerate() {
            outln!("[{}] {n}", k + 1);
        }
        outln!(
            "\nvs fp32: test accuracy difference in percentage points; bytes: what each worker sent\n\
         (all-gather sends p-1 frames per step, the fp32 ring 2(p-1)/p of the gradient)."
        );
        Ok(())
    }

    /// `--plot`: the test-loss curves, a panel per codec family.
    fn plot(&self, path: &std::path::Path) -> Res<()> {
        let Runs {
            cfg, base, rows, ..
        } = self;
        let model = cfg.model;
        let curve = |c: &[gradpack::train::EpochPoint]| -> Vec<(f64, f64)> {
            c.iter()
                .filter(|p| p.test_loss.is_finite())
                .map(|p| (p.epoch as f64, p.test_loss))
                .collect()
        };
        // One panel per family; a codec and its error-feedback run share a colour.
        let mut variants: Vec<String> = Vec::new();
        let mut series = Vec::new();
        for (ef, row) in rows {
            if let TrainRow::Done(r) = row {
                let spec = r.method();
                let fam = plot::family(&spec);
                if !variants.contains(&spec) {
                    variants.push(spec.clone());
                }
                // Its place among its family's codecs picks its colour.
                let variant = variants
                    .iter()
                    .filter(|w| plot::family(w) == fam)
                    .position(|w| *w == spec)
                    .unwrap_or(0);
                let s = plot::Series {
                    name: format!("{spec}{}", if *ef { " + EF" } else { "" }),
                    pts: curve(&r.curve),
                    dashed: *ef,
                    variant,
                };
                series.push((spec, s));
            }
        }
        let reference = plot::Series {
            name: "fp32".into(),
            pts: curve(&base.curve),
            dashed: false,
            variant: usize::MAX,
        };
        plot::small_multiples(
            path,
            &format!(
                "test loss of the {} on the synthetic task, {} workers (dashed: with error feedback)",
                model.name(),
                cfg.workers
            ),
            &plot::by_family(series),
            &reference,
            &plot::Axes {
                x: (1.0, cfg.epochs.max(2) as f64),
                x_log: false,
                x_label: "epoch".into(),
                y_label: "test loss".into(),
                mark_x: None,
            },
        )?;
        Ok(())
    }
}
