#!/usr/bin/env bash
# Runs a subset of the test suite under valgrind (memcheck) and fails on any definite leak or
# memory error. The subset covers every allocator path: the library's unit tests, allocator-api2
# front end, #[global_allocator] under threads, NUMA_GPU_ALLOC parsing, placement syscalls,
# every injected fault, teardown with blocks outstanding, and the fuzz corpus replay.
# Tests that fork or re-execute themselves (fork, seccomp, exhaustion, bad environment values, child
# processes of teardown) or measure RSS (trim_rss) are left out: valgrind does not follow them
# (--trace-children=no) and changes the process's memory.
#
#   bash scripts/leak-check.sh        # about 1 minute on 2 cores (plus the build)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null; then
    echo "leak-check: valgrind is not installed (apt-get install valgrind)" >&2
    exit 1
fi

# Map each test target to its binary from cargo's "Executable" lines (the first match): the
# builds of CI's fault-injection step (the unit tests and the placement calls with every fault
# injected, serde's JSON) and of its test step (default features, the rest).
build_log=$(cargo test --no-run --features fault-injection,serde --lib --test faults \
    --test sys_placement --test pinned_sim 2>&1 && cargo test --no-run 2>&1) || {
    echo "$build_log" >&2
    exit 1
}
binary() {
    # "  Executable tests/faults.rs (target/debug/deps/faults-0123abcd)"
    echo "$build_log" | sed -n "s|^ *Executable $1 (\(.*\))\$|\1|p" | head -n 1
}

# target source | test-binary arguments (filters, skips)
runs=(
    "tests/integration/main.rs|allocator_api:: placement:: topology::"
    # The carver's and the pool's property tests are thousands of sequences of bookkeeping that
    # map nothing: minutes under valgrind for no leak they could show. Valgrind 3.19 marks the
    # pages an mremap adds to a mapping it moves (MREMAP_FIXED to a larger size) unaddressable
    # once other tests mapped and unmapped around it, though they are mapped (its report: "in a
    # rw- anonymous segment"): the doubling test passes under valgrind alone and natively checks
    # every page.
    "unittests src/lib.rs|--skip arena::carve::fuzz --skip pool::tests::random_allocations --skip alloc::tests::a_doubling_block"
    "tests/global_allocator.rs|"
    "tests/env_config.rs|"
    # valgrind's mmap answers EINVAL, not the kernel's ENOMEM, to a half-address-space request.
    "tests/sys_placement/main.rs|--skip map_anonymous_rejects_bad_sizes"
    "tests/faults.rs|"
    "tests/teardown.rs|--skip processes_exit_with_blocks_outstanding"
    "tests/fuzz_corpus.rs|"
)

# Valgrind runs one thread of a process at a time: one process per core. Each writes its own
# log, printed whole once every run ended; the longest runs come first in `runs`.
jobs=${LEAK_CHECK_JOBS:-$(nproc)}
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || {
    echo "leak-check: LEAK_CHECK_JOBS=$jobs: give a number of runs at a time, 1 or more" >&2
    exit 2
}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
check() { # target binary args...
    local target=$1 bin=$2 start=$SECONDS
    shift 2
    echo "leak-check: $target"
    if ! valgrind --quiet --leak-check=full --errors-for-leak-kinds=definite \
        --show-leak-kinds=definite --error-exitcode=1 --trace-children=no \
        --fair-sched=yes "$bin" --test-threads=2 "$@"; then
        echo "leak-check: FAILED $target"
        return 1
    fi
    echo "leak-check: $target took $((SECONDS - start)) s"
}

failed=0
for i in "${!runs[@]}"; do
    run=${runs[$i]}
    target=${run%%|*}
    args=${run#*|}
    bin=$(binary "$target")
    if [[ -z "$bin" ]]; then
        echo "leak-check: no test binary for $target" >&2
        failed=1
        continue
    fi
    while (($(jobs -pr | wc -l) >= jobs)); do
        wait -n || true
    done
    # shellcheck disable=SC2086 # args are test filters, split on purpose
    { if check "$target" "$bin" $args >"$logs/$i" 2>&1; then echo 0; else echo 1; fi >"$logs/$i.status"; } &
done
wait
for i in "${!runs[@]}"; do
    [[ -f "$logs/$i" ]] || continue
    cat "$logs/$i"
    [[ "$(cat "$logs/$i.status" 2>/dev/null)" == 0 ]] || failed=1
done

if [[ $failed -ne 0 ]]; then
    echo "leak-check: failures above" >&2
    exit 1
fi
echo "leak-check: no definite leak, no memory error"
