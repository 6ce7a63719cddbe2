//! A new dedicated block that no cached block fits is made of a cached block of another size.

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
