//! Heap allocation, counted (allocation-counter replaces the global allocator in this test
//! binary only): the hot path allocates nothing (DESIGN rule 3), a frame claiming 2^40
//! elements is refused before any allocation, and the owning decoders allocate exactly
//! the documented `4 * elements` bytes, at most `4 * decode_limit(frame length)`.

mod common;

use allocation_counter::measure;
use common::*;
use gradpack::{
    Codec, CodecId, CodecSpec, EncodeCtx, Error, ErrorFeedback, FeedbackOptions, Header,
};

/// Below the size where the rayon paths split the work (they allocate job state).
const N: usize = 4000;

#[test]
fn hot_path_allocates_nothing() {
    let x = sample(N, 1);
    let opts = FeedbackOptions {
        allow_non_contractive: true,
        ..FeedbackOptions::default()
    };
    // The process's backend is chosen on first use (reading GRADPACK_BACKEND allocates).
    let _ = gradpack::Backend::current();
    for spec in specs() {
        let ctx = EncodeCtx::new(3);
        let mut frame = vec![0u8; gradpack::wire::sealed_len(spec.max_encoded_len(N))];
        let mut out = vec![0f32; N];
        let mut ef = ErrorFeedback::with_options(spec, N, opts).unwrap();
        let mut len = 0;
        if let CodecSpec::Dct(_) = spec {
            // dct builds the basis of each chunk length once per process, on first use.
            let len = spec.encode_into(&x, &ctx, &mut frame).unwrap();
            spec.decode_into(&frame[..len], &mut out).unwrap();
        }
        let info = measure(|| {
            len = spec.encode_into(&x, &ctx, &mut frame).unwrap();
            spec.decode_into(&frame[..len], &mut out).unwrap();
            spec.decode_add(&frame[..len], &mut out).unwrap();
            gradpack::decode(&frame[..len], &mut out).unwrap();
            gradpack::decode_add(&frame[..len], &mut out).unwrap();
            gradpack::inspect(&frame[..len]).unwrap();
            let sealed = gradpack::wire::seal(&mut frame, len).unwrap();
            gradpack::decode(&frame[..sealed], &mut out).unwrap();
            ef.encode_into(&x, &ctx, &mut frame).unwrap();
        });
        assert_eq!(info.count_total, 0, "{spec}: {info:?}");
    }
}

#[test]
fn huge_claims_are_refused_before_allocating() {
    // 2^40 elements, a 16-byte payload: refused by every entry point, allocation-free.
    for id in CodecId::ALL {
        let h = Header {
            codec: id,
            flags: 0,
            elements: 1 << 40,
            payload_len: 16,
            seed: 0,
            offset: 0,
            params: [64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        };
        let mut f = vec![0u8; gradpack::HEADER_LEN + 16];
        h.write(&mut f);
        let spec = CodecSpec::parse(id.name()).unwrap();
        let mut small = [0f32; 16];
        let mut results = Vec::with_capacity(4);
        let info = measure(|| {
            results.push(gradpack::decode_to_vec(&f).is_err());
            results.push(spec.decode(&f).is_err());
            results.push(gradpack::decode(&f, &mut small).is_err());
            results.push(gradpack::decode_add(&f, &mut small).is_err());
        });
        assert!(results.iter().all(|&refused| refused), "{id}");
        // Error values that carry a message allocate it; none may allocate the tensor.
        assert!(info.bytes_max < 4096, "{id}: {info:?}");
        let tiny = measure(|| {
            let _ = gradpack::decode_to_vec(&f);
        });
        assert_eq!(
            tiny.count_total, 0,
            "{id}: TooLarge is refused allocation-free"
        );
    }
}

#[test]
fn owning_decoders_allocate_exactly_the_output() {
    let x = sample(N, 2);
    for spec in specs() {
        let frame = spec.encode(&x, &EncodeCtx::new(1)).unwrap();
        // A first decode builds the tables some codecs keep for the process (`dct`'s
        // bases, once per length); the ones after allocate only the output.
        gradpack::decode_to_vec(&frame).unwrap();
        let info = measure(|| {
            let v = gradpack::decode_to_vec(&frame).unwrap();
            assert_eq!(v.len(), N);
        });
        assert_eq!(info.count_total, 1, "{spec}: {info:?}");
        assert_eq!(info.bytes_total, 4 * N as u64, "{spec}");
        assert!(N as u64 <= gradpack::decode_limit(frame.len()));
    }
}

#[test]
fn a_frame_claiming_more_than_its_payload_holds_is_refused_before_allocating() {
    // An int8 frame claiming 2^33 elements with a 16-byte payload, decoded with a limit
    // that allows 2^33 elements: the payload length its header implies gives it away
    // before 32 GiB are asked for.
    let codec: CodecSpec = "int8".parse().unwrap();
    let mut f = codec.encode(&[1.0; 4], &EncodeCtx::new(0)).unwrap();
    let mut h = Header::parse(&f).unwrap();
    h.elements = 1 << 33;
    h.write(&mut f);
    let mut res = None;
    let info = measure(|| res = Some(gradpack::decode_to_vec_with_limit(&f, u64::MAX)));
    let e = res.unwrap().unwrap_err();
    assert!(matches!(e, Error::PayloadLength { .. }), "{e}");
    assert!(info.bytes_max < 4096, "{info:?}");
}
