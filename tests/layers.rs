//! The crate's layers, checked on its source: each module names only the modules below
//! it. The bottom (the codec ids, the error type, the hash behind every random draw, the
//! scalar oracle) depends on nothing above it, the kernels on nothing but that bottom,
//! and neither the collectives nor the sync engine on the demo (`synthetic`, `train`).
//!
//! A path is read from the code outside comments and `#[cfg(test)]` modules: a
//! `crate::name` or `super::name` anywhere in it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The code of a source file without its comment lines and its test module.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    code_in(&text)
}

/// `text` without its comment lines and its test module.
fn code_in(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module names that follow `prefix` (`crate::` or `super::`) in `code`.
fn named_after(code: &str, prefix: &str) -> BTreeSet<String> {
    code.match_indices(prefix)
        .filter(|(at, _)| {
            // Not the tail of a longer path (`a::crate::`), nor an identifier's end.
            let before = code[..*at].chars().next_back();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
        })
        .map(|(at, _)| {
            code[at + prefix.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// Every `.rs` file under `dir` (or `dir` itself, a file).
fn sources(dir: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    if root.is_file() {
        return vec![root];
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{d:?}: {e}")) {
            let p = entry.expect("a directory entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    assert!(!out.is_empty(), "no sources under {dir}");
    out
}

/// Assert that the files under `dir` name only `allowed` modules of the crate.
fn only(dir: &str, allowed: &[&str]) {
    for path in sources(dir) {
        let named = named_after(&code_of(&path), "crate::");
        let extra: Vec<_> = named
            .iter()
            .filter(|n| !allowed.contains(&n.as_str()))
            .collect();
        assert!(
            extra.is_empty(),
            "{path:?} names {extra:?}; this layer may name only {allowed:?}"
        );
    }
}

/// Assert that the files under `dir` name none of `banned`.
fn never(dir: &str, banned: &[&str]) {
    for path in sources(dir) {
        let named = named_after(&code_of(&path), "crate::");
        let bad: Vec<_> = named
            .iter()
            .filter(|n| banned.contains(&n.as_str()))
            .collect();
        assert!(bad.is_empty(), "{path:?} names {bad:?}, a layer above it");
    }
}

#[test]
fn the_bottom_of_the_crate_names_nothing_above_it() {
    only("src/codec_id.rs", &[]);
    only("src/rng.rs", &[]);
    only("src/error.rs", &["codec_id"]);
    only("src/sample.rs", &["rng"]);
    only("src/wire", &["codec_id", "error", "kernels", "rng"]);
}

#[test]
fn the_scalar_oracle_depends_on_nothing_but_the_draws() {
    let code: String = sources("src/kernels/scalar")
        .iter()
        .map(|p| code_of(p))
        .collect();
    assert_eq!(
        named_after(&code, "crate::"),
        BTreeSet::from(["rng".to_string()])
    );
    assert!(
        named_after(&code, "super::").is_empty(),
        "the oracle names a sibling kernel module: {:?}",
        named_after(&code, "super::")
    );
}

#[test]
fn the_kernels_name_only_the_bottom() {
    only("src/kernels", &["kernels", "rng", "error"]);
}

#[test]
fn the_engine_and_the_collectives_do_not_know_the_demo() {
    never("src/sync", &["synthetic", "train"]);
    // The engine is built on the collectives, never the other way round.
    never("src/collective", &["sync", "outer", "synthetic", "train"]);
    never(
        "src/codecs",
        &["sync", "outer", "collective", "synthetic", "train"],
    );
}

#[test]
fn the_reader_finds_paths_and_skips_comments() {
    let code = "use crate::rng::Draws;\n// crate::sync is mentioned\nlet x = a::crate::b;\nsuper::fp8::value(crate::error::Error)";
    let code = code_in(code);
    assert_eq!(
        named_after(&code, "crate::"),
        BTreeSet::from(["rng".to_string(), "error".to_string()])
    );
    assert_eq!(
        named_after(&code, "super::"),
        BTreeSet::from(["fp8".to_string()])
    );
}
