//! Process-wide state: the initialisation lock, the list of initialised runtimes, and the fork
//! handlers that keep both, and every arena lock, consistent in a forked child.
//!
//! A child inherits each lock in the state some other thread of the parent left it in, and that
//! thread does not exist in the child. As glibc, jemalloc and mimalloc do, the `pthread_atfork`
//! prepare handler takes every lock in one fixed order — the initialisation lock, the runtime list,
//! then each runtime's arena lock in the list's order — so that no other thread is inside any of
//! them at the fork; the parent handler releases them, and the child handler resets them to
//! unlocked. Nothing else takes them in another order: an initialisation takes the runtime list
//! while holding the initialisation lock, and code holding an arena lock takes neither.
//!
//! The prepare handler therefore waits for an initialisation or an arena operation in progress on
//! another thread (a block's mapping, populating and pinning happen outside the arena lock and do
//! not delay a fork). The child never calls CUDA (see `cuda.rs`); each arena is told it is in a child,
//! so that page-locked blocks are not reused there.

use std::sync::atomic::{AtomicPtr, Ordering};

use crate::guard::Inside;
use crate::lock::Lock;
use crate::runtime::Runtime;
use crate::sys;

/// Held while a runtime is built, so that a fork never copies a half-built one.
static INIT: Lock<()> = Lock::new(());

/// Every initialised runtime that is not dropped yet.
static RUNTIMES: Lock<Vec<RuntimePtr>> = Lock::new(Vec::new());

/// Registers the fork handlers when the program is loaded, before `main` and before any thread
/// exists, as jemalloc and mimalloc do from their constructors: registered later (say, by the
/// first initialisation), a fork could come between another thread taking [`INIT`] and the
/// registration, and the child would inherit the lock taken.
#[used]
#[link_section = ".init_array"]
static REGISTER_AT_LOAD: extern "C" fn() = register_fork_handlers;

extern "C" fn register_fork_handlers() {
    // Only ENOMEM is possible; then a fork during an allocation may deadlock the child, as it
    // would without this module.
    let _ = sys::at_fork(prepare, parent, child);
}

/// A runtime in the list: boxed by [`initialise`], removed by [`forget`] before it is freed.
#[derive(Clone, Copy, PartialEq, Eq)]
struct RuntimePtr(*const Runtime);

// SAFETY: `Runtime` is Send + Sync (asserted in `runtime.rs`); the pointer is only dereferenced
// while the runtime is in the list, i.e. alive.
unsafe impl Send for RuntimePtr {}

/// The runtime in `slot`, built with `make` and listed if there is none yet. Waits for another
/// thread's initialisation of the same slot. Must be called inside the re-entrancy guard.
pub(crate) fn initialise(slot: &AtomicPtr<Runtime>, make: impl FnOnce() -> Runtime) -> &Runtime {
    // Referenced, so that the linker keeps the object holding the registration.
    std::hint::black_box(&REGISTER_AT_LOAD);
    let _init = INIT.lock();
    let mut current = slot.load(Ordering::Acquire);
    if current.is_null() {
        let runtime = Box::into_raw(Box::new(make()));
        RUNTIMES.lock().push(RuntimePtr(runtime));
        slot.store(runtime, Ordering::Release);
        current = runtime;
    }
    // SAFETY: non-null values of `slot` come from `Box::into_raw` above and are freed only by the
    // slot's owner once nobody can call this any more (`NumaGpuAlloc::drop` takes `&mut self`).
    unsafe { &*current }
}

/// Removes `runtime` from the list, before its owner frees it.
pub(crate) fn forget(runtime: *const Runtime) {
    RUNTIMES.lock().retain(|r| *r != RuntimePtr(runtime));
}

/// Frees `addr` in the listed runtime other than `except` whose live block it is; whether one
/// was. The list stays locked meanwhile (that runtime cannot be dropped); its arena lock comes
/// after the list's, the fixed order.
pub(crate) fn free_elsewhere(except: *const Runtime, addr: usize) -> bool {
    let runtimes = RUNTIMES.lock();
    runtimes
        .iter()
        .filter(|r| r.0 != except)
        // SAFETY: listed runtimes are alive while the list is locked (see `RuntimePtr`).
        .any(|r| unsafe { &*r.0 }.free_block(addr))
}

/// Takes every lock, in the fixed order. Allocates nothing.
unsafe extern "C" fn prepare() {
    INIT.acquire();
    RUNTIMES.acquire();
    // SAFETY: this thread took RUNTIMES just above and holds it until `parent` or `child`.
    let runtimes = unsafe { RUNTIMES.held() };
    for r in runtimes {
        // SAFETY: listed runtimes are alive (see `RuntimePtr`).
        unsafe { &*r.0 }.arena.acquire();
    }
}

/// Releases what [`prepare`] took, in reverse order.
unsafe extern "C" fn parent() {
    // SAFETY: `prepare` took RUNTIMES on this thread and still holds it.
    let runtimes = unsafe { RUNTIMES.held() };
    for r in runtimes.iter().rev() {
        // SAFETY: listed runtimes are alive; `prepare` took this arena lock on this thread.
        unsafe { (*r.0).arena.release() };
    }
    // SAFETY: `prepare` took both on this thread.
    unsafe {
        RUNTIMES.release();
        INIT.release();
    }
}

/// Resets what [`prepare`] took (the parent's other threads do not exist here) and tells each
/// arena it now lives in a child.
unsafe extern "C" fn child() {
    let _inside = Inside::enter();
    // SAFETY: `prepare` took RUNTIMES on this thread (the child's only one) before the fork.
    let runtimes = unsafe { RUNTIMES.held() };
    for r in runtimes.iter().rev() {
        // SAFETY: listed runtimes are alive (the child has a copy of each); `prepare` took this
        // arena lock, and the child has no other thread.
        let runtime = unsafe { &*r.0 };
        // SAFETY: as above.
        unsafe { runtime.arena.reset_in_child() };
        runtime.arena.lock().enter_child();
    }
    // SAFETY: as above, for the two process-wide locks.
    unsafe {
        RUNTIMES.reset_in_child();
        INIT.reset_in_child();
    }
}

/// Runtimes listed now (for tests).
#[cfg(test)]
pub(crate) fn listed(runtime: *const Runtime) -> bool {
    RUNTIMES.lock().contains(&RuntimePtr(runtime))
}
