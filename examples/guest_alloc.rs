//! `NumaGpuAlloc` as the `#[global_allocator]` of a whole program, checked from inside a QEMU
//! guest (see `scripts/numa-guests.sh`).
//!
//! `guest/init` runs it with `NUMA_GPU_ALLOC=gpu=pci:<device>` (the test device, no CUDA in the
//! guest: placement without pinning), saves its standard output and exit status, and
//! `guest_check --alloc-report FILE` folds its lines into the guest's table. It prints one line
//! per check, `PASS global.<name>` or `FAIL global.<name>: expected X, got Y`, then
//! `global: N passed, M failed`, and exits with status 1 if any check failed.
//!
//! ```text
//! NUMA_GPU_ALLOC=gpu=pci:DDDD:BB:DD.F guest_alloc --device DDDD:BB:DD.F
//!     --expect-home NODE --expect-host NODE
//! guest_alloc --mode limit --memory-max BYTES
//! ```
//!
//! What it checks: large `Vec`s, a boxed slice and a `Vec` reallocated across the threshold
//! (both ways) land page by page on the host node; small allocations never reach the large path;
//! per-node live bytes equal the capacities (size classes) of the live blocks; freed blocks come
//! back as cache hits, still on the node, and zeroed when asked for zeroed memory; `trim()` empties
//! the cache; a block populated by several threads (spawned from inside the allocator) is placed.
//!
//! `--mode limit` (lines `limit.<name>`) runs inside a cgroup whose `memory.max` is `BYTES`: an
//! idle cached block is given back when a block of another size class fits only then, with the
//! global allocator and with `policy=bind`; blocks beyond the limit fail cleanly (counted), and
//! the kernel's OOM killer never runs (`memory.events`).

use std::process::ExitCode;
use std::ptr::NonNull;

use allocator_api2::vec::Vec as AVec;
use numa_gpu_alloc::sys::{self, PageCensus};
use numa_gpu_alloc::{Error, MemPolicy, NumaGpuAlloc, Stats, ENV_VAR};

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();

const MIB: usize = 1 << 20;
/// The default threshold: requests of at least this size take the large path.
const THRESHOLD: usize = 2 * MIB;
/// Elements of the boxed slice: 13.2 MB, not a size class (rounded up to 13 MiB).
const BOX_LEN: usize = 3_300_000;
/// At least 64 MiB: populated by several threads.
const BIG: usize = 96 * MIB;

/// Prints the check lines as they happen, so that a crash still leaves the earlier ones.
struct Report {
    /// `global` or `limit`: the first part of each check's name.
    prefix: &'static str,
    passed: usize,
    failed: usize,
}

impl Report {
    fn check(&mut self, name: &str, ok: bool, expected: impl FnOnce() -> String, got: String) {
        let prefix = self.prefix;
        if ok {
            self.passed += 1;
            println!("PASS {prefix}.{name}");
        } else {
            self.failed += 1;
            println!("FAIL {prefix}.{name}: expected {}, got {got}", expected());
        }
    }

    fn eq<T: PartialEq + std::fmt::Debug>(&mut self, name: &str, expected: T, got: T) {
        let ok = expected == got;
        self.check(name, ok, || format!("{expected:?}"), format!("{got:?}"));
    }

    /// All pages of `ptr..ptr+len` are present on `node`.
    fn on_node(&mut self, name: &str, ptr: *const u8, len: usize, node: usize) {
        let pages = len.div_ceil(sys::page_size());
        let expected = || format!("{pages} pages on node {node}");
        match census(ptr, len, node) {
            Ok(c) => {
                let ok = c.pages == pages && c.on_node == pages;
                self.check(name, ok, expected, describe(&c));
            }
            Err(e) => self.check(name, false, expected, e),
        }
    }
}

/// Where the pages of a live allocation of this process are.
fn census(ptr: *const u8, len: usize, node: usize) -> Result<PageCensus, String> {
    let ptr = NonNull::new(ptr.cast_mut()).ok_or("a null pointer")?;
    // SAFETY: `ptr..ptr+len` lies in a live large block of this process (page-aligned, mapped);
    // move_pages without target nodes only reads the page tables.
    unsafe { sys::census(ptr, len, node) }.map_err(|e| format!("census: {e}"))
}

fn describe(c: &PageCensus) -> String {
    format!(
        "{} of {} pages there, {} elsewhere, {} absent",
        c.on_node, c.pages, c.elsewhere, c.absent
    )
}

/// The crate's capacity for a request of `size` bytes: 8 size classes per power of two, whole
/// pages (as `class_size` in src/arena/mod.rs).
fn class_size(size: usize) -> usize {
    let size = size.max(1);
    let octave = usize::BITS - 1 - size.leading_zeros();
    let step = (1usize << octave.saturating_sub(3)).max(sys::page_size());
    size.next_multiple_of(step)
}

/// Live bytes, live blocks and cached bytes of `node`, as the stats report them.
fn node_row(stats: &Stats, node: usize) -> (usize, usize, usize) {
    stats
        .nodes
        .iter()
        .find(|n| n.node == node)
        .map_or((0, 0, 0), |n| (n.live_bytes, n.live_blocks, n.cached_bytes))
}

/// Live bytes of every node but `node` (all zero when the blocks stay apart).
fn others_live(stats: &Stats, node: usize) -> Vec<(usize, usize)> {
    stats
        .nodes
        .iter()
        .filter(|n| n.node != node && n.live_bytes != 0)
        .map(|n| (n.node, n.live_bytes))
        .collect()
}

/// Event counters, as deltas are compared: (large allocations, cache hits, cache misses, frees).
fn counters(stats: &Stats) -> [u64; 4] {
    [
        stats.large_allocations,
        stats.cache_hits,
        stats.cache_misses,
        stats.frees,
    ]
}

fn delta(before: [u64; 4], after: [u64; 4]) -> [u64; 4] {
    std::array::from_fn(|i| after[i].wrapping_sub(before[i]))
}

/// A byte pattern that tells offsets apart (period 251, prime).
fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

fn is_pattern(data: &[u8]) -> bool {
    data.iter().enumerate().all(|(i, &b)| b == pattern(i))
}

struct Args {
    device: String,
    expect_home: Option<usize>,
    expect_host: Option<usize>,
    /// `--mode limit`: the checks under a memory limit instead.
    limit: bool,
    memory_max: Option<usize>,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        device: String::new(),
        expect_home: None,
        expect_host: None,
        limit: false,
        memory_max: None,
    };
    let node = |v: String| match v.as_str() {
        "none" | "" => Ok(None),
        _ => v.parse().map(Some).map_err(|_| format!("node id {v:?}")),
    };
    const FLAGS: &[&str] = &[
        "--device",
        "--expect-home",
        "--expect-host",
        "--mode",
        "--memory-max",
    ];
    while let Some(flag) = it.next() {
        if !FLAGS.contains(&flag.as_str()) {
            return Err(format!("unknown argument {flag:?}"));
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--device" => args.device = value,
            "--expect-home" => args.expect_home = node(value)?,
            "--expect-host" => args.expect_host = node(value)?,
            "--mode" if value == "limit" => args.limit = true,
            "--memory-max" => {
                let bytes = value.parse().map_err(|_| format!("byte count {value:?}"))?;
                args.memory_max = Some(bytes);
            }
            _ => return Err(format!("{flag} {value:?}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let parsed = parse_args(std::env::args().skip(1));
    let prefix = match &parsed {
        Ok(a) if a.limit => "limit",
        _ => "global",
    };
    let mut r = Report {
        prefix,
        passed: 0,
        failed: 0,
    };
    match parsed {
        Ok(args) if args.limit => run_limit(&mut r, args.memory_max),
        Ok(args) => run(&mut r, &args),
        Err(e) => r.check(
            "args",
            false,
            || "the arguments in the module docs".into(),
            e,
        ),
    }
    println!("{prefix}: {} passed, {} failed", r.passed, r.failed);
    if r.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run(r: &mut Report, args: &Args) {
    // --- Configuration: the environment names the device; no CUDA, so no pinning. -----------
    let env = std::env::var(ENV_VAR).unwrap_or_default();
    r.eq("env", format!("gpu=pci:{}", args.device), env);
    let placement = ALLOC.placement();
    r.eq(
        "placement.gpu_pci",
        Some(args.device.clone()),
        placement.gpu_pci.map(|a| a.to_string()),
    );
    if let Some(home) = args.expect_home {
        r.eq("placement.home_node", Some(home), placement.home_node);
    }
    if let Some(host) = args.expect_host {
        r.eq("placement.host_node", host, placement.host_node);
    }
    r.eq("placement.numa", true, placement.numa_placement);
    r.eq("placement.unpinned", false, placement.pinning);
    let stats = ALLOC.stats();
    // Without libcuda the only setup problem is that CUDA is unavailable (pinning skipped).
    let unexpected: Vec<String> = stats
        .config_errors
        .iter()
        .filter(|e| !matches!(e, Error::CudaUnavailable { .. }))
        .map(|e| e.to_string())
        .collect();
    r.eq("config_errors", Vec::<String>::new(), unexpected);
    let node = args.expect_host.unwrap_or(placement.host_node);

    // --- Fresh blocks: two Vecs and a boxed slice. -------------------------------------------
    let before = counters(&ALLOC.stats());
    let v8 = vec![1u8; 8 * MIB];
    let v48 = vec![3u64; 6 * MIB];
    let boxed: Box<[u32]> = (0..BOX_LEN as u32).collect::<Vec<u32>>().into_boxed_slice();
    r.on_node("vec8MiB.pages", v8.as_ptr(), v8.len(), node);
    r.on_node("vec48MiB.pages", v48.as_ptr().cast(), v48.len() * 8, node);
    r.on_node(
        "box13MB.pages",
        boxed.as_ptr().cast(),
        boxed.len() * 4,
        node,
    );
    let data_ok = v8.iter().all(|&b| b == 1)
        && v48.iter().all(|&x| x == 3)
        && boxed.iter().enumerate().all(|(i, &x)| x as usize == i);
    r.eq("fresh.data", true, data_ok);
    let stats = ALLOC.stats();
    // [large allocations, hits, misses, frees]
    r.eq(
        "fresh.counters",
        [3, 0, 3, 0],
        delta(before, counters(&stats)),
    );
    let requested = [8 * MIB, 48 * MIB, BOX_LEN * 4];
    let expected_live: usize = requested.iter().map(|&s| class_size(s)).sum();
    let (live, blocks, _) = node_row(&stats, node);
    r.eq(
        &format!("fresh.live.node{node}"),
        (expected_live, 3),
        (live, blocks),
    );
    r.eq("fresh.live.other_nodes", vec![], others_live(&stats, node));
    // Independent of the class formula: at least what was asked, at most 1/8 and a page more.
    let asked: usize = requested.iter().sum();
    let most: usize = requested
        .iter()
        .map(|&s| s + s / 8 + sys::page_size())
        .sum();
    r.check(
        "fresh.live.bounds",
        (asked..=most).contains(&stats.live_bytes()),
        || format!("{asked}..={most}"),
        stats.live_bytes().to_string(),
    );

    // --- Small allocations never take the large path; the threshold is exact. ---------------
    let before_stats = ALLOC.stats();
    let strings: Vec<String> = (0..10_000).map(|i| format!("{i:01024}")).collect();
    let mediums: Vec<Vec<u8>> = (1..=32).map(|i| vec![i as u8; i * 32 * 1024]).collect();
    let just_below = vec![9u8; THRESHOLD - 1];
    let stats = ALLOC.stats();
    let small_ok = strings.iter().all(|s| s.len() == 1024)
        && mediums
            .iter()
            .all(|m| m.iter().all(|&b| b as usize == m.len() / 32768));
    r.eq("small.data", true, small_ok);
    r.eq(
        "small.untouched",
        (before_stats.large_allocations, before_stats.live_bytes()),
        (stats.large_allocations, stats.live_bytes()),
    );
    let at_threshold = vec![0u8; THRESHOLD];
    let stats = ALLOC.stats();
    r.eq(
        "small.at_threshold_is_large",
        (before_stats.large_allocations + 1, class_size(THRESHOLD)),
        (
            stats.large_allocations,
            stats.live_bytes().saturating_sub(before_stats.live_bytes()),
        ),
    );
    r.on_node(
        "small.at_threshold.pages",
        at_threshold.as_ptr(),
        THRESHOLD,
        node,
    );
    drop((strings, mediums, just_below, at_threshold));

    // --- Reallocation: grow across the threshold, grow, shrink in place, shrink back. -------
    let base = ALLOC.stats();
    let mut grown: Vec<u8> = (0..MIB).map(pattern).collect();
    grown.reserve_exact(12 * MIB - grown.len());
    let stats = ALLOC.stats();
    r.eq(
        "realloc.grow_across.counters",
        [1, 0, 1, 0],
        delta(counters(&base), counters(&stats)),
    );
    r.eq(
        "realloc.grow_across.live",
        base.live_bytes() + class_size(12 * MIB),
        stats.live_bytes(),
    );
    r.on_node("realloc.grow_across.pages", grown.as_ptr(), 12 * MIB, node);
    r.eq("realloc.grow_across.data", true, is_pattern(&grown));
    grown.extend((grown.len()..12 * MIB).map(pattern));
    grown.reserve_exact(24 * MIB - grown.len());
    r.on_node("realloc.grow.pages", grown.as_ptr(), 24 * MIB, node);
    r.eq("realloc.grow.data", true, is_pattern(&grown));
    grown.extend((grown.len()..16 * MIB).map(pattern));
    let (at, in_place) = (grown.as_ptr(), ALLOC.stats().in_place_reallocs);
    grown.shrink_to_fit(); // 16 of 24 MiB: kept in place
    r.eq(
        "realloc.shrink_in_place",
        (at, in_place + 1),
        (grown.as_ptr(), ALLOC.stats().in_place_reallocs),
    );
    r.eq("realloc.shrink_in_place.data", true, is_pattern(&grown));
    grown.truncate(256 * 1024);
    grown.shrink_to_fit(); // back below the threshold: moved to the system allocator
    let stats = ALLOC.stats();
    r.eq("realloc.shrink_across.data", true, is_pattern(&grown));
    r.eq(
        "realloc.shrink_across.live",
        (base.live_bytes(), 3),
        (stats.live_bytes(), node_row(&stats, node).1),
    );
    drop(grown);

    // --- Free, then the same sizes again: cache hits, still on the node. --------------------
    let base = ALLOC.stats();
    drop((v8, v48, boxed));
    let stats = ALLOC.stats();
    let (live, blocks, cached) = node_row(&stats, node);
    r.eq("free.live", (0, 0), (live, blocks));
    r.eq(
        "free.cached",
        node_row(&base, node).2 + expected_live,
        cached,
    );
    r.eq(
        "free.counters",
        [0, 0, 0, 3],
        delta(counters(&base), counters(&stats)),
    );
    let v8 = vec![0u8; 8 * MIB]; // zeroed: the reused block held ones
    let v48 = vec![5u64; 6 * MIB];
    let boxed: Box<[u32]> = (0..BOX_LEN as u32)
        .rev()
        .collect::<Vec<u32>>()
        .into_boxed_slice();
    let after = ALLOC.stats();
    r.eq(
        "reuse.counters",
        [3, 3, 0, 0],
        delta(counters(&stats), counters(&after)),
    );
    r.eq(
        &format!("reuse.live.node{node}"),
        (expected_live, 3, node_row(&base, node).2),
        node_row(&after, node),
    );
    r.on_node("reuse.vec8MiB.pages", v8.as_ptr(), v8.len(), node);
    r.on_node(
        "reuse.vec48MiB.pages",
        v48.as_ptr().cast(),
        v48.len() * 8,
        node,
    );
    r.on_node(
        "reuse.box13MB.pages",
        boxed.as_ptr().cast(),
        boxed.len() * 4,
        node,
    );
    r.eq("reuse.zeroed", true, v8.iter().all(|&b| b == 0));
    let data_ok = v48.iter().all(|&x| x == 5)
        && boxed
            .iter()
            .enumerate()
            .all(|(i, &x)| x as usize == BOX_LEN - 1 - i);
    r.eq("reuse.data", true, data_ok);

    // --- Trim releases the cache; a block big enough to be populated by several threads
    // (spawned from inside the global allocator) still lands on the node. ------------------
    drop((v8, v48, boxed));
    ALLOC.trim();
    let stats = ALLOC.stats();
    r.eq(
        "trim",
        (0, 0, 0),
        (
            stats.live_bytes(),
            stats.cached_bytes(),
            node_row(&stats, node).1,
        ),
    );
    let big = vec![7u8; BIG];
    r.on_node("parallel96MiB.pages", big.as_ptr(), big.len(), node);
    r.eq("parallel96MiB.data", true, big.iter().all(|&b| b == 7));
    drop(big);
    let after = ALLOC.stats();
    let f = &after.fallbacks;
    r.eq(
        "fallbacks",
        (0, 0, 0, 0),
        (
            f.failed_allocations,
            f.unplaced_blocks,
            f.populate_failures,
            f.foreign_frees,
        ),
    );
}

/// Sizes of the memory-limit checks: each fits under the limit alone, the first two together do
/// not, and the last never does.
const LIMIT_FIRST: usize = 96 * MIB;
const LIMIT_SECOND: usize = 120 * MIB;
const LIMIT_TOO_BIG: usize = 256 * MIB;

/// A `Vec` of `len` bytes equal to `byte`, or `None` when the allocator says no (a `vec!` would
/// abort instead).
fn filled(len: usize, byte: u8) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).ok()?;
    v.resize(len, byte);
    Some(v)
}

/// This process's cgroup directory (cgroup v2, mounted at /sys/fs/cgroup by `guest/init`).
fn own_cgroup() -> String {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or("/");
    format!("/sys/fs/cgroup{}", path.trim())
}

/// A `key value` line of a cgroup file such as `memory.events`.
fn cgroup_value(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("{}/{file}", own_cgroup())).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// (retries, blocks given back, failed allocations, refused for the memory limit, bind exhausted)
fn pressure(s: &Stats) -> (u64, u64, u64, u64, u64) {
    let f = &s.fallbacks;
    (
        s.pressure_retries,
        s.pressure_released_blocks,
        f.failed_allocations,
        f.memory_limited,
        f.bind_exhausted,
    )
}

fn run_limit(r: &mut Report, memory_max: Option<usize>) {
    let path = format!("{}/memory.max", own_cgroup());
    let max = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| t.trim().parse().ok());
    r.eq("cgroup.memory_max", memory_max, max);
    let node = ALLOC.placement().host_node;

    // --- The global allocator: a freed 96 MiB block stays cached; 120 MiB fit only once it is
    // given back. ---------------------------------------------------------------------------
    drop(filled(LIMIT_FIRST, 1));
    r.eq("global.cached", LIMIT_FIRST, ALLOC.stats().cached_bytes());
    match filled(LIMIT_SECOND, 2) {
        Some(second) => {
            r.on_node(
                "global.given_back.pages",
                second.as_ptr(),
                second.len(),
                node,
            );
            r.eq(
                "global.given_back.data",
                true,
                second.iter().all(|&b| b == 2),
            );
        }
        None => r.check(
            "global.given_back",
            false,
            || format!("{LIMIT_SECOND} bytes after giving back the cache"),
            "AllocError".into(),
        ),
    }
    let s = ALLOC.stats();
    r.eq("global.given_back.counters", (1, 1, 0, 0, 0), pressure(&s));
    ALLOC.trim();

    // --- policy=bind, same steps; then a block beyond the limit fails cleanly, after its
    // allocator gave back what it had cached. -------------------------------------------------
    let bind = NumaGpuAlloc::new().node(node).policy(MemPolicy::Bind);
    let mut first: AVec<u8, _> = AVec::new_in(&bind);
    let first_ok = first.try_reserve_exact(LIMIT_FIRST).is_ok();
    drop(first);
    let mut second: AVec<u8, _> = AVec::new_in(&bind);
    let second_ok = second.try_reserve_exact(LIMIT_SECOND).is_ok();
    if second_ok {
        second.resize(LIMIT_SECOND, 3);
    }
    r.eq("bind.given_back", (true, true), (first_ok, second_ok));
    r.on_node("bind.given_back.pages", second.as_ptr(), second.len(), node);
    drop(second);
    let mut too_big: AVec<u8, _> = AVec::new_in(&bind);
    r.eq(
        "bind.too_big.fails",
        true,
        too_big.try_reserve_exact(LIMIT_TOO_BIG).is_err(),
    );
    // Retries: one for the second block, one for the too-big one after giving back the second.
    r.eq("bind.counters", (2, 2, 1, 1, 0), pressure(&bind.stats()));
    eprintln!("{}", bind.stats());

    // --- The default policy beyond the limit: the same clean failure. ------------------------
    let preferred = NumaGpuAlloc::new().node(node);
    let mut too_big: AVec<u8, _> = AVec::new_in(&preferred);
    r.eq(
        "preferred.too_big.fails",
        true,
        too_big.try_reserve_exact(LIMIT_TOO_BIG).is_err(),
    );
    r.eq(
        "preferred.counters",
        (0, 0, 1, 1, 0),
        pressure(&preferred.stats()),
    );

    // --- The kernel never had to kill anything. --------------------------------------------
    r.eq(
        "no_oom_kill",
        (Some(0), Some(0)),
        (
            cgroup_value("memory.events", "oom"),
            cgroup_value("memory.events", "oom_kill"),
        ),
    );
}
