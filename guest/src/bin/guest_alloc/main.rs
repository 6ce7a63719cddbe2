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
//! (both ways) land page by page on the host node where they are written (unpinned blocks are
//! faulted in where touched, on the node of their policy); a `Vec` grown across the threshold
//! gets a mapping of its own and grows again by moving its pages; small allocations never reach
//! the large path;
//! blocks are carved from the node's chunks (the first 32 MiB, the next twice as large), whose
//! free space is the node's cached bytes; per-node live bytes equal the capacities of the live
//! blocks (carved: the request in whole pages); requests that fit the chunks there are are cache
//! hits, freed space is carved again, still on the node, and zeroed when asked for zeroed memory;
//! `trim()` releases wholly free chunks and keeps a chunk with a live block (its free space
//! purged); an empty heap starts over at 32 MiB; a carved block grows in place into the free
//! space after it; idle free space decays (the decay thread purges it while nothing large is
//! allocated; the next large request is carved from a chunk there is and releases the other,
//! wholly free as long); a big block written by one thread is placed, and one populated when
//! handed out (`populate_eager`) by several threads (the node's workers, spawned from inside the
//! allocator, bound to its CPUs) is placed too.
//!
//! `--mode limit` (lines `limit.<name>`) runs inside a cgroup whose `memory.max` is `BYTES`: idle
//! memory (a wholly free chunk, a cached block) is given back when a block fits only then, with
//! the global allocator and with `policy=bind`; blocks beyond the limit fail cleanly and at once
//! when what is idle could not make room (counted), and the kernel's OOM killer never runs
//! (`memory.events`).

use std::process::ExitCode;

use allocator_api2::vec::Vec as AVec;
use numa_gpu_alloc::unstable::sys;
use numa_gpu_alloc::{Error, MemPolicy, NodeStats, NumaGpuAlloc, Stats, ENV_VAR};

#[path = "../../report.rs"]
mod report;

mod limit;
mod readings;
use limit::run_limit;
use readings::*;
use report::Report;

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();

const MIB: usize = 1 << 20;
/// The default threshold: requests of at least this size take the large path.
const THRESHOLD: usize = 2 * MIB;
/// Elements of the boxed slice: 13.2 MB, not a whole number of pages (13,201,408 bytes carved).
const BOX_LEN: usize = 3_300_000;
/// At least 64 MiB: populated by several threads.
const BIG: usize = 96 * MIB;
/// A node's first chunk (as `CHUNK_FIRST` in src/arena/mod.rs); each next one is twice as large.
const CHUNK_FIRST: usize = 32 * MIB;
/// Blocks of 2 MiB and more are carved from huge-page chunks, purged in whole huge pages.
const HUGE_PAGE: usize = 2 * MIB;
/// How long the decay checks wait at most for the decay thread (it purges free space idle for
/// the default decay time, 1 s, and looks every quarter of it). Generous: a TCG guest booted
/// beside another on a loaded 2-core host once took longer than 6 s.
const DECAY_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// The crate's capacity for a carved request of `size` bytes (below the dedicated minimum, 64
/// MiB): the request in whole pages.
fn carved_size(size: usize) -> usize {
    size.max(1).next_multiple_of(sys::page_size())
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
    let mut r = Report::new(prefix);
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
    r.finish()
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

    // --- Fresh blocks: two Vecs and a boxed slice, carved from the node's first chunks. -----
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
    let stats = quiet_stats();
    // [large allocations, hits, misses, frees]: 8 MiB makes the first chunk (32 MiB, a miss);
    // 48 MiB does not fit the 24 MiB left and makes the second (64 MiB, a miss); 13.2 MB fits
    // what is left of either (a hit, though nothing was freed).
    r.eq(
        "fresh.counters",
        [3, 1, 2, 0],
        delta(before, counters(&stats)),
    );
    let requested = [8 * MIB, 48 * MIB, BOX_LEN * 4];
    let expected_live: usize = requested.iter().map(|&s| carved_size(s)).sum();
    let (live, blocks, _) = node_row(&stats, node);
    r.eq(
        &format!("fresh.live.node{node}"),
        (expected_live, 3),
        (live, blocks),
    );
    r.eq("fresh.live.other_nodes", vec![], others_live(&stats, node));
    // Independent of the rounding rule: at least what was asked, at most a page more per block.
    let asked: usize = requested.iter().sum();
    let most = asked + requested.len() * sys::page_size();
    r.check(
        "fresh.live.bounds",
        (asked..=most).contains(&stats.live_bytes()),
        || format!("{asked}..={most}"),
        stats.live_bytes().to_string(),
    );
    // Two chunks of one kind (default policy, unpinned, huge pages for blocks of 2 MiB and more);
    // what the blocks do not use is cached.
    let chunk_bytes = CHUNK_FIRST + 2 * CHUNK_FIRST;
    r.eq(
        &format!("fresh.chunks.node{node}"),
        (2, chunk_bytes, chunk_bytes - expected_live),
        (
            node_stats(&stats, node).chunks,
            node_stats(&stats, node).mapped_bytes,
            node_stats(&stats, node).cached_bytes,
        ),
    );
    let heaps: Vec<_> = stats
        .heaps
        .iter()
        .map(|h| (h.node, h.policy, h.pinned, h.huge_pages, h.chunks))
        .collect();
    r.eq(
        "fresh.heaps",
        vec![(node, MemPolicy::Preferred, false, true, 2)],
        heaps,
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
    let mut at_threshold = vec![0u8; THRESHOLD];
    let stats = ALLOC.stats();
    r.eq(
        "small.at_threshold_is_large",
        (before_stats.large_allocations + 1, carved_size(THRESHOLD)),
        (
            stats.large_allocations,
            stats.live_bytes().saturating_sub(before_stats.live_bytes()),
        ),
    );
    // Zeroed and untouched, its pages take no memory yet: written, they land on the node.
    at_threshold.fill(1);
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
    // Grown across the threshold, it gets a mapping of its own (a miss), to grow from by moving
    // its pages.
    r.eq(
        "realloc.grow_across.counters",
        [1, 0, 1, 0],
        delta(counters(&base), counters(&stats)),
    );
    r.eq(
        "realloc.grow_across.live",
        base.live_bytes() + carved_size(12 * MIB),
        stats.live_bytes(),
    );
    r.eq("realloc.grow_across.data", true, is_pattern(&grown));
    grown.extend((grown.len()..12 * MIB).map(pattern));
    r.on_node("realloc.grow_across.pages", grown.as_ptr(), 12 * MIB, node);
    // Its pages move into a larger mapping (mremap): no copy.
    let without_copy = ALLOC.stats().grown_without_copy;
    grown.reserve_exact(24 * MIB - grown.len());
    r.eq(
        "realloc.grow.mremap",
        without_copy + 1,
        ALLOC.stats().grown_without_copy,
    );
    r.eq("realloc.grow.data", true, is_pattern(&grown));
    grown.extend((grown.len()..16 * MIB).map(pattern));
    r.on_node("realloc.grow.pages", grown.as_ptr(), 16 * MIB, node);
    let (at, in_place) = (grown.as_ptr(), ALLOC.stats().in_place_reallocs);
    // 16 of 24 MiB: kept in place, its mapping whole (it wastes less than half).
    grown.shrink_to_fit();
    r.eq(
        "realloc.shrink_in_place",
        (at, in_place + 1, base.live_bytes() + 24 * MIB),
        (
            grown.as_ptr(),
            ALLOC.stats().in_place_reallocs,
            ALLOC.stats().live_bytes(),
        ),
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

    // --- Free: the blocks' space goes back to their chunks; the same sizes again are carved
    // from it (hits), still on the node, zeroed where zeroed memory is asked for. -----------
    let base = quiet_stats();
    // Where the freed blocks held data (ones, threes, indices).
    let freed: Vec<(usize, usize)> = [
        (v8.as_ptr() as usize, v8.len()),
        (v48.as_ptr() as usize, v48.len() * 8),
        (boxed.as_ptr() as usize, boxed.len() * 4),
    ]
    .to_vec();
    drop((v8, v48, boxed));
    let stats = quiet_stats();
    let (live, blocks, cached) = node_row(&stats, node);
    r.eq("free.live", (0, 0), (live, blocks));
    r.eq(
        "free.cached",
        (node_row(&base, node).2 + expected_live, chunks(&base, node)),
        (cached, chunks(&stats, node)),
    );
    r.eq(
        "free.counters",
        [0, 0, 0, 3],
        delta(counters(&base), counters(&stats)),
    );
    let v8 = vec![0u8; 8 * MIB]; // zeroed: carved from space that held data
    let v48 = vec![5u64; 6 * MIB];
    let boxed: Box<[u32]> = (0..BOX_LEN as u32)
        .rev()
        .collect::<Vec<u32>>()
        .into_boxed_slice();
    let after = quiet_stats();
    r.eq(
        "reuse.counters",
        [3, 3, 0, 0],
        delta(counters(&stats), counters(&after)),
    );
    r.eq(
        &format!("reuse.live.node{node}"),
        (
            expected_live,
            3,
            node_row(&base, node).2,
            chunks(&base, node),
        ),
        {
            let (live, blocks, cached) = node_row(&after, node);
            (live, blocks, cached, chunks(&after, node))
        },
    );
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
    // The zeroed block overlaps space a freed block wrote: zeroing was needed, and done.
    let v8_at = v8.as_ptr() as usize;
    let over_old_data = freed
        .iter()
        .any(|&(at, len)| v8_at < at + len && at < v8_at + v8.len());
    r.eq(
        "reuse.zeroed",
        (true, true),
        (over_old_data, v8.iter().all(|&b| b == 0)),
    );
    // Zeroed by giving its pages back: written, they come back on the node.
    let mut v8 = v8;
    v8.fill(8);
    r.on_node("reuse.vec8MiB.pages", v8.as_ptr(), v8.len(), node);
    let data_ok = v48.iter().all(|&x| x == 5)
        && boxed
            .iter()
            .enumerate()
            .all(|(i, &x)| x as usize == BOX_LEN - 1 - i);
    r.eq("reuse.data", true, data_ok);

    // --- Trim releases wholly free chunks; the chunk of a live block stays, its free space
    // purged, the block's data untouched. Then nothing is left. ----------------------------
    drop((v8, boxed));
    let before = quiet_stats();
    ALLOC.trim();
    let stats = quiet_stats();
    let row = node_stats(&stats, node);
    let live48 = carved_size(48 * MIB);
    r.eq(
        "trim.keeps_live_chunk",
        (1, live48, row.mapped_bytes.saturating_sub(live48)),
        (row.chunks, row.live_bytes, row.cached_bytes),
    );
    // Released: every chunk but the live block's, and the mapping the shrunk `Vec` left cached,
    // unless the decay thread released that first (counted before `before`, or just after: it
    // leaves the cache before its release is counted).
    let sum = |f: fn(&NodeStats) -> usize| before.nodes.iter().map(f).sum::<usize>() as u64;
    let chunks_before = sum(|n| n.chunks);
    let mapping_before = sum(|n| n.cached_blocks.saturating_sub(n.free_ranges));
    let released = stats.released_blocks - before.released_blocks;
    r.check(
        "trim.released",
        (chunks_before - 1 + mapping_before..=chunks_before).contains(&released),
        || {
            format!(
                "{} chunks, and the cached mapping unless decay took it",
                chunks_before - 1
            )
        },
        released.to_string(),
    );
    // Resident: the block's huge pages (two more at most where it shares one with free space).
    r.check(
        "trim.purged_free_space",
        (live48..=live48 + 2 * HUGE_PAGE).contains(&row.resident_bytes),
        || format!("{live48}..={} resident bytes", live48 + 2 * HUGE_PAGE),
        row.resident_bytes.to_string(),
    );
    r.on_node("trim.live.pages", v48.as_ptr().cast(), v48.len() * 8, node);
    r.eq("trim.live.data", true, v48.iter().all(|&x| x == 5));
    drop(v48);
    ALLOC.trim();
    let stats = ALLOC.stats();
    r.eq(
        "trim",
        (0, 0, 0, (0, 0)),
        (
            stats.live_bytes(),
            stats.cached_bytes(),
            node_row(&stats, node).1,
            chunks(&stats, node),
        ),
    );

    // --- An empty heap starts over at 32 MiB; a carved block grows in place into the free
    // space after it (the chunk holds nothing else). ----------------------------------------
    let mut growing: Vec<u8> = Vec::with_capacity(4 * MIB);
    growing.extend((0..4 * MIB).map(pattern));
    r.eq(
        "trim.restart",
        (1, CHUNK_FIRST),
        chunks(&ALLOC.stats(), node),
    );
    let (at, base) = (growing.as_ptr(), ALLOC.stats());
    growing.reserve_exact(20 * MIB - growing.len());
    let stats = ALLOC.stats();
    r.eq(
        "realloc.grow_in_place",
        (at, 1, 0, base.live_bytes() + 16 * MIB),
        (
            growing.as_ptr(),
            stats.in_place_reallocs - base.in_place_reallocs,
            stats.grown_without_copy - base.grown_without_copy,
            stats.live_bytes(),
        ),
    );
    growing.extend((growing.len()..20 * MIB).map(pattern));
    r.on_node(
        "realloc.grow_in_place.pages",
        growing.as_ptr(),
        growing.len(),
        node,
    );
    r.eq("realloc.grow_in_place.data", true, is_pattern(&growing));

    // --- Decay: with nothing large allocated, the decay thread purges freed space once it was
    // idle for the decay time (the chunks stay); the next large request is carved from a
    // chunk there is (a hit), and the other chunk, wholly free as long, is released. --------
    let second = vec![9u8; 24 * MIB]; // does not fit the 12 MiB left: a second chunk (64 MiB)
    r.eq(
        "decay.second_chunk",
        (2, 3 * CHUNK_FIRST),
        chunks(&ALLOC.stats(), node),
    );
    drop((growing, second));
    let base = quiet_stats();
    let purged0 = node_stats(&base, node).purged_bytes;
    let purged = (20 + 24) * MIB as u64;
    let started = std::time::Instant::now();
    let decayed = loop {
        let n = node_stats(&ALLOC.stats(), node);
        let done = n.purged_bytes - purged0 >= purged && n.cached_bytes == 3 * CHUNK_FIRST;
        if done || started.elapsed() > DECAY_WAIT {
            break n;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    r.eq(
        "decay.purged",
        (purged, 0, 2, 3 * CHUNK_FIRST),
        (
            decayed.purged_bytes - purged0,
            decayed.resident_bytes,
            decayed.chunks,
            decayed.cached_bytes,
        ),
    );
    let released = ALLOC.stats().released_blocks;
    let before = counters(&ALLOC.stats());
    let fresh = vec![0u8; 8 * MIB];
    let stats = ALLOC.stats();
    r.eq(
        "decay.chunk_released",
        ([1, 1, 0, 0], 1, 1),
        (
            delta(before, counters(&stats)),
            stats.released_blocks - released,
            node_stats(&stats, node).chunks,
        ),
    );
    r.eq("decay.zeroed", true, fresh.iter().all(|&b| b == 0));
    drop(fresh);

    // --- A big block written by one thread lands on the node; so does one populated when
    // handed out by several threads (spawned from inside the allocator). -------------------
    let big = vec![7u8; BIG];
    r.on_node("parallel96MiB.pages", big.as_ptr(), big.len(), node);
    r.eq("parallel96MiB.data", true, big.iter().all(|&b| b == 7));
    drop(big);
    // The block just freed is cached, populated: given back, so that a new one is populated.
    ALLOC.trim();
    let eager = NumaGpuAlloc::new().populate_eager(true);
    let populated: AVec<u8, _> = AVec::with_capacity_in(BIG, &eager);
    r.on_node("eager96MiB.pages", populated.as_ptr(), BIG, node);
    drop(populated);
    // Its populate threads: the node's pooled workers, bound to the node's CPUs.
    let cpulist = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist"))
        .unwrap_or_default();
    let workers = populate_workers(node);
    r.check(
        "populate.workers_bound",
        !workers.is_empty() && workers.iter().all(|cpus| *cpus == cpulist.trim()),
        || format!("workers bound to node {node}'s CPUs {}", cpulist.trim()),
        format!("{workers:?}"),
    );

    // --- A reservation made in the background: its chunks, populated by those workers, are
    // on the node, and a request is carved from them. ---------------------------------------
    ALLOC.trim();
    let reservation = ALLOC
        .reserve_in_background(RESERVED)
        .expect("a reservation");
    let done = reservation.wait();
    r.eq(
        "reserve.usable",
        Ok((RESERVED, 2)),
        done.map(|d| (d.usable, d.chunks))
            .map_err(|e| e.to_string()),
    );
    let before = counters(&ALLOC.stats());
    let carved = vec![3u8; 24 * MIB];
    let stats = ALLOC.stats();
    r.eq("reserve.hit", [1, 1, 0, 0], delta(before, counters(&stats)));
    r.on_node("reserve.pages", carved.as_ptr(), carved.len(), node);
    drop(carved);
    ALLOC.trim();
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

/// Bytes reserved in the background: two chunks, of 32 MiB each.
const RESERVED: usize = 64 * MIB;
