//! The cache of freed blocks, indexed by capacity: a lookup is O(log n), never a scan.
//!
//! Blocks of one capacity sit in a queue ordered by the time they were cached. Reuse takes the
//! newest (its pages are the most likely to be hot); eviction takes the oldest over all
//! capacities, which is always the front of its own queue, so both ends are O(1) once the queue is
//! found in the capacity map (O(log n)).

use std::collections::{BTreeMap, VecDeque};

use super::{Block, Fit};

/// Cached blocks by capacity, with their age order.
#[derive(Default)]
pub(crate) struct CacheIndex {
    /// Capacity → blocks of that capacity, oldest first, each with its sequence number. Empty
    /// queues are removed, so a range of capacities holds only hits.
    by_capacity: BTreeMap<usize, VecDeque<(u64, Block)>>,
    /// Sequence number → capacity, the oldest first: the eviction order.
    by_age: BTreeMap<u64, usize>,
    next_seq: u64,
    bytes: usize,
}

impl CacheIndex {
    /// Adds a freed block as the newest.
    pub(crate) fn insert(&mut self, block: Block) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_capacity
            .entry(block.capacity)
            .or_default()
            .push_back((seq, block));
        self.by_age.insert(seq, block.capacity);
        self.bytes += block.capacity;
    }

    /// Takes the newest block of the smallest capacity that `fit` admits. Only the newest block
    /// of each capacity is looked at: a request with a stricter alignment than that block's misses
    /// rather than searching the queue (blocks are page-aligned, and 2 MiB-aligned from 2 MiB
    /// with huge pages, so this is rare).
    pub(crate) fn take(&mut self, fit: Fit) -> Option<Block> {
        let capacity = self.find(fit)?;
        let queue = self.by_capacity.get_mut(&capacity)?;
        let (seq, block) = queue.pop_back()?;
        if queue.is_empty() {
            self.by_capacity.remove(&capacity);
        }
        self.by_age.remove(&seq);
        self.bytes -= block.capacity;
        Some(block)
    }

    /// Whether [`Self::take`] would find a block.
    pub(crate) fn holds(&self, fit: Fit) -> bool {
        self.find(fit).is_some()
    }

    /// The smallest capacity whose newest block `fit` admits.
    fn find(&self, fit: Fit) -> Option<usize> {
        self.by_capacity
            .range(fit.least..=fit.most)
            .find(|(_, queue)| queue.back().is_some_and(|(_, b)| fit.admits(b)))
            .map(|(&capacity, _)| capacity)
    }

    /// Removes the block cached longest ago.
    pub(crate) fn pop_oldest(&mut self) -> Option<Block> {
        let (_, capacity) = self.by_age.pop_first()?;
        let queue = self.by_capacity.get_mut(&capacity)?;
        // The oldest block overall is the oldest of its capacity: the front of its queue.
        let (_, block) = queue.pop_front()?;
        if queue.is_empty() {
            self.by_capacity.remove(&capacity);
        }
        self.bytes -= block.capacity;
        Some(block)
    }

    /// Removes every block, oldest first.
    pub(crate) fn drain(&mut self) -> Vec<Block> {
        let mut drained = Vec::with_capacity(self.len());
        while let Some(block) = self.pop_oldest() {
            drained.push(block);
        }
        drained
    }

    /// Number of cached blocks.
    pub(crate) fn len(&self) -> usize {
        self.by_age.len()
    }

    /// Sum of the cached blocks' capacities.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn block(addr: usize, capacity: usize) -> Block {
        Block {
            addr,
            capacity,
            pinned: false,
        }
    }

    /// Capacities `least..=most`, addresses aligned to `align`.
    fn fit(least: usize, most: usize, align: usize) -> Fit {
        Fit { least, most, align }
    }

    #[test]
    fn takes_the_newest_of_the_smallest_fitting_capacity() {
        let mut index = CacheIndex::default();
        index.insert(block(0x100_0000, 4 * MIB));
        index.insert(block(0x200_0000, 4 * MIB));
        index.insert(block(0x300_0000, 3 * MIB));
        assert_eq!(
            index.take(fit(3 * MIB, 5 * MIB, 4096)),
            Some(block(0x300_0000, 3 * MIB))
        );
        assert_eq!(
            index.take(fit(3 * MIB, 5 * MIB, 4096)),
            Some(block(0x200_0000, 4 * MIB))
        );
        assert_eq!(
            index.take(fit(5 * MIB, 6 * MIB, 4096)),
            None,
            "none large enough"
        );
        assert_eq!(
            index.take(fit(MIB, 2 * MIB, 4096)),
            None,
            "none small enough"
        );
        assert_eq!((index.len(), index.bytes()), (1, 4 * MIB));
    }

    #[test]
    fn a_misaligned_newest_block_is_skipped_for_the_next_capacity() {
        let mut index = CacheIndex::default();
        index.insert(block(0x10_1000, 4 * MIB));
        index.insert(block(0x40_0000, 5 * MIB));
        assert_eq!(
            index.take(fit(4 * MIB, 5 * MIB, 2 * MIB)),
            Some(block(0x40_0000, 5 * MIB))
        );
        assert_eq!(index.take(fit(4 * MIB, 5 * MIB, 2 * MIB)), None);
    }

    #[test]
    fn eviction_goes_oldest_first_across_capacities() {
        let mut index = CacheIndex::default();
        index.insert(block(0x1000, 4 * MIB));
        index.insert(block(0x2000, 2 * MIB));
        index.insert(block(0x3000, 4 * MIB));
        // Taking the newest 4 MiB block leaves the oldest 4 MiB one at its queue's front.
        assert_eq!(
            index.take(fit(4 * MIB, 4 * MIB, 4096)),
            Some(block(0x3000, 4 * MIB))
        );
        index.insert(block(0x4000, 2 * MIB));
        let order: Vec<usize> = index.drain().iter().map(|b| b.addr).collect();
        assert_eq!(order, [0x1000, 0x2000, 0x4000]);
        assert_eq!((index.len(), index.bytes()), (0, 0));
    }
}
