#!/bin/sh
# Seed corpora from the golden vectors (tests/vectors): every frame for the decoding
# targets, and every golden input under a spread of control bytes for the round trip.
# Usage: fuzz/seed.sh (from anywhere); writes fuzz/seeds/TARGET/.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
vectors="$here/../tests/vectors"
seeds="$here/seeds"
rm -rf "$seeds"
mkdir -p "$seeds/decode_any" "$seeds/header" "$seeds/output_independence" "$seeds/roundtrip"
for f in "$vectors"/*.gpk "$vectors"/*.sealed; do
    name=$(basename "$f")
    cp "$f" "$seeds/header/$name"
    cp "$f" "$seeds/output_independence/$name"
    { printf '\000'; cat "$f"; } > "$seeds/decode_any/$name"
    { printf '\003'; cat "$f"; } > "$seeds/decode_any/$name.len21"
done
# Round trip: every codec id (0..14), block 64, a few variant bits, ratio 26/256, seed 42.
for input in input input-nonfinite; do
    for codec in 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14; do
        for variant in 00 11 1a 2c 48 88 a8; do
            out="$seeds/roundtrip/$input-$codec-$variant"
            printf "\\$(printf '%03o' "$codec")\\100\\000\\$(printf '%03o' "0x$variant")\\031\\000\\000\\000\\052\\000\\000\\000" > "$out"
            cat "$vectors/$input.f32" >> "$out"
        done
    done
done
# The collective's receive path and the .npy reader: real message streams and files,
# written by the regression tests that check them.
GRADPACK_FUZZ_SEEDS="$seeds" cargo test --quiet --manifest-path "$here/../Cargo.toml" \
    --test fuzz_regressions -- collective_seeds npy_reader >/dev/null
echo "seeded $(find "$seeds" -type f | wc -l) files in $seeds"
