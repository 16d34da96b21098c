#!/usr/bin/env python3
"""Summarise a criterion run of benches/codecs.rs as a markdown table.

Reads target/criterion/**/new/{benchmark,estimates}.json, takes each benchmark's median
time, and prints GB/s of f32 input with ratios to the same-run baselines of the same
size (memcpy, the read-only pass, and half's f16/bf16 slice conversions).

Usage: python3 benches/summarize.py [target/criterion]
"""

import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "target/criterion"
rows = {}  # (group, function) -> GB/s
for dirpath, _, files in os.walk(root):
    if os.path.basename(dirpath) != "new" or "estimates.json" not in files:
        continue
    bench = json.load(open(os.path.join(dirpath, "benchmark.json")))
    est = json.load(open(os.path.join(dirpath, "estimates.json")))
    nbytes = bench["throughput"]["Bytes"]
    median_ns = est["median"]["point_estimate"]
    fid = bench["function_id"]
    if not bench["group_id"].startswith("baseline/"):
        if not bench.get("value_str"):
            continue  # another bench's group (sparsify, feedback): no backend parameter
        fid = "%s|%s" % (fid, bench["value_str"])  # op|backend
    rows[(bench["group_id"], fid)] = nbytes / median_ns  # bytes/ns = GB/s

# Only sizes with same-run baselines (a codecs run writes them for every size it runs).
sizes = sorted({int(g.rsplit("/", 1)[1]) for g, f in rows
                if g.startswith("baseline/") and f == "memcpy"})
for n in sizes:
    base = {f: v for (g, f), v in rows.items() if g == "baseline/%d" % n}
    print("\n#### %d elements (%s of f32)\n" % (n, "%d KiB" % (n * 4 // 1024) if n < 1 << 18 else "%d MiB" % (n * 4 >> 20)))
    print("Baselines: " + ", ".join("%s %.1f GB/s" % (f, v) for f, v in sorted(base.items())))
    print()
    print("| codec | op | backend | GB/s | / memcpy | / read pass | / half f16 | / half bf16 |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (g, f), v in sorted(rows.items()):
        spec, size = g.rsplit("/", 1)
        if spec == "baseline" or int(size) != n:
            continue
        op, backend = f.split("|")
        hf = base.get("half_f16_from_f32" if op == "encode" else "half_f16_to_f32")
        hb = base.get("half_bf16_from_f32" if op == "encode" else "half_bf16_to_f32")
        print("| `%s` | %s | %s | %.2f | %.3f | %.3f | %.2f | %.2f |" % (
            spec, op, backend, v, v / base["memcpy"], v / base["read_sum"], v / hf, v / hb))

# ---------------------------------------------------------------- issue-3 targets
# Each target: (size, codecs, op, baseline, minimum ratio). The figure is the best
# backend's median; "stochastic" codecs are those with random rounding.
SMALL, LARGE = 1 << 16, 1 << 26
DETERMINISTIC_FIXED = ["fp16", "bf16", "int8", "sign"]
STOCHASTIC = ["int8:rounding=stochastic", "qsgd:bits=4", "qsgd:bits=8", "ternary", "natural"]
ALL = sorted({g.rsplit("/", 1)[0] for g, _ in rows if not g.startswith("baseline/")})
TARGETS = [
    (SMALL, ["fp16", "bf16"], "encode", "memcpy", 0.9),
    (SMALL, ["fp16", "bf16"], "decode", "memcpy", 0.9),
    (SMALL, ["sign"], "encode", "memcpy", 1.0),
    (SMALL, ["int8"], "encode", "memcpy", 0.5),
    (SMALL, STOCHASTIC, "encode", "memcpy", 0.2),
    (SMALL, [c for c in ALL if c not in ("fp16", "bf16")], "decode", "memcpy", 0.5),
    (SMALL, ALL, "decode_add", "memcpy", 0.4),
    (LARGE, DETERMINISTIC_FIXED, "encode", "memcpy", 1.1),
    (LARGE, STOCHASTIC, "encode", "memcpy", 0.8),
    (LARGE, ["sign"], "encode", "read_sum", 0.85),
    (SMALL, ["fp16"], "encode", "half_f16_from_f32", 3.0),
    (SMALL, ["bf16"], "encode", "half_bf16_from_f32", 4.0),
]


def best(spec, n, op):
    cands = [(v, f.split("|")[1]) for (g, f), v in rows.items()
             if g == "%s/%d" % (spec, n) and f.split("|")[0] == op]
    return max(cands) if cands else None


if any(int(g.rsplit("/", 1)[1]) in (SMALL, LARGE) for g, _ in rows):
    print("\n#### Targets (best backend's median against the same-run baseline)\n")
    print("| size | codec | op | needs | measured | backend | status |")
    print("|---|---|---|---|---:|---|---|")
    for n, specs, op, base_name, need in TARGETS:
        base = rows.get(("baseline/%d" % n, base_name))
        if base is None:
            continue
        for spec in specs:
            b = best(spec, n, op)
            if b is None:
                continue
            ratio = b[0] / base
            print("| %s | `%s` | %s | >= %.2fx %s | %.3fx | %s | %s |" % (
                "64 Ki" if n == SMALL else "64 Mi", spec, op, need, base_name, ratio, b[1],
                "met" if ratio >= need else "missed"))
