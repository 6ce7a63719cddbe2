#!/usr/bin/env bash
# Real programs under LD_PRELOAD of numa-gpu-alloc's preload library, Debian's jemalloc and
# mimalloc, and glibc alone: wall time and peak RSS per run, and whether each output is the same
# bytes as glibc's. Then the time a foreign free spends in the library's ownership check.
#
# usage: scripts/preload-compare.sh [SIZE_MIB]   (default 1024: sort and gzip on a 1 GiB file,
#        xz on a quarter of it; CI runs it with 16)
# Needs: cargo, cc, /usr/bin/time; libjemalloc2, libmimalloc2.0 and ripgrep (apt-get install),
# skipped with a note when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
size_mib=${1:-1024}
cargo build --release -q -p numa-gpu-alloc-preload
ours=$PWD/target/release/libnuma_gpu_alloc_preload.so
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

declare -A preload=([glibc]="" [numa-gpu-alloc]="$ours")
for lib in jemalloc:libjemalloc.so.2 mimalloc:libmimalloc.so.2; do
    # awk reads all of ldconfig's list: an early exit would end ldconfig by SIGPIPE (pipefail).
    path=$(ldconfig -p | awk -v n="${lib#*:}" '$1 == n && p == "" { p = $NF } END { print p }')
    if [ -n "$path" ]; then preload[${lib%%:*}]=$path; else echo "note: ${lib#*:} not installed, its rows left out"; fi
done
allocators=(glibc numa-gpu-alloc)
for a in jemalloc mimalloc; do [ -n "${preload[$a]:-}" ] && allocators+=("$a"); done

# Input: lines of pseudo-random hex (awk's rand with a fixed seed), size_mib MiB.
awk -v lines=$((size_mib * 1048576 / 17)) 'BEGIN { srand(42); for (i = 0; i < lines; i++) printf "%08x%08x\n", rand() * 4294967296, rand() * 4294967296 }' > "$work/in.txt"
head -c $((size_mib * 1048576 / 4)) "$work/in.txt" > "$work/quarter.txt"
cc -O2 -pthread -o "$work/lifecycle" preload/tests/c/lifecycle.c
cc -O2 -o "$work/foreign_free" preload/bench/foreign_free.c
cat > "$work/buffers.py" <<'PY'
# Python's large buffers: bytearrays and bytes of 16 to 512 MiB made, filled, sliced, freed.
import hashlib
h = hashlib.sha256()
for round in range(6):
    for mib in (16, 64, 256, 512):
        b = bytearray(mib << 20)
        b[:: 4096] = bytes([round]) * len(range(0, mib << 20, 4096))
        h.update(bytes(b[-(1 << 20):]))
        del b
print(h.hexdigest())
PY

jobs=(
    "sort -S 1G $work/in.txt"
    "gzip -c -6 $work/in.txt"
    "xz -c -1 -T2 $work/quarter.txt"
    "python3 $work/buffers.py"
    "$work/lifecycle 2 $((size_mib / 2 + 100)) portable"
)
# ripgrep, when installed, over lines of size_mib/16 MiB: without mmap its line buffer grows to
# hold one.
if command -v rg > /dev/null; then
    tr -d '\n' < "$work/in.txt" | fold -b -w $((size_mib * 65536)) > "$work/long.txt"
    jobs+=("rg --no-mmap -c 0 $work/long.txt")
else
    echo "note: ripgrep not installed, its row left out"
fi
differ=0
printf '%-34s %-15s %9s %14s  %s\n' program allocator "wall s" "peak RSS MiB" output
for job in "${jobs[@]}"; do
    name=$(awk '{ for (i = 1; i <= 3 && i <= NF; i++) { n = split($i, p, "/"); printf "%s ", p[n] } }' <<<"$job")
    for a in "${allocators[@]}"; do
        LD_PRELOAD=${preload[$a]} /usr/bin/time -f '%e %M' -o "$work/time" $job > "$work/out.$a"
        read -r wall rss < "$work/time"
        if cmp -s "$work/out.glibc" "$work/out.$a"; then same="same as glibc"; else same="DIFFERENT"; differ=1; fi
        printf '%-34s %-15s %9s %14.1f  %s\n' "$name" "$a" "$wall" "$(echo "$rss / 1024" | bc -l)" "$same"
    done
done
echo
LD_PRELOAD=$ours "$work/foreign_free"
[ "$differ" = 0 ] || { echo "an output differed from glibc's" >&2; exit 1; }
