#!/usr/bin/env bash
# Builds and runs each program here with a cargo command of its own: Cargo unifies features over
# the packages of one command, and these members' cudarc features must not meet. They share the
# crate's target directory, so dependencies built for the crate's tests are reused.
set -euo pipefail
cd "$(dirname "$0")"
for member in cuda-12060 cuda-13000 cudarc-defaults; do
    cargo run --quiet --target-dir ../../target -p "compose-$member"
done
# Linked against libcuda when built, and CI has none to link: compiled, not linked or run.
cargo check --quiet --target-dir ../../target -p compose-dynamic-linking
