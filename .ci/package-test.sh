#!/usr/bin/env bash
# What crates.io users get: packs the crate as `cargo publish` would, unpacks it into a fresh
# directory, and builds and runs its tests there (the examples are built), so that no packaged
# file depends on one the package excludes. The benchmarks are the repository's
# `benches/` package, not shipped: they need their peers and the repository's scripts.
# Dependencies come from the crate's target directory, already built by the earlier steps.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
cargo package --quiet --allow-dirty --no-verify -p numa-gpu-alloc
unpacked=target/package-test
rm -rf "$unpacked" && mkdir -p "$unpacked"
tar xzf "target/package/numa-gpu-alloc-$version.crate" -C "$unpacked"
cd "$unpacked/numa-gpu-alloc-$version"
# Every test target builds from what is packed; the tests that read packed files run (the sysfs
# fixtures: the unit tests and the integration binary's topology, placement and decay modules;
# the simulator's source: its reservations; the README: the doc tests). The rest ran in the
# checkout already.
cargo test --target-dir ../.. --no-run
cargo test --target-dir ../.. --lib
cargo test --target-dir ../.. --test integration -- topology:: placement:: decay_thread:: reserve_sim::
cargo test --target-dir ../.. --doc
