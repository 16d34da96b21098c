//! `.npy` files: the reader the CLI uses for its inputs (any float dtype, either byte
//! order, C or Fortran order, through the `npyz` crate) and the writer for its outputs
//! (float32, C order, with a shape). Self-contained (no crate items), so the fuzz target
//! `npy` runs the very same reader.

use npyz::{DType, NpyFile, Order, TypeChar};

/// An array read from a `.npy` file, as float32 in C order.
pub struct Array {
    pub values: Vec<f32>,
    /// Its shape (empty for a 0-d array).
    pub shape: Vec<u64>,
    /// What was done to make it float32 in C order, if anything (for a note to the user).
    pub converted: Option<String>,
}

/// Read a `.npy` file of float16, float32 or float64 (either byte order, C or Fortran
/// order) as float32 in C order. float64 values are rounded to the nearest float32
/// (overflow to ±Inf, which every codec then flags); float16 values convert exactly.
pub fn read(b: &[u8]) -> Result<Array, String> {
    let bad = |m: &dyn std::fmt::Display| format!("not a readable .npy file: {m}");
    if !b.starts_with(b"\x93NUMPY") {
        return Err(bad(&"missing the \\x93NUMPY magic"));
    }
    // The header's length against the bytes present, before the parser allocates it.
    let start = match b.get(6..12) {
        Some(&[1, _, l0, l1, ..]) => 10 + u16::from_le_bytes([l0, l1]) as u64,
        Some(&[2 | 3, _, l0, l1, l2, l3]) => 12 + u32::from_le_bytes([l0, l1, l2, l3]) as u64,
        Some(&[v, ..]) => return Err(bad(&format!("unsupported version {v}"))),
        _ => return Err(bad(&"truncated header")),
    };
    if start > b.len() as u64 {
        return Err(bad(&"truncated header"));
    }
    check_shape_text(&b[if b[6] == 1 { 10 } else { 12 }..start as usize]).map_err(|e| bad(&e))?;
    let file = NpyFile::new(b).map_err(|e| bad(&e))?;
    let shape = file.shape().to_vec();
    let order = file.order();
    let DType::Plain(ty) = file.dtype() else {
        return Err(bad(
            &"a structured or array dtype; want float16, float32 or float64",
        ));
    };
    let size = ty.size_field();
    if ty.type_char() != TypeChar::Float || !matches!(size, 2 | 4 | 8) {
        return Err(bad(&format!(
            "dtype {ty}; want float16, float32 or float64 (convert with numpy: a.astype(np.float32))"
        )));
    }
    // The data the shape declares, in checked arithmetic, against the bytes present:
    // nothing is allocated for data the file does not hold.
    let count = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(&format!("shape {shape:?} has more than 2^64 elements")))?;
    let need = count
        .checked_mul(size)
        .ok_or_else(|| bad(&format!("shape {shape:?} is more than 2^64 bytes")))?;
    let have = (b.len() as u64).saturating_sub(start);
    if need != have {
        return Err(bad(&format!(
            "shape {shape:?} of {ty} needs {need} data bytes, the file has {have}"
        )));
    }
    let io = |e: std::io::Error| bad(&e);
    let mut values: Vec<f32> = match size {
        2 => file
            .into_vec::<half::f16>()
            .map_err(io)?
            .into_iter()
            .map(f32::from)
            .collect(),
        4 => file.into_vec::<f32>().map_err(io)?,
        _ => file
            .into_vec::<f64>()
            .map_err(io)?
            .into_iter()
            .map(|v| v as f32)
            .collect(),
    };
    let mut notes = Vec::new();
    if size != 4 {
        notes.push(format!("{ty} converted to float32"));
    } else if ty.to_string().starts_with('>') {
        notes.push("big-endian float32 read".to_string());
    }
    if order == Order::Fortran && shape.len() > 1 {
        values = fortran_to_c(&values, &shape);
        notes.push("Fortran order rearranged to C order".to_string());
    }
    Ok(Array {
        values,
        shape,
        converted: (!notes.is_empty()).then(|| notes.join(", ")),
    })
}

/// The header text, checked before `npyz` sees it. Its brackets may nest at most
/// `MAX_NESTING` deep: `npyz`'s parser backtracks exponentially in the depth (a header of
/// 55 nested braces took minutes). And `npyz` multiplies the dimensions (for the element
/// count and the strides) without checking for overflow, which panics in a build with
/// overflow checks: the header must name one shape, of whole numbers, whose nonzero
/// dimensions multiply to at most 2^64 - 1 (every product `npyz` forms is then exact).
fn check_shape_text(header: &[u8]) -> Result<(), String> {
    const MAX_NESTING: usize = 8;
    let text = std::str::from_utf8(header).map_err(|_| "the header is not text".to_string())?;
    let mut depth = 0usize;
    for c in text.bytes() {
        match c {
            b'{' | b'[' | b'(' => depth += 1,
            b'}' | b']' | b')' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if depth > MAX_NESTING {
            return Err(format!(
                "the header nests brackets more than {MAX_NESTING} deep"
            ));
        }
    }
    if text.matches("shape").count() != 1 {
        return Err("the header must name exactly one shape".into());
    }
    let at = text.find("shape").unwrap_or(0);
    let rest = &text[at..];
    let dims = rest
        .find('(')
        .and_then(|o| rest[o + 1..].find(')').map(|c| &rest[o + 1..o + 1 + c]))
        .ok_or("the shape is not a tuple")?;
    let mut count = 1u64;
    for d in dims.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let d: u64 = d
            .trim_end_matches('L')
            .parse()
            .map_err(|_| format!("shape ({dims}): dimensions must be whole numbers"))?;
        if d != 0 {
            count = count
                .checked_mul(d)
                .ok_or_else(|| format!("shape ({dims}) has more than 2^64 elements"))?;
        }
    }
    Ok(())
}

/// The C-order copy of `x`, stored in Fortran order with `shape`.
fn fortran_to_c(x: &[f32], shape: &[u64]) -> Vec<f32> {
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    // Fortran strides: the first index moves fastest.
    let mut strides = vec![1usize; dims.len()];
    for k in 1..dims.len() {
        strides[k] = strides[k - 1] * dims[k - 1];
    }
    let mut out = Vec::with_capacity(x.len());
    let mut idx = vec![0usize; dims.len()];
    for _ in 0..x.len() {
        out.push(x[idx.iter().zip(&strides).map(|(i, s)| i * s).sum::<usize>()]);
        // The next C-order index: the last index moves fastest.
        for k in (0..dims.len()).rev() {
            idx[k] += 1;
            if idx[k] < dims[k] {
                break;
            }
            idx[k] = 0;
        }
    }
    out
}

/// A version 1.0 `.npy` of a float32 array of `shape` in C order (the product of `shape`
/// is `x.len()`; a 1-D array when `shape` is `None`).
pub fn write(x: &[f32], shape: Option<&[u64]>) -> Vec<u8> {
    let dims = match shape {
        Some([d]) => format!("({d},)"),
        Some(s) => format!(
            "({})",
            s.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
        ),
        None => format!("({},)", x.len()),
    };
    let mut h = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
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
