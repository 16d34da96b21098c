//! The `gradpack` command-line tool (feature `cli`).
//!
//! - `gradpack report`: measure every codec on this CPU and model what it buys on a network;
//! - `gradpack encode` / `decode`: compress raw f32 or `.npy` files and back;
//! - `gradpack inspect`: a frame's header, validation and decoded statistics;
//! - `gradpack model`: the communication cost model alone, without measuring;
//! - `gradpack train`: data-parallel SGD of a small model with each codec, against fp32.
//!
//! Every error prints one line on stderr and exits with status 2.

/// `println!` that returns an error instead of panicking when stdout is closed (a pipe
/// into `head`, say): the command then ends with one line on stderr and status 2.
macro_rules! outln {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout().lock(), $($arg)*).map_err(|e| format!("writing to stdout: {e}"))?
    };
}

mod npy;
mod plot;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use gradpack::cost::{self, CodecProfile, Strategy};
use gradpack::{Backend, Codec, CodecSpec, EncodeCtx, ErrorFeedback};

type Res<T> = Result<T, String>;

#[derive(Parser)]
#[command(
    name = "gradpack",
    version,
    about = "Gradient compression for data-parallel training: measure, model, encode, decode"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Measure each codec on this CPU and model its all-reduce time on a network.
    Report(ReportArgs),
    /// Encode raw little-endian f32 (or .npy float32) into a gradpack frame.
    Encode {
        /// Codec spec, e.g. int8, qsgd:bits=4, topk:ratio=0.01.
        #[arg(long)]
        codec: String,
        /// Seed of the stochastic codecs' draws.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Global index of the first element (for chunks of a larger tensor).
        #[arg(long, default_value_t = 0)]
        offset: u64,
        /// Seal the frame with a CRC-32 of its payload (4 more bytes; decoders verify it).
        #[arg(long)]
        checksum: bool,
        /// Input: raw little-endian f32, or .npy (float32, 1-D or any shape, C order).
        input: PathBuf,
        /// Output frame.
        output: PathBuf,
    },
    /// Decode a frame into raw little-endian f32 (or .npy when OUT ends in .npy).
    Decode {
        /// Input frame (`-` for stdin).
        input: String,
        /// Output: raw f32, or .npy.
        output: PathBuf,
        /// Decode frames of up to this many elements (default: 4096 per byte of frame, at
        /// least 65536; a very sparse top-k or random-k frame can hold more).
        #[arg(long)]
        max_elements: Option<u64>,
    },
    /// Show a frame's header, whether it is valid, and statistics of its decoded values.
    Inspect {
        /// The frame file, or `-` for stdin.
        file: String,
        /// Decode frames of up to this many elements (as for `decode`).
        #[arg(long)]
        max_elements: Option<u64>,
    },
    /// The cost model alone: all-reduce times from nominal codec sizes, no measuring.
    Model(ModelArgs),
    /// Train a small model data-parallel with each codec (with and without error
    /// feedback) and compare final loss and accuracy with fp32.
    Train(TrainArgs),
}

#[derive(Args)]
struct TrainArgs {
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
    /// All-reduce strategy for the compressed runs: allgather, ring or majority.
    #[arg(long, default_value = "allgather")]
    strategy: String,
    /// Codec spec (repeatable; default: a representative set).
    #[arg(long = "codec")]
    codecs: Vec<String>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an SVG of the test-loss curves to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Args)]
struct Net {
    /// Number of ranks.
    #[arg(long, default_value_t = 8)]
    nodes: u32,
    /// Link bandwidth, e.g. 25Gbit/s, 10Gbps, 100Mbit/s, 1.25GB/s.
    #[arg(long, default_value = "25Gbit/s", allow_hyphen_values = true)]
    bandwidth: String,
    /// Per-message latency, e.g. 5us, 1ms.
    #[arg(long, default_value = "5us", allow_hyphen_values = true)]
    latency: String,
}

#[derive(Args)]
struct ReportArgs {
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
}

#[derive(Args)]
struct ModelArgs {
    #[command(flatten)]
    net: Net,
    /// fp32 gradient size, e.g. 25MiB, 100MB, 4096.
    #[arg(long, default_value = "100MiB")]
    size: String,
    /// Codec spec (repeatable; default: a representative set).
    #[arg(long = "codec")]
    codecs: Vec<String>,
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Report(a) => report(a),
        Cmd::Encode {
            codec,
            seed,
            offset,
            checksum,
            input,
            output,
        } => encode(&codec, seed, offset, checksum, &input, &output),
        Cmd::Decode {
            input,
            output,
            max_elements,
        } => decode(&input, &output, max_elements),
        Cmd::Inspect { file, max_elements } => inspect(&file, max_elements),
        Cmd::Model(a) => model(a),
        Cmd::Train(a) => train(a),
    };
    if let Err(e) = r {
        eprintln!("gradpack: error: {e}");
        std::process::exit(2);
    }
}

// ---------------------------------------------------------------- shared

struct Network {
    nodes: u32,
    bandwidth: f64,
    latency: f64,
}

impl Net {
    fn parse(&self) -> Res<Network> {
        if self.nodes == 0 {
            return Err("--nodes must be at least 1".into());
        }
        Ok(Network {
            nodes: self.nodes,
            bandwidth: cost::parse_bandwidth(&self.bandwidth)
                .map_err(|e| format!("--bandwidth: {e}"))?,
            latency: cost::parse_duration(&self.latency).map_err(|e| format!("--latency: {e}"))?,
        })
    }
}

fn specs(list: &[String]) -> Res<Vec<CodecSpec>> {
    let list: Vec<&str> = if list.is_empty() {
        gradpack::codec::REPRESENTATIVE_SPECS.to_vec()
    } else {
        list.iter().map(String::as_str).collect()
    };
    list.iter()
        .map(|s| {
            s.parse::<CodecSpec>()
                .map_err(|e| format!("--codec {s:?}: {e}"))
        })
        .collect()
}

/// A progress bar on stderr of `len` steps (hidden if `hidden`).
fn progress(len: u64, hidden: bool) -> indicatif::ProgressBar {
    if hidden {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}") {
        bar.set_style(style);
    }
    bar
}

/// Read one frame from a file or stdin (`-`): the header first, checked (magic, version,
/// checksum), then exactly the bytes it declares, so a file that is not a frame is
/// refused after reading 56 bytes, and memory follows what actually arrives.
fn read_frame(path: &str) -> Res<Vec<u8>> {
    let name = if path == "-" { "stdin" } else { path };
    let mut src: Box<dyn Read> = if path == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::fs::File::open(path).map_err(|e| format!("{path}: {e}"))?)
    };
    let mut frame = Vec::with_capacity(gradpack::HEADER_LEN);
    (&mut src)
        .take(gradpack::HEADER_LEN as u64)
        .read_to_end(&mut frame)
        .map_err(|e| format!("{name}: {e}"))?;
    let h = gradpack::Header::parse(&frame).map_err(|e| format!("{name}: invalid frame: {e}"))?;
    let total = h
        .frame_len()
        .ok_or_else(|| format!("{name}: invalid frame: its declared length overflows"))?;
    // Read what the header declares (growing as data arrives), plus one byte to tell
    // trailing data from none.
    (&mut src)
        .take(total + 1 - gradpack::HEADER_LEN as u64)
        .read_to_end(&mut frame)
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(frame)
}

fn write_output(path: &Path, bytes: &[u8]) -> Res<()> {
    std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}

fn is_npy(p: &Path) -> bool {
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("npy"))
}

fn read_f32(path: &Path) -> Res<Vec<f32>> {
    let b = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // What the bytes are decides, not the name: a renamed .npy is still read as one.
    if is_npy(path) || b.starts_with(b"\x93NUMPY") {
        return npy::read(&b).map_err(|e| format!("{}: {e}", path.display()));
    }
    if b.starts_with(b"PK\x03\x04") {
        return Err(format!(
            "{}: a zip archive (an .npz?), not an array: save the one array as .npy \
             (numpy.save) or as raw little-endian float32",
            path.display()
        ));
    }
    if b.starts_with(b"GPAK") {
        return Err(format!(
            "{}: a gradpack frame, not an array: decode it first (gradpack decode)",
            path.display()
        ));
    }
    if b.len() % 4 != 0 {
        return Err(format!(
            "{}: {} bytes is not a whole number of little-endian f32 values",
            path.display(),
            b.len()
        ));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn write_f32(path: &Path, x: &[f32]) -> Res<()> {
    if is_npy(path) {
        write_output(path, &npy::write(x))
    } else {
        write_output(path, bytemuck::cast_slice(x))
    }
}

// ---------------------------------------------------------------- encode / decode / inspect

fn encode(
    codec: &str,
    seed: u64,
    offset: u64,
    checksum: bool,
    input: &Path,
    output: &Path,
) -> Res<()> {
    let spec: CodecSpec = codec
        .parse()
        .map_err(|e| format!("--codec {codec:?}: {e}"))?;
    let x = read_f32(input)?;
    let ctx = EncodeCtx::new(seed).with_offset(offset);
    let frame = if checksum {
        gradpack::Checksummed(spec).encode(&x, &ctx)
    } else {
        spec.encode(&x, &ctx)
    }
    .map_err(|e| format!("encoding {}: {e}", input.display()))?;
    write_output(output, &frame)?;
    eprintln!(
        "{}: {} elements -> {} bytes ({:.3} bits per element, {spec})",
        output.display(),
        x.len(),
        frame.len(),
        frame.len() as f64 * 8.0 / x.len().max(1) as f64
    );
    Ok(())
}

/// Decode `frame` (read from `name`) within `max_elements` (default: the frame-size
/// limit); a frame over the limit gets an error that says how to decode it.
fn decode_limited(name: &str, frame: &[u8], max_elements: Option<u64>) -> Res<Vec<f32>> {
    let limit = max_elements.unwrap_or_else(|| gradpack::decode_limit(frame.len()));
    gradpack::decode_to_vec_with_limit(frame, limit).map_err(|e| match e {
        gradpack::Error::TooLarge { elements, limit } if limit < usize::MAX as u64 => format!(
            "{name}: the frame holds {elements} elements, more than the {limit} decoded by \
             default for a frame of {} bytes (a sparse frame can hold many); pass \
             --max-elements {elements} to decode it into {} MiB",
            frame.len(),
            elements.saturating_mul(4).div_ceil(1 << 20)
        ),
        e => format!("{name}: invalid frame: {e}"),
    })
}

fn decode(input: &str, output: &Path, max_elements: Option<u64>) -> Res<()> {
    let frame = read_frame(input)?;
    let x = decode_limited(input, &frame, max_elements)?;
    write_f32(output, &x)
}

fn inspect(file: &str, max_elements: Option<u64>) -> Res<()> {
    let frame = read_frame(file)?;
    let (h, spec) = gradpack::inspect(&frame).map_err(|e| format!("{file}: invalid frame: {e}"))?;
    outln!("file        {file} ({} bytes)", frame.len());
    outln!("codec       {spec}");
    outln!("elements    {}", h.elements);
    outln!("payload     {} bytes", h.payload_len);
    outln!(
        "bits/elem   {:.4}",
        frame.len() as f64 * 8.0 / h.elements.max(1) as f64
    );
    outln!("seed        {}", h.seed);
    outln!("offset      {}", h.offset);
    outln!(
        "flags       {:#06x}{}",
        h.flags,
        match (h.nonfinite(), h.payload_checksum()) {
            (true, true) => " (input held NaN or Inf; payload checksum)",
            (true, false) => " (input held NaN or Inf)",
            (false, true) => " (payload checksum)",
            (false, false) => "",
        }
    );
    let x = decode_limited(file, &frame, max_elements)?;
    outln!(
        "valid       yes (header checksum, {}fields and payload all check)",
        if h.payload_checksum() {
            "payload checksum, "
        } else {
            ""
        }
    );
    // One streaming pass (no copy of the decoded values).
    let mut st = Stats::default();
    x.iter().for_each(|&v| st.add(v));
    drop(x);
    outln!(
        "decoded     {} values: {} zero, {} NaN, {} Inf",
        st.count,
        st.zeros,
        st.nan,
        st.inf
    );
    if st.finite > 0 {
        outln!(
            "            min {:.6e}  max {:.6e}  mean {:.6e}  L2 norm {:.6e}",
            st.min,
            st.max,
            st.sum / st.finite as f64,
            st.sq.sqrt()
        );
    }
    Ok(())
}

/// Statistics of decoded values, gathered one value at a time.
struct Stats {
    count: u64,
    zeros: u64,
    nan: u64,
    inf: u64,
    finite: u64,
    sum: f64,
    sq: f64,
    min: f64,
    max: f64,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            count: 0,
            zeros: 0,
            nan: 0,
            inf: 0,
            finite: 0,
            sum: 0.0,
            sq: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }
}

impl Stats {
    fn add(&mut self, v: f32) {
        self.count += 1;
        self.zeros += u64::from(v == 0.0);
        self.nan += u64::from(v.is_nan());
        self.inf += u64::from(v.is_infinite());
        if v.is_finite() {
            let v = f64::from(v);
            self.finite += 1;
            self.sum += v;
            self.sq += v * v;
            self.min = self.min.min(v);
            self.max = self.max.max(v);
        }
    }
}

// ---------------------------------------------------------------- report

#[derive(Clone)]
struct Measured {
    spec: CodecSpec,
    bits: f64,
    rel_l2: f64,
    /// `||sum g - sum D|| / ||sum g||` after `EF_STEPS` steps of error feedback (`None`:
    /// the codec is not usable with error feedback).
    ef_rel_l2: Option<f64>,
    enc: f64,
    dec: f64,
    add: f64,
}

/// Steps of error feedback behind the report's "EF rel L2" column.
const EF_STEPS: u64 = 8;

/// Median seconds of `f` over at least 5 runs and about `budget` seconds.
fn median_secs(budget: f64, mut f: impl FnMut()) -> f64 {
    f(); // warm up
    let start = Instant::now();
    let mut t = Vec::new();
    while t.len() < 5 || (start.elapsed().as_secs_f64() < budget && t.len() < 200) {
        let s = Instant::now();
        f();
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Error feedback over a few steps of fresh gradients: the error of what the model
/// actually receives, `||sum g - sum D|| / ||sum g||`. `None` when the codec refuses
/// error feedback (codecs that are not contractive: random-k with `scale=unbiased`,
/// QSGD with variance factor >= 1).
fn ef_error(
    spec: &CodecSpec,
    ef_grads: &[Vec<f32>],
    frame: &mut [u8],
    d: &mut [f32],
) -> Res<Option<f64>> {
    let n = d.len();
    let Ok(mut ef) = ErrorFeedback::new(*spec, n) else {
        return Ok(None);
    };
    if ef_grads.is_empty() {
        return Ok(Some(0.0));
    }
    let (mut sum_g, mut sum_d) = (vec![0f64; n], vec![0f64; n]);
    for (step, g) in ef_grads.iter().enumerate() {
        let l = ef
            .encode_into(g, &EncodeCtx::new(step as u64), frame)
            .map_err(|e| format!("{spec}: {e}"))?;
        gradpack::decode(&frame[..l], d).map_err(|e| format!("{spec}: {e}"))?;
        for i in 0..n {
            sum_g[i] += g[i] as f64;
            sum_d[i] += d[i] as f64;
        }
    }
    let (num, den) = sum_g
        .iter()
        .zip(&sum_d)
        .fold((0f64, 0f64), |(a, b), (&u, &v)| {
            (a + (u - v).powi(2), b + u * u)
        });
    Ok(Some((num / den).sqrt()))
}

/// Rounds of timing in `report`: every codec is timed once per round, the rounds
/// interleaved, so a slow spell of the machine touches every codec alike; a codec's
/// speeds are the medians over the rounds, and the spread of its break-even over the
/// rounds is printed beside it.
const ROUNDS: usize = 5;

/// One codec's encode, decode and decode_add speeds (bytes of f32 input per second).
#[derive(Clone, Copy)]
struct Speeds {
    enc: f64,
    dec: f64,
    add: f64,
}

/// Error figures of `spec` on `x` (speeds left at zero; [`time_round`] measures them).
fn measure(spec: &CodecSpec, x: &[f32], ef_grads: &[Vec<f32>]) -> Res<Measured> {
    let n = x.len();
    let ctx = EncodeCtx::new(1);
    let mut frame = vec![0u8; spec.max_encoded_len(n)];
    let len = spec
        .encode_into(x, &ctx, &mut frame)
        .map_err(|e| format!("{spec}: {e}"))?;
    let mut d = vec![0f32; n];
    gradpack::decode(&frame[..len], &mut d).map_err(|e| format!("{spec}: {e}"))?;
    let (num, den) = x.iter().zip(&d).fold((0f64, 0f64), |(a, b), (&u, &v)| {
        (a + (u as f64 - v as f64).powi(2), b + (u as f64).powi(2))
    });
    let ef_rel_l2 = ef_error(spec, ef_grads, &mut frame, &mut d)?;
    Ok(Measured {
        spec: *spec,
        bits: len as f64 * 8.0 / n as f64,
        rel_l2: (num / den).sqrt(),
        ef_rel_l2,
        enc: 0.0,
        dec: 0.0,
        add: 0.0,
    })
}

/// One round of timing of `spec` on `x`: the median of each operation over `budget`
/// seconds (at least 5 runs).
fn time_round(spec: &CodecSpec, x: &[f32], budget: f64) -> Res<Speeds> {
    let n = x.len();
    let ctx = EncodeCtx::new(1);
    let mut frame = vec![0u8; spec.max_encoded_len(n)];
    let len = spec
        .encode_into(x, &ctx, &mut frame)
        .map_err(|e| format!("{spec}: {e}"))?;
    let mut d = vec![0f32; n];
    let bytes = 4.0 * n as f64;
    let enc = median_secs(budget, || {
        spec.encode_into(x, &ctx, &mut frame).expect("encode");
    });
    let dec = median_secs(budget, || {
        gradpack::decode(&frame[..len], &mut d).expect("decode");
    });
    let add = median_secs(budget, || {
        gradpack::decode_add(&frame[..len], &mut d).expect("decode_add");
    });
    Ok(Speeds {
        enc: bytes / enc,
        dec: bytes / dec,
        add: bytes / add,
    })
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// `m` with the median speeds of `rounds`.
fn with_speeds(mut m: Measured, rounds: &[Speeds]) -> Measured {
    m.enc = median(rounds.iter().map(|s| s.enc).collect());
    m.dec = median(rounds.iter().map(|s| s.dec).collect());
    m.add = median(rounds.iter().map(|s| s.add).collect());
    m
}

fn profile(m: &Measured) -> CodecProfile {
    CodecProfile {
        spec: m.spec.to_string(),
        bits_per_element: m.bits,
        encode_bytes_per_s: m.enc,
        decode_bytes_per_s: m.dec,
        decode_add_bytes_per_s: m.add,
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock (days-to-civil conversion of
/// H. Hinnant's date algorithms).
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02}")
}

/// Where a codec pays, in Gbit/s: `always`, `never`, or intervals such as `<120.5`,
/// `>480.0`, `<120.5 or >480.0`.
fn fmt_pays(pays: &[(f64, f64)]) -> String {
    match pays {
        [] => "never".into(),
        [(lo, hi)] if *lo == 0.0 && hi.is_infinite() => "always".into(),
        _ => pays
            .iter()
            .map(|&(lo, hi)| match (lo == 0.0, hi.is_infinite()) {
                (true, _) => format!("<{:.1}", hi / 1e9),
                (false, true) => format!(">{:.1}", lo / 1e9),
                (false, false) => format!("{:.1}-{:.1}", lo / 1e9, hi / 1e9),
            })
            .collect::<Vec<_>>()
            .join(" or "),
    }
}

/// A break-even and, when the timing rounds disagree, their range.
fn fmt_be(be: f64, (lo, hi): (f64, f64)) -> String {
    if fmt_bw(lo) == fmt_bw(hi) {
        fmt_bw(be)
    } else {
        format!("{} ({}-{})", fmt_bw(be), fmt_bw(lo), fmt_bw(hi))
    }
}

fn fmt_bw(b: f64) -> String {
    if b.is_infinite() {
        "always".into()
    } else if b <= 0.0 {
        "never".into()
    } else {
        format!("{:.1}", b / 1e9)
    }
}

fn report(a: ReportArgs) -> Res<()> {
    let net = a.net.parse()?;
    if a.elements == 0 {
        return Err("--elements must be at least 1".into());
    }
    let backend = match &a.backend {
        None => Backend::current(),
        Some(name) => Backend::by_name(name)
            .map_err(|e| format!("--backend: {e}"))?
            .ok_or_else(|| format!("--backend {name}: not supported on this CPU"))?,
    };
    let specs = specs(&a.codecs)?;
    let n = a.elements;
    let x = gradpack::synthetic::gradient(n, 2024);
    let ef_grads: Vec<Vec<f32>> = (0..EF_STEPS)
        .map(|s| gradpack::synthetic::gradient(n, 3000 + s))
        .collect();
    // Time budget per operation and round: about 20 s of timing for the whole default
    // report.
    let budget = 0.3_f64.min(20.0 / (3.0 * (specs.len() + 1) as f64)) / ROUNDS as f64;
    let bar = progress(((specs.len() + 1) * (ROUNDS + 1)) as u64, false);
    let identity: CodecSpec = "identity".parse().expect("identity parses");
    bar.set_message("errors");
    let base = backend.run(|| measure(&identity, &x, &[]))?;
    bar.inc(1);
    let mut rows = Vec::new();
    for s in &specs {
        bar.set_message(format!("{s}: errors"));
        rows.push(backend.run(|| measure(s, &x, &ef_grads))?);
        bar.inc(1);
    }
    // Timing rounds: identity (the fp32 reduction) and every codec, interleaved; each
    // codec's timing is paired with a timing of the fp32 reduction just before it, so
    // both see the machine in the same state, and each round gives a break-even.
    let mut base_rounds = Vec::new();
    let mut row_rounds: Vec<Vec<(Speeds, f64)>> = vec![Vec::new(); specs.len()];
    for round in 0..ROUNDS {
        bar.set_message(format!("timing, round {} of {ROUNDS}", round + 1));
        base_rounds.push(backend.run(|| time_round(&identity, &x, budget))?);
        bar.inc(1);
        for (s, r) in specs.iter().zip(row_rounds.iter_mut()) {
            let reduce = backend.run(|| time_round(&identity, &x, budget / 3.0))?.add;
            r.push((backend.run(|| time_round(s, &x, budget))?, reduce));
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let base = with_speeds(base, &base_rounds);
    let rows: Vec<Measured> = rows
        .into_iter()
        .zip(&row_rounds)
        .map(|(m, r)| with_speeds(m, &r.iter().map(|p| p.0).collect::<Vec<_>>()))
        .collect();

    // fp32: the faster of the ring (its reduction is an f32 add, which identity's
    // decode_add measures) and an all-gather of fp32 frames.
    let reduce = base.add;
    let elements = n as f64;
    let cluster = cost::Cluster {
        nodes: net.nodes,
        bandwidth_bit_s: net.bandwidth,
        latency_s: net.latency,
    };
    let (fp32_strategy, fp32) = cost::best_fp32(&profile(&base), &cluster, elements, reduce);
    struct Row<'a> {
        m: &'a Measured,
        strategy: Strategy,
        t: f64,
        /// Where the codec pays (bit/s intervals), from the median speeds.
        pays: Vec<(f64, f64)>,
        /// When it pays below a break-even and only there: that break-even, and the
        /// lowest and highest of the timing rounds' break-evens.
        be: Option<(f64, (f64, f64))>,
    }
    let id = profile(&base);
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
        .zip(&row_rounds)
        .map(|(m, rounds)| {
            let p = profile(m);
            let (strategy, t) = cost::best_strategy(&p, &cluster, elements, reduce);
            let pays = region(&p, reduce);
            let be = below(&pays).and_then(|be| {
                let per_round: Option<Vec<f64>> = rounds
                    .iter()
                    .map(|(s, reduce)| {
                        let p = profile(&with_speeds(m.clone(), std::slice::from_ref(s)));
                        below(&region(&p, *reduce))
                    })
                    .collect();
                let per_round = per_round?;
                let range = per_round
                    .iter()
                    .fold((f64::INFINITY, 0f64), |(lo, hi), &b| (lo.min(b), hi.max(b)));
                Some((be, range))
            });
            Row {
                m,
                strategy,
                t,
                pays,
                be,
            }
        })
        .collect();

    if a.json {
        let codecs: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "spec": r.m.spec.to_string(),
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
                    // The lowest and highest break-even of the timing rounds.
                    "break_even_range_gbit_s": r.be.map(|b| [b.1.0 / 1e9, b.1.1 / 1e9]),
                    // Every interval of link speeds where it pays (null: no upper end).
                    "pays_at_gbit_s": r.pays.iter().map(|&(lo, hi)| {
                        [Some(lo / 1e9), hi.is_finite().then_some(hi / 1e9)]
                    }).collect::<Vec<_>>(),
                    "allreduce_s": r.t,
                    "speedup": fp32 / r.t,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "gradpack_version": env!("CARGO_PKG_VERSION"),
            "date": today(),
            "cpu": cpu_model(),
            "backend": backend.name(),
            "elements": n,
            "nodes": net.nodes,
            "bandwidth_bit_s": net.bandwidth,
            "latency_s": net.latency,
            "fp32_reduce_gb_s": reduce / 1e9,
            "fp32_allreduce_s": fp32,
            "fp32_strategy": fp32_strategy.name(),
            "codecs": codecs,
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?
        );
    } else {
        outln!(
            "gradpack {} report, {}: {n} f32 elements ({:.1} MiB) of the synthetic gradient on {} (backend {backend})",
            env!("CARGO_PKG_VERSION"),
            today(),
            n as f64 * 4.0 / 1048576.0,
            cpu_model(),
        );
        outln!(
            "all-reduce model: {} nodes, {:.1} Gbit/s links, {:.1} us latency; fp32 {:.3} ms ({}; sums at {:.1} GB/s)\n",
            net.nodes,
            net.bandwidth / 1e9,
            net.latency * 1e6,
            fp32 * 1e3,
            if fp32_strategy == Strategy::Fp32Ring {
                "ring"
            } else {
                "all-gather of fp32 frames"
            },
            reduce / 1e9
        );
        // The spec column fits the longest spec.
        let w = rows
            .iter()
            .map(|r| r.m.spec.to_string().len())
            .max()
            .unwrap_or(0)
            .max(4);
        outln!(
            "{:<w$} {:>7} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7} {:>9} {:>22} {:>9} {:>8}",
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
            "speedup"
        );
        for r in &rows {
            outln!(
                "{:<w$} {:>7.3} {:>6.1} {:>9.2e} {:>9} {:>8.2} {:>8.2} {:>8.2} {:>7} {:>9} {:>22} {:>9.3} {:>8}",
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
                    None => fmt_pays(&r.pays),
                },
                r.t * 1e3,
                speedup(fp32, r.t)
            );
        }
        outln!(
            "\nrel L2: ||x - D(x)|| / ||x||; EF rel L2: ||sum g - sum D|| / ||sum g|| after {EF_STEPS} steps of error feedback\n\
             (- where error feedback refuses a non-contractive codec);\n\
             break-even: the link speed (Gbit/s) below which the codec's all-reduce beats the fastest fp32 one, from\n\
             the median speeds of {ROUNDS} interleaved timing rounds, each timing the codec beside the fp32 sum (range:\n\
             the rounds' lowest and highest); where latency dominates, where it pays (>X: above X; always; never);\n\
             time: the modelled all-reduce at {:.1} Gbit/s with the best strategy (ring or allgather).",
            net.bandwidth / 1e9
        );
    }
    if let Some(path) = &a.plot {
        plot(
            path,
            &rows.iter().map(|r| profile(r.m)).collect::<Vec<_>>(),
            &profile(&base),
            &net,
            elements,
            reduce,
        )?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// All-reduce time against link bandwidth (1 to 400 Gbit/s, log-log), one line per codec
/// (best strategy at each bandwidth) and fp32.
fn plot(
    path: &Path,
    codecs: &[CodecProfile],
    base: &CodecProfile,
    net: &Network,
    elements: f64,
    reduce: f64,
) -> Res<()> {
    let bws: Vec<f64> = (0..=200)
        .map(|i| 1e9 * 400f64.powf(i as f64 / 200.0))
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
            x: (1.0, 400.0),
            x_log: true,
            x_label: "link bandwidth (Gbit/s)".into(),
            y_label: "time (ms)".into(),
        },
    )
}

// ---------------------------------------------------------------- model

fn model(a: ModelArgs) -> Res<()> {
    let net = a.net.parse()?;
    let bytes = cost::parse_size(&a.size).map_err(|e| format!("--size: {e}"))?;
    let specs = specs(&a.codecs)?;
    let elements = (bytes / 4.0).floor().max(1.0);
    let g_bits = elements * 32.0;
    let p = net.nodes;
    let abg = cost::AlphaBetaGamma::new(net.bandwidth, net.latency, f64::INFINITY);
    let mut out = std::io::stdout().lock();
    let w =
        |out: &mut std::io::StdoutLock, s: String| writeln!(out, "{s}").map_err(|e| e.to_string());
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
    w(
        &mut out,
        format!(
            "{:<32} {:>8} {:>6} {:>14} {:>12} {:>12} {:>8}",
            "spec", "bits/el", "ratio", "k-bit ring ms", "ring ms", "allgather ms", "speedup"
        ),
    )?;
    let fp32 = abg.ring_allreduce(p, bytes);
    for s in specs {
        let bits = s.bits_per_element(elements as usize);
        let c = CodecProfile::nominal(s.to_string(), bits);
        let t = |st| {
            cost::allreduce_cost(st, &c, p, net.latency, elements, f64::INFINITY)
                .time(net.bandwidth)
        };
        let (ring, ag) = (
            t(Strategy::CompressedRing),
            t(Strategy::CompressedAllGather),
        );
        w(
            &mut out,
            format!(
                "{:<32} {:>8.3} {:>6.1} {:>14.3} {:>12.3} {:>12.3} {:>8}",
                s.to_string(),
                bits,
                32.0 / bits,
                cost::ring_quantised(p, g_bits, net.bandwidth, bits) * 1e3,
                ring * 1e3,
                ag * 1e3,
                speedup(fp32, ring.min(ag))
            ),
        )?;
    }
    Ok(())
}

/// `fp32 / t` as "1.23x", or "-" when both are zero (one node sends nothing).
fn speedup(fp32: f64, t: f64) -> String {
    if fp32 == 0.0 && t == 0.0 {
        "-".into()
    } else {
        format!("{:.2}x", fp32 / t)
    }
}

// ---------------------------------------------------------------- train

/// One row of `gradpack train`: a finished run, or why it did not run.
enum TrainRow {
    Done(gradpack::train::TrainResult),
    Refused { codec: CodecSpec, reason: String },
}

fn train(a: TrainArgs) -> Res<()> {
    use gradpack::train::{Dataset, ModelKind, TrainConfig, TrainResult};
    let model = match a.model.as_str() {
        "softmax" => ModelKind::Softmax,
        "mlp" => ModelKind::Mlp { hidden: a.hidden },
        m => return Err(format!("--model {m:?}: accepted values are softmax, mlp")),
    };
    let strategy = match Strategy::from_name(&a.strategy) {
        Some(
            s @ (Strategy::CompressedAllGather | Strategy::CompressedRing | Strategy::SignMajority),
        ) => s,
        _ => {
            return Err(format!(
                "--strategy {:?}: accepted values are allgather, ring, majority",
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
    let specs = specs(&a.codecs)?;
    let ds = Dataset::synthetic(a.seed);
    let cfg = TrainConfig {
        model,
        workers: a.workers,
        epochs: a.epochs,
        batch: a.batch,
        lr: a.lr,
        seed: a.seed,
        strategy,
    };
    let runs = 1 + 2 * specs.len();
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
    for spec in &specs {
        for ef in [false, true] {
            bar.set_message(format!("{spec}{}", if ef { " + EF" } else { "" }));
            let row = match gradpack::train::train(&ds, &cfg, *spec, ef) {
                Ok(r) => TrainRow::Done(r),
                Err(e @ (gradpack::Error::Param { .. } | gradpack::Error::Collective(_))) => {
                    TrainRow::Refused {
                        codec: *spec,
                        reason: e.to_string(),
                    }
                }
                Err(e) => return Err(format!("{spec}: {e}")),
            };
            rows.push((ef, row));
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let b = base.last();
    let fmt_run = |r: &TrainResult| {
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
    };
    if a.json {
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
                "codec": r.codec.to_string(), "strategy": r.strategy.name(),
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
            "seed": cfg.seed, "baseline": run(&base), "runs": runs,
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?
        );
    } else {
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
                TrainRow::Done(r) => r.codec.to_string().len(),
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
            fmt_run(&base),
            base.bytes_per_worker,
            1.0
        );
        let mut notes: Vec<&str> = Vec::new();
        for (ef, row) in &rows {
            let ef_s = if *ef { "yes" } else { "no" };
            match row {
                TrainRow::Done(r) => outln!(
                    "{:<w$} {:>3} {} {:>13} {:>8.3}",
                    r.codec.to_string(),
                    ef_s,
                    fmt_run(r),
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
    }
    if let Some(path) = &a.plot {
        let curve = |c: &[gradpack::train::EpochPoint]| -> Vec<(f64, f64)> {
            c.iter()
                .filter(|p| p.test_loss.is_finite())
                .map(|p| (p.epoch as f64, p.test_loss))
                .collect()
        };
        // One panel per family; a codec and its error-feedback run share a colour.
        let mut variants: Vec<String> = Vec::new();
        let mut series = Vec::new();
        for (ef, row) in &rows {
            if let TrainRow::Done(r) = row {
                let spec = r.codec.to_string();
                let fam = plot::family(&spec);
                let variant = match variants.iter().position(|v| *v == spec) {
                    Some(v) => variants[..v]
                        .iter()
                        .filter(|w| plot::family(w) == fam)
                        .count(),
                    None => {
                        let k = variants.iter().filter(|w| plot::family(w) == fam).count();
                        variants.push(spec.clone());
                        k
                    }
                };
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
            },
        )?;
    }
    Ok(())
}
