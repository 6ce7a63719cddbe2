//! The dedicated cache: its limit evicts the oldest first, its budget keeps the footprint within
//! the live peak and an eighth, and a forked child releases page-locked blocks.

use super::*;

/// An arena whose live bytes once reached `peak` (so that its budget allows a cache that
/// large), as if blocks had been handed out and freed.
fn arena_that_held(peak: usize) -> Arena {
    let mut arena = arena();
    arena.peak_in_use = peak;
    // The room live dedicated blocks would have reserved.
    assert!(arena.dedicated.cached.reserve(8));
    arena
}

fn fit(size: usize, pinned: bool) -> Fit {
    let kind = Kind {
        pinned,
        ..Kind::default()
    };
    Fit::new(size, class_size(size, PAGE).unwrap(), PAGE, kind)
}

fn released_blocks(out: &mut Released) -> Vec<Block> {
    out.blocks.drain().map(|d| d.block).collect()
}

#[test]
fn the_dedicated_cache_limit_evicts_oldest_first() {
    let mut arena = arena_that_held(1 << 40);
    let mut out = Released::default();
    let mut made = Vec::new();
    for i in 1..=3 {
        let d = dedicated(i << 30, 640 * MIB, true);
        made.push(d.block);
        arena.dedicated.note_created(&d.block);
        arena.cache(d, 1280 * MIB, &mut out);
    }
    assert_eq!(released_blocks(&mut out), [made[0]]);
    let stats = row(&arena);
    assert_eq!(
        (stats.cached_bytes, stats.pinned_bytes),
        (1280 * MIB, 1280 * MIB)
    );
    let big = dedicated(4 << 30, 2000 * MIB, true);
    let big_block = big.block;
    arena.dedicated.note_created(&big_block);
    arena.cache(big, 1280 * MIB, &mut out);
    assert_eq!(
        released_blocks(&mut out),
        [big_block],
        "over the limit alone"
    );
    assert_eq!(
        arena.take_cached(fit(640 * MIB, true)).map(|d| d.block),
        Some(made[2])
    );
    assert!(
        arena.take_cached(fit(640 * MIB, false)).is_none(),
        "another kind"
    );
}

#[test]
fn the_dedicated_cache_never_grows_the_footprint_beyond_the_live_peak_and_an_eighth() {
    // A Vec grown by doubling: each step allocates the next size, then frees the last.
    let mut arena = arena();
    let mut out = Released::default();
    let mut previous: Option<Block> = None;
    let mut released = 0;
    // Each next size at its own place: 0, 1 GiB, 2 GiB, 4 GiB.
    for (offset, mib) in [(0, 512), (1, 1024), (2, 2048), (4, 4096)] {
        let made = dedicated(offset << 30, mib * MIB, false);
        let next = arena.insert_created(made, usize::MAX, &mut out).unwrap();
        if let Some(old) = previous.replace(next) {
            let live = arena.remove_live(old.addr).unwrap();
            arena.free(live, usize::MAX, &mut out);
        }
        released += released_blocks(&mut out)
            .iter()
            .map(|b| b.capacity)
            .sum::<usize>();
        let footprint = arena.live.bytes() + arena.dedicated.cached.bytes();
        assert!(footprint <= arena.peak_in_use * 9 / 8, "{mib} MiB step");
    }
    assert_eq!(arena.dedicated.cached.bytes(), 2048 * MIB);
    assert_eq!(released, (512 + 1024) * MIB);
}

#[test]
fn a_forked_child_releases_page_locked_dedicated_blocks() {
    let mut arena = arena_that_held(1 << 40);
    let mut out = Released::default();
    let (pinned, plain) = (
        dedicated(1 << 30, 640 * MIB, true),
        dedicated(2 << 30, 640 * MIB, false),
    );
    let (pinned_block, plain_block) = (pinned.block, plain.block);
    for d in [pinned, plain] {
        arena.dedicated.note_created(&d.block);
        arena.cache(d, usize::MAX, &mut out);
    }
    arena.enter_child();
    arena.settle_pending(usize::MAX, &mut out);
    assert_eq!(released_blocks(&mut out), [pinned_block]);
    assert_eq!(
        arena.take_cached(fit(640 * MIB, false)).map(|d| d.block),
        Some(plain_block)
    );
    assert_eq!(row(&arena).pinned_bytes, 0);
}

#[test]
fn a_freed_dedicated_block_is_released_once() {
    let mut arena = arena_that_held(1 << 40);
    let block = arena
        .insert_dedicated(dedicated(5 << 30, 640 * MIB, false))
        .unwrap();
    let live = arena.remove_live(block.addr).unwrap();
    let mut out = Released::default();
    // A cache limit of 0 evicts it at once.
    arena.free(live, 0, &mut out);
    assert!(arena.remove_live(block.addr).is_none(), "freed twice");
    let before = unmapped();
    out.finish(None, &crate::stats::Counters::default());
    assert_eq!(unmapped() - before, 1, "unmapped once");
    assert!(
        arena.trim(&mut out) && out.is_empty(),
        "nothing left to release"
    );
}

#[test]
fn a_new_block_first_evicts_what_it_would_leave_beyond_the_live_peak() {
    // A program's phases: each held one large block of its own size, freed at the phase's end.
    let mut arena = arena_that_held(200 * MIB);
    let mut out = Released::default();
    let mut phases = Vec::new();
    for (offset, mib) in [(0, 64), (1, 96)] {
        let d = dedicated(offset << 30, mib * MIB, false);
        phases.push(d.block);
        arena.cache(d, usize::MAX, &mut out);
    }
    assert!(released_blocks(&mut out).is_empty(), "within the budget");
    // A small new block leaves room for both.
    arena.make_room(16 * MIB, usize::MAX, &mut out);
    assert!(released_blocks(&mut out).is_empty(), "reuse still fits");
    // The next phase's 144 MiB: with it live, 225 MiB (the peak and an eighth) leave 81 for the
    // cache, so both old blocks go before it is mapped, oldest first.
    arena.make_room(144 * MIB, usize::MAX, &mut out);
    assert_eq!(released_blocks(&mut out), phases);
    assert_eq!(arena.dedicated.cached.bytes(), 0);
}
