//! `.npy` files of float32: the reader the CLI uses for its inputs and the writer for
//! its outputs. Self-contained (no crate items), so the fuzz target `npy` runs the very
//! same reader.

/// Parse a version 1, 2 or 3 `.npy` file holding little-endian float32 in C order.
pub fn read(b: &[u8]) -> Result<Vec<f32>, String> {
    let bad = |m: &str| Err(format!("not a float32 .npy file: {m}"));
    if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
        return bad("missing the \\x93NUMPY magic");
    }
    let (hlen, start): (usize, usize) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 if b.len() >= 12 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        v => return bad(&format!("unsupported version {v}")),
    };
    let Some(header) = start.checked_add(hlen).and_then(|end| b.get(start..end)) else {
        return bad("truncated header");
    };
    let Ok(header) = std::str::from_utf8(header) else {
        return bad("header is not text");
    };
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}'"))?;
        let rest = header[i + key.len() + 2..].trim_start().strip_prefix(':')?;
        Some(rest.trim_start())
    };
    match field("descr") {
        Some(d) if d.starts_with("'<f4'") || d.starts_with("'float32'") => {}
        Some(d) => {
            return bad(&format!(
                "dtype {} (want '<f4')",
                d.split(',').next().unwrap_or(d)
            ));
        }
        None => return bad("no descr"),
    }
    if !field("fortran_order").is_some_and(|f| f.starts_with("False")) {
        return bad("Fortran order (want C order)");
    }
    let shape = field("shape")
        .and_then(|s| s.strip_prefix('('))
        .and_then(|s| s.split(')').next())
        .ok_or("not a float32 .npy file: no shape")?;
    // Elements and data bytes in checked arithmetic: a shape whose byte count overflows
    // is refused, never wrapped round to a small one.
    let mut bytes: u64 = 4;
    for d in shape.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let d: u64 = d
            .parse()
            .map_err(|_| format!("not a float32 .npy file: bad shape ({shape})"))?;
        bytes = bytes.checked_mul(d).ok_or_else(|| {
            format!("not a float32 .npy file: shape ({shape}) is more than 2^64 bytes")
        })?;
    }
    let data = &b[start + hlen..];
    if data.len() as u64 != bytes {
        return bad(&format!(
            "shape ({shape}) needs {bytes} data bytes, the file has {}",
            data.len()
        ));
    }
    Ok(data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A version 1.0 `.npy` of a 1-D float32 array.
pub fn write(x: &[f32]) -> Vec<u8> {
    let mut h = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        x.len()
    );
    // Pad with spaces so that the data starts on a 64-byte boundary; end with a newline.
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut out = Vec::with_capacity(10 + h.len() + 4 * x.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    for v in x {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}
