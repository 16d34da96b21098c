//! The `gradpack` command-line tool (feature `cli`).
//!
//! - `gradpack report`: measure every codec on this CPU and model what it buys on a network;
//! - `gradpack encode` / `decode`: compress raw f32 or `.npy` files and back;
//! - `gradpack inspect`: a frame's header, validation and decoded statistics;
//! - `gradpack model`: the communication cost model alone, without measuring;
//! - `gradpack train`: data-parallel SGD of a small model with each codec, against fp32.
//!
//! Every error prints one line on stderr and exits with status 2.

/// `println!` that returns an error instead of panicking when stdout is closed: a pipe
/// closed by its reader (`| head`) ends the command quietly with status 0 (see
/// [`stdout_error`]), any other failure with one line on stderr and status 2.
macro_rules! outln {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout().lock(), $($arg)*).map_err(crate::stdout_error)?
    };
}

/// The error of a failed write to stdout: [`BROKEN_PIPE`] when the reader has gone (as
/// `head` does once it has its lines), which `main` ends on quietly.
pub(crate) fn stdout_error(e: std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        BROKEN_PIPE.to_string()
    } else {
        format!("writing to stdout: {e}")
    }
}

/// A crate error as the command line says it: the crate names its Rust option for
/// non-contractive error feedback, which the command line does not have.
pub(crate) fn cli_message(e: &str) -> String {
    e.replace(
        "; FeedbackOptions::allow_non_contractive overrides this",
        " (the command line runs error feedback with contractive codecs only: for random-k \
         use scale=none, for qsgd more bits or smaller blocks)",
    )
}

/// The error text that stands for "stdout's reader has gone": not an error to report.
pub(crate) const BROKEN_PIPE: &str = "\0stdout closed";

mod frames;
mod io;
mod model;
mod npy;
mod plot;
mod recommend;
mod report;
mod train;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use gradpack::CodecSpec;
use gradpack::cost;

use frames::{decode, encode, inspect};
use model::{ModelArgs, model};
use report::{ReportArgs, report};
use train::{TrainArgs, train};

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
    /// Encode raw little-endian f32, or a .npy array of any float type, into a gradpack
    /// frame.
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
        /// Input: raw little-endian f32, or .npy: float16, float32 or float64 (converted
        /// to float32, with a note), either byte order, C or Fortran order (read in C
        /// order), any shape (a `dct` spec without `width=` then tiles the rows of a 2-D
        /// array); `-` for stdin.
        input: PathBuf,
        /// Output frame (`-` for stdout).
        output: PathBuf,
    },
    /// Decode a frame into raw little-endian f32 (or .npy when OUT ends in .npy).
    Decode {
        /// Input frame (`-` for stdin).
        input: String,
        /// Output: raw f32, or .npy when its name ends in .npy (`-` for stdout, raw unless
        /// --format npy).
        output: PathBuf,
        /// Decode frames of up to this many elements (default: 4096 per byte of frame, at
        /// least 65536, so a 192 KiB dct frame may decode to 1 GiB; give the count you
        /// expect for a frame you do not trust. A very sparse top-k, random-k or
        /// chunktopk frame can hold more than the default).
        #[arg(long)]
        max_elements: Option<u64>,
        /// The array's shape for a .npy output, as `encode` printed it: 256,300 or
        /// "(256, 300)" ("" or "()" for a 0-d array); 1-D without it. Frames hold a flat
        /// list, so only a 2-D `dct` frame (its width) can tell a transposed shape.
        #[arg(long, allow_hyphen_values = true)]
        shape: Option<String>,
        /// Output format: raw (little-endian f32) or npy (default: by the output's name).
        #[arg(long)]
        format: Option<String>,
    },
    /// Show a frame's header, whether it is valid, and statistics of its decoded values.
    Inspect {
        /// The frame file, or `-` for stdin.
        file: String,
        /// Decode frames of up to this many elements (as for `decode`).
        #[arg(long)]
        max_elements: Option<u64>,
        /// The array the frame was encoded from (.npy or raw f32, or the whole tensor of
        /// a chunk at the frame's offset): print the frame's error against it and the
        /// codec's error bound.
        #[arg(long)]
        reference: Option<PathBuf>,
    },
    /// The cost model alone: all-reduce times from nominal codec sizes, no measuring.
    Model(ModelArgs),
    /// Train a small model data-parallel with each codec (with and without error
    /// feedback) and compare final loss and accuracy with fp32.
    Train(TrainArgs),
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
            shape,
            format,
        } => decode(
            &input,
            &output,
            max_elements,
            shape.as_deref(),
            format.as_deref(),
        ),
        Cmd::Inspect {
            file,
            max_elements,
            reference,
        } => inspect(&file, max_elements, reference.as_deref()),
        Cmd::Model(a) => model(a),
        Cmd::Train(a) => train(a),
    };
    if let Err(e) = r {
        if e == BROKEN_PIPE {
            // The reader of stdout has what it wanted: stop, as other tools do.
            std::process::exit(0);
        }
        eprintln!("gradpack: error: {}", cli_message(&e));
        std::process::exit(2);
    }
}

// ---------------------------------------------------------------- shared

pub(crate) struct Network {
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

pub(crate) fn specs(list: &[String]) -> Res<Vec<CodecSpec>> {
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
pub(crate) fn progress(len: u64, hidden: bool) -> indicatif::ProgressBar {
    if hidden {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}") {
        bar.set_style(style);
    }
    bar
}
