//! Reservations: blocks made ahead of the requests that will want them and put straight into the
//! cache (as PyTorch's `pinned_reserve_segment_size_mb` avoids a first batch's stall). A reserved
//! block is an ordinary cached block: a request of its size class takes it as a cache hit, it
//! counts against the cache limit, and `trim()` releases it.

use std::io::Write as _;

use crate::arena::class_size;
use crate::config::{Config, Reserve};
use crate::route;
use crate::runtime::Runtime;
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

    /// Creates `blocks` blocks of `block_size` bytes (placed, populated, pinned as configured)
    /// and caches them. Blocks made before a failure stay cached.
    pub(crate) fn reserve(&self, blocks: usize, block_size: usize) -> Result<(), Error> {
        if blocks == 0 {
            return Ok(());
        }
        let limit = self.config.cache_limit;
        let capacity = check(&self.config, self.page_size, blocks, block_size)?;
        // On the node where the calling thread's blocks go (its route, or the value's target).
        let target = route::target(self);
        // `pin=strict` with nothing to page-lock them: none is made.
        self.kind(&target)?;
        for _ in 0..blocks {
            let block = self.create_block(capacity, self.page_size, &target)?;
            let mut evicted = Vec::new();
            if let Some(mut arena) = self.arena(block.node) {
                arena.insert_reserved(block, limit, &mut evicted);
            }
            // SAFETY: evicted blocks left the cache and are handed out to nobody.
            unsafe { self.release_blocks(evicted) };
        }
        Ok(())
    }
}

/// The capacity of each of `blocks` blocks of `block_size` bytes reserved under `config`, or
/// [`Error::ReserveRejected`] when a block would be below the threshold (no request would reuse
/// it) or all of them beyond the cache limit (they would be released at once).
pub(crate) fn check(
    config: &Config,
    page_size: usize,
    blocks: usize,
    block_size: usize,
) -> Result<usize, Error> {
    class_size(block_size, page_size)
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
mod tests {
    use std::alloc::{GlobalAlloc, Layout};

    use crate::alloc::tests::serial;
    use crate::{Error, NumaGpuAlloc, PinMode, Stats};

    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;

    fn allocator() -> NumaGpuAlloc {
        NumaGpuAlloc::new().threshold(64 * KIB).pin(PinMode::Off)
    }

    fn cached_blocks(stats: &Stats) -> usize {
        stats.nodes.iter().map(|n| n.cached_blocks).sum()
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
    fn reserved_blocks_serve_the_first_requests_and_trim_releases_them() {
        let _serial = serial();
        let alloc = allocator();
        alloc.reserve(2, MIB).unwrap();
        let stats = alloc.stats();
        assert_eq!((cached_blocks(&stats), stats.cached_bytes()), (2, 2 * MIB));
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
        assert_eq!(cached_blocks(&stats), 0);
        // SAFETY: allocated above with these layouts.
        unsafe {
            alloc.dealloc(first, layout);
            alloc.dealloc(second, smaller);
        }

        alloc.trim();
        let stats = alloc.stats();
        assert_eq!((cached_blocks(&stats), stats.released_blocks), (0, 2));
        assert!(!hit(&alloc, MIB), "trimmed: a miss again");
    }

    #[test]
    fn reservations_count_against_the_cache_limit() {
        let _serial = serial();
        let alloc = allocator().cache_limit(2 * MIB);
        assert!(!hit(&alloc, 512 * KIB), "the first request misses");
        alloc.reserve(2, MIB).unwrap();
        let stats = alloc.stats();
        assert_eq!((cached_blocks(&stats), stats.cached_bytes()), (2, 2 * MIB));
        assert_eq!(stats.released_blocks, 1, "the older cached block made room");
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
            cached_blocks(&alloc.stats()),
            2,
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
        assert_eq!(cached_blocks(&alloc.stats()), 3);
    }
}
