//! What each codec buys: encode throughput against the bytes it saves per second, and the
//! link bandwidth below which compressing pays, printed as a table after the criterion run.
//!
//! `cargo bench --bench tradeoff` (about a minute). Each codec is measured at 1 Mi elements
//! of the synthetic gradient on the default backend. From the medians:
//!
//! - saved GB/s = encode GB/s of f32 input * (1 - bits/32): wire bytes saved per second of
//!   encoding;
//! - point-to-point break-even: sending n elements raw takes `32n/B`; compressed,
//!   `4n/enc + 4n/dec + bits*n/B`. Compression pays below `B = (32 - bits) / (4/enc + 4/dec)`;
//! - all-reduce break-even on 8 nodes with 5 us latency, from `gradpack::cost` (best of the
//!   compressed ring and the all-gather, against an fp32 ring summing at the measured
//!   identity decode_add speed).

#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use gradpack::cost::{self, CodecProfile};
use gradpack::{Backend, Codec, CodecSpec, EncodeCtx};

const N: usize = 1 << 20;
/// identity (the fp32 reference, and the reduction speed) and the report's codecs.
fn specs() -> impl Iterator<Item = &'static str> {
    std::iter::once("identity").chain(gradpack::codec::REPRESENTATIVE_SPECS.iter().copied())
}

/// Seconds per iteration of every sample criterion took, by (spec, op).
type Samples = HashMap<(String, &'static str), Vec<f64>>;
static SAMPLES: Mutex<Option<Samples>> = Mutex::new(None);

fn record(spec: &str, op: &'static str, per_iter: f64) {
    let mut g = SAMPLES.lock().expect("lock");
    g.get_or_insert_with(HashMap::new)
        .entry((spec.to_string(), op))
        .or_default()
        .push(per_iter);
}

fn timed(spec: &str, op: &'static str, iters: u64, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    let el = start.elapsed();
    record(spec, op, el.as_secs_f64() / iters as f64);
    el
}

fn tradeoff(c: &mut Criterion) {
    let x = gradpack::synthetic::gradient(N, 7);
    let mut g = c.benchmark_group(format!("tradeoff/{N}"));
    g.throughput(Throughput::Bytes(4 * N as u64));
    for s in specs() {
        let spec: CodecSpec = s.parse().expect("spec");
        let ctx = EncodeCtx::new(1);
        let mut frame = vec![0u8; spec.max_encoded_len(N)];
        let len = spec.encode_into(&x, &ctx, &mut frame).expect("encode");
        let mut out = vec![0f32; N];
        record(s, "bits", len as f64 * 8.0 / N as f64);
        g.bench_function(BenchmarkId::new(s, "encode"), |b| {
            b.iter_custom(|iters| {
                timed(s, "encode", iters, || {
                    spec.encode_into(black_box(&x), &ctx, &mut frame)
                        .expect("encode");
                })
            })
        });
        g.bench_function(BenchmarkId::new(s, "decode"), |b| {
            b.iter_custom(|iters| {
                timed(s, "decode", iters, || {
                    gradpack::decode(black_box(&frame[..len]), &mut out).expect("decode");
                })
            })
        });
        g.bench_function(BenchmarkId::new(s, "decode_add"), |b| {
            b.iter_custom(|iters| {
                timed(s, "decode_add", iters, || {
                    gradpack::decode_add(black_box(&frame[..len]), &mut out).expect("decode_add");
                })
            })
        });
    }
    g.finish();
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn summary() {
    let g = SAMPLES.lock().expect("lock");
    let Some(m) = g.as_ref() else { return };
    let get = |s: &str, op| m.get(&(s.to_string(), op)).map(|v| median(v));
    let rate = |s: &str, op| get(s, op).map(|t| 4.0 * N as f64 / t);
    let Some(reduce) = rate("identity", "decode_add") else {
        return;
    };
    println!(
        "\ntradeoff at {N} elements on backend {} (medians; GB/s of f32 input):\n",
        Backend::current()
    );
    println!(
        "{:<30} {:>7} {:>9} {:>9} {:>10} {:>14} {:>16}",
        "spec",
        "bits/el",
        "enc GB/s",
        "dec GB/s",
        "saved GB/s",
        "p2p pays below",
        "8-node pays below"
    );
    let bw = |b: f64| {
        if b.is_infinite() {
            "always".to_string()
        } else if b <= 0.0 {
            "never".to_string()
        } else {
            format!("{:.1} Gbit/s", b / 1e9)
        }
    };
    for s in specs() {
        let (Some(bits), Some(enc), Some(dec), Some(add)) = (
            get(s, "bits"),
            rate(s, "encode"),
            rate(s, "decode"),
            rate(s, "decode_add"),
        ) else {
            continue;
        };
        let saved = enc * (1.0 - bits / 32.0);
        let p2p = (32.0 - bits) / (4.0 / enc + 4.0 / dec);
        let profile = CodecProfile {
            spec: s.to_string(),
            bits_per_element: bits,
            encode_bytes_per_s: enc,
            decode_bytes_per_s: dec,
            decode_add_bytes_per_s: add,
        };
        let ar = cost::break_even_bandwidth(&profile, 8, 5e-6, N as f64, reduce);
        println!(
            "{:<30} {:>7.3} {:>9.2} {:>9.2} {:>10.2} {:>14} {:>16}",
            s,
            bits,
            enc / 1e9,
            dec / 1e9,
            saved / 1e9,
            bw(p2p),
            bw(ar)
        );
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

criterion_group! { name = benches; config = config(); targets = tradeoff }

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
