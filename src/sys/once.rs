//! One-time state that a fork cannot catch half-done.
//!
//! A `std::sync::OnceLock` that another thread is initialising when the process forks stays
//! "running" in the child, where that thread does not exist: the child's first reader waits
//! forever. [`ForkOnce`] records the fork generation of the thread that runs the initialiser, and
//! a reader of a later generation is told the initialisation was abandoned instead of waiting.
//! [`SetOnce`] never waits at all: a second writer, or a reader during the write, sees nothing.
//!
//! Unsafe code here relies on the state word: the value is written only by the one thread that
//! moved the state from empty to running (or claimed), and read only once the state says done,
//! with Release/Acquire between the two.
#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU32, Ordering};

use super::lock::{futex_wait, futex_wake};

const EMPTY: u32 = 0;
const DONE: u32 = 1;
/// Running states are `RUNNING | generation << 2`, one per fork generation (modulo 2^30).
const RUNNING: u32 = 2;

fn running(generation: u32) -> u32 {
    RUNNING | (generation << 2)
}

/// A value computed once, by the first caller; later callers of the same fork generation wait for
/// it, callers of a later one (a child forked while it was computed) do not.
pub(crate) struct ForkOnce<T> {
    state: AtomicU32,
    value: UnsafeCell<MaybeUninit<T>>,
}

// SAFETY: the value is written once, by one thread, before the state says done (Release), and only
// shared by reference after (Acquire); `T: Send + Sync` lets that reference cross threads.
unsafe impl<T: Send + Sync> Sync for ForkOnce<T> {}

/// A [`ForkOnce`] whose initialiser was running in the parent when this process was forked: it
/// will never finish here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Abandoned;

impl<T> ForkOnce<T> {
    pub(crate) const fn new() -> ForkOnce<T> {
        ForkOnce {
            state: AtomicU32::new(EMPTY),
            value: UnsafeCell::new(MaybeUninit::uninit()),
        }
    }

    /// The value, computed now with `init` if nobody has started it. `generation` is the caller's
    /// fork generation: a caller whose generation differs from the one that started `init`
    /// gets [`Abandoned`] at once (the parent's thread that runs it does not exist here).
    pub(crate) fn get_or_init(
        &self,
        generation: u32,
        init: impl FnOnce() -> T,
    ) -> Result<&T, Abandoned> {
        let mine = running(generation);
        loop {
            match self
                .state
                .compare_exchange(EMPTY, mine, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => return Ok(self.run(init)),
                Err(DONE) => {
                    // SAFETY: the state is done: the value was written before (Acquire above).
                    return Ok(unsafe { (*self.value.get()).assume_init_ref() });
                }
                Err(state) if state == mine => futex_wait(&self.state, state),
                Err(_) => return Err(Abandoned),
            }
        }
    }

    /// Runs `init` on the thread that moved the state to running, and publishes its value; the
    /// state goes back to empty (and waiters retry) if `init` unwinds.
    fn run(&self, init: impl FnOnce() -> T) -> &T {
        struct Unwinding<'a>(&'a AtomicU32);
        impl Drop for Unwinding<'_> {
            fn drop(&mut self) {
                self.0.store(EMPTY, Ordering::Release);
                futex_wake(self.0, u32::MAX);
            }
        }
        let unwinding = Unwinding(&self.state);
        let value = init();
        std::mem::forget(unwinding);
        // SAFETY: this thread moved the state from empty to running; nobody else writes or reads
        // the value until the state says done.
        let value = unsafe { (*self.value.get()).write(value) };
        self.state.store(DONE, Ordering::Release);
        futex_wake(&self.state, u32::MAX);
        value
    }
}

/// A `Copy` value set at most once, by whichever writer comes first; nothing ever waits.
pub(crate) struct SetOnce<T: Copy> {
    state: AtomicU32,
    value: UnsafeCell<MaybeUninit<T>>,
}

// SAFETY: as for `ForkOnce`: one writer, before the state says done; readers after.
unsafe impl<T: Copy + Send + Sync> Sync for SetOnce<T> {}

impl<T: Copy> SetOnce<T> {
    pub(crate) const fn new() -> SetOnce<T> {
        SetOnce {
            state: AtomicU32::new(EMPTY),
            value: UnsafeCell::new(MaybeUninit::uninit()),
        }
    }

    /// Stores `value` unless a value is stored or being stored.
    pub(crate) fn set(&self, value: T) {
        if self
            .state
            .compare_exchange(EMPTY, RUNNING, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            // SAFETY: this thread claimed the slot; nobody reads it before the state says done.
            unsafe { (*self.value.get()).write(value) };
            self.state.store(DONE, Ordering::Release);
        }
    }

    /// The stored value, if one was stored completely.
    pub(crate) fn get(&self) -> Option<T> {
        (self.state.load(Ordering::Acquire) == DONE).then(|| {
            // SAFETY: the state is done: the value was written before (Acquire above).
            unsafe { (*self.value.get()).assume_init() }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_computed_once_and_waited_for() {
        let once = ForkOnce::new();
        let calls = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let v = once.get_or_init(0, || {
                        calls.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        7
                    });
                    assert_eq!(v, Ok(&7));
                });
            }
        });
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_later_generation_does_not_wait_for_an_abandoned_initialiser() {
        let once: ForkOnce<u32> = ForkOnce::new();
        // As a child sees it: the parent's thread (generation 0) was running the initialiser.
        once.state.store(running(0), Ordering::Relaxed);
        assert_eq!(once.get_or_init(1, || 1), Err(Abandoned));
    }

    #[test]
    fn a_set_once_keeps_the_first_value() {
        let slot = SetOnce::new();
        assert_eq!(slot.get(), None);
        slot.set("first");
        slot.set("second");
        assert_eq!(slot.get(), Some("first"));
    }
}
