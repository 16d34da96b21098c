//! Data-parallel SGD with compressed gradients: fp32 against a few codecs, with and
//! without error feedback, on the built-in synthetic task.
//!
//! ```text
//! cargo run --release --example train [softmax|mlp]
//! ```
//!
//! `gradpack train` (feature `cli`) is the full tool: every codec, options, a plot.

use gradpack::CodecSpec;
use gradpack::collective::Strategy;
use gradpack::train::{Dataset, ModelKind, TrainConfig, train};

fn main() -> Result<(), gradpack::Error> {
    let model = match std::env::args().nth(1).as_deref() {
        Some("softmax") => ModelKind::Softmax,
        None | Some("mlp") => ModelKind::Mlp { hidden: 64 },
        Some(other) => {
            eprintln!("unknown model {other:?}: softmax or mlp");
            std::process::exit(2);
        }
    };
    let ds = Dataset::synthetic(1);
    let cfg = TrainConfig::new(model);
    let identity: CodecSpec = "identity".parse()?;
    let base = train(
        &ds,
        &TrainConfig {
            strategy: Strategy::Fp32Ring,
            ..cfg.clone()
        },
        identity,
        false,
    )?;
    println!(
        "{} workers, {} epochs, {} steps; {} parameters\n",
        cfg.workers,
        cfg.epochs,
        base.steps,
        model.params(ds.features, ds.classes)
    );
    println!("| codec | EF | test loss | test accuracy | bytes/worker |");
    println!("|---|---|---:|---:|---:|");
    let row = |r: &gradpack::train::TrainResult| {
        let l = r.last();
        println!(
            "| {} | {} | {:.4} | {:.2}% | {} |",
            r.codec,
            if r.feedback { "yes" } else { "no" },
            l.test_loss,
            100.0 * l.test_accuracy,
            r.bytes_per_worker
        );
    };
    row(&base);
    let list =
        std::env::var("CODECS").unwrap_or("fp16,bf16,int8,sign,topk:ratio=0.01,qsgd:bits=2".into());
    for spec in list.split(';') {
        let codec: CodecSpec = spec.parse()?;
        for ef in [false, true] {
            row(&train(&ds, &cfg, codec, ef)?);
        }
    }
    Ok(())
}
