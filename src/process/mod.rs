//! Process-wide state: the initialisation lock, and the fork handlers that keep it, every node's
//! arena lock (`nodes.rs`) and the CUDA event pool's lock (`cuda/event.rs`, with the
//! feature `pinned-buffer`) consistent in a forked child.
//!
//! A child inherits each lock in the state some other thread of the parent left it in, and that
//! thread does not exist in the child. As glibc, jemalloc and mimalloc do, the `pthread_atfork`
//! prepare handler takes every lock in one fixed order — the initialisation lock, then each node's
//! arena lock in node order, then the event pool's lock — so that no other thread is inside any of
//! them at the fork; the parent handler releases them, and the child handler resets them to
//! unlocked. Nothing else takes them in another order: code holds at most one arena lock at a
//! time, takes the initialisation lock (to build a runtime or make a node's arena) holding none,
//! and takes the event pool's lock holding at most an arena lock (a pending block's event that
//! completed goes back to the pool), locking nothing while it holds it.
//!
//! The prepare handler therefore waits for an initialisation or an arena operation in progress on
//! another thread (a block's mapping, populating and pinning happen outside the arena lock and do
//! not delay a fork). The child never calls CUDA (see `cuda/`); each arena is told it is in a
//! child, so that page-locked blocks are not reused there.
//!
//! Unsafe code here relies on the fork handlers run on the forking thread, holding (then releasing
//! or resetting) every lock in one order.
#![allow(unsafe_code)]

pub(crate) mod decay;
pub(crate) mod faults;
pub(crate) mod job;
mod large;
mod nodes;
pub(crate) mod workers;

pub(crate) use large::{large_path, policy_nodes, LargePath};
pub(crate) use nodes::NODES;

use std::sync::atomic::{AtomicPtr, Ordering};

#[cfg(feature = "pinned-buffer")]
use crate::cuda::event::POOL as EVENT_POOL;
use crate::guard::Inside;
use crate::setup::Setup;
use crate::sys;
use crate::sys::lock::Lock;

/// Held while a runtime is built or a node's arena made, so that a fork never copies a
/// half-built one, and the arenas the fork handlers lock are all there is. It holds what the
/// runtimes share as they are built (the environment's settings, the setup lines printed).
pub(crate) static INIT: Lock<Setup> = Lock::new(Setup::NEW);

/// Registers the fork handlers when the program is loaded, before `main` and before any thread
/// exists, as jemalloc and mimalloc do from their constructors: registered later (say, by the
/// first initialisation), a fork could come between another thread taking [`INIT`] and the
/// registration, and the child would inherit the lock taken. The exit gate's handler is
/// registered here too: a program that loaded libcuda itself before the crate's first probe
/// would otherwise have the driver's teardown run before it.
///
/// Of priority 101, the first a program may use: it runs before the object's constructors of no
/// priority, so in the preload library before its own, which loads libcuda and makes the large
/// path ready.
#[used]
#[link_section = ".init_array.00101"]
static REGISTER_AT_LOAD: extern "C" fn() = register_fork_handlers;

extern "C" fn register_fork_handlers() {
    // Only ENOMEM is possible; then a fork during an allocation may deadlock the child, as it
    // would without this module.
    let _ = sys::at_fork(prepare, parent, child);
    // The exit gate's handler too, before anything loads libcuda (the driver probe registers it
    // again, and fails the probe if it cannot be).
    let _ = crate::cuda::close_at_exit();
}

/// The value in `slot` (an allocator's runtime), built with `make` from the process's [`Setup`]
/// and boxed (its address is stable: the exit report finds it) if there is none yet. Waits for
/// another thread's initialisation of the same slot. Must be called inside the re-entrancy guard.
pub(crate) fn initialise<T>(slot: &AtomicPtr<T>, make: impl FnOnce(&mut Setup) -> T) -> &T {
    // Referenced, so that the linker keeps the object holding the registration.
    std::hint::black_box(&REGISTER_AT_LOAD);
    let mut setup = INIT.lock();
    let mut current = slot.load(Ordering::Acquire);
    if current.is_null() {
        let runtime = Box::into_raw(Box::new(make(&mut setup)));
        slot.store(runtime, Ordering::Release);
        current = runtime;
    }
    // SAFETY: non-null values of `slot` come from `Box::into_raw` above and are freed only by the
    // slot's owner once nobody can call this any more (`NumaGpuAlloc::drop` takes `&mut self`).
    unsafe { &*current }
}

/// Takes every lock, in the fixed order. Allocates nothing.
unsafe extern "C" fn prepare() {
    INIT.hold_for_fork();
    for arena in NODES.arenas() {
        arena.hold_for_fork();
    }
    #[cfg(feature = "pinned-buffer")]
    EVENT_POOL.hold_for_fork();
    // The earlier-registered handlers that run from here to the parent or child handler below
    // may allocate (see `sys/lock.rs`).
    sys::lock::set_forking(true);
}

/// Releases what [`prepare`] took, in reverse order.
unsafe extern "C" fn parent() {
    sys::lock::set_forking(false);
    #[cfg(feature = "pinned-buffer")]
    // SAFETY: `prepare` took it on this thread, and handlers hold no guard across calls.
    unsafe {
        EVENT_POOL.release_after_fork()
    };
    for arena in NODES.arenas().rev() {
        // SAFETY: `prepare` took this arena lock on this thread (no arena is made meanwhile:
        // that takes INIT, which `prepare` holds, and a handler that allocated made it inside
        // that hold, under this thread's own way in).
        unsafe { arena.release_after_fork() };
    }
    // SAFETY: `prepare` took it on this thread.
    unsafe { INIT.release_after_fork() };
}

/// Whether this process is a child forked from one that loaded this crate (CUDA is not called
/// there: `gpu=current` is not followed).
pub(crate) fn in_child() -> bool {
    crate::fork::generation() > 0
}

/// Resets what [`prepare`] took (the parent's other threads do not exist here) and tells each
/// arena it now lives in a child.
unsafe extern "C" fn child() {
    sys::lock::set_forking(false);
    crate::fork::count_fork_in_child();
    crate::cuda::forget_calls_in_child();
    decay::forget_in_child();
    let _inside = Inside::enter();
    #[cfg(feature = "pinned-buffer")]
    // SAFETY: `prepare` took the pool's lock before the fork, and the child has no other thread.
    unsafe {
        EVENT_POOL.reset_in_child()
    };
    for arena in NODES.arenas().rev() {
        // SAFETY: `prepare` took this arena lock before the fork, and the child has no other
        // thread.
        unsafe { arena.reset_in_child() };
        arena.lock().enter_child();
    }
    // SAFETY: as above, for the initialisation lock.
    unsafe { INIT.reset_in_child() };
}

/// Spawns `body` on a thread of its own, named `name`, with a stack of `stack` bytes and every
/// signal blocked, and returns once it runs: the thread's own start-up (its signal stack and
/// guard page: memory) happens now, while the request that needed the thread can still fail
/// cleanly, and not later, when the process may have run out of memory.
pub(crate) fn spawn_started(
    name: &str,
    stack: usize,
    body: impl FnOnce() + Send + 'static,
) -> crate::Result<()> {
    let started = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let flag = std::sync::Arc::clone(&started);
    sys::spawn_detached(
        name,
        stack,
        Box::new(move || {
            flag.store(1, Ordering::Release);
            sys::futex_wake(&flag, 1);
            drop(flag);
            body();
        }),
    )?;
    while started.load(Ordering::Acquire) == 0 {
        sys::futex_wait(&started, 0);
    }
    Ok(())
}
