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
        fid = "%s|%s" % (fid, bench["value_str"])  # op|backend
    rows[(bench["group_id"], fid)] = nbytes / median_ns  # bytes/ns = GB/s

sizes = sorted({int(g.rsplit("/", 1)[1]) for g, _ in rows})
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
