//! Unit tests of the arena: size classes, reuse bounds, eviction, the cache budget, pending
//! blocks and the forked child.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::pending::double::Flag;
use super::*;

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

#[test]
fn classes_waste_at_most_an_eighth() {
    let mut size = 2 * MIB;
    while size < 512 * MIB {
        let class = class_size(size, PAGE).unwrap();
        assert!(class >= size);
        assert!((class - size) * 8 <= size, "size {size} class {class}");
        assert_eq!(class % PAGE, 0);
        size += 12_345 * 7;
    }
}

#[test]
fn class_examples() {
    assert_eq!(class_size(2 * MIB, PAGE), Some(2 * MIB));
    assert_eq!(class_size(2 * MIB + 1, PAGE), Some(2 * MIB + 256 * 1024));
    assert_eq!(class_size(3 * MIB, PAGE), Some(3 * MIB));
    assert_eq!(class_size(100, PAGE), Some(PAGE));
    assert_eq!(class_size(usize::MAX, PAGE), None);
}

fn block(addr: usize, capacity: usize, pinned: bool) -> Block {
    Block {
        addr,
        capacity,
        pinned,
    }
}

/// An arena whose live bytes once reached `peak` (so that its budget allows a cache that
/// large), as if blocks had been handed out and freed.
fn arena_that_held(peak: usize) -> Arena {
    let mut arena = Arena::new(&NumaTopology::single_node(), 0);
    arena.peak_in_use = peak;
    arena
}

/// The fit of a request of `size` bytes, as the allocator computes it.
fn fit(size: usize, align: usize) -> Fit {
    Fit::new(size, class_size(size, PAGE).unwrap(), align)
}

#[test]
fn reuse_needs_covering_capacity_and_alignment() {
    let mut arena = arena_that_held(1 << 40);
    let mut evicted = Vec::new();
    arena.cache(block(0x20_0000, 4 * MIB, false), usize::MAX, &mut evicted);
    assert_eq!(arena.take_cached(fit(5 * MIB, PAGE)), None, "too small");
    assert_eq!(arena.take_cached(fit(2 * MIB, PAGE)), None, "too wasteful");
    assert_eq!(arena.take_cached(fit(4 * MIB, 1 << 30)), None, "misaligned");
    assert_eq!(
        arena.take_cached(fit(4 * MIB - PAGE, 2 * MIB)),
        Some(block(0x20_0000, 4 * MIB, false))
    );
    assert_eq!(arena.cached.bytes(), 0);
}

#[test]
fn reuse_wastes_at_most_an_eighth_of_the_request() {
    let mut arena = arena_that_held(1 << 40);
    let mut evicted = Vec::new();
    // 2.5 MiB is one class above 2 MiB + 1 B (class 2.25 MiB): 25% over the request.
    arena.cache(
        block(0x20_0000, 2 * MIB + MIB / 2, false),
        usize::MAX,
        &mut evicted,
    );
    assert_eq!(arena.take_cached(fit(2 * MIB + 1, PAGE)), None);
    // 2.5 MiB for 2.25 MiB + 1 B is within 1/8 of the request although its class is 2.5 MiB.
    assert!(arena
        .take_cached(fit(2 * MIB + MIB / 4 + 1, PAGE))
        .is_some());
    let mut size = 4 * PAGE;
    while size < 64 * MIB {
        let f = fit(size, PAGE);
        assert!((f.most - size) * 8 <= size, "size {size} bound {}", f.most);
        size = size * 9 / 8 + 4321;
    }
}

#[test]
fn cache_limit_evicts_oldest_first() {
    let mut arena = arena_that_held(1 << 40);
    let mut evicted = Vec::new();
    for i in 1..=3 {
        let b = block(i * 0x1000_0000, 4 * MIB, true);
        arena.note_created(&b);
        arena.cache(b, 8 * MIB, &mut evicted);
    }
    assert_eq!(evicted, [block(0x1000_0000, 4 * MIB, true)]);
    let mut nodes = vec![NodeStats::default()];
    arena.fill(&mut nodes);
    assert_eq!(nodes[0].cached_bytes, 8 * MIB);
    assert_eq!(nodes[0].pinned_bytes, 8 * MIB);
    assert_eq!(nodes[0].cached_blocks, 2);
    let big = block(0x4000_0000, 16 * MIB, true);
    arena.note_created(&big);
    evicted.clear();
    arena.cache(big, 8 * MIB, &mut evicted);
    assert_eq!(
        evicted,
        [big],
        "a block over the limit leaves the others cached"
    );
    arena.fill(&mut nodes);
    assert_eq!(
        (nodes[0].cached_blocks, nodes[0].pinned_bytes),
        (2, 8 * MIB)
    );
    assert_eq!(arena.drain_cached().len(), 2);
    arena.fill(&mut nodes);
    assert_eq!((nodes[0].cached_bytes, nodes[0].pinned_bytes), (0, 0));
}

#[test]
fn memory_is_given_back_oldest_first_and_only_as_much_as_asked() {
    let mut arena = arena_that_held(1 << 40);
    let mut evicted = Vec::new();
    let blocks = [(1, 4), (2, 2), (3, 8), (4, 2)].map(|(i, mib)| block(i << 30, mib * MIB, true));
    for b in blocks {
        arena.note_created(&b);
        arena.cache(b, usize::MAX, &mut evicted);
    }
    assert_eq!(arena.release_oldest(5 * MIB), blocks[..2]);
    assert_eq!(arena.release_oldest(0), []);
    assert_eq!(arena.release_oldest(usize::MAX), blocks[2..]);
    let mut nodes = vec![NodeStats::default()];
    arena.fill(&mut nodes);
    assert_eq!((nodes[0].cached_bytes, nodes[0].pinned_bytes), (0, 0));
}

/// A live 4 MiB pinned block at `addr`, with work recorded through a pointer inside it.
fn live_in_use(arena: &mut Arena, addr: usize) -> Arc<AtomicBool> {
    let b = block(addr, 4 * MIB, true);
    arena.note_created(&b);
    arena.insert_live(b);
    let (work, done) = Flag::unfinished();
    assert!(arena.record_in_flight(addr + MIB + 17, work).is_ok());
    done
}

#[test]
fn a_freed_block_in_use_is_not_reused_before_its_work_completed() {
    let mut arena = arena_that_held(1 << 40);
    let mut evicted = Vec::new();
    let done = live_in_use(&mut arena, 0x40_0000);
    let (block, work) = arena.remove_live(0x40_0000).unwrap();
    arena.free(block, work, usize::MAX, &mut evicted);
    arena.settle_pending(usize::MAX, &mut evicted);
    assert_eq!(
        arena.take_cached(fit(4 * MIB, PAGE)),
        None,
        "reused while in flight"
    );
    assert!(arena.pending_fits(fit(4 * MIB, PAGE)));
    let mut nodes = vec![NodeStats::default()];
    arena.fill(&mut nodes);
    assert_eq!(
        (nodes[0].pending_blocks, nodes[0].pending_bytes),
        (1, 4 * MIB)
    );
    assert_eq!(nodes[0].pinned_bytes, 4 * MIB);

    done.store(true, Ordering::Release);
    arena.settle_pending(usize::MAX, &mut evicted);
    assert_eq!(arena.take_cached(fit(4 * MIB, PAGE)), Some(block));
    assert!(evicted.is_empty());
}

#[test]
fn work_is_recorded_only_inside_a_live_block() {
    let topo = NumaTopology::single_node();
    let mut arena = Arena::new(&topo, 0);
    arena.insert_live(block(0x40_0000, 4 * MIB, false));
    for addr in [0x40_0000 - 1, 0x40_0000 + 4 * MIB, 0] {
        assert!(
            arena.record_in_flight(addr, Flag::unfinished().0).is_err(),
            "{addr:#x}"
        );
    }
    assert!(arena
        .record_in_flight(0x40_0000 + 4 * MIB - 1, Flag::unfinished().0)
        .is_ok());
}

#[test]
fn pending_bytes_count_against_the_limit_and_are_never_evicted() {
    let mut arena = arena_that_held(1 << 40);
    let mut evicted = Vec::new();
    arena.cache(block(0x1000_0000, 4 * MIB, false), 8 * MIB, &mut evicted);
    let first = live_in_use(&mut arena, 0x2000_0000);
    let second = live_in_use(&mut arena, 0x3000_0000);
    for addr in [0x2000_0000, 0x3000_0000] {
        let (block, work) = arena.remove_live(addr).unwrap();
        arena.free(block, work, 8 * MIB, &mut evicted);
    }
    assert_eq!(
        evicted,
        [block(0x1000_0000, 4 * MIB, false)],
        "ready blocks go first"
    );
    assert_eq!(arena.drain_cached(), [], "trim skips blocks in flight");
    first.store(true, Ordering::Release);
    assert_eq!(arena.drain_cached(), [block(0x2000_0000, 4 * MIB, true)]);
    let pending = arena.drain_pending();
    assert_eq!(pending.len(), 1);
    assert!(
        !second.load(Ordering::Acquire),
        "draining does not wait: the caller does"
    );
    let mut nodes = vec![NodeStats::default()];
    arena.fill(&mut nodes);
    assert_eq!((nodes[0].pending_bytes, nodes[0].pinned_bytes), (0, 0));
}

#[test]
fn a_block_over_the_limit_waits_for_its_work_before_eviction() {
    let mut arena = arena_that_held(1 << 40);
    let mut evicted = Vec::new();
    let done = live_in_use(&mut arena, 0x2000_0000);
    let (block, work) = arena.remove_live(0x2000_0000).unwrap();
    arena.free(block, work, 2 * MIB, &mut evicted);
    assert!(evicted.is_empty(), "a block in flight is never released");
    done.store(true, Ordering::Release);
    arena.settle_pending(2 * MIB, &mut evicted);
    assert_eq!(evicted, [block]);
}

#[test]
fn a_forked_child_releases_page_locked_blocks_instead_of_reusing_them() {
    let mut arena = arena_that_held(1 << 40);
    let mut evicted = Vec::new();
    let (pinned, plain) = (
        block(0x100_0000, 4 * MIB, true),
        block(0x200_0000, 4 * MIB, false),
    );
    for b in [pinned, plain] {
        arena.note_created(&b);
        arena.cache(b, usize::MAX, &mut evicted);
    }
    arena.enter_child();
    arena.settle_pending(usize::MAX, &mut evicted);
    assert_eq!(evicted, [pinned]);
    assert_eq!(arena.take_cached(fit(4 * MIB, PAGE)), Some(plain));
    let live = block(0x300_0000, 4 * MIB, true);
    arena.note_created(&live);
    arena.insert_live(live);
    let (freed, work) = arena.remove_live(live.addr).unwrap();
    arena.free(freed, work, usize::MAX, &mut evicted);
    assert_eq!(
        evicted,
        [pinned, live],
        "freed in the child: released, not cached"
    );
    let mut nodes = vec![NodeStats::default()];
    arena.fill(&mut nodes);
    assert_eq!((nodes[0].cached_blocks, nodes[0].pinned_bytes), (0, 0));
}

#[test]
fn the_cache_never_grows_the_footprint_beyond_the_live_peak_and_an_eighth() {
    // A Vec grown by doubling: each step allocates the next size, then frees the last.
    let mut arena = Arena::new(&NumaTopology::single_node(), 0);
    let mut evicted = Vec::new();
    let mut previous: Option<Block> = None;
    for (i, mib) in [2, 4, 8, 16, 32].into_iter().enumerate() {
        let next = block((i + 1) << 30, mib * MIB, false);
        arena.insert_created(next, usize::MAX, &mut evicted);
        if let Some(old) = previous.replace(next) {
            let (old, work) = arena.remove_live(old.addr).unwrap();
            arena.free(old, work, usize::MAX, &mut evicted);
        }
        let footprint = arena.live_bytes() + arena.cached.bytes();
        assert!(footprint <= arena.peak_in_use * 9 / 8, "{mib} MiB step");
    }
    // Only the last smaller size stays; the older ones were given back as the live set grew.
    assert_eq!(arena.cached.bytes(), 16 * MIB);
    let released: usize = evicted.iter().map(|b| b.capacity).sum();
    assert_eq!(released, (2 + 4 + 8) * MIB);
    // Reuse of what was live at once is untouched: freeing everything keeps it all.
    let (last, work) = arena.remove_live(previous.unwrap().addr).unwrap();
    arena.free(last, work, usize::MAX, &mut evicted);
    assert_eq!(arena.cached.bytes(), 48 * MIB);
    assert_eq!(arena.take_cached(fit(32 * MIB, PAGE)), Some(last));
}

#[test]
fn live_accounting_and_peak() {
    let topo = NumaTopology::two_node(20);
    let mut arena = Arena::new(&topo, 1);
    arena.insert_live(block(0x1000, 4 * MIB, false));
    arena.insert_live(block(0x2000, 2 * MIB, false));
    assert_eq!(
        arena.remove_live(0x1000).map(|b| b.0.capacity),
        Some(4 * MIB)
    );
    assert!(arena.remove_live(0x1000).is_none());
    let mut nodes = vec![
        NodeStats {
            node: 0,
            ..NodeStats::default()
        },
        NodeStats {
            node: 1,
            ..NodeStats::default()
        },
    ];
    arena.fill(&mut nodes);
    assert_eq!(nodes[0].live_bytes, 0);
    assert_eq!(nodes[1].live_bytes, 2 * MIB);
    assert_eq!(nodes[1].peak_live_bytes, 6 * MIB);
    assert_eq!(nodes[1].live_blocks, 1);
}
