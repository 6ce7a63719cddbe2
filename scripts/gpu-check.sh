#!/usr/bin/env bash
# Runs numa-gpu-alloc's prebuilt test and benchmark binaries on a Linux machine with an NVIDIA GPU
# (no Rust toolchain needed), within one overall deadline, printing each step's verdict as it
# happens. Build the folder with scripts/build-gpu-bin.sh, copy it over, then:
#
#   bash gpu-bin/gpu-check.sh [DIR] [--deadline SECONDS] [--bench] [--dma-args "ARGS"]
#
#   DIR         folder with tests/, dma_bench, bench-dma (default: the script's own folder when it
#               holds tests/, else ./gpu-bin)
#   --deadline  seconds for the whole check (default 420, or $GPU_CHECK_DEADLINE); every step is
#               stopped with `timeout` so that the summary is written before the deadline
#   --bench     also run the criterion benchmarks (bench-dma, bench-pinned), shortened, if time
#               is left
#   --dma-args  arguments for dma_bench (default: none; see `dma_bench --help`)
#
# Order: the machine (driver version, persistence mode, each GPU's PCI id and NUMA node), the GPU
# test binaries (test-gpu; test-pinned_sim and test-host_numa_sim with
# NUMA_GPU_ALLOC_REAL_DRIVER=1) with the GPU visible and NUMA_GPU_ALLOC_REQUIRE_GPU=1 (without a
# GPU: skipping, and the simulator), one
# dma_bench run, the other test binaries with CUDA_VISIBLE_DEVICES= (cuInit finds no device, so
# none creates a context), then the optional bench.
#
# Logs (also as logs.tar.gz), dma_bench.json, this output (gpu-check.txt) and summary.json go to
# ${OUT:-DIR/out}.
# Exit status: 0 every step passed on a machine with a GPU; 1 a step failed, timed out, or no
# test binary ran; 2 bad usage or no bundle; 3 no GPU on this machine (every host-side step
# passed, GPU steps skipped: not a GPU verdict).
set -u

start=$(date +%s)
deadline_s=${GPU_CHECK_DEADLINE:-420}
dir=""
run_bench=0
dma_args=""
usage() { sed -n '2,24p' "$0"; }
while [ $# -gt 0 ]; do
    case $1 in
        --bench) run_bench=1 ;;
        --deadline | --dma-args)
            [ $# -ge 2 ] || { echo "gpu-check: $1 needs a value" >&2; exit 2; }
            if [ "$1" = --deadline ]; then deadline_s=$2; else dma_args=$2; fi
            shift
            ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "gpu-check: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) dir=$1 ;;
    esac
    shift
done
case $deadline_s in
    '' | *[!0-9]*) echo "gpu-check: the deadline must be whole seconds, got '$deadline_s'" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "$dir" ]; then
    if [ -d "$here/tests" ]; then dir=$here; else dir=gpu-bin; fi
fi
if [ ! -d "$dir/tests" ]; then
    echo "gpu-check: $dir/tests not found; build it with scripts/build-gpu-bin.sh" >&2
    exit 2
fi
dir=$(cd "$dir" && pwd)
out=${OUT:-$dir/out}
logs=$out/logs
if ! mkdir -p "$logs" || [ ! -w "$logs" ]; then
    echo "gpu-check: cannot write to $logs; set OUT to a writable folder" >&2
    exit 2
fi
out=$(cd "$out" && pwd)
logs=$out/logs
# Everything printed is also kept, in case the caller only sees the tail.
exec > >(tee "$out/gpu-check.txt") 2>&1
tee_pid=$!
# The copy is complete before the script returns.
trap 'exec >&- 2>&-; wait "$tee_pid"' EXIT
if ! command -v timeout >/dev/null; then
    echo "gpu-check: coreutils' timeout is missing: the deadline cannot be enforced" >&2
    exit 2
fi

# --- bookkeeping: one record per step, printed when it ends and kept for summary.json
steps_json=()
failed=0
binaries_run=0
gpu_present=0
json_escape() {
    local s=$1
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\n'/\\n}
    s=${s//$'\t'/ }
    printf '%s' "$s" | tr -d '\000-\037'
}
elapsed() { echo $(($(date +%s) - start)); }
# Seconds a step may run: its own cap, but never past the deadline less a reserve for the rest.
budget() {
    local cap=$1 left
    left=$((start + deadline_s - $(date +%s) - 10))
    [ "$left" -lt "$cap" ] && cap=$left
    echo "$cap"
}
# record STATUS NAME SECONDS REASON [LOG]: prints the verdict line and the reason's lines.
record() {
    local status=$1 name=$2 secs=$3 reason=$4 log=${5:-}
    [ "$status" = FAIL ] && failed=1
    printf '%-4s  %-28s %4ss  %s\n' "$status" "$name" "$secs" "$(head -n1 <<<"$reason")"
    tail -n +2 <<<"$reason" | sed 's/^/        /'
    steps_json+=("{\"name\":\"$(json_escape "$name")\",\"status\":\"$status\",\"seconds\":$secs,\"reason\":\"$(json_escape "$reason")\",\"log\":\"$(json_escape "$log")\"}")
    write_summary running
}
write_summary() {
    local result=$1 gpus_json
    gpus_json=$(json_escape "${gpus:-}")
    {
        printf '{"result":"%s","deadline_s":%s,"elapsed_s":%s,"gpu_present":%s,"gpus":"%s",' \
            "$result" "$deadline_s" "$(elapsed)" "$([ $gpu_present = 1 ] && echo true || echo false)" "$gpus_json"
        printf '"test_binaries_run":%s,"steps":[' "$binaries_run"
        local IFS=,
        printf '%s' "${steps_json[*]}"
        printf ']}\n'
    } >"$out/summary.json"
}
# Why a process with exit status RC failed, from its log: the panic messages, else the log's tail.
failure_reason() {
    local rc=$1 log=$2 limit=$3 why
    case $rc in
        124 | 137) why="timed out after ${limit}s (stopped by timeout)" ;;
        *) if [ "$rc" -gt 128 ]; then
               why="killed by signal SIG$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))"
           else
               why="exit $rc"
           fi ;;
    esac
    # Since Rust 1.73 the panic message is on the line after "panicked at".
    local panics
    panics=$(grep -A1 -E "^test .* FAILED|panicked at" "$log" 2>/dev/null | grep -v '^--$' | head -n 12)
    if [ -n "$panics" ]; then
        printf '%s\n%s' "$why" "$panics"
    else
        # An abort or a signal prints no panic: the last lines say where it stopped.
        printf '%s, no panic message; last lines of the log:\n%s' "$why" "$(tail -n 8 "$log" 2>/dev/null)"
    fi
}

# Stopped from outside (e.g. the device's own limit): the running step is stopped and the summary
# still says how far the check got. Steps run in the background and are waited for, so that the
# trap runs at once.
child=""
on_signal() {
    [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
    record FAIL interrupted "$(elapsed)" "stopped by a signal after $(elapsed)s"
    write_summary FAIL
    exit 1
}
trap on_signal TERM INT HUP
# bg_step LOG COMMAND...: runs COMMAND (`exec`ed, so that $child is the process itself) with its
# output in LOG and waits for it; the exit status is the command's.
bg_step() {
    local log=$1 rc
    shift
    (cd "$dir" && exec "$@") >"$log" 2>&1 &
    child=$!
    # Bash's own "Aborted" notice stays out of the output: the step's reason says it.
    { wait "$child"; } 2>/dev/null
    rc=$?
    child=""
    return $rc
}

# --- the machine
echo "=== numa-gpu-alloc GPU check (deadline ${deadline_s}s; logs and summary.json in $out) ==="
nodes=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
echo "host: $(uname -n) $(uname -r) $(uname -m), $(nproc 2>/dev/null || echo '?') CPUs, $nodes NUMA node(s), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo 2>/dev/null) memory"
[ -f "$dir/MANIFEST" ] && echo "bundle: $(sed -n 2p "$dir/MANIFEST")"
gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
    query=index,name,pci.bus_id,driver_version,persistence_mode,memory.total
    gpus=$(timeout 30 nvidia-smi --query-gpu=$query --format=csv,noheader 2>"$logs/nvidia-smi.err")
    rc=$?
    [ $rc -eq 0 ] || echo "nvidia-smi --query-gpu failed (exit $rc): $(head -n 3 "$logs/nvidia-smi.err")"
    timeout 30 nvidia-smi topo -m >"$logs/nvidia-smi-topo.txt" 2>&1
else
    echo "nvidia-smi: not installed"
fi
[ -r /proc/driver/nvidia/version ] && echo "kernel module: $(head -n1 /proc/driver/nvidia/version)"
if [ -n "$gpus" ]; then
    gpu_present=1
    while IFS=, read -r idx name bus driver persist mem; do
        # nvidia-smi writes 00000000:81:00.0; sysfs names it 0000:81:00.0.
        pci=$(echo "$bus" | tr -d ' ' | tr 'A-F' 'a-f' | sed 's/^0000\(....:\)/\1/')
        numa=$(cat "/sys/bus/pci/devices/$pci/numa_node" 2>/dev/null || echo '?')
        echo "gpu $idx:${name} | pci $pci | NUMA node $numa | driver${driver} | persistence${persist} |${mem}"
    done <<<"$gpus"
elif [ -e /dev/nvidia0 ] || ls /proc/driver/nvidia/gpus/* >/dev/null 2>&1; then
    # The driver's own files show a GPU that nvidia-smi did not list: GPU steps must not skip.
    gpu_present=1
    gpus="(nvidia-smi listed none; /dev/nvidia0 or /proc/driver/nvidia/gpus present)"
    echo "gpu: $gpus"
else
    echo "gpu: NONE on this machine (no nvidia-smi listing, no /dev/nvidia0): GPU tests skip, dma_bench measures the host only; this is not a GPU verdict"
fi
# Binaries linked against a newer glibc than this machine's fail with only "exit 1": say why.
needed=$(sed -n 's/^glibc-needed: //p' "$dir/MANIFEST" 2>/dev/null)
have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
if [ -n "$needed" ] && [ "$needed" != unknown ] && [ -n "$have" ] &&
    [ "$(printf '%s\n%s\n' "$needed" "$have" | sort -t. -k1,1n -k2,2n | head -n1)" != "$needed" ]; then
    record FAIL glibc 0 "these binaries need glibc $needed, this machine has $have; build them on an older distribution"
    write_summary FAIL
    exit 1
fi
[ $gpu_present = 1 ] && export NUMA_GPU_ALLOC_REQUIRE_GPU=1

# run_test BIN CAP [ENV...] [-- ARGS...]: one test binary, in the bundle folder, under
# `env ENV...`, given the test harness's ARGS.
run_test() {
    local bin=$1 cap=$2 name limit log t0 rc passed fails skipped ignored secs envs=() args=()
    shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
    [ $# -gt 0 ] && { shift; args=("$@"); }
    name=$(basename "$bin")
    log=$logs/$name.log
    limit=$(budget "$cap")
    if [ "$limit" -lt 5 ]; then
        record FAIL "$name" 0 "not run: the ${deadline_s}s deadline was reached"
        return
    fi
    t0=$(date +%s)
    bg_step "$log" timeout -k 5 "$limit" env "${envs[@]}" "$bin" --nocapture "${args[@]}"
    rc=$?
    secs=$(($(date +%s) - t0))
    binaries_run=$((binaries_run + 1))
    passed=$(sed -n 's/^test result: .* \([0-9][0-9]*\) passed.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
    fails=$(sed -n 's/^test result: .* \([0-9][0-9]*\) failed.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
    skipped=$(grep -cE 'SKIPPED|ignored at run time' "$log")
    ignored=$(sed -n 's/^test result: .* \([0-9][0-9]*\) ignored.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
    if [ $rc -eq 0 ] && [ "$passed" -eq 0 ]; then
        record FAIL "$name" "$secs" "ran no test (built without the tests it should hold?)" "$log"
    elif [ $rc -eq 0 ]; then
        record PASS "$name" "$secs" "$passed passed, $ignored ignored, $skipped skipped" "$log"
    else
        record FAIL "$name" "$secs" "$passed passed, $fails failed; $(failure_reason $rc "$log" "$limit")" "$log"
    fi
}

# --- GPU test binaries: the GPU visible, a missing driver is a failure (when a GPU is present)
gpu_tests=()
for bin in "$dir/tests/test-gpu" "$dir/tests/test-pinned_sim" "$dir/tests/test-host_numa_sim"; do
    [ -x "$bin" ] && gpu_tests+=("$bin")
done
echo "--- GPU tests (${#gpu_tests[@]} binaries)"
for bin in "${gpu_tests[@]}"; do
    case $(basename "$bin")-$gpu_present in
        # Against the real driver; without a GPU, against its simulator (which it compiles from
        # the source tree, so only where the bundle was built).
        # One test at a time: in place, the bodies share one process and its allocators.
        test-pinned_sim-1 | test-host_numa_sim-1) run_test "$bin" 120 NUMA_GPU_ALLOC_REAL_DRIVER=1 RUST_TEST_THREADS=1 ;;
        # The tests that need a GPU are ignored unless asked for.
        test-gpu-1) run_test "$bin" 120 -- --include-ignored ;;
        *) run_test "$bin" 120 ;;
    esac
done

# --- dma_bench: one run, text here and JSON beside the logs
echo "--- dma_bench"
if [ -x "$dir/dma_bench" ]; then
    log=$logs/dma_bench.txt
    limit=$(budget 240)
    t0=$(date +%s)
    if [ "$limit" -lt 5 ]; then
        record FAIL dma_bench 0 "not run: the ${deadline_s}s deadline was reached"
    else
        # Sections that would start late are skipped, so the run ends (and writes its JSON)
        # before `timeout` would stop it.
        max=$((limit > 120 ? limit - 60 : limit / 2))
        # Its output is shown as it comes (tail stops, after a last read, when dma_bench ends).
        : >"$log"
        tail -n +1 -f "$log" &
        tail_pid=$!
        # shellcheck disable=SC2086
        bg_step "$log" timeout -k 5 "$limit" ./dma_bench --max-seconds "$max" --json-out "$out/dma_bench.json" $dma_args
        rc=$?
        sleep 1
        kill "$tail_pid" 2>/dev/null
        wait "$tail_pid" 2>/dev/null
        secs=$(($(date +%s) - t0))
        problems=()
        [ "$rc" -eq 0 ] || problems+=("$(failure_reason "$rc" "$log" "$limit")")
        # A section or row that failed carries "failed: ..."; a section skipped for time, the
        # --max-seconds note.
        # (The driver's own start-up failure is judged below, by whether a GPU is present.)
        bad=$(grep -E "failed: |^skipped: --max-seconds" "$log" |
            grep -vE "^(no CUDA driver|measured host-side costs only)" | head -n 5)
        [ -z "$bad" ] || problems+=("$bad")
        if [ $gpu_present = 1 ] && grep -q "^no CUDA driver" "$log"; then
            problems+=("a GPU is present but dma_bench could not use CUDA: $(grep -m1 '^no CUDA driver' "$log")")
        fi
        [ "$rc" -ne 0 ] || [ -s "$out/dma_bench.json" ] || problems+=("dma_bench.json was not written")
        if [ ${#problems[@]} -eq 0 ]; then
            record PASS dma_bench "$secs" "JSON in $out/dma_bench.json" "$log"
        else
            record FAIL dma_bench "$secs" "$(printf '%s\n' "${problems[@]}")" "$log"
        fi
    fi
else
    record FAIL dma_bench 0 "dma_bench missing from $dir"
fi

# --- a pinned reservation in the background (64 GiB, or RESERVE_GIB): time to the first chunk,
# total, the longest registration, and small-copy latency during it vs idle
echo "--- kv_reserve"
log=$logs/kv_reserve.txt
limit=$(budget 150)
if [ ! -x "$dir/kv_reserve" ]; then
    record FAIL kv_reserve 0 "kv_reserve missing from $dir"
elif [ "$limit" -lt 30 ]; then
    record FAIL kv_reserve 0 "not run: only ${limit}s left before the deadline"
else
    t0=$(date +%s)
    bg_step "$log" timeout -k 5 "$limit" "$dir/kv_reserve" "${RESERVE_GIB:-64}"
    rc=$?
    secs=$(($(date +%s) - t0))
    if [ $rc -ne 0 ]; then
        record FAIL kv_reserve "$secs" "$(failure_reason $rc "$log" "$limit")" "$log"
    else
        record PASS kv_reserve "$secs" "$(grep -m1 'done\|stopped' "$log")" "$log"
    fi
    grep -E "done|stopped|small copy" "$log" | sed 's/^/        /'
fi

# --- the other test binaries: no GPU visible, so none of them starts the driver
echo "--- host tests (CUDA_VISIBLE_DEVICES empty)"
for bin in "$dir"/tests/*; do
    [ -x "$bin" ] || continue
    case " ${gpu_tests[*]} " in *" $bin "*) continue ;; esac
    case $(basename "$bin") in
        # The sysfs fixtures' tests read the source tree, which does not travel with the bundle.
        test-integration) run_test "$bin" 90 CUDA_VISIBLE_DEVICES= -- --skip topology:: --skip placement:: ;;
        *) run_test "$bin" 90 CUDA_VISIBLE_DEVICES= ;;
    esac
done
if [ $binaries_run -eq 0 ]; then
    record FAIL tests 0 "no test binary ran (none in $dir/tests, or the deadline came first)"
fi

# --- criterion benchmarks (optional, short): host<->device DMA, and the pinned pipeline
if [ $run_bench -eq 1 ]; then
    for bench in bench-dma bench-pinned; do
        echo "--- $bench"
        limit=$(budget 120)
        log=$logs/$bench.txt
        if [ ! -x "$dir/$bench" ]; then
            record FAIL "$bench" 0 "$bench missing from $dir"
            continue
        elif [ "$limit" -lt 20 ]; then
            record FAIL "$bench" 0 "not run: only ${limit}s left before the deadline"
            continue
        fi
        t0=$(date +%s)
        bg_step "$log" timeout -k 5 "$limit" "./$bench" --bench --warm-up-time 0.5 --measurement-time 1 --sample-size 10
        rc=$?
        secs=$(($(date +%s) - t0))
        if [ $rc -ne 0 ]; then
            record FAIL "$bench" "$secs" "$(failure_reason $rc "$log" "$limit")" "$log"
        elif [ $gpu_present = 1 ] && grep -q "skipped" "$log"; then
            record FAIL "$bench" "$secs" "a GPU is present but the bench skipped: $(grep -m1 skipped "$log")" "$log"
        else
            record PASS "$bench" "$secs" "$(grep -cE 'time:' "$log") measurements" "$log"
        fi
        grep -E "skipped|time:|thrpt:|^dma|^pinned|^[A-Za-z_]+/" "$log" | head -n 40 | sed 's/^/        /'
    done
fi

if [ $failed -ne 0 ]; then
    result=FAIL status=1
elif [ $gpu_present = 0 ]; then
    result=NO_GPU status=3
else
    result=PASS status=0
fi
write_summary "$result"
# One archive as well: a device tool that returns only a few files from $OUT still returns every log.
tar -czf "$out/logs.tar.gz" -C "$out" logs 2>/dev/null
case $result in
    PASS) echo "RESULT: PASS in $(elapsed)s: every step passed with a GPU present" ;;
    FAIL) echo "RESULT: FAIL in $(elapsed)s: see the FAIL lines above (logs in $logs)" ;;
    NO_GPU) echo "RESULT: NO GPU in $(elapsed)s: host-side steps passed, nothing was checked on a GPU (exit 3)" ;;
esac
exit $status
