//! The library's few raw calls: mapping the granule map's leaves, errno, the page size, yielding.

use std::ffi::c_void;
use std::ptr;

/// Maps `len` bytes of zeroed, private memory; `None` when the kernel refuses.
pub(crate) fn map_zeroed(len: usize) -> Option<*mut c_void> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing.
    let ptr = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (ptr != libc::MAP_FAILED).then_some(ptr)
}

/// Unmaps what [`map_zeroed`] mapped.
///
/// # Safety
/// `ptr..ptr+len` is a mapping of [`map_zeroed`] that nothing uses any more.
pub(crate) unsafe fn unmap(ptr: *mut c_void, len: usize) {
    // SAFETY: forwarded from the caller. A failure leaves the mapping in place, which is harmless.
    unsafe { libc::munmap(ptr, len) };
}

/// The calling thread's errno.
pub(crate) fn errno() -> i32 {
    // SAFETY: glibc's per-thread errno location is always valid.
    unsafe { *libc::__errno_location() }
}

/// Sets the calling thread's errno.
pub(crate) fn set_errno(value: i32) {
    // SAFETY: as in `errno`.
    unsafe { *libc::__errno_location() = value };
}

/// The page size, read at run time (64 KiB kernels exist).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

/// Lets another thread run (a shard's lock is held for a table operation only).
pub(crate) fn yield_now() {
    // SAFETY: no preconditions.
    unsafe { libc::sched_yield() };
}

/// Registers the fork handlers.
pub(crate) fn at_fork(prepare: extern "C" fn(), parent: extern "C" fn(), child: extern "C" fn()) {
    // SAFETY: the handlers take and release locks only; they never unwind.
    unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
}

/// Says that memory ran out where no answer is safe, and aborts (as glibc does on a corrupt heap).
pub(crate) fn out_of_memory() -> ! {
    let text = b"numa-gpu-alloc: out of memory while moving a block in realloc (the granule map \
                 could not grow); aborting\n";
    // SAFETY: writes a static buffer to stderr; nothing is allocated.
    unsafe { libc::write(2, text.as_ptr().cast(), text.len()) };
    std::process::abort()
}
