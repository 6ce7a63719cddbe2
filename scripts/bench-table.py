#!/usr/bin/env python3
"""Markdown table of ratios from `cargo bench --bench alloc`.

Reads criterion's estimates (target/criterion/<group>/<function>/new/estimates.json, matched by
the group and function ids in the neighbouring benchmark.json), the computed rounding figure
the bench writes to target/criterion/rounding_waste/computed.json, and the rows measured outside
criterion (target/criterion/<group>/rows.json: the cache-index misses of `benches/alloc.rs`, the
peak RSS of `benches/rss.rs`), and prints:

    workload | ours | peer | ratio (ours/peer) | target | met?

Times are criterion's median per iteration (robust on a shared VM); the ratio is ours / peer, so
below 1 means ours is faster. Usage:

    python3 scripts/bench-table.py [--criterion-dir DIR] [--machine]

`--machine` also prints the machine description (CPU model, cores, memory, NUMA nodes, kernel,
date) above the table. Exits 1 if a row's results are missing, 0 otherwise (missed targets are
reported in the table, not by the exit status).
"""

import argparse
import datetime
import glob
import json
import os
import platform
import sys

# (workload, group, ours function, peer label, peer function, target ratio or None).
# A target T means "ours/peer <= T"; "≥ 50× faster" is written as 1/50.
ROWS = [
    ("64 B alloc/free, 1 thread", "small_64B_1thread", "ours", "glibc (System)", "system_glibc", 1.05),
    ("64 B alloc/free, 1 thread", "small_64B_1thread", "ours", "mimalloc", "mimalloc", None),
    ("64 B alloc/free, 1 thread, ours over mimalloc", "small_64B_1thread", "ours_over_mimalloc", "mimalloc", "mimalloc",
     1.05),
    ("64 B alloc/free, 2 threads", "small_64B_2threads", "ours", "glibc (System)", "system_glibc", 1.05),
    ("64 B alloc/free, 2 threads", "small_64B_2threads", "ours", "mimalloc", "mimalloc", None),
    ("64 B alloc/free, 2 threads, ours over mimalloc", "small_64B_2threads", "ours_over_mimalloc", "mimalloc", "mimalloc",
     1.05),
    ("4 KiB alloc/free, 1 thread", "small_4KiB_1thread", "ours", "glibc (System)", "system_glibc", 1.05),
    ("4 KiB alloc/free, 1 thread", "small_4KiB_1thread", "ours", "mimalloc", "mimalloc", None),
    ("4 KiB alloc/free, 1 thread, ours over mimalloc", "small_4KiB_1thread", "ours_over_mimalloc", "mimalloc", "mimalloc",
     1.05),
    ("4 KiB alloc/free, 2 threads", "small_4KiB_2threads", "ours", "glibc (System)", "system_glibc", 1.05),
    ("4 KiB alloc/free, 2 threads", "small_4KiB_2threads", "ours", "mimalloc", "mimalloc", None),
    ("4 KiB alloc/free, 2 threads, ours over mimalloc", "small_4KiB_2threads", "ours_over_mimalloc", "mimalloc", "mimalloc",
     1.05),
    ("64 MiB alloc + write every page + free (ours: cache warm)", "large_reuse_64MiB", "ours",
     "glibc malloc/free", "glibc_malloc", 1 / 150),
    ("64 MiB alloc + write every page + free (ours: cache warm)", "large_reuse_64MiB", "ours",
     "libnuma numa_alloc_onnode/numa_free", "libnuma_onnode", 1 / 50),
    ("64 MiB alloc + write every page + free (ours: cache warm)", "large_reuse_64MiB", "ours",
     "mmap/munmap", "mmap_munmap", 1 / 50),
    ("1 GiB cold placement, ours 1 populate thread", "cold_placement_1GiB", "ours_1thread",
     "libnuma + 1-thread touch", "libnuma_1thread_touch", 1.0),
    ("1 GiB cold placement, ours parallel populate", "cold_placement_1GiB", "ours_parallel",
     "ours, 1 populate thread", "ours_1thread", 1 / 1.6),
    ("1 GiB cold placement, ours parallel populate", "cold_placement_1GiB", "ours_parallel",
     "libnuma + 1-thread touch", "libnuma_1thread_touch", 1 / 1.6),
    ("Vec<u8> grown to 256 MiB (64 KiB chunks)", "growth_vec_256MiB", "ours", "System (glibc)", "system", 1.0),
    ("4 MiB alloc/free (cache hits) per thread, 4 threads on 4 nodes' arenas vs 1 thread",
     "arena_contention_4MiB_4threads", "four_nodes", "1 thread", "one_thread", 1.3),
    ("4 MiB alloc/free (cache hits) per thread, 4 threads on one node's arena vs 1 thread",
     "arena_contention_4MiB_4threads", "one_node", "1 thread", "one_thread", None),
]

ROUNDING_TARGET = 1.125

# Groups that write rows.json (measured outside criterion's timing loop), in table order.
ROW_GROUPS = ["carver_free_ranges", "rss_client"]


def default_criterion_dir():
    if os.environ.get("CRITERION_HOME"):
        return os.environ["CRITERION_HOME"]
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "target")
    return os.path.join(target, "criterion")


def load_estimates(criterion_dir):
    """{(group_id, function_id): median ns} for every benchmark with a `new` result."""
    found = {}
    pattern = os.path.join(criterion_dir, "**", "new", "benchmark.json")
    for path in glob.glob(pattern, recursive=True):
        with open(path) as f:
            bench = json.load(f)
        estimates_path = os.path.join(os.path.dirname(path), "estimates.json")
        if not os.path.exists(estimates_path):
            continue
        with open(estimates_path) as f:
            estimates = json.load(f)
        found[(bench["group_id"], bench.get("function_id"))] = estimates["median"]["point_estimate"]
    return found


def fmt_time(ns):
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}" if ns / scale < 100 else f"{ns / scale:.0f} {unit}"
    return f"{ns:.3g} ns"


def fmt_target(target):
    if target is None:
        return "—"
    if target < 1:
        return f"≤ {target:.3g} (≥ {1 / target:.3g}× faster)"
    return f"≤ {target:g}×"


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine():
    cpuinfo = read("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    mem_kib = next((int(line.split()[1]) for line in read("/proc/meminfo").splitlines()
                    if line.startswith("MemTotal:")), 0)
    nodes = read("/sys/devices/system/node/online").strip() or "unknown"
    thp = read("/sys/kernel/mm/transparent_hugepage/enabled").strip() or "unknown"
    lines = [
        f"- CPU: {model}, {os.cpu_count()} logical cores",
        f"- Memory: {mem_kib / (1 << 20):.1f} GiB; NUMA nodes online: {nodes}",
        f"- Kernel: {platform.system()} {platform.release()} ({platform.machine()}); THP: {thp}",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
    ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--criterion-dir", default=default_criterion_dir())
    parser.add_argument("--machine", action="store_true", help="print the machine description too")
    args = parser.parse_args()

    estimates = load_estimates(args.criterion_dir)
    missing = []
    out = []
    if args.machine:
        out += [machine(), ""]
    out += ["| workload | ours | peer | ratio (ours/peer) | target | met? |",
            "|---|---|---|---|---|---|"]
    for workload, group, ours_fn, peer_label, peer_fn, target in ROWS:
        ours = estimates.get((group, ours_fn))
        peer = estimates.get((group, peer_fn))
        if ours is None or peer is None:
            missing += [f"{group}/{f}" for f, v in ((ours_fn, ours), (peer_fn, peer)) if v is None]
            out.append(f"| {workload} | {fmt_time(ours) if ours else 'not run'} | {peer_label}: "
                       f"{fmt_time(peer) if peer else 'not run'} | — | {fmt_target(target)} | — |")
            continue
        ratio = ours / peer
        met = "—" if target is None else ("yes" if ratio <= target else "**no**")
        speed = f" ({peer / ours:.0f}× faster)" if ratio < 0.1 else ""
        out.append(f"| {workload} | {fmt_time(ours)} | {peer_label}: {fmt_time(peer)} | "
                   f"{ratio:.3f}{speed} | {fmt_target(target)} | {met} |")

    computed = os.path.join(args.criterion_dir, "rounding_waste", "computed.json")
    if os.path.exists(computed):
        with open(computed) as f:
            r = json.load(f)
        met = "yes" if r["ours"] <= ROUNDING_TARGET else "**no**"
        out.append(
            f"| Rounding waste: reserved/requested bytes, {r['sizes']} sizes log-uniform in "
            f"{r['low'] >> 20} MiB–{r['high'] >> 20} MiB (seed {r['seed']}; worst single request: "
            f"ours {r['ours_worst']:.3f}, pow2 {r['pow2_worst']:.3f}) | {r['ours']:.4f} | "
            f"power-of-two rounding (PyTorch): {r['pow2']:.4f} | {r['ours'] / r['pow2']:.3f} | "
            f"ours ≤ {ROUNDING_TARGET} | {met} |")
    else:
        missing.append("rounding_waste/computed.json")
        out.append(f"| Rounding waste | not run | power-of-two rounding | — | ours ≤ {ROUNDING_TARGET} | — |")

    for group in ROW_GROUPS:
        path = os.path.join(args.criterion_dir, group, "rows.json")
        if not os.path.exists(path):
            missing.append(f"{group}/rows.json")
            out.append(f"| {group} | not run | — | — | — | — |")
            continue
        with open(path) as f:
            rows = json.load(f)
        for r in rows:
            ratio = r["ours"] / r["peer"]
            target = r["target"]
            met = "—" if target is None else ("yes" if ratio <= target else "**no**")
            unit = r["unit"]
            out.append(f"| {r['workload']} | {r['ours']:.1f} {unit} | {r['peer_label']}: "
                       f"{r['peer']:.1f} {unit} | {ratio:.3f} | {fmt_target(target)} | {met} |")

    print("\n".join(out))
    if missing:
        print(f"\nmissing results: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
