//! Running out of address space: a child process (this test binary, re-executed) lowers its
//! `RLIMIT_AS` and allocates large blocks until the allocator says no. Large requests then get
//! null / `AllocError` / a `try_reserve` error, never an abort, and every block handed out before
//! still holds its pattern. Under the same kind of limit, idle cached blocks are given back when a
//! new block does not fit otherwise.

use std::alloc::{GlobalAlloc, Layout};

use allocator_api2::alloc::Allocator;
use numa_gpu_alloc::NumaGpuAlloc;

mod common {
    pub mod bytes;
    pub mod child;
    pub mod fill;
}

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().cache_limit(64 << 20);

const MIB: usize = 1 << 20;
const CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_EXHAUSTION_CHILD";
const CHILD_OK: &str = "exhaustion child: all checks passed";
/// Room left above the child's current address-space size.
const HEADROOM: usize = 384 * MIB;

fn vm_size() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
    let kib: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kib * 1024
}

fn set_address_space_limit(bytes: usize) {
    let limit = libc::rlimit {
        rlim_cur: bytes as libc::rlim_t,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: `limit` is a valid rlimit for the duration of the call.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
}

/// A pattern per block: one byte per page plus the last byte.
fn fill(ptr: *mut u8, len: usize, seed: u8) {
    for off in (0..len).step_by(4096) {
        // SAFETY: off < len, inside the caller's block.
        unsafe { ptr.add(off).write(seed.wrapping_add((off / 4096) as u8)) };
    }
    // SAFETY: len > 0, the last byte of the block.
    unsafe { ptr.add(len - 1).write(seed ^ 0x5a) };
}

fn intact(ptr: *const u8, len: usize, seed: u8) -> bool {
    // SAFETY: reads inside the caller's block, as `fill` wrote.
    (0..len)
        .step_by(4096)
        .all(|off| unsafe { *ptr.add(off) } == seed.wrapping_add((off / 4096) as u8))
        && unsafe { *ptr.add(len - 1) } == seed ^ 0x5a
}

fn child() {
    // Bookkeeping is reserved before the limit, so only the allocations under test can fail.
    let mut global: Vec<(*mut u8, Layout, u8)> = Vec::with_capacity(4096);
    let mut local_blocks: Vec<(std::ptr::NonNull<u8>, Layout, u8)> = Vec::with_capacity(4096);
    let local = NumaGpuAlloc::new().cache_limit(0);
    // Initialise both large paths first: on a GPU machine that loads libcuda (the default target
    // asks the driver for the GPU's node), whose mappings must not count against the limit.
    let _ = (ALLOC.placement(), local.placement());
    let limit = vm_size() + HEADROOM;
    set_address_space_limit(limit);

    // 1. The global allocator until it returns null.
    let mut seed = 0u8;
    let mut global_failures = 0;
    for i in 0..4096 {
        let size = [16 * MIB, 6 * MIB + 4096, 40 * MIB][i % 3];
        let layout = Layout::from_size_align(size, 64).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { ALLOC.alloc(layout) };
        if p.is_null() {
            global_failures += 1;
            if global_failures >= 3 {
                break;
            }
            continue;
        }
        seed = seed.wrapping_add(1);
        fill(p, size, seed);
        global.push((p, layout, seed));
    }
    assert!(global_failures >= 3, "the limit was never reached");
    assert!(!global.is_empty(), "nothing fitted under the limit");

    // 2. A huge request, zeroed, and growing a Vec with try_reserve: errors, not aborts.
    let huge = Layout::from_size_align(1 << 40, 4096).unwrap();
    // SAFETY: non-zero size.
    assert!(unsafe { ALLOC.alloc_zeroed(huge) }.is_null());
    let mut v: Vec<u8> = Vec::new();
    assert!(v.try_reserve_exact(HEADROOM * 2).is_err());

    // 3. The allocator-api2 front end of another instance: AllocError. Free some global blocks
    // first so that it gets some room, then exhaust it too.
    for (p, layout, seed) in global.drain(..global.len() / 2) {
        assert!(intact(p, layout.size(), seed));
        // SAFETY: allocated above with this layout.
        unsafe { ALLOC.dealloc(p, layout) };
    }
    ALLOC.trim();
    let mut local_failures = 0;
    for i in 0..4096 {
        let size = [8 * MIB, 24 * MIB, 72 * MIB][i % 3]; // 72 MiB: populated by threads
        let layout = Layout::from_size_align(size, 4096).unwrap();
        match local.allocate(layout) {
            Ok(p) => {
                seed = seed.wrapping_add(1);
                fill(p.cast::<u8>().as_ptr(), size, seed);
                local_blocks.push((p.cast(), layout, seed));
            }
            Err(_) => {
                local_failures += 1;
                if local_failures >= 3 {
                    break;
                }
            }
        }
    }
    assert!(local_failures >= 3);
    assert!(!local_blocks.is_empty());

    // 4. Everything handed out is intact; freeing it all makes room again.
    for &(p, layout, seed) in &global {
        assert!(intact(p, layout.size(), seed), "global block corrupted");
    }
    for &(p, layout, seed) in &local_blocks {
        assert!(
            intact(p.as_ptr(), layout.size(), seed),
            "local block corrupted"
        );
    }
    let (global_stats, local_stats) = (ALLOC.stats(), local.stats());
    for (p, layout, _) in global.drain(..) {
        // SAFETY: allocated above with this layout.
        unsafe { ALLOC.dealloc(p, layout) };
    }
    for (p, layout, _) in local_blocks.drain(..) {
        // SAFETY: allocated above with this layout.
        unsafe { local.deallocate(p, layout) };
    }
    ALLOC.trim();
    let again = vec![3u8; 32 * MIB];
    assert!(common::bytes::all_bytes_are(&again, 3));
    drop(again);

    for (name, s) in [("global", &global_stats), ("local", &local_stats)] {
        println!("{name}:\n{s}");
        assert!(s.fallbacks.failed_allocations >= 3, "{s}");
        assert_eq!(
            s.fallbacks.failed_allocations,
            s.fallbacks.map_failures + s.fallbacks.populate_failures + s.fallbacks.memory_limited,
            "{s}"
        );
        assert_eq!(s.cache_hits + s.cache_misses, s.large_allocations, "{s}");
    }
    assert_eq!(ALLOC.stats().live_bytes(), 0);
    assert_eq!(local.stats().live_bytes(), 0);
    println!("{CHILD_OK}");
}

/// A large cached block given back: 900 MiB reserved and freed (960 MiB cached), then 100 MiB
/// under a limit that only fits one of the two. (A request large enough that the cached block
/// and it would pass the live peak evicts the cached block before mapping, with no pressure.)
fn cache_child() {
    let local = NumaGpuAlloc::new();
    set_address_space_limit(vm_size() + 1000 * MIB);
    let mut first: allocator_api2::vec::Vec<u8, _> = allocator_api2::vec::Vec::new_in(&local);
    first.try_reserve_exact(900 * MIB).expect("900 MiB fit");
    common::fill::resize(&mut first, 900 * MIB, 1);
    drop(first);
    assert_eq!(local.stats().cached_bytes(), 960 * MIB);

    let mut second: allocator_api2::vec::Vec<u8, _> = allocator_api2::vec::Vec::new_in(&local);
    second
        .try_reserve_exact(100 * MIB)
        .expect("the cached 960 MiB were given back");
    common::fill::resize(&mut second, 100 * MIB, 2);
    assert!(second.iter().step_by(4096).all(|&b| b == 2));
    let s = local.stats();
    println!("{s}");
    assert_eq!(
        (s.pressure_retries, s.pressure_released_blocks),
        (1, 1),
        "{s}"
    );
    assert_eq!(
        (s.fallbacks.failed_allocations, s.cached_bytes()),
        (0, 0),
        "{s}"
    );
    println!("{CHILD_OK}");
}

/// Frees while the inner allocator (`System`) has nothing left: a free of the large path takes
/// no memory of its own, not even when it purges idle memory or releases a whole chunk.
fn free_child() {
    let purging = NumaGpuAlloc::new().cache_limit(0);
    let layout = Layout::from_size_align(2 * MIB, 64).unwrap();
    // SAFETY: non-zero sizes.
    let (a, b, c) = unsafe {
        (
            ALLOC.alloc(layout),
            purging.alloc(layout),
            purging.alloc(layout),
        )
    };
    assert!(!a.is_null() && !b.is_null() && !c.is_null());
    fill(a, layout.size(), 1);
    // Exhaust `System` under a limit just above what is mapped now.
    let mut held: Vec<*mut libc::c_void> = Vec::with_capacity(1 << 20);
    set_address_space_limit(vm_size() + 8 * MIB);
    for size in [1 << 16, 1 << 12, 1 << 6, 16] {
        // A failed malloc moves this thread to another of glibc's arenas (another thread's,
        // whose heap may still have room): only several failures in a row mean none has.
        let mut failures = 0;
        while failures < 8 {
            // SAFETY: malloc of a non-zero size; the result is checked.
            let p = unsafe { libc::malloc(size) };
            if p.is_null() {
                failures += 1;
                continue;
            }
            failures = 0;
            // Beyond the room reserved, the rest is left to the child's exit: until malloc says
            // no, however much free space glibc's heaps held.
            if held.len() < held.capacity() {
                held.push(p);
            }
        }
    }
    // SAFETY: malloc of a non-zero size. Through `black_box`: an optimiser may assume that a
    // malloc whose result is unused succeeded, and remove it.
    let probe = std::hint::black_box(unsafe { libc::malloc(16) });
    assert!(probe.is_null(), "System is exhausted");
    // SAFETY: allocated above with this layout, freed once each.
    unsafe {
        ALLOC.dealloc(a, layout);
        // Above a zero idle limit: purged at once; then its chunk is wholly free: released.
        purging.dealloc(b, layout);
        purging.dealloc(c, layout);
    }
    for p in held {
        // SAFETY: from malloc above, freed once.
        unsafe { libc::free(p) };
    }
    let s = purging.stats();
    assert_eq!(s.frees, 2, "{s}");
    assert!(
        s.nodes.iter().map(|n| n.purged_bytes).sum::<u64>() > 0,
        "purged on a free: {s}"
    );
    println!("{CHILD_OK}: freed with the inner allocator exhausted");
}

#[test]
fn frees_need_no_memory_of_the_inner_allocator() {
    if common::child::mode(CHILD_VAR).is_some() {
        return free_child();
    }
    let (stdout, stderr) = common::child::run(
        "frees_need_no_memory_of_the_inner_allocator",
        CHILD_VAR,
        "1",
        &[],
    );
    assert!(stdout.contains(CHILD_OK), "{stdout}\n{stderr}");
}

#[test]
fn idle_cache_is_given_back_when_the_address_space_runs_out() {
    if common::child::mode(CHILD_VAR).is_some() {
        return cache_child();
    }
    let (stdout, stderr) = common::child::run(
        "idle_cache_is_given_back_when_the_address_space_runs_out",
        CHILD_VAR,
        "1",
        &[],
    );
    assert!(stdout.contains(CHILD_OK), "{stdout}\n{stderr}");
}

#[test]
fn address_space_exhaustion_fails_cleanly() {
    if common::child::mode(CHILD_VAR).is_some() {
        return child();
    }
    let (stdout, stderr) = common::child::run(
        "address_space_exhaustion_fails_cleanly",
        CHILD_VAR,
        "1",
        &[],
    );
    assert!(stdout.contains(CHILD_OK), "{stdout}\n{stderr}");
}
