//! Codec specs: parse, print (canonical form) and errors that name the bad key or value
//! and what is accepted.

use gradpack::{Codec, CodecId, CodecSpec, Error};

#[test]
fn specs_from_the_docs_parse_and_print_canonically() {
    let cases = [
        ("identity", "identity"),
        ("fp16", "fp16"),
        ("bf16", "bf16"),
        ("int8", "int8:block=256,rounding=nearest"),
        ("int8:block=256", "int8:block=256,rounding=nearest"),
        (
            "int8:block=256,rounding=stochastic",
            "int8:block=256,rounding=stochastic",
        ),
        (
            "int8: rounding = stochastic , block=64",
            "int8:block=64,rounding=stochastic",
        ),
        ("qsgd:bits=4,block=512", "qsgd:bits=4,block=512"),
        ("qsgd", "qsgd:bits=4,block=512"),
        ("sign:block=1024", "sign:block=1024"),
        ("ternary", "ternary:block=1024"),
        ("natural", "natural:block=1024"),
        ("topk:ratio=0.01,values=fp16", "topk:ratio=0.01,values=fp16"),
        ("topk", "topk:ratio=0.01,values=f32"),
        ("topk:k=1000", "topk:k=1000,values=f32"),
        ("randk:ratio=0.01", "randk:ratio=0.01,values=f32,scale=none"),
        (
            "randk:ratio=0.5,scale=unbiased,values=fp16",
            "randk:ratio=0.5,values=fp16,scale=unbiased",
        ),
        (
            "randk:select=strata,ratio=0.001",
            "randk:ratio=0.001,values=f32,scale=none,select=strata",
        ),
        (
            "randk:select=bernoulli",
            "randk:ratio=0.01,values=f32,scale=none",
        ),
        ("dct", "dct:chunk=64,k=4,values=f32,width=0"),
        (
            "dct:values=sign,k=32,width=4096",
            "dct:chunk=64,k=32,values=sign,scale=chunk,width=4096",
        ),
        (
            "dct:chunk=16,values=sign,scale=frame",
            "dct:chunk=16,k=4,values=sign,scale=frame,width=0",
        ),
    ];
    for (input, canonical) in cases {
        let spec: CodecSpec = input.parse().unwrap_or_else(|e| panic!("{input}: {e}"));
        assert_eq!(spec.to_string(), canonical);
        let again: CodecSpec = canonical.parse().unwrap();
        assert_eq!(again, spec, "{canonical} does not parse back to itself");
    }
}

fn reason(s: &str) -> String {
    match s.parse::<CodecSpec>() {
        Err(Error::Spec { spec, reason }) => {
            assert_eq!(spec, s);
            reason
        }
        other => panic!("{s}: expected a spec error, got {other:?}"),
    }
}

#[test]
fn bad_specs_name_the_problem_and_the_accepted_values() {
    let r = reason("int9");
    assert!(
        r.contains("\"int9\"") && r.contains("int8") && r.contains("randk"),
        "{r}"
    );
    let r = reason("int8:blok=256");
    assert!(
        r.contains("`blok`") && r.contains("block") && r.contains("rounding"),
        "{r}"
    );
    let r = reason("int8:rounding=up");
    assert!(
        r.contains("rounding=up") && r.contains("nearest") && r.contains("stochastic"),
        "{r}"
    );
    let r = reason("int8:block=0");
    assert!(r.contains("block=0") && r.contains("1..=16777216"), "{r}");
    let r = reason("int8:block=99999999999999999999");
    assert!(r.contains("block="), "{r}");
    let r = reason("qsgd:bits=3");
    assert!(r.contains("bits=3") && r.contains("2, 4, 8"), "{r}");
    let r = reason("topk:ratio=0");
    assert!(r.contains("ratio=0") && r.contains("(0, 1]"), "{r}");
    let r = reason("topk:ratio=1.5");
    assert!(r.contains("(0, 1]"), "{r}");
    let r = reason("topk:ratio=nan");
    assert!(r.contains("(0, 1]"), "{r}");
    let r = reason("topk:ratio=0.1,k=5");
    assert!(r.contains("not both"), "{r}");
    let r = reason("topk:values=int4");
    assert!(r.contains("f32") && r.contains("fp16"), "{r}");
    let r = reason("dct:k=65");
    assert!(r.contains("`k`") && r.contains("1..=64"), "{r}");
    let r = reason("dct:chunk=65");
    assert!(r.contains("chunk=65") && r.contains("1..=64"), "{r}");
    let r = reason("dct:values=fp16,scale=frame");
    assert!(r.contains("values=sign"), "{r}");
    let r = reason("fp16:block=4");
    assert!(r.contains("fp16 takes no parameters"), "{r}");
    let r = reason("int8:block=64,block=32");
    assert!(r.contains("twice"), "{r}");
    let r = reason("int8:block");
    assert!(r.contains("key=value"), "{r}");
    let r = reason("int8:");
    assert!(r.contains("key=value"), "{r}");
    let r = reason("");
    assert!(r.contains("unknown codec"), "{r}");
}

#[test]
fn constructors_validate_like_the_parser() {
    assert!(gradpack::Int8::new(0, gradpack::Rounding::Nearest).is_err());
    assert!(gradpack::Int8::new(1 << 25, gradpack::Rounding::Nearest).is_err());
    assert!(gradpack::Qsgd::new(3, 64).is_err());
    assert!(
        gradpack::TopK::new(gradpack::TopKSelect::Ratio(0.0), gradpack::ValueType::F32).is_err()
    );
    assert!(
        gradpack::RandK::new(
            f64::NAN,
            gradpack::ValueType::F32,
            gradpack::RandKScale::None
        )
        .is_err()
    );
    let e = gradpack::Sign::new(0).unwrap_err();
    assert!(
        e.to_string().contains("sign") && e.to_string().contains("block"),
        "{e}"
    );
}

#[test]
fn ids_names_and_spec_metadata_agree() {
    for id in CodecId::ALL {
        assert_eq!(CodecId::from_u8(id as u8), Some(id));
        let spec: CodecSpec = id.name().parse().unwrap();
        assert_eq!(spec.id(), id);
        assert_eq!(spec.spec(), spec);
    }
    assert_eq!(CodecId::from_u8(16), None);
    let bits = |s: &str| s.parse::<CodecSpec>().unwrap().bits_per_element(1 << 20);
    assert_eq!(bits("identity"), 32.0);
    // dct: per 64 elements, 4 one-byte positions and 4 f32 (or fp16, or sign bits and a
    // scale).
    assert_eq!(bits("dct"), 4.0 * 5.0 * 8.0 / 64.0);
    assert_eq!(bits("dct:values=fp16"), 4.0 * 3.0 * 8.0 / 64.0);
    assert_eq!(bits("dct:values=sign"), (4.0 + 4.0 + 1.0) * 8.0 / 64.0);
    // 64 x 64 tiles of a 1024-wide matrix: two-byte positions.
    assert_eq!(bits("dct:k=32,width=1024"), 32.0 * 6.0 * 8.0 / 4096.0);
    assert_eq!(bits("fp16"), 16.0);
    assert_eq!(bits("fp8"), 8.0 + 32.0 / 128.0);
    assert_eq!(bits("fp8:scale=e8m0,block=32"), 8.0 + 8.0 / 32.0);
    assert_eq!(bits("fp8:scale=none"), 8.0);
    assert_eq!(bits("fp4"), 4.0 + 8.0 / 32.0);
    assert_eq!(bits("codebook"), 8.0 + 8192.0 / 65536.0);
    // 64 of every 4096: a 4-byte scale, 64 x 6 low bits, 127 upper bits, 64 x 2-bit codes.
    assert_eq!(bits("chunktopk"), 84.0 * 8.0 / 4096.0);
    assert!(!"chunktopk".parse::<CodecSpec>().unwrap().unbiased());
    assert!(!"codebook".parse::<CodecSpec>().unwrap().unbiased());
    assert_eq!(bits("fp4:scale=f32,block=16"), 4.0 + 32.0 / 16.0);
    // NVFP4-like: blocks of 16 by default, one E4M3 byte each.
    assert_eq!(bits("fp4:scale=e4m3"), 4.0 + 8.0 / 16.0);
    assert_eq!(
        "fp4:scale=e4m3".parse::<CodecSpec>().unwrap().to_string(),
        "fp4:format=e2m1,block=16,scale=e4m3,rounding=nearest"
    );
    assert_eq!(
        "fp4".parse::<CodecSpec>().unwrap().to_string(),
        "fp4:format=e2m1,block=32,scale=e8m0,rounding=nearest"
    );
    assert!(
        "fp4:rounding=stochastic"
            .parse::<CodecSpec>()
            .unwrap()
            .unbiased()
    );
    assert!("fp4:scale=none".parse::<CodecSpec>().is_err());
    assert!("fp4:block=15".parse::<CodecSpec>().is_err());
    assert!(
        "fp8:rounding=stochastic"
            .parse::<CodecSpec>()
            .unwrap()
            .unbiased()
    );
    assert!(!"fp8".parse::<CodecSpec>().unwrap().unbiased());
    assert_eq!(
        "fp8".parse::<CodecSpec>().unwrap().to_string(),
        "fp8:format=e4m3,block=128,scale=f32,rounding=nearest"
    );
    assert!("fp8:scale=none,block=4".parse::<CodecSpec>().is_err());
    assert!("fp8:format=e3m4".parse::<CodecSpec>().is_err());
    assert_eq!(bits("int8:block=256"), 8.0 + 32.0 / 256.0);
    assert_eq!(bits("qsgd:bits=2,block=512"), 2.0 + 32.0 / 512.0);
    assert_eq!(bits("sign:block=1024"), 1.0 + 32.0 / 1024.0);
    assert!((bits("randk:ratio=0.01") - 0.32).abs() < 1e-6);
    assert!(bits("topk:ratio=0.01,values=fp16") > 16.0 * 0.01);
    assert!("qsgd".parse::<CodecSpec>().unwrap().unbiased());
    assert!(!"sign".parse::<CodecSpec>().unwrap().unbiased());
    assert!(!"randk".parse::<CodecSpec>().unwrap().unbiased());
    assert!(
        "randk:scale=unbiased"
            .parse::<CodecSpec>()
            .unwrap()
            .unbiased()
    );
}

/// fp4's NVFP4-like layout from its definition: the frame scale `g` from the largest
/// finite magnitude, the frame's largest block on E4M3's top value, a block far below it
/// on the smallest, non-finite elements left out of `g`, and the documented bound.
#[test]
fn fp4_e4m3_scales_follow_the_frame() {
    use gradpack::{Codec, EncodeCtx};
    let spec: CodecSpec = "fp4:scale=e4m3".parse().unwrap();
    let global = |f: &[u8]| f32::from_le_bytes(f[47..51].try_into().unwrap());
    // Block 0 holds the largest magnitude, block 1 values 2^-20 of it, block 2 zeros.
    let mut x = vec![0f32; 48];
    for i in 0..16 {
        x[i] = (i as f32 - 7.5) * 3.0;
        x[16 + i] = (i as f32 - 7.5) * 3.0 * 2f32.powi(-20);
    }
    let a = 22.5f32;
    let f = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
    assert_eq!(global(&f).to_bits(), (a / 2688.0).to_bits());
    assert_eq!(&f[56..59], &[0x7E, 0x01, 0x00]);
    let d = gradpack::decode_to_vec(&f).unwrap();
    // The largest element maps to -6 times the block scale 448 g: -22.5 up to roundings.
    assert!((d[0] + 22.5).abs() <= 22.5 * 2f32.powi(-21), "{}", d[0]);
    let bound = spec.error_bound(a as f64);
    for (v, w) in x.iter().zip(&d) {
        assert!(((v - w).abs() as f64) <= bound, "{v} decoded as {w}");
    }
    assert!(d[32..].iter().all(|&v| v.to_bits() == 0));
    // A NaN and an Inf in block 1: g is still block 0's, block 1 decodes to NaN.
    x[17] = f32::NAN;
    x[18] = f32::INFINITY;
    let f = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
    assert_eq!(global(&f).to_bits(), (a / 2688.0).to_bits());
    assert_eq!(f[57], 0x7F);
    let d = gradpack::decode_to_vec(&f).unwrap();
    assert!(d[16..32].iter().all(|v| v.is_nan()));
    // All zero: the smallest frame scale, every byte 0, zeros out.
    let f = spec.encode(&[0.0; 32], &EncodeCtx::new(0)).unwrap();
    assert_eq!(global(&f), f32::MIN_POSITIVE);
    assert!(
        gradpack::decode_to_vec(&f)
            .unwrap()
            .iter()
            .all(|&v| v == 0.0)
    );
}

/// `CodecSpec::unbiased` agrees with the README's codec table for the spec of every row
/// (the first spec in backticks), "exact" and "yes" meaning unbiased, "no" and a
/// condition ("with `scale=unbiased`", not met by the row's spec) meaning not.
#[test]
fn unbiased_matches_the_codec_table_of_the_readme() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let table = readme
        .split("| spec (defaults shown) | bits / element | unbiased |")
        .nth(1)
        .expect("the codec table");
    let mut rows = 0;
    for line in table.lines().skip(2) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.split(" | ").collect();
        let spec = cells[0].split('`').nth(1).expect("a spec in backticks");
        // "int8:...,rounding=stochastic" stands for int8 with that rounding.
        let spec = spec.replace(":...,", ":");
        let c: CodecSpec = spec.parse().unwrap_or_else(|e| panic!("{spec}: {e}"));
        let want = matches!(cells[2].trim(), "exact" | "yes");
        assert_eq!(c.unbiased(), want, "{spec}: the README says {:?}", cells[2]);
        rows += 1;
    }
    assert!(rows >= 16, "{rows} rows read");
}

/// `scale_rule=ocp` (fp8 and fp4 with E8M0 scales): parsed, printed only where it is not
/// the default, refused with other scales, recorded in the header (a decoded frame names
/// it), and a header byte that is neither rule is refused.
#[test]
fn the_e8m0_scale_rule_parses_prints_and_travels_in_the_header() {
    for (spec, canonical) in [
        (
            "fp8:scale=e8m0,scale_rule=ocp",
            "fp8:format=e4m3,block=128,scale=e8m0,rounding=nearest,scale_rule=ocp",
        ),
        (
            "fp8:scale=e8m0,scale_rule=rceil",
            "fp8:format=e4m3,block=128,scale=e8m0,rounding=nearest",
        ),
        (
            "fp4:scale_rule=ocp,format=e3m0",
            "fp4:format=e3m0,block=32,scale=e8m0,rounding=nearest,scale_rule=ocp",
        ),
    ] {
        let c: CodecSpec = spec.parse().unwrap();
        assert_eq!(c.to_string(), canonical);
        let x: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let frame = c.encode(&x, &gradpack::EncodeCtx::new(0)).unwrap();
        let h = gradpack::Header::parse(&frame).unwrap();
        assert_eq!(CodecSpec::from_header(&h).unwrap().to_string(), canonical);
    }
    for bad in [
        "fp8:scale_rule=ocp",
        "fp8:scale=none,scale_rule=ocp",
        "fp4:scale=f32,scale_rule=ocp",
        "fp4:scale=e4m3,scale_rule=rceil",
    ] {
        let e = bad.parse::<CodecSpec>().unwrap_err().to_string();
        assert!(
            e.contains("scale_rule applies to scale=e8m0 only"),
            "{bad}: {e}"
        );
    }
    let e = "fp8:scale=e8m0,scale_rule=floor"
        .parse::<CodecSpec>()
        .unwrap_err();
    assert!(e.to_string().contains("rceil, ocp"), "{e}");
    // The rule's byte is params[11]: 2 is no rule, and 1 (ocp) is refused with an f32
    // scale.
    for (spec, byte) in [("fp8:scale=e8m0", 2u8), ("fp8", 1), ("fp4:scale=f32", 1)] {
        let c: CodecSpec = spec.parse().unwrap();
        let mut frame = c
            .encode(&[1.0, -2.0, 0.5, 3.0], &gradpack::EncodeCtx::new(0))
            .unwrap();
        let mut h = gradpack::Header::parse(&frame).unwrap();
        assert_eq!(h.params[11], 0, "{spec}");
        h.params[11] = byte;
        h.write(&mut frame);
        let e = gradpack::decode_to_vec(&frame).unwrap_err().to_string();
        assert!(e.contains("scale_rule"), "{spec} with {byte}: {e}");
    }
}

/// fp8 with `scale_rule=ocp` is, element by element, the OCP MX 1.0 definition: the
/// block's scale byte is `floor(log2 m) - emax + 127` (at least 0), and each element
/// decodes to the nearest fp8 value of its quotient clamped to `±FMAX` (the crate's
/// unscaled conversion, PyTorch's cast), times the scale. Where the block's largest
/// mantissa exceeds FMAX's, the byte is one below the default rule's, else equal.
#[test]
fn fp8_with_the_ocp_rule_is_the_ocp_definition() {
    for (fmt, fmax, emax) in [("e4m3", 448.0f32, 8), ("e5m2", 57344.0, 15)] {
        let ocp: CodecSpec = format!("fp8:format={fmt},block=32,scale=e8m0,scale_rule=ocp")
            .parse()
            .unwrap();
        let rceil: CodecSpec = format!("fp8:format={fmt},block=32,scale=e8m0")
            .parse()
            .unwrap();
        let none: CodecSpec = format!("fp8:format={fmt},scale=none").parse().unwrap();
        // Blocks at every scale, from subnormal to near f32's largest, whose largest
        // element's mantissa falls on either side of FMAX's.
        let mut x = Vec::new();
        for b in 0..2000u32 {
            let e = (b % 250) as i32 - 140;
            for i in 0..32u32 {
                let h = gradpack::rng::lowbias32(b * 32 + i);
                // 2^e in two exact factors: powi(e) alone underflows to 0 past 2^-126.
                // In two blocks of three, mantissas below 1/4 or 1/8: blocks whose
                // largest mantissa is below FMAX's.
                let v = f32::from_bits(0x3F80_0000 | (h >> (9 + b % 3 + (b % 3).min(1))))
                    * 2f32.powi(e / 2)
                    * 2f32.powi(e - e / 2);
                x.push(if h & 1 == 0 { v } else { -v });
            }
        }
        let ctx = gradpack::EncodeCtx::new(0);
        let (f_ocp, f_rceil) = (
            ocp.encode(&x, &ctx).unwrap(),
            rceil.encode(&x, &ctx).unwrap(),
        );
        let nb = x.len() / 32;
        let h = gradpack::HEADER_LEN;
        let back = gradpack::decode_to_vec(&f_ocp).unwrap();
        let (mut below, mut equal) = (0, 0);
        for (b, xb) in x.chunks(32).enumerate() {
            let m = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let k = (m.log2().floor() as i32 - emax).max(-127);
            assert_eq!(
                f_ocp[h + b] as i32,
                k + 127,
                "{fmt} block {b}: absmax {m:e}"
            );
            let larger = (m.to_bits() & 0x7F_FFFF) > (fmax.to_bits() & 0x7F_FFFF);
            let r = f_rceil[h + b] as i32;
            if larger && k > -127 {
                assert_eq!(r, k + 128, "{fmt} block {b}");
                below += 1;
            } else if k > -127 {
                assert_eq!(r, k + 127, "{fmt} block {b}");
                equal += 1;
            }
            let s = 2f32.powi(k / 2) * 2f32.powi(k - k / 2);
            let q: Vec<f32> = xb.iter().map(|v| (v / s).clamp(-fmax, fmax)).collect();
            let want = gradpack::decode_to_vec(&none.encode(&q, &ctx).unwrap()).unwrap();
            for i in 0..32 {
                assert_eq!(
                    back[b * 32 + i].to_bits(),
                    (want[i] * s).to_bits(),
                    "{fmt} block {b} element {i}: {:e}",
                    xb[i]
                );
            }
        }
        assert!(
            below > nb / 10 && equal > nb / 10,
            "{fmt}: {below} {equal} of {nb}"
        );
    }
}
