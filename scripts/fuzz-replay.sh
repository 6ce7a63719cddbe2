#!/usr/bin/env bash
# Replays the fuzz corpus (fuzz/corpus/<target>/*) through the fuzz targets' checks, on stable
# Rust: no nightly, no cargo-fuzz. For CI.
#
#   bash scripts/fuzz-replay.sh            # replay the corpus (stable)
#   FUZZ_SECONDS=60 bash scripts/fuzz-replay.sh --fuzz
#                                          # also fuzz each target for FUZZ_SECONDS with
#                                          # `cargo +nightly fuzz` (needs nightly and cargo-fuzz),
#                                          # growing fuzz/corpus/<target>/
set -euo pipefail
cd "$(dirname "$0")/.."

cargo test --test fuzz_corpus -- --nocapture

if [[ "${1:-}" == "--fuzz" ]]; then
    if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
        echo "fuzz-replay: --fuzz needs a nightly toolchain and cargo-fuzz (cargo install cargo-fuzz)" >&2
        exit 1
    fi
    seconds="${FUZZ_SECONDS:-60}"
    cd fuzz
    for target in $(cargo +nightly fuzz list); do
        echo "fuzz-replay: fuzzing $target for ${seconds}s"
        cargo +nightly fuzz run "$target" "corpus/$target" -- \
            -max_total_time="$seconds" -max_len=512 -timeout=10
    done
fi
