//! The allocator's lock: a futex mutex that never allocates and that a forked child can reset.
//!
//! parking_lot allocates on contention (its thread data and hash table), and cannot be unlocked in
//! a forked child when threads of the parent were parked on it: its unlock path takes a bucket lock
//! of the global parking lot, which another thread of the parent may have held at the fork. This
//! lock's whole state is one word (0 unlocked, 1 locked, 2 locked with sleepers, as in Drepper's
//! "Futexes Are Tricky"), so a child sets it to 0: none of the parent's other threads exist there
//! to sleep on it or be woken.
//!
//! Sleeping and waking are `futex(2)` calls on the state word (`FUTEX_WAIT_PRIVATE`,
//! `FUTEX_WAKE_PRIVATE`).
//!
//! Fork handlers may allocate, as glibc allows in every one of them. The crate's prepare
//! handler holds its locks from before the earlier-registered prepare handlers run (they run
//! last-registered first) until after the earlier-registered parent and child handlers ran (first-
//! registered first): a library whose constructor ran before the crate's registered them. So a
//! lock the forking thread holds for the fork ([`Lock::hold_for_fork`]) lets that thread in
//! again ([`Lock::lock`] returns a guard that releases nothing): every other thread is kept out
//! by the held word, so the forking thread is alone inside, as glibc's own fork handling makes
//! the forking thread alone inside its arenas.
//!
//! Unsafe code here relies on the state word: one guard at a time holds the value; `release` and
//! `reset_in_child` are for the fork handlers, which hold or reset the lock on the forking thread;
//! the futex calls only read that live, aligned word.
#![allow(unsafe_code)]

use std::cell::{Cell, UnsafeCell};
use std::ops::{Deref, DerefMut};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

const UNLOCKED: u32 = 0;
const LOCKED: u32 = 1;
const SLEEPERS: u32 = 2;

/// Spins before sleeping: arena critical sections are short (a few map operations).
const SPINS: u32 = 100;

thread_local! {
    /// Whether this thread holds the fork's locks: between the crate's prepare handler and its
    /// parent or child handler. A child's only thread is a copy of the forking one, so it keeps
    /// the mark until the child handler clears it.
    static FORKING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread holds the fork's locks (it runs fork handlers).
pub(crate) fn forking() -> bool {
    FORKING.with(Cell::get)
}

/// Marks (or unmarks) the calling thread as the one holding the fork's locks.
pub(crate) fn set_forking(forking: bool) {
    FORKING.with(|f| f.set(forking));
}

/// A mutual-exclusion lock around a `T`.
pub(crate) struct Lock<T> {
    state: AtomicU32,
    /// Held by the fork handlers (see the module's documentation).
    fork_held: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, and one guard exists at a time (the state word
// is acquired with Acquire and released with Release), so sharing the lock shares `T` between
// threads one at a time, which `T: Send` allows.
unsafe impl<T: Send> Sync for Lock<T> {}

impl<T> Lock<T> {
    /// An unlocked lock.
    pub(crate) const fn new(value: T) -> Self {
        Lock {
            state: AtomicU32::new(UNLOCKED),
            fork_held: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Waits for the lock; it is released when the guard drops. On the thread that holds it for
    /// a fork, at once (see the module's documentation).
    pub(crate) fn lock(&self) -> Guard<'_, T> {
        if self.try_take() {
            return self.guard(true);
        }
        if self.held_by_this_fork() {
            return self.guard(false);
        }
        self.acquire_contended();
        self.guard(true)
    }

    /// The lock if it is free now (or held for a fork by this thread), without waiting (the exit
    /// report must not block).
    pub(crate) fn try_lock(&self) -> Option<Guard<'_, T>> {
        if self.try_take() {
            return Some(self.guard(true));
        }
        self.held_by_this_fork().then(|| self.guard(false))
    }

    fn try_take(&self) -> bool {
        self.state
            .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    fn guard(&self, releases: bool) -> Guard<'_, T> {
        Guard {
            lock: self,
            releases,
            _not_send: std::marker::PhantomData,
        }
    }

    /// Whether the calling thread holds this lock for a fork. `fork_held` is written by that
    /// thread alone, so its own program order is all the ordering needed; another thread may
    /// read a stale value, but never has `FORKING` set.
    #[cold]
    fn held_by_this_fork(&self) -> bool {
        self.fork_held.load(Ordering::Relaxed) && forking()
    }

    /// Takes the lock for a fork (the prepare handler): until [`Self::release_after_fork`] or
    /// [`Self::reset_in_child`], the calling thread, once marked with [`set_forking`], gets in
    /// again without waiting.
    pub(crate) fn hold_for_fork(&self) {
        self.acquire();
        self.fork_held.store(true, Ordering::Relaxed);
    }

    /// Releases a lock taken with [`Self::hold_for_fork`] (the parent handler); leaves alone one
    /// that was not (an arena a handler's allocation made during the fork, say).
    ///
    /// # Safety
    /// Called by the thread that ran the prepare handler, with no guard of its own on the lock
    /// alive.
    pub(crate) unsafe fn release_after_fork(&self) {
        if self.fork_held.swap(false, Ordering::Relaxed) {
            // SAFETY: held by this thread since `hold_for_fork` (forwarded from the caller).
            unsafe { self.release() };
        }
    }

    /// Waits for the lock without a guard (fork handlers hold locks across calls).
    pub(crate) fn acquire(&self) {
        if self
            .state
            .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.acquire_contended();
        }
    }

    #[cold]
    fn acquire_contended(&self) {
        for _ in 0..SPINS {
            if self.state.load(Ordering::Relaxed) == UNLOCKED
                && self
                    .state
                    .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
            std::hint::spin_loop();
        }
        // Marking the word "sleepers" makes the holder's release wake one of us; a thread that
        // takes the lock this way keeps the mark, since others may still sleep.
        while self.state.swap(SLEEPERS, Ordering::Acquire) != UNLOCKED {
            futex_wait(&self.state, SLEEPERS);
        }
    }

    /// Releases a lock taken with [`Self::acquire`].
    ///
    /// # Safety
    /// The calling thread holds the lock through [`Self::acquire`] (not through a guard).
    pub(crate) unsafe fn release(&self) {
        if self.state.swap(UNLOCKED, Ordering::Release) == SLEEPERS {
            futex_wake(&self.state, 1);
        }
    }

    /// Marks the lock unlocked without waking anyone.
    ///
    /// # Safety
    /// Only in a forked child, on a lock that the fork handler's prepare step held, and before
    /// the child has another thread: the parent's sleepers do not exist in the child.
    pub(crate) unsafe fn reset_in_child(&self) {
        self.fork_held.store(false, Ordering::Relaxed);
        self.state.store(UNLOCKED, Ordering::Relaxed);
    }
}

/// Access to the locked value; releases the lock when dropped. Not `Send`: it is released on the
/// thread that took it.
pub(crate) struct Guard<'a, T> {
    lock: &'a Lock<T>,
    /// False for the forking thread's way in to a lock it holds for the fork.
    releases: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard proves the lock is held, so no other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        if self.releases {
            // SAFETY: the guard was made by `lock`, which acquired the lock on this thread.
            unsafe { self.lock.release() }
        }
    }
}

/// Sleeps while `word` holds `expected` (`FUTEX_WAIT_PRIVATE`, no timeout). Returns on a wake-up,
/// a signal, or at once when the value already differs: callers re-check in a loop.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: the kernel only reads the aligned u32 behind `word`, which outlives the call; the
    // null timeout means "no timeout" and the two unused arguments are ignored for FUTEX_WAIT.
    let waited: std::result::Result<libc::c_long, libc::c_int> = linux_only!(unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            ptr::null::<libc::timespec>(),
        )
    });
    if waited.is_err() {
        // No futex: waiting is yielding, and callers re-check anyway.
        std::thread::yield_now();
    }
}

/// Wakes up to `count` threads sleeping in [`futex_wait`] on `word` (`FUTEX_WAKE_PRIVATE`).
pub(crate) fn futex_wake(word: &AtomicU32, count: u32) {
    let count = i32::try_from(count).unwrap_or(i32::MAX);
    // SAFETY: FUTEX_WAKE only uses the address as a key; `word` is a live, aligned u32.
    let _woken: std::result::Result<libc::c_long, libc::c_int> = linux_only!(unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            count,
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contended_increments_are_all_kept() {
        let counter = Lock::new(0u64);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20_000 {
                        *counter.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(*counter.lock(), 80_000);
    }

    #[test]
    fn the_forking_thread_gets_into_the_locks_it_holds_and_others_wait() {
        let lock = Lock::new(0u32);
        lock.hold_for_fork();
        set_forking(true);
        *lock.lock() += 1;
        assert!(
            lock.try_lock().is_some(),
            "held for the fork by this thread"
        );
        assert_eq!(lock.state.load(Ordering::Relaxed), LOCKED, "still held");
        std::thread::scope(|s| {
            let other = s.spawn(|| lock.try_lock().is_none());
            assert!(other.join().unwrap(), "another thread is kept out");
        });
        set_forking(false);
        assert!(lock.try_lock().is_none(), "unmarked: like any holder's");
        // SAFETY: taken by `hold_for_fork` on this thread; no guard is alive.
        unsafe { lock.release_after_fork() };
        assert_eq!(*lock.lock(), 1);
    }

    #[test]
    fn a_reset_lock_can_be_taken_again() {
        let lock = Lock::new(());
        lock.acquire();
        // SAFETY: no other thread uses this lock; this stands in for a child after fork.
        unsafe { lock.reset_in_child() };
        drop(lock.lock());
        assert_eq!(lock.state.load(Ordering::Relaxed), UNLOCKED);
    }
}
