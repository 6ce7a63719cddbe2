//! glibc's own allocator, reached by its public `__libc_*` entry points (never through `dlsym`,
//! which allocates), and as a `GlobalAlloc`: the crate's inner allocator and this library's Rust
//! allocations. `System` would call `malloc`, which in this library is the library itself.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

extern "C" {
    pub(crate) fn __libc_malloc(size: usize) -> *mut c_void;
    pub(crate) fn __libc_free(ptr: *mut c_void);
    pub(crate) fn __libc_calloc(count: usize, size: usize) -> *mut c_void;
    pub(crate) fn __libc_realloc(ptr: *mut c_void, size: usize) -> *mut c_void;
    pub(crate) fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
    pub(crate) fn __libc_valloc(size: usize) -> *mut c_void;
    pub(crate) fn __libc_pvalloc(size: usize) -> *mut c_void;
}

/// The alignment glibc's `malloc` guarantees on 64-bit targets.
pub(crate) const MALLOC_ALIGN: usize = 16;

/// glibc's `malloc_usable_size`, which this library's own export hides: found with
/// `dlsym(RTLD_NEXT)` by the library's constructor, outside any allocation (0 until then).
static USABLE_SIZE: AtomicUsize = AtomicUsize::new(0);

/// Looks glibc's `malloc_usable_size` up. Never inside an allocation: `dlsym` allocates.
pub(crate) fn resolve_usable_size() {
    // SAFETY: a NUL-terminated name; RTLD_NEXT finds the definition after this library's.
    let found = unsafe { libc::dlsym(libc::RTLD_NEXT, c"malloc_usable_size".as_ptr()) };
    USABLE_SIZE.store(found as usize, Relaxed);
}

/// glibc's usable size of `ptr` (one of glibc's). Before the constructor ran (a constructor of a
/// library loaded earlier asks) it is looked up now: `malloc_usable_size` is no allocation, and
/// glibc never calls it holding a lock. `None` if glibc has none.
///
/// # Safety
/// `ptr` is null or a live allocation of glibc's.
pub(crate) unsafe fn usable_size(ptr: *mut c_void) -> Option<usize> {
    let mut found = USABLE_SIZE.load(Relaxed);
    if found == 0 {
        resolve_usable_size();
        found = USABLE_SIZE.load(Relaxed);
    }
    if found == 0 {
        return None;
    }
    // SAFETY: `found` is glibc's `malloc_usable_size`, whose signature this is.
    let usable: unsafe extern "C" fn(*mut c_void) -> usize = unsafe { std::mem::transmute(found) };
    // SAFETY: forwarded from the caller.
    Some(unsafe { usable(ptr) })
}

/// glibc's allocator as a `GlobalAlloc`.
pub(crate) struct Glibc;

// SAFETY: glibc's entry points return memory valid for the size at the alignment asked (memalign
// above malloc's own), or null; they never unwind.
unsafe impl GlobalAlloc for Glibc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: plain C calls; a null result is passed on.
        unsafe {
            if layout.align() <= MALLOC_ALIGN {
                __libc_malloc(layout.size()).cast()
            } else {
                __libc_memalign(layout.align(), layout.size()).cast()
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() > MALLOC_ALIGN {
            // SAFETY: forwarded from the caller.
            let ptr = unsafe { self.alloc(layout) };
            if !ptr.is_null() {
                // SAFETY: a fresh allocation of `layout.size()` bytes.
                unsafe { ptr.write_bytes(0, layout.size()) };
            }
            return ptr;
        }
        // SAFETY: a plain C call.
        unsafe { __libc_calloc(1, layout.size()).cast() }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: GlobalAlloc's contract: `ptr` came from `alloc` above, i.e. from glibc.
        unsafe { __libc_free(ptr.cast()) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() > MALLOC_ALIGN {
            // glibc's realloc keeps only malloc's alignment: allocate, copy and free.
            // SAFETY: `ptr` has `layout`; the new layout is valid by GlobalAlloc's contract.
            let new =
                unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
            if !new.is_null() {
                // SAFETY: both live, distinct, at least this long.
                unsafe { std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size)) };
                // SAFETY: `ptr` is glibc's and not used after this.
                unsafe { __libc_free(ptr.cast()) };
            }
            return new;
        }
        // SAFETY: `ptr` is glibc's (GlobalAlloc's contract).
        unsafe { __libc_realloc(ptr.cast(), new_size).cast() }
    }
}
