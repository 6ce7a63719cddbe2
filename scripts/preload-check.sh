#!/usr/bin/env bash
# The preload library as Python users get it: the wheel, built from a release build with the
# standard library only, pip-installed into a fresh virtual environment (with numpy, from PyPI);
# then, through `python -m numa_gpu_alloc run`, Python's buffers checked page by page on node 0
# and a sample of Python's own test suite for modules that allocate, with a 64 KiB threshold so
# that the library serves thousands of their allocations. Then real programs side by side
# (scripts/preload-compare.sh on 16 MiB files: outputs must match glibc's).
set -euo pipefail
cd "$(dirname "$0")/.."
# The peers of the side-by-side table: Debian's preload builds of jemalloc and mimalloc.
libs=$(ldconfig -p)
if ! grep -q 'libjemalloc.so.2 ' <<<"$libs" || ! grep -q 'libmimalloc.so.2 ' <<<"$libs"; then
    apt-get update -qq && apt-get install -y -qq libjemalloc2 libmimalloc2.0
fi
cargo build --release -p numa-gpu-alloc-preload
wheel=$(python3 preload/python/build_wheel.py target/release target/wheel)
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q "$wheel" numpy
run() { (cd "$venv" && "$venv/bin/python" -m numa_gpu_alloc run -- "$@"); }
placed=$(run "$venv/bin/python" "$PWD/preload/tests/python/placed.py" 0)
printf '%s\n' "$placed"
grep -q '^numpy.zeros .*policy prefer:0.*elsewhere: 0$' <<<"$placed" || { echo "numpy's arrays were not checked or not placed" >&2; exit 1; }
suite=$(NUMA_GPU_ALLOC=threshold=64K,stats=exit run "$venv/bin/python" -m test \
    test_bytes test_array test_memoryview test_zlib test_lzma test_bz2 test_list test_struct test_hashlib 2>&1)
printf '%s\n' "$suite" | grep -E '^(Total|Result)|^large allocations' | tail -4
grep -q '^Result: SUCCESS' <<<"$suite" || { printf '%s\n' "$suite" | tail -40; echo "Python's tests failed under the library" >&2; exit 1; }
scripts/preload-compare.sh 16
