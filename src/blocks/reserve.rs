//! Reservations: memory made ahead of the requests that will want it (as PyTorch's
//! `pinned_reserve_segment_size_mb` avoids a first batch's stall).
//!
//! - Bytes (`reserve=SIZE`, [`Reserver::reserve_bytes`], in the background or not) are made chunk
//!   by chunk, each at most [`Blocks::chunk_max`] (the registration bound when pinned): mapped,
//!   placed, populated by the node's bound workers and (pinned) registered with one driver call,
//!   then added to the arena, where requests carve from it at once while later chunks are still
//!   being made. Reserved chunks outlive decay; `trim()` and memory pressure release them.
//! - Blocks of a size (`reserve=COUNTxSIZE`, [`Reserver::reserve_blocks`]) are the same, in chunks of
//!   whole blocks; a block larger than a chunk is a cached dedicated block of its own,
//!   registered whole.
//! - Either is bounded by the node's memory and the pinned limit, not by the cache limit.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use super::block::DedicatedPath;
use super::{reserved_key, Blocks, Resolved, HUGE_PAGE};
use crate::arena::{class_size, Kind, CHUNK_ALIGN, CHUNK_FIRST};
use crate::chunk::{PinPolicy, Progress};
use crate::cuda;
use crate::process::job::Job;
use crate::Error;

/// The reservations side of a value's large path.
pub(crate) struct Reserver<'a> {
    pub(super) blocks: &'a Blocks,
}

impl Reserver<'_> {
    /// Room for `blocks` blocks of `block_size` bytes: reserved chunks of whole blocks when a
    /// block fits a chunk (at most the registration bound when pinned), else cached dedicated
    /// blocks, each registered whole. Bounded by the node's memory and the pinned limit, not by
    /// the cache limit. What was made before a failure stays.
    pub(crate) fn reserve_blocks(
        &self,
        blocks: usize,
        block_size: usize,
        target: &Resolved,
        tally: &Tally,
    ) -> Result<(), Error> {
        if blocks == 0 || block_size == 0 {
            return Ok(());
        }
        reservations_supported()?;
        check(self.blocks.settings.threshold, blocks, block_size)?;
        let page = self.blocks.page_size();
        // `pin=strict` with nothing to page-lock them: none is made.
        let kind = self.blocks.kind(target)?;
        // A carved block's room: whole huge pages where it is carved from a huge-page chunk.
        let unit = if self.blocks.settings.huge_pages && block_size >= HUGE_PAGE {
            block_size.checked_next_multiple_of(HUGE_PAGE)
        } else {
            block_size.checked_next_multiple_of(page)
        };
        let too_large = |bytes| self.too_large(bytes, target.host_node);
        let unit = unit.ok_or_else(|| too_large(usize::MAX))?;
        let total = unit
            .checked_mul(blocks)
            .ok_or_else(|| too_large(usize::MAX))?;
        if unit <= self.blocks.chunk_max(kind.pinned) {
            return self.reserve_room(total, unit, target, kind, tally);
        }
        let capacity = class_size(block_size, page).ok_or_else(|| too_large(usize::MAX))?;
        let total = capacity
            .checked_mul(blocks)
            .ok_or_else(|| too_large(usize::MAX))?;
        self.check_room(total, target, kind)?;
        // Its node's arena first (one exists for every node id in the table, and stays): a block
        // made for none would be released by nothing.
        if self.blocks.arena(target.host_node).is_none() {
            return Err(Error::UnknownNode {
                node: target.host_node,
                node_count: self.blocks.process.node_count(),
            });
        }
        for _ in 0..blocks {
            // Made populated whatever the kind: a reservation is room made now.
            let dedicated = DedicatedPath {
                blocks: self.blocks,
            };
            let made = dedicated.create_block(capacity, page, target, capacity)?;
            // Kept whatever the cache limit (checked above against the node and pinned limit);
            // once used and freed again they are cached blocks like any other.
            self.blocks.with_arena(made.block.node, |arena, out| {
                arena.insert_reserved(made, usize::MAX, out)
            });
            tally.job.chunk_done(capacity);
            self.blocks.counters.reserved_chunks.incr();
            self.blocks.counters.reserved_bytes.add(capacity as u64);
        }
        Ok(())
    }

    fn too_large(&self, bytes: usize, node: usize) -> Error {
        Error::ReserveTooLarge {
            bytes,
            node,
            node_bytes: self.blocks.process.node_bytes(node),
        }
    }

    /// Refuses a reservation of `bytes` beyond the node's memory (where known), or, pinned,
    /// beyond the pinned limit.
    fn check_room(&self, bytes: usize, target: &Resolved, kind: Kind) -> Result<(), Error> {
        let node_bytes = self.blocks.process.node_bytes(target.host_node);
        if node_bytes != 0 && bytes > node_bytes {
            return Err(self.too_large(bytes, target.host_node));
        }
        let limit = self.blocks.settings.pin_limit;
        if kind.pinned && bytes > limit {
            return Err(Error::PinLimit {
                requested: bytes,
                pinned: crate::chunk::page_locked_bytes(),
                limit,
            });
        }
        Ok(())
    }

    /// Makes `bytes` (rounded up to whole 2 MiB) of reserved chunks for `target`, of `kind`,
    /// counting each step in `tally` (see [`Self::reserve_room`]).
    pub(crate) fn reserve_bytes(
        &self,
        bytes: usize,
        target: &Resolved,
        kind: Kind,
        tally: &Tally,
    ) -> Result<(), Error> {
        self.reserve_room(bytes, CHUNK_ALIGN, target, kind, tally)
    }

    /// Makes room for `bytes` (rounded up to whole `unit`s) in reserved chunks for `target`, of
    /// `kind`, each a whole number of `unit`s (rounded up to 2 MiB), counting each step in
    /// `tally`; stops at the first
    /// failure (what was made stays, usable) or when the tally is cancelled. Chunk lengths
    /// double from the first chunk's, so that the first is usable soon, up to
    /// [`Blocks::chunk_max`] (the registration bound when pinned). Refused beyond the node's
    /// memory or the pinned limit.
    fn reserve_room(
        &self,
        bytes: usize,
        unit: usize,
        target: &Resolved,
        kind: Kind,
        tally: &Tally,
    ) -> Result<(), Error> {
        reservations_supported()?;
        let key = reserved_key(kind, self.blocks.settings.huge_pages);
        self.check_room(bytes, target, kind)?;
        // Counted in units, not bytes: each chunk's rounding up to 2 MiB is room no unit uses.
        let mut left = bytes.div_ceil(unit);
        let max = (self.blocks.chunk_max(kind.pinned) / unit).max(1);
        let mut next = (CHUNK_FIRST / unit).clamp(1, max);
        while left > 0 && !tally.job.cancelled() {
            // A pinned chunk could not be registered any more (`cuda/teardown.rs`).
            if kind.pinned && cuda::exiting() {
                return Err(Error::ReservationLost {
                    reason: cuda::EXITING_REASON,
                });
            }
            let units = next.min(left);
            left -= units;
            next = (next * 2).min(max);
            let len = (units * unit).next_multiple_of(CHUNK_ALIGN);
            let source = self.blocks.process.source();
            let chunk = self.blocks.placer().reserved_chunk(
                source,
                len,
                key.huge,
                &target.place(),
                PinPolicy::reserving(kind.pinned),
                tally,
            )?;
            BYTES_RESERVED.store(true, Ordering::Release);
            self.blocks
                .add_chunk(target.host_node, key, chunk)
                .ok_or(Error::Syscall {
                    call: "arena bookkeeping",
                    errno: libc::ENOMEM,
                })?;
            tally.job.chunk_done(len);
            self.blocks.counters.reserved_chunks.incr();
            self.blocks.counters.reserved_bytes.add(len as u64);
        }
        Ok(())
    }
}

/// Off Linux no request takes the large path, so reserved memory would serve none: refused.
fn reservations_supported() -> Result<(), Error> {
    if cfg!(target_os = "linux") {
        Ok(())
    } else {
        Err(Error::Syscall {
            call: "reserve (Linux only: requests go to the inner allocator here)",
            errno: libc::ENOSYS,
        })
    }
}

/// Set once a reservation of bytes made a chunk in this process: until then no request looks for
/// reserved room (one load instead of an arena lock).
static BYTES_RESERVED: AtomicBool = AtomicBool::new(false);

/// Whether a reservation of bytes may have left room to carve from.
pub(crate) fn bytes_reserved() -> bool {
    BYTES_RESERVED.load(Ordering::Acquire)
}

/// What a reservation of bytes has done so far, updated as it goes (read by its handle): its
/// [`Job`] (chunks added to the arena, and their bytes: what is usable), and the bytes each
/// step has done, a chunk that then failed included.
pub(crate) struct Tally {
    pub(crate) job: Job,
    pub(crate) placed: AtomicUsize,
    pub(crate) populated: AtomicUsize,
    pub(crate) registered: AtomicUsize,
}

impl Tally {
    pub(crate) fn new(requested: usize) -> Tally {
        Tally {
            job: Job::new(requested),
            placed: AtomicUsize::new(0),
            populated: AtomicUsize::new(0),
            registered: AtomicUsize::new(0),
        }
    }
}

impl AsRef<Job> for Tally {
    fn as_ref(&self) -> &Job {
        &self.job
    }
}

/// A reservation's chunks report their steps to its tally.
impl Progress for Tally {
    fn placed(&self, len: usize) {
        self.placed.fetch_add(len, Ordering::Relaxed);
    }

    fn populated(&self, len: usize) {
        self.populated.fetch_add(len, Ordering::Relaxed);
    }

    fn driver_call(&self, took: Duration) {
        self.job.driver_call(took);
    }

    fn registered(&self, len: usize) {
        self.registered.fetch_add(len, Ordering::Relaxed);
    }
}

/// [`Error::ReserveRejected`] when blocks of `block_size` bytes would be below `config`'s
/// threshold: no request of that size takes the large path, so none would use them.
pub(crate) fn check(threshold: usize, blocks: usize, block_size: usize) -> Result<(), Error> {
    if block_size >= threshold {
        return Ok(());
    }
    Err(Error::ReserveRejected {
        blocks,
        block_size,
        threshold,
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
    fn reservations_are_bounded_by_the_threshold_not_the_cache_limit() {
        let _serial = serial();
        let alloc = allocator().cache_limit(2 * MIB);
        alloc.reserve(3, MIB).unwrap();
        assert!(hit(&alloc, MIB), "room beyond the cache limit is kept");
        let rejected = alloc.reserve(1, 32 * KIB).unwrap_err();
        assert_eq!(
            rejected,
            Error::ReserveRejected {
                blocks: 1,
                block_size: 32 * KIB,
                threshold: 64 * KIB,
            }
        );
        let text = rejected.to_string();
        assert!(
            text.contains("below the threshold") && text.contains("threshold="),
            "{text}"
        );
        assert_eq!(alloc.reserve(0, 0), Ok(()));
        let too_large = alloc.reserve(1 << 20, 1 << 30).unwrap_err();
        assert!(
            matches!(too_large, Error::ReserveTooLarge { .. }),
            "{too_large}"
        );
        assert!(
            too_large.to_string().contains("reserve less"),
            "{too_large}"
        );
        assert_eq!(
            mapped(&alloc.stats()),
            4 * MIB,
            "nothing made for a refusal"
        );
        alloc.trim();
    }

    /// Room for `blocks` blocks of `size` serves that many requests of that size.
    fn reserve_serves(alloc: NumaGpuAlloc, blocks: usize, size: usize) {
        alloc.reserve(blocks, size).unwrap();
        let layout = Layout::from_size_align(size, 64).unwrap();
        let before = alloc.stats();
        // SAFETY: a non-zero layout; each block freed below with it.
        let taken: Vec<_> = (0..blocks)
            .map(|_| unsafe { alloc.alloc(layout) })
            .collect();
        let stats = alloc.stats();
        for p in taken {
            // SAFETY: allocated above with this layout.
            unsafe { alloc.dealloc(p, layout) };
        }
        assert_eq!(
            (
                stats.cache_hits - before.cache_hits,
                stats.cache_misses - before.cache_misses
            ),
            (blocks as u64, 0),
            "{blocks} blocks of {size}: {stats}"
        );
        alloc.trim();
    }

    #[test]
    fn room_for_blocks_holds_every_block() {
        let _serial = serial();
        // Chunks whose rounding to 2 MiB would otherwise eat the last block's room.
        reserve_serves(allocator(), 45, 768 * KIB);
        reserve_serves(allocator().huge_pages(false), 32, 3 * MIB);
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
