//! Fault injection for tests (feature `fault-injection`; never enable it in production).
//!
//! An injected fault stands in for the kernel's answer, after argument checks: the function
//! returns exactly what it would if the syscall had failed with that errno (so an injected EPERM
//! into [`bind`](super::bind) gives [`Error::NumaUnavailable`](crate::Error::NumaUnavailable), an
//! injected EINVAL into a first [`populate`](super::populate) falls back to touching pages).
//! Faults are process-wide and thread-safe (one atomic per point); tests that inject must
//! serialise with every other test of their binary that reaches these calls.
//!
//! Without the feature nothing is ever injected, and the checks compile away.

#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A syscall site that can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    /// The `mmap` of [`map_anonymous`](super::map_anonymous).
    Mmap,
    /// The `mbind` of [`bind`](super::bind).
    Mbind,
    /// The `madvise(MADV_POPULATE_WRITE)` of [`populate`](super::populate), at every attempt
    /// (EINTR is retried).
    Populate,
    /// The `move_pages` of [`page_nodes`](super::page_nodes) (first batch).
    MovePages,
    /// The `madvise(MADV_DONTNEED)` of [`advise_dontneed`](super::advise_dontneed), which purges
    /// idle free ranges (EINVAL stands in for locked memory).
    #[cfg(feature = "fault-injection")]
    Purge,
    /// The CUDA registration (`cuMemHostRegister_v2`) of a chunk or a dedicated block. The
    /// injected value is the `CUresult` code. A chunk meets it where it would be registered
    /// (a GPU targeted, pinning on); a dedicated block wherever pinning is on, even without
    /// a GPU (not checked with `pin=off`, which never registers).
    #[cfg(feature = "fault-injection")]
    Register,
}

// Per point: errno in the high 32 bits, remaining count in the low 32, so that one
// compare-exchange reads and consumes both consistently.
#[cfg(feature = "fault-injection")]
static FAULTS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

#[cfg(feature = "fault-injection")]
fn slot(point: FaultPoint) -> &'static AtomicU64 {
    &FAULTS[point as usize]
}

/// Makes the next `count` calls at `point` fail with `errno` (`u32::MAX`: until [`clear`]).
/// Replaces any fault pending at that point; `count == 0` removes it.
#[cfg(feature = "fault-injection")]
pub fn inject(point: FaultPoint, errno: i32, count: u32) {
    slot(point).store(
        (u64::from(errno as u32) << 32) | u64::from(count),
        Ordering::SeqCst,
    );
}

/// Removes every pending fault and forgets which populate method works, so the next
/// [`populate`](super::populate) probes `MADV_POPULATE_WRITE` again.
#[cfg(feature = "fault-injection")]
pub fn clear() {
    for f in &FAULTS {
        f.store(0, Ordering::SeqCst);
    }
    PROBE_AGAIN.store(true, Ordering::SeqCst);
}

/// Set by [`clear`], taken by the next [`populate`](super::populate): the fault state knows
/// nothing of populate's, populate asks.
#[cfg(feature = "fault-injection")]
static PROBE_AGAIN: AtomicBool = AtomicBool::new(false);

/// Whether [`clear`] ran since the last call: [`populate`](super::populate) then forgets the
/// method it probed.
#[cfg(feature = "fault-injection")]
pub(super) fn cleared() -> bool {
    PROBE_AGAIN.load(Ordering::SeqCst) && PROBE_AGAIN.swap(false, Ordering::SeqCst)
}

/// How many calls at `point` will still fail (`u32::MAX`: until cleared).
#[cfg(feature = "fault-injection")]
pub fn remaining(point: FaultPoint) -> u32 {
    slot(point).load(Ordering::SeqCst) as u32
}

#[cfg(feature = "fault-injection")]
static IGNORE_IN_FLIGHT: AtomicBool = AtomicBool::new(false);

/// Makes frees ignore GPU work recorded against a block, so that it is cached (and reused) at
/// once: stream-ordered reuse switched off, for tests that show they catch the bug. Process-wide;
/// [`clear`] does not reset it.
#[cfg(feature = "fault-injection")]
pub fn ignore_in_flight(on: bool) {
    IGNORE_IN_FLIGHT.store(on, Ordering::SeqCst);
}

/// Whether [`ignore_in_flight`] is on.
#[cfg(feature = "fault-injection")]
pub(crate) fn in_flight_ignored() -> bool {
    IGNORE_IN_FLIGHT.load(Ordering::SeqCst)
}

/// Consumes one pending fault at `point`, returning its errno.
#[cfg(feature = "fault-injection")]
pub(crate) fn injected(point: FaultPoint) -> Option<i32> {
    let slot = slot(point);
    let mut cur = slot.load(Ordering::SeqCst);
    loop {
        let count = cur as u32;
        let errno = (cur >> 32) as u32 as i32;
        if count == 0 {
            return None;
        }
        if count == u32::MAX {
            return Some(errno);
        }
        match slot.compare_exchange_weak(cur, cur - 1, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return Some(errno),
            Err(now) => cur = now,
        }
    }
}

/// Never a fault without the feature.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn injected(_point: FaultPoint) -> Option<i32> {
    None
}

/// Never on without the feature.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn in_flight_ignored() -> bool {
    false
}

/// Never cleared without the feature.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(super) fn cleared() -> bool {
    false
}
