//! Unit tests of the arena: carving from chunks (reuse at any size, populate and zero once,
//! decay, the idle limit, growth in place), pending blocks, the dedicated cache and its budget
//! (`dedicated_cache.rs`),
//! the forked child, and the accounting. Chunks are real mappings (nothing is populated: the
//! arena only plans that).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::pending::double::Flag;
use super::*;
use crate::chunk::{Mapping, Span};
use crate::stats::NodeStats;
use crate::sys::MemPolicy;

mod dedicated_cache;
mod planned;

pub(in crate::arena) use planned::{dedicated, planned, unmapped};

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
    assert_eq!(class_size(2 * MIB + 1, PAGE), Some(2 * MIB + 256 * 1024));
    assert_eq!(class_size(usize::MAX, PAGE), None);
}

const HUGE: HeapKey = HeapKey {
    kind: Kind {
        policy: MemPolicy::Preferred,
        pinned: false,
        flags: crate::cuda::RegisterFlags {
            devicemap: false,
            read_only: false,
        },
        lazy: false,
        verified: false,
    },
    huge: true,
    reserved: false,
};

fn arena() -> Arena {
    Arena::new(0)
}

/// An arena with one unpinned huge-page chunk of `len` bytes under `key`.
fn arena_with_chunk(key: HeapKey, len: usize) -> Arena {
    let mut arena = arena();
    let chunk = Chunk::new(
        Mapping::new(&crate::chunk::ANONYMOUS, len, CHUNK_ALIGN).unwrap(),
        2 * MIB,
    )
    .unwrap();
    assert!(arena.add_chunk(key, chunk).is_ok());
    arena
}

fn carve(arena: &mut Arena, size: usize) -> Carving {
    arena
        .carve(HUGE, size, PAGE, None)
        .expect("bookkeeping")
        .expect("room")
}

fn free(arena: &mut Arena, addr: usize, limit: usize) -> Released {
    let mut out = Released::default();
    let live = arena.remove_live(addr).expect("live");
    arena.free(live, limit, &mut out);
    out
}

/// What [`Arena::resize_carved`] answered: `None` (not resized), or the length it left to
/// populate, if any.
fn resized(arena: &mut Arena, addr: usize, size: usize) -> Option<Option<usize>> {
    arena
        .resize_carved(addr, size)
        .map(|populate| populate.map(|p| p.len()))
}

fn row(arena: &Arena) -> NodeStats {
    let mut row = NodeStats::default();
    arena.fill(&mut row);
    row
}

#[test]
fn freed_space_is_carved_again_at_any_size() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let big = carve(&mut arena, 15 * MIB).block;
    assert!(free(&mut arena, big.addr, usize::MAX).is_empty());
    // The freed 15 MiB merged back with the rest: a smaller block lands where it was.
    let small = carve(&mut arena, 3 * MIB).block;
    assert_eq!(small.addr, big.addr);
    let other = carve(&mut arena, 20 * MIB).block;
    assert_ne!(other.addr, small.addr);
    assert!(
        arena.carve(HUGE, 10 * MIB, PAGE, None).unwrap().is_none(),
        "full"
    );
    let stats = row(&arena);
    assert_eq!((stats.chunks, stats.live_blocks), (1, 2));
    assert_eq!(stats.live_bytes, 23 * MIB);
    assert_eq!(stats.cached_bytes, 9 * MIB);
}

#[test]
fn each_granule_is_populated_once_and_zeroed_only_when_dirty() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let first = carve(&mut arena, 4 * MIB);
    assert_eq!(first.populate.map(|s| s.len), Some(4 * MIB));
    assert!(first.dirty.is_none(), "fresh memory is zero");
    let _ = free(&mut arena, first.block.addr, usize::MAX);
    let again = carve(&mut arena, 3 * MIB);
    assert_eq!(again.block.addr, first.block.addr);
    assert!(again.populate.is_none(), "already resident");
    assert_eq!(
        again.dirty.map(|s| s.len),
        Some(3 * MIB),
        "handed out before"
    );
    assert_eq!(row(&arena).resident_bytes, 4 * MIB);
}

#[test]
fn idle_free_space_decays_and_is_populated_again_after() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let block = carve(&mut arena, 8 * MIB).block;
    let keep = carve(&mut arena, 2 * MIB).block;
    let _ = free(&mut arena, block.addr, usize::MAX);
    let mut out = Released::default();
    arena.decay(0, &mut out);
    let purged: Vec<Span> = out.purges.iter().map(|p| p.span).collect();
    assert_eq!(purged.iter().map(|s| s.len).sum::<usize>(), 8 * MIB);
    assert!(out.chunks.is_empty(), "a block is still live in the chunk");
    assert!(
        arena.carve(HUGE, 30 * MIB, PAGE, None).unwrap().is_none(),
        "held out while purged"
    );
    arena.purged(out.purges.drain().map(|p| (p, true)));
    let again = carve(&mut arena, 8 * MIB);
    assert_eq!(again.block.addr, block.addr);
    assert_eq!(again.populate.map(|s| s.len), Some(8 * MIB));
    assert!(again.dirty.is_none(), "purged memory is zero");
    let stats = row(&arena);
    assert_eq!(
        (stats.purged_bytes, stats.resident_bytes),
        (8 * MIB as u64, 10 * MIB)
    );
    let _ = keep;

    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let block = carve(&mut arena, 8 * MIB).block;
    let _ = free(&mut arena, block.addr, usize::MAX);
    let mut out = Released::default();
    arena.decay(u64::MAX, &mut out);
    assert!(out.is_empty(), "decay off");
}

#[test]
fn a_wholly_free_chunk_is_released_by_trim_and_by_the_idle_limit() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let block = carve(&mut arena, 4 * MIB).block;
    assert!(free(&mut arena, block.addr, usize::MAX).is_empty());
    let mut out = Released::default();
    assert!(arena.trim(&mut out));
    assert_eq!(out.chunks.iter().count(), 1);
    assert_eq!(row(&arena).chunks, 0);

    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let keep = carve(&mut arena, 4 * MIB).block;
    let block = carve(&mut arena, 4 * MIB).block;
    let mut out = free(&mut arena, block.addr, 0);
    let purged: usize = out.purges.iter().map(|p| p.span.len).sum();
    assert_eq!(
        purged,
        4 * MIB,
        "nothing idle may stay resident above a zero limit"
    );
    assert_eq!(row(&arena).resident_bytes, 4 * MIB, "the live block's");
    arena.purged(out.purges.drain().map(|p| (p, true)));
    let out = free(&mut arena, keep.addr, 0);
    assert_eq!(out.chunks.iter().count(), 1, "wholly free: released");
}

#[test]
fn a_carved_block_grows_into_its_free_neighbour_and_shrinks_in_place() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let block = carve(&mut arena, 4 * MIB).block;
    let populate = arena
        .resize_carved(block.addr, 10 * MIB)
        .expect("room after it");
    assert_eq!(populate.map(|s| s.len()), Some(6 * MIB));
    assert_eq!(row(&arena).live_bytes, 10 * MIB);
    assert_eq!(resized(&mut arena, block.addr, 6 * MIB), Some(None));
    assert_eq!(row(&arena).live_bytes, 6 * MIB);
    let next = carve(&mut arena, 26 * MIB).block;
    assert_eq!(next.addr, block.addr + 6 * MIB, "the tail was given back");
    assert_eq!(resized(&mut arena, block.addr, 7 * MIB), None, "no room");
}

/// A live carved block with unfinished work recorded through a pointer inside it.
fn live_in_use(arena: &mut Arena, size: usize) -> (Block, Arc<AtomicBool>) {
    let block = carve(arena, size).block;
    let (work, done) = Flag::unfinished();
    assert!(arena.record_in_flight(block.addr + MIB + 17, work).is_ok());
    (block, done)
}

#[test]
fn a_freed_block_in_use_is_not_carved_again_before_its_work_completed() {
    let mut arena = arena_with_chunk(HUGE, 8 * MIB);
    let (block, done) = live_in_use(&mut arena, 8 * MIB);
    let _ = free(&mut arena, block.addr, usize::MAX);
    let mut out = Released::default();
    arena.settle_pending(usize::MAX, &mut out);
    assert!(arena.carve(HUGE, 4 * MIB, PAGE, None).unwrap().is_none());
    assert!(arena.pending_fits(Fit::new(4 * MIB, 4 * MIB, PAGE, HUGE.kind)));
    assert!(
        arena.trim(&mut out) && out.chunks.is_empty(),
        "trim skips it"
    );
    assert_eq!(
        (row(&arena).pending_blocks, row(&arena).pending_bytes),
        (1, 8 * MIB)
    );
    done.store(true, Ordering::Release);
    arena.settle_pending(usize::MAX, &mut out);
    assert_eq!(carve(&mut arena, 4 * MIB).block.addr, block.addr);
}

#[test]
fn work_is_recorded_only_inside_a_live_block() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let block = carve(&mut arena, 4 * MIB).block;
    let dedicated = arena
        .insert_dedicated(dedicated(0, 4 * MIB, false))
        .unwrap();
    for addr in [
        block.addr - 1,
        block.addr + 4 * MIB,
        0,
        dedicated.addr + 4 * MIB,
    ] {
        assert!(
            arena.record_in_flight(addr, Flag::unfinished().0).is_err(),
            "{addr:#x}"
        );
    }
    for addr in [block.addr + 4 * MIB - 1, dedicated.addr + MIB] {
        assert!(arena.record_in_flight(addr, Flag::unfinished().0).is_ok());
    }
}

#[test]
fn a_forked_child_never_carves_page_locked_chunks() {
    let pinned = HeapKey {
        kind: Kind {
            pinned: true,
            ..HUGE.kind
        },
        ..HUGE
    };
    let mut arena = arena_with_chunk(pinned, 32 * MIB);
    assert!(arena.carve(pinned, 4 * MIB, PAGE, None).unwrap().is_some());
    arena.enter_child();
    assert!(arena.carve(pinned, 4 * MIB, PAGE, None).unwrap().is_none());
    let mut out = Released::default();
    assert!(arena.trim(&mut out));
    assert!(
        out.chunks.is_empty(),
        "the parent's registration stays mapped"
    );
}

#[test]
fn live_blocks_are_counted_per_node_and_gpu() {
    let mut arena = Arena::new(1);
    let for_gpu = |offset, gpu, pinned| {
        let mut d = dedicated(offset, 4 * MIB, pinned);
        d.block.routed_for = gpu;
        d.block.node = 1;
        d
    };
    for d in [
        for_gpu(0x100_0000, Some(3), true),
        for_gpu(0x200_0000, Some(1), false),
        for_gpu(0x300_0000, Some(3), false),
        for_gpu(0x400_0000, None, false),
    ] {
        assert!(arena.insert_dedicated(d).is_ok());
    }
    assert!(arena.remove_live(planned(0x300_0000)).is_some());
    assert!(arena.remove_live(planned(0x300_0000)).is_none());
    let rows: Vec<_> = arena
        .gpus()
        .iter()
        .map(|g| {
            (
                g.ordinal,
                g.node,
                g.live_blocks,
                g.live_bytes,
                g.pinned_bytes,
            )
        })
        .collect();
    assert_eq!(rows, [(1, 1, 1, 4 * MIB, 0), (3, 1, 1, 4 * MIB, 4 * MIB)]);
    assert_eq!(arena.gpus()[1].peak_live_bytes, 8 * MIB);
    let stats = row(&arena);
    assert_eq!(
        (stats.live_bytes, stats.peak_live_bytes, stats.live_blocks),
        (12 * MIB, 16 * MIB, 3)
    );
    arena.reset_peak();
    assert_eq!(arena.gpus()[1].peak_live_bytes, 4 * MIB);
}

/// Decay with age 0 that really purges what it hands out (the chunk's memory is real).
fn purge_now(arena: &mut Arena) {
    let mut out = Released::default();
    arena.clock.next_decay = 0;
    arena.decay(0, &mut out);
    let done: Vec<bool> = out
        .purges
        .iter()
        // SAFETY: taken out of the carver for this: unused, unpinned.
        .map(|p| unsafe { crate::chunk::purge(p.source, p.span) }.is_ok())
        .collect();
    arena.purged(out.purges.drain().zip(done));
}

/// Populates a span the arena planned (the chunk's memory is real).
fn populate(span: Option<Span>) {
    if let Some(s) = span {
        // SAFETY: a span of a chunk of this arena, planned for the block the test holds.
        unsafe { crate::sys::populate(s.ptr().unwrap(), s.len) }.unwrap();
    }
}

/// Whether `byte` at `addr` would reach a zeroed request whose dirty span is `dirty`.
fn zeroed_would_see(addr: usize, dirty: Option<Span>) -> u8 {
    let covered = dirty.is_some_and(|d| d.addr <= addr && addr < d.addr + d.len);
    // SAFETY: inside a populated block of the test's chunk.
    let byte = unsafe { (addr as *const u8).read_volatile() };
    if covered {
        0
    } else {
        byte
    }
}

#[test]
fn a_failed_populate_never_loses_what_may_hold_old_data() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let pad = carve(&mut arena, 2 * MIB);
    populate(pad.populate);
    let x = carve(&mut arena, 4 * MIB);
    populate(x.populate);
    // SAFETY: x is ours and populated.
    unsafe { (x.block.addr as *mut u8).write_volatile(0xAA) };
    let gap = carve(&mut arena, 20 * MIB).block;
    let _keep = carve(&mut arena, 2 * MIB);
    let _ = free(&mut arena, gap.addr, usize::MAX);
    let _ = free(&mut arena, pad.block.addr, usize::MAX);
    purge_now(&mut arena);
    let _ = free(&mut arena, x.block.addr, usize::MAX);
    let b = carve(&mut arena, 8 * MIB).block;
    // Its populate fails (ENOMEM, a memory limit, a misplaced page under policy=bind).
    arena.populate_failed(b);
    purge_now(&mut arena);
    let c = carve(&mut arena, 8 * MIB);
    assert_eq!(c.block.addr, b.addr);
    populate(c.populate);
    assert_eq!(zeroed_would_see(x.block.addr, c.dirty), 0);
}

#[test]
fn a_neighbour_in_a_shared_granule_keeps_its_data_and_dirt() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let b = carve(&mut arena, 3 * MIB);
    let c = carve(&mut arena, 3 * MIB);
    let _keep = carve(&mut arena, 2 * MIB);
    populate(c.populate);
    // SAFETY: c is ours; its page faults in if not populated.
    unsafe { (c.block.addr as *mut u8).write_volatile(0xCC) };
    // B's populate, planned first, never writes into C's part of the granule they share.
    populate(b.populate);
    // SAFETY: as above.
    assert_eq!(unsafe { (c.block.addr as *const u8).read_volatile() }, 0xCC);
    arena.populate_failed(b.block);
    let _ = free(&mut arena, c.block.addr, usize::MAX);
    purge_now(&mut arena);
    let z = carve(&mut arena, 6 * MIB);
    populate(z.populate);
    assert_eq!(zeroed_would_see(c.block.addr, z.dirty), 0);
}

#[test]
fn a_failed_purge_keeps_the_range_dirty() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let x = carve(&mut arena, 4 * MIB);
    let _keep = carve(&mut arena, 2 * MIB);
    populate(x.populate);
    // SAFETY: x is ours and populated; locked, MADV_DONTNEED refuses it (EINVAL).
    let locked = unsafe {
        (x.block.addr as *mut u8).write_bytes(0xAA, 4 * MIB);
        libc::mlock(x.block.addr as *const libc::c_void, 4 * MIB) == 0
    };
    let _ = free(&mut arena, x.block.addr, usize::MAX);
    purge_now(&mut arena);
    let z = carve(&mut arena, 4 * MIB);
    let seen = zeroed_would_see(z.block.addr, z.dirty);
    // SAFETY: locked above.
    unsafe { libc::munlock(x.block.addr as *const libc::c_void, 4 * MIB) };
    assert!(locked, "mlock of 4 MiB");
    assert_eq!(seen, 0, "a zeroed request would see old data");
}

#[test]
fn pinned_free_space_does_not_count_against_the_idle_limit() {
    let pinned = HeapKey {
        kind: Kind {
            pinned: true,
            ..HUGE.kind
        },
        ..HUGE
    };
    let mut arena = arena();
    let mut chunk = Chunk::new(
        Mapping::new(&crate::chunk::ANONYMOUS, 32 * MIB, CHUNK_ALIGN).unwrap(),
        2 * MIB,
    )
    .unwrap();
    // What registration does to the bits: all resident.
    let _ = chunk.plan_populate(chunk.base(), chunk.len());
    assert!(arena.add_chunk(pinned, chunk).is_ok());
    let _keep = arena.carve(pinned, 2 * MIB, PAGE, None).unwrap().unwrap();
    let block = arena
        .insert_dedicated(dedicated(0, 8 * MIB, false))
        .unwrap();
    let live = arena.remove_live(block.addr).unwrap();
    let mut out = Released::default();
    arena.free(live, 16 * MIB, &mut out);
    assert_eq!(
        out.blocks.iter().count(),
        0,
        "8 MiB under a 16 MiB limit stays cached"
    );
}

#[test]
fn a_block_with_gpu_work_does_not_shrink_in_place() {
    let mut arena = arena_with_chunk(HUGE, 32 * MIB);
    let (block, done) = live_in_use(&mut arena, 8 * MIB);
    assert_eq!(
        resized(&mut arena, block.addr, 4 * MIB),
        None,
        "its tail may be in use"
    );
    done.store(true, Ordering::Release);
    assert_eq!(resized(&mut arena, block.addr, 4 * MIB), Some(None));
}

#[test]
fn ranges_whose_purge_failed_are_not_offered_again() {
    let small = HeapKey {
        huge: false,
        ..HUGE
    };
    let mut arena = arena();
    let chunk = Chunk::new(
        Mapping::new(&crate::chunk::ANONYMOUS, 32 * MIB, CHUNK_ALIGN).unwrap(),
        PAGE,
    )
    .unwrap();
    assert!(arena.add_chunk(small, chunk).is_ok());
    let carve_small = |arena: &mut Arena| {
        let carving = arena.carve(small, 64 << 10, PAGE, None).unwrap().unwrap();
        carving.block
    };
    let blocks: Vec<Block> = (0..40).map(|_| carve_small(&mut arena)).collect();
    // 20 free ranges between live blocks: more than one round of purges.
    for block in blocks.iter().step_by(2) {
        assert!(free(&mut arena, block.addr, usize::MAX).is_empty());
    }
    // trim() as the runtime loops it, every purge failing (locked memory).
    let (mut rounds, mut tried) = (0, 0);
    loop {
        let mut out = Released::default();
        let done = arena.trim(&mut out);
        tried += out.purges.iter().count();
        let _ = arena.purged(out.purges.drain().map(|p| (p, false)));
        rounds += 1;
        if done || rounds == 100 {
            break;
        }
    }
    assert_eq!((rounds, tried), (2, 20), "each range tried once");
    let stats = row(&arena);
    assert_eq!(stats.purged_bytes, 0, "nothing was purged");
    assert_eq!(stats.resident_bytes, 40 * (64 << 10));
    assert_eq!(
        arena.releasable(Shortage::Memory),
        0,
        "nothing to give back"
    );
    assert_eq!(
        arena.releasable(Shortage::AddressSpace),
        32 * MIB - 20 * (64 << 10)
    );
    let mut out = Released::default();
    arena.clock.next_decay = 0;
    arena.decay(0, &mut out);
    assert!(out.is_empty(), "decay leaves them alone too");
    // A block freed beside two of them: the merged range is worth a purge again.
    let _ = free(&mut arena, blocks[1].addr, usize::MAX);
    assert_eq!(arena.releasable(Shortage::Memory), 3 * (64 << 10));
    arena.clock.next_decay = 0;
    arena.decay(0, &mut out);
    let spans: Vec<usize> = out.purges.iter().map(|p| p.span.len).collect();
    assert_eq!(spans, [3 * (64 << 10)]);
    let _ = arena.purged(out.purges.drain().map(|p| (p, true)));
    assert_eq!(row(&arena).purged_bytes, 3 * (64 << 10) as u64);
}
