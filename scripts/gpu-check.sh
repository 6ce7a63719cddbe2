#!/usr/bin/env bash
# Runs numa-gpu-alloc's prebuilt test and benchmark binaries on a Linux machine with an NVIDIA GPU
# (no Rust toolchain needed) and prints one summary. Build the folder with
# scripts/build-gpu-bin.sh, copy it over, then:
#
#   gpu-bin/gpu-check.sh [DIR] [--bench] [--dma-args "ARGS"]
#
#   DIR         folder with tests/, dma_bench, bench-dma (default: the script's own folder when it
#               holds tests/, else ./gpu-bin)
#   --bench     also run the criterion benchmark (a few minutes)
#   --dma-args  arguments for dma_bench (default: none, i.e. 256 MiB and a 1 GiB cold block)
#
# When nvidia-smi sees a GPU, NUMA_GPU_ALLOC_REQUIRE_GPU=1 is exported, so a GPU test that would
# skip for want of a driver fails instead. Full logs go to DIR/logs (or a temporary folder).
# Exit status: 0 when every step passed, 1 otherwise.
set -u

dir=""
run_bench=0
dma_args=""
while [ $# -gt 0 ]; do
    case $1 in
        --bench) run_bench=1 ;;
        --dma-args)
            [ $# -ge 2 ] || { echo "gpu-check: --dma-args needs a value" >&2; exit 2; }
            dma_args=$2
            shift
            ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) dir=$1 ;;
    esac
    shift
done
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "$dir" ]; then
    if [ -d "$here/tests" ]; then dir=$here; else dir=gpu-bin; fi
fi
if [ ! -d "$dir/tests" ]; then
    echo "gpu-check: $dir/tests not found; build it with scripts/build-gpu-bin.sh" >&2
    exit 1
fi
dir=$(cd "$dir" && pwd)
logs=$dir/logs
mkdir -p "$logs" 2>/dev/null && [ -w "$logs" ] || logs=$(mktemp -d)
with_timeout() {
    if command -v timeout >/dev/null; then timeout "$@"; else shift; "$@"; fi
}

summary=()
failed=0
note() { summary+=("$*"); }

# --- the machine
gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv,noheader 2>/dev/null)
    nvidia-smi topo -m >"$logs/nvidia-smi-topo.txt" 2>&1
fi
nodes=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
note "host: $(uname -n) $(uname -r) $(uname -m), $(nproc 2>/dev/null || echo '?') CPUs, $nodes NUMA node(s)"
# Without nvidia-smi the driver's own files still show a GPU: then skipping must not pass.
if [ -z "$gpus" ] && { [ -e /dev/nvidia0 ] || ls /proc/driver/nvidia/gpus/* >/dev/null 2>&1; }; then
    gpus="(nvidia-smi missing; /dev/nvidia0 or /proc/driver/nvidia/gpus present)"
fi
if [ -n "$gpus" ]; then
    while IFS= read -r g; do note "gpu: $g"; done <<<"$gpus"
    export NUMA_GPU_ALLOC_REQUIRE_GPU=1
else
    note "gpu: none seen by nvidia-smi: GPU tests will skip, dma_bench measures the host only"
fi
[ -f "$dir/MANIFEST" ] && note "bundle: $(sed -n 2p "$dir/MANIFEST")"
# Binaries linked against a newer glibc than this machine's fail with only "exit 1": say why.
needed=$(sed -n 's/^glibc-needed: //p' "$dir/MANIFEST" 2>/dev/null)
have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
if [ -n "$needed" ] && [ "$needed" != unknown ] && [ -n "$have" ] &&
    [ "$(printf '%s\n%s\n' "$needed" "$have" | sort -t. -k1,1n -k2,2n | head -n1)" != "$needed" ]; then
    echo "gpu-check: these binaries need glibc $needed, this machine has $have; build them on an older distribution" >&2
    exit 1
fi

# --- tests
for bin in "$dir"/tests/*; do
    [ -x "$bin" ] || continue
    name=$(basename "$bin")
    log=$logs/$name.log
    (cd "$dir" && with_timeout 900 "$bin" --nocapture) >"$log" 2>&1
    rc=$?
    passed=$(sed -n 's/^test result: .* \([0-9][0-9]*\) passed.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
    fails=$(sed -n 's/^test result: .* \([0-9][0-9]*\) failed.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
    skipped=$(grep -c 'SKIPPED' "$log")
    if [ $rc -eq 0 ]; then
        note "PASS  $name: $passed passed, $skipped skipped"
    else
        failed=1
        note "FAIL  $name (exit $rc): $passed passed, $fails failed; log $log"
        # Since Rust 1.73 the panic message is on the line after "panicked at".
        while IFS= read -r l; do note "        $l"; done < <(grep -A1 -E "^test .* FAILED|panicked at" "$log" | head -n 12)
    fi
done

# --- dma_bench
if [ -x "$dir/dma_bench" ]; then
    log=$logs/dma_bench.txt
    # shellcheck disable=SC2086
    (cd "$dir" && with_timeout 600 ./dma_bench $dma_args) >"$log" 2>&1
    rc=$?
    # A row that failed inside a measurement only carries a "failed: ..." note.
    if [ $rc -eq 0 ] && ! grep -qE "measurements stopped|failed: " "$log"; then
        note "PASS  dma_bench"
    else
        failed=1
        note "FAIL  dma_bench (exit $rc); log $log"
    fi
    if [ -n "$gpus" ] && grep -q "^no CUDA driver" "$log"; then
        failed=1
        note "FAIL  dma_bench did not find the CUDA driver although nvidia-smi sees a GPU"
    fi
    while IFS= read -r l; do note "        $l"; done <"$log"
    # shellcheck disable=SC2086
    (cd "$dir" && with_timeout 600 ./dma_bench --json $dma_args) >"$logs/dma_bench.json" 2>/dev/null
else
    failed=1
    note "FAIL  dma_bench missing from $dir"
fi

# --- criterion benchmark (optional)
if [ $run_bench -eq 1 ] && [ -x "$dir/bench-dma" ]; then
    log=$logs/bench-dma.txt
    (cd "$dir" && with_timeout 1800 ./bench-dma --bench --warm-up-time 1 --measurement-time 3) >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then note "PASS  bench-dma"; else failed=1; note "FAIL  bench-dma (exit $rc); log $log"; fi
    while IFS= read -r l; do note "        $l"; done < <(grep -E "skipped|time:|thrpt:|^dma|^pinned" "$log" | head -n 40)
fi

echo "=== numa-gpu-alloc GPU check ==="
printf '%s\n' "${summary[@]}"
if [ $failed -eq 0 ]; then echo "RESULT: PASS (logs in $logs)"; else echo "RESULT: FAIL (logs in $logs)"; fi
exit $failed
