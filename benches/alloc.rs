//! Allocator benchmarks against named peers, measured side by side in one run.
//!
//! `cargo bench --bench alloc` runs every group; `python3 scripts/bench-table.py` then turns
//! criterion's estimates (and the computed rounding figure written next to them) into the
//! markdown table of ratios kept in `BENCHMARKS.md`.
//!
//! Groups (each function id names the peer):
//! - `small_{64B,4KiB}_{1,2}thread`: alloc/free pairs below the threshold — ours (a `static`
//!   `NumaGpuAlloc` called through `GlobalAlloc`, not installed as the global allocator) vs
//!   `std::alloc::System` (glibc) vs mimalloc, and ours over mimalloc (`NumaGpuAlloc<MiMalloc>`)
//!   vs mimalloc.
//! - `large_reuse_64MiB`: allocate 64 MiB, write every page, free — ours (cache warm) vs glibc
//!   `malloc`/`free` vs libnuma `numa_alloc_onnode`/`numa_free` vs `mmap`/`munmap`.
//! - `cold_placement_1GiB`: one fresh 1 GiB block placed and populated — ours with one populate
//!   thread, ours with the default threads, libnuma plus a single-threaded touch.
//! - `growth_vec_256MiB`: an allocator-api2 `Vec<u8>` extended to 256 MiB — ours vs `System`.
//! - `arena_contention_4MiB_4threads`: 4 MiB alloc/free pairs (cache hits) through one
//!   allocator on a 4-node machine's topology (the `amd-nps4` fixture; blocks for nodes this
//!   machine lacks stay unplaced, which changes nothing for cache hits): four threads each bound
//!   to its own node's arena, four threads bound to node 0's, and one thread. Each thread's CPU
//!   time, as for the small path (a 2-core machine has fewer cores than threads).
//! - `rounding_waste` (computed, not timed): bytes reserved / bytes requested for 1000
//!   log-uniform sizes in 2 MiB..512 MiB — ours (from `stats()`) vs power-of-two rounding.
//! - `carver_free_ranges` (timed outside criterion, medians written to `rows.json`): 2,000
//!   blocks of 100 KiB in an arena beside 70,000 free 8 KiB ranges none of them fits, vs an
//!   empty arena (`threshold=4KiB`); each repetition builds its arena afresh.
//!
//! libnuma is opened at run time with `dlopen("libnuma.so.1")`, so nothing links it; without it
//! the libnuma peers are skipped (and say so).

#[path = "common/libnuma.rs"]
mod libnuma;
#[path = "../examples/support/measure.rs"]
mod measure;
use libnuma::{mmap_anon, touch_pages, Libnuma};

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode};
use measure::{cpu_time, splitmix64};
use mimalloc::MiMalloc;
use numa_gpu_alloc::{bind_thread, NumaGpuAlloc, Route};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// Base page size of the machines this runs on; "write every page" writes one byte per page.
const PAGE: usize = 4 * KIB;

/// Ours on the small path and in the large-reuse and growth groups (default settings).
static OURS: NumaGpuAlloc = NumaGpuAlloc::new();
static MIMALLOC: MiMalloc = MiMalloc;
/// Ours wrapping mimalloc: the small path's requests go to mimalloc.
static OURS_MIMALLOC: NumaGpuAlloc<MiMalloc> = NumaGpuAlloc::with_inner(MiMalloc);
/// Cold placement: nothing cached, so every allocation places and populates a fresh block.
static COLD_ONE_THREAD: NumaGpuAlloc = NumaGpuAlloc::new().cache_limit(0).populate_threads(1);
static COLD_PARALLEL: NumaGpuAlloc = NumaGpuAlloc::new().cache_limit(0);
/// Arena contention: threads bound to nodes of a 4-node topology.
static FOUR_NODES: NumaGpuAlloc = NumaGpuAlloc::new().sysfs_root("tests/fixtures/amd-nps4");

// ---------------------------------------------------------------------------------------------
// Helpers.

/// Times `work(thread index, iters)` on `threads` fresh threads started together, each on its
/// own CPU time (`CLOCK_THREAD_CPUTIME_ID`: what the work itself costs, not counting time other
/// processes on this shared 2-core machine held the CPU); the result is the slowest thread's.
///
/// Fresh threads even for one: glibc serves each thread from its own arena, so the work does not
/// run in the main arena, whose state criterion's own analysis changes between benchmarks (a
/// 4 KiB pair costs ~28 ns or ~50 ns there depending on whether the freed chunk borders the top
/// chunk, which would hand one peer or the other an unearned advantage).
fn on_threads<F: Fn(usize, u64) + Sync>(threads: usize, iters: u64, work: F) -> Duration {
    let timed = |index: usize| {
        let start = cpu_time(libc::CLOCK_THREAD_CPUTIME_ID);
        work(index, iters);
        cpu_time(libc::CLOCK_THREAD_CPUTIME_ID).saturating_sub(start)
    };
    let barrier = Barrier::new(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|index| {
                let (barrier, timed) = (&barrier, &timed);
                scope.spawn(move || {
                    barrier.wait();
                    timed(index)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("bench thread panicked"))
            .max()
            .unwrap_or_default()
    })
}

/// One alloc/free pair through `GlobalAlloc`.
#[inline(always)]
fn pair<A: GlobalAlloc>(alloc: &A, layout: Layout) {
    // SAFETY: the layout has a non-zero size; the pointer is freed with the same layout.
    unsafe {
        let ptr = alloc.alloc(layout);
        black_box(ptr);
        alloc.dealloc(ptr, layout);
    }
}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 8).expect("valid layout")
}

fn page_layout(size: usize) -> Layout {
    Layout::from_size_align(size, PAGE).expect("valid layout")
}

// ---------------------------------------------------------------------------------------------
// 1. Small path.

/// Times alloc/free pairs of `layout` on `alloc`, on `threads` threads, as function `id`.
fn small_pairs<A: GlobalAlloc + Sync>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    alloc: &A,
    threads: usize,
    layout: Layout,
) {
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            on_threads(threads, iters, |_, n| {
                (0..n).for_each(|_| pair(alloc, layout))
            })
        })
    });
}

fn small_path(c: &mut Criterion) {
    for (label, size) in [("64B", 64), ("4KiB", 4 * KIB)] {
        let layout = layout(size);
        for threads in [1, 2] {
            let name = match threads {
                1 => format!("small_{label}_1thread"),
                _ => format!("small_{label}_{threads}threads"),
            };
            let mut group = c.benchmark_group(name);
            group
                .sample_size(30)
                .warm_up_time(Duration::from_millis(500))
                .measurement_time(Duration::from_secs(2));
            small_pairs(&mut group, "ours", &OURS, threads, layout);
            small_pairs(&mut group, "system_glibc", &System, threads, layout);
            small_pairs(&mut group, "mimalloc", &MIMALLOC, threads, layout);
            small_pairs(
                &mut group,
                "ours_over_mimalloc",
                &OURS_MIMALLOC,
                threads,
                layout,
            );
            group.finish();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Large reuse.

fn large_reuse(c: &mut Criterion, libnuma: Option<&Libnuma>, node: usize) {
    const LEN: usize = 64 * MIB;
    let layout = page_layout(LEN);

    let mut group = c.benchmark_group("large_reuse_64MiB");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));

    // Warm the cache: the first block is placed and populated here, every later one is reused.
    // SAFETY: non-zero layout, freed with the same layout.
    unsafe { OURS.dealloc(OURS.alloc(layout), layout) };
    group.bench_function("ours", |b| {
        b.iter(|| {
            // SAFETY: non-zero layout, freed with the same layout.
            unsafe {
                let ptr = OURS.alloc(layout);
                touch_pages(ptr, LEN);
                OURS.dealloc(ptr, layout);
            }
        })
    });
    group.bench_function("glibc_malloc", |b| {
        b.iter(|| {
            // SAFETY: malloc'ed memory of LEN bytes, freed once.
            unsafe {
                let ptr = libc::malloc(LEN).cast::<u8>();
                touch_pages(ptr, LEN);
                libc::free(ptr.cast());
            }
        })
    });
    if let Some(numa) = libnuma {
        group.bench_function("libnuma_onnode", |b| {
            b.iter(|| {
                let ptr = numa.alloc(LEN, node);
                touch_pages(ptr, LEN);
                // SAFETY: allocated above with LEN bytes, freed once.
                unsafe { numa.release(ptr, LEN) };
            })
        });
    }
    group.bench_function("mmap_munmap", |b| {
        b.iter(|| {
            let ptr = mmap_anon(LEN);
            touch_pages(ptr, LEN);
            // SAFETY: the mapping made above, unmapped once.
            unsafe { libc::munmap(ptr.cast(), LEN) };
        })
    });
    group.finish();
}

// ---------------------------------------------------------------------------------------------
// 3. Cold placement.

/// Times only the allocation (placement and populating) of fresh blocks; frees outside the clock.
fn time_fresh_blocks(alloc: &NumaGpuAlloc, len: usize, iters: u64) -> Duration {
    let layout = page_layout(len);
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        alloc.trim();
        let start = Instant::now();
        // SAFETY: non-zero layout.
        let ptr = unsafe { alloc.alloc(layout) };
        total += start.elapsed();
        assert!(!ptr.is_null(), "allocation of {len} bytes failed");
        // SAFETY: allocated above with `layout`.
        unsafe { alloc.dealloc(black_box(ptr), layout) };
    }
    total
}

fn cold_placement(c: &mut Criterion, libnuma: Option<&Libnuma>, node: usize) {
    const LEN: usize = GIB;

    let mut group = c.benchmark_group("cold_placement_1GiB");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    group.bench_function("ours_1thread", |b| {
        b.iter_custom(|iters| time_fresh_blocks(&COLD_ONE_THREAD, LEN, iters))
    });
    group.bench_function("ours_parallel", |b| {
        b.iter_custom(|iters| time_fresh_blocks(&COLD_PARALLEL, LEN, iters))
    });
    if let Some(numa) = libnuma {
        group.bench_function("libnuma_1thread_touch", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    let ptr = numa.alloc(LEN, node);
                    touch_pages(ptr, LEN);
                    total += start.elapsed();
                    // SAFETY: allocated above with LEN bytes, freed once.
                    unsafe { numa.release(black_box(ptr), LEN) };
                }
                total
            })
        });
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------------
// 4. Growth.

/// Appends `chunk` with one `memcpy`, growing by doubling, as std's `extend_from_slice` does for
/// `Copy` elements (allocator-api2's pushes byte by byte, which would bury the allocator's cost).
fn extend_chunk<A: Allocator>(vec: &mut allocator_api2::vec::Vec<u8, A>, chunk: &[u8]) {
    vec.reserve(chunk.len());
    let len = vec.len();
    let spare = vec.spare_capacity_mut();
    // SAFETY: `reserve` made room for `chunk.len()` more bytes after `len`, and `chunk` cannot
    // overlap the vector's own buffer; the bytes are initialised before the length covers them.
    unsafe {
        std::ptr::copy_nonoverlapping(chunk.as_ptr(), spare.as_mut_ptr().cast(), chunk.len());
        vec.set_len(len + chunk.len());
    }
}

fn grow_to<A: Allocator>(alloc: A, len: usize) {
    const CHUNK: usize = 64 * KIB;
    let chunk = [1u8; CHUNK];
    let mut vec = allocator_api2::vec::Vec::new_in(alloc);
    while vec.len() < len {
        extend_chunk(&mut vec, black_box(&chunk));
    }
    black_box(vec.as_ptr());
}

fn growth(c: &mut Criterion) {
    const LEN: usize = 256 * MIB;

    let mut group = c.benchmark_group("growth_vec_256MiB");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    group.bench_function("ours", |b| b.iter(|| grow_to(&OURS, LEN)));
    group.bench_function("system", |b| b.iter(|| grow_to(System, LEN)));
    group.finish();
}

// ---------------------------------------------------------------------------------------------
// 5. Rounding waste (computed).

/// `count` request sizes, log-uniform over `[low, high]`, from a fixed seed.
fn log_uniform_sizes(count: usize, low: usize, high: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let (ln_low, ln_high) = ((low as f64).ln(), (high as f64).ln());
    (0..count)
        .map(|_| {
            let unit = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            ((ln_low + unit * (ln_high - ln_low)).exp() as usize).clamp(low, high)
        })
        .collect()
}

fn rounding_waste(count: usize) {
    const SEED: u64 = 6;
    let start = Instant::now();
    let sizes = log_uniform_sizes(count, 2 * MIB, 512 * MIB, SEED);
    // Nothing cached, so each request's reservation is its own block's capacity.
    let ours = NumaGpuAlloc::new().cache_limit(0);
    let (mut requested, mut reserved, mut pow2) = (0u128, 0u128, 0u128);
    let (mut worst_ours, mut worst_pow2) = (1.0f64, 1.0f64);
    for &size in &sizes {
        let layout = layout(size);
        // SAFETY: non-zero layout, freed with the same layout below.
        let ptr = unsafe { ours.alloc(layout) };
        assert!(!ptr.is_null(), "allocation of {size} bytes failed");
        let capacity = ours.stats().live_bytes();
        // SAFETY: allocated above with `layout`.
        unsafe { ours.dealloc(ptr, layout) };
        let rounded = size.next_power_of_two();
        requested += size as u128;
        reserved += capacity as u128;
        pow2 += rounded as u128;
        worst_ours = worst_ours.max(capacity as f64 / size as f64);
        worst_pow2 = worst_pow2.max(rounded as f64 / size as f64);
    }
    let ours_ratio = reserved as f64 / requested as f64;
    let pow2_ratio = pow2 as f64 / requested as f64;
    println!(
        "rounding_waste: {count} sizes log-uniform in 2 MiB..512 MiB (seed {SEED}): reserved/requested \
         ours {ours_ratio:.4} (worst {worst_ours:.4}) vs power-of-two {pow2_ratio:.4} (worst \
         {worst_pow2:.4}); ours/pow2 {:.4}; target ours <= 1.125: {} ({:.1} s)",
        ours_ratio / pow2_ratio,
        if ours_ratio <= 1.125 { "met" } else { "MISSED" },
        start.elapsed().as_secs_f64()
    );
    let dir = rows::criterion_dir().join("rounding_waste");
    let json = format!(
        "{{\"sizes\": {count}, \"seed\": {SEED}, \"low\": {}, \"high\": {}, \
         \"requested_bytes\": {requested}, \"ours_reserved_bytes\": {reserved}, \
         \"pow2_reserved_bytes\": {pow2}, \"ours\": {ours_ratio}, \"pow2\": {pow2_ratio}, \
         \"ours_worst\": {worst_ours}, \"pow2_worst\": {worst_pow2}}}\n",
        2 * MIB,
        512 * MIB
    );
    if let Err(err) =
        std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join("computed.json"), json))
    {
        eprintln!(
            "rounding_waste: cannot write {}: {err}",
            dir.join("computed.json").display()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Arena contention.

fn arena_contention(c: &mut Criterion) {
    const LEN: usize = 4 * MIB;
    let layout = page_layout(LEN);
    // Thread `index` bound to node `node(index)`: a node of its own, or node 0 for all.
    let bound = |node: fn(usize) -> usize| {
        move |index: usize, n: u64| {
            let _bound = bind_thread(Route::Node(node(index)));
            (0..n).for_each(|_| pair(&FOUR_NODES, layout))
        }
    };
    let own_node: fn(usize) -> usize = |index| index;
    let node_zero: fn(usize) -> usize = |_| 0;

    // Warm every node's arena so every allocation in the timed loops is a cache hit.
    on_threads(4, 1, bound(own_node));

    let mut group = c.benchmark_group("arena_contention_4MiB_4threads");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    group.bench_function("one_thread", |b| {
        b.iter_custom(|iters| on_threads(1, iters, bound(node_zero)))
    });
    group.bench_function("four_nodes", |b| {
        b.iter_custom(|iters| on_threads(4, iters, bound(own_node)))
    });
    group.bench_function("one_node", |b| {
        b.iter_custom(|iters| on_threads(4, iters, bound(node_zero)))
    });
    group.finish();
}

// ---------------------------------------------------------------------------------------------
// 7. The carver: requests beside many free ranges that cannot serve them.

/// The median of `values` (not empty).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Milliseconds to allocate `count` blocks of `size` bytes in an arena holding `free_ranges`
/// free 8 KiB ranges (every other of twice as many 8 KiB blocks freed, so that none merge),
/// none of which can serve them.
fn time_beside_free_ranges(free_ranges: usize, count: usize, size: usize) -> f64 {
    let alloc = NumaGpuAlloc::new()
        .threshold(4 * KIB)
        .decay_ms(u64::MAX)
        .cache_limit(4 * GIB);
    alloc.trim();
    let free = |ptr: *mut u8, len: usize| {
        // SAFETY: allocated below from `alloc` with `layout(len)`.
        unsafe { alloc.dealloc(ptr, layout(len)) }
    };
    // SAFETY: non-zero layouts.
    let small: Vec<*mut u8> = (0..2 * free_ranges)
        .map(|_| unsafe { alloc.alloc(page_layout(8 * KIB)) })
        .collect();
    assert!(small.iter().all(|p| !p.is_null()), "8 KiB blocks");
    small.iter().step_by(2).for_each(|&p| free(p, 8 * KIB));
    let ranges: usize = alloc.stats().nodes.iter().map(|n| n.cached_blocks).sum();
    assert!(ranges >= free_ranges, "{ranges} free ranges");
    let start = Instant::now();
    // SAFETY: non-zero layouts.
    let held: Vec<*mut u8> = (0..count)
        .map(|_| unsafe { alloc.alloc(layout(size)) })
        .collect();
    let elapsed = start.elapsed();
    assert!(
        held.iter().all(|p| !p.is_null()),
        "blocks beside the free ranges"
    );
    held.into_iter().for_each(|p| free(p, size));
    small
        .iter()
        .skip(1)
        .step_by(2)
        .for_each(|&p| free(p, 8 * KIB));
    alloc.trim();
    elapsed.as_secs_f64() * 1e3
}

fn carver_free_ranges(repetitions: usize) {
    const FREE_RANGES: usize = 70_000;
    const BLOCKS: usize = 2_000;
    const SIZE: usize = 100 * KIB;
    let (mut full, mut empty) = (Vec::new(), Vec::new());
    for _ in 0..repetitions {
        full.push(time_beside_free_ranges(FREE_RANGES, BLOCKS, SIZE));
        empty.push(time_beside_free_ranges(0, BLOCKS, SIZE));
    }
    let (full, empty) = (median(&mut full), median(&mut empty));
    println!(
        "carver_free_ranges: {BLOCKS} blocks of 100 KiB, median of {repetitions}: {full:.1} ms \
         beside {FREE_RANGES} free 8 KiB ranges, {empty:.1} ms in an empty arena: {:.3}x (target \
         <= 1.2x)",
        full / empty
    );
    rows::write(
        "carver_free_ranges",
        &[rows::row(
            "2,000 blocks of 100 KiB (threshold 4 KiB) beside 70,000 free 8 KiB ranges",
            full,
            "empty arena",
            empty,
            "ms",
            Some(1.2),
        )],
    );
}

// ---------------------------------------------------------------------------------------------

/// Criterion options that take a value (so the value is not mistaken for a filter).
const VALUE_OPTIONS: &[&str] = &[
    "--color",
    "-c",
    "--save-baseline",
    "-s",
    "--baseline",
    "-b",
    "--baseline-lenient",
    "--load-baseline",
    "--profile-time",
    "--sample-size",
    "--warm-up-time",
    "--measurement-time",
    "--nresamples",
    "--noise-threshold",
    "--confidence-level",
    "--significance-level",
    "--plotting-backend",
    "--output-format",
    "--format",
];

/// Whether a group named `name` runs under the command line's filter (substring match, as
/// criterion does by default).
fn selected(name: &str) -> bool {
    let mut args = std::env::args().skip(1);
    let mut filters = Vec::new();
    while let Some(arg) = args.next() {
        if VALUE_OPTIONS.contains(&arg.as_str()) {
            args.next();
        } else if !arg.starts_with('-') {
            filters.push(arg);
        }
    }
    filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()))
}

fn main() {
    // Criterion runs each benchmark once, untimed, unless cargo passes `--bench`
    // (`cargo test --benches`); keep the computed figure short there too.
    let bench_mode = std::env::args().any(|arg| arg == "--bench");
    let node = OURS.placement().host_node;
    let libnuma = match Libnuma::open() {
        Ok(numa) => Some(numa),
        Err(err) => {
            println!("libnuma peers skipped: cannot use libnuma.so.1 ({err})");
            None
        }
    };

    let mut c = Criterion::default().configure_from_args();
    small_path(&mut c);
    large_reuse(&mut c, libnuma.as_ref(), node);
    cold_placement(&mut c, libnuma.as_ref(), node);
    growth(&mut c);
    arena_contention(&mut c);
    if selected("rounding_waste") {
        rounding_waste(if bench_mode { 1000 } else { 16 });
    }
    if selected("carver_free_ranges") {
        carver_free_ranges(if bench_mode { 9 } else { 1 });
    }
    c.final_summary();
}

#[path = "common/rows.rs"]
mod rows;
