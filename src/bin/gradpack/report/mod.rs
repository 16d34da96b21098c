//! `report`: measure every codec on this CPU and model what it buys on a network.
//!
//! [`report`] runs the phases in turn: the arguments checked ([`Setup`]), every codec
//! measured and timed (`measure`), the cost model's rows ([`Model`]), the training runs
//! and the recommendation, then the JSON, the table or the wide tables (`format`) and the
//! plot.

mod format;
mod json;
mod measure;

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use gradpack::cost::{self, CodecProfile, Strategy};
use gradpack::{Backend, CodecSpec};

use crate::model::speedup;
use crate::recommend::{
    Candidate, MAX_EF_ERROR, Recommendation, Verdict, explain, judge, recommend,
};
use crate::{Net, Network, Res, progress, specs};
use format::{
    Row, fit_pays, fmt_bw, fmt_err, fmt_lowrank_be, plot, same_region, stable, wide_tables,
};
use measure::{
    EF_STEPS, LowRankRow, Measured, POWERSGD_RANKS, ROUNDS, Speeds, Trained, cpu_model, encoded,
    matrix_shape, measure, profile, read_inputs, time_add, time_powersgd, time_round, today,
    train_rows, with_speeds,
};

#[derive(Args)]
pub(crate) struct ReportArgs {
    /// Gradient elements (f32) to measure on.
    #[arg(long, default_value_t = 1 << 22)]
    elements: usize,
    #[command(flatten)]
    net: Net,
    /// Codec spec to measure (repeatable; default: a representative set).
    #[arg(long = "codec")]
    codecs: Vec<String>,
    /// Backend to force: scalar, avx2, avx512, neon (default: the best this CPU has).
    #[arg(long)]
    backend: Option<String>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an SVG of all-reduce time against link bandwidth to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Print every column (speeds, backend, the break-even's range) and the PowerSGD
    /// table; by default the table fits a terminal of 100 columns.
    #[arg(long)]
    wide: bool,
    /// Measure the error columns (and time the codecs) on this gradient instead of the
    /// synthetic one: .npy (any float dtype) or raw little-endian f32. Repeat it with the
    /// gradients of successive steps for the error-feedback column (one file: the same
    /// gradient every step).
    #[arg(long = "input", conflicts_with = "elements")]
    inputs: Vec<PathBuf>,
    /// Skip the short training runs behind the `acc` column: the recommendation then
    /// rests on the error-feedback error alone (marked `yes?`).
    #[arg(long)]
    no_train: bool,
    /// The most test accuracy (percentage points) a codec may lose against fp32 in the
    /// training runs and still count as tracking fp32.
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true)]
    tolerance: f64,
}

/// The checked arguments and the gradients to measure on.
struct Setup {
    net: Network,
    backend: Backend,
    specs: Vec<CodecSpec>,
    /// The names the short table shows: what the user typed, or the report's short specs.
    names: Vec<String>,
    /// The gradient measured and timed, those of the error-feedback steps, and what they
    /// are (for the header).
    x: Vec<f32>,
    ef_grads: Vec<Vec<f32>>,
    source: String,
    /// PowerSGD's rows beside the default codecs; with --codec, only the codecs asked for.
    ps_ranks: &'static [usize],
}

/// The arguments checked (every refusal before a run of a minute or two) and the
/// gradients read or made.
fn setup(a: &ReportArgs) -> Res<Setup> {
    let net = a.net.parse()?;
    if a.plot.as_ref().is_some_and(|p| crate::io::is_std(p)) {
        return Err("--plot -: stdout carries the report; give the SVG a file name".into());
    }
    if net.nodes < 2 {
        return Err(format!(
            "--nodes {}: the report models all-reduces between ranks, and one rank sends \
             nothing; give 2 or more",
            net.nodes
        ));
    }
    if let Some(p) = &a.plot {
        crate::io::check_writable(p, "--plot")?; // before a run of a minute or two
    }
    if a.elements == 0 && a.inputs.is_empty() {
        return Err("--elements must be at least 1".into());
    }
    let backend = match &a.backend {
        None => Backend::current(),
        Some(name) => Backend::by_name(name)
            .map_err(|e| format!("--backend: {e}"))?
            .ok_or_else(|| format!("--backend {name}: not supported on this CPU"))?,
    };
    let specs = specs(&a.codecs)?;
    // The names the short table shows: what the user typed, or the report's short specs.
    let names: Vec<String> = if a.codecs.is_empty() {
        gradpack::codec::REPRESENTATIVE_SPECS
            .iter()
            .map(|s| s.to_string())
            .collect()
    } else {
        a.codecs.clone()
    };
    if !(a.tolerance.is_finite() && a.tolerance >= 0.0) {
        return Err(format!(
            "--tolerance {}: expected percentage points >= 0, e.g. 0.5",
            a.tolerance
        ));
    }
    let (x, ef_grads, source) = if a.inputs.is_empty() {
        let n = a.elements;
        let ef: Vec<Vec<f32>> = (0..EF_STEPS)
            .map(|s| gradpack::synthetic::gradient(n, 3000 + s))
            .collect();
        (
            gradpack::synthetic::gradient(n, 2024),
            ef,
            "the synthetic gradient".to_string(),
        )
    } else {
        read_inputs(&a.inputs)?
    };
    let ps_ranks: &'static [usize] = if a.codecs.is_empty() {
        &POWERSGD_RANKS
    } else {
        &[]
    };
    Ok(Setup {
        net,
        backend,
        specs,
        names,
        x,
        ef_grads,
        source,
        ps_ranks,
    })
}

pub(crate) fn report(a: ReportArgs) -> Res<()> {
    let s = setup(&a)?;
    let train_runs = if a.no_train {
        0
    } else {
        1 + s.specs.len() + s.ps_ranks.len()
    };
    // The first line at once: a report takes a minute or two, and a reader should see it
    // has started (the progress bar shows only on a terminal; elsewhere `phase` prints a
    // line per phase on stderr).
    if !a.json {
        outln!(
            "gradpack {} report, {}, on {} (backend {})",
            env!("CARGO_PKG_VERSION"),
            today(),
            cpu_model(),
            s.backend,
        );
    }
    let started = std::time::Instant::now();
    let phase = |what: String| {
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() {
            eprintln!(
                "gradpack report: {what} ({:.0} s so far)",
                started.elapsed().as_secs_f64()
            );
        }
    };
    let bar = progress(
        ((s.specs.len() + 1) * (ROUNDS + 1) + s.ps_ranks.len() + train_runs) as u64,
        false,
    );
    let m = measure_all(&s, &phase, &bar)?;
    let model = Model::new(&s, &m);
    let trained = if a.no_train {
        None
    } else {
        phase(format!(
            "training fp32, {} codecs and {} PowerSGD ranks (the longest part)",
            model.rows.len(),
            s.ps_ranks.len()
        ));
        Some(train_rows(&model.rows, s.ps_ranks, &bar)?)
    };
    phase("done".to_string());
    bar.finish_and_clear();
    let cands = candidates(&model, &s.names, trained.as_ref());
    let verdicts: Vec<Verdict> = cands.iter().map(|c| judge(c, a.tolerance)).collect();
    let rec = recommend(&cands, model.fp32, a.tolerance);
    let out = Output {
        a: &a,
        s: &s,
        model: &model,
        cands: &cands,
        verdicts: &verdicts,
        rec: &rec,
        trained: trained.as_ref(),
    };
    if a.json {
        out.json()?;
    } else {
        out.text()?;
    }
    if let Some(path) = &a.plot {
        plot(
            path,
            &model
                .rows
                .iter()
                .zip(&s.names)
                .map(|(r, name)| CodecProfile {
                    spec: name.clone(),
                    ..profile(r.m)
                })
                .collect::<Vec<_>>(),
            &profile(&m.base),
            &s.net,
            model.elements,
            model.reduce,
        )?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Every codec's errors and speeds, fp32's, and PowerSGD's step times.
struct Measurements {
    base: Measured,
    rows: Vec<Measured>,
    /// Per codec, each timing round's speeds and the fp32 sum's speed timed beside them.
    row_rounds: Vec<Vec<(Speeds, f64)>>,
    /// Per PowerSGD rank, a step's time on the matrix `shape`.
    lowrank_compute: Vec<f64>,
    shape: (usize, usize),
}

/// Measure the errors of every codec, then time them and fp32 in interleaved rounds, then
/// time PowerSGD's steps.
fn measure_all(
    s: &Setup,
    phase: &dyn Fn(String),
    bar: &indicatif::ProgressBar,
) -> Res<Measurements> {
    let Setup {
        backend,
        specs,
        x,
        ef_grads,
        ps_ranks,
        ..
    } = s;
    let (backend, n) = (*backend, x.len());
    // Time budget per operation and round: about 20 s of timing for the whole default
    // report.
    let budget = 0.3_f64.min(20.0 / (3.0 * (specs.len() + 1) as f64)) / ROUNDS as f64;
    let identity: CodecSpec = "identity".parse().expect("identity parses");
    phase(format!("measuring the errors of {} codecs", specs.len()));
    bar.set_message("errors");
    let base = backend.run(|| measure(&identity, x, &[]))?;
    bar.inc(1);
    let mut rows = Vec::new();
    for c in specs {
        bar.set_message(format!("{c}: errors"));
        rows.push(backend.run(|| measure(c, x, ef_grads))?);
        bar.inc(1);
    }
    // Timing rounds: identity (the fp32 reduction) and every codec, interleaved; each
    // codec's timing is paired with a timing of the fp32 reduction just before it, so
    // both see the machine in the same state, and each round gives a break-even.
    let (sum_frame, sum_len) = encoded(&identity, x)?;
    let mut sum_acc = vec![0f32; n];
    let mut base_rounds = Vec::new();
    let mut row_rounds: Vec<Vec<(Speeds, f64)>> = vec![Vec::new(); specs.len()];
    phase(format!(
        "timing {} codecs and fp32, {ROUNDS} rounds",
        specs.len()
    ));
    for round in 0..ROUNDS {
        bar.set_message(format!("timing, round {} of {ROUNDS}", round + 1));
        base_rounds.push(backend.run(|| time_round(&identity, x, budget))?);
        bar.inc(1);
        for (c, r) in specs.iter().zip(row_rounds.iter_mut()) {
            let reduce = backend.run(|| time_add(&sum_frame[..sum_len], &mut sum_acc, budget));
            r.push((backend.run(|| time_round(c, x, budget))?, reduce));
            bar.inc(1);
        }
    }
    let (mrows, mcols) = matrix_shape(n);
    let mut lowrank_compute = Vec::new();
    if !ps_ranks.is_empty() {
        phase(format!("timing PowerSGD of ranks {ps_ranks:?}"));
    }
    for &rank in *ps_ranks {
        bar.set_message(format!("PowerSGD rank {rank}"));
        lowrank_compute.push(backend.run(|| time_powersgd(x, mrows, mcols, rank, ROUNDS))?);
        bar.inc(1);
    }
    let base = with_speeds(base, &base_rounds);
    let rows: Vec<Measured> = rows
        .into_iter()
        .zip(&row_rounds)
        .map(|(m, r)| with_speeds(m, &r.iter().map(|p| p.0).collect::<Vec<_>>()))
        .collect();

    Ok(Measurements {
        base,
        rows,
        row_rounds,
        lowrank_compute,
        shape: (mrows, mcols),
    })
}

/// What the cost model makes of the measurements.
struct Model<'a> {
    rows: Vec<Row<'a>>,
    lowrank: Vec<LowRankRow>,
    /// fp32's all-reduce: the faster of the ring and an all-gather of fp32 frames.
    fp32: f64,
    fp32_strategy: Strategy,
    /// The fp32 sum's speed (bytes/s), and the gradient's elements.
    reduce: f64,
    elements: f64,
    shape: (usize, usize),
}

impl<'a> Model<'a> {
    /// Every codec's all-reduce time and where it pays, PowerSGD's rows, and fp32's.
    fn new(s: &Setup, m: &'a Measurements) -> Model<'a> {
        let Measurements {
            base,
            rows,
            row_rounds,
            lowrank_compute,
            shape: (mrows, mcols),
        } = m;
        let (mrows, mcols, net, ps_ranks, n) = (*mrows, *mcols, &s.net, s.ps_ranks, s.x.len());
        // fp32: the faster of the ring (its reduction is an f32 add, which identity's
        // decode_add measures) and an all-gather of fp32 frames.
        let reduce = base.add;
        let elements = n as f64;
        let cluster = cost::Cluster {
            nodes: net.nodes,
            bandwidth_bit_s: net.bandwidth,
            latency_s: net.latency,
        };
        let (fp32_strategy, fp32) = cost::best_fp32(&profile(base), &cluster, elements, reduce);
        // PowerSGD: its compute on this CPU plus its two fp32 all-reduces of the factors.
        let lowrank: Vec<LowRankRow> = ps_ranks
            .iter()
            .zip(lowrank_compute)
            .map(|(&rank, &compute_s)| {
                let c = cost::powersgd_cost(
                    Strategy::Fp32Ring,
                    &profile(base),
                    net.nodes,
                    net.latency,
                    &[(mrows, mcols)],
                    rank,
                    reduce,
                );
                let r = rank.min(mrows).min(mcols) as f64;
                // Equal times: compute + F_p + 8 B_p / b = F_f + 8 B_f / b.
                let ring = cost::allreduce_cost(
                    Strategy::Fp32Ring,
                    &profile(base),
                    net.nodes,
                    net.latency,
                    elements,
                    reduce,
                );
                let extra = compute_s + c.fixed - ring.fixed;
                let saved = 8.0 * (ring.bytes - c.bytes);
                let break_even = if saved <= 0.0 {
                    0.0
                } else if extra <= 0.0 {
                    f64::INFINITY
                } else {
                    saved / extra
                };
                LowRankRow {
                    rank,
                    rows: mrows,
                    cols: mcols,
                    bits: 32.0 * (mrows + mcols) as f64 * r / (mrows * mcols) as f64,
                    compute_s,
                    t: compute_s + c.time(net.bandwidth),
                    break_even,
                }
            })
            .collect();
        let id = profile(base);
        let region = |p: &CodecProfile, reduce: f64| {
            cost::winning_bandwidths(p, &id, net.nodes, net.latency, elements, reduce)
        };
        // The break-even of a region that is one interval from 0 up to it.
        let below = |r: &[(f64, f64)]| match r {
            [(lo, hi)] if *lo == 0.0 && hi.is_finite() => Some(*hi),
            _ => None,
        };
        let rows: Vec<Row> = rows
            .iter()
            .zip(row_rounds)
            .map(|(m, rounds)| {
                let p = profile(m);
                let (strategy, t) = cost::best_strategy(&p, &cluster, elements, reduce);
                let pays = region(&p, reduce);
                // Where it pays by each timing round's own speeds.
                let round_pays: Vec<Vec<(f64, f64)>> = rounds
                    .iter()
                    .map(|(s, reduce)| {
                        let p = profile(&with_speeds(m.clone(), std::slice::from_ref(s)));
                        region(&p, *reduce)
                    })
                    .collect();
                let pays_stable = round_pays.iter().all(|r| same_region(r, &pays));
                let be = below(&pays).and_then(|be| {
                    let per_round: Option<Vec<f64>> = round_pays.iter().map(|r| below(r)).collect();
                    let per_round = per_round?;
                    // The spread of the estimates: every round's, and the one from the fastest
                    // speeds (which need not lie between the rounds').
                    let range = per_round
                        .iter()
                        .fold((be, be), |(lo, hi), &b| (lo.min(b), hi.max(b)));
                    Some((be, range))
                });
                Row {
                    m,
                    strategy,
                    t,
                    pays,
                    pays_stable,
                    be,
                }
            })
            .collect();
        Model {
            rows,
            lowrank,
            fp32,
            fp32_strategy,
            reduce,
            elements,
            shape: (mrows, mcols),
        }
    }

    /// fp32's strategy as the table names it.
    fn fp32_name(&self) -> &'static str {
        if self.fp32_strategy == Strategy::Fp32Ring {
            "ring"
        } else {
            "allgather"
        }
    }
}

/// Candidates for the recommendation: every codec row (with error feedback where it
/// accepts it), then the PowerSGD rows.
fn candidates(model: &Model, names: &[String], trained: Option<&Trained>) -> Vec<Candidate> {
    let mut cands: Vec<Candidate> = model
        .rows
        .iter()
        .zip(names)
        .enumerate()
        .map(|(i, (r, name))| Candidate {
            name: name.clone(),
            strategy: r.strategy.name(),
            time_s: r.t,
            ef_error: r.m.ef_rel_l2,
            feedback: r.m.ef_rel_l2.is_some(),
            accuracy_delta: trained.and_then(|t| t.codecs[i]),
        })
        .collect();
    for (k, l) in model.lowrank.iter().enumerate() {
        cands.push(Candidate {
            name: format!("powersgd:rank={}", l.rank),
            strategy: "ring",
            time_s: l.t,
            ef_error: None,
            feedback: true,
            accuracy_delta: trained.and_then(|t| t.powersgd[k]),
        });
    }
    cands
}

/// Everything the report prints.
struct Output<'a> {
    a: &'a ReportArgs,
    s: &'a Setup,
    model: &'a Model<'a>,
    cands: &'a [Candidate],
    verdicts: &'a [Verdict],
    rec: &'a Recommendation,
    trained: Option<&'a Trained>,
}

impl Output<'_> {
    /// The header, the table (or `--wide`'s tables) and the recommendation.
    fn text(&self) -> Res<()> {
        let Output {
            a,
            s,
            model,
            cands,
            verdicts,
            rec,
            trained,
        } = self;
        let (rows, lowrank, fp32, reduce) = (&model.rows, &model.lowrank, model.fp32, model.reduce);
        let (backend, net, n, source) = (s.backend, &s.net, s.x.len(), &s.source);
        let fp32_name = model.fp32_name();
        let (mrows, mcols) = model.shape;
        let network = format!("{} nodes at {} Gbit/s", net.nodes, fmt_bw(net.bandwidth));
        if a.inputs.is_empty() {
            outln!(
                "{n} f32 elements ({:.1} MiB) of {source}; the fp32 sum runs at {:.1} GB/s",
                n as f64 * 4.0 / 1048576.0,
                reduce / 1e9
            );
        } else {
            // The path on a line of its own, so the figures stay inside 100 columns.
            outln!("input: {source}");
            outln!(
                "{n} f32 elements ({:.1} MiB); the fp32 sum runs at {:.1} GB/s; acc: the \
                 built-in MLP",
                n as f64 * 4.0 / 1048576.0,
                reduce / 1e9
            );
        }
        outln!(
            "all-reduce model: {} nodes, {} Gbit/s links, {:.1} us latency; fp32 {:.3} ms ({fp32_name})\n",
            net.nodes,
            fmt_bw(net.bandwidth),
            net.latency * 1e6,
            fp32 * 1e3,
        );
        let acc = |i: usize| match cands[i].accuracy_delta {
            None => "-".to_string(),
            Some(d) if d.is_nan() => "diverged".to_string(),
            Some(d) => format!("{d:+.2}"),
        };
        if a.wide {
            wide_tables(
                rows,
                lowrank,
                verdicts,
                &acc,
                backend,
                fp32,
                (mrows, mcols),
                net,
            )?;
        } else {
            self.narrow(&acc)?;
        }
        outln!();
        for line in explain(
            cands,
            rec,
            &network,
            (fp32, fp32_name),
            trained.map(|t| t.fp32),
            a.tolerance,
        ) {
            outln!("{line}");
        }
        Ok(())
    }

    /// The table that fits 100 columns: every candidate and fp32, fastest first, and
    /// its legend.
    fn narrow(&self, acc: &dyn Fn(usize) -> String) -> Res<()> {
        let Output {
            a,
            s,
            model,
            cands,
            verdicts,
            ..
        } = self;
        let (rows, lowrank, fp32) = (&model.rows, &model.lowrank, model.fp32);
        let (net, fp32_name, (mrows, mcols)) = (&s.net, model.fp32_name(), model.shape);
        // Every candidate and fp32, fastest first.
        let mut order: Vec<Option<usize>> = (0..cands.len()).map(Some).collect();
        order.push(None);
        let time = |o: &Option<usize>| o.map_or(fp32, |i| cands[i].time_s);
        order.sort_by(|a, b| time(a).total_cmp(&time(b)));
        let w = cands.iter().map(|c| c.name.len()).max().unwrap_or(0).max(4);
        outln!(
            "{:<w$} {:>7} {:>7} {:>6} {:>6} {:>9} {:>8} {:>7} {:>10}",
            "spec",
            "bits/el",
            "EF err",
            "acc",
            "tracks",
            "strategy",
            "time ms",
            "speedup",
            "break-even"
        );
        for o in &order {
            let Some(i) = *o else {
                outln!(
                    "{:<w$} {:>7.3} {:>7} {:>6} {:>6} {:>9} {:>8.3} {:>7} {:>10}",
                    "fp32",
                    32.0,
                    "-",
                    "-",
                    "-",
                    fp32_name,
                    fp32 * 1e3,
                    "1.00x",
                    "-"
                );
                continue;
            };
            let c = &cands[i];
            let (bits, be) = match rows.get(i) {
                Some(r) => (
                    r.m.bits,
                    match r.be {
                        Some((be, range)) => {
                            format!("{}{}", fmt_bw(be), if stable(range) { "" } else { "?" })
                        }
                        // The same mark on every form when the rounds disagree.
                        None if r.pays_stable => fit_pays(&r.pays, 10),
                        None => format!("{}?", fit_pays(&r.pays, 9)),
                    },
                ),
                None => {
                    let l = &lowrank[i - rows.len()];
                    (l.bits, fmt_lowrank_be(l.break_even))
                }
            };
            outln!(
                "{:<w$} {:>7.3} {:>7} {:>6} {:>6} {:>9} {:>8.3} {:>7} {:>10}",
                c.name,
                bits,
                c.ef_error.map_or("-".to_string(), fmt_err),
                acc(i),
                verdicts[i].short(),
                c.strategy,
                c.time_s * 1e3,
                speedup(fp32, c.time_s),
                be
            );
        }
        outln!(
            "\nEF err: ||sum g - sum D|| / ||sum g|| after {EF_STEPS} steps of error feedback (-: not used);\n\
             acc: test accuracy against fp32 (points) of `gradpack train`'s MLP with the codec, its\n\
             error feedback and strategy; tracks: EF err < {MAX_EF_ERROR} and acc within -{} (yes?: not\n\
             trained); time: modelled all-reduce at {} Gbit/s by the fastest strategy; break-even:\n\
             the link speed (Gbit/s) below which it beats fp32, else the speeds where it does (<X, X-Y,\n\
             >X, always, never; …: more ranges, in --wide and --json); ?: on any of these, the timing\n\
             rounds disagree by more than 25%{}. --wide: every column.",
            a.tolerance,
            fmt_bw(net.bandwidth),
            if lowrank.is_empty() {
                String::new()
            } else {
                format!("; powersgd: a {mrows} x {mcols} matrix of it")
            }
        );
        Ok(())
    }
}
