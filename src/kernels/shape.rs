//! The shape-aware operations' entries: the DCT of `dct` (forward by each transform,
//! selection, inverse) and PowerSGD's thin products, each routed per call where the
//! routing table says (`routing::ROWS`).

use super::*;

simd_op!(DctForward {
    x: &'a [f32], stride: usize, h: usize, w: usize, y: &'a mut [f32], out: &'a mut [f32],
} -> () = dct::forward_impl(x, stride, h, w, y, out));

/// The forward DCT of a tile (see [`dct::forward`]), compiled for the current backend
/// (for AVX2 on the AVX-512 backend: the routing table, `routing::ROWS`).
pub(super) fn dct_forward(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    call!(dct_forward(x, stride, h, w, y, out))
}

/// The entry of [`dct_forward`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn dct_forward_on<const K: u8>(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::forward_impl(x, stride, h, w, y, out),
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::DctForward, Call::ANY) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(DctForward {
                x,
                stride,
                h,
                w,
                y,
                out,
            })
        }
        _ => table::on::<K, _>(DctForward {
            x,
            stride,
            h,
            w,
            y,
            out,
        }),
    }
}

simd_op!(DctSelect { coef: &'a mut [f32], kt: usize, keys: &'a mut [u64], chosen: &'a mut [u16] }
    -> () = dct::select_impl(coef, kt, keys, chosen));

/// The small selection of the `dct` encoder (see [`dct::select`]), compiled for the
/// current backend.
pub(super) fn dct_select(coef: &mut [f32], kt: usize, keys: &mut [u64], chosen: &mut [u16]) {
    call!(dct_select(coef, kt, keys, chosen))
}

/// The entry of [`dct_select`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn dct_select_on<const K: u8>(
    coef: &mut [f32],
    kt: usize,
    keys: &mut [u64],
    chosen: &mut [u16],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::select_impl(coef, kt, keys, chosen),
        _ => table::on::<K, _>(DctSelect {
            coef,
            kt,
            keys,
            chosen,
        }),
    }
}

simd_op!(DctForwardFast {
    x: &'a [f32], stride: usize, h: usize, w: usize, y: &'a mut [f32], out: &'a mut [f32],
} -> () = dct::forward_fast_impl(x, stride, h, w, y, out));

/// The factorised forward DCT of a tile (see [`dct::forward_fast`]), compiled for the
/// current backend.
pub(super) fn dct_forward_fast(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    call!(dct_forward_fast(x, stride, h, w, y, out))
}

/// The entry of [`dct_forward_fast`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn dct_forward_fast_on<const K: u8>(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::forward_fast_impl(x, stride, h, w, y, out),
        _ => table::on::<K, _>(DctForwardFast {
            x,
            stride,
            h,
            w,
            y,
            out,
        }),
    }
}

simd_op!(DctEncodeRowsFast {
    x: &'a [f32], w: usize, kt: usize, pos: &'a mut [u16], vals: &'a mut [f32],
} -> () = dct::encode_rows_fast_impl(x, w, kt, pos, vals));

/// The `dct` encoder's work for tiles of one row (see [`dct::encode_rows_fast`]),
/// compiled for the current backend (for AVX2 on the AVX-512 backend at 16 and 32:
/// the routing table, `routing::ROWS`).
pub(super) fn dct_encode_rows_fast(
    x: &[f32],
    w: usize,
    kt: usize,
    pos: &mut [u16],
    vals: &mut [f32],
) {
    call!(dct_encode_rows_fast(x, w, kt, pos, vals))
}

/// The entry of [`dct_encode_rows_fast`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn dct_encode_rows_fast_on<const K: u8>(
    x: &[f32],
    w: usize,
    kt: usize,
    pos: &mut [u16],
    vals: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::encode_rows_fast_impl(x, w, kt, pos, vals),
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::DctFastRows, Call::blocks(w)) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(DctEncodeRowsFast {
                x,
                w,
                kt,
                pos,
                vals,
            })
        }
        _ => table::on::<K, _>(DctEncodeRowsFast {
            x,
            w,
            kt,
            pos,
            vals,
        }),
    }
}

simd_op!(DctEncodeRowsLee {
    x: &'a [f32], w: usize, kt: usize, pos: &'a mut [u16], vals: &'a mut [f32],
    load: dct::LoadLanes<'a>,
} -> () = dct::encode_rows_lee_impl(x, w, kt, pos, vals, load));

/// The `dct` encoder's work for tiles of one row by Lee's transform (see
/// [`dct::encode_rows_lee`]), compiled for the current backend; the AVX-512 backend puts
/// sixteen tiles of 16, 32 or 64 into lanes by in-register transposes of 16 x 16 blocks, the
/// AVX2 build (and the AVX-512 backend at 8) tiles of 8 to 64 by 8 x 8 blocks.
pub(super) fn dct_encode_rows_lee(
    x: &[f32],
    w: usize,
    kt: usize,
    pos: &mut [u16],
    vals: &mut [f32],
) {
    call!(dct_encode_rows_lee(x, w, kt, pos, vals))
}

/// The entry of [`dct_encode_rows_lee`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn dct_encode_rows_lee_on<const K: u8>(
    x: &[f32],
    w: usize,
    kt: usize,
    pos: &mut [u16],
    vals: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    let load = lanes_for(b.kind());
    if b.kind() == BackendKind::Scalar {
        return dct::encode_rows_lee_impl(x, w, kt, pos, vals, load);
    }
    let op = DctEncodeRowsLee {
        x,
        w,
        kt,
        pos,
        vals,
        load,
    };
    table::on::<K, _>(op)
}

/// How a backend's build puts sixteen rows into lanes (see [`dct::LoadLanes`]).
pub(super) fn lanes_for(kind: BackendKind) -> dct::LoadLanes<'static> {
    match kind {
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx512 => AVX512_LANES,
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx2 => AVX2_LANES,
        _ => PLAIN_LANES,
    }
}

/// The plain loop puts rows into lanes (see [`dct::LoadLanes`]).
pub(super) const PLAIN_LANES: dct::LoadLanes = &|_, _, _, _| false;

/// The AVX-512 backend puts sixteen rows of 16, 32 or 64 into lanes by in-register
/// transposes of 16 x 16 blocks, and rows of 8 as the AVX2 build does (see
/// [`dct::LoadLanes`]); only for that backend.
#[cfg(target_arch = "x86_64")]
pub(super) const AVX512_LANES: dct::LoadLanes = &|rows, stride, w, a| {
    if matches!(w, 16 | 32 | 64) && stride >= w && rows.len() >= 15 * stride + w {
        // SAFETY: AVX512_LANES is passed only with the AVX-512 backend, which exists only
        // after AVX-512F was detected; the arguments are the ones the kernel asserts.
        unsafe { x86_64::blocks512::rows_to_lanes16(rows, stride, w, a) };
        return true;
    }
    AVX2_LANES(rows, stride, w, a)
};

/// The AVX2 build puts sixteen rows of 8 to 64 into lanes by in-register transposes of
/// 8 x 8 blocks (see [`dct::LoadLanes`]); for the AVX2 and AVX-512 backends.
#[cfg(target_arch = "x86_64")]
pub(super) const AVX2_LANES: dct::LoadLanes = &|rows, stride, w, a| {
    let fits = matches!(w, 8 | 16 | 32 | 64) && stride >= w && rows.len() >= 15 * stride + w;
    if fits {
        // SAFETY: AVX2_LANES is passed only with the AVX2 and AVX-512 backends, which
        // exist only after AVX2 was detected; the arguments are the ones the kernel
        // asserts.
        unsafe { x86_64::blocks::rows_to_lanes16(rows, stride, w, a) };
    }
    fits
};

simd_op!(DctForwardLee {
    x: &'a [f32], stride: usize, h: usize, w: usize, y: &'a mut [f32], out: &'a mut [f32],
    load: dct::LoadLanes<'a>,
} -> () = dct::forward_lee_impl(x, stride, h, w, y, out, load));

/// Lee's forward DCT of a tile (see [`dct::forward_lee`]), compiled for the current
/// backend (for AVX2 on the AVX-512 backend for 64 x 64 tiles: the routing table, `routing::ROWS`); the
/// AVX2 and AVX-512 builds put sixteen rows at a time into lanes by in-register transposes.
pub(super) fn dct_forward_lee(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    call!(dct_forward_lee(x, stride, h, w, y, out))
}

/// The entry of [`dct_forward_lee`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn dct_forward_lee_on<const K: u8>(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    #[cfg(target_arch = "x86_64")]
    let to_avx2 = route::<K>(Op::DctLee, Call::blocks(h * w)) == X86::Avx2;
    #[cfg(target_arch = "x86_64")]
    let load = lanes_for(if to_avx2 { BackendKind::Avx2 } else { b.kind() });
    #[cfg(not(target_arch = "x86_64"))]
    let load = lanes_for(b.kind());
    let op = DctForwardLee {
        x,
        stride,
        h,
        w,
        y,
        out,
        load,
    };
    match b.kind() {
        BackendKind::Scalar => dct::forward_lee_impl(x, stride, h, w, op.y, op.out, load),
        #[cfg(target_arch = "x86_64")]
        _ if to_avx2 => table::on::<{ table::AVX2 }, _>(op),
        _ => table::on::<K, _>(op),
    }
}

simd_op!(DctDecodeRows<const M: u8> {
    w: usize, kt: usize, pos: &'a [u16], vals: &'a [f32], out: &'a mut [f32],
} -> () = dct::decode_rows_impl::<M>(w, kt, pos, vals, out));

/// The `dct` decoder's work for tiles of one row (see [`dct::decode_rows`]), compiled for
/// the current backend (for AVX2 on the AVX-512 backend: the routing table, `routing::ROWS`, as the inverse).
pub(super) fn dct_decode_rows<const M: u8>(
    w: usize,
    kt: usize,
    pos: &[u16],
    vals: &[f32],
    out: &mut [f32],
) {
    call!(dct_decode_rows[M as usize](w, kt, pos, vals, out))
}

/// The entry of [`dct_decode_rows`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn dct_decode_rows_on<const K: u8, const M: u8>(
    w: usize,
    kt: usize,
    pos: &[u16],
    vals: &[f32],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::decode_rows_impl::<M>(w, kt, pos, vals, out),
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::DctInverse, Call::ANY) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(DctDecodeRows::<M> {
                w,
                kt,
                pos,
                vals,
                out,
            })
        }
        _ => table::on::<K, _>(DctDecodeRows::<M> {
            w,
            kt,
            pos,
            vals,
            out,
        }),
    }
}

simd_op!(ThinMq {
    x: &'a mut [f32], e: Option<&'a [f32]>, qt: &'a [f32], cols: usize, p: &'a mut [f32],
} -> () = gemm::thin_mq_rows(x, e, qt, cols, p));

/// PowerSGD's rows of `M Q` (see [`gemm::thin_mq`]), compiled for the current backend.
pub(super) fn gemm_thin_mq(
    x: &mut [f32],
    e: Option<&[f32]>,
    qt: &[f32],
    cols: usize,
    p: &mut [f32],
) {
    call!(gemm_thin_mq(x, e, qt, cols, p))
}

/// The entry of [`gemm_thin_mq`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn gemm_thin_mq_on<const K: u8>(
    x: &mut [f32],
    e: Option<&[f32]>,
    qt: &[f32],
    cols: usize,
    p: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => gemm::thin_mq_rows(x, e, qt, cols, p),
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::ThinMq, Call::ANY) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(ThinMq { x, e, qt, cols, p })
        }
        _ => table::on::<K, _>(ThinMq { x, e, qt, cols, p }),
    }
}

simd_op!(ThinPqt {
    x: Option<&'a [f32]>, out: &'a mut [f32], e: Option<&'a mut [f32]>, p: &'a [f32],
    qt: &'a [f32], cols: usize,
} -> () = gemm::thin_pqt_rows(x, out, e, p, qt, cols));

/// PowerSGD's rows of `P Q^T` and residuals (see [`gemm::thin_pqt`]), compiled for the
/// current backend; with `stream`, the x86 kernels with non-temporal stores.
pub(super) fn gemm_thin_pqt(
    x: Option<&[f32]>,
    out: &mut [f32],
    e: Option<&mut [f32]>,
    p: &[f32],
    qt: &[f32],
    cols: usize,
    stream: bool,
) {
    call!(gemm_thin_pqt(x, out, e, p, qt, cols, stream))
}

/// The entry of [`gemm_thin_pqt`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn gemm_thin_pqt_on<const K: u8>(
    x: Option<&[f32]>,
    out: &mut [f32],
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))] mut e: Option<&mut [f32]>,
    p: &[f32],
    qt: &[f32],
    cols: usize,
    stream: bool,
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    #[cfg(target_arch = "x86_64")]
    if stream && !out.is_empty() {
        use x86_64::{PQT_FROM_OUT, PQT_FROM_X, PQT_OUT};
        let r = p.len() / (out.len() / cols.max(1)).max(1);
        let mode = match (x.is_some(), e.is_some()) {
            (_, false) => PQT_OUT,
            (true, true) => PQT_FROM_X,
            (false, true) => PQT_FROM_OUT,
        };
        let (xs, es) = (x.unwrap_or(&[]), e.as_deref_mut().unwrap_or_default());
        // True when a streaming kernel took the rows (ranks 1 to THIN_MAX_RANK).
        macro_rules! go {
            ($f:ident) => {
                gemm::by_rank!(r, R => {
                    match mode {
                        PQT_OUT => x86_64::$f::<R, PQT_OUT>(xs, out, es, p, qt, cols),
                        PQT_FROM_X => x86_64::$f::<R, PQT_FROM_X>(xs, out, es, p, qt, cols),
                        _ => x86_64::$f::<R, PQT_FROM_OUT>(xs, out, es, p, qt, cols),
                    }
                    true
                }, _ => false)
            };
        }
        let done = match route::<K>(Op::StreamPqt, Call::ANY) {
            // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists
            // only after AVX-512F was detected.
            X86::Avx512 => unsafe { go!(pqt_stream_avx512) },
            // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which
            // exist only after AVX2 was detected.
            X86::Avx2 => unsafe { go!(pqt_stream_avx2) },
            X86::None => false,
        };
        if done {
            return;
        }
    }
    let _ = stream;
    match b.kind() {
        BackendKind::Scalar => gemm::thin_pqt_rows(x, out, e, p, qt, cols),
        _ => table::on::<K, _>(ThinPqt {
            x,
            out,
            e,
            p,
            qt,
            cols,
        }),
    }
}

simd_op!(ThinMtp {
    m: &'a [f32], cols: usize, j0: usize, p: &'a [f32], r: usize, acc: &'a mut [f32],
} -> () = gemm::thin_mtp_cols(m, cols, j0, p, r, acc));

/// PowerSGD's columns of `M^T P` (see [`gemm::thin_mtp`]), compiled for the current
/// backend.
pub(super) fn gemm_thin_mtp(
    m: &[f32],
    cols: usize,
    j0: usize,
    p: &[f32],
    r: usize,
    acc: &mut [f32],
) {
    call!(gemm_thin_mtp(m, cols, j0, p, r, acc))
}

/// The entry of [`gemm_thin_mtp`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn gemm_thin_mtp_on<const K: u8>(
    m: &[f32],
    cols: usize,
    j0: usize,
    p: &[f32],
    r: usize,
    acc: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => gemm::thin_mtp_cols(m, cols, j0, p, r, acc),
        _ => table::on::<K, _>(ThinMtp {
            m,
            cols,
            j0,
            p,
            r,
            acc,
        }),
    }
}

simd_op!(DctInverseRows {
    t: &'a [f32], cols: &'a [bool], h: usize, w: usize, x: &'a mut [f32],
} -> () = dct::inverse_rows_impl(t, cols, h, w, x));

/// The second pass of the inverse DCT of a tile (see [`dct::inverse`]), compiled for
/// the current backend (for AVX2 on the AVX-512 backend: the routing table, `routing::ROWS`).
pub(super) fn dct_inverse_rows(t: &[f32], cols: &[bool], h: usize, w: usize, x: &mut [f32]) {
    call!(dct_inverse_rows(t, cols, h, w, x))
}

/// The entry of [`dct_inverse_rows`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn dct_inverse_rows_on<const K: u8>(
    t: &[f32],
    cols: &[bool],
    h: usize,
    w: usize,
    x: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::inverse_rows_impl(t, cols, h, w, x),
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::DctInverse, Call::ANY) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(DctInverseRows { t, cols, h, w, x })
        }
        _ => table::on::<K, _>(DctInverseRows { t, cols, h, w, x }),
    }
}
