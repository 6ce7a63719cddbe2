//! Reservations of bytes against the CUDA driver simulator (`tests/sim/`), which records each
//! registration's size and can make registrations take time under its global lock, as the
//! driver's page-table work does: chunk by chunk, in the background, within the pinned limit,
//! and stopped cleanly by a failed chunk.
//!
//! Its own binary: each body runs in a child process that loads the simulator as libcuda, with
//! its own allocators (the arenas are the process's).

use crate::common;

use std::alloc::{GlobalAlloc, Layout};
use std::time::{Duration, Instant};

use common::sim::{self, Sim};
use numa_gpu_alloc::{Error, NumaGpuAlloc, PinMode, Stats};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// No registration of a reservation covers more than this (the default `register_max=`).
const CHUNK_BOUND: u64 = 256 << 20;

fn mapped(stats: &Stats) -> usize {
    stats.nodes.iter().map(|n| n.mapped_bytes).sum()
}

/// Allocates `size` bytes from `alloc`; the caller frees with [`free`].
fn allocate(alloc: &NumaGpuAlloc, size: usize) -> *mut u8 {
    let layout = Layout::from_size_align(size, 4096).unwrap();
    // SAFETY: a non-zero layout.
    unsafe { alloc.alloc(layout) }
}

fn free(alloc: &NumaGpuAlloc, ptr: *mut u8, size: usize) {
    let layout = Layout::from_size_align(size, 4096).unwrap();
    // SAFETY: allocated by `allocate` with this size.
    unsafe { alloc.dealloc(ptr, layout) };
}

sim_test!(
    /// 3 GiB and 64 MiB reserved pinned: chunks of at most the bound, each registered once, and a
    /// 256 MiB block (which would otherwise get a mapping and registration of its own) carved
    /// from their room.
    a_reservation_registers_chunk_by_chunk,
    env: [],
    {
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);
        let before = (!sim::real_driver()).then(|| Sim::get().stats());
        let done = ALLOC.reserve_bytes(3 * GIB + 64 * MIB).expect("reserve");
        eprintln!("{done}");
        assert_eq!((done.registered, done.usable), (3 * GIB + 64 * MIB, 3 * GIB + 64 * MIB));
        assert!(done.finished && done.first_chunk.is_some());
        let stats = ALLOC.stats();
        assert_eq!(stats.pinned_bytes(), 3 * GIB + 64 * MIB, "{stats}");
        if let Some(before) = before {
            let after = Sim::get().stats();
            assert!(after.largest_registration <= CHUNK_BOUND, "{after:?}");
            assert_eq!(after.registrations - before.registrations, done.chunks as u64);
        }
        let misses = stats.cache_misses;
        let block = allocate(&ALLOC, 256 * MIB);
        assert!(!block.is_null());
        let stats = ALLOC.stats();
        assert_eq!(stats.cache_misses, misses, "carved from reserved room: {stats}");
        assert_eq!(stats.pinned_bytes(), 3 * GIB + 64 * MIB, "no registration of its own");
        free(&ALLOC, block, 256 * MIB);
        ALLOC.trim();
        assert_eq!(ALLOC.stats().pinned_bytes(), 0, "trim releases reserved chunks");
    }
);

sim_test!(
    /// While 2 GiB are being reserved in the background (registration taking 0.8 s per GiB
    /// under the simulator's lock), a request is served from the first chunk, and the handle
    /// shows the reservation's progress.
    the_first_allocation_is_served_while_a_reservation_registers,
    env: [("CUDA_SIM_REGISTER_US_PER_GIB", "800000")],
    {
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);
        ALLOC.placement();
        let reservation = ALLOC.reserve_in_background(2 * GIB).expect("start");
        let start = Instant::now();
        while reservation.progress().chunks == 0 {
            assert!(start.elapsed() < Duration::from_secs(60), "{:?}", reservation.progress());
            std::thread::sleep(Duration::from_millis(1));
        }
        let (hits, misses) = (ALLOC.stats().cache_hits, ALLOC.stats().cache_misses);
        let block = allocate(&ALLOC, 16 * MIB);
        assert!(!block.is_null());
        let during = reservation.progress();
        eprintln!("first allocation served during: {during}");
        assert!(!during.finished, "the reservation was still going: {during}");
        let stats = ALLOC.stats();
        assert_eq!((stats.cache_hits, stats.cache_misses), (hits + 1, misses), "{stats}");
        let done = reservation.wait().expect("the reservation");
        eprintln!("{done}");
        assert_eq!(done.registered, 2 * GIB);
        if !sim::real_driver() {
            let sim = Sim::get().stats();
            assert!(sim.largest_registration <= CHUNK_BOUND, "{sim:?}");
            // A 256 MiB chunk's registration takes 0.2 s in the simulator: the handle saw it.
            assert!(done.longest_driver_call >= Duration::from_millis(75), "{done}");
        }
        free(&ALLOC, block, 16 * MIB);
        ALLOC.trim();
    }
);

sim_test!(
    /// `pin_limit=256MiB`: a reservation beyond the limit is refused before anything is made
    /// (`Error::PinLimit`, saying what to change), a `pin=on` block past it is served unpinned
    /// (counted), a `pin=strict` one fails, and once `trim` gave the reserved chunks back a block
    /// is page-locked again.
    the_pinned_limit_holds,
    env: [],
    {
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On).pin_limit(256 * MIB);
        static STRICT: NumaGpuAlloc =
            NumaGpuAlloc::new().pin(PinMode::Strict).pin_limit(256 * MIB);
        let err = ALLOC.reserve_bytes(GIB).unwrap_err();
        assert!(
            matches!(err, Error::PinLimit { limit, requested, .. } if limit == 256 * MIB && requested == GIB),
            "{err}"
        );
        assert!(err.to_string().contains("raise pin_limit="), "{err}");
        assert_eq!(mapped(&ALLOC.stats()), 0, "nothing made for a refusal");
        // Chunks of 32, 64 and 128 MiB.
        ALLOC.reserve_bytes(224 * MIB).expect("within the limit");
        let stats = ALLOC.stats();
        assert_eq!((stats.pinned_bytes(), mapped(&stats)), (224 * MIB, 224 * MIB), "{stats}");

        let unpinned = stats.fallbacks.unpinned_blocks;
        let block = allocate(&ALLOC, 200 * MIB);
        assert!(!block.is_null());
        let stats = ALLOC.stats();
        assert_eq!(stats.pinned_bytes(), 224 * MIB, "still within the limit: {stats}");
        assert_eq!(stats.fallbacks.unpinned_blocks, unpinned + 1, "{stats}");
        assert_eq!(stats.fallbacks.pin_limited, 1, "the block: {stats}");
        assert_eq!((stats.page_locked_bytes, stats.pin_limit), (224 * MIB, Some(256 * MIB)));
        assert!(stats.to_string().contains("of the pinned limit 256 MiB"), "{stats}");
        free(&ALLOC, block, 200 * MIB);

        assert!(allocate(&STRICT, 200 * MIB).is_null(), "pin=strict fails past the limit");

        ALLOC.trim();
        assert_eq!(ALLOC.stats().pinned_bytes(), 0);
        let block = allocate(&ALLOC, 200 * MIB);
        let pinned = ALLOC.stats().pinned_bytes();
        assert!((200 * MIB..=256 * MIB).contains(&pinned), "page-locked again: {pinned}");
        free(&ALLOC, block, 200 * MIB);
        ALLOC.trim();
    }
);

sim_test!(
    /// The third chunk's registration fails (out of memory): the reservation stops with that
    /// CUDA error, the two chunks registered before it stay usable, the failed one is unmapped,
    /// and the next registration works (no error left behind).
    a_chunk_failure_stops_the_reservation_cleanly,
    env: [("CUDA_SIM_FAIL", "cuMemHostRegister_v2:2:2:1")],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: needs the simulator's error injection"
        );
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);
        let err = ALLOC.reserve_bytes(GIB).unwrap_err();
        assert!(matches!(err, Error::Cuda { code: 2, .. }), "{err}");
        assert!(err.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
        let stats = ALLOC.stats();
        assert_eq!((stats.pinned_bytes(), mapped(&stats)), (96 * MIB, 96 * MIB), "{stats}");

        let misses = stats.cache_misses;
        let block = allocate(&ALLOC, 48 * MIB);
        assert!(!block.is_null());
        assert_eq!(ALLOC.stats().cache_misses, misses, "served from a registered chunk");

        let registrations = Sim::get().stats().registrations;
        let other = allocate(&ALLOC, 200 * MIB);
        assert!(!other.is_null());
        assert_eq!(Sim::get().stats().registrations, registrations + 1);
        let pinned = ALLOC.stats().pinned_bytes() - 96 * MIB;
        assert!((200 * MIB..=256 * MIB).contains(&pinned), "registered after the failure");
        free(&ALLOC, block, 48 * MIB);
        free(&ALLOC, other, 200 * MIB);
        ALLOC.trim();
    }
);

sim_test!(
    /// A reservation still under way when the program ends: the exit handler lets the chunk in
    /// progress finish and stops the rest, before the driver tears down at exit (the simulator
    /// aborts on a registration after its teardown).
    a_reservation_under_way_at_exit_stops_before_the_driver_tears_down,
    env: [("CUDA_SIM_REGISTER_US_PER_GIB", "200000"), ("CUDA_SIM_TEARDOWN_US", "2000000")],
    {
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);
        let reservation = ALLOC.reserve_in_background(8 * GIB).expect("start");
        while reservation.progress().chunks < 2 {
            std::thread::sleep(Duration::from_millis(1));
        }
        // The body returns at once: the test harness exits with the reservation under way.
    }
);

/// After the environment's reservation (`NUMA_GPU_ALLOC` of the test), a pool of 512 blocks of
/// 2 MiB: the reservation and the pool together register at most 16 chunks, none above the
/// bound, and the pool is carved from the reserved room.
fn a_pool_after_the_environments_reservation(reserved: usize) {
    require!(
        !sim::real_driver(),
        "on the real driver: counts the simulator's registrations"
    );
    static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();
    let pool: Vec<_> = (0..512).map(|_| allocate(&ALLOC, 2 * MIB)).collect();
    assert!(pool.iter().all(|p| !p.is_null()));
    let sim = Sim::get().stats();
    let stats = ALLOC.stats();
    eprintln!("{sim:?}\n{stats}");
    assert!(sim.registrations <= 16, "{sim:?}");
    assert!(sim.largest_registration <= CHUNK_BOUND, "{sim:?}");
    assert_eq!(stats.reserved_bytes, reserved as u64, "{stats}");
    assert_eq!(
        stats.pinned_bytes(),
        reserved,
        "the pool is carved from the room: {stats}"
    );
    for p in pool {
        free(&ALLOC, p, 2 * MIB);
    }
    ALLOC.trim();
}

sim_test!(
    /// `reserve=3GiB`: chunked room, one registration per chunk, none above the bound.
    the_environment_reserves_bytes_in_chunks,
    env: [("NUMA_GPU_ALLOC", "pin=on,reserve=3GiB")],
    { a_pool_after_the_environments_reservation(3 * GIB) }
);

sim_test!(
    /// `reserve=24x128MiB`: chunks of whole 128 MiB blocks, not 24 blocks registered each.
    the_environment_reserves_blocks_in_chunks,
    env: [("NUMA_GPU_ALLOC", "pin=on,reserve=24x128MiB")],
    { a_pool_after_the_environments_reservation(3 * GIB) }
);

sim_test!(
    /// `reserve=2GiB` with `cache=1GiB`: reserved room is bounded by the node's memory and the
    /// pinned limit, not the cache's; and a block above the bound gets one registration of its
    /// own, counted as such.
    a_reservation_beyond_the_cache_limit_needs_no_cache_setting,
    env: [("NUMA_GPU_ALLOC", "pin=on,cache=1GiB,reserve=2GiB")],
    {
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();
        let block = allocate(&ALLOC, 2 * MIB);
        let stats = ALLOC.stats();
        assert_eq!(stats.reserved_bytes, 2 * GIB as u64, "{stats}");
        assert!(stats.config_errors.is_empty(), "{:?}", stats.config_errors);
        free(&ALLOC, block, 2 * MIB);
        ALLOC.trim();
        let large = allocate(&ALLOC, 300 * MIB);
        assert!(!large.is_null());
        let stats = ALLOC.stats();
        assert_eq!(stats.oversized_registrations, 1, "{stats}");
        free(&ALLOC, large, 300 * MIB);
        ALLOC.trim();
    }
);
