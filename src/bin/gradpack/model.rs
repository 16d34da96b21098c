//! `model`: the communication cost model alone, without measuring.

use std::io::Write;

use clap::Args;
use gradpack::cost::{self, CodecProfile, Strategy};

use crate::{Net, Res, specs};

#[derive(Args)]
pub(crate) struct ModelArgs {
    #[command(flatten)]
    net: Net,
    /// fp32 gradient size, e.g. 25MiB, 100MB, 4096.
    #[arg(long, default_value = "100MiB", allow_hyphen_values = true)]
    size: String,
    /// Codec spec (repeatable; default: a representative set).
    #[arg(long = "codec")]
    codecs: Vec<String>,
    /// Ranks per node: with more than 1, the ranks are grouped into nodes whose uplinks
    /// are the --bandwidth and --latency link, and the model compares the flat
    /// all-reduce with the two-level one (full precision inside a node).
    #[arg(long, default_value_t = 1)]
    per_node: u32,
    /// Bandwidth between two ranks of a node (with --per-node).
    #[arg(long, default_value = "100Gbit/s", allow_hyphen_values = true)]
    intra_bandwidth: String,
    /// Per-message latency inside a node (with --per-node).
    #[arg(long, default_value = "2us", allow_hyphen_values = true)]
    intra_latency: String,
}

pub(crate) fn model(a: ModelArgs) -> Res<()> {
    let net = a.net.parse()?;
    let bytes = cost::parse_size(&a.size).map_err(|e| format!("--size: {e}"))?;
    let specs = specs(&a.codecs)?;
    let elements = (bytes / 4.0).floor().max(1.0);
    let g_bits = elements * 32.0;
    let p = net.nodes;
    let abg = cost::AlphaBetaGamma::new(net.bandwidth, net.latency, f64::INFINITY);
    let mut out = std::io::stdout().lock();
    let w = |out: &mut std::io::StdoutLock, s: String| {
        writeln!(out, "{s}").map_err(crate::stdout_error)
    };
    w(
        &mut out,
        format!(
            "cost model: {:.0} f32 elements ({}), {p} nodes, {:.2} Gbit/s, {:.1} us latency; compute is free\n",
            elements,
            a.size,
            net.bandwidth / 1e9,
            net.latency * 1e6
        ),
    )?;
    w(
        &mut out,
        "fp32 all-reduce (Thakur, Rabenseifner and Gropp 2005; gamma = 0):".into(),
    )?;
    for (name, t) in [
        ("ring", abg.ring_allreduce(p, bytes)),
        ("binomial tree", abg.binomial_tree_allreduce(p, bytes)),
        (
            "recursive doubling",
            abg.recursive_doubling_allreduce(p, bytes),
        ),
        ("halving-doubling", abg.halving_doubling_allreduce(p, bytes)),
    ] {
        w(&mut out, format!("  {name:<20} {:>10.3} ms", t * 1e3))?;
    }
    w(
        &mut out,
        format!(
            "  ideal ring 2(n-1)/n g/b {:>7.3} ms; with latency {:.3} ms\n",
            cost::ring_ideal(p, g_bits, net.bandwidth) * 1e3,
            cost::ring_with_latency(p, g_bits, net.bandwidth, net.latency) * 1e3
        ),
    )?;
    // The spec column fits the longest spec.
    let sw = specs
        .iter()
        .map(|s| s.to_string().len())
        .max()
        .unwrap_or(0)
        .max(4);
    w(
        &mut out,
        format!(
            "{:<sw$} {:>8} {:>6} {:>14} {:>12} {:>12} {:>11} {:>8}",
            "spec",
            "bits/el",
            "ratio",
            "k-bit ring ms",
            "ring ms",
            "allgather ms",
            "twoshot ms",
            "speedup"
        ),
    )?;
    let fp32 = abg.ring_allreduce(p, bytes);
    for s in &specs {
        let bits = s.bits_per_element(elements as usize);
        let c = CodecProfile::nominal(s.to_string(), bits);
        let t = |st| {
            cost::allreduce_cost(st, &c, p, net.latency, elements, f64::INFINITY)
                .time(net.bandwidth)
        };
        let (ring, ag, two) = (
            t(Strategy::CompressedRing),
            t(Strategy::CompressedAllGather),
            t(Strategy::TwoShot),
        );
        w(
            &mut out,
            format!(
                "{:<sw$} {:>8.3} {:>6.1} {:>14.3} {:>12.3} {:>12.3} {:>11.3} {:>8}",
                s.to_string(),
                bits,
                32.0 / bits,
                cost::ring_quantised(p, g_bits, net.bandwidth, bits) * 1e3,
                ring * 1e3,
                ag * 1e3,
                two * 1e3,
                speedup(fp32, ring.min(ag).min(two))
            ),
        )?;
    }
    if a.per_node > 1 {
        two_level(&mut out, &a, &net, elements, &specs)?;
    }
    Ok(())
}

/// The flat all-reduce against the two-level one on nodes of `--per-node` ranks.
fn two_level(
    out: &mut std::io::StdoutLock,
    a: &ModelArgs,
    net: &crate::Network,
    elements: f64,
    specs: &[gradpack::CodecSpec],
) -> Res<()> {
    let w = |out: &mut std::io::StdoutLock, s: String| {
        writeln!(out, "{s}").map_err(crate::stdout_error)
    };
    if !net.nodes.is_multiple_of(a.per_node) {
        return Err(format!(
            "--per-node {} does not divide --nodes {} (the ranks)",
            a.per_node, net.nodes
        ));
    }
    let two = cost::TwoLevel {
        nodes: net.nodes / a.per_node,
        per_node: a.per_node,
        intra_bandwidth_bit_s: cost::parse_bandwidth(&a.intra_bandwidth)
            .map_err(|e| format!("--intra-bandwidth: {e}"))?,
        intra_latency_s: cost::parse_duration(&a.intra_latency)
            .map_err(|e| format!("--intra-latency: {e}"))?,
        inter_bandwidth_bit_s: net.bandwidth,
        inter_latency_s: net.latency,
    };
    w(
        out,
        format!(
            "\ntwo levels: {} nodes of {} ranks, {:.2} Gbit/s and {:.1} us inside a node, the \
             node's uplink {:.2} Gbit/s and {:.1} us (its ranks' streams share it)",
            two.nodes,
            two.per_node,
            two.intra_bandwidth_bit_s / 1e9,
            two.intra_latency_s * 1e6,
            two.inter_bandwidth_bit_s / 1e9,
            two.inter_latency_s * 1e6
        ),
    )?;
    let sw = specs
        .iter()
        .map(|s| s.to_string().len())
        .max()
        .unwrap_or(0)
        .max(8);
    w(
        out,
        format!(
            "{:<sw$} {:>12} {:>16} {:>8}  best",
            "spec", "flat ms", "hierarchical ms", "speedup"
        ),
    )?;
    let fp32 = CodecProfile::nominal("identity", 32.0);
    let flat32 = cost::flat_time(Strategy::Fp32Ring, &fp32, &two, elements, f64::INFINITY);
    let mut rows = vec![("fp32".to_string(), fp32)];
    for s in specs {
        let bits = s.bits_per_element(elements as usize);
        rows.push((s.to_string(), CodecProfile::nominal(s.to_string(), bits)));
    }
    for (name, c) in rows {
        let strategies: &[Strategy] = if c.bits_per_element >= 32.0 {
            &[Strategy::Fp32Ring]
        } else {
            cost::candidates(&c)
        };
        let best = |f: &dyn Fn(Strategy) -> f64| {
            strategies
                .iter()
                .map(|&st| (st, f(st)))
                .fold((strategies[0], f64::INFINITY), |m, x| {
                    if x.1 < m.1 { x } else { m }
                })
        };
        let flat = best(&|st| cost::flat_time(st, &c, &two, elements, f64::INFINITY));
        let hier = best(&|st| cost::hierarchical_time(st, &c, &two, elements, 32.0, f64::INFINITY));
        let (label, t) = if hier.1 < flat.1 {
            (
                format!("hierarchical, {} between nodes", hier.0.name()),
                hier.1,
            )
        } else {
            (format!("flat {}", flat.0.name()), flat.1)
        };
        w(
            out,
            format!(
                "{name:<sw$} {:>12.3} {:>16.3} {:>8}  {label}",
                flat.1 * 1e3,
                hier.1 * 1e3,
                speedup(flat32, t)
            ),
        )?;
    }
    Ok(())
}

/// `fp32 / t` as "1.23x", or "-" when both are zero (one node sends nothing).
pub(crate) fn speedup(fp32: f64, t: f64) -> String {
    if fp32 == 0.0 && t == 0.0 {
        "-".into()
    } else {
        format!("{:.2}x", fp32 / t)
    }
}
