//! `NumaGpuAlloc` through allocator-api2 (0.4 and hashbrown's 0.2), with local instances.
//!
//! The instances share the process's per-node arenas, whose rows the stats show: each test holds
//! [`serial`] and frees what it allocates.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard, PoisonError};

use allocator_api2::alloc::Allocator;
use allocator_api2::boxed::Box;
use allocator_api2::vec::Vec;
use numa_gpu_alloc::{MemPolicy, NumaGpuAlloc};

use crate::common::bytes::all_bytes_are;
use crate::common::fill::resize;

const MIB: usize = 1 << 20;

/// Runs the tests one at a time, each starting with empty caches and peaks at what is live.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let alloc = NumaGpuAlloc::new();
    let _ = alloc.placement();
    alloc.trim();
    alloc.reset_peaks();
    guard
}

#[test]
fn vec_grows_and_shrinks_across_the_threshold() {
    let _serial = serial();
    let alloc = NumaGpuAlloc::new().node(0);
    let mut v: Vec<u64, _> = Vec::new_in(&alloc);
    for i in 0..(1u64 << 20) {
        v.push(i); // 8 MiB by the end: small → large on the way
    }
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64));
    v.truncate(1000);
    v.shrink_to_fit(); // large → small: the data moves
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64));
    drop(v);
    let stats = alloc.stats();
    assert!(stats.large_allocations > 0);
    assert_eq!(stats.live_bytes(), 0);
    assert_eq!(stats.host_node, Some(0));
}

#[test]
fn boxes_zero_sizes_and_huge_alignment() {
    let _serial = serial();
    let alloc = NumaGpuAlloc::new();
    let small = Box::new_in(42u32, &alloc);
    assert_eq!(*small, 42);
    let zeroed = Box::<[u8], _>::new_zeroed_slice_in(16 * MIB, &alloc);
    // SAFETY: zeroed bytes are valid u8s.
    let zeroed = unsafe { zeroed.assume_init() };
    assert!(all_bytes_are(&zeroed, 0));

    let empty = Layout::from_size_align(0, 64).unwrap();
    let p = alloc.allocate(empty).unwrap();
    assert_eq!(p.len(), 0);
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(p.cast(), empty) };

    for align in [4096, 2 * MIB, 1 << 30] {
        let layout = Layout::from_size_align(4 * MIB, align).unwrap();
        let p = alloc.allocate(layout).unwrap();
        assert_eq!(p.cast::<u8>().as_ptr() as usize % align, 0, "align {align}");
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(p.cast(), layout) };
    }
}

#[test]
fn zeroed_reuse_of_a_dirty_cached_block_is_zero() {
    let _serial = serial();
    // A carved block, and a dedicated one (a mapping of its own, cached whole).
    for size in [6 * MIB, 96 * MIB] {
        let alloc = NumaGpuAlloc::new();
        let layout = Layout::from_size_align(size, 8).unwrap();
        let p = alloc.allocate(layout).unwrap().cast::<u8>();
        // SAFETY: the block is ours and `size` long.
        unsafe { std::ptr::write_bytes(p.as_ptr(), 0xaa, size) };
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(p, layout) };
        let hits = alloc.stats().cache_hits;
        let q = alloc.allocate_zeroed(layout).unwrap().cast::<u8>();
        assert_eq!(q, p, "the cached block of {size} bytes is reused");
        assert_eq!(alloc.stats().cache_hits, hits + 1);
        // SAFETY: the block is ours and `size` long.
        let bytes = unsafe { std::slice::from_raw_parts(q.as_ptr(), size) };
        assert!(all_bytes_are(bytes, 0), "{size} bytes");
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(q, layout) };
    }
}

/// Bytes of `len` at `p` that are resident (`mincore`).
fn resident(p: NonNull<u8>, len: usize) -> usize {
    let page = numa_gpu_alloc::unstable::sys::page_size();
    let mut pages = vec![0u8; len.div_ceil(page)];
    // SAFETY: the range is a live block of ours (whole pages: blocks start on a page); `pages`
    // has one entry per page.
    let rc = unsafe { libc::mincore(p.as_ptr().cast(), len, pages.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore of {len} bytes at {p:p}");
    pages.iter().filter(|&&v| v & 1 != 0).count() * page
}

#[test]
fn unpinned_blocks_not_asked_zeroed_are_populated_and_zeroed_ones_take_memory_where_touched() {
    let _serial = serial();
    // A carved block and a dedicated one, handed out fresh (after trim) and again from the cache
    // for a zeroed request: after every byte was written, and after one byte was.
    for size in [8 * MIB, 96 * MIB] {
        for eager in [false, true] {
            let alloc = NumaGpuAlloc::new().populate_eager(eager);
            alloc.trim();
            // Without placement the bound workers place pages by populating them: eager always.
            let populated = eager || !alloc.placement().numa_placement;
            let layout = Layout::from_size_align(size, 4096).unwrap();
            let zeroed_again = |p: NonNull<u8>| {
                // SAFETY: allocated with this layout.
                unsafe { alloc.deallocate(p, layout) };
                let q = alloc.allocate_zeroed(layout).unwrap().cast::<u8>();
                assert_eq!(q, p, "the freed block of {size} bytes is reused");
                q
            };
            let all_zero = |q: NonNull<u8>| {
                // SAFETY: the block is ours and `size` long.
                let bytes = unsafe { std::slice::from_raw_parts(q.as_ptr(), size) };
                assert!(all_bytes_are(bytes, 0), "{size} bytes, eager {eager}");
                // SAFETY: allocated with this layout.
                unsafe { alloc.deallocate(q, layout) };
            };
            // Not asked zeroed: written whole, so populated in bulk either way.
            let p = alloc.allocate(layout).unwrap().cast::<u8>();
            assert_eq!(resident(p, size), size, "{size} bytes not asked zeroed");
            // SAFETY: the block is ours and `size` long.
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0xaa, size) };
            let q = zeroed_again(p);
            assert_eq!(
                resident(q, size),
                size,
                "written whole: written over where it lies"
            );
            all_zero(q);
            alloc.trim();
            // Asked zeroed: faulted in where touched, unless eager.
            let p = alloc.allocate_zeroed(layout).unwrap().cast::<u8>();
            let fresh = resident(p, size);
            // SAFETY: inside the block.
            unsafe { p.as_ptr().add(size / 2).write(0xaa) };
            let q = zeroed_again(p);
            let reused = resident(q, size);
            if populated {
                assert_eq!((fresh, reused), (size, size), "{size} bytes, eager");
            } else {
                assert_eq!(fresh, 0, "{size} bytes handed out zeroed, lazy");
                // At most a huge page at each end of the block, and the one written.
                assert!(
                    reused <= 6 * MIB,
                    "{size} bytes barely touched, reused zeroed: {reused} resident"
                );
            }
            all_zero(q);
        }
    }
}

/// A value that faults pages in where touched shares the node's arenas with one that populates
/// and one that checks pages: neither gets a block of the first one's memory unpopulated.
#[test]
fn a_lazy_values_freed_memory_serves_no_value_that_populates() {
    let _serial = serial();
    for size in [8 * MIB, 96 * MIB] {
        let layout = Layout::from_size_align(size, 4096).unwrap();
        let lazy = NumaGpuAlloc::new();
        if !lazy.placement().numa_placement {
            return; // without placement every block is populated
        }
        let p = lazy.allocate(layout).unwrap();
        // SAFETY: allocated above with this layout, untouched.
        unsafe { lazy.deallocate(p.cast(), layout) };
        let eager = NumaGpuAlloc::new().populate_eager(true);
        let q = eager.allocate(layout).unwrap().cast::<u8>();
        assert_eq!(
            resident(q, size),
            size,
            "{size} bytes populated for the eager value"
        );
        // SAFETY: allocated above with this layout.
        unsafe { eager.deallocate(q, layout) };
        let lazy_again = lazy.allocate(layout).unwrap();
        let checked = NumaGpuAlloc::new().verify(true);
        let r = checked.allocate(layout).unwrap().cast::<u8>();
        assert_eq!(
            checked.stats().pages_checked,
            (size / 4096) as u64,
            "{size} bytes checked"
        );
        // SAFETY: allocated above with this layout.
        unsafe {
            checked.deallocate(r, layout);
            lazy.deallocate(lazy_again.cast(), layout);
        }
    }
}

/// Reserved room stays resident: a zeroed block from it is written, its pages not given back.
#[test]
fn zeroed_reuse_of_reserved_room_keeps_it_resident() {
    let _serial = serial();
    let alloc = NumaGpuAlloc::new().node(0);
    alloc.reserve_bytes(64 * MIB).unwrap();
    let layout = Layout::from_size_align(16 * MIB, 4096).unwrap();
    let p = alloc.allocate(layout).unwrap().cast::<u8>();
    // SAFETY: the block is ours and 16 MiB long.
    unsafe { std::ptr::write_bytes(p.as_ptr(), 0xaa, 16 * MIB) };
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(p, layout) };
    let q = alloc.allocate_zeroed(layout).unwrap().cast::<u8>();
    assert_eq!(q, p, "the reserved room is carved again");
    assert_eq!(resident(q, 16 * MIB), 16 * MIB, "still resident");
    // SAFETY: the block is ours and 16 MiB long.
    let bytes = unsafe { std::slice::from_raw_parts(q.as_ptr(), 16 * MIB) };
    assert!(all_bytes_are(bytes, 0));
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(q, layout) };
}

#[test]
fn grow_in_place_within_capacity_and_move_beyond() {
    let _serial = serial();
    let alloc = NumaGpuAlloc::new();
    let old = Layout::from_size_align(2 * MIB + 1, 8).unwrap(); // capacity 2.25 MiB
    let p = alloc.allocate(old).unwrap().cast::<u8>();
    // SAFETY: ours, at least old.size() long.
    unsafe { p.as_ptr().write(7) };
    let within = Layout::from_size_align(2 * MIB + 200_000, 8).unwrap();
    // SAFETY: p is live with `old`; within.size() >= old.size().
    let q = unsafe { alloc.grow(p, old, within) }.unwrap().cast::<u8>();
    assert_eq!(q, p, "grown in place");
    let beyond = Layout::from_size_align(9 * MIB, 8).unwrap();
    // SAFETY: q is live with `within`.
    let r = unsafe { alloc.grow(q, within, beyond) }
        .unwrap()
        .cast::<u8>();
    // SAFETY: r is live and at least one byte long.
    assert_eq!(unsafe { r.as_ptr().read() }, 7);
    assert_eq!(r, q, "grown into the free space after it");
    // Beyond what the chunk has after it: moved.
    let farther = Layout::from_size_align(100 * MIB, 8).unwrap();
    // SAFETY: r is live with `beyond`.
    let s = unsafe { alloc.grow(r, beyond, farther) }
        .unwrap()
        .cast::<u8>();
    assert_ne!(s, r, "moved");
    // SAFETY: s is live and at least one byte long.
    assert_eq!(unsafe { s.as_ptr().read() }, 7);
    // SAFETY: live with this layout.
    unsafe { alloc.deallocate(s, farther) };
    let stats = alloc.stats();
    assert_eq!(stats.in_place_reallocs, 2);
    assert_eq!(stats.live_bytes(), 0);
}

#[test]
fn cache_limit_bounds_idle_resident_memory_and_trim_releases_all() {
    let _serial = serial();
    let alloc = NumaGpuAlloc::new().cache_limit(8 * MIB).decay_ms(u64::MAX);
    let resident = |alloc: &NumaGpuAlloc| -> usize {
        alloc.stats().nodes.iter().map(|n| n.resident_bytes).sum()
    };
    let blocks: std::vec::Vec<Vec<u8, &NumaGpuAlloc>> = (0..3)
        .map(|_| {
            let mut v = Vec::with_capacity_in(4 * MIB, &alloc);
            v.resize(4 * MIB, 1);
            v
        })
        .collect();
    assert_eq!(resident(&alloc), 12 * MIB);
    drop(blocks);
    let stats = alloc.stats();
    assert!(resident(&alloc) <= 8 * MIB, "{stats}");
    alloc.trim();
    let stats = alloc.stats();
    assert_eq!(stats.cached_bytes(), 0);
    assert_eq!(stats.nodes.iter().map(|n| n.mapped_bytes).sum::<usize>(), 0);
    assert!(stats.released_blocks >= 1, "the chunk");
}

#[test]
fn reset_peaks_starts_over_from_what_is_live() {
    let _serial = serial();
    // Populated when handed out, so that populating has a time to reset.
    let alloc = NumaGpuAlloc::new().node(0).populate_eager(true);
    alloc.reset_peaks(); // before initialisation: nothing to reset
    let kept: Vec<u8, _> = Vec::with_capacity_in(8 * MIB, &alloc);
    drop(Vec::<u8, _>::with_capacity_in(16 * MIB, &alloc));
    let before = alloc.stats();
    assert_eq!(before.nodes[0].peak_live_bytes, 24 * MIB);
    assert!(before.populate_time.max > std::time::Duration::ZERO);

    alloc.reset_peaks();
    let after = alloc.stats();
    assert_eq!(after.nodes[0].peak_live_bytes, 8 * MIB, "what is live now");
    assert_eq!(after.populate_time.max, std::time::Duration::ZERO);
    assert_eq!(
        after.populate_time.total, before.populate_time.total,
        "totals kept"
    );
    assert_eq!(after.large_allocations, 2, "counts kept");
    drop(kept);
}

#[test]
fn verify_and_bind_on_node_zero() {
    let _serial = serial();
    for policy in [MemPolicy::Preferred, MemPolicy::Bind, MemPolicy::Interleave] {
        let alloc = NumaGpuAlloc::new().node(0).verify(true).policy(policy);
        let mut v: Vec<u8, _> = Vec::with_capacity_in(8 * MIB, &alloc);
        resize(&mut v, 8 * MIB, 3);
        let stats = alloc.stats();
        assert!(stats.pages_checked >= (8 * MIB / 4096) as u64, "{policy:?}");
        assert_eq!(stats.pages_misplaced, 0, "{policy:?}");
        assert_eq!(stats.fallbacks.unplaced_blocks, 0, "{policy:?}");
        assert!(alloc.placement().numa_placement);
    }
}

// hashbrown implements allocator-api2 0.2's trait.
#[cfg(feature = "allocator-api2-02")]
#[test]
fn hashbrown_map_in_our_allocator() {
    let _serial = serial();
    let alloc = NumaGpuAlloc::new();
    let mut map = hashbrown::HashMap::new_in(&alloc);
    for i in 0..300_000u64 {
        map.insert(i, i * 3);
    }
    assert!((0..300_000u64).all(|i| map[&i] == i * 3));
    assert!(
        alloc.stats().large_allocations > 0,
        "the table outgrew the threshold"
    );
    drop(map);
    assert_eq!(alloc.stats().live_bytes(), 0);
}

#[test]
fn two_allocators_share_their_nodes_arena() {
    let _serial = serial();
    let a = NumaGpuAlloc::new().node(0);
    let b = NumaGpuAlloc::new().node(0);
    let va: Vec<u8, _> = Vec::with_capacity_in(4 * MIB, &a);
    let vb: Vec<u8, _> = Vec::with_capacity_in(4 * MIB, &b);
    let freed = va.as_ptr();
    assert_eq!(a.stats().live_bytes(), 8 * MIB, "node 0's row: both values");
    assert_eq!(b.stats().live_bytes(), 8 * MIB);
    drop(va);
    let mapped = b.stats().nodes[0].mapped_bytes;
    assert_eq!(
        b.stats().cached_bytes(),
        mapped - 4 * MIB,
        "all but vb's block is free"
    );
    let hits = b.stats().cache_hits;
    let reused: Vec<u8, _> = Vec::with_capacity_in(4 * MIB, &b);
    assert_eq!(reused.as_ptr(), freed, "a's freed block serves b");
    assert_eq!(b.stats().cache_hits, hits + 1);
    drop((vb, reused));
}

#[test]
fn growing_a_block_shrunk_in_place_to_a_stricter_alignment() {
    let _serial = serial();
    let alloc = NumaGpuAlloc::new().node(0);
    let big = Layout::from_size_align(64 * MIB, 4096).unwrap();
    let shrunk = Layout::from_size_align(33 * MIB, 4096).unwrap();
    // Keeps the 64 MiB block; growing to 34 MiB at 1 GiB alignment cannot stay in place, and
    // the block is already larger than the new size needs: it must move by copying.
    let grown = Layout::from_size_align(34 * MIB, 1 << 30).unwrap();
    let p = alloc.allocate(big).unwrap().cast::<u8>();
    // SAFETY: `p` is live with layout `big`; then with `shrunk`.
    let p = unsafe { alloc.shrink(p, big, shrunk) }
        .unwrap()
        .cast::<u8>();
    // SAFETY: writes inside the 33 MiB the layout covers.
    unsafe { p.as_ptr().write_bytes(7, 33 * MIB) };
    // SAFETY: `p` is live with layout `shrunk`.
    let q = unsafe { alloc.grow(p, shrunk, grown) }
        .unwrap()
        .cast::<u8>();
    assert_eq!(q.as_ptr() as usize % (1 << 30), 0);
    // SAFETY: the first 33 MiB were copied from the old block.
    let copied = unsafe { std::slice::from_raw_parts(q.as_ptr(), 33 * MIB) };
    assert!(all_bytes_are(copied, 7));
    // SAFETY: `q` is live with layout `grown`.
    unsafe { alloc.deallocate(q, grown) };
}
