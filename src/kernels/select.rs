//! The selection operations' entries: top-k's and `chunktopk`'s magnitude filters and
//! bounds, and random-k's draws (filters, counts, stratified masks), each routed as the
//! routing table says (`routing::ROWS`).

use super::*;

simd_op!(LaneBound<const D: usize> { x: &'a [f32] } -> u32 = portable::lane_bound::<D>(x));
simd_op!(FilterMagGe { x: &'a [f32], t: u32, idx: &'a mut [u32] } -> (usize, usize)
    = portable::filter_mag_ge(x, t, idx));
simd_op!(FilterMagGeVals { x: &'a [f32], t: u32, idx: &'a mut [u32], vals: &'a mut [u32] }
    -> (usize, usize) = portable::filter_mag_ge_vals(x, t, idx, vals));
simd_op!(FilterDrawLt { first: u32, key: u32, t: u32, n: usize, idx: &'a mut [u32] }
    -> (usize, usize) = portable::filter_draw_lt(first, key, t, n, idx));
simd_op!(DrawMasks { first: u32, key: u32, t: u32, n: usize, masks: &'a mut [MaybeUninit<u64>] }
    -> usize = portable::draw_masks(first, key, t, n, masks));
simd_op!(CountDrawLt { first: u32, key: u32, t: u32, n: usize, _l: PhantomData<&'a ()> }
    -> usize = portable::count_draw_lt(first, key, t, n));

/// Compare and compress: the indices (relative to `x`, ascending) of the elements whose
/// magnitude key `|x|` bits (see [`scalar::mag_key`]) is `>= t`, written to `idx`.
/// Returns `(consumed, written)`: it scans from the start of `x` while `idx` has room, and
/// consumes at least one element unless `x` is empty; call again on the rest (indices are
/// relative to each call's start). `idx.len() >= 64` and `x.len() <= 2^32` are required.
/// How far one call gets differs between backends; the indices found do not. Entries of
/// `idx` past the written ones may change (fewer than 64 past them).
pub fn filter_mag_ge(x: &[f32], t: u32, idx: &mut [u32]) -> (usize, usize) {
    call!(filter_mag_ge(x, t, idx))
}

/// The entry of [`filter_mag_ge`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn filter_mag_ge_on<const K: u8>(
    x: &[f32],
    t: u32,
    idx: &mut [u32],
) -> (usize, usize) {
    assert!(idx.len() >= 64, "filter index buffer shorter than 64");
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), route::<K>(Op::FilterMagGe, Call::ANY)) {
        (BackendKind::Scalar, _) => scalar::filter_mag_ge(x, t, idx),
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx2) => unsafe { x86_64::filter_mag_ge_avx2(x, t, idx) },
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx512) => unsafe { x86_64::filter_mag_ge_avx512(x, t, idx) },
        _ => table::on::<K, _>(FilterMagGe { x, t, idx }),
    }
}

/// The groups of [`lane_bound`]: element `i` of a slice is in group `i % LANE_GROUPS`.
pub const LANE_GROUPS: usize = scalar::BOUND_GROUPS;

/// A lower bound of the `16 d`-th largest magnitude key of `x` (`bits & 0x7FFFFFFF`;
/// `d` 1 to 4) in one pass: the elements dealt into 16 groups (element `i` into group
/// `i % 16`), the least of the groups' `d`-th largest keys (0 where a group has fewer
/// than `d` elements). At least `min(16 d, x.len())` elements have a key at or above
/// it. The same value on every backend (see [`scalar::lane_bound`]).
pub fn lane_bound(x: &[f32], d: usize) -> u32 {
    call!(lane_bound(x, d))
}

/// The entry of [`lane_bound`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn lane_bound_on<const K: u8>(x: &[f32], d: usize) -> u32 {
    assert!((1..=4).contains(&d), "lane_bound depth {d} outside 1..=4");
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), route::<K>(Op::LaneBound, Call::ANY)) {
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx512) => unsafe {
            match d {
                1 => x86_64::lane_bound_avx512::<1>(x),
                2 => x86_64::lane_bound_avx512::<2>(x),
                3 => x86_64::lane_bound_avx512::<3>(x),
                _ => x86_64::lane_bound_avx512::<4>(x),
            }
        },
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx2) => match d {
            1 => table::on::<{ table::AVX2 }, _>(LaneBound::<1> { x }),
            2 => table::on::<{ table::AVX2 }, _>(LaneBound::<2> { x }),
            3 => table::on::<{ table::AVX2 }, _>(LaneBound::<3> { x }),
            _ => table::on::<{ table::AVX2 }, _>(LaneBound::<4> { x }),
        },
        _ => match d {
            1 => table::on::<K, _>(LaneBound::<1> { x }),
            2 => table::on::<K, _>(LaneBound::<2> { x }),
            3 => table::on::<K, _>(LaneBound::<3> { x }),
            _ => table::on::<K, _>(LaneBound::<4> { x }),
        },
    }
}

/// Whether [`lane_bound`] and [`filter_keys`] are the faster way to a chunk's candidates
/// on the current backend than a sampled threshold: on the SIMD backends, not on the
/// scalar one, whose bound pass on x86-64's baseline (no unsigned 32-bit minima and
/// maxima) took 4.2 us a chunk of 4096 where the sampled way took 6.4 us for the whole
/// encode (a 2-core Intel Xeon, 2026-11-29).
pub fn lane_bound_pays() -> bool {
    table::current().lane_bound_pays
}

/// The positions (ascending) and magnitude keys (`bits & 0x7FFFFFFF`) of the elements of
/// `x` whose key is at least `t`, into `idx` and `keys`, which must hold `x.len() + 64`
/// entries (`x.len() < 2^32`): their count. Entries past the count may change. The same
/// entries on every backend (see [`scalar::filter_keys`]); AVX-512 compresses 16 lanes
/// at a time without a branch per element, the others run [`filter_mag_ge`] and read
/// each key again.
pub fn filter_keys(x: &[f32], t: u32, idx: &mut [u32], keys: &mut [u32]) -> usize {
    call!(filter_keys(x, t, idx, keys))
}

/// The entry of [`filter_keys`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn filter_keys_on<const K: u8>(
    x: &[f32],
    t: u32,
    idx: &mut [u32],
    keys: &mut [u32],
) -> usize {
    assert!(
        idx.len() >= x.len() + 64 && keys.len() >= x.len() + 64 && x.len() <= u32::MAX as usize,
        "filter_keys: room for {} entries, not {} and {}",
        x.len() + 64,
        idx.len(),
        keys.len()
    );
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), route::<K>(Op::FilterKeys, Call::ANY)) {
        (BackendKind::Scalar, _) => scalar::filter_keys(x, t, idx, keys),
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F and DQ (pulp's x86-64-v4 set) and AVX2 with POPCNT (its v3
        // set) were detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx512) => unsafe { x86_64::filter_keys_avx512(x, t, idx, keys) },
        // The index filter (mask registers or movemask), then each key read again.
        _ => {
            let (mut pos, mut len) = (0, 0);
            while pos < x.len() {
                let (used, kept) = filter_mag_ge(&x[pos..], t, &mut idx[len..]);
                for i in &mut idx[len..len + kept] {
                    *i += pos as u32;
                }
                pos += used;
                len += kept;
            }
            for (k, &i) in keys[..len].iter_mut().zip(&idx[..len]) {
                *k = x[i as usize].to_bits() & 0x7FFF_FFFF;
            }
            len
        }
    }
}

/// [`filter_mag_ge`] that also writes each kept element's bits beside its index:
/// `vals[j] = x[idx[j]].to_bits()` for the `written` entries, so that a caller collecting
/// candidates reads `x` once (a gather afterwards missed the cache on large tensors).
/// `idx.len() >= 64` and `vals.len() >= idx.len()` are required.
pub fn filter_mag_ge_vals(x: &[f32], t: u32, idx: &mut [u32], vals: &mut [u32]) -> (usize, usize) {
    call!(filter_mag_ge_vals(x, t, idx, vals))
}

/// The entry of [`filter_mag_ge_vals`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn filter_mag_ge_vals_on<const K: u8>(
    x: &[f32],
    t: u32,
    idx: &mut [u32],
    vals: &mut [u32],
) -> (usize, usize) {
    assert!(idx.len() >= 64, "filter index buffer shorter than 64");
    assert!(
        vals.len() >= idx.len(),
        "filter value buffer shorter than its index buffer"
    );
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), route::<K>(Op::FilterMagGe, Call::ANY)) {
        (BackendKind::Scalar, _) => scalar::filter_mag_ge_vals(x, t, idx, vals),
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx2) => unsafe { x86_64::filter_mag_ge_vals_avx2(x, t, idx, vals) },
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx512) => unsafe { x86_64::filter_mag_ge_vals_avx512(x, t, idx, vals) },
        _ => table::on::<K, _>(FilterMagGeVals { x, t, idx, vals }),
    }
}

/// Keep, in place and in order, the entries `j` of `idx` and `vals` whose value bits
/// `vals[j]` have a magnitude key (see [`scalar::mag_key`]) `>= t`; returns how many were
/// kept (entries past it are unspecified). Both slices are taken to the shorter one's
/// length. Routed with [`filter_mag_ge`], of which it is the in-place form.
pub fn retain_mag_ge(idx: &mut [u32], vals: &mut [u32], t: u32) -> usize {
    call!(retain_mag_ge(idx, vals, t))
}

/// The entry of [`retain_mag_ge`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn retain_mag_ge_on<const K: u8>(
    idx: &mut [u32],
    vals: &mut [u32],
    t: u32,
) -> usize {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), route::<K>(Op::FilterMagGe, Call::ANY)) {
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        (BackendKind::Avx2 | BackendKind::Avx512, X86::Avx2) => unsafe {
            x86_64::retain_mag_ge_avx2(idx, vals, t)
        },
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F was detected.
        #[cfg(target_arch = "x86_64")]
        (BackendKind::Avx512, X86::Avx512) => unsafe { x86_64::retain_mag_ge_avx512(idx, vals, t) },
        _ => scalar::retain_mag_ge(idx, vals, t),
    }
}

/// Calls `f(i)` for each index, ascending, that a compare-and-compress filter keeps out of
/// `n` elements: `filter(pos, idx)` scans from element `pos` and returns
/// `(consumed, written)` with indices relative to `pos`, as [`filter_mag_ge`] and
/// [`filter_draw_lt`] do. The index buffer lives on the stack.
pub fn for_each_filtered(
    n: usize,
    mut filter: impl FnMut(usize, &mut [u32]) -> (usize, usize),
    mut f: impl FnMut(usize),
) {
    for_each_filtered_in(&mut (), n, |_, pos, idx| filter(pos, idx), |_, i| f(i));
}

/// [`for_each_filtered`] with a context `ctx` that both `filter` and `f` may change (the
/// output that random-k's decode zeroes in its filter and writes in `f`).
pub(super) fn for_each_filtered_in<C: ?Sized>(
    ctx: &mut C,
    n: usize,
    mut filter: impl FnMut(&mut C, usize, &mut [u32]) -> (usize, usize),
    mut f: impl FnMut(&mut C, usize),
) {
    let mut idx = [0u32; 1024];
    let mut pos = 0;
    while pos < n {
        let (used, kept) = filter(ctx, pos, &mut idx);
        for &i in &idx[..kept] {
            f(ctx, pos + i as usize);
        }
        pos += used;
    }
}

/// Compare and compress on hash draws: the indices `i < n` (ascending) with
/// `draws.draw(first + i) < t` (`t <= 2^32`), written to `idx`; returns
/// `(consumed, written)` as [`filter_mag_ge`] does. `idx.len() >= 64` is required.
pub fn filter_draw_lt(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    idx: &mut [u32],
) -> (usize, usize) {
    filter_draw_lt_zeroing(draws, first, t, n, idx, None)
}

/// [`filter_draw_lt`], also setting `zero[..consumed]` to 0.0 when `zero` is given.
pub(super) fn filter_draw_lt_zeroing(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    idx: &mut [u32],
    zero: Option<&mut [f32]>,
) -> (usize, usize) {
    call!(filter_draw_lt_zeroing(draws, first, t, n, idx, zero))
}

/// The entry of [`filter_draw_lt_zeroing`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn filter_draw_lt_zeroing_on<const K: u8>(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    idx: &mut [u32],
    zero: Option<&mut [f32]>,
) -> (usize, usize) {
    assert!(idx.len() >= 64, "filter index buffer shorter than 64");
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    // Keep each call inside one 2^32 index window (one key).
    let n = in_window(first, n);
    let (used, kept) = match (b.kind(), route::<K>(Op::FilterDrawLt, Call::ANY)) {
        (BackendKind::Scalar, _) => scalar::filter_draw_lt(draws, first, t, n, idx),
        _ if t > u32::MAX as u64 => {
            // Every draw is below 2^32.
            let m = n.min(idx.len() & !63);
            for (i, o) in idx[..m].iter_mut().enumerate() {
                *o = i as u32;
            }
            (m, m)
        }
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after x86-64-v3 (AVX2, POPCNT, BMI1, ...) was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx2) => {
            let key = draws.key_for(first);
            let (first, t) = (first as u32, t as u32);
            return unsafe { x86_64::blocks::filter_draw_lt_avx2(first, key, t, n, idx, zero) };
        }
        _ => table::on::<K, _>(FilterDrawLt {
            first: first as u32,
            key: draws.key_for(first),
            t: t as u32,
            n,
            idx,
        }),
    };
    if let Some(z) = zero {
        z[..used].fill(0.0);
    }
    (used, kept)
}

/// Sets every element of `out` to 0.0 and calls `f(out, i)` for each `i < out.len()`,
/// ascending, with `draws.draw(first + i) < t` (`t <= 2^32`): random-k's `decode_into`,
/// with the zeroing done in the pass of hash draws. `f` is called once `out[i]` is zero
/// and may write it; it should write nothing else. `first + out.len()` must not overflow
/// u64.
pub fn for_each_draw_lt_zeroing(
    draws: &Draws,
    first: u64,
    t: u64,
    out: &mut [f32],
    f: impl FnMut(&mut [f32], usize),
) {
    let n = out.len();
    let filter = |out: &mut [f32], pos: usize, idx: &mut [u32]| {
        let zero = Some(&mut out[pos..]);
        filter_draw_lt_zeroing(draws, first + pos as u64, t, n - pos, idx, zero)
    };
    for_each_filtered_in(out, n, filter, f);
}

/// How many `i < n` have `draws.draw(first + i) < t` (`t <= 2^32`): the size of
/// [`filter_draw_lt`]'s selection without its indices (random-k's check that a frame's
/// selection matches its payload, before `decode_add` touches the accumulator).
/// `first + n` must not overflow u64.
pub fn count_draw_lt(draws: &Draws, first: u64, t: u64, n: usize) -> usize {
    call!(count_draw_lt(draws, first, t, n))
}

/// The entry of [`count_draw_lt`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn count_draw_lt_on<const K: u8>(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
) -> usize {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    if b.kind() == BackendKind::Scalar {
        return scalar::count_draw_lt(draws, first, t, n);
    }
    if t > u32::MAX as u64 {
        // Every draw is below 2^32.
        return n;
    }
    let (mut count, mut done) = (0, 0);
    while done < n {
        // One 2^32 index window (one key) at a time.
        let at = first + done as u64;
        let m = in_window(at, n - done);
        let key = draws.key_for(at);
        count += match route::<K>(Op::CountDrawLt, Call::ANY) {
            // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which
            // exist only after AVX2 was detected.
            #[cfg(target_arch = "x86_64")]
            X86::Avx2 => unsafe { x86_64::blocks::count_draw_lt_avx2(at as u32, key, t as u32, m) },
            _ => table::on::<K, _>(CountDrawLt {
                first: at as u32,
                key,
                t: t as u32,
                n: m,
                _l: PhantomData,
            }),
        };
        done += m;
    }
    count
}

/// Keep masks of hash draws: writes the first `n.div_ceil(64)` entries of `masks`, bit
/// `i % 64` of entry `i / 64` set when `draws.draw(first + i) < t` (`t <= 2^32`), for
/// `i < n` (the bits past `n` are 0). Returns how many bits are set, the count of
/// [`count_draw_lt`]. `first + n` must not overflow u64.
///
/// # Panics
/// If `masks` is shorter than `n.div_ceil(64)`.
pub fn draw_masks(draws: &Draws, first: u64, t: u64, n: usize, masks: &mut [u64]) -> usize {
    // SAFETY: `MaybeUninit<u64>` has the layout of `u64`, and `draw_masks_into` only
    // writes initialised values through it, so `masks` stays initialised.
    let masks = unsafe { &mut *(core::ptr::from_mut(masks) as *mut [MaybeUninit<u64>]) };
    draw_masks_into(draws, first, t, n, masks)
}

/// [`draw_masks`] into storage that need not be initialised; the entries it covers are
/// written.
pub(super) fn draw_masks_into(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    masks: &mut [MaybeUninit<u64>],
) -> usize {
    call!(draw_masks_into(draws, first, t, n, masks))
}

/// The entry of [`draw_masks_into`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn draw_masks_into_on<const K: u8>(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    masks: &mut [MaybeUninit<u64>],
) -> usize {
    assert!(
        masks.len() >= n.div_ceil(64),
        "{} mask entries for {n} elements",
        masks.len()
    );
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    // The oracle also takes a range across a 2^32 index window (two keys), which happens
    // once in 2^32 elements.
    if b.kind() == BackendKind::Scalar || in_window(first, n) < n {
        return scalar::draw_masks(draws, first, t, n, masks);
    }
    if t > u32::MAX as u64 {
        // Every draw is below 2^32.
        for (w, slot) in masks[..n.div_ceil(64)].iter_mut().enumerate() {
            slot.write(u64::MAX >> (64 - (n - 64 * w).min(64)));
        }
        return n;
    }
    let (first, key, t) = (first as u32, draws.key_for(first), t as u32);
    match route::<K>(Op::DrawMasks, Call::ANY) {
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after x86-64-v3 (AVX2, POPCNT, ...) was detected.
        #[cfg(target_arch = "x86_64")]
        X86::Avx2 => unsafe { x86_64::blocks::draw_masks_avx2(first, key, t, n, masks) },
        _ => table::on::<K, _>(DrawMasks {
            first,
            key,
            t,
            n,
            masks,
        }),
    }
}

/// Elements whose keep masks [`for_each_draw_lt_exactly`] keeps on the stack (32 KiB of
/// masks); past them it draws twice.
pub const STORED_MASK_ELEMENTS: usize = 1 << 18;

/// Calls `f(i)` for each `i < n`, ascending, with `draws.draw(first + i) < t`
/// (`t <= 2^32`), but only once it has checked that there are exactly `expect` of them;
/// otherwise returns `Err(count)` without calling `f`. `first + n` must not overflow u64.
///
/// This is random-k's `decode_add`: the accumulator may change only once the frame's
/// selection is known to match its payload. The keep masks of the first
/// [`STORED_MASK_ELEMENTS`] elements are kept on the stack from the counting pass, so those
/// are hashed once; the rest are hashed twice (counted, then filtered).
pub fn for_each_draw_lt_exactly(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    expect: usize,
    mut f: impl FnMut(usize),
) -> Result<(), usize> {
    let mut stored = [MaybeUninit::<u64>::uninit(); STORED_MASK_ELEMENTS / 64];
    let pre = n.min(STORED_MASK_ELEMENTS);
    let words = pre.div_ceil(64);
    let mut count = draw_masks_into(draws, first, t, pre, &mut stored[..words]);
    count += count_draw_lt(draws, first + pre as u64, t, n - pre);
    if count != expect {
        return Err(count);
    }
    // SAFETY: `draw_masks_into` wrote the first `words` entries, and `MaybeUninit<u64>`
    // has the layout of `u64`.
    let masks = unsafe { &*(core::ptr::from_ref(&stored[..words]) as *const [u64]) };
    let rare = rare_keep(t);
    for_each_filtered(
        pre,
        |pos, idx| compress_stored_masks(&masks[pos / 64..], pre - pos, idx, rare),
        &mut f,
    );
    let rest = |pos: usize, idx: &mut [u32]| {
        filter_draw_lt(draws, first + (pre + pos) as u64, t, n - pre - pos, idx)
    };
    for_each_filtered(n - pre, rest, |i| f(pre + i));
    Ok(())
}

/// The indices of the set bits of `masks` (bit `i % 64` of entry `i / 64`, for `i < n`),
/// written to `idx` as a filter writes its own: returns `(consumed, written)`, consuming
/// whole entries but at the end. `rare` says most entries are 0.
pub(super) fn compress_stored_masks(
    masks: &[u64],
    n: usize,
    idx: &mut [u32],
    rare: bool,
) -> (usize, usize) {
    call!(compress_stored_masks(masks, n, idx, rare))
}

/// The entry of [`compress_stored_masks`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
pub(super) unsafe fn compress_stored_masks_on<const K: u8>(
    masks: &[u64],
    n: usize,
    idx: &mut [u32],
    rare: bool,
) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    if route::<K>(Op::CompressMasks, Call::ANY) == X86::Avx2 {
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after x86-64-v3 (AVX2, POPCNT, BMI1, ...) was detected.
        return unsafe { x86_64::compress_stored_masks_avx2(masks, n, idx, rare) };
    }
    let _ = rare;
    portable::compress_masks(n, idx, |done, _| masks[done / 64])
}

/// Whether a draw threshold `t` keeps so few elements (below 2^-9) that most groups of 64
/// keep nothing, and a branch that skips them is predicted right.
pub(crate) fn rare_keep(t: u64) -> bool {
    t < 1 << 23
}

/// How many of the `n` indices from `first` lie in `first`'s 2^32 index window (they share
/// one hash key).
pub(super) fn in_window(first: u64, n: usize) -> usize {
    let to_window_end = (1u64 << 32) - (first & 0xFFFF_FFFF);
    (n as u64).min(to_window_end) as usize
}
