//! The per-node arena: live blocks, the cache of freed blocks, and per-node accounting.
//!
//! An arena is only touched under its `parking_lot::Mutex`, from inside the re-entrancy guard
//! (its maps allocate through the system allocator). Slow work — mapping, populating, pinning,
//! unmapping — happens outside the lock; the arena only moves [`Block`] records around.

use std::collections::{HashMap, VecDeque};

use crate::buffer::{NumaAllocTracker, NumaBuffer};
use crate::stats::NodeStats;
use crate::NumaTopology;

/// Size classes per power of two: with 8, rounding wastes at most 1/8 = 12.5% of a request.
const CLASSES_PER_DOUBLING: u32 = 8;

/// The capacity given to a request of `size` bytes: `size` rounded up to one of 8 classes per
/// power of two, and to whole pages.
pub(crate) fn class_size(size: usize, page_size: usize) -> Option<usize> {
    let size = size.max(1);
    let octave = usize::BITS - 1 - size.leading_zeros();
    let step_shift = octave.saturating_sub(CLASSES_PER_DOUBLING.trailing_zeros());
    let step = (1usize << step_shift).max(page_size);
    size.checked_next_multiple_of(step)
}

/// One mapping made by the large path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// Start address (the pointer handed out).
    pub(crate) addr: usize,
    /// Mapped bytes.
    pub(crate) capacity: usize,
    /// Registered with CUDA.
    pub(crate) pinned: bool,
}

/// State behind one node's lock.
pub(crate) struct Arena {
    node: usize,
    topology: NumaTopology,
    live: HashMap<usize, Block>,
    /// Oldest first, so the cache limit releases the oldest and reuse takes the newest.
    cached: VecDeque<Block>,
    cached_bytes: usize,
    pinned_bytes: usize,
    peak_live_bytes: usize,
    tracker: NumaAllocTracker,
}

impl Arena {
    /// An empty arena for blocks on `node` (one of `topology`'s nodes).
    pub(crate) fn new(topology: &NumaTopology, node: usize) -> Self {
        Arena {
            node,
            topology: topology.clone(),
            live: HashMap::new(),
            cached: VecDeque::new(),
            cached_bytes: 0,
            pinned_bytes: 0,
            peak_live_bytes: 0,
            tracker: NumaAllocTracker::new(topology),
        }
    }

    /// Takes the newest cached block whose capacity covers `capacity` without exceeding the
    /// waste bound (so reuse keeps the ≤ 12.5% promise) and whose address fits `align`.
    pub(crate) fn take_cached(&mut self, capacity: usize, align: usize) -> Option<Block> {
        let most = capacity.saturating_add(capacity / CLASSES_PER_DOUBLING as usize);
        let index = self
            .cached
            .iter()
            .rposition(|b| b.capacity >= capacity && b.capacity <= most && b.addr % align == 0)?;
        let block = self.cached.remove(index)?;
        self.cached_bytes = self.cached_bytes.saturating_sub(block.capacity);
        Some(block)
    }

    /// Records a block handed out to the user.
    pub(crate) fn insert_live(&mut self, block: Block) {
        if let Ok(buffer) = NumaBuffer::on_node(&self.topology, self.node, block.capacity) {
            // Cannot fail: the tracker was built from the topology that contains `self.node`.
            let _ = self.tracker.record(&buffer);
        }
        self.live.insert(block.addr, block);
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes());
    }

    /// Records that a newly created block exists (pinned bytes include live and cached blocks).
    pub(crate) fn note_created(&mut self, block: &Block) {
        if block.pinned {
            self.pinned_bytes += block.capacity;
        }
    }

    /// Looks up a live block by address.
    pub(crate) fn live_block(&self, addr: usize) -> Option<Block> {
        self.live.get(&addr).copied()
    }

    /// Removes a live block; `None` if the address was not handed out by this arena.
    pub(crate) fn remove_live(&mut self, addr: usize) -> Option<Block> {
        let block = self.live.remove(&addr)?;
        if let Ok(buffer) = NumaBuffer::on_node(&self.topology, self.node, block.capacity) {
            let _ = self.tracker.release(&buffer);
        }
        Some(block)
    }

    /// Caches a freed block, then evicts the oldest blocks beyond `limit` bytes into `evicted`.
    /// A block larger than the whole limit is evicted alone rather than emptying the cache.
    pub(crate) fn cache(&mut self, block: Block, limit: usize, evicted: &mut Vec<Block>) {
        if block.capacity > limit {
            if block.pinned {
                self.pinned_bytes = self.pinned_bytes.saturating_sub(block.capacity);
            }
            evicted.push(block);
            return;
        }
        self.cached.push_back(block);
        self.cached_bytes += block.capacity;
        while self.cached_bytes > limit {
            let Some(old) = self.cached.pop_front() else {
                break;
            };
            self.forget_cached(old);
            evicted.push(old);
        }
    }

    /// Removes every cached block (for `trim()`), returning them for release.
    pub(crate) fn drain_cached(&mut self) -> Vec<Block> {
        let drained: Vec<Block> = self.cached.drain(..).collect();
        self.cached_bytes = 0;
        for block in &drained {
            if block.pinned {
                self.pinned_bytes = self.pinned_bytes.saturating_sub(block.capacity);
            }
        }
        drained
    }

    fn forget_cached(&mut self, block: Block) {
        self.cached_bytes = self.cached_bytes.saturating_sub(block.capacity);
        if block.pinned {
            self.pinned_bytes = self.pinned_bytes.saturating_sub(block.capacity);
        }
    }

    /// Starts the peak over from the bytes live now (`reset_peaks()`).
    pub(crate) fn reset_peak(&mut self) {
        self.peak_live_bytes = self.live_bytes();
    }

    fn live_bytes(&self) -> usize {
        self.tracker.total_bytes()
    }

    /// Adds this arena's figures to the per-node rows.
    pub(crate) fn fill(&self, nodes: &mut [NodeStats]) {
        for row in nodes.iter_mut() {
            row.live_bytes = self.tracker.bytes_on_node(row.node).unwrap_or(0);
            if row.node == self.node {
                row.peak_live_bytes = self.peak_live_bytes;
                row.cached_bytes = self.cached_bytes;
                row.pinned_bytes = self.pinned_bytes;
                row.live_blocks = self.live.len();
                row.cached_blocks = self.cached.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;
    const MIB: usize = 1 << 20;

    #[test]
    fn classes_waste_at_most_an_eighth() {
        let mut size = 2 * MIB;
        while size < 512 * MIB {
            let class = class_size(size, PAGE).unwrap();
            assert!(class >= size);
            assert!((class - size) * 8 <= size, "size {size} class {class}");
            assert_eq!(class % PAGE, 0);
            size += 12_345 * 7;
        }
    }

    #[test]
    fn class_examples() {
        assert_eq!(class_size(2 * MIB, PAGE), Some(2 * MIB));
        assert_eq!(class_size(2 * MIB + 1, PAGE), Some(2 * MIB + 256 * 1024));
        assert_eq!(class_size(3 * MIB, PAGE), Some(3 * MIB));
        assert_eq!(class_size(100, PAGE), Some(PAGE));
        assert_eq!(class_size(usize::MAX, PAGE), None);
    }

    fn block(addr: usize, capacity: usize, pinned: bool) -> Block {
        Block {
            addr,
            capacity,
            pinned,
        }
    }

    #[test]
    fn reuse_needs_covering_capacity_and_alignment() {
        let topo = NumaTopology::single_node();
        let mut arena = Arena::new(&topo, 0);
        let mut evicted = Vec::new();
        arena.cache(block(0x20_0000, 4 * MIB, false), usize::MAX, &mut evicted);
        assert_eq!(arena.take_cached(5 * MIB, PAGE), None, "too small");
        assert_eq!(arena.take_cached(2 * MIB, PAGE), None, "too wasteful");
        assert_eq!(arena.take_cached(4 * MIB, 1 << 30), None, "misaligned");
        assert_eq!(
            arena.take_cached(4 * MIB - PAGE, 2 * MIB),
            Some(block(0x20_0000, 4 * MIB, false))
        );
        assert_eq!(arena.cached_bytes, 0);
    }

    #[test]
    fn cache_limit_evicts_oldest_first() {
        let topo = NumaTopology::single_node();
        let mut arena = Arena::new(&topo, 0);
        let mut evicted = Vec::new();
        for i in 1..=3 {
            let b = block(i * 0x1000_0000, 4 * MIB, true);
            arena.note_created(&b);
            arena.cache(b, 8 * MIB, &mut evicted);
        }
        assert_eq!(evicted, [block(0x1000_0000, 4 * MIB, true)]);
        let mut nodes = vec![NodeStats::default()];
        arena.fill(&mut nodes);
        assert_eq!(nodes[0].cached_bytes, 8 * MIB);
        assert_eq!(nodes[0].pinned_bytes, 8 * MIB);
        assert_eq!(nodes[0].cached_blocks, 2);
        let big = block(0x4000_0000, 16 * MIB, true);
        arena.note_created(&big);
        evicted.clear();
        arena.cache(big, 8 * MIB, &mut evicted);
        assert_eq!(
            evicted,
            [big],
            "a block over the limit leaves the others cached"
        );
        arena.fill(&mut nodes);
        assert_eq!(
            (nodes[0].cached_blocks, nodes[0].pinned_bytes),
            (2, 8 * MIB)
        );
        assert_eq!(arena.drain_cached().len(), 2);
        arena.fill(&mut nodes);
        assert_eq!((nodes[0].cached_bytes, nodes[0].pinned_bytes), (0, 0));
    }

    #[test]
    fn live_accounting_and_peak() {
        let topo = NumaTopology::two_node(20);
        let mut arena = Arena::new(&topo, 1);
        arena.insert_live(block(0x1000, 4 * MIB, false));
        arena.insert_live(block(0x2000, 2 * MIB, false));
        assert_eq!(arena.remove_live(0x1000).map(|b| b.capacity), Some(4 * MIB));
        assert_eq!(arena.remove_live(0x1000), None);
        let mut nodes = vec![
            NodeStats {
                node: 0,
                ..NodeStats::default()
            },
            NodeStats {
                node: 1,
                ..NodeStats::default()
            },
        ];
        arena.fill(&mut nodes);
        assert_eq!(nodes[0].live_bytes, 0);
        assert_eq!(nodes[1].live_bytes, 2 * MIB);
        assert_eq!(nodes[1].peak_live_bytes, 6 * MIB);
        assert_eq!(nodes[1].live_blocks, 1);
    }
}
