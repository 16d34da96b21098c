//! `encode`, `decode` and `inspect`: files to frames and back.

use std::io::Write;
use std::path::Path;

use gradpack::{Codec, CodecSpec, EncodeCtx};

use crate::Res;
use crate::io::{fmt_shape, parse_shape, read_f32, read_frame, write_f32, write_output};

pub(crate) fn encode(
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
    let (x, shape) = read_f32(input)?;
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
    // Frames hold a flat list of values: say how to get the shape back.
    if let Some(s) = shape.filter(|s| s.len() != 1) {
        eprintln!(
            "{}: the input's shape is ({}); `gradpack decode --shape {:?}` restores it",
            output.display(),
            s.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
            fmt_shape(&s)
        );
    }
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

pub(crate) fn decode(
    input: &str,
    output: &Path,
    max_elements: Option<u64>,
    shape: Option<&str>,
) -> Res<()> {
    let shape = shape.map(parse_shape).transpose()?;
    let frame = read_frame(input)?;
    let x = decode_limited(input, &frame, max_elements)?;
    write_f32(output, &x, shape.as_deref())
}

pub(crate) fn inspect(file: &str, max_elements: Option<u64>) -> Res<()> {
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
