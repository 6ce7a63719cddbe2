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
//! Unsafe code here relies on the state word: one guard at a time holds the value; `release` and
//! `reset_in_child` are for the fork handlers, which hold or reset the lock on the forking thread;
//! the futex calls only read that live, aligned word.
#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};

const UNLOCKED: u32 = 0;
const LOCKED: u32 = 1;
const SLEEPERS: u32 = 2;

/// Spins before sleeping: arena critical sections are short (a few map operations).
const SPINS: u32 = 100;

/// A mutual-exclusion lock around a `T`.
pub(crate) struct Lock<T> {
    state: AtomicU32,
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
            value: UnsafeCell::new(value),
        }
    }

    /// Waits for the lock; it is released when the guard drops.
    pub(crate) fn lock(&self) -> Guard<'_, T> {
        self.acquire();
        Guard {
            lock: self,
            _not_send: std::marker::PhantomData,
        }
    }

    /// The lock if it is free now, without waiting (the exit report must not block).
    pub(crate) fn try_lock(&self) -> Option<Guard<'_, T>> {
        self.state
            .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Guard {
                lock: self,
                _not_send: std::marker::PhantomData,
            })
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
        self.state.store(UNLOCKED, Ordering::Relaxed);
    }
}

/// Access to the locked value; releases the lock when dropped. Not `Send`: it is released on the
/// thread that took it.
pub(crate) struct Guard<'a, T> {
    lock: &'a Lock<T>,
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
        // SAFETY: the guard was made by `lock`, which acquired the lock on this thread.
        unsafe { self.lock.release() }
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
    fn a_reset_lock_can_be_taken_again() {
        let lock = Lock::new(());
        lock.acquire();
        // SAFETY: no other thread uses this lock; this stands in for a child after fork.
        unsafe { lock.reset_in_child() };
        drop(lock.lock());
        assert_eq!(lock.state.load(Ordering::Relaxed), UNLOCKED);
    }
}
