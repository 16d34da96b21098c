//! Degenerate arguments to public helpers give an answer or an error, never a panic or a
//! hang, in debug and release builds alike (the test profile keeps overflow checks on).

use gradpack::codec::REPRESENTATIVE_SPECS;
use gradpack::collective::{
    AllReduce, AllReduceOptions, Strategy, StrategyChoice, chunk_range, error_bound, local,
};
use gradpack::{Codec, CodecSpec, Error, wire};

fn specs() -> Vec<CodecSpec> {
    let extra = [
        "topk:ratio=0.01",
        "topk:k=0",
        "topk:k=4294967296",
        "topk:ratio=1,values=int8",
        "topk:ratio=0.5,select=approx",
        "topk:threshold=0.5",
        "randk:ratio=5e-324,scale=unbiased",
        "randk:ratio=1",
    ];
    REPRESENTATIVE_SPECS
        .iter()
        .chain(extra.iter())
        .map(|s| s.parse().unwrap_or_else(|e| panic!("{s}: {e}")))
        .collect()
}

#[test]
fn chunk_range_of_no_chunks_is_empty() {
    assert_eq!(chunk_range(10, 0, 0), 10..10);
    assert_eq!(chunk_range(10, 3, 3), 10..10);
    assert_eq!(chunk_range(10, 3, usize::MAX), 10..10);
    assert_eq!(chunk_range(usize::MAX, 2, 1).end, usize::MAX);
    // The chunks of a split tile the range in order.
    for (n, p) in [(0, 1), (7, 3), (10, 10), (3, 8), (1000, 7)] {
        let mut at = 0;
        for c in 0..p {
            let r = chunk_range(n, p, c);
            assert_eq!(r.start, at);
            at = r.end;
        }
        assert_eq!(at, n);
    }
}

#[test]
fn error_bounds_are_numbers_for_any_argument() {
    for codec in specs() {
        for a in [0.0, 1e-300, 1.0, 1e30, f64::MAX, f64::INFINITY, -1.0] {
            let e = codec.error_bound(a);
            assert!(!e.is_nan() && e >= 0.0, "{codec} error_bound({a}) = {e}");
        }
        for s in [
            Strategy::CompressedRing,
            Strategy::CompressedAllGather,
            Strategy::SignMajority,
            Strategy::Fp32Ring,
        ] {
            for p in [0, 1, 2, 1 << 20, (1 << 20) + 1, usize::MAX] {
                let e = error_bound(&codec, s, p, 1.0);
                assert!(!e.is_nan() && e >= 0.0, "{codec} {} p={p}: {e}", s.name());
            }
        }
    }
}

#[test]
fn sizes_never_overflow() {
    for codec in specs() {
        for n in [
            0,
            1,
            255,
            1 << 32,
            (1 << 32) + 1,
            usize::MAX / 2,
            usize::MAX,
        ] {
            let b = codec.bits_per_element(n);
            assert!(
                !b.is_nan() && b >= 0.0,
                "{codec} bits_per_element({n}) = {b}"
            );
            let len = codec.max_encoded_len(n);
            assert!(len >= gradpack::HEADER_LEN, "{codec} max_encoded_len({n})");
        }
    }
    for n in [0u64, 1, 1000, u64::MAX] {
        for k in [0u64, 1, 999, 1000, 1001, u64::MAX] {
            let b = wire::rice_param(n, k);
            assert!(b < 32);
            for b in [0, 1, 31, 63, 64, u32::MAX] {
                let _ = wire::rice_max_bits(n, k, b);
            }
        }
    }
}

#[test]
fn impossible_all_reduces_are_errors() {
    let w = local::Local::world(2);
    let int8: CodecSpec = "int8".parse().unwrap();
    for n in [usize::MAX, usize::MAX / 2, 1 << 60] {
        for s in [
            Strategy::CompressedRing,
            Strategy::CompressedAllGather,
            Strategy::SignMajority,
        ] {
            let o = AllReduceOptions {
                strategy: StrategyChoice::Forced(s),
                ..Default::default()
            };
            let e = AllReduce::new(int8, n, &w[0], o).unwrap_err();
            assert!(
                matches!(e, Error::OutOfMemory { .. } | Error::Param { .. }),
                "{n} {}: {e}",
                s.name()
            );
        }
        // Auto decides the strategy from the cost model first; it must not overflow.
        assert!(AllReduce::new(int8, n, &w[0], AllReduceOptions::default()).is_err());
    }
}
