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

pub(crate) fn write_output(path: &Path, bytes: &[u8]) -> Res<()> {
    std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}

fn is_npy(p: &Path) -> bool {
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("npy"))
}

pub(crate) fn read_f32(path: &Path) -> Res<Vec<f32>> {
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

pub(crate) fn write_f32(path: &Path, x: &[f32]) -> Res<()> {
    if is_npy(path) {
        write_output(path, &npy::write(x))
    } else {
        write_output(path, bytemuck::cast_slice(x))
    }
}
