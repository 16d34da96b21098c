//! Measures how often random bit damage to a frame is detected, with and without the
//! payload checksum (wire format section 1.3): `cargo run --release --example corruption
//! [TRIALS_PER_CASE] [ELEMENTS]` (defaults 50000 and 2048).
//!
//! For each representative codec, the synthetic gradient is encoded once plain and once
//! sealed. Each trial copies the frame, flips `f` distinct bits at uniformly random
//! positions anywhere in the frame (`f` = 1 in 40% of trials, 2 in 20%, 3 in 15%, else
//! uniform in 4..=64) and decodes it. The outcome is *detected* (an error), *harmless*
//! (decodes to the same bits as the undamaged frame) or *silent* (decodes without error to
//! different values: the failure a checksum exists to prevent). Trials whose flips touch
//! the header are also counted on their own: the header CRC must catch every one.
//! Prints a Markdown table (docs/robustness.md records a run).

use gradpack::{Checksummed, Codec, CodecSpec, EncodeCtx, HEADER_LEN};

#[derive(Default, Clone, Copy)]
struct Tally {
    trials: u64,
    detected: u64,
    harmless: u64,
    silent: u64,
    single: u64,
    single_detected: u64,
    header_trials: u64,
    header_detected: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.trials += o.trials;
        self.detected += o.detected;
        self.harmless += o.harmless;
        self.silent += o.silent;
        self.single += o.single;
        self.single_detected += o.single_detected;
        self.header_trials += o.header_trials;
        self.header_detected += o.header_detected;
    }
}

/// The next draw of a counter-based generator (the crate's splitmix64 finaliser).
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(1);
    gradpack::rng::splitmix64(*state)
}

fn below(state: &mut u64, n: u64) -> u64 {
    ((next(state) as u128 * n as u128) >> 64) as u64
}

fn flips(state: &mut u64) -> usize {
    match below(state, 100) {
        0..40 => 1,
        40..60 => 2,
        60..75 => 3,
        _ => 4 + below(state, 61) as usize,
    }
}

fn measure(frame: &[u8], reference: &[u32], trials: u64, seed: u64) -> Tally {
    let mut t = Tally::default();
    // Scrambled, so that the counter streams of nearby seeds do not overlap.
    let mut state = gradpack::rng::splitmix64(seed);
    let bits = frame.len() as u64 * 8;
    let mut g = frame.to_vec();
    let mut out = vec![0f32; reference.len()];
    let mut pos = Vec::with_capacity(64);
    for _ in 0..trials {
        g.copy_from_slice(frame);
        let f = flips(&mut state);
        pos.clear();
        while pos.len() < f {
            let b = below(&mut state, bits);
            if !pos.contains(&b) {
                pos.push(b);
            }
        }
        for &b in &pos {
            g[(b / 8) as usize] ^= 1 << (b % 8);
        }
        let in_header = pos.iter().any(|&b| b < HEADER_LEN as u64 * 8);
        let detected = gradpack::decode(&g, &mut out).is_err();
        t.trials += 1;
        t.single += u64::from(f == 1);
        t.header_trials += u64::from(in_header);
        if detected {
            t.detected += 1;
            t.single_detected += u64::from(f == 1);
            t.header_detected += u64::from(in_header);
        } else if out.iter().zip(reference).all(|(x, r)| x.to_bits() == *r) {
            t.harmless += 1;
        } else {
            t.silent += 1;
        }
    }
    t
}

fn pct(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.3}%", 100.0 * a as f64 / b as f64)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let trials: u64 = args.next().map_or(Ok(50_000), |a| a.parse())?;
    let n: usize = args.next().map_or(Ok(2048), |a| a.parse())?;
    let x = gradpack::synthetic::gradient(n, 3);
    let ctx = EncodeCtx::new(5);
    println!("{trials} trials per codec and kind, {n} elements, 1 to 64 bits flipped per trial\n");
    println!(
        "| codec | kind | frame bytes | detected | harmless | silent | 1-bit flips detected | header touched: detected |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut totals = [Tally::default(); 2];
    for (c, s) in gradpack::codec::REPRESENTATIVE_SPECS.iter().enumerate() {
        let spec: CodecSpec = s.parse()?;
        let plain = spec.encode(&x, &ctx)?;
        let sealed = Checksummed(spec).encode(&x, &ctx)?;
        let reference: Vec<u32> = gradpack::decode_to_vec(&plain)?
            .iter()
            .map(|v| v.to_bits())
            .collect();
        for (k, (kind, frame)) in [("plain", &plain), ("sealed", &sealed)]
            .into_iter()
            .enumerate()
        {
            let t = measure(
                frame,
                &reference,
                trials,
                0x5EED ^ ((c as u64) << 8) ^ k as u64,
            );
            totals[k].add(&t);
            println!(
                "| `{s}` | {kind} | {} | {} | {} | {} | {} | {} of {} |",
                frame.len(),
                pct(t.detected, t.trials),
                pct(t.harmless, t.trials),
                pct(t.silent, t.trials),
                pct(t.single_detected, t.single),
                t.header_detected,
                t.header_trials
            );
        }
    }
    for (k, kind) in ["plain", "sealed"].into_iter().enumerate() {
        let t = &totals[k];
        println!(
            "| all | {kind} | | {} | {} | {} ({} trials) | {} | {} of {} |",
            pct(t.detected, t.trials),
            pct(t.harmless, t.trials),
            pct(t.silent, t.trials),
            t.silent,
            pct(t.single_detected, t.single),
            t.header_detected,
            t.header_trials
        );
    }
    let all = totals[0].trials + totals[1].trials;
    println!("\n{all} trials in total");
    if totals[1].silent > 0 || totals.iter().any(|t| t.header_detected != t.header_trials) {
        return Err("a sealed frame or a damaged header was accepted with different values".into());
    }
    Ok(())
}
