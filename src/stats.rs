//! Counters kept by an allocator and the [`Stats`] snapshot users read.
//!
//! Hot counters are relaxed atomics (one per event, no lock); per-node byte counts live in the
//! arena and are updated under the arena lock the allocation already holds.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

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
    fn snapshot(&self) -> TimeStats {
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
const FREE_SLOT: u32 = u32::MAX;

/// Registration failures counted by CUDA error code, lock-free.
pub(crate) struct CodeCounts {
    codes: [AtomicU32; ERROR_CODE_SLOTS],
    names: [std::sync::OnceLock<&'static str>; ERROR_CODE_SLOTS],
    counts: [AtomicU64; ERROR_CODE_SLOTS],
    /// The last slot also counts codes that found no slot of their own.
    overflowed: std::sync::atomic::AtomicBool,
}

impl Default for CodeCounts {
    fn default() -> Self {
        CodeCounts {
            codes: std::array::from_fn(|_| AtomicU32::new(FREE_SLOT)),
            names: std::array::from_fn(|_| std::sync::OnceLock::new()),
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
                let _ = self.names[slot].set(name);
                self.counts[slot].fetch_add(1, Relaxed);
                return;
            }
        }
    }
    /// The codes counted so far, in slot order.
    fn counts(&self) -> impl Iterator<Item = CudaErrorCount> + '_ {
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
                    self.names[slot].get().copied().unwrap_or("?")
                },
                count,
            })
        })
    }
}

/// The lock's guard when it is free (a poisoned lock still holds a valid `Option<Error>`).
fn try_lock<T>(lock: &std::sync::Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match lock.try_lock() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Buckets of [`Stats::requests_by_octave`]: 4 KiB up to 8 TiB and beyond.
const OCTAVES: usize = 32;
/// The smallest bucket's lower bound (the smallest threshold), as a power of two.
const FIRST_OCTAVE: u32 = 12;

/// The bucket of a request of `size` bytes.
fn octave(size: usize) -> usize {
    let log2 = usize::BITS - 1 - size.max(1).leading_zeros();
    (log2.saturating_sub(FIRST_OCTAVE) as usize).min(OCTAVES - 1)
}

/// The allocator's atomic counters.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) frees: Counter,
    pub(crate) cache_hits: Counter,
    pub(crate) cache_misses: Counter,
    pub(crate) failed_allocations: Counter,
    pub(crate) unplaced_blocks: Counter,
    pub(crate) unpinned_blocks: Counter,
    pub(crate) pin_failures: Counter,
    pub(crate) pin_failure_codes: CodeCounts,
    pub(crate) registrations: Counter,
    pub(crate) unregistrations: Counter,
    pub(crate) unregister_failures: Counter,
    pub(crate) bind_exhausted: Counter,
    pub(crate) map_failures: Counter,
    pub(crate) populate_failures: Counter,
    pub(crate) placement_failures: Counter,
    pub(crate) unverified_blocks: Counter,
    pub(crate) foreign_frees: Counter,
    pub(crate) released_blocks: Counter,
    pub(crate) in_place_reallocs: Counter,
    pub(crate) grown_without_copy: Counter,
    pub(crate) in_flight_recorded: Counter,
    pub(crate) reuse_deferred: Counter,
    pub(crate) pressure_retries: Counter,
    pub(crate) pressure_released: Counter,
    pub(crate) memory_limited: Counter,
    pub(crate) strict_refused: Counter,
    pub(crate) pages_checked: Counter,
    pub(crate) pages_misplaced: Counter,
    pub(crate) populate: Timer,
    pub(crate) pin: Timer,
    pub(crate) unpin: Timer,
    pub(crate) requests_by_octave: [Counter; OCTAVES],
    /// The latest registration or unregistration error (taken on failures and snapshots only; std's
    /// futex mutex does not allocate).
    pub(crate) last_pin_error: std::sync::Mutex<Option<Error>>,
}

impl Counters {
    /// Counts a failed registration under its CUDA error code.
    pub(crate) fn record_pin_failure(&self, error: &Error) {
        self.pin_failures.incr();
        self.set_last_pin_error(error);
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
        self.set_last_pin_error(error);
    }

    /// Counts a failed unregistration (the block is then leaked, not unmapped).
    pub(crate) fn record_unregister_failure(&self, error: &Error) {
        self.unregister_failures.incr();
        self.set_last_pin_error(error);
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

    fn set_last_pin_error(&self, error: &Error) {
        // Only tried: a forked child inherits this lock in whatever state another thread of the
        // parent left it, and a contended update loses nothing but the latest message. Cloning a
        // CUDA error copies numbers and static strings: no allocation.
        if let Some(mut last) = try_lock(&self.last_pin_error) {
            *last = Some(error.clone());
        }
    }

    /// Copies the counters into `stats`. Allocates nothing when `stats.pin_failures_by_code` has
    /// room for [`ERROR_CODE_SLOTS`] entries (the exit report relies on it).
    pub(crate) fn fill(&self, stats: &mut Stats) {
        // Only tried, as above (the exit report must not block); contended: the snapshot's own.
        if let Some(last) = try_lock(&self.last_pin_error) {
            stats.last_pin_error = last.clone();
        }
        stats.frees = self.frees.get();
        stats.cache_hits = self.cache_hits.get();
        stats.cache_misses = self.cache_misses.get();
        // Every large request is one or the other: derived, and so always consistent with them.
        stats.large_allocations = stats.cache_hits + stats.cache_misses;
        stats.in_place_reallocs = self.in_place_reallocs.get();
        stats.grown_without_copy = self.grown_without_copy.get();
        stats.in_flight_recorded = self.in_flight_recorded.get();
        stats.reuse_deferred = self.reuse_deferred.get();
        stats.pressure_retries = self.pressure_retries.get();
        stats.pressure_released_blocks = self.pressure_released.get();
        stats.released_blocks = self.released_blocks.get();
        stats.registrations = self.registrations.get();
        stats.unregistrations = self.unregistrations.get();
        stats.pages_checked = self.pages_checked.get();
        stats.pages_misplaced = self.pages_misplaced.get();
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
        stats.fallbacks = Fallbacks {
            unplaced_blocks: self.unplaced_blocks.get(),
            unpinned_blocks: self.unpinned_blocks.get(),
            pin_failures: self.pin_failures.get(),
            unregister_failures: self.unregister_failures.get(),
            failed_allocations: self.failed_allocations.get(),
            bind_exhausted: self.bind_exhausted.get(),
            map_failures: self.map_failures.get(),
            populate_failures: self.populate_failures.get(),
            memory_limited: self.memory_limited.get(),
            strict_refused: self.strict_refused.get(),
            placement_failures: self.placement_failures.get(),
            unverified_blocks: self.unverified_blocks.get(),
            foreign_frees: self.foreign_frees.get(),
        };
    }
}

/// Total and longest time spent in one kind of step (in JSON: nanoseconds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct TimeStats {
    /// Sum over all blocks.
    #[cfg_attr(feature = "serde", serde(serialize_with = "crate::stats_json::nanos"))]
    pub total: Duration,
    /// The longest single block (since the last [`reset_peaks`](crate::NumaGpuAlloc::reset_peaks)).
    #[cfg_attr(feature = "serde", serde(serialize_with = "crate::stats_json::nanos"))]
    pub max: Duration,
}

/// Registration (and unregistration) failures with one CUDA error code; the last slot of the
/// fixed table collects every further code, and is named `other` then.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct CudaErrorCount {
    /// The `CUresult` number (`u32::MAX` for the `other` row).
    pub code: u32,
    /// The `CUresult` name, or `other` for the row that collects codes beyond the table's size.
    pub name: &'static str,
    /// How many registrations failed with it.
    pub count: u64,
}

/// Degraded modes and failures, each counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Fallbacks {
    /// Blocks mapped without NUMA placement: the kernel refuses NUMA calls (see
    /// [`Stats::numa_unavailable`]), or refused this block's `preferred`/`interleave` policy
    /// (also counted in `placement_failures`).
    pub unplaced_blocks: u64,
    /// Blocks handed out without page-locking (pinning off, or under `pin=on` no GPU or a failed
    /// registration).
    pub unpinned_blocks: u64,
    /// `cuMemHostRegister` calls that failed.
    pub pin_failures: u64,
    /// `cuMemHostUnregister` calls that failed; those blocks are leaked rather than unmapped
    /// while the driver still holds them.
    pub unregister_failures: u64,
    /// Large requests that returned null / `AllocError`.
    pub failed_allocations: u64,
    /// Of those: `policy=bind` blocks that could not be placed entirely on the node.
    pub bind_exhausted: u64,
    /// Of those: `mmap` failures.
    pub map_failures: u64,
    /// Of those: populating failed (out of memory).
    pub populate_failures: u64,
    /// Of those: the block would have exceeded a cgroup's `memory.max` (populating it would
    /// have summoned the OOM killer).
    pub memory_limited: u64,
    /// Of those: `pin=strict` requests refused before anything was mapped, since no block could
    /// be page-locked for their target (no CUDA driver, no GPU for it, a forked child; the
    /// reason is in `last_pin_error` and `config_errors`).
    pub strict_refused: u64,
    /// `mbind` or the page check failed for another reason than NUMA being unavailable (e.g.
    /// EINVAL for a node the kernel or cpuset does not allow): the block went unplaced under
    /// `preferred`/`interleave`, the allocation failed under `bind` or a failed page check.
    pub placement_failures: u64,
    /// Blocks that `verify=on` or `policy=bind` could not check page by page because the kernel
    /// refused `move_pages` (seccomp); `bind` then lets `mbind(MPOL_MF_STRICT)` check instead.
    pub unverified_blocks: u64,
    /// Large frees of pointers no arena holds: memory the inner allocator served while inside
    /// the allocator or before initialisation lowered the threshold (passed on to it). Blocks of
    /// another `NumaGpuAlloc` value are not counted: they go back to their node's arena.
    pub foreign_frees: u64,
}

/// Per-node byte and block counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct NodeStats {
    /// NUMA node id.
    pub node: usize,
    /// Bytes (block capacities) handed out and not yet freed.
    pub live_bytes: usize,
    /// Highest `live_bytes` seen (since the last
    /// [`reset_peaks`](crate::NumaGpuAlloc::reset_peaks)).
    pub peak_live_bytes: usize,
    /// Bytes of freed blocks kept for reuse.
    pub cached_bytes: usize,
    /// Bytes page-locked with CUDA (live and cached).
    pub pinned_bytes: usize,
    /// Blocks handed out and not yet freed.
    pub live_blocks: usize,
    /// Blocks kept for reuse.
    pub cached_blocks: usize,
    /// Freed blocks that GPU work may still use, reusable once it completed (they count against
    /// the cache limit).
    pub pending_blocks: usize,
    /// Their bytes.
    pub pending_bytes: usize,
    /// Chunks mapped (blocks are carved from them).
    pub chunks: usize,
    /// Bytes of those chunks.
    pub mapped_bytes: usize,
    /// Of those, bytes resident (populated and not purged since).
    pub resident_bytes: usize,
    /// The largest free range of one chunk.
    pub largest_free: usize,
    /// Chunks page-locked with CUDA (one registration each).
    pub registrations: u64,
    /// Bytes of idle free ranges given back to the kernel (`MADV_DONTNEED`) so far.
    pub purged_bytes: u64,
    /// Idle cached dedicated blocks the decay thread released (they count in no value's
    /// `released_blocks`).
    pub decay_released: u64,
}

impl NodeStats {
    /// Free bytes of the chunks over their mapped bytes (0 without chunks).
    pub fn fragmentation(&self) -> f64 {
        let free = self.cached_bytes.min(self.mapped_bytes);
        if self.mapped_bytes == 0 {
            0.0
        } else {
            free as f64 / self.mapped_bytes as f64
        }
    }
}

/// The chunks of one kind on one node: the memory the arena carves blocks from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct HeapStats {
    /// NUMA node id of the arena.
    pub node: usize,
    /// The chunks' NUMA policy.
    pub policy: crate::MemPolicy,
    /// Whether they are page-locked.
    pub pinned: bool,
    /// Whether they serve blocks of 2 MiB and more, advised `MADV_HUGEPAGE`.
    pub huge_pages: bool,
    /// Chunks mapped now.
    pub chunks: usize,
    /// Their bytes.
    pub mapped_bytes: usize,
    /// Resident bytes of them.
    pub resident_bytes: usize,
    /// Page-locked bytes of them.
    pub pinned_bytes: usize,
    /// Free bytes in them.
    pub free_bytes: usize,
    /// Free ranges in them.
    pub free_ranges: usize,
    /// The largest free range.
    pub largest_free: usize,
    /// Chunks made so far.
    pub chunks_made: u64,
    /// Chunks registered so far.
    pub registrations: u64,
    /// Bytes purged so far.
    pub purged_bytes: u64,
}

impl HeapStats {
    /// Free bytes over mapped bytes (0 without chunks).
    pub fn fragmentation(&self) -> f64 {
        if self.mapped_bytes == 0 {
            0.0
        } else {
            self.free_bytes as f64 / self.mapped_bytes as f64
        }
    }

    /// Adds `other`'s sizes and counts to these (the largest free range is the larger one).
    pub(crate) fn add(&mut self, other: &HeapStats) {
        self.chunks += other.chunks;
        self.mapped_bytes += other.mapped_bytes;
        self.resident_bytes += other.resident_bytes;
        self.pinned_bytes += other.pinned_bytes;
        self.free_bytes += other.free_bytes;
        self.free_ranges += other.free_ranges;
        self.largest_free = self.largest_free.max(other.largest_free);
        self.chunks_made += other.chunks_made;
        self.registrations += other.registrations;
        self.purged_bytes += other.purged_bytes;
    }
}

/// The blocks one node's arena handed out for requests routed to one GPU: which GPUs each node
/// serves, and how much. Cached blocks are the node's (any GPU may reuse them, see
/// [`NodeStats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct GpuStats {
    /// CUDA device ordinal.
    pub ordinal: u32,
    /// NUMA node id of the arena.
    pub node: usize,
    /// Bytes handed out for this GPU and not yet freed.
    pub live_bytes: usize,
    /// Highest `live_bytes` seen (since the last
    /// [`reset_peaks`](crate::NumaGpuAlloc::reset_peaks)).
    pub peak_live_bytes: usize,
    /// The page-locked part of `live_bytes`.
    pub pinned_bytes: usize,
    /// Blocks handed out for this GPU and not yet freed.
    pub live_blocks: usize,
}

/// A snapshot of one allocator's state, from [`NumaGpuAlloc::stats`](crate::NumaGpuAlloc::stats).
///
/// Each counter is read on its own (relaxed atomics), so figures read while other threads allocate
/// may be a moment apart. `Display` gives a table, [`Stats::json`] one line of JSON, and with the
/// `serde` feature the snapshot implements `Serialize` (the same JSON from `serde_json`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Stats {
    /// Whether the large path has been initialised (it is, lazily, on the first large request).
    pub initialized: bool,
    /// Size from which requests take the large path.
    pub threshold: usize,
    /// Node large blocks are placed on, when known.
    pub host_node: Option<usize>,
    /// The GPU's own node, when there is a GPU and it is known.
    pub home_node: Option<usize>,
    /// The GPU, e.g. `0 (0000:81:00.0) NVIDIA H200`, when one is used.
    pub gpu: Option<String>,
    /// Whether blocks are page-locked with CUDA.
    pub pinning: bool,
    /// Per node: the process's arenas, shared by every allocator value.
    pub nodes: Vec<NodeStats>,
    /// Per node and kind of chunk (policy, pinning, page size), in node order. Not refreshed by
    /// the report at exit.
    pub heaps: Vec<HeapStats>,
    /// Per GPU and node, for requests routed to a GPU the CUDA driver knows (by the allocator's
    /// target or a thread's [`Route`](crate::Route)), in node order. Not refreshed by the report
    /// at exit.
    pub gpus: Vec<GpuStats>,
    /// Large requests that reached the cache: hits + misses. A miss whose block could not be made
    /// failed, and is counted here and in `fallbacks.failed_allocations`; a request refused
    /// before the cache (`pin=strict` with nothing to page-lock, a size too large to round up to
    /// its class) is counted only there.
    pub large_allocations: u64,
    /// Large blocks freed by the user.
    pub frees: u64,
    /// Large allocations served from the cache.
    pub cache_hits: u64,
    /// Large requests no cached block served: a new block was made for each, or could not be
    /// (then the request failed); growths without copy count too.
    pub cache_misses: u64,
    /// Reallocations done in place, within the block's capacity.
    pub in_place_reallocs: u64,
    /// Reallocations that grew an unpinned block by moving its pages into a larger mapping
    /// (`mremap`, no copy; also counted as a miss and a free).
    pub grown_without_copy: u64,
    /// GPU uses (events) recorded against live blocks.
    pub in_flight_recorded: u64,
    /// Cache misses while a pending block would have fitted: reuse deferred by GPU work.
    pub reuse_deferred: u64,
    /// Block creations retried after cached blocks were given back for want of memory.
    pub pressure_retries: u64,
    /// Cached blocks given back for those retries (oldest first).
    pub pressure_released_blocks: u64,
    /// Blocks unmapped (cache limit, `trim()`, failed placement).
    pub released_blocks: u64,
    /// Successful `cuMemHostRegister` calls.
    pub registrations: u64,
    /// `cuMemHostUnregister` calls.
    pub unregistrations: u64,
    /// Pages checked with `move_pages` (`verify=on`, or `policy=bind`).
    pub pages_checked: u64,
    /// Checked pages found off the intended node(s).
    pub pages_misplaced: u64,
    /// Time spent populating blocks.
    pub populate_time: TimeStats,
    /// Time spent registering blocks with CUDA.
    pub pin_time: TimeStats,
    /// Time spent unregistering blocks (`cuMemHostUnregister`, when a pinned block is released).
    pub unpin_time: TimeStats,
    /// Large requests by size: entry `k` counts requests of `4 KiB << k` bytes up to (not
    /// including) twice that; the last entry also counts everything larger.
    pub requests_by_octave: [u64; OCTAVES],
    /// Degraded modes and failures.
    pub fallbacks: Fallbacks,
    /// Registration failures by CUDA error.
    pub pin_failures_by_code: Vec<CudaErrorCount>,
    /// The latest failed registration or unregistration, with the CUDA call, code and name, or
    /// why `pin=strict` refused a request (in JSON: the message).
    #[cfg_attr(
        feature = "serde",
        serde(serialize_with = "crate::stats_json::message")
    )]
    pub last_pin_error: Option<Error>,
    /// Why NUMA placement is off, when the kernel refused it (in JSON: the message).
    #[cfg_attr(
        feature = "serde",
        serde(serialize_with = "crate::stats_json::message")
    )]
    pub numa_unavailable: Option<Error>,
    /// Rejected `NUMA_GPU_ALLOC` entries and other setup problems: every problem that applies to
    /// this value. Each was also printed to stderr, the environment's once per process, the
    /// value's own settings' by this value (in JSON: the messages).
    #[cfg_attr(
        feature = "serde",
        serde(serialize_with = "crate::stats_json::messages")
    )]
    pub config_errors: Vec<Error>,
}

impl Stats {
    /// The smallest request size counted in bucket `k` of [`Stats::requests_by_octave`]
    /// (`4 KiB << k`).
    pub fn octave_start(k: usize) -> usize {
        1usize << (FIRST_OCTAVE as usize + k.min(OCTAVES - 1))
    }

    /// Live bytes over all nodes.
    pub fn live_bytes(&self) -> usize {
        self.nodes.iter().map(|n| n.live_bytes).sum()
    }
    /// Cached bytes over all nodes.
    pub fn cached_bytes(&self) -> usize {
        self.nodes.iter().map(|n| n.cached_bytes).sum()
    }
    /// Pinned bytes over all nodes.
    pub fn pinned_bytes(&self) -> usize {
        self.nodes.iter().map(|n| n.pinned_bytes).sum()
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// A byte count in the largest binary unit that keeps a whole or one-decimal number: `4 KiB`,
/// `2.5 MiB`, `64 GiB` (the threshold ranges from 4 KiB to 64 GiB). Without allocating.
struct Size(usize);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = ["B", "KiB", "MiB", "GiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < units.len() {
            value /= 1024.0;
            unit += 1;
        }
        let tenths = (value * 10.0).round();
        if tenths % 10.0 == 0.0 {
            write!(f, "{} {}", tenths / 10.0, units[unit])
        } else {
            write!(f, "{value:.1} {}", units[unit])
        }
    }
}

/// A node id, or `-` when unknown (without allocating: the exit report prints this).
struct Opt(Option<usize>);

impl fmt::Display for Opt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(v) => write!(f, "{v}"),
            None => f.write_str("-"),
        }
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "numa-gpu-alloc: host node {}, GPU {} (home node {}), pinning {}, threshold {}",
            Opt(self.host_node),
            self.gpu.as_deref().unwrap_or("none"),
            Opt(self.home_node),
            if self.pinning { "on" } else { "off" },
            Size(self.threshold)
        )?;
        writeln!(
            f,
            "{:>4} {:>12} {:>12} {:>12} {:>12} {:>6} {:>6} {:>6} {:>12} {:>12} {:>12} {:>5}",
            "node",
            "live MiB",
            "peak MiB",
            "cached MiB",
            "pinned MiB",
            "live",
            "cached",
            "chunks",
            "mapped MiB",
            "resident MiB",
            "largest MiB",
            "frag"
        )?;
        for n in &self.nodes {
            writeln!(
                f,
                "{:>4} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>6} {:>6} {:>6} {:>12.1} {:>12.1} \
                 {:>12.1} {:>5.2}",
                n.node,
                mib(n.live_bytes),
                mib(n.peak_live_bytes),
                mib(n.cached_bytes),
                mib(n.pinned_bytes),
                n.live_blocks,
                n.cached_blocks,
                n.chunks,
                mib(n.mapped_bytes),
                mib(n.resident_bytes),
                mib(n.largest_free),
                n.fragmentation()
            )?;
        }
        for h in &self.heaps {
            writeln!(
                f,
                "chunks on node {} ({:?}{}{}): {} ({:.1} MiB, {:.1} resident, {:.1} free in {} \
                 ranges, largest {:.1}), made {}, registered {}, purged {:.1} MiB",
                h.node,
                h.policy,
                if h.pinned { ", pinned" } else { "" },
                if h.huge_pages { ", huge pages" } else { "" },
                h.chunks,
                mib(h.mapped_bytes),
                mib(h.resident_bytes),
                mib(h.free_bytes),
                h.free_ranges,
                mib(h.largest_free),
                h.chunks_made,
                h.registrations,
                h.purged_bytes as f64 / f64::from(1u32 << 20)
            )?;
        }
        for g in &self.gpus {
            writeln!(
                f,
                "gpu {} on node {}: live {:.1} MiB ({} blocks, {:.1} MiB pinned), peak {:.1} MiB",
                g.ordinal,
                g.node,
                mib(g.live_bytes),
                g.live_blocks,
                mib(g.pinned_bytes),
                mib(g.peak_live_bytes)
            )?;
        }
        writeln!(
            f,
            "large allocations {} (cache hits {}, misses {}), frees {}, in-place reallocs {}, \
             grown without copy {}, released blocks {}",
            self.large_allocations,
            self.cache_hits,
            self.cache_misses,
            self.frees,
            self.in_place_reallocs,
            self.grown_without_copy,
            self.released_blocks
        )?;
        writeln!(
            f,
            "populate {:.3?} total, {:.3?} max; pin {:.3?} total, {:.3?} max; unpin {:.3?} total, \
             {:.3?} max; registrations {}, unregistrations {}",
            self.populate_time.total,
            self.populate_time.max,
            self.pin_time.total,
            self.pin_time.max,
            self.unpin_time.total,
            self.unpin_time.max,
            self.registrations,
            self.unregistrations
        )?;
        if self.requests_by_octave.iter().any(|&n| n > 0) {
            f.write_str("requests by size:")?;
            for (k, &n) in self.requests_by_octave.iter().enumerate() {
                if n > 0 {
                    write!(f, " {}+ {n}", Size(Stats::octave_start(k)))?;
                }
            }
            writeln!(f)?;
        }
        writeln!(
            f,
            "pages checked {}, misplaced {}",
            self.pages_checked, self.pages_misplaced
        )?;
        let (blocks, bytes) = self.nodes.iter().fold((0, 0), |(n, b), row| {
            (n + row.pending_blocks, b + row.pending_bytes)
        });
        writeln!(
            f,
            "pending {blocks} blocks ({:.1} MiB), GPU uses recorded {}, reuse deferred {}; \
             retries after giving back {} cached blocks: {}",
            mib(bytes),
            self.in_flight_recorded,
            self.reuse_deferred,
            self.pressure_released_blocks,
            self.pressure_retries
        )?;
        let fb = &self.fallbacks;
        writeln!(
            f,
            "fallbacks: unplaced {}, unpinned {}, unverified {}, pin failures {}, unregister \
             failures {}, failed \
             allocations {} (bind exhausted {}, mmap {}, placement {}, populate {}, memory limit \
             {}, strict refused {}), foreign frees {}",
            fb.unplaced_blocks,
            fb.unpinned_blocks,
            fb.unverified_blocks,
            fb.pin_failures,
            fb.unregister_failures,
            fb.failed_allocations,
            fb.bind_exhausted,
            fb.map_failures,
            fb.placement_failures,
            fb.populate_failures,
            fb.memory_limited,
            fb.strict_refused,
            fb.foreign_frees
        )?;
        for c in &self.pin_failures_by_code {
            writeln!(f, "pin failure {} ({}): {}", c.name, c.code, c.count)?;
        }
        if let Some(e) = &self.last_pin_error {
            writeln!(f, "last pin failure: {e}")?;
        }
        if let Some(e) = &self.numa_unavailable {
            writeln!(f, "NUMA unavailable: {e}")?;
        }
        for e in &self.config_errors {
            writeln!(f, "setup: {e}")?;
        }
        Ok(())
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
    fn requests_fall_into_power_of_two_buckets() {
        assert_eq!(octave(4096), 0);
        assert_eq!(octave(8191), 0);
        assert_eq!(octave(2 << 20), 9);
        assert_eq!(octave((4 << 20) - 1), 9);
        assert_eq!(octave(usize::MAX), OCTAVES - 1);
        assert_eq!(Stats::octave_start(9), 2 << 20);
        let counters = Counters::default();
        counters.record_request(3 << 20);
        counters.record_request(100 << 20);
        counters.record_request(64 << 20);
        let mut stats = Stats::default();
        counters.fill(&mut stats);
        assert_eq!(
            (stats.requests_by_octave[9], stats.requests_by_octave[14]),
            (1, 2)
        );
        assert_eq!(stats.requests_by_octave.iter().sum::<u64>(), 3);
        assert!(
            stats
                .to_string()
                .contains("requests by size: 2 MiB+ 1 64 MiB+ 2"),
            "{stats}"
        );
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

    #[test]
    fn display_renders_a_table() {
        let stats = Stats {
            threshold: 2 << 20,
            host_node: Some(1),
            nodes: vec![NodeStats {
                node: 1,
                live_bytes: 3 << 20,
                ..NodeStats::default()
            }],
            ..Stats::default()
        };
        let text = stats.to_string();
        assert!(text.contains("host node 1"), "{text}");
        assert!(text.contains("threshold 2 MiB"), "{text}");
        assert_eq!(
            [4096, 2_621_440, 64 << 30, 1000].map(|b| Size(b).to_string()),
            ["4 KiB", "2.5 MiB", "64 GiB", "1000 B"]
        );
        assert!(text.contains("   1          3.0"), "{text}");
        assert_eq!(stats.live_bytes(), 3 << 20);
    }
}
