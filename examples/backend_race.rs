//! Every backend this CPU has, on every codec's encode, decode, decode_add and error-
//! feedback step, in one process, alternated: the check that no backend is slower than
//! another on an operation it can run (an AVX-512 CPU also runs the AVX2 kernels, so its
//! backend must route each operation to the faster of the two).
//!
//! ```text
//! cargo run --release --example backend_race [ELEMENTS...] [SPEC...]
//! cargo run --release --example backend_race -- --routing
//! ```
//!
//! Sizes default to 65536 and 1048576, codecs to a representative list.
//!
//! With `--routing` (an AVX-512 CPU): the routing table measured on this CPU. Each row of
//! the table that applies to this CPU's vendor has its probe (a codec operation) timed
//! on the AVX2 backend and on the AVX-512 backend with its routing off, alternated as
//! below; the faster one is the row's measured choice (within 3%: level, the row's
//! choice stands). Prints each row's figures and verdict, then the rows for this vendor
//! in the table's source form, with this CPU and today's date, to replace the ones that
//! differ.
//!
//! `reduce x8` is [`gradpack::reduce_frames`] of eight frames of the codec, in GB/s of its
//! f32 output (one eighth of the elements decoded).
//!
//! Prints, per size, codec and operation, the best of 8 rounds (each round times every
//! backend once, 0.1 s of repetitions each, in an order that alternates between rounds) in GB/s of f32, the same run's
//! memcpy and read pass (a 16-lane sum, as the criterion benches' `read_sum`), and each
//! backend's ratio to the fastest.

use std::time::Instant;

/// The criterion benches' helpers: `read_pass`, the same-run read baseline.
#[path = "../benches/common/mod.rs"]
mod common;
use common::read_pass;

use gradpack::codec::REPRESENTATIVE_SPECS;
use gradpack::{Backend, BackendKind, Codec, CodecSpec, EncodeCtx, ErrorFeedback};

/// Beside the representative set: top-k's approximate selection and plain f32.
const EXTRA_SPECS: [&str; 2] = ["topk:ratio=0.01,values=fp16,select=approx", "identity"];

/// Seconds per call of `f`, best over repetitions filling about 0.1 s.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut reps = 0u32;
    let mut best = f64::INFINITY;
    while start.elapsed().as_secs_f64() < 0.1 || reps < 3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        reps += 1;
    }
    best
}

/// A buffer that starts on a 4 KiB boundary wherever the allocator put it, so that a
/// race's figures do not depend on the allocator's placement, which differs between two
/// builds of this program (it once made a copy of f32 values 10% slower in one build).
struct Aligned<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

const PAGE: usize = 4096;

impl<T: Copy + Default> Aligned<T> {
    fn zeroed(len: usize) -> Aligned<T> {
        let size = std::mem::size_of::<T>();
        let buf = vec![T::default(); len + PAGE / size];
        let start = (PAGE - buf.as_ptr() as usize % PAGE) % PAGE / size;
        Aligned { buf, start, len }
    }

    fn from_slice(s: &[T]) -> Aligned<T> {
        let mut a = Aligned::zeroed(s.len());
        a.copy_from_slice(s);
        a
    }
}

impl<T> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

impl AsRef<[u8]> for Aligned<u8> {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// A codec operation the race times.
#[derive(Clone, Copy, PartialEq)]
enum RaceOp {
    Encode,
    Decode,
    DecodeAdd,
    Feedback,
    Reduce,
}

impl RaceOp {
    const ALL: [RaceOp; 5] = [
        RaceOp::Encode,
        RaceOp::Decode,
        RaceOp::DecodeAdd,
        RaceOp::Feedback,
        RaceOp::Reduce,
    ];

    fn name(self) -> &'static str {
        match self {
            RaceOp::Encode => "encode",
            RaceOp::Decode => "decode",
            RaceOp::DecodeAdd => "decode_add",
            RaceOp::Feedback => "feedback",
            RaceOp::Reduce => "reduce x8",
        }
    }
}

/// One codec on `n` elements, ready to race: its input, a frame, eight frames for the
/// reduction and its error-feedback state (where it has one). Every buffer starts on a
/// 4 KiB boundary.
struct Bench {
    codec: CodecSpec,
    x: Aligned<f32>,
    ctx: EncodeCtx,
    frame: Aligned<u8>,
    frame_ok: Aligned<u8>,
    eight: Vec<Aligned<u8>>,
    out: Aligned<f32>,
    ef: Option<ErrorFeedback>,
}

/// The synthetic gradient of `n` elements from `seed`, as values of the type a
/// `lossless:dtype=bf16` or `fp16` codec takes (rounded by the plain codec of that type,
/// what it cannot hold set to 0).
fn sample(codec: &CodecSpec, n: usize, seed: u64) -> Vec<f32> {
    let x = gradpack::synthetic::gradient(n, seed);
    let plain = match codec {
        CodecSpec::Lossless(l) if l.dtype() == gradpack::FloatType::Bf16 => "bf16",
        CodecSpec::Lossless(l) if l.dtype() == gradpack::FloatType::Fp16 => "fp16",
        _ => return x,
    };
    let c: CodecSpec = plain.parse().expect("spec");
    let mut y = c
        .decode(&c.encode(&x, &EncodeCtx::new(0)).expect("encode"))
        .expect("decode");
    y.iter_mut()
        .filter(|v| !v.is_finite())
        .for_each(|v| *v = 0.0);
    y
}

impl Bench {
    fn new(spec: &str, n: usize) -> Bench {
        let codec: CodecSpec = spec.parse().expect("spec");
        let x = Aligned::from_slice(&sample(&codec, n, 3));
        let ctx = EncodeCtx::new(9);
        let mut frame = Aligned::zeroed(codec.max_encoded_len(n));
        let len = codec.encode_into(&x, &ctx, &mut frame).expect("encode");
        let frame_ok = Aligned::from_slice(&frame[..len]);
        // Eight frames of the same codec for the fused reduction.
        let eight: Vec<Aligned<u8>> = (0..8u64)
            .map(|q| {
                let xq = sample(&codec, n, 20 + q);
                Aligned::from_slice(&codec.encode(&xq, &EncodeCtx::new(q)).expect("encode"))
            })
            .collect();
        let ef = ErrorFeedback::new(codec, n).ok();
        Bench {
            codec,
            x,
            ctx,
            frame,
            frame_ok,
            eight,
            out: Aligned::zeroed(n),
            ef,
        }
    }

    /// The best seconds per call of `op` on each backend, over 8 rounds in an order that
    /// alternates between rounds; `None` where the codec has no such operation.
    fn race(&mut self, op: RaceOp, backends: &[Backend]) -> Option<Vec<f64>> {
        if op == RaceOp::Feedback && self.ef.is_none() {
            return None;
        }
        let mut best = vec![f64::INFINITY; backends.len()];
        for round in 0..8 {
            // Alternate the order, so that neither backend always goes first.
            let mut order: Vec<usize> = (0..backends.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let Bench {
                    codec,
                    x,
                    ctx,
                    frame,
                    frame_ok,
                    eight,
                    out,
                    ef,
                } = self;
                let t = backends[i].run(|| match op {
                    RaceOp::Encode => time(|| {
                        codec.encode_into(x, ctx, frame).expect("encode");
                    }),
                    RaceOp::Decode => time(|| codec.decode_into(frame_ok, out).expect("decode")),
                    RaceOp::DecodeAdd => {
                        time(|| codec.decode_add(frame_ok, out).expect("decode_add"))
                    }
                    RaceOp::Reduce => time(|| {
                        gradpack::reduce_frames(eight, out).expect("reduce");
                    }),
                    RaceOp::Feedback => {
                        let ef = ef.as_mut().expect("feedback state");
                        time(|| {
                            ef.encode_into(x, ctx, frame).expect("feedback");
                        })
                    }
                });
                best[i] = best[i].min(t);
            }
        }
        Some(best)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    gradpack::parallel::set_min_len(usize::MAX);
    if args.iter().any(|a| a == "--routing") {
        return routing();
    }
    let sizes: Vec<usize> = {
        let v: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
        if v.is_empty() {
            vec![1 << 16, 1 << 20]
        } else {
            v
        }
    };
    let specs: Vec<&str> = {
        let v: Vec<&str> = args
            .iter()
            .filter(|a| a.parse::<usize>().is_err())
            .map(String::as_str)
            .collect();
        if v.is_empty() {
            REPRESENTATIVE_SPECS
                .iter()
                .chain(&EXTRA_SPECS)
                .copied()
                .collect()
        } else {
            v
        }
    };
    let backends: Vec<Backend> = BackendKind::ALL
        .into_iter()
        .filter(|k| *k != BackendKind::Scalar)
        .filter_map(Backend::of)
        .collect();
    println!(
        "backends: {:?}; best of 8 rounds in alternating order, GB/s of f32 input, one thread\n",
        backends.iter().map(|b| b.kind().name()).collect::<Vec<_>>()
    );
    for &n in &sizes {
        let x = Aligned::from_slice(&gradpack::synthetic::gradient(n, 3));
        let src = Aligned::from_slice(bytemuck::cast_slice::<f32, u8>(&x));
        let mut dst = Aligned::<u8>::zeroed(src.len());
        let memcpy = (0..7)
            .map(|_| time(|| dst.copy_from_slice(&src)))
            .fold(f64::INFINITY, f64::min);
        let read = (0..7)
            .map(|_| time(|| _ = std::hint::black_box(read_pass(std::hint::black_box(&x)))))
            .fold(f64::INFINITY, f64::min);
        let gbs = |t: f64| 4.0 * n as f64 / t / 1e9;
        println!(
            "## {n} elements (memcpy {:.1} GB/s, read pass {:.1} GB/s)\n",
            gbs(memcpy),
            gbs(read)
        );
        print!("| codec | operation |");
        for b in &backends {
            print!(" {} GB/s |", b.kind().name());
        }
        println!(" slowest / fastest |");
        println!("|---|---|{}---:|", "---:|".repeat(backends.len()));
        for &spec in &specs {
            let mut bench = Bench::new(spec, n);
            for op in RaceOp::ALL {
                let Some(best) = bench.race(op, &backends) else {
                    continue;
                };
                print!("| {spec} | {} |", op.name());
                for t in &best {
                    print!(" {:.1} |", gbs(*t));
                }
                let (lo, hi) = best
                    .iter()
                    .fold((f64::INFINITY, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
                println!(" {:.2} |", hi / lo);
            }
        }
        println!();
    }
}

/// `--routing`: each routing row that applies to this CPU, measured (see the module docs).
fn routing() {
    use gradpack::unstable::kernels::routing::{
        Measure, Probe, ROWS, Vendor, X86, row_source, unrouted,
    };
    let (Some(avx2), Some(avx512)) = (Backend::avx2(), Backend::avx512()) else {
        println!("SKIP --routing: this CPU has no AVX-512 backend (only it routes)");
        return;
    };
    let backends = [avx2, unrouted(avx512)];
    let vendor = Vendor::this();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| format!("{vendor:?}"));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let measured = format!("{}, {cores}-core {cpu}", today());
    println!(
        "routing rows measured on {measured} ({vendor:?}): AVX2 against AVX-512 unrouted, one thread\n"
    );
    println!(
        "| operation | CPU | calls | probe | table | avx2 GB/s | avx512 GB/s | avx512 / avx2 | verdict |"
    );
    println!("|---|---|---|---|---|---:|---:|---:|---|");
    let mut proposed = Vec::new();
    let mut cache: Vec<(Probe, [f64; 2])> = Vec::new();
    // An operation's rows after one that takes every call of this vendor are never
    // reached here.
    let mut closed = Vec::new();
    for row in ROWS.iter().filter(|r| r.cpu.covers(vendor)) {
        if closed.contains(&row.op) {
            proposed.push((*row, row.measured.to_string()));
            continue;
        }
        if row.when.is_always() {
            closed.push(row.op);
        }
        let Some(p) = row.probe else {
            println!(
                "| {:?} | {:?} | {} | none | {} | | | | not probed |",
                row.op,
                row.cpu,
                calls(&row_source(row)),
                row.takes.name()
            );
            proposed.push((*row, row.measured.to_string()));
            continue;
        };
        let t = match cache.iter().find(|(k, _)| *k == p) {
            Some((_, t)) => *t,
            None => {
                let op = match p.measure {
                    Measure::Encode => RaceOp::Encode,
                    Measure::Decode => RaceOp::Decode,
                    Measure::DecodeAdd => RaceOp::DecodeAdd,
                    Measure::Step => RaceOp::Feedback,
                    Measure::Reduce => RaceOp::Reduce,
                };
                let best = Bench::new(p.spec, p.elements)
                    .race(op, &backends)
                    .expect("the probe's operation exists (a unit test checks it)");
                cache.push((p, [best[0], best[1]]));
                [best[0], best[1]]
            }
        };
        let gbs = |t: f64| 4.0 * p.elements as f64 / t / 1e9;
        let speedup = t[0] / t[1];
        let faster = if speedup > 1.0 {
            X86::Avx512
        } else {
            X86::Avx2
        };
        // The table's `None` (a portable build) is AVX-512's own code too.
        let table = if row.takes == X86::None {
            X86::Avx512
        } else {
            row.takes
        };
        let verdict = if (speedup - 1.0).abs() <= 0.03 {
            "level"
        } else if faster == table {
            "agrees"
        } else {
            "DIFFERS"
        };
        println!(
            "| {:?} | {:?} | {} | {} {:?} {} | {} | {:.1} | {:.1} | {speedup:.2} | {verdict} |",
            row.op,
            row.cpu,
            calls(&row_source(row)),
            p.spec,
            p.measure,
            p.elements,
            row.takes.name(),
            gbs(t[0]),
            gbs(t[1])
        );
        if verdict == "DIFFERS" {
            let mut r = *row;
            r.takes = faster;
            r.cpu = match vendor {
                Vendor::Intel => Vendor::Intel,
                _ => Vendor::Amd,
            };
            proposed.push((r, format!("{measured}: {speedup:.2}")));
            // A row for every vendor keeps its choice for the others.
            if row.cpu == Vendor::Any {
                proposed.push((*row, row.measured.to_string()));
            }
        } else {
            proposed.push((*row, row.measured.to_string()));
        }
    }
    println!(
        "\nThe rows for this vendor ({vendor:?}), as measured: op, CPU, calls, code (measured)\n"
    );
    for (r, m) in proposed {
        println!("{}  // {m}", row_source(&r));
    }
}

/// The calls column: a row's `when` in source form.
fn calls(source: &str) -> String {
    source
        .splitn(3, ", ")
        .nth(2)
        .and_then(|w| w.rsplit_once(", "))
        .map_or(String::new(), |(w, _)| w.to_string())
}

/// Today's date (UTC) as YYYY-MM-DD.
fn today() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Days since 1970-01-01 to a civil date (the proleptic Gregorian calendar).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}
