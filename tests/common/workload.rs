//! The workload of the `#[global_allocator]` tests: threads allocating mixed sizes, reallocating
//! across the threshold both ways, and contending for one arena, unbound and bound to routes;
//! then the checks on the allocator's counters. It needs the allocator under test to be the process's global one (with
//! the default 2 MiB threshold), and nothing else in the process to allocate large blocks.

use std::alloc::GlobalAlloc;
use std::sync::Barrier;

use numa_gpu_alloc::{bind_thread, Error, NumaGpuAlloc, Route};

use super::pattern::{check, fill};

const MIB: usize = 1 << 20;
const THRESHOLD: usize = 2 * MIB;

fn sizes(thread: usize) -> Vec<usize> {
    vec![
        64,
        4096 + thread,
        THRESHOLD - 1,
        THRESHOLD,
        THRESHOLD + 1,
        3 * MIB + thread * 4096,
        10 * MIB + thread,
        24 * MIB,
    ]
}

fn mixed_workload(thread: usize) {
    for round in 0..6u8 {
        let seed = (thread as u8).wrapping_mul(31).wrapping_add(round);
        let mut held: Vec<Vec<u8>> = Vec::new();
        for size in sizes(thread) {
            let mut v = vec![0u8; size];
            fill(&mut v, seed);
            held.push(v);
        }
        // Grow across the threshold (small → large) and shrink back (large → small).
        let mut grow = vec![0u8; 512 * 1024];
        fill(&mut grow, seed);
        grow.reserve_exact(4 * MIB);
        check(&grow, seed);
        grow.resize(5 * MIB, 0);
        fill(&mut grow, seed);
        grow.truncate(100_000);
        grow.shrink_to_fit();
        grow.push(seed ^ 0x5a);
        check(&grow, seed);
        for v in &held {
            check(v, seed);
        }
    }
}

/// Many threads freeing and allocating the same size hammer one arena lock, so its sleeping path
/// runs, and the arena's maps allocate under the guard.
fn contended_reuse(barrier: &Barrier) {
    barrier.wait();
    for i in 0..200u32 {
        let mut v = vec![0u8; 4 * MIB];
        v[0] = i as u8;
        v[4 * MIB - 1] = !(i as u8);
        std::hint::black_box(&mut v);
        assert_eq!((v[0], v[4 * MIB - 1]), (i as u8, !(i as u8)));
    }
}

/// Runs the workload on threads, then checks `alloc`'s counters (its cache limit is
/// `cache_limit`).
pub fn run_and_check<A: GlobalAlloc>(alloc: &NumaGpuAlloc<A>, cache_limit: usize) {
    let before = alloc.stats();
    assert!(!before.initialized || before.live_bytes() == 0);

    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || mixed_workload(t));
        }
    });
    let barrier = Barrier::new(8);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| contended_reuse(&barrier));
        }
    });

    // Threads bound to routes contend too: node 0, the local node, and a node id no machine has
    // (the nearest node with memory instead, reported once in `config_errors`).
    let routes = [Route::Node(0), Route::LocalNode, Route::Node(1023)];
    let barrier = Barrier::new(6);
    std::thread::scope(|s| {
        for t in 0..6 {
            let (barrier, route) = (&barrier, routes[t % 3]);
            s.spawn(move || {
                let _bound = bind_thread(route);
                contended_reuse(barrier);
            });
        }
    });

    let stats = alloc.stats();
    println!("{stats}");
    let unknown = |e: &Error| matches!(e, Error::UnknownNode { node: 1023, .. });
    assert_eq!(stats.config_errors.iter().filter(|e| unknown(e)).count(), 1);
    assert!(stats.initialized);
    assert_eq!(stats.live_bytes(), 0, "every large block was freed");
    assert_eq!(
        stats.cache_hits + stats.cache_misses,
        stats.large_allocations
    );
    assert!(stats.large_allocations >= 14 * 200);
    assert!(
        stats.cache_hits > stats.cache_misses,
        "freed blocks are reused"
    );
    assert!(stats.frees >= stats.large_allocations - stats.in_place_reallocs);
    // The limit bounds idle memory that stays resident (free space of chunks may stay mapped).
    let resident: usize = stats.nodes.iter().map(|n| n.resident_bytes).sum();
    assert!(
        resident - stats.live_bytes() <= cache_limit,
        "cache limit holds: {stats}"
    );
    assert_eq!(stats.fallbacks.failed_allocations, 0);
    assert_eq!(stats.host_node, Some(alloc.placement().host_node));
}
