//! The `#[global_allocator]` front end.

use std::alloc::{GlobalAlloc, Layout};

use crate::NumaGpuAlloc;

// SAFETY: every method forwards to the shared routing in `alloc.rs`, which returns memory valid for
// the layout (system allocator below the threshold, our own mappings above it), frees by the same
// rule, and never unwinds.
unsafe impl GlobalAlloc for NumaGpuAlloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, false)
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, true)
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: GlobalAlloc's contract: `ptr` came from this allocator with `layout`.
        unsafe { self.deallocate(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: GlobalAlloc's contract: new_size rounded to the alignment does not overflow.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: GlobalAlloc's contract: `ptr` came from this allocator with `layout`, and both
        // sizes are non-zero.
        unsafe { self.reallocate(ptr, layout, new) }
    }
}
