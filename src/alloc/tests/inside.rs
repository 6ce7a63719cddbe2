//! The `GlobalAlloc` front end's own case: a request made inside the allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use crate::guard::Inside;
use crate::NumaGpuAlloc;

/// `System`, counting allocations and frees.
#[derive(Default)]
struct Counted {
    allocs: AtomicUsize,
    frees: AtomicUsize,
}

// SAFETY: forwards to `System`; counting neither allocates nor unwinds.
unsafe impl GlobalAlloc for Counted {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocs.fetch_add(1, Relaxed);
        // SAFETY: forwarded from the caller.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        self.frees.fetch_add(1, Relaxed);
        // SAFETY: forwarded from the caller.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// A large request made inside the allocator (as its own code makes them) is served by the
/// inner allocator, and its free, a large free the arena does not know, goes back there.
#[test]
fn a_large_request_made_inside_is_the_inner_allocators() {
    let alloc = NumaGpuAlloc::with_inner(Counted::default()).threshold(64 << 10);
    let _ = alloc.placement();
    let large = Layout::from_size_align(1 << 20, 8).unwrap();
    let ptr = {
        let _inside = Inside::enter().expect("not inside yet");
        // SAFETY: a non-zero layout.
        unsafe { alloc.alloc(large) }
    };
    assert!(!ptr.is_null());
    assert_eq!(alloc.inner().allocs.load(Relaxed), 1);
    // SAFETY: allocated above with this layout.
    unsafe { alloc.dealloc(ptr, large) };
    assert_eq!(alloc.inner().frees.load(Relaxed), 1);
    let stats = alloc.stats();
    assert_eq!(
        (stats.fallbacks.foreign_frees, stats.large_allocations),
        (1, 0)
    );
}
