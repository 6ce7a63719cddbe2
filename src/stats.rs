//! Counters kept by an allocator and the [`Stats`] snapshot users read.
//!
//! Hot counters are relaxed atomics (one per event, no lock); per-node byte counts live in the
//! arena and are updated under the arena lock the allocation already holds.
//!
//! An event counter is declared once, in the `events { … }` block of [`Stats`] or [`Fallbacks`]
//! below: its doc, its name and, to be printed at the end of its struct's line of the table, its
//! label. [`snapshot!`](events) makes the public field, the atomic (`counters.name.incr()` where
//! the event happens), the snapshot copy and the JSON key from it.

use std::time::Duration;

use crate::Error;

mod counters;
mod events;
mod json;
mod table;
pub(crate) use counters::{Counters, ERROR_CODE_SLOTS};
use counters::{FIRST_OCTAVE, OCTAVES};
use events::snapshot;

/// Total and longest time spent in one kind of step (in JSON: nanoseconds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct TimeStats {
    /// Sum over all blocks.
    #[cfg_attr(feature = "serde", serde(serialize_with = "crate::stats::json::nanos"))]
    pub total: Duration,
    /// The longest single block (since the last [`reset_peaks`](crate::NumaGpuAlloc::reset_peaks)).
    #[cfg_attr(feature = "serde", serde(serialize_with = "crate::stats::json::nanos"))]
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
    /// Bytes kept for reuse: the chunks' free bytes ([`free_bytes`](Self::free_bytes)) plus the
    /// cached dedicated blocks, which are mappings of their own, outside
    /// [`mapped_bytes`](Self::mapped_bytes) (so this may exceed it).
    pub cached_bytes: usize,
    /// Bytes page-locked with CUDA (live and cached).
    pub pinned_bytes: usize,
    /// Blocks handed out and not yet freed.
    pub live_blocks: usize,
    /// The pieces `cached_bytes` is in: the chunks' free ranges
    /// ([`free_ranges`](Self::free_ranges)) plus the cached dedicated blocks.
    pub cached_blocks: usize,
    /// Freed blocks that GPU work may still use, reusable once it completed (they count against
    /// the cache limit).
    pub pending_blocks: usize,
    /// Their bytes.
    pub pending_bytes: usize,
    /// Chunks mapped (blocks are carved from them).
    pub chunks: usize,
    /// Bytes of those chunks (dedicated blocks, live or cached, are not in it).
    pub mapped_bytes: usize,
    /// Of those, bytes that may be resident: populated, or handed out (and so perhaps touched)
    /// when blocks are faulted in where touched, and not purged since.
    pub resident_bytes: usize,
    /// Of those, bytes free (carved again before a chunk is made).
    pub free_bytes: usize,
    /// The free ranges they are in.
    pub free_ranges: usize,
    /// The largest free range of one chunk.
    pub largest_free: usize,
    /// Chunks page-locked with CUDA (one registration each).
    pub registrations: u64,
    /// Bytes of idle free ranges given back to the kernel (`MADV_DONTNEED`) so far.
    pub purged_bytes: u64,
    /// Idle cached dedicated blocks the decay thread released (they count in every value's
    /// `released_blocks` too: the decay thread's releases are added to each value's).
    pub decay_released: u64,
}

impl NodeStats {
    /// The share of the chunks' bytes that is free: [`free_bytes`](Self::free_bytes) over
    /// [`mapped_bytes`](Self::mapped_bytes), from 0 (every byte carved into live blocks) to 1
    /// (the chunks are all idle); 0 without chunks. It measures idle room, not fragmentation:
    /// [`largest_free`](Self::largest_free) tells how large a block that room can still serve.
    pub fn free_fraction(&self) -> f64 {
        fraction(self.free_bytes, self.mapped_bytes)
    }
}

/// `part / whole`, 0 when `whole` is.
fn fraction(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
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
    /// Whether a reservation of bytes made them (they serve requests of every size first).
    pub reserved: bool,
    /// Chunks mapped now.
    pub chunks: usize,
    /// Their bytes.
    pub mapped_bytes: usize,
    /// Bytes of them that may be resident (as [`NodeStats::resident_bytes`]).
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
    /// The share of these chunks' bytes that is free, as [`NodeStats::free_fraction`]: 0 all
    /// carved, 1 all idle (0 without chunks).
    pub fn free_fraction(&self) -> f64 {
        fraction(self.free_bytes, self.mapped_bytes)
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

snapshot! {
    /// A snapshot of one allocator's state, from
    /// [`NumaGpuAlloc::stats`](crate::NumaGpuAlloc::stats).
    ///
    /// Each counter is read on its own (relaxed atomics), so figures read while other threads
    /// allocate may be a moment apart. `Display` gives a table, [`Stats::json`] one line of JSON,
    /// and with the `serde` feature the snapshot implements `Serialize` (the same JSON from
    /// `serde_json`).
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
        /// Why they are not, when `pinning` is false (see
        /// [`Placement::pinning_off`](crate::Placement::pinning_off); in JSON: the message).
        #[cfg_attr(
            feature = "serde",
            serde(serialize_with = "crate::stats::json::message")
        )]
        pub pinning_off: Option<Error>,
        /// Bytes the process holds page-locked through the allocator (every value's blocks and
        /// chunks), to compare with [`pin_limit`](Self::pin_limit).
        pub page_locked_bytes: usize,
        /// This value's pinned limit (`pin_limit=`), when it has one.
        pub pin_limit: Option<usize>,
        /// Per node: the process's arenas, shared by every allocator value.
        pub nodes: Vec<NodeStats>,
        /// Per node and kind of chunk (policy, pinning, page size), in node order.
        pub heaps: Vec<HeapStats>,
        /// Per GPU and node, for requests routed to a GPU the CUDA driver knows (by the allocator's
        /// target or a thread's [`Route`](crate::Route)), in node order.
        pub gpus: Vec<GpuStats>,
        /// Large requests that reached the cache: hits + misses. A miss whose block could not be
        /// made failed, and is counted here and in `fallbacks.failed_allocations`; a request
        /// refused before the cache (`pin=strict` with nothing to page-lock, a size too large to
        /// round up to its class) is counted only there.
        pub large_allocations: u64,
        events {
            /// Large blocks freed by the user.
            frees: "frees",
            /// Large allocations served from the cache.
            cache_hits,
            /// Large requests no cached block served: a new block was made for each, or could not
            /// be (then the request failed); growths without copy count too.
            cache_misses,
            /// Reallocations done in place, within the block's capacity.
            in_place_reallocs: "in-place reallocs",
            /// Reallocations that grew an unpinned block by moving its pages into a larger mapping
            /// (`mremap`, no copy; also counted as a miss and a free).
            grown_without_copy: "grown without copy",
            /// New blocks made of a cached block of another size (also counted as a miss): a
            /// larger one shrunk in place, or a smaller one whose pages moved to the new block's
            /// head (`mremap`, no copy; only its tail was mapped fresh).
            resized_from_cache: "resized from cache",
            /// GPU uses (events) recorded against live blocks.
            in_flight_recorded,
            /// Cache misses while a pending block would have fitted: reuse deferred by GPU work.
            reuse_deferred,
            /// Block creations retried after cached blocks were given back for want of memory.
            pressure_retries,
            /// Cached blocks given back for those retries (oldest first).
            pressure_released_blocks,
            /// Blocks and chunks unmapped (cache limit, `trim()`, failed placement, decay; the
            /// process's decay thread's count in every value's stats).
            released_blocks: "released blocks",
            /// Successful `cuMemHostRegister` calls.
            registrations,
            /// Blocks larger than the registration bound (`register_max=`), each registered whole
            /// with one call.
            oversized_registrations: "registered whole above the bound",
            /// Chunks made by reservations (`reserve=`, `reserve_bytes`, in the background).
            reserved_chunks,
            /// Their bytes.
            reserved_bytes,
            /// `cuMemHostUnregister` calls.
            unregistrations,
            /// Pages checked with `move_pages` (`verify=on`, or `policy=bind`).
            pages_checked,
            /// Checked pages found off the intended node(s).
            pages_misplaced,
        }
        /// Time spent populating blocks.
        pub populate_time: TimeStats,
        /// Time spent registering blocks with CUDA.
        pub pin_time: TimeStats,
        /// Time spent unregistering blocks (`cuMemHostUnregister`, when a pinned block is
        /// released).
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
            serde(serialize_with = "crate::stats::json::message")
        )]
        pub last_pin_error: Option<Error>,
        /// Why NUMA placement is off, when the kernel refused it (in JSON: the message).
        #[cfg_attr(
            feature = "serde",
            serde(serialize_with = "crate::stats::json::message")
        )]
        pub numa_unavailable: Option<Error>,
        /// Rejected `NUMA_GPU_ALLOC` entries and other setup problems: every problem that applies
        /// to this value. Each was also printed to stderr, the environment's once per process, the
        /// value's own settings' by this value (in JSON: the messages).
        #[cfg_attr(
            feature = "serde",
            serde(serialize_with = "crate::stats::json::messages")
        )]
        pub config_errors: Vec<Error>,
    }

    /// Degraded modes and failures, each counted.
    #[derive(Clone, Debug, Default, PartialEq, Eq)]
    #[cfg_attr(feature = "serde", derive(serde::Serialize))]
    #[non_exhaustive]
    pub struct Fallbacks {
        events {
            /// Blocks mapped without NUMA placement: the kernel refuses NUMA calls (see
            /// [`Stats::numa_unavailable`]), or refused this block's `preferred`/`interleave`
            /// policy (also counted in `placement_failures`).
            unplaced_blocks,
            /// Mappings (dedicated blocks and chunks) made without page-locking although pinning
            /// was asked for (`pin=on`: no usable driver or GPU for the target, a failed
            /// registration, the pinned limit). A `pin=off` allocator counts none: nothing fell
            /// back.
            unpinned_blocks,
            /// Registrations refused by the pinned limit (`pin_limit=`), after giving idle
            /// page-locked memory back did not make room.
            pin_limited: "refused by the pinned limit",
            /// `cuMemHostRegister` calls that failed.
            pin_failures,
            /// Huge-page blocks or chunks whose populating stalled (the kernel compacting memory
            /// for each huge page) and went on in small pages.
            huge_page_stalls: "huge-page stalls",
            /// `cuMemHostUnregister` calls that failed; those blocks are leaked rather than
            /// unmapped while the driver still holds them.
            unregister_failures,
            /// Large requests that returned null / `AllocError`.
            failed_allocations,
            /// Of those: `policy=bind` blocks that could not be placed entirely on the node.
            bind_exhausted,
            /// Of those: `mmap` failures.
            map_failures,
            /// Of those: populating failed (out of memory).
            populate_failures,
            /// Of those: the block would have exceeded a cgroup's `memory.max` (populating it would
            /// have summoned the OOM killer).
            memory_limited,
            /// Of those: `pin=strict` requests refused before anything was mapped, since no block
            /// could be page-locked for their target (no CUDA driver, no GPU for it, a forked
            /// child; the reason is in `last_pin_error` and `config_errors`).
            strict_refused,
            /// `mbind` or the page check failed for another reason than NUMA being unavailable
            /// (e.g. EINVAL for a node the kernel or cpuset does not allow): the block went
            /// unplaced under `preferred`/`interleave`, the allocation failed under `bind` or a
            /// failed page check.
            placement_failures,
            /// Blocks that `verify=on` or `policy=bind` could not check page by page because the
            /// kernel refused `move_pages` (seccomp); `bind` then lets `mbind(MPOL_MF_STRICT)`
            /// check instead.
            unverified_blocks,
            /// Purges of idle free ranges that failed: `MADV_DONTNEED` refuses locked memory
            /// (`mlock`, `mlockall`). Such a range stays resident, is not purged again until it
            /// merges with a range freed beside it, and counts as nothing to give back (its
            /// chunk is still released once wholly free). The decay thread's count too.
            purge_failures: "failed purges",
            /// Large frees of pointers no arena holds: memory the inner allocator served while
            /// inside the allocator or before initialisation lowered the threshold (passed on to
            /// it). Blocks of another `NumaGpuAlloc` value are not counted: they go back to their
            /// node's arena.
            foreign_frees: "foreign frees",
        }
    }
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

#[cfg(test)]
mod tests {
    use super::counters::octave;
    use super::*;

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
}
