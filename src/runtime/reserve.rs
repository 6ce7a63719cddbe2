//! Reservations: memory made ahead of the requests that will want it (as PyTorch's
//! `pinned_reserve_segment_size_mb` avoids a first batch's stall).
//!
//! - Blocks of a size (`reserve=COUNTxSIZE`, [`Runtime::reserve`]) go straight into the cache,
//!   as chunks with room for them or cached dedicated blocks: they count against the cache
//!   limit, and `trim()` releases them.
//! - Bytes ([`Runtime::reserve_bytes`], in the background or not) are made chunk by chunk, each
//!   at most [`CHUNK_MAX`]: mapped, placed, populated by the node's bound workers and (pinned)
//!   registered with one driver call, then added to the arena, where requests carve from it at
//!   once while later chunks are still being made. Reserved chunks outlive decay; `trim()` and
//!   memory pressure release them.

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::block::HUGE_PAGE;
use super::carved::{carved, reserved_key};
use super::route;
use super::{Resolved, Runtime};
use crate::arena::{class_size, HeapKey, Kind, CHUNK_ALIGN, CHUNK_FIRST, CHUNK_MAX};
use crate::chunk::Mapping;
use crate::config::{Config, Reserve};
use crate::cuda;
use crate::sys::lock::Lock;
use crate::Error;

impl Runtime {
    /// Makes the configured reservation (`reserve=`); called once, right after initialisation.
    /// A failure is printed as one line on stderr (the cause is also counted in the stats); one
    /// refused for its figures (see [`check`]) or by `pin=strict` is already a setup error.
    pub(crate) fn reserve_configured(&self) {
        let Reserve { blocks, block_size } = self.config.reserve;
        match self.reserve(blocks, block_size) {
            Ok(()) | Err(Error::ReserveRejected { .. } | Error::StrictPinning { .. }) => {}
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "numa-gpu-alloc: reserve: {e}");
            }
        }
    }

    /// Makes room for `blocks` blocks of `block_size` bytes (placed, populated, pinned as
    /// configured) in the arena of the node where the calling thread's blocks go: chunks of that
    /// much free space for sizes that are carved, cached dedicated blocks for the others. What
    /// was made before a failure stays.
    pub(crate) fn reserve(&self, blocks: usize, block_size: usize) -> Result<(), Error> {
        if blocks == 0 {
            return Ok(());
        }
        let limit = self.config.cache_limit;
        let page = self.page_size;
        let capacity = check(&self.config, page, blocks, block_size)?;
        // On the node where the calling thread's blocks go (its route, or the value's target).
        let target = route::target(self);
        // `pin=strict` with nothing to page-lock them: none is made.
        let kind = self.kind(&target)?;
        if carved(capacity, page) {
            return self.reserve_chunks(blocks, capacity, &target, kind);
        }
        // Its node's arena first (one exists for every node id in the table, and stays): a block
        // made for none would be released by nothing.
        if self.arena(target.host_node).is_none() {
            return Err(Error::UnknownNode {
                node: target.host_node,
                node_count: self.topology.node_count(),
            });
        }
        for _ in 0..blocks {
            let block = self.create_block(capacity, page, &target)?;
            self.with_arena(block.node, |arena, out| {
                arena.insert_reserved(block, limit, out)
            });
        }
        Ok(())
    }

    /// Chunks with room for `blocks` blocks of `capacity` bytes, populated whole, kept when idle.
    fn reserve_chunks(
        &self,
        blocks: usize,
        capacity: usize,
        target: &Resolved,
        kind: Kind,
    ) -> Result<(), Error> {
        let key = HeapKey {
            kind,
            huge: self.config.huge_pages && capacity >= HUGE_PAGE,
            reserved: false,
        };
        // Whole blocks per chunk: a block never straddles two.
        let per_chunk = (CHUNK_MAX / capacity).max(1);
        let mut left = blocks;
        while left > 0 {
            let n = left.min(per_chunk);
            let len = (n * capacity).next_multiple_of(CHUNK_ALIGN);
            let mut chunk = self.make_chunk(key, len, target)?;
            self.populate_chunk(&mut chunk, target)?;
            chunk.set_reserved();
            let key = HeapKey {
                kind: Kind {
                    pinned: chunk.pinned(),
                    ..kind
                },
                ..key
            };
            self.add_chunk(target.host_node, key, chunk)
                .ok_or(Error::Syscall {
                    call: "arena bookkeeping",
                    errno: libc::ENOMEM,
                })?;
            left -= n;
        }
        Ok(())
    }
}

impl Runtime {
    /// Makes `bytes` (rounded up to whole 2 MiB) of reserved chunks for `target`, of `kind`,
    /// counting each step in `tally`; stops at the first failure (what was made stays, usable)
    /// or when the tally is cancelled. Chunk lengths double from the first chunk's, so that the
    /// first is usable soon, up to [`CHUNK_MAX`].
    pub(crate) fn reserve_bytes(
        &self,
        bytes: usize,
        target: &Resolved,
        kind: Kind,
        tally: &Tally,
    ) -> Result<(), Error> {
        let key = reserved_key(kind, self.config.huge_pages);
        let node = target.host_node;
        // A node's size where sysfs tells it (0: unknown, then the populate's failure says it).
        let node_bytes = self
            .topology
            .nodes()
            .iter()
            .find(|n| n.id == node)
            .map_or(0, |n| usize::try_from(n.memory_bytes).unwrap_or(usize::MAX));
        let too_large = Error::ReserveTooLarge {
            bytes,
            node,
            node_bytes,
        };
        if node_bytes != 0 && bytes > node_bytes {
            return Err(too_large);
        }
        let total = bytes
            .checked_next_multiple_of(CHUNK_ALIGN)
            .ok_or(too_large)?;
        let mut made = 0;
        let mut next = CHUNK_FIRST;
        while made < total && !tally.cancel.load(Ordering::Acquire) {
            // A pinned chunk could not be registered any more (`cuda/teardown.rs`).
            if kind.pinned && cuda::exiting() {
                return Err(Error::ReservationLost {
                    reason: cuda::EXITING_REASON,
                });
            }
            let len = next.min(total - made);
            next = (next * 2).min(CHUNK_MAX);
            let mapping = Mapping::new(len, CHUNK_ALIGN)?;
            let mut chunk = self.placed_chunk(key, mapping, target)?;
            tally.placed.fetch_add(len, Ordering::Relaxed);
            self.populate_chunk(&mut chunk, target)?;
            tally.populated.fetch_add(len, Ordering::Relaxed);
            if kind.pinned {
                let start = Instant::now();
                let registered = self.register_chunk(&mut chunk, target);
                tally.driver_call(start.elapsed());
                registered?;
                tally.registered.fetch_add(len, Ordering::Relaxed);
            }
            chunk.set_reserved();
            BYTES_RESERVED.store(true, Ordering::Release);
            self.add_chunk(target.host_node, key, chunk)
                .ok_or(Error::Syscall {
                    call: "arena bookkeeping",
                    errno: libc::ENOMEM,
                })?;
            tally.chunk_added(len);
            made += len;
        }
        Ok(())
    }
}

/// Set once a reservation of bytes made a chunk in this process: until then no request looks for
/// reserved room (one load instead of an arena lock).
static BYTES_RESERVED: AtomicBool = AtomicBool::new(false);

/// Whether a reservation of bytes may have left room to carve from.
pub(crate) fn bytes_reserved() -> bool {
    BYTES_RESERVED.load(Ordering::Acquire)
}

/// What a reservation of bytes has done so far, updated as it goes (read by its handle).
pub(crate) struct Tally {
    pub(crate) requested: usize,
    pub(crate) start: Instant,
    pub(crate) placed: AtomicUsize,
    pub(crate) populated: AtomicUsize,
    pub(crate) registered: AtomicUsize,
    pub(crate) chunks: AtomicUsize,
    /// Bytes of the chunks added.
    pub(crate) usable: AtomicUsize,
    /// Nanoseconds of the longest registration.
    pub(crate) longest_call_ns: AtomicU64,
    /// Nanoseconds from the start to the first chunk added (0: none yet).
    pub(crate) first_chunk_ns: AtomicU64,
    /// Set to stop after the chunk in progress.
    pub(crate) cancel: AtomicBool,
    /// 1 once the reservation ended (a futex word: waiters sleep on it).
    pub(crate) finished: AtomicU32,
    /// Why it ended early.
    pub(crate) error: Lock<Option<Error>>,
}

impl Tally {
    pub(crate) fn new(requested: usize) -> Tally {
        Tally {
            requested,
            start: Instant::now(),
            placed: AtomicUsize::new(0),
            populated: AtomicUsize::new(0),
            registered: AtomicUsize::new(0),
            chunks: AtomicUsize::new(0),
            usable: AtomicUsize::new(0),
            longest_call_ns: AtomicU64::new(0),
            first_chunk_ns: AtomicU64::new(0),
            cancel: AtomicBool::new(false),
            finished: AtomicU32::new(0),
            error: Lock::new(None),
        }
    }

    fn driver_call(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.longest_call_ns.fetch_max(ns, Ordering::Relaxed);
    }

    fn chunk_added(&self, len: usize) {
        self.usable.fetch_add(len, Ordering::Relaxed);
        self.chunks.fetch_add(1, Ordering::Release);
        let ns = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let _ = self.first_chunk_ns.compare_exchange(
            0,
            ns.max(1),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Records the outcome and wakes the waiters.
    pub(crate) fn finish(&self, outcome: Result<(), Error>) {
        if let Err(e) = outcome {
            *self.error.lock() = Some(e);
        }
        self.finished.store(1, Ordering::Release);
        crate::sys::futex_wake(&self.finished, u32::MAX);
    }
}

/// The capacity of each of `blocks` blocks of `block_size` bytes reserved under `config` (whole
/// pages for carved sizes, the size class for dedicated ones), or
/// [`Error::ReserveRejected`] when a block would be below the threshold (no request would reuse
/// it) or all of them beyond the cache limit (they would be released at once).
pub(crate) fn check(
    config: &Config,
    page_size: usize,
    blocks: usize,
    block_size: usize,
) -> Result<usize, Error> {
    // Carved sizes are whole pages; dedicated ones take their size class.
    let carve = block_size
        .checked_next_multiple_of(page_size)
        .filter(|&size| carved(size, page_size));
    carve
        .or_else(|| class_size(block_size, page_size))
        .filter(|&capacity| {
            block_size >= config.threshold
                && capacity
                    .checked_mul(blocks)
                    .is_some_and(|total| total <= config.cache_limit)
        })
        .ok_or(Error::ReserveRejected {
            blocks,
            block_size,
            threshold: config.threshold,
            cache_limit: config.cache_limit,
        })
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use std::alloc::{GlobalAlloc, Layout};

    use crate::alloc::tests::serial;
    use crate::{Error, NumaGpuAlloc, PinMode, Stats};

    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;

    fn allocator() -> NumaGpuAlloc {
        NumaGpuAlloc::new().threshold(64 * KIB).pin(PinMode::Off)
    }

    fn mapped(stats: &Stats) -> usize {
        stats.nodes.iter().map(|n| n.mapped_bytes).sum()
    }

    /// Allocates and frees `size` bytes; returns whether that allocation was a cache hit.
    fn hit(alloc: &NumaGpuAlloc, size: usize) -> bool {
        let hits = alloc.stats().cache_hits;
        let layout = Layout::from_size_align(size, 8).unwrap();
        // SAFETY: a non-zero layout, freed with the same layout.
        unsafe { alloc.dealloc(alloc.alloc(layout), layout) };
        alloc.stats().cache_hits == hits + 1
    }

    #[test]
    fn reserved_chunks_serve_the_first_requests_and_trim_releases_them() {
        let _serial = serial();
        let alloc = allocator();
        alloc.reserve(2, MIB).unwrap();
        let stats = alloc.stats();
        assert_eq!((stats.cached_bytes(), mapped(&stats)), (2 * MIB, 2 * MIB));
        let resident: usize = stats.nodes.iter().map(|n| n.resident_bytes).sum();
        assert_eq!(resident, 2 * MIB, "populated up front");
        assert_eq!((stats.large_allocations, stats.cache_misses), (0, 0));

        let (layout, smaller) = (
            Layout::from_size_align(MIB, 8).unwrap(),
            Layout::from_size_align(MIB - 100 * KIB, 8).unwrap(),
        );
        // SAFETY: a non-zero layout, freed below.
        let first = unsafe { alloc.alloc(layout) };
        // SAFETY: as above.
        let second = unsafe { alloc.alloc(smaller) };
        let stats = alloc.stats();
        assert_eq!((stats.cache_hits, stats.cache_misses), (2, 0), "{stats}");
        assert_eq!(stats.cached_bytes(), 100 * KIB);
        // SAFETY: allocated above with these layouts.
        unsafe {
            alloc.dealloc(first, layout);
            alloc.dealloc(second, smaller);
        }

        alloc.trim();
        let stats = alloc.stats();
        assert_eq!((mapped(&stats), stats.released_blocks), (0, 1));
        assert!(!hit(&alloc, MIB), "trimmed: a miss again");
    }

    #[test]
    fn reservations_beyond_the_cache_limit_are_rejected() {
        let _serial = serial();
        let alloc = allocator().cache_limit(2 * MIB);
        alloc.reserve(2, MIB).unwrap();
        assert!(hit(&alloc, MIB));
        let rejected = alloc.reserve(3, MIB).unwrap_err();
        assert_eq!(
            rejected,
            Error::ReserveRejected {
                blocks: 3,
                block_size: MIB,
                threshold: 64 * KIB,
                cache_limit: 2 * MIB,
            }
        );
        assert!(rejected.to_string().contains("3 blocks of 1048576 bytes"));
        assert!(matches!(
            alloc.reserve(1, 32 * KIB),
            Err(Error::ReserveRejected { .. })
        ));
        assert_eq!(alloc.reserve(0, 0), Ok(()));
        assert_eq!(
            mapped(&alloc.stats()),
            2 * MIB,
            "nothing made for a rejection"
        );
    }

    #[test]
    fn a_reservation_at_initialisation_is_cached_before_the_first_request() {
        let _serial = serial();
        let alloc = allocator().reserve_at_init(3, 256 * KIB);
        assert_eq!(alloc.stats().cached_bytes(), 0, "not initialised yet");
        assert!(
            hit(&alloc, 256 * KIB),
            "the request that initialises is a hit"
        );
        let stats = alloc.stats();
        assert_eq!((stats.cached_bytes(), mapped(&stats)), (2 * MIB, 2 * MIB));
    }

    #[test]
    fn reserved_bytes_serve_small_and_large_requests_first() {
        let _serial = serial();
        let alloc = allocator();
        alloc.trim();
        let done = alloc.reserve_bytes(96 * MIB).unwrap();
        assert_eq!((done.usable, done.chunks), (96 * MIB, 2));
        let before = alloc.stats();
        // A small block (a small-page heap's otherwise) and one too large to carve otherwise.
        let small = Layout::from_size_align(MIB, 8).unwrap();
        let large = Layout::from_size_align(64 * MIB, 8).unwrap();
        // SAFETY: non-zero layouts, freed below.
        let (a, b) = unsafe { (alloc.alloc(small), alloc.alloc(large)) };
        assert!(!a.is_null() && !b.is_null());
        let stats = alloc.stats();
        assert_eq!(
            (
                stats.cache_hits - before.cache_hits,
                stats.cache_misses - before.cache_misses
            ),
            (2, 0),
            "{stats}"
        );
        assert_eq!(
            mapped(&stats),
            96 * MIB,
            "no chunk or mapping of their own: {stats}"
        );
        assert!(matches!(
            alloc.reserve_bytes(usize::MAX),
            Err(Error::ReserveTooLarge {
                bytes: usize::MAX,
                ..
            })
        ));
        // SAFETY: allocated above with these layouts.
        unsafe {
            alloc.dealloc(a, small);
            alloc.dealloc(b, large);
        }
        alloc.trim();
    }

    #[test]
    fn a_reserved_chunk_outlives_decay() {
        let _serial = serial();
        let alloc = allocator().decay_ms(0);
        alloc.reserve(1, MIB).unwrap();
        assert!(hit(&alloc, MIB));
        assert!(
            hit(&alloc, MIB),
            "still there after a free looked at idle memory"
        );
    }
}
