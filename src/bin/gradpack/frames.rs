//! `encode`, `decode` and `inspect`: files to frames and back.

use std::io::Write;
use std::path::Path;

use gradpack::{Codec, CodecSpec, EncodeCtx};

use crate::Res;
use crate::io::{
    fmt_shape, is_npy, is_std, parse_shape, read_f32, read_frame, shown, write_f32, write_output,
};

/// Bits per element for messages: `8.125 bits per element`, or `no elements` for an
/// empty frame (whose header alone would be "448 bits per element").
fn fmt_bits(bytes: usize, elements: u64) -> String {
    if elements == 0 {
        "no elements".into()
    } else {
        format!(
            "{:.3} bits per element",
            bytes as f64 * 8.0 / elements as f64
        )
    }
}

pub(crate) fn encode(
    codec: &str,
    seed: u64,
    offset: u64,
    checksum: bool,
    input: &Path,
    output: &Path,
) -> Res<()> {
    let mut spec: CodecSpec = codec
        .parse()
        .map_err(|e| format!("--codec {codec:?}: {e}"))?;
    let (x, shape) = read_f32(input)?;
    let out_name = shown(output, "stdout");
    // `dct` without a width tiles along the flat array; a 2-D (or more) input has rows,
    // so its 2-D tiles follow them unless the spec says otherwise.
    if let (CodecSpec::Dct(d), Some(s)) = (&spec, &shape)
        && d.width() == 0
        && s.len() >= 2
        && !codec.contains("width=")
    {
        let w = *s.last().expect("2-D");
        match u32::try_from(w).ok().filter(|&w| w > 0).map(|w| {
            gradpack::Dct::new(d.chunk(), d.k(), w, d.values())
                .map(|c| c.with_transform(d.transform()))
        }) {
            Some(Ok(with_rows)) => {
                eprintln!(
                    "{out_name}: note: dct tiles follow the input's rows of {w} (width={w}); \
                     pass width=0 for tiles along the flat array"
                );
                spec = CodecSpec::Dct(with_rows);
            }
            _ => eprintln!(
                "{out_name}: note: dct tiles run along the flat array (rows of {w} do not \
                 make 2-D tiles)"
            ),
        }
    }
    let ctx = EncodeCtx::new(seed).with_offset(offset);
    let frame = if checksum {
        gradpack::Checksummed(spec).encode(&x, &ctx)
    } else {
        spec.encode(&x, &ctx)
    }
    .map_err(|e| format!("encoding {}: {e}", shown(input, "stdin")))?;
    write_output(output, &frame)?;
    eprintln!(
        "{out_name}: {} elements -> {} bytes ({}, {spec})",
        x.len(),
        frame.len(),
        fmt_bits(frame.len(), x.len() as u64)
    );
    // A seed a codec never reads would be dropped without a word: say so (the payload of
    // another seed is the same bits).
    // The encoder flagged non-finite input in the header: count it only then.
    let nonfinite = gradpack::inspect(&frame).is_ok_and(|(h, _)| h.nonfinite());
    if seed != 0 && !nonfinite {
        let other = spec
            .encode(&x, &EncodeCtx::new(seed ^ 1).with_offset(offset))
            .map_err(|e| format!("encoding {}: {e}", shown(input, "stdin")))?;
        // The payloads compared (a seal's CRC-32 follows the payload).
        if frame.get(gradpack::HEADER_LEN..other.len()) == other.get(gradpack::HEADER_LEN..) {
            eprintln!(
                "{out_name}: note: {spec} draws no random numbers here, so --seed changes \
                 nothing (stochastic rounding, e.g. int8:rounding=stochastic, does)"
            );
        }
    }
    let bad = if nonfinite {
        x.iter().filter(|v| !v.is_finite()).count()
    } else {
        0
    };
    if bad > 0 {
        eprintln!(
            "{out_name}: note: the input holds {bad} NaN or infinite values; the frame is \
             flagged (inspect shows it) and they decode as non-finite"
        );
    }
    // Frames hold a flat list of values: say how to get the shape back.
    if let Some(s) = shape.filter(|s| s.len() != 1) {
        eprintln!(
            "{out_name}: the input's shape is ({}); `gradpack decode --shape {:?}` restores it",
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
    format: Option<&str>,
) -> Res<()> {
    let npy = match format {
        None => is_npy(output),
        Some("npy") => true,
        Some("raw") => false,
        Some(f) => return Err(format!("--format {f:?}: accepted values are raw, npy")),
    };
    let shape = shape.map(parse_shape).transpose()?;
    if shape.is_some() && !npy {
        return Err(format!(
            "--shape: {} is raw f32, which has no shape: name the output .npy{}",
            shown(output, "stdout"),
            if is_std(output) {
                " or pass --format npy"
            } else {
                ""
            }
        ));
    }
    let frame = read_frame(input)?;
    let x = decode_limited(input, &frame, max_elements)?;
    // A 2-D dct frame knows its row length: a shape that does not end in it is the
    // transposed (or another) shape.
    if let (Some(s), Ok((_, CodecSpec::Dct(d)))) = (&shape, gradpack::inspect(&frame))
        && d.width() > 0
        && s.last() != Some(&u64::from(d.width()))
    {
        return Err(format!(
            "--shape {}: the frame's rows are {} long (dct width={}), so its shape ends in {}",
            fmt_shape(s),
            d.width(),
            d.width(),
            d.width()
        ));
    }
    write_f32(output, &x, npy, shape.as_deref())
}

pub(crate) fn inspect(file: &str, max_elements: Option<u64>, reference: Option<&Path>) -> Res<()> {
    let frame = read_frame(file)?;
    let (h, spec) = gradpack::inspect(&frame).map_err(|e| format!("{file}: invalid frame: {e}"))?;
    outln!("file        {file} ({} bytes)", frame.len());
    outln!("codec       {spec}");
    outln!("elements    {}", h.elements);
    outln!("payload     {} bytes", h.payload_len);
    outln!(
        "bits/elem   {}",
        if h.elements == 0 {
            "- (no elements)".to_string()
        } else {
            format!("{:.4}", frame.len() as f64 * 8.0 / h.elements as f64)
        }
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
    if h.payload_checksum() {
        outln!("valid       yes (header checksum, payload checksum, fields and payload all check)");
    } else {
        // Without the seal a changed payload byte usually still decodes: say what was
        // checked, and what was not.
        outln!(
            "valid       decodes (header checksum and fields check; the payload is not \
             checksummed: encode with --checksum to seal it)"
        );
    }
    // One streaming pass (no copy of the decoded values).
    let mut st = Stats::default();
    x.iter().for_each(|&v| st.add(v));
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
    if let Some(r) = reference {
        against_reference(r, &x, h.offset, &spec)?;
    }
    Ok(())
}

/// `inspect --reference`: the decoded values `d` against the original they were encoded
/// from (the whole reference, or the frame's part of it at its offset when the reference
/// is the whole tensor and the frame a chunk).
fn against_reference(path: &Path, d: &[f32], offset: u64, spec: &CodecSpec) -> Res<()> {
    let (r, _) = read_f32(path)?;
    let name = shown(path, "stdin");
    let n = d.len();
    let (x, part) = if r.len() == n {
        (&r[..], String::new())
    } else {
        let start = usize::try_from(offset)
            .ok()
            .filter(|&o| o.checked_add(n).is_some_and(|end| end <= r.len()));
        match start {
            Some(o) if offset > 0 => (&r[o..o + n], format!(", elements {o}..{}", o + n)),
            _ => {
                return Err(format!(
                    "--reference {name}: {} values, the frame {n} (at offset {offset}): give \
                     the array the frame was encoded from",
                    r.len()
                ));
            }
        }
    };
    outln!("reference   {name} ({} values{part})", r.len());
    // Non-finite originals must decode to the same kind (rule 7: never silent).
    let (mut num, mut den, mut worst, mut at, mut absmax) = (0f64, 0f64, 0f64, 0usize, 0f64);
    let mut lost = 0u64;
    for (i, (&a, &b)) in x.iter().zip(d).enumerate() {
        if !a.is_finite() {
            lost += u64::from(a.is_nan() != b.is_nan() || (a.is_infinite() && a != b));
            continue;
        }
        let e = (f64::from(a) - f64::from(b)).abs();
        num += e * e;
        den += f64::from(a) * f64::from(a);
        absmax = absmax.max(f64::from(a).abs());
        if e > worst || e.is_nan() {
            (worst, at) = (e, i);
        }
    }
    let rel = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    outln!(
        "error       rel L2 {rel:.3e}  RMS {:.3e}  max |x - D(x)| {worst:.3e} at {at}",
        (num / n.max(1) as f64).sqrt()
    );
    let bound = spec.error_bound(absmax);
    outln!(
        "bound       {} {bound:.3e}: the codec's bound for |x| <= {absmax:.3e}{}",
        if worst <= bound { "within" } else { "EXCEEDS" },
        if lost > 0 {
            format!("; {lost} non-finite values not kept")
        } else {
            String::new()
        }
    );
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
