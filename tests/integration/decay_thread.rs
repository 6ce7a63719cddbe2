//! The decay thread gives idle memory back while the program allocates nothing large, releases
//! it through the same routine as `trim()` (so the stats count it), and reads the sysfs root of
//! the allocator that started it. Each test runs in a child process: the thread is the
//! process's, started once, with the first value's settings.

use std::alloc::Layout;
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;
use numa_gpu_alloc::NumaGpuAlloc;

use crate::common;

const CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_DECAY_CHILD";
const CHILD_OK: &str = "decay child: all checks passed";
/// A dedicated block (a mapping of its own, cached whole when freed).
const BLOCK: usize = 96 << 20;

/// Frees a populated dedicated block of `alloc` (so that it is cached), then waits up to `wait`
/// for the decay thread to release it, without another large request or `trim()`. Returns the
/// `released_blocks` the stats counted by then, over the count before the free (the block leaves
/// the cache before its release is counted: both are waited for).
fn released_by_decay(alloc: &NumaGpuAlloc, wait: Duration) -> u64 {
    let layout = Layout::from_size_align(BLOCK, 4096).unwrap();
    let block = alloc.allocate(layout).expect("a dedicated block");
    let before = alloc.stats().released_blocks;
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(block.cast(), layout) };
    assert!(
        alloc.stats().cached_bytes() >= BLOCK,
        "the freed block is cached"
    );
    let start = Instant::now();
    let released = || alloc.stats().released_blocks - before;
    while (alloc.stats().cached_bytes() >= BLOCK || released() == 0) && start.elapsed() < wait {
        std::thread::sleep(Duration::from_millis(10));
    }
    released()
}

fn counted_child() {
    // A chunk starts the thread; the block itself is dedicated.
    let alloc = NumaGpuAlloc::new().node(0).decay_ms(20);
    let small = Layout::from_size_align(4 << 20, 4096).unwrap();
    let chunk_block = alloc.allocate(small).unwrap();
    let released = released_by_decay(&alloc, Duration::from_secs(10));
    assert!(alloc.stats().cached_bytes() < BLOCK, "released within 10 s");
    assert!(
        released >= 1,
        "the decay thread's release is counted: {released}"
    );
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(chunk_block.cast(), small) };
    println!("{CHILD_OK}");
}

fn sysfs_root_child() {
    // Decay after a minute: only a node that its sysfs says runs low gives memory back sooner.
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/low-memory");
    let alloc = NumaGpuAlloc::new()
        .sysfs_root(root)
        .node(0)
        .decay_ms(60_000);
    let small = Layout::from_size_align(4 << 20, 4096).unwrap();
    let chunk_block = alloc.allocate(small).unwrap();
    let released = released_by_decay(&alloc, Duration::from_secs(5));
    assert!(
        released >= 1,
        "the decay thread read the fixture's low node 0, not this machine's: {released} released"
    );
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(chunk_block.cast(), small) };
    println!("{CHILD_OK}");
}

fn in_child(test: &str) {
    let (stdout, stderr) = common::child::run_test(module_path!(), test, CHILD_VAR);
    assert!(stdout.contains(CHILD_OK), "{stdout}\n{stderr}");
}

#[test]
fn the_decay_thread_releases_idle_blocks_and_counts_them() {
    if common::child::mode(CHILD_VAR).is_some() {
        return counted_child();
    }
    in_child("the_decay_thread_releases_idle_blocks_and_counts_them");
}

#[test]
fn the_decay_thread_reads_the_configured_sysfs_root() {
    if common::child::mode(CHILD_VAR).is_some() {
        return sysfs_root_child();
    }
    in_child("the_decay_thread_reads_the_configured_sysfs_root");
}
