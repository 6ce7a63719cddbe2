//! `NumaGpuAlloc<MiMalloc>` as the process's `#[global_allocator]` (its own binary: the global
//! allocator is per process): under threads, small requests, reallocs across the threshold both
//! ways and the allocator's own re-entrant requests are served and freed by mimalloc, large ones
//! by the arena. A pointer freed by the wrong one would crash the process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::c_void;

use mimalloc::MiMalloc;
use numa_gpu_alloc::NumaGpuAlloc;

mod common {
    pub mod pattern;
    pub mod workload;
}

const CACHE_LIMIT: usize = 256 << 20;

#[global_allocator]
static ALLOC: NumaGpuAlloc<MiMalloc> = NumaGpuAlloc::with_inner(MiMalloc).cache_limit(CACHE_LIMIT);

extern "C" {
    /// mimalloc's own test for "is this pointer in memory mimalloc manages" (linked in through
    /// the `mimalloc` crate's static library).
    fn mi_is_in_heap_region(p: *const c_void) -> bool;
}

fn owned_by_mimalloc(p: *const u8) -> bool {
    // SAFETY: a pure query on an address; mimalloc never dereferences it.
    unsafe { mi_is_in_heap_region(p.cast()) }
}

#[test]
fn threads_mixed_sizes_reallocs_and_contention() {
    common::workload::run_and_check(&ALLOC, CACHE_LIMIT);

    let small = vec![7u8; 1000];
    let large = vec![7u8; 8 << 20];
    assert!(
        owned_by_mimalloc(small.as_ptr()),
        "small requests go to mimalloc"
    );
    assert!(
        !owned_by_mimalloc(large.as_ptr()),
        "large ones to the arena"
    );
    let layout = Layout::from_size_align(1000, 8).unwrap();
    // SAFETY: a non-zero layout; freed below with the same one.
    let glibc = unsafe { System.alloc(layout) };
    assert!(
        !glibc.is_null() && !owned_by_mimalloc(glibc),
        "the check tells them apart"
    );
    // SAFETY: allocated above by System with this layout.
    unsafe { System.dealloc(glibc, layout) };
}
