//! Reading arrays and frames from files (or stdin), writing outputs.

use std::io::Read;
use std::path::Path;

use crate::{Res, npy};

/// Read one frame from a file or stdin (`-`): the header first, checked (magic, version,
/// checksum), then exactly the bytes it declares, so a file that is not a frame is
/// refused after reading 56 bytes, and memory follows what actually arrives.
pub(crate) fn read_frame(path: &str) -> Res<Vec<u8>> {
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

/// Whether `path` is `-`: stdin for an input, stdout for an output (a file named `-` is
/// `./-`).
pub(crate) fn is_std(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// How messages name `path`: `stdin` or `stdout` for `-` (as `std_name` says), else the
/// path.
pub(crate) fn shown(path: &Path, std_name: &str) -> String {
    if is_std(path) {
        std_name.to_string()
    } else {
        path.display().to_string()
    }
}

/// Write `bytes` to the file `path`, or to stdout for `-`.
pub(crate) fn write_output(path: &Path, bytes: &[u8]) -> Res<()> {
    if is_std(path) {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        return out
            .write_all(bytes)
            .and_then(|()| out.flush())
            .map_err(crate::stdout_error);
    }
    std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// Whether `p`'s name ends in `.npy`.
pub(crate) fn is_npy(p: &Path) -> bool {
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("npy"))
}

/// An input array: a `.npy` file (by its magic, whatever its name; any float dtype,
/// either byte order and memory order, converted to float32 in C order, with a note on
/// stderr) or raw little-endian f32; and its shape, if the file has one.
///
/// `-` reads stdin (a `.npy` by its magic, else raw f32).
pub(crate) fn read_f32(path: &Path) -> Res<(Vec<f32>, Option<Vec<u64>>)> {
    let b = if is_std(path) {
        let mut b = Vec::new();
        std::io::stdin()
            .lock()
            .read_to_end(&mut b)
            .map_err(|e| format!("stdin: {e}"))?;
        b
    } else {
        std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?
    };
    let path = &std::path::PathBuf::from(shown(path, "stdin"));
    // What the bytes are decides, not the name: a renamed .npy is still read as one.
    if is_npy(path) || b.starts_with(b"\x93NUMPY") {
        let a = npy::read(&b).map_err(|e| format!("{}: {e}", path.display()))?;
        if let Some(what) = &a.converted {
            eprintln!("{}: note: {what}", path.display());
        }
        return Ok((a.values, Some(a.shape)));
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
    let x = b
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((x, None))
}

/// Write `x` as `.npy` (if `npy`; with `shape`, whose product must be `x.len()`, or
/// 1-D) or as raw little-endian f32, to a file or stdout (`-`).
pub(crate) fn write_f32(path: &Path, x: &[f32], npy: bool, shape: Option<&[u64]>) -> Res<()> {
    if let Some(s) = shape {
        let count = s.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if count != Some(x.len() as u64) {
            return Err(format!(
                "--shape {}: {} elements, the frame holds {}",
                fmt_shape(s),
                count.map_or("more than 2^64".into(), |c| c.to_string()),
                x.len()
            ));
        }
    }
    if npy {
        write_output(path, &npy::write(x, shape))
    } else {
        write_output(path, bytemuck::cast_slice(x))
    }
}

/// A shape as `--shape` takes it: `256,300`; empty for a 0-d array.
pub(crate) fn fmt_shape(s: &[u64]) -> String {
    s.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// Parse `--shape`: comma-separated dimensions (`256,300`), also as Python prints a
/// shape (`(256, 300)`, `(256,)`, `[256, 300]`); empty or `()` for a 0-d array.
pub(crate) fn parse_shape(s: &str) -> Res<Vec<u64>> {
    let t = s.trim();
    let inner = match (t.chars().next(), t.chars().last()) {
        (Some('('), Some(')')) | (Some('['), Some(']')) => &t[1..t.len() - 1],
        _ => t,
    };
    let inner = inner.trim();
    if inner.is_empty() {
        return Ok(Vec::new());
    }
    // One trailing comma, as in Python's `(256,)`.
    let inner = inner.strip_suffix(',').unwrap_or(inner);
    inner
        .split(',')
        .map(|d| {
            d.trim().parse::<u64>().map_err(|_| {
                format!(
                    "--shape {s:?}: dimensions are whole numbers, e.g. 256,300 or \"(256, 300)\""
                )
            })
        })
        .collect()
}

/// Check that `path` can be written (its directory exists and a file can be made there),
/// so a bad path fails at once, not after the work; a file made only to check is
/// removed again. `what` names the option.
pub(crate) fn check_writable(path: &Path, what: &str) -> Res<()> {
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| format!("{what} {}: cannot write there: {e}", path.display()))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
