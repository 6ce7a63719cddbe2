//! Unit tests of the front end over the process's arenas: stream-ordered reuse, growth, frees
//! through any value, per-thread routes.

use std::sync::atomic::Ordering;

use super::*;
use crate::arena::class_size;
use crate::arena::pending_double::Flag;
use crate::{Error, GpuSelector, PinMode};

mod from_cache;
mod inside;

const BLOCK: usize = 256 << 10;

/// Serialises the unit tests that allocate large blocks (here, in `blocks/reserve.rs` and `blocks/tests.rs`), which
/// share the process's arenas (one switches stream-ordered reuse off process-wide under
/// `fault-injection`), and releases what earlier ones cached. Each test frees what it allocates
/// and completes the work it records.
pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = SWITCH
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let alloc = allocator();
    let _ = alloc.placement();
    alloc.trim();
    guard
}

/// An allocator whose large path starts at 64 KiB, never pinning.
fn allocator() -> NumaGpuAlloc {
    NumaGpuAlloc::new().threshold(64 << 10).pin(PinMode::Off)
}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 8).unwrap()
}

fn pending_blocks(alloc: &NumaGpuAlloc) -> usize {
    alloc.stats().nodes.iter().map(|n| n.pending_blocks).sum()
}

/// Frees a block with unfinished work, then allocates the same size: the address it gets,
/// and the switch that finishes the work.
fn reuse_while_in_flight(
    alloc: &NumaGpuAlloc,
) -> (
    *mut u8,
    *mut u8,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let first = alloc.allocate(layout(BLOCK), false);
    assert!(!first.is_null());
    let (work, done) = Flag::unfinished();
    // A pointer into the middle, as `record_stream` on a sub-slice passes.
    assert!(alloc
        .record_in_flight(first.wrapping_add(1000), work)
        .is_ok());
    // SAFETY: allocated above with this layout, not used afterwards.
    unsafe { alloc.deallocate(first, layout(BLOCK)) };
    (first, alloc.allocate(layout(BLOCK), false), done)
}

#[test]
fn a_block_with_gpu_work_is_reused_only_after_it_completed() {
    let _serial = serial();
    let alloc = allocator();
    let (first, second, done) = reuse_while_in_flight(&alloc);
    assert_ne!(second, first, "reused while the GPU may still use it");
    let stats = alloc.stats();
    // The chunk had room elsewhere: nothing was deferred.
    assert_eq!((stats.in_flight_recorded, stats.reuse_deferred), (1, 0));
    assert_eq!(pending_blocks(&alloc), 1);

    done.store(true, Ordering::Release);
    let third = alloc.allocate(layout(BLOCK), false);
    assert_eq!(third, first);
    let stats = alloc.stats();
    assert_eq!(
        stats.nodes.iter().map(|n| n.pending_bytes).sum::<usize>(),
        0
    );
    assert_eq!((stats.cache_hits, stats.cache_misses), (2, 1));
    for ptr in [second, third] {
        // SAFETY: live blocks of this layout, freed once.
        unsafe { alloc.deallocate(ptr, layout(BLOCK)) };
    }
}

#[test]
fn a_realloc_that_moves_leaves_the_old_block_pending() {
    let _serial = serial();
    let alloc = allocator();
    let old = alloc.allocate(layout(BLOCK), false);
    // Carved right after it: `old` cannot grow in place.
    let neighbour = alloc.allocate(layout(BLOCK), false);
    assert_eq!(neighbour as usize, old as usize + BLOCK);
    let (work, done) = Flag::unfinished();
    assert!(alloc.record_in_flight(old, work).is_ok());
    // SAFETY: `old` is live with this layout.
    let moved = unsafe { alloc.reallocate(old, layout(BLOCK), layout(4 * BLOCK)) };
    assert!(!moved.is_null() && moved != old);
    let other = alloc.allocate(layout(BLOCK), false);
    assert_ne!(other, old);
    done.store(true, Ordering::Release);
    let again = alloc.allocate(layout(BLOCK), false);
    assert_eq!(again, old);
    // SAFETY: live blocks of these layouts, freed once.
    unsafe {
        alloc.deallocate(moved, layout(4 * BLOCK));
        alloc.deallocate(other, layout(BLOCK));
        alloc.deallocate(again, layout(BLOCK));
        alloc.deallocate(neighbour, layout(BLOCK));
    }
}

#[test]
fn work_outside_every_live_block_is_given_back() {
    let _serial = serial();
    let alloc = allocator();
    let (work, _) = Flag::unfinished();
    let work = alloc
        .record_in_flight(ptr::null(), work)
        .expect_err("not initialised");
    let live = alloc.allocate(layout(BLOCK), false);
    let outside = live.wrapping_add(class_size(BLOCK, 4096).unwrap());
    // Nothing else is live (the tests are serial and free what they allocate).
    assert!(alloc.record_in_flight(outside, work).is_err());
    assert_eq!(alloc.stats().in_flight_recorded, 0);
    // SAFETY: a live block of this layout.
    unsafe { alloc.deallocate(live, layout(BLOCK)) };
}

#[test]
fn a_dropped_value_leaves_its_blocks_to_the_others() {
    let _serial = serial();
    let (owner, other) = (allocator(), allocator());
    let _ = other.placement();
    let (first, second, done) = reuse_while_in_flight(&owner);
    let live = owner.allocate(layout(4 * BLOCK), false);
    drop(owner);
    assert_eq!(pending_blocks(&other), 1, "still pending, not waited for");
    // SAFETY: live blocks of the dropped value, freed once through another one.
    unsafe {
        other.deallocate(second, layout(BLOCK));
        other.deallocate(live, layout(4 * BLOCK));
    }
    let stats = other.stats();
    assert_eq!((stats.frees, stats.live_bytes()), (2, 0));
    assert_eq!(stats.fallbacks.foreign_frees, 0);
    done.store(true, Ordering::Release);
    let reused = [BLOCK, BLOCK, 4 * BLOCK].map(|size| other.allocate(layout(size), false));
    assert!(reused.contains(&first) && reused.contains(&second) && reused.contains(&live));
    assert_eq!(other.stats().cache_hits, 3);
    for (ptr, size) in reused.into_iter().zip([BLOCK, BLOCK, 4 * BLOCK]) {
        // SAFETY: live blocks of these layouts, freed once.
        unsafe { other.deallocate(ptr, layout(size)) };
    }
}

#[test]
fn a_carved_block_grows_and_shrinks_in_place() {
    let _serial = serial();
    let alloc = allocator();
    let small = alloc.allocate(layout(BLOCK), false);
    // SAFETY: a live block of BLOCK bytes.
    unsafe { ptr::write_bytes(small, 0xa5, BLOCK) };
    // SAFETY: `small` is live with this layout; the chunk is free after it.
    let grown = unsafe { alloc.reallocate(small, layout(BLOCK), layout(4 * BLOCK)) };
    assert_eq!(grown, small, "grown into the free range after it");
    // SAFETY: the grown block is 4 × BLOCK long; its head holds the old bytes.
    let bytes = unsafe { std::slice::from_raw_parts(grown, 4 * BLOCK) };
    assert!(bytes[..BLOCK].iter().all(|&b| b == 0xa5));
    let stats = alloc.stats();
    assert_eq!((stats.in_place_reallocs, stats.grown_without_copy), (1, 0));
    assert_eq!(stats.live_bytes(), 4 * BLOCK);
    // SAFETY: live with this layout.
    let shrunk = unsafe { alloc.reallocate(grown, layout(4 * BLOCK), layout(BLOCK)) };
    assert_eq!(shrunk, small);
    assert_eq!(alloc.stats().live_bytes(), BLOCK, "the tail went back");
    let next = alloc.allocate(layout(BLOCK), false);
    assert_eq!(next as usize, small as usize + BLOCK);
    // SAFETY: live with these layouts.
    unsafe {
        alloc.deallocate(shrunk, layout(BLOCK));
        alloc.deallocate(next, layout(BLOCK));
    }
}

/// Blocks too large to carve grow by moving their pages (`mremap`), without a copy.
#[test]
fn growing_a_dedicated_block_moves_its_pages_and_leaves_nothing_behind() {
    let _serial = serial();
    let alloc = allocator();
    let size = crate::arena::DEDICATED_MIN;
    let small = alloc.allocate(layout(size), false);
    // SAFETY: a live block of `size` bytes.
    unsafe { ptr::write_bytes(small, 0xa5, 4096) };
    // SAFETY: `small` is live with this layout.
    let grown = unsafe { alloc.reallocate(small, layout(size), layout(2 * size)) };
    assert!(!grown.is_null());
    // SAFETY: the grown block is 2 × size long; its head holds the old bytes.
    let bytes = unsafe { std::slice::from_raw_parts(grown, 2 * size) };
    assert!(bytes[..4096].iter().all(|&b| b == 0xa5));
    assert!(
        bytes[size..].iter().step_by(4096).all(|&b| b == 0),
        "a fresh tail"
    );
    let stats = alloc.stats();
    assert_eq!(stats.grown_without_copy, 1);
    assert_eq!(
        (stats.cached_bytes(), stats.live_bytes()),
        (0, class_size(2 * size, 4096).unwrap())
    );
    // SAFETY: live with this layout.
    unsafe { alloc.deallocate(grown, layout(2 * size)) };
}

/// A block grown by doubling a second time finds the block it grew into the first time, cached:
/// it moves into it at its first doubling and grows in place after, mapping nothing new.
#[test]
fn a_block_grown_again_grows_inside_the_block_cached_last_time() {
    let _serial = serial();
    let alloc = allocator();
    let grow = |round: u8| {
        let mut size = 16 << 20;
        let mut block = alloc.allocate(layout(size), false);
        assert!(!block.is_null());
        while size < 128 << 20 {
            // SAFETY: `block` is live with this layout.
            block = unsafe { alloc.reallocate(block, layout(size), layout(2 * size)) };
            assert!(!block.is_null());
            // SAFETY: the grown block is 2 × size long.
            unsafe { ptr::write_bytes(block.add(size), round, size) };
            size *= 2;
        }
        // SAFETY: live with this layout.
        unsafe { alloc.deallocate(block, layout(size)) };
    };
    grow(1);
    let before = alloc.stats();
    grow(2);
    let after = alloc.stats();
    assert_eq!(
        (
            after.cache_misses - before.cache_misses,
            after.cache_hits - before.cache_hits,
            after.in_place_reallocs - before.in_place_reallocs,
        ),
        // Hits: the 16 MiB block (carved where the first one was) and the cached 128 MiB block.
        (0, 2, 2),
        "(misses, hits, in place) of the second growth from 16 to 128 MiB"
    );
}

/// Kernel mappings (`/proc/self/maps` lines) that overlap `addr..addr+len`.
fn mappings_over(addr: usize, len: usize) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|line| {
            let (start, end) = line.split_whitespace().next()?.split_once('-')?;
            let start = usize::from_str_radix(start, 16).ok()?;
            let end = usize::from_str_radix(end, 16).ok()?;
            Some(start < addr + len && addr < end)
        })
        .filter(|&overlaps| overlaps)
        .count()
}

/// A carved block with a neighbour after it, grown by doubling, moves once, by copying, into a
/// mapping of its own; every doubling after that moves its pages, as a `Vec` would, though the
/// sizes are carved ones. Faulted in where touched, it grows in one `mremap` and stays one kernel
/// mapping, so this holds on any kernel; populated up front, its populated tail is a second
/// mapping, which kernels before 6.17 cannot move with the first: every other doubling copies.
#[test]
fn a_doubling_block_is_copied_once_then_moves_its_pages() {
    let _serial = serial();
    for eager in [false, true] {
        let alloc = allocator().populate_eager(eager);
        let mut size = 4 << 20;
        let mut block = alloc.allocate(layout(size), false);
        // Carved after it: no room to grow in place.
        let neighbour = alloc.allocate(layout(size), false);
        // SAFETY: a live block of `size` bytes.
        unsafe { ptr::write_bytes(block, 0x5a, size) };
        let before = alloc.stats();
        while size < 32 << 20 {
            // SAFETY: `block` is live with this layout.
            block = unsafe { alloc.reallocate(block, layout(size), layout(2 * size)) };
            assert!(!block.is_null());
            // SAFETY: the grown block is 2 × size long; the new half is the caller's to write.
            unsafe { ptr::write_bytes(block.add(size), 0x5a, size) };
            size *= 2;
        }
        // SAFETY: the block is `size` bytes long and was written whole.
        let bytes = unsafe { std::slice::from_raw_parts(block, size) };
        assert!(
            bytes.iter().step_by(4096).all(|&b| b == 0x5a),
            "contents kept"
        );
        let stats = alloc.stats();
        // 4 to 32 MiB: three doublings, the first a copy.
        let moved = if !eager || crate::sys::moves_several_mappings() {
            2
        } else {
            1
        };
        assert_eq!(
            (
                stats.grown_without_copy - before.grown_without_copy,
                stats.in_place_reallocs - before.in_place_reallocs
            ),
            (moved, 0),
            "eager {eager}: one copy, then pages moved"
        );
        if !eager {
            assert_eq!(mappings_over(block as usize, size), 1, "one kernel mapping");
        }
        // SAFETY: live with these layouts.
        unsafe {
            alloc.deallocate(block, layout(size));
            alloc.deallocate(neighbour, layout(4 << 20));
        }
        alloc.trim();
    }
}

#[test]
fn a_block_freed_through_any_value_returns_to_its_nodes_arena() {
    let _serial = serial();
    let (owner, other, fresh) = (allocator(), allocator(), allocator());
    let _ = other.placement();
    for through in [&other, &fresh] {
        let block = owner.allocate(layout(BLOCK), false);
        // SAFETY: a live block of `owner`, freed once (through another value).
        unsafe { through.deallocate(block, layout(BLOCK)) };
        let stats = owner.stats();
        assert_eq!(stats.live_bytes(), 0);
        let mapped: usize = stats.nodes.iter().map(|n| n.mapped_bytes).sum();
        assert_eq!(
            stats.cached_bytes(),
            mapped,
            "all of the chunk is free again"
        );
        // The freed space serves the other value's request.
        let again = through.allocate(layout(BLOCK), false);
        assert_eq!(again, block);
        // SAFETY: live with this layout.
        unsafe { owner.deallocate(again, layout(BLOCK)) };
    }
    assert_eq!((other.stats().frees, fresh.stats().frees), (1, 1));
    assert_eq!(owner.stats().frees, 2);
    assert_eq!(other.stats().fallbacks.foreign_frees, 0);
}

#[test]
fn a_thread_bound_to_a_node_uses_that_nodes_arena() {
    let _serial = serial();
    let alloc = allocator();
    let host = alloc.placement().host_node;
    let explicit = allocator().node(host);
    let bound = std::thread::scope(|s| {
        s.spawn(|| {
            let _bound = crate::bind_thread(crate::Route::Node(host));
            assert_eq!(crate::thread_route(), Some(crate::Route::Node(host)));
            let ptr = alloc.allocate(layout(BLOCK), false);
            let row = alloc.stats().nodes.into_iter().find(|n| n.node == host);
            assert_eq!(row.map(|r| r.live_blocks), Some(1));
            ptr as usize
        })
        .join()
        .unwrap()
    });
    assert_eq!(
        crate::thread_route(),
        None,
        "bound on the other thread only"
    );
    // Freed on this (unbound) thread, through a value with an explicit target: back to the
    // node's arena, where the explicit value finds it.
    // SAFETY: live with this layout.
    unsafe { explicit.deallocate(bound as *mut u8, layout(BLOCK)) };
    let again = explicit.allocate(layout(BLOCK), false);
    assert_eq!(again as usize, bound);
    // SAFETY: live with this layout.
    unsafe { alloc.deallocate(again, layout(BLOCK)) };
}

/// The switch the simulator tests use: with it, the same sequence reuses the block at once.
#[cfg(feature = "fault-injection")]
#[test]
fn ignoring_in_flight_work_reuses_early() {
    let _serial = serial();
    let alloc = allocator();
    crate::sys::fault::ignore_in_flight(true);
    let (first, second, _) = reuse_while_in_flight(&alloc);
    crate::sys::fault::ignore_in_flight(false);
    assert_eq!(first, second);
    // SAFETY: live with this layout.
    unsafe { alloc.deallocate(second, layout(BLOCK)) };
}

#[test]
fn pin_strict_never_takes_an_unpinned_cached_block() {
    let _serial = serial();
    // A node target has no GPU: nothing can be page-locked for it, whatever the driver.
    let host = allocator().placement().host_node;
    let [off, on, strict] =
        [PinMode::Off, PinMode::On, PinMode::Strict].map(|pin| allocator().node(host).pin(pin));
    let blocks = [&off, &on].map(|value| (value, value.allocate(layout(BLOCK), false)));
    for (value, block) in blocks {
        assert!(!block.is_null());
        // SAFETY: live with this layout, freed once.
        unsafe { value.deallocate(block, layout(BLOCK)) };
    }
    let cached = off.stats().cached_bytes();
    let mapped: usize = off.stats().nodes.iter().map(|n| n.mapped_bytes).sum();
    assert_eq!(cached, mapped, "both chunks' space is free");
    for _ in 0..2 {
        let got = strict.allocate(layout(BLOCK), false);
        if !got.is_null() {
            // SAFETY: live with this layout, freed once.
            unsafe { strict.deallocate(got, layout(BLOCK)) };
        }
        assert!(got.is_null(), "pin=strict handed out an unpinned block");
    }
    let stats = strict.stats();
    assert_eq!(stats.cache_hits, 0, "{stats}");
    assert_eq!(stats.fallbacks.failed_allocations, 2, "{stats}");
    assert_eq!(stats.fallbacks.strict_refused, 2, "{stats}");
    assert!(
        matches!(
            stats.last_pin_error,
            Some(Error::StrictPinning { driver: None, .. })
        ),
        "{stats}"
    );
    assert_eq!(stats.cached_bytes(), cached, "the unpinned chunks stay");
}

/// A failed populate, then a trim: a later zeroed request still gets zeros.
#[cfg(feature = "fault-injection")]
#[test]
fn zeroed_memory_is_zero_after_a_failed_populate() {
    use crate::sys::fault;
    let _serial = serial();
    let alloc = allocator().decay_ms(u64::MAX).decay_thread(false);
    let l = |mib: usize| layout(mib << 20);
    let [pad, x, gap, keep] = [2, 4, 20, 2].map(|mib| alloc.allocate(l(mib), false));
    // SAFETY: x is live and 4 MiB long; the others are freed with their layouts, once.
    unsafe {
        x.write_bytes(0xAA, 4 << 20);
        alloc.deallocate(gap, l(20));
        alloc.deallocate(pad, l(2));
        alloc.trim();
        alloc.deallocate(x, l(4));
    }
    fault::inject(fault::FaultPoint::Populate, libc::ENOMEM, 2);
    let failed = alloc.allocate(l(8), true);
    fault::clear();
    alloc.trim();
    let z = alloc.allocate(l(8), true);
    // SAFETY: z is live and 8 MiB long.
    let nonzero = unsafe { std::slice::from_raw_parts(z, 8 << 20) }
        .iter()
        .filter(|&&b| b != 0)
        .count();
    // SAFETY: live blocks of these layouts, freed once.
    unsafe {
        if !failed.is_null() {
            alloc.deallocate(failed, l(8));
        }
        alloc.deallocate(z, l(8));
        alloc.deallocate(keep, l(2));
    }
    assert_eq!(nonzero, 0, "a zeroed block held old data");
}

/// Idle free space is looked at after carving: the range that fits is not held out to purge
/// while a new chunk is mapped beside it.
#[test]
fn decay_never_holds_out_the_room_a_request_needs() {
    let _serial = serial();
    let alloc = allocator().decay_ms(20).decay_thread(false);
    let chunks = || -> usize { alloc.stats().nodes.iter().map(|n| n.chunks).sum() };
    let [a, k] = [24, 8].map(|mib| alloc.allocate(layout(mib << 20), false));
    let before = chunks();
    // SAFETY: live with this layout, freed once.
    unsafe { alloc.deallocate(a, layout(24 << 20)) };
    std::thread::sleep(std::time::Duration::from_millis(60));
    let b = alloc.allocate(layout(24 << 20), false);
    let after = chunks();
    // SAFETY: live blocks of these layouts, freed once.
    unsafe {
        alloc.deallocate(b, layout(24 << 20));
        alloc.deallocate(k, layout(8 << 20));
    }
    assert_eq!(
        before, after,
        "a chunk was mapped although the idle range fits"
    );
}

/// Blocks that are not page-locked say why, each cause with its own error: in the placement, at
/// the head of the stats table, and when a `PinnedBuf` is asked of the allocator.
#[test]
fn an_allocator_that_does_not_pin_says_why() {
    let _serial = serial();
    let off = allocator();
    let placement = off.placement();
    assert!(!placement.pinning);
    assert_eq!(placement.pinning_off, Some(Error::PinningOff));
    let text = off.stats().to_string();
    assert!(text.contains(", pinning off (pin=off)\n"), "{text}");
    #[cfg(feature = "pinned-buffer")]
    assert_eq!(
        crate::PinnedBuf::<u8>::zeroed(&off, 1).err(),
        Some(Error::PinningOff)
    );
    let node = allocator().node(placement.host_node).pin(PinMode::On);
    assert_eq!(node.placement().pinning_off, Some(Error::NodeTarget));
    let missing = allocator().pin(PinMode::On).gpu(GpuSelector::Ordinal(99));
    let why = missing.placement().pinning_off;
    match crate::cuda::probe_error() {
        Some(driver) => {
            assert_eq!(why, Some(Error::DriverUnusable { driver }));
            let text = missing.stats().to_string();
            assert!(text.contains(", pinning off: CUDA unusable ("), "{text}");
            #[cfg(feature = "pinned-buffer")]
            assert_eq!(
                crate::PinnedBuf::<u8>::zeroed(&missing, 1).err(),
                Some(Error::DriverUnusable { driver })
            );
        }
        None => assert!(
            matches!(&why, Some(Error::GpuNotFound { selector, .. }) if selector == "99"),
            "{why:?}"
        ),
    }
}

/// `unpinned` counts blocks that pinning was asked for and could not have; a default (`pin=off`)
/// allocator shows none, so that a correct setup does not read as degraded.
#[test]
fn a_default_allocator_counts_no_unpinned_fallback() {
    let _serial = serial();
    let dedicated = 64 << 20;
    let host = allocator().placement().host_node;
    // A node target has no GPU to pin for: asked to pin, its new mapping is a fallback.
    let on = allocator().node(host).pin(PinMode::On);
    let block = on.allocate(layout(dedicated), false);
    assert!(!block.is_null());
    // SAFETY: live with this layout, freed once.
    unsafe { on.deallocate(block, layout(dedicated)) };
    assert_eq!(on.stats().fallbacks.unpinned_blocks, 1, "{}", on.stats());
    on.trim();
    let default = NumaGpuAlloc::new().threshold(64 << 10);
    for size in [BLOCK, dedicated] {
        let block = default.allocate(layout(size), false);
        assert!(!block.is_null());
        // SAFETY: live with this layout, freed once.
        unsafe { default.deallocate(block, layout(size)) };
    }
    let stats = default.stats();
    assert_eq!(stats.fallbacks.unpinned_blocks, 0, "{stats}");
    assert!(stats.to_string().contains(", unpinned 0,"), "{stats}");
}

/// Process-wide settings are the first initialiser's: a later value with another sysfs root
/// (a fixture tree) resolves its own target from its own tree, and shares the one large path
/// (topology for the workers, cpuset, limits, page size, chunk source) made before it.
#[test]
fn values_share_the_large_path_of_the_first_initialiser() {
    let _serial = serial();
    let first = allocator();
    let fixture = allocator()
        .sysfs_root(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/sparse"
        ))
        .node(2);
    let _inside = crate::guard::Inside::enter();
    let (a, b) = (first.runtime(), fixture.runtime());
    assert!(
        std::ptr::eq(a.blocks.process(), b.blocks.process()),
        "one large path per process"
    );
    assert_eq!(
        b.placement().host_node,
        2,
        "the value's own tree decides its target"
    );
}
