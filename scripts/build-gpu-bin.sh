#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on a GPU machine that has no Rust toolchain:
#   gpu-bin/tests/<kind>-<name>   release test executables (unit tests and tests/*.rs)
#   gpu-bin/bench-dma             the criterion DMA benchmark (benches/dma.rs)
#   gpu-bin/bench-pinned          the pinned pipeline benchmark (benches/pinned.rs)
#   gpu-bin/dma_bench             the DMA example
#   gpu-bin/kv_reserve            the background reservation example
#   gpu-bin/gpu-check.sh          the runner; gpu-bin/MANIFEST  what was built, from which commit
#
# usage: scripts/build-gpu-bin.sh [OUT_DIR]        (default: gpu-bin/ in the repository root)
# Extra cargo arguments (e.g. --target x86_64-unknown-linux-gnu) may be given in $CARGO_ARGS.
# Copy the folder to the GPU machine and run `bash gpu-bin/gpu-check.sh --deadline 420` there
# (the check writes its logs and summary.json to $OUT, or gpu-bin/out). The binaries load
# libcuda at run time, so they need only glibc (no older than the build machine's) and the
# driver. The script fails if the folder grows past 64 MiB, to keep it quick to copy.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/gpu-bin}
cd "$root"
read -r -a extra <<<"${CARGO_ARGS:-}"

# Keep the output folder out of git without touching .gitignore.
if exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/gpu-bin/' "$exclude" 2>/dev/null || echo '/gpu-bin/' >>"$exclude"
fi

rm -rf "$out"
mkdir -p "$out/tests"

# Prints "KIND NAME EXECUTABLE" for every artifact with an executable in cargo's JSON messages.
executables() {
    sed -n 's/.*"reason":"compiler-artifact".*"target":{"kind":\["\([^"]*\)"\][^}]*"name":"\([^"]*\)".*"executable":"\([^"]*\)".*/\1 \2 \3/p'
}

echo "building release test binaries..." >&2
n=0
while read -r kind name exe; do
    case $kind in
        lib) dest="$out/tests/unit-$name" ;;
        # The fuzz corpus is read from the source tree, which does not travel (gpu-check.sh
        # skips the integration binary's sysfs fixture tests for the same reason).
        test) case $name in fuzz_corpus) continue ;; esac
              dest="$out/tests/test-$name" ;;
        *) continue ;; # examples are built (not as tests) by `cargo test`: not test binaries
    esac
    cp "$exe" "$dest"
    n=$((n + 1))
done < <(cargo test --release --no-run --message-format=json "${extra[@]}" | executables)
[ "$n" -gt 0 ] || { echo "no test executables found" >&2; exit 1; }

echo "building the dma and pinned benches..." >&2
while read -r kind name exe; do
    [ "$kind" = bench ] && cp "$exe" "$out/bench-$name"
done < <(cargo bench --no-run --bench dma --bench pinned --message-format=json "${extra[@]}" | executables)
for bench in dma pinned; do
    [ -x "$out/bench-$bench" ] || { echo "the $bench bench was not built" >&2; exit 1; }
done

echo "building the dma_bench example..." >&2
while read -r kind name exe; do
    [ "$kind" = example ] && cp "$exe" "$out/$name"
done < <(cargo build --release --example dma_bench --example kv_reserve --message-format=json "${extra[@]}" | executables)
for example in dma_bench kv_reserve; do
    [ -x "$out/$example" ] || { echo "the $example example was not built" >&2; exit 1; }
done

cp scripts/gpu-check.sh "$out/gpu-check.sh"
chmod +x "$out/gpu-check.sh"
{
    echo "numa-gpu-alloc GPU test bundle"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty tree)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(rustc --version)"
    echo "glibc: $(ldd --version 2>/dev/null | head -n1)"
    # The newest glibc symbol version any binary uses: gpu-check.sh refuses older machines.
    needed=$(find "$out" -type f -perm -u+x ! -name '*.sh' -exec objdump -T {} + 2>/dev/null |
        grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -t. -k1,1n -k2,2n -k3,3n | tail -n1)
    echo "glibc-needed: ${needed:-unknown}"
    echo "files:"
    (cd "$out" && find . -type f ! -name MANIFEST | sort | sed 's/^/  /')
} >"$out/MANIFEST"
size_kib=$(du -sk "$out" | cut -f1)
echo "bundle: $((size_kib / 1024)) MiB in $out" >&2
if [ "$size_kib" -gt $((64 * 1024)) ]; then
    echo "the bundle is larger than 64 MiB" >&2
    exit 1
fi
echo "done: run \`bash $(basename "$out")/gpu-check.sh --deadline 420\` from the folder above it on the GPU machine" >&2
