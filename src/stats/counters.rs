//! The allocator's counters: relaxed atomics, one per event, no lock (the last pin error's
//! lock is only tried).

use std::ops::Deref;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use super::{CudaErrorCount, Events, Stats, TimeStats};
use crate::sys::lock::Lock;
use crate::sys::once::SetOnce;
use crate::Error;

/// A monotonically increasing event counter.
#[derive(Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Relaxed);
    }
    pub(crate) fn incr(&self) {
        self.add(1);
    }
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// Total and maximum of a duration, in nanoseconds.
#[derive(Default)]
pub(crate) struct Timer {
    total_ns: Counter,
    max_ns: AtomicU64,
}

impl Timer {
    pub(crate) fn record(&self, elapsed: Duration) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.total_ns.add(ns);
        self.max_ns.fetch_max(ns, Relaxed);
    }
    pub(super) fn snapshot(&self) -> TimeStats {
        TimeStats {
            total: Duration::from_nanos(self.total_ns.get()),
            max: Duration::from_nanos(self.max_ns.load(Relaxed)),
        }
    }
    /// Forgets the maximum; the total stays.
    fn reset_max(&self) {
        self.max_ns.store(0, Relaxed);
    }
}

/// How many distinct CUDA error codes are counted separately; the rest share the last slot.
pub(crate) const ERROR_CODE_SLOTS: usize = 8;
pub(super) const FREE_SLOT: u32 = u32::MAX;

/// Registration failures counted by CUDA error code, lock-free.
pub(crate) struct CodeCounts {
    codes: [AtomicU32; ERROR_CODE_SLOTS],
    /// Not `OnceLock`s: one another thread was setting at a fork would stay "running" in the
    /// child, and the child's next failure would wait for it forever.
    names: [SetOnce<&'static str>; ERROR_CODE_SLOTS],
    counts: [AtomicU64; ERROR_CODE_SLOTS],
    /// The last slot also counts codes that found no slot of their own.
    overflowed: std::sync::atomic::AtomicBool,
}

impl Default for CodeCounts {
    fn default() -> Self {
        CodeCounts {
            codes: std::array::from_fn(|_| AtomicU32::new(FREE_SLOT)),
            names: std::array::from_fn(|_| SetOnce::new()),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            overflowed: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl CodeCounts {
    pub(crate) fn record(&self, code: u32, name: &'static str) {
        for slot in 0..ERROR_CODE_SLOTS {
            let claimed = self.codes[slot]
                .compare_exchange(FREE_SLOT, code, Relaxed, Relaxed)
                .unwrap_or_else(|current| current);
            if claimed == code || claimed == FREE_SLOT || slot == ERROR_CODE_SLOTS - 1 {
                if claimed != code && claimed != FREE_SLOT {
                    self.overflowed.store(true, Relaxed);
                }
                self.names[slot].set(name);
                self.counts[slot].fetch_add(1, Relaxed);
                return;
            }
        }
    }
    /// The codes counted so far, in slot order.
    pub(super) fn counts(&self) -> impl Iterator<Item = CudaErrorCount> + '_ {
        (0..ERROR_CODE_SLOTS).filter_map(|slot| {
            let count = self.counts[slot].load(Relaxed);
            let mixed = slot == ERROR_CODE_SLOTS - 1 && self.overflowed.load(Relaxed);
            (count > 0).then(|| CudaErrorCount {
                code: if mixed {
                    FREE_SLOT
                } else {
                    self.codes[slot].load(Relaxed)
                },
                name: if mixed {
                    "other"
                } else {
                    self.names[slot].get().unwrap_or("?")
                },
                count,
            })
        })
    }
}

/// The latest error of a kind, behind the crate's futex lock (one word, never allocates), which is
/// only ever tried, never waited for: a forked child inherits the lock in whatever state another
/// thread of the parent left it, the exit report must not block, and a contended update loses
/// nothing but the latest message.
struct LastError(Lock<Option<Error>>);

impl Default for LastError {
    fn default() -> Self {
        LastError(Lock::new(None))
    }
}

impl LastError {
    /// Keeps `error`, unless another thread holds the slot. Cloning a CUDA error copies numbers
    /// and static strings: no allocation.
    fn set(&self, error: &Error) {
        if let Some(mut last) = self.0.try_lock() {
            *last = Some(error.clone());
        }
    }

    /// Copies the latest error to `out`; while another thread holds the slot, `out` keeps its
    /// own.
    fn copy_into(&self, out: &mut Option<Error>) {
        if let Some(last) = self.0.try_lock() {
            out.clone_from(&last);
        }
    }
}

/// Buckets of [`Stats::requests_by_octave`]: 4 KiB up to 8 TiB and beyond.
pub(crate) const OCTAVES: usize = 32;
/// The smallest bucket's lower bound (the smallest threshold), as a power of two.
pub(super) const FIRST_OCTAVE: u32 = 12;

/// The bucket of a request of `size` bytes.
pub(super) fn octave(size: usize) -> usize {
    let log2 = usize::BITS - 1 - size.max(1).leading_zeros();
    (log2.saturating_sub(FIRST_OCTAVE) as usize).min(OCTAVES - 1)
}

/// The allocator's atomic counters.
#[derive(Default)]
pub(crate) struct Counters {
    /// One per event field of [`Stats`] and [`Fallbacks`](super::Fallbacks), made from their
    /// declaration.
    events: Events,
    pub(crate) pin_failure_codes: CodeCounts,
    pub(crate) populate: Timer,
    pub(crate) pin: Timer,
    pub(crate) unpin: Timer,
    pub(crate) requests_by_octave: [Counter; OCTAVES],
    /// The latest registration or unregistration error.
    last_pin_error: LastError,
}

/// Call sites name an event counter as a field of the counters (`counters.frees.incr()`), wherever
/// its atomic is declared.
impl Deref for Counters {
    type Target = Events;
    fn deref(&self) -> &Events {
        &self.events
    }
}

impl Counters {
    /// Counts a failed registration under its CUDA error code.
    pub(crate) fn record_pin_failure(&self, error: &Error) {
        self.pin_failures.incr();
        self.last_pin_error.set(error);
        if let Error::Cuda { code, name, .. } = error {
            self.pin_failure_codes.record(*code, name);
        }
    }

    /// Counts a block or chunk that could not be made under the step that failed: the cgroup
    /// limit, `mmap`, populating, or a `policy=bind` node out of memory (others are counted
    /// where they happen, or are not memory failures).
    pub(crate) fn record_block_failure(&self, error: &Error) {
        let counter = match error {
            Error::MemoryLimit { .. } => &self.memory_limited,
            Error::Syscall { call: "mmap", .. } => &self.map_failures,
            Error::Syscall {
                call: "madvise(MADV_POPULATE_WRITE)",
                ..
            } => &self.populate_failures,
            Error::Syscall {
                call: "mbind(MPOL_BIND)",
                ..
            } => &self.bind_exhausted,
            _ => return,
        };
        counter.incr();
    }

    /// Counts a request `pin=strict` refused before mapping anything, with why.
    pub(crate) fn record_strict_refusal(&self, error: &Error) {
        self.strict_refused.incr();
        self.last_pin_error.set(error);
    }

    /// Counts a failed unregistration (the block is then leaked, not unmapped).
    pub(crate) fn record_unregister_failure(&self, error: &Error) {
        self.unregister_failures.incr();
        self.last_pin_error.set(error);
        if let Error::Cuda { code, name, .. } = error {
            self.pin_failure_codes.record(*code, name);
        }
    }

    /// Starts the maxima over (see [`NumaGpuAlloc::reset_peaks`](crate::NumaGpuAlloc::reset_peaks)).
    pub(crate) fn reset_peaks(&self) {
        self.populate.reset_max();
        self.pin.reset_max();
        self.unpin.reset_max();
    }

    /// Counts a large request in its power-of-two size bucket.
    pub(crate) fn record_request(&self, size: usize) {
        self.requests_by_octave[octave(size)].incr();
    }

    /// Adds what these counters released and purged (the decay thread's) into `stats`, whose
    /// own counts were copied in before. The CUDA codes of failed unregistrations stay out of
    /// `pin_failures_by_code` (the exit report's room for them is one value's).
    pub(crate) fn add_releases(&self, stats: &mut Stats) {
        stats.released_blocks += self.released_blocks.get();
        stats.unregistrations += self.unregistrations.get();
        stats.fallbacks.unregister_failures += self.unregister_failures.get();
        stats.fallbacks.purge_failures += self.purge_failures.get();
        let unpin = self.unpin.snapshot();
        stats.unpin_time.total += unpin.total;
        stats.unpin_time.max = stats.unpin_time.max.max(unpin.max);
    }

    /// Copies the counters into `stats`. Allocates nothing when `stats.pin_failures_by_code` has
    /// room for [`ERROR_CODE_SLOTS`] entries (the exit report relies on it).
    pub(crate) fn fill(&self, stats: &mut Stats) {
        self.last_pin_error.copy_into(&mut stats.last_pin_error);
        stats.copy_events(&self.events);
        stats.fallbacks.copy_events(&self.events);
        // Every large request is one or the other: derived, and so always consistent with them.
        stats.large_allocations = stats.cache_hits + stats.cache_misses;
        stats.populate_time = self.populate.snapshot();
        stats.pin_time = self.pin.snapshot();
        stats.unpin_time = self.unpin.snapshot();
        for (count, counter) in stats
            .requests_by_octave
            .iter_mut()
            .zip(&self.requests_by_octave)
        {
            *count = counter.get();
        }
        stats.pin_failures_by_code.clear();
        stats
            .pin_failures_by_code
            .extend(self.pin_failure_codes.counts());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_are_counted_per_code() {
        let counts = CodeCounts::default();
        counts.record(2, "CUDA_ERROR_OUT_OF_MEMORY");
        counts.record(712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED");
        counts.record(2, "CUDA_ERROR_OUT_OF_MEMORY");
        let snap: Vec<_> = counts.counts().collect();
        assert_eq!(snap.len(), 2);
        assert_eq!((snap[0].code, snap[0].count), (2, 2));
        assert_eq!((snap[1].code, snap[1].count), (712, 1));
    }

    #[test]
    fn overflowing_codes_share_the_last_slot() {
        let counts = CodeCounts::default();
        for code in 0..20 {
            counts.record(code, "X");
        }
        let snapshot: Vec<_> = counts.counts().collect();
        let total: u64 = snapshot.iter().map(|c| c.count).sum();
        assert_eq!(total, 20);
        assert_eq!(snapshot.last().map(|c| c.name), Some("other"));
    }
}
