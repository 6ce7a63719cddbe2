//! [`NumaGpuAlloc`]: the allocator value, its large/small dispatch, and the traits over it:
//! `GlobalAlloc` (the `#[global_allocator]` front end), allocator-api2's `Allocator` (for 0.4
//! and — because hashbrown uses it — 0.2: the two traits have the same shape, one macro
//! implements both), `Default`, `Debug`, `Drop`. Its public methods (constructors, the const builder, settings, stats,
//! reservations, `record_stream`) are in `alloc/methods.rs`, each a thin call into the runtime
//! or the job's module (`reserving.rs`, `record.rs`); resizing without a copy is `resize.rs`'s.
//!
//! Unsafe code here relies on the front ends' contracts (a pointer freed with the layout it was
//! allocated with; `GlobalAlloc`'s and allocator-api2's, forwarded to the dispatch) and the runtime box
//! `process::initialise` made.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write as _;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::Acquire, Ordering::Relaxed};

use crate::config::Config;
use crate::guard::Inside;
use crate::process;
use crate::runtime::route;
use crate::runtime::Runtime;

/// A NUMA- and GPU-aware allocator.
///
/// Requests smaller than the threshold (2 MiB by default) go straight to the inner allocator `A`
/// (the system allocator unless built with [`with_inner`](Self::with_inner)). Larger ones get
/// blocks placed on the host node nearest the configured GPU, page-locked with CUDA when pinning
/// is on and a driver is present (and then populated up front), and cached for reuse when freed.
///
/// ## Arenas are the process's
///
/// Every value shares the process's arenas, one per NUMA node: a freed block goes back to its
/// node's arena, whichever value or thread frees it, and serves later requests of any value
/// routed to that node with the same policy and pinning. A value tells large from small by its
/// own threshold, and frees small memory through its own inner allocator: free a block through a
/// value with the same threshold and inner allocator as the one that allocated it (any value of
/// the same `static` configuration qualifies; a different threshold would hand a large block to
/// the inner allocator). A value holds only its settings and
/// counters; dropping it releases no block (cached blocks stay for the other values; see
/// [`trim`](Self::trim)). Per-thread routing ([`bind_thread`](crate::bind_thread)) sends a
/// thread's blocks to its GPU's or its node's arena.
///
/// ## Settings per process and per value
///
/// What the large path knows of the machine is made once, by the process's first
/// initialisation, and shared by every value: the topology that binds the populate workers and
/// bounds reservations (read under the first value's [`sysfs_root`](Self::sysfs_root)), the
/// cpuset's memory nodes, the cgroup memory limits, the page size, where chunk memory comes
/// from, the arenas and the decay thread. Where values disagree on what the process has one of:
///
/// - the decay thread wakes for the shortest [`decay_ms`](Self::decay_ms) of the values that
///   made chunks, and reads the sysfs root of the value that started it (the first);
/// - the topology behind the populate workers and reservation bounds is the first value's.
///
/// Everything else is the value's own, applied by its own requests to the shared arenas: the
/// threshold, the target and routes (resolved from its own sysfs tree), policy, `verify`,
/// huge pages, `populate`, pinning (`pin`, flags, `pin_limit` against the process's page-locked
/// bytes, `register_max`), `cache_limit` and `decay_ms` on its own frees, `populate_threads`,
/// reservations, and its counters (stats; the decay thread's releases are added to every
/// value's). Whether blocks are still placed with `mbind` is each value's too: a value whose
/// tree could not be read, or that met a refusal of `mbind`, places no more blocks, and says
/// so in its own [`placement`](Self::placement) and stats.
///
/// ## Fork
///
/// `fork()` is safe from any thread: fork handlers hold every node's arena lock across the fork
/// (it waits for an initialisation or a short arena operation in progress on another thread), so
/// the child can allocate. The child never calls CUDA; page-locked blocks cached by the parent are
/// released there at the child's first large allocation instead of being reused, and blocks it
/// frees that were page-locked are released too (unmapped, never unregistered: the registration
/// is the parent's).
///
/// ```
/// use numa_gpu_alloc::NumaGpuAlloc;
///
/// #[global_allocator]
/// static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().threshold(4 << 20);
///
/// let big = vec![1u8; 8 << 20];
/// assert_eq!(big[12345], 1);
/// ```
///
/// ## The inner allocator
///
/// Every pointer that is not one of the large path's blocks belongs to `A`: small requests,
/// requests the allocator makes while it runs (re-entrant ones, large or not), and any free of a
/// pointer no arena knows. `A` must not allocate through this allocator (as the global
/// allocator, it must not use the global allocator): mimalloc, jemalloc and `System` do not.
///
/// ```
/// use mimalloc::MiMalloc;
/// use numa_gpu_alloc::NumaGpuAlloc;
///
/// #[global_allocator]
/// static ALLOC: NumaGpuAlloc<MiMalloc> = NumaGpuAlloc::with_inner(MiMalloc);
///
/// let small = vec![1u8; 100]; // served by mimalloc
/// assert_eq!(small[99], 1);
/// ```
pub struct NumaGpuAlloc<A = System> {
    /// The effective threshold; the environment may change the builder's value at initialisation.
    threshold: Threshold,
    config: Config,
    /// Null until the large path initialises; then a runtime boxed and listed by
    /// [`process::initialise`] (its address must not move with the allocator value, and the fork
    /// handlers reach it through the list), freed in `Drop`.
    runtime: AtomicPtr<Runtime>,
    /// Serves everything that is not a block of the large path.
    inner: A,
}

/// The one value the small path reads, on a cache line of its own so that writes to the
/// allocator's other fields (locks, counters) never invalidate it.
#[repr(align(128))]
struct Threshold(AtomicUsize);

/// Clamps a threshold into the accepted range (see [`Config::apply`] for the checked form).
const fn clamp_threshold(bytes: usize) -> usize {
    if bytes < crate::config::MIN_THRESHOLD {
        crate::config::MIN_THRESHOLD
    } else if bytes > crate::config::MAX_THRESHOLD {
        crate::config::MAX_THRESHOLD
    } else {
        bytes
    }
}

impl<A> NumaGpuAlloc<A> {
    /// The runtime, once the large path has initialised.
    fn initialised(&self) -> Option<&Runtime> {
        // SAFETY: a non-null pointer is a live runtime boxed by `process::initialise`, freed only
        // by `Drop`, which `&self` rules out.
        unsafe { self.runtime.load(Acquire).as_ref() }
    }

    /// The runtime, initialised now if needed. Must be called inside the re-entrancy guard.
    fn runtime(&self) -> &Runtime {
        if let Some(rt) = self.initialised() {
            return rt;
        }
        let mut initialised_here = false;
        let rt = process::initialise(&self.runtime, |setup| {
            initialised_here = true;
            let rt = Runtime::new(self.config, setup);
            self.threshold.0.store(rt.config.threshold, Relaxed);
            rt
        });
        if initialised_here {
            rt.report_setup_errors();
            let in_static = crate::sys::in_loaded_image(self);
            crate::stats_exit::register(rt, in_static);
            let background = rt.config.reserve_background && !rt.config.reserve.is_none();
            match crate::stats_exit::as_static(rt, in_static) {
                Some(rt) if background => rt.reserve_configured_in_background(),
                None if background => {
                    let _ = writeln!(
                        std::io::stderr(),
                        "numa-gpu-alloc: reserve_background=on applies to allocators in a \
                         static (a thread may outlive this one); reserving now"
                    );
                    rt.reserve_configured();
                }
                _ => rt.reserve_configured(),
            }
        }
        rt
    }
}

impl<A: GlobalAlloc> NumaGpuAlloc<A> {
    /// Whether a request of `size` bytes takes the large path. The small path's only cost.
    #[inline(always)]
    pub(crate) fn is_large(&self, size: usize) -> bool {
        // The threshold is never below the minimum: a smaller size needs no load, and a size
        // known at compile time (`Box<T>`, a map's nodes) needs no test at all. Off Linux there
        // is no placement to do: every request passes through to the inner allocator.
        cfg!(target_os = "linux")
            && size >= crate::config::MIN_THRESHOLD
            && size >= self.threshold.0.load(Relaxed)
    }

    /// Allocates `layout` (non-zero size). Null on failure.
    #[inline]
    pub(crate) fn allocate(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        if self.is_large(layout.size()) {
            self.allocate_large_path(layout, zeroed, false)
        } else {
            self.inner_alloc(layout, zeroed)
        }
    }

    #[cold]
    #[inline(never)]
    fn allocate_large_path(&self, layout: Layout, zeroed: bool, growing: bool) -> *mut u8 {
        // Inside fork handlers too: between the crate's prepare handler and its parent or child
        // handler, a request (of another library's handler) must make nothing new, neither an
        // arena the handlers did not lock, nor a populate worker, a thread or a driver call,
        // all of which the child would inherit half-made or refer to the parent's.
        let (Some(_inside), false) = (Inside::enter(), crate::sys::lock::forking()) else {
            return self.inner_alloc(layout, zeroed);
        };
        let rt = self.runtime();
        // The environment may have raised the threshold during initialisation.
        if !self.is_large(layout.size()) {
            return self.inner_alloc(layout, zeroed);
        }
        rt.blocks
            .allocate(layout, zeroed, growing, &route::target(rt))
            .map_or(ptr::null_mut(), NonNull::as_ptr)
    }

    /// Frees what [`Self::allocate`] returned for `layout`.
    ///
    /// # Safety
    /// `ptr` was returned by this allocator for `layout` and is not used afterwards.
    #[inline]
    pub(crate) unsafe fn deallocate(&self, ptr: *mut u8, layout: Layout) {
        if self.is_large(layout.size()) {
            // SAFETY: forwarded from the caller.
            unsafe { self.deallocate_large_path(ptr, layout) }
        } else {
            // SAFETY: small requests were served by the inner allocator with this layout.
            unsafe { self.inner.dealloc(ptr, layout) }
        }
    }

    /// # Safety
    /// As [`Self::deallocate`].
    #[cold]
    #[inline(never)]
    unsafe fn deallocate_large_path(&self, ptr: *mut u8, layout: Layout) {
        // Already inside: this thread is running allocator code, which frees only what it
        // allocated itself while inside, i.e. the inner allocator's memory, never a block of ours.
        if let Some(_inside) = Inside::enter() {
            // Whichever value allocated the block, it goes back to its node's arena.
            let rt = self.runtime();
            if rt.blocks.free(ptr as usize, route::likely_node(rt)) {
                return;
            }
        }
        // Not ours: served by the inner allocator while inside the allocator or before
        // initialisation changed the threshold.
        // SAFETY: the inner allocator served this pointer with this layout.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    /// Resizes an allocation, in place when the block's capacity allows, otherwise by moving.
    /// Null on failure (the old allocation is then untouched).
    ///
    /// # Safety
    /// `ptr` was returned by this allocator for `old` (non-zero size), `new` has a non-zero size.
    #[inline]
    pub(crate) unsafe fn reallocate(&self, ptr: *mut u8, old: Layout, new: Layout) -> *mut u8 {
        // `is_large` grows with the size: one threshold load covers both.
        if !self.is_large(old.size().max(new.size())) && old.align() == new.align() {
            // SAFETY: both sizes are small, so the inner allocator owns `ptr` with layout `old`.
            return unsafe { self.inner.realloc(ptr, old, new.size()) };
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.reallocate_large_path(ptr, old, new) }
    }

    /// Out of line, so that the small path above saves no registers.
    ///
    /// # Safety
    /// As [`Self::reallocate`].
    #[cold]
    #[inline(never)]
    unsafe fn reallocate_large_path(&self, ptr: *mut u8, old: Layout, new: Layout) -> *mut u8 {
        let (old_large, new_large) = (self.is_large(old.size()), self.is_large(new.size()));
        if old_large {
            resize::reallocating(self.initialised(), ptr);
        }
        // In fork handlers a block moves to the inner allocator (see `allocate_large_path`).
        let resizes = old_large && new_large && !crate::sys::lock::forking();
        if resizes && resize::in_place(self.initialised(), ptr, new) {
            return ptr;
        }
        if resizes && new.size() > old.size() {
            if let Some(grown) = resize::grow_without_copy(self.initialised(), ptr, new) {
                return grown.as_ptr();
            }
        }
        // A block that grows and moves gets a place it can grow from without a copy next time.
        let moved = if new_large && new.size() > old.size() {
            self.allocate_large_path(new, false, true)
        } else {
            self.allocate(new, false)
        };
        if !moved.is_null() {
            // SAFETY: both are live, distinct allocations at least this long.
            unsafe { ptr::copy_nonoverlapping(ptr, moved, old.size().min(new.size())) };
            // SAFETY: forwarded from the caller.
            unsafe { self.deallocate(ptr, old) };
        }
        moved
    }

    /// Allocates from the inner allocator.
    #[inline(always)]
    fn inner_alloc(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        // SAFETY: callers pass layouts of non-zero size.
        unsafe {
            if zeroed {
                self.inner.alloc_zeroed(layout)
            } else {
                self.inner.alloc(layout)
            }
        }
    }

    /// Allocates `layout`; zero-size requests get a dangling, aligned pointer.
    #[inline]
    fn allocate_slice(&self, layout: Layout, zeroed: bool) -> Option<NonNull<[u8]>> {
        let ptr = if layout.size() == 0 {
            dangling(layout)
        } else {
            NonNull::new(self.allocate(layout, zeroed))?
        };
        Some(NonNull::slice_from_raw_parts(ptr, layout.size()))
    }

    /// Moves or resizes an allocation to `new`, handling zero sizes.
    ///
    /// # Safety
    /// `ptr` is live in this allocator with layout `old`.
    #[inline]
    unsafe fn resize_slice(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Option<NonNull<[u8]>> {
        if old.size() == 0 {
            return self.allocate_slice(new, false);
        }
        if new.size() == 0 {
            // SAFETY: forwarded from the caller.
            unsafe { self.deallocate(ptr.as_ptr(), old) };
            return Some(NonNull::slice_from_raw_parts(dangling(new), 0));
        }
        // SAFETY: forwarded from the caller; both sizes are non-zero.
        let moved = NonNull::new(unsafe { self.reallocate(ptr.as_ptr(), old, new) })?;
        Some(NonNull::slice_from_raw_parts(moved, new.size()))
    }

    /// # Safety
    /// `ptr` is live in this allocator with `layout`.
    #[inline]
    unsafe fn deallocate_nonzero(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() != 0 {
            // SAFETY: forwarded from the caller.
            unsafe { self.deallocate(ptr.as_ptr(), layout) }
        }
    }
}

// SAFETY: every method forwards to the large/small dispatch above, which returns memory valid
// for the layout (the inner allocator below the threshold, our own mappings above it), frees by
// the same rule, and never unwinds (the inner allocator is a `GlobalAlloc`, which must not
// unwind).
unsafe impl<A: GlobalAlloc> GlobalAlloc for NumaGpuAlloc<A> {
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

impl<A: Default> Default for NumaGpuAlloc<A> {
    fn default() -> Self {
        Self::with_inner(A::default())
    }
}

impl<A> std::fmt::Debug for NumaGpuAlloc<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NumaGpuAlloc")
            .field("inner", &std::any::type_name::<A>())
            .field("config", &self.config())
            .field("initialized", &self.initialised().is_some())
            .finish()
    }
}

impl<A> Drop for NumaGpuAlloc<A> {
    /// Frees the runtime. Its blocks stay in the process's arenas: live ones may still be freed
    /// through another value of the same threshold and inner allocator, cached and pending ones
    /// serve other values.
    fn drop(&mut self) {
        let runtime = std::mem::replace(self.runtime.get_mut(), ptr::null_mut());
        if runtime.is_null() {
            return;
        }
        let _inside = Inside::enter();
        // SAFETY: boxed by `process::initialise`; `&mut self` means nobody else uses it.
        drop(unsafe { Box::from_raw(runtime) });
    }
}

#[inline]
fn dangling(layout: Layout) -> NonNull<u8> {
    // An aligned, non-null address that is never dereferenced (as `Layout::dangling` does).
    NonNull::new(layout.align() as *mut u8).unwrap_or(NonNull::dangling())
}

macro_rules! impl_allocator {
    ($api:path) => {
        use $api as api;

        // SAFETY: blocks returned are valid for their layout until deallocated through this
        // allocator (or its references, or another value of the same threshold and inner
        // allocator: blocks live in the process's arenas), so
        // moving the value keeps them valid; resizing preserves contents; nothing unwinds.
        unsafe impl<A: GlobalAlloc> api::Allocator for NumaGpuAlloc<A> {
            #[inline]
            fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, api::AllocError> {
                self.allocate_slice(layout, false).ok_or(api::AllocError)
            }

            #[inline]
            fn allocate_zeroed(&self, layout: Layout) -> Result<NonNull<[u8]>, api::AllocError> {
                self.allocate_slice(layout, true).ok_or(api::AllocError)
            }

            #[inline]
            unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
                // SAFETY: the trait's contract: `ptr` is live here with `layout`.
                unsafe { self.deallocate_nonzero(ptr, layout) }
            }

            #[inline]
            unsafe fn grow(
                &self,
                ptr: NonNull<u8>,
                old: Layout,
                new: Layout,
            ) -> Result<NonNull<[u8]>, api::AllocError> {
                // SAFETY: the trait's contract: `ptr` is live here with `old`.
                unsafe { self.resize_slice(ptr, old, new) }.ok_or(api::AllocError)
            }

            #[inline]
            unsafe fn shrink(
                &self,
                ptr: NonNull<u8>,
                old: Layout,
                new: Layout,
            ) -> Result<NonNull<[u8]>, api::AllocError> {
                // SAFETY: the trait's contract: `ptr` is live here with `old`.
                unsafe { self.resize_slice(ptr, old, new) }.ok_or(api::AllocError)
            }
        }
    };
}

mod v04 {
    use super::*;
    impl_allocator!(allocator_api2::alloc);
}

#[cfg(feature = "allocator-api2-02")]
mod v02 {
    use super::*;
    impl_allocator!(allocator_api2_02::alloc);
}

mod methods;
#[cfg(feature = "pinned-buffer")]
mod record;
mod reserving;
mod resize;
#[cfg(feature = "pinned-buffer")]
pub(crate) use record::RecordedEvent;
#[cfg(test)]
#[allow(unsafe_code)]
pub(crate) mod tests;
