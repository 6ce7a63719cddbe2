//! The C allocation API, as glibc defines it (`realloc(p, 0)` frees and returns null,
//! `memalign` rounds a non-power-of-two alignment up, `pvalloc` rounds the size up to pages).
//! Every function is `extern "C"` and never unwinds: nothing below panics.

use std::ffi::{c_int, c_void};
use std::ptr;

use super::*;

/// `malloc(3)`.
///
/// # Safety
/// The C contract: none beyond freeing the result once.
#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    if large(size) {
        return allocate_large(size, MALLOC_ALIGN, false);
    }
    // SAFETY: a plain C call.
    unsafe { glibc::__libc_malloc(size) }
}

/// `free(3)`; keeps `errno`.
///
/// # Safety
/// `ptr` is null or a live allocation of this process's `malloc` family, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn free(ptr: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    if owned::maybe_ours(ptr as usize) {
        // SAFETY: forwarded from the caller.
        unsafe { free_maybe_ours(ptr) }
    } else {
        // SAFETY: certainly not ours, so glibc's (which keeps errno itself).
        unsafe { glibc::__libc_free(ptr) }
    }
}

/// `cfree(3)`: `free` under its old name. glibc no longer links new programs to it, but old
/// binaries call it, on blocks of ours too.
///
/// # Safety
/// As `free`.
#[no_mangle]
pub unsafe extern "C" fn cfree(ptr: *mut c_void) {
    // SAFETY: the same contract.
    unsafe { free(ptr) }
}

/// `calloc(3)`.
///
/// # Safety
/// As `malloc`.
#[no_mangle]
pub unsafe extern "C" fn calloc(count: usize, size: usize) -> *mut c_void {
    match count.checked_mul(size) {
        Some(total) if large(total) => allocate_large(total, MALLOC_ALIGN, true),
        // SAFETY: a plain C call (glibc reports the overflow itself).
        _ => unsafe { glibc::__libc_calloc(count, size) },
    }
}

/// `realloc(3)`: a block that crosses the threshold either way moves.
///
/// # Safety
/// `ptr` is null or a live allocation of this process's `malloc` family; on success it is not
/// used afterwards.
#[no_mangle]
pub unsafe extern "C" fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
    if ptr.is_null() {
        // SAFETY: the C contract of malloc.
        return unsafe { malloc(size) };
    }
    if owned::maybe_ours(ptr as usize) {
        if let Some(record) = owned::remove(ptr as usize) {
            // SAFETY: ours, taken out of the record.
            return unsafe { realloc_ours(ptr, record, size) };
        }
    }
    if large(size) {
        // SAFETY: not ours, so glibc's.
        if let Some(moved) = unsafe { realloc_into_large(ptr, size) } {
            return moved;
        }
    }
    // SAFETY: glibc's.
    unsafe { glibc::__libc_realloc(ptr, size) }
}

/// An alignment rounded as glibc's `memalign` rounds it; `None` past the largest power of two.
fn round_align(align: usize) -> Option<usize> {
    align.max(MALLOC_ALIGN).checked_next_power_of_two()
}

/// `memalign(3)`.
///
/// # Safety
/// As `malloc`.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    if large(size) {
        let Some(align) = round_align(align) else {
            sys::set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        return allocate_large(size, align, false);
    }
    // SAFETY: a plain C call.
    unsafe { glibc::__libc_memalign(align, size) }
}

/// `aligned_alloc(3)` (glibc's is `memalign`).
///
/// # Safety
/// As `malloc`.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    // SAFETY: the same contract.
    unsafe { memalign(align, size) }
}

/// `posix_memalign(3)`: EINVAL for an alignment that is not a power of two times
/// `sizeof(void *)`, ENOMEM when out of memory; `*out` is set only on success.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(size_of::<*mut c_void>()) {
        return libc::EINVAL;
    }
    let errno = sys::errno();
    let ptr = if large(size) {
        allocate_large(size, align, false)
    } else {
        // SAFETY: a plain C call with a valid alignment.
        unsafe { glibc::__libc_memalign(align, size) }
    };
    sys::set_errno(errno);
    if ptr.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: the caller's contract.
    unsafe { *out = ptr };
    0
}

/// `valloc(3)`: page-aligned, the page size read at run time.
///
/// # Safety
/// As `malloc`.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    if large(size) {
        return allocate_large(size, sys::page_size(), false);
    }
    // SAFETY: a plain C call.
    unsafe { glibc::__libc_valloc(size) }
}

/// `pvalloc(3)`: page-aligned, the size rounded up to whole pages (one page for 0).
///
/// # Safety
/// As `malloc`.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let page = sys::page_size();
    match size.max(1).checked_next_multiple_of(page) {
        Some(rounded) if large(rounded) => allocate_large(rounded, page, false),
        // SAFETY: a plain C call (glibc reports the overflow itself).
        _ => unsafe { glibc::__libc_pvalloc(size) },
    }
}

/// `malloc_usable_size(3)`: a block of ours reports the size asked for.
///
/// # Safety
/// `ptr` is null or a live allocation of this process's `malloc` family.
#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(ptr: *mut c_void) -> usize {
    if ptr.is_null() {
        return 0;
    }
    if let Some(record) = owned::get(ptr as usize) {
        return record.size;
    }
    // SAFETY: glibc's. Without glibc's function the size is unknown: 0 promises nothing.
    unsafe { glibc::usable_size(ptr) }.unwrap_or(0)
}
