//! `libnuma_gpu_alloc.so`: numa-gpu-alloc for any dynamically linked program, through
//! `LD_PRELOAD` (or the launcher, `numa-gpu-alloc run -- CMD`). Cargo builds it as
//! `libnuma_gpu_alloc_preload.so` (`numa_gpu_alloc` is the crate's library name); the wheel
//! ships it as `libnuma_gpu_alloc.so`.
//!
//! It exports `malloc`, `free`, `calloc`, `realloc`, `posix_memalign`, `aligned_alloc`,
//! `memalign`, `valloc`, `pvalloc` and `malloc_usable_size`. Requests of at least the threshold
//! (2 MiB unless `NUMA_GPU_ALLOC` says `threshold=`) are the crate's large blocks, placed on the
//! node nearest the GPU, with every setting of `NUMA_GPU_ALLOC`; smaller ones go to glibc's own
//! entry points (`__libc_malloc` and the rest), as does every pointer that is not a block of
//! ours (`owned.rs` tells which, with no lock for glibc's).
//!
//! The defaults differ from the crate's in four ways, for programs that did not ask for it:
//! - no page-locking (`pin=off`, the crate's default too): PyTorch and SGLang register their
//!   `malloc`ed memory themselves, and a second registration fails (error 712);
//! - no cache (`cache=0`): a freed block's pages are given back at once (`madvise(MADV_DONTNEED)`
//!   on the freed range of a chunk, `munmap` of a block with a mapping of its own), so a block is
//!   never handed out again with pages a third party may still have registered: libraries that
//!   keep registrations until the memory goes away (UCX's memory hooks watch `munmap` and
//!   `madvise(MADV_DONTNEED)`) see it go at `free`, as with glibc's `munmap` of a large chunk.
//!   `cache=4G` turns the cache back on where no such library runs;
//! - no background thread (`decay_thread=off`): with no cache it would have nothing to do;
//! - overcommit kept (`bulk_max=0`): a request is populated in bulk only once blocks of its size
//!   were seen written whole, so a table sized for the worst case and barely touched stays as
//!   small as under glibc (the launcher, for GPU programs, sets `bulk_max=256MiB`).
//!
//! Nothing that could take a lock of glibc's runs inside an allocation: the large path is made
//! ready by the library's constructor (its settings, topology, cgroup limits and the driver
//! probe), and requests made before it ran (by the constructors of libraries loaded earlier) are
//! glibc's. Fork handlers may allocate (the record's and the arenas' locks let the forking
//! thread in while they are held for the fork); the library's threads take no signal;
//! thread-local state is the crate's flags only (global-dynamic TLS, so the library can also be
//! `dlopen`ed).

// Linux only (glibc's entry points, ELF constructors); elsewhere the library is empty, so that
// the workspace still checks for other targets.
#![cfg(target_os = "linux")]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(clippy::missing_safety_doc)]

mod glibc;
mod owned;
mod sys;

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use numa::{Config, NumaGpuAlloc};

use glibc::{Glibc, MALLOC_ALIGN};
use owned::Record;

/// The library's Rust allocations (the crate's tables, the record) are glibc's: through `System`
/// they would come back to this library's `malloc`.
#[global_allocator]
static RUST_HEAP: Glibc = Glibc;

/// The preload's defaults (see the crate docs above); `NUMA_GPU_ALLOC` applies over them.
const PRELOAD_CONFIG: Config = {
    let mut config = Config::DEFAULT;
    config.cache_limit = 0;
    config.decay_thread = false;
    // A `malloc` may be a table barely touched: populated in bulk only once seen written whole.
    config.bulk_max = 0;
    config
};

/// The large path, over glibc.
static ALLOC: NumaGpuAlloc<Glibc> = NumaGpuAlloc::with_inner_config(Glibc, PRELOAD_CONFIG);

/// The threshold in force. Every request is glibc's until the library's constructor has made
/// the large path ready and stored the threshold its settings give: nothing the large path needs
/// (the driver probe, topology, cgroup and sysfs reads) is then left for inside an allocation,
/// where the caller may hold a lock of glibc's (`setlocale` holds the locale lock while stdio
/// allocates; `dlopen`, `dlerror` and gettext would take it again).
static THRESHOLD: AtomicUsize = AtomicUsize::new(usize::MAX);
/// No threshold is smaller (the crate's minimum): smaller requests need no load.
const MIN_LARGE: usize = 4 << 10;

/// Whether a request of `size` bytes is a large block.
#[inline(always)]
fn large(size: usize) -> bool {
    size >= MIN_LARGE && size >= THRESHOLD.load(Relaxed)
}

/// Allocates a large block of `size` bytes at `align` (a power of two): the crate's, recorded as
/// ours. Null with `ENOMEM` on failure.
#[cold]
#[inline(never)]
fn allocate_large(size: usize, align: usize, zeroed: bool) -> *mut c_void {
    let Ok(layout) = Layout::from_size_align(size, align.max(MALLOC_ALIGN)) else {
        sys::set_errno(libc::ENOMEM);
        return ptr::null_mut();
    };
    // A successful call leaves errno as it was, whatever the calls below set it to.
    let errno = sys::errno();
    // SAFETY: a non-zero size (at least MIN_LARGE).
    let ptr = unsafe {
        if zeroed {
            ALLOC.alloc_zeroed(layout)
        } else {
            ALLOC.alloc(layout)
        }
    };
    if ptr.is_null() {
        sys::set_errno(libc::ENOMEM);
        return ptr::null_mut();
    }
    let record = Record {
        size,
        align: layout.align(),
    };
    if !owned::insert(ptr as usize, record) {
        // SAFETY: allocated just above with this layout.
        unsafe { ALLOC.dealloc(ptr, layout) };
        sys::set_errno(libc::ENOMEM);
        return ptr::null_mut();
    }
    sys::set_errno(errno);
    ptr.cast()
}

/// The layout a block was allocated with.
fn layout_of(record: Record) -> Layout {
    // SAFETY: it was a valid layout when the block was allocated.
    unsafe { Layout::from_size_align_unchecked(record.size, record.align) }
}

/// Frees a pointer the granule map says may be ours; `errno` is kept.
///
/// # Safety
/// `ptr` is a live allocation (of ours or glibc's) that is not used afterwards.
#[cold]
#[inline(never)]
unsafe fn free_maybe_ours(ptr: *mut c_void) {
    let errno = sys::errno();
    match owned::remove(ptr as usize) {
        // SAFETY: ours, allocated with this layout; the record is gone, so nobody frees it twice.
        Some(record) => unsafe { ALLOC.dealloc(ptr.cast(), layout_of(record)) },
        // SAFETY: not ours, so glibc's.
        None => unsafe { glibc::__libc_free(ptr) },
    }
    sys::set_errno(errno);
}

/// `realloc` of a block of ours: resized by the crate while it stays large, moved to glibc
/// below the threshold. `errno` is kept unless it fails (`ENOMEM`).
///
/// # Safety
/// `ptr` is the live block `record` describes, taken out of the record by the caller.
unsafe fn realloc_ours(ptr: *mut c_void, record: Record, size: usize) -> *mut c_void {
    let errno = sys::errno();
    // SAFETY: forwarded from the caller.
    let moved = unsafe { resize_ours(ptr, record, size) };
    if !moved.is_null() || size == 0 {
        sys::set_errno(errno);
    }
    moved
}

/// [`realloc_ours`]'s work; null with `ENOMEM` when it fails (the old block is then the
/// caller's still), null when `size` is 0 (freed).
///
/// # Safety
/// As [`realloc_ours`].
unsafe fn resize_ours(ptr: *mut c_void, record: Record, size: usize) -> *mut c_void {
    let old = layout_of(record);
    if size == 0 {
        // glibc frees and returns null.
        // SAFETY: ours with this layout.
        unsafe { ALLOC.dealloc(ptr.cast(), old) };
        return ptr::null_mut();
    }
    let moved = if large(size) {
        match Layout::from_size_align(size, record.align) {
            // SAFETY: ours with `old`; `size` is non-zero and a layout with it exists.
            Ok(_) => unsafe { ALLOC.realloc(ptr.cast(), old, size) }.cast::<c_void>(),
            Err(_) => ptr::null_mut(),
        }
    } else {
        // SAFETY: a plain C call.
        let small = unsafe { glibc::__libc_malloc(size) };
        if !small.is_null() {
            // SAFETY: both live and distinct; the new size is the smaller.
            unsafe { ptr::copy_nonoverlapping(ptr.cast::<u8>(), small.cast(), size) };
            // SAFETY: ours with this layout, not used again.
            unsafe { ALLOC.dealloc(ptr.cast(), old) };
            return small;
        }
        ptr::null_mut()
    };
    if moved.is_null() {
        // The old block is untouched and still the caller's. Its granules' leaves exist (they
        // are never unmapped): recording it again cannot fail.
        owned::insert(ptr as usize, record);
        sys::set_errno(libc::ENOMEM);
        return ptr::null_mut();
    }
    let new = Record { size, ..record };
    if owned::insert(moved as usize, new) {
        return moved;
    }
    // The granule map could not grow (mapping one page failed): the data goes to glibc.
    // SAFETY: a plain C call.
    let small = unsafe { glibc::__libc_malloc(size) };
    if small.is_null() {
        // The old block is gone and the new one cannot be recorded: no answer is safe.
        sys::out_of_memory();
    }
    // SAFETY: both live and distinct, `size` bytes long; `moved` is ours with `new`'s layout.
    unsafe {
        ptr::copy_nonoverlapping(moved.cast::<u8>(), small.cast(), size);
        ALLOC.dealloc(moved.cast(), layout_of(new));
    }
    small
}

/// `realloc` of one of glibc's pointers to a large size: moved into a block of ours. `None`
/// when glibc's usable size is not known yet (before the constructor): glibc reallocates.
///
/// # Safety
/// `ptr` is a live allocation of glibc's.
unsafe fn realloc_into_large(ptr: *mut c_void, size: usize) -> Option<*mut c_void> {
    // SAFETY: forwarded from the caller.
    let old = unsafe { glibc::usable_size(ptr) }?;
    let new = allocate_large(size, MALLOC_ALIGN, false);
    if !new.is_null() {
        // SAFETY: both live and distinct, each at least this long.
        unsafe { ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast(), old.min(size)) };
        // SAFETY: glibc's, not used again.
        unsafe { glibc::__libc_free(ptr) };
    }
    Some(new)
}

/// Does what must not be done inside an allocation: glibc's `malloc_usable_size` looked up
/// (`dlsym` allocates), the fork handlers registered, and the large path made ready (settings,
/// topology, cgroup limits, the driver probe: `dlopen`, sysfs reads), after which large requests
/// are the library's. Requests made before (by the constructors of libraries loaded earlier)
/// are glibc's. `errno` is left as it was.
extern "C" fn construct() {
    let errno = sys::errno();
    glibc::resolve_usable_size();
    sys::at_fork(owned::before_fork, owned::after_fork, owned::after_fork);
    let _ = ALLOC.placement();
    THRESHOLD.store(ALLOC.config().threshold.max(MIN_LARGE), Relaxed);
    sys::set_errno(errno);
}

/// Runs [`construct`] when the library is loaded, preloaded or `dlopen`ed.
#[used]
#[link_section = ".init_array"]
static CONSTRUCT: extern "C" fn() = construct;

/// The exported C entry points (in the unit tests' binary too: its allocations go through them).
mod exports;
