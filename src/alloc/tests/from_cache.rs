//! A new dedicated block that no cached block fits is made of a cached block of another size,
//! and what a grown block populates.

use std::ptr;

use super::{allocator, layout, serial};
use crate::arena::{class_size, DEDICATED_MIN};

const PAGE: usize = 4096;

/// Whether every page of `len` bytes at `ptr` starts with `byte`.
///
/// # Safety
///
/// `ptr..ptr + len` is a live block.
unsafe fn pages_hold(ptr: *const u8, len: usize, byte: u8) -> bool {
    // SAFETY: the caller's block.
    let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
    bytes.iter().step_by(PAGE).all(|&b| b == byte)
}

/// A block written whole and freed is cached; a request for twice its size (not asked zeroed)
/// takes its pages for its head (`mremap`: they hold what was written, and nothing is left
/// cached), and only its tail is fresh; that block freed, a request for three quarters of it
/// takes it shrunk in place. A zeroed request never takes written pages.
#[test]
fn a_new_block_is_made_of_a_cached_block_of_another_size() {
    let _serial = serial();
    let alloc = allocator();
    let size = DEDICATED_MIN;
    let class = |len| class_size(len, PAGE).unwrap();
    let first = alloc.allocate(layout(size), false);
    assert!(!first.is_null());
    // SAFETY: a live block of `size` bytes, freed with its layout and not used after.
    unsafe {
        ptr::write_bytes(first, 0xa5, size);
        alloc.deallocate(first, layout(size));
    }
    assert_eq!(alloc.stats().cached_bytes(), class(size));

    let larger = alloc.allocate(layout(2 * size), false);
    assert!(!larger.is_null());
    // SAFETY: a live block of 2 × `size` bytes.
    let (head, tail) = unsafe {
        (
            pages_hold(larger, size, 0xa5),
            pages_hold(larger.add(size), size, 0),
        )
    };
    assert!(
        head,
        "the cached block's pages, not fresh ones, at its head"
    );
    assert!(tail, "a fresh tail");
    let stats = alloc.stats();
    assert_eq!(stats.resized_from_cache, 1);
    assert_eq!(
        (stats.cached_bytes(), stats.live_bytes()),
        (0, class(2 * size))
    );

    // SAFETY: live with this layout, not used after.
    unsafe {
        ptr::write_bytes(larger, 0x5a, 2 * size);
        alloc.deallocate(larger, layout(2 * size));
    }
    let smaller = alloc.allocate(layout(3 * size / 2), false);
    assert_eq!(smaller, larger, "shrunk in place");
    // SAFETY: a live block of 1.5 × `size` bytes.
    assert!(unsafe { pages_hold(smaller, 3 * size / 2, 0x5a) });
    let stats = alloc.stats();
    assert_eq!(stats.resized_from_cache, 2);
    assert_eq!(
        (stats.cached_bytes(), stats.live_bytes()),
        (0, class(3 * size / 2)),
        "the tail was given back"
    );
    // SAFETY: live with this layout, not used after.
    unsafe { alloc.deallocate(smaller, layout(3 * size / 2)) };

    let zeroed = alloc.allocate(layout(3 * size), true);
    assert!(!zeroed.is_null());
    // SAFETY: a live block of 3 × `size` bytes.
    assert!(unsafe { pages_hold(zeroed, 3 * size, 0) }, "zeroed");
    assert_eq!(
        alloc.stats().resized_from_cache,
        2,
        "a zeroed request maps fresh"
    );
    // SAFETY: live with this layout.
    unsafe { alloc.deallocate(zeroed, layout(3 * size)) };
}

/// A new block and a block grown by moving its pages (`realloc`) are populated up to the size
/// asked for, not the rounding up to their class: those pages stay unfaulted until written.
#[test]
fn blocks_are_populated_up_to_the_size_asked_for() {
    let _serial = serial();
    let alloc = allocator();
    let size = DEDICATED_MIN;
    let asked = 2 * size + (3 << 20) + 1;
    let capacity = class_size(asked, PAGE).unwrap();
    let written = asked.next_multiple_of(PAGE);
    // A huge page covers the last bytes asked for: the rest of it is resident too.
    let unwritten = written.next_multiple_of(crate::sys::HUGE_PAGE);
    assert!(
        capacity >= unwritten + (8 << 20),
        "a class well above the request"
    );
    let resident = |block: *mut u8, from: usize, to: usize| {
        let ptr = std::ptr::NonNull::new(block.wrapping_add(from)).unwrap();
        crate::sys::resident_sample(ptr, to - from, 16).unwrap()
    };

    let new = alloc.allocate(layout(asked), false);
    assert!(!new.is_null());
    let (head, sampled) = resident(new, 0, written);
    assert_eq!(head, sampled, "populated up to the request");
    assert_eq!(
        resident(new, unwritten, capacity).0,
        0,
        "the rounding is not"
    );
    // SAFETY: live with this layout.
    unsafe { alloc.deallocate(new, layout(asked)) };
    alloc.trim();

    let first = alloc.allocate(layout(size), false);
    assert!(!first.is_null());
    // SAFETY: `first` is live with this layout.
    let grown = unsafe { alloc.reallocate(first, layout(size), layout(asked)) };
    assert!(!grown.is_null());
    assert_eq!(alloc.stats().grown_without_copy, 1);
    let (tail, sampled) = resident(grown, size, written);
    assert_eq!(tail, sampled, "the tail up to the request is populated");
    assert_eq!(
        resident(grown, unwritten, capacity).0,
        0,
        "the rounding is not"
    );
    // SAFETY: live with this layout.
    unsafe { alloc.deallocate(grown, layout(asked)) };
}
