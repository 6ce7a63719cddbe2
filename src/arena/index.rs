//! The cache of freed dedicated blocks: blocks too large to carve from a chunk (or grown by
//! `realloc`), each a mapping of its own, kept whole and reused for a request of nearly their
//! size.
//!
//! Dedicated blocks are at least 8 MiB (most at least half the largest chunk), so a node's cache
//! holds few of them (its limit over that size: 512 at most for the default 4 GiB, 8 of 512 MiB
//! blocks): a scan is cheaper than an index, and a vector whose room is reserved before a free
//! caches a block keeps the free path from allocating.

use super::{Block, Dedicated, Fit};

/// Cached blocks with the order in which they were cached.
#[derive(Default)]
pub(crate) struct CacheIndex {
    /// (sequence number, when cached in arena milliseconds, block), in no particular order.
    blocks: Vec<(u64, u64, Dedicated)>,
    next_seq: u64,
    bytes: usize,
}

impl CacheIndex {
    /// Makes room for `more` blocks beyond those cached now (for the live dedicated blocks,
    /// whose frees must not allocate); false when none can be had.
    pub(crate) fn reserve(&mut self, more: usize) -> bool {
        self.blocks.try_reserve(more).is_ok()
    }

    /// Adds a block freed at `now` as the newest, within the room reserved for it; gives it back
    /// when there is none (the caller releases it instead). Never allocates.
    pub(crate) fn insert(&mut self, dedicated: Dedicated, now: u64) -> Result<(), Dedicated> {
        if self.blocks.len() == self.blocks.capacity() {
            return Err(dedicated);
        }
        self.bytes += dedicated.block.capacity;
        self.blocks.push((self.next_seq, now, dedicated));
        self.next_seq += 1;
        Ok(())
    }

    /// Takes the newest block of the smallest capacity that `fit` admits.
    pub(crate) fn take(&mut self, fit: Fit) -> Option<Dedicated> {
        let at = self.find(fit)?;
        Some(self.remove(at))
    }

    fn remove(&mut self, at: usize) -> Dedicated {
        let (_, _, dedicated) = self.blocks.swap_remove(at);
        self.bytes -= dedicated.block.capacity;
        dedicated
    }

    /// Whether [`Self::take`] would find a block.
    pub(crate) fn holds(&self, fit: Fit) -> bool {
        self.find(fit).is_some()
    }

    fn find(&self, fit: Fit) -> Option<usize> {
        self.blocks
            .iter()
            .enumerate()
            .filter(|(_, (_, _, d))| fit.admits(&d.block))
            .min_by_key(|(_, (seq, _, d))| (d.block.capacity, u64::MAX - seq))
            .map(|(at, _)| at)
    }

    /// Takes a block of `fit`'s kind that `fit` does not admit but a new block for it can be
    /// made of: within `least..=most` bytes, one that evicting the oldest blocks until `over`
    /// bytes left would evict, and that `resizable` admits (its mapping can move or shrink:
    /// [`Memory::movable`]). The smallest of those larger than `fit` (it shrinks in place, so its
    /// address must suit `fit`), else the largest smaller (its pages move to the head of a larger
    /// mapping); the newest of equals.
    ///
    /// [`Memory::movable`]: crate::chunk::Memory::movable
    pub(crate) fn take_to_resize(
        &mut self,
        fit: Fit,
        (least, most): (usize, usize),
        over: usize,
        resizable: impl Fn(&Dedicated) -> bool,
    ) -> Option<Dedicated> {
        // Oldest first, a block is evicted while the bytes evicted before it are short of `over`.
        let evicted = |seq: u64| {
            let older = self.blocks.iter().filter(|(s, _, _)| *s < seq);
            older.map(|(_, _, d)| d.block.capacity).sum::<usize>() < over
        };
        let at = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, (seq, _, d))| {
                let block = &d.block;
                let larger = block.capacity > fit.most;
                block.kind == fit.kind
                    && (least..=most).contains(&block.capacity)
                    && (larger || block.capacity < fit.least)
                    && (!larger || block.addr.is_multiple_of(fit.align))
                    && resizable(d)
                    && evicted(*seq)
            })
            .min_by_key(|(_, (seq, _, d))| {
                let capacity = d.block.capacity;
                let smaller = capacity < fit.least;
                (smaller, capacity.abs_diff(fit.least), u64::MAX - seq)
            })
            .map(|(at, _)| at)?;
        Some(self.remove(at))
    }

    /// Removes the block cached longest ago.
    pub(crate) fn pop_oldest(&mut self) -> Option<Dedicated> {
        self.pop_cached_by(u64::MAX)
    }

    /// Removes the block cached longest ago if it was cached at `since` or before.
    pub(crate) fn pop_cached_by(&mut self, since: u64) -> Option<Dedicated> {
        self.pop_cached_where(since, |_| true)
    }

    /// Removes the block cached longest ago of those cached at `since` or before that `wanted`.
    pub(crate) fn pop_cached_where(
        &mut self,
        since: u64,
        wanted: impl Fn(&Block) -> bool,
    ) -> Option<Dedicated> {
        let at = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, (_, at, d))| *at <= since && wanted(&d.block))
            .min_by_key(|(_, (seq, _, _))| *seq)
            .map(|(at, _)| at)?;
        Some(self.remove(at))
    }

    /// Number of cached blocks.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Sum of the cached blocks' capacities.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Sum of the cached page-locked blocks' capacities.
    pub(crate) fn pinned_bytes(&self) -> usize {
        self.blocks
            .iter()
            .filter(|(_, _, d)| d.block.kind.pinned)
            .map(|(_, _, d)| d.block.capacity)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::tests::{dedicated, planned};
    use crate::arena::Kind;

    const MIB: usize = 1 << 20;

    /// An unpinned dedicated block at `offset` of the planned region (1 GiB aligned).
    fn block(offset: usize, capacity: usize) -> Dedicated {
        dedicated(offset, capacity, false)
    }

    /// The address of what `index` took or popped.
    fn at(taken: Option<Dedicated>) -> Option<usize> {
        taken.map(|d| d.block.addr - planned(0))
    }

    /// Capacities `least..=most`, addresses aligned to `align`.
    fn fit(least: usize, most: usize, align: usize) -> Fit {
        Fit {
            least,
            most,
            align,
            kind: Kind::default(),
        }
    }

    #[test]
    fn takes_the_newest_of_the_smallest_fitting_capacity() {
        let mut index = CacheIndex::default();
        assert!(index.reserve(3));
        for (addr, mib) in [(0x100_0000, 4), (0x200_0000, 4), (0x300_0000, 3)] {
            index.insert(block(addr, mib * MIB), 0).unwrap();
        }
        let fits = fit(3 * MIB, 5 * MIB, 4096);
        assert_eq!(at(index.take(fits)), Some(0x300_0000));
        assert_eq!(at(index.take(fits)), Some(0x200_0000));
        assert!(
            index.take(fit(5 * MIB, 6 * MIB, 4096)).is_none(),
            "none large enough"
        );
        assert!(
            index.take(fit(MIB, 2 * MIB, 4096)).is_none(),
            "none small enough"
        );
        assert_eq!((index.len(), index.bytes()), (1, 4 * MIB));
    }

    #[test]
    fn a_misaligned_block_is_skipped() {
        let mut index = CacheIndex::default();
        assert!(index.reserve(2));
        index.insert(block(0x10_1000, 4 * MIB), 0).unwrap();
        index.insert(block(0x40_0000, 5 * MIB), 0).unwrap();
        let fits = fit(4 * MIB, 5 * MIB, 2 * MIB);
        assert_eq!(at(index.take(fits)), Some(0x40_0000));
        assert!(index.take(fits).is_none());
    }

    /// Bytes over the budget that evict every cached block.
    const ALL: usize = usize::MAX;

    #[test]
    fn a_block_to_resize_is_the_nearest_larger_else_the_largest_smaller() {
        let mut index = CacheIndex::default();
        assert!(index.reserve(5));
        for (addr, mib) in [
            (0x100_0000, 64),
            (0x200_0000, 96),
            (0x300_0000, 160),
            (0x400_0000, 200),
            (0x500_1000, 150),
        ] {
            index.insert(block(addr, mib * MIB), 0).unwrap();
        }
        let wanted = fit(128 * MIB, 144 * MIB, 2 * MIB);
        let sizes = (32 * MIB, 512 * MIB);
        let any = |_: &Dedicated| true;
        // The two oldest (64 and 96 MiB) are what evicting 100 MiB would evict.
        assert_eq!(
            at(index.take_to_resize(wanted, sizes, 100 * MIB, any)),
            Some(0x200_0000)
        );
        index.insert(block(0x200_0000, 96 * MIB), 0).unwrap();
        assert!(
            index
                .take_to_resize(wanted, sizes, ALL, |_| false)
                .is_none(),
            "none that cannot move"
        );
        // 150 MiB is nearer but misaligned for shrinking in place.
        assert_eq!(
            at(index.take_to_resize(wanted, sizes, ALL, any)),
            Some(0x300_0000)
        );
        assert_eq!(
            at(index.take_to_resize(wanted, sizes, ALL, any)),
            Some(0x400_0000)
        );
        assert_eq!(
            at(index.take_to_resize(wanted, sizes, ALL, any)),
            Some(0x200_0000)
        );
        assert_eq!(
            at(index.take_to_resize(wanted, (80 * MIB, sizes.1), ALL, any)),
            None,
            "64 MiB is below the least"
        );
        assert_eq!(
            at(index.take_to_resize(wanted, sizes, ALL, any)),
            Some(0x100_0000)
        );
        assert!(
            index
                .take_to_resize(fit(128 * MIB, 160 * MIB, 4096), sizes, ALL, any)
                .is_none(),
            "150 MiB fits: take() serves it"
        );
    }

    #[test]
    fn eviction_goes_oldest_first_across_capacities() {
        let mut index = CacheIndex::default();
        assert!(index.reserve(4));
        assert!(index.insert(block(0x9000, MIB), 0).is_ok());
        assert_eq!(at(index.pop_oldest()), Some(0x9000));
        for (addr, mib) in [(0x1000, 4), (0x2000, 2), (0x3000, 4)] {
            index.insert(block(addr, mib * MIB), 0).unwrap();
        }
        assert_eq!(at(index.take(fit(4 * MIB, 4 * MIB, 4096))), Some(0x3000));
        index.insert(block(0x4000, 2 * MIB), 5).unwrap();
        assert_eq!(at(index.pop_cached_by(4)), Some(0x1000));
        index.insert(block(0x1000, 4 * MIB), 0).unwrap();
        let order: Vec<usize> = std::iter::from_fn(|| at(index.pop_oldest())).collect();
        assert_eq!(order, [0x2000, 0x4000, 0x1000]);
        assert_eq!((index.len(), index.bytes()), (0, 0));
    }
}
