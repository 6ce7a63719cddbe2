//! The per-node arena: live blocks, the cache of freed blocks (`index.rs`), blocks waiting for GPU
//! work (`pending.rs`), and per-node accounting.
//!
//! An arena is only touched under its `parking_lot::Mutex`, from inside the re-entrancy guard
//! (its maps allocate through the inner allocator). Slow work — mapping, populating, pinning,
//! unmapping — happens outside the lock; the arena only moves [`Block`] records around.

use std::collections::BTreeMap;

mod index;
mod pending;

use index::CacheIndex;
#[cfg(test)]
pub(crate) use pending::double as pending_double;
use pending::PendingList;
pub(crate) use pending::{settle, InFlight, PendingBlock, Work};

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

/// The cached blocks that may serve one request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fit {
    /// The request's class: the least capacity that covers it.
    pub(crate) least: usize,
    /// At most 1/8 more than the request itself (never less than the class, which page rounding
    /// can push beyond that for requests just above a page).
    pub(crate) most: usize,
    /// The address must be a multiple of this.
    pub(crate) align: usize,
}

impl Fit {
    /// For a request of `size` bytes whose class is `capacity`.
    pub(crate) fn new(size: usize, capacity: usize, align: usize) -> Fit {
        let most = size.saturating_add(size / CLASSES_PER_DOUBLING as usize);
        Fit {
            least: capacity,
            most: most.max(capacity),
            align,
        }
    }

    /// Whether `block` may serve the request.
    pub(crate) fn admits(&self, block: &Block) -> bool {
        (self.least..=self.most).contains(&block.capacity) && block.addr.is_multiple_of(self.align)
    }
}

/// A block handed out, with the GPU work recorded against it.
struct Live {
    block: Block,
    work: Work,
}

/// State behind one node's lock.
pub(crate) struct Arena {
    node: usize,
    topology: NumaTopology,
    /// By address, so that a pointer anywhere inside a block finds it.
    live: BTreeMap<usize, Live>,
    cached: CacheIndex,
    pending: PendingList,
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
            live: BTreeMap::new(),
            cached: CacheIndex::default(),
            pending: PendingList::default(),
            pinned_bytes: 0,
            peak_live_bytes: 0,
            tracker: NumaAllocTracker::new(topology),
        }
    }

    /// Moves pending blocks whose work has completed into the cache (evicting beyond `limit` into
    /// `evicted`). Polls, never waits: O(pending).
    pub(crate) fn settle_pending(&mut self, limit: usize, evicted: &mut Vec<Block>) {
        if self.pending.len() == 0 {
            return;
        }
        let mut ready = Vec::new();
        self.pending.poll(&mut ready);
        for block in ready {
            self.cache(block, limit, evicted);
        }
    }

    /// Takes a cached block that fits (see [`CacheIndex::take`]).
    pub(crate) fn take_cached(&mut self, fit: Fit) -> Option<Block> {
        self.cached.take(fit)
    }

    /// Whether a pending block would have served this request (a miss deferred by GPU work).
    pub(crate) fn pending_fits(&self, fit: Fit) -> bool {
        self.pending.holds_fit(fit)
    }

    /// Records a block handed out to the user.
    pub(crate) fn insert_live(&mut self, block: Block) {
        if let Ok(buffer) = NumaBuffer::on_node(&self.topology, self.node, block.capacity) {
            // Cannot fail: the tracker was built from the topology that contains `self.node`.
            let _ = self.tracker.record(&buffer);
        }
        let work = Work::new();
        self.live.insert(block.addr, Live { block, work });
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes());
    }

    /// Records that a newly created block exists (pinned bytes include live, pending and cached
    /// blocks).
    pub(crate) fn note_created(&mut self, block: &Block) {
        if block.pinned {
            self.pinned_bytes += block.capacity;
        }
    }

    /// Looks up a live block by address.
    pub(crate) fn live_block(&self, addr: usize) -> Option<Block> {
        self.live.get(&addr).map(|live| live.block)
    }

    /// Attaches `work` to the live block containing `addr`; gives it back when there is none.
    pub(crate) fn record_in_flight(
        &mut self,
        addr: usize,
        work: Box<dyn InFlight>,
    ) -> Result<(), Box<dyn InFlight>> {
        match self.live.range_mut(..=addr).next_back() {
            Some((_, live)) if addr - live.block.addr < live.block.capacity => {
                // A long-lived block recorded on every copy: keep only the work still running.
                settle(&mut live.work);
                live.work.push(work);
                Ok(())
            }
            _ => Err(work),
        }
    }

    /// Removes a live block and its recorded work; `None` if the address was not handed out by
    /// this arena.
    pub(crate) fn remove_live(&mut self, addr: usize) -> Option<(Block, Work)> {
        let Live { block, work } = self.live.remove(&addr)?;
        if let Ok(buffer) = NumaBuffer::on_node(&self.topology, self.node, block.capacity) {
            let _ = self.tracker.release(&buffer);
        }
        Some((block, work))
    }

    /// Takes back a freed block: pending while any of `work` is not complete, else cached (see
    /// [`Self::cache`]).
    pub(crate) fn free(
        &mut self,
        block: Block,
        mut work: Work,
        limit: usize,
        evicted: &mut Vec<Block>,
    ) {
        if settle(&mut work) {
            self.cache(block, limit, evicted);
        } else {
            self.pending.push(block, work);
            self.evict_beyond(limit, evicted);
        }
    }

    /// Caches a freed block, then evicts the oldest cached blocks while cached and pending bytes
    /// exceed `limit`. A block larger than the whole limit is evicted alone rather than emptying
    /// the cache. Pending blocks are never evicted: GPU work may still use them.
    pub(crate) fn cache(&mut self, block: Block, limit: usize, evicted: &mut Vec<Block>) {
        if block.capacity > limit {
            self.forget_pinned(&block);
            evicted.push(block);
            return;
        }
        self.cached.insert(block);
        self.evict_beyond(limit, evicted);
    }

    fn evict_beyond(&mut self, limit: usize, evicted: &mut Vec<Block>) {
        while self.cached.bytes() + self.pending.bytes() > limit {
            let Some(old) = self.cached.pop_oldest() else {
                break;
            };
            self.forget_pinned(&old);
            evicted.push(old);
        }
    }

    /// Removes every cached block and every pending block whose work has completed (for
    /// `trim()`), returning them for release. Pending blocks still in use stay pending.
    pub(crate) fn drain_cached(&mut self) -> Vec<Block> {
        let mut drained = self.cached.drain();
        self.pending.poll(&mut drained);
        for block in &drained {
            self.forget_pinned(block);
        }
        drained
    }

    /// Removes every pending block with its work (for the allocator's `Drop`, which waits).
    pub(crate) fn drain_pending(&mut self) -> Vec<PendingBlock> {
        let drained = self.pending.drain();
        for p in &drained {
            self.forget_pinned(&p.block);
        }
        drained
    }

    fn forget_pinned(&mut self, block: &Block) {
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
                row.cached_bytes = self.cached.bytes();
                row.pinned_bytes = self.pinned_bytes;
                row.live_blocks = self.live.len();
                row.cached_blocks = self.cached.len();
                row.pending_bytes = self.pending.bytes();
                row.pending_blocks = self.pending.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::pending::double::Flag;
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

    /// The fit of a request of `size` bytes, as the allocator computes it.
    fn fit(size: usize, align: usize) -> Fit {
        Fit::new(size, class_size(size, PAGE).unwrap(), align)
    }

    #[test]
    fn reuse_needs_covering_capacity_and_alignment() {
        let topo = NumaTopology::single_node();
        let mut arena = Arena::new(&topo, 0);
        let mut evicted = Vec::new();
        arena.cache(block(0x20_0000, 4 * MIB, false), usize::MAX, &mut evicted);
        assert_eq!(arena.take_cached(fit(5 * MIB, PAGE)), None, "too small");
        assert_eq!(arena.take_cached(fit(2 * MIB, PAGE)), None, "too wasteful");
        assert_eq!(arena.take_cached(fit(4 * MIB, 1 << 30)), None, "misaligned");
        assert_eq!(
            arena.take_cached(fit(4 * MIB - PAGE, 2 * MIB)),
            Some(block(0x20_0000, 4 * MIB, false))
        );
        assert_eq!(arena.cached.bytes(), 0);
    }

    #[test]
    fn reuse_wastes_at_most_an_eighth_of_the_request() {
        let topo = NumaTopology::single_node();
        let mut arena = Arena::new(&topo, 0);
        let mut evicted = Vec::new();
        // 2.5 MiB is one class above 2 MiB + 1 B (class 2.25 MiB): 25% over the request.
        arena.cache(
            block(0x20_0000, 2 * MIB + MIB / 2, false),
            usize::MAX,
            &mut evicted,
        );
        assert_eq!(arena.take_cached(fit(2 * MIB + 1, PAGE)), None);
        // 2.5 MiB for 2.25 MiB + 1 B is within 1/8 of the request although its class is 2.5 MiB.
        assert!(arena
            .take_cached(fit(2 * MIB + MIB / 4 + 1, PAGE))
            .is_some());
        let mut size = 4 * PAGE;
        while size < 64 * MIB {
            let f = fit(size, PAGE);
            assert!((f.most - size) * 8 <= size, "size {size} bound {}", f.most);
            size = size * 9 / 8 + 4321;
        }
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

    /// A live 4 MiB pinned block at `addr`, with work recorded through a pointer inside it.
    fn live_in_use(arena: &mut Arena, addr: usize) -> Arc<AtomicBool> {
        let b = block(addr, 4 * MIB, true);
        arena.note_created(&b);
        arena.insert_live(b);
        let (work, done) = Flag::unfinished();
        assert!(arena.record_in_flight(addr + MIB + 17, work).is_ok());
        done
    }

    #[test]
    fn a_freed_block_in_use_is_not_reused_before_its_work_completed() {
        let topo = NumaTopology::single_node();
        let mut arena = Arena::new(&topo, 0);
        let mut evicted = Vec::new();
        let done = live_in_use(&mut arena, 0x40_0000);
        let (block, work) = arena.remove_live(0x40_0000).unwrap();
        arena.free(block, work, usize::MAX, &mut evicted);
        arena.settle_pending(usize::MAX, &mut evicted);
        assert_eq!(
            arena.take_cached(fit(4 * MIB, PAGE)),
            None,
            "reused while in flight"
        );
        assert!(arena.pending_fits(fit(4 * MIB, PAGE)));
        let mut nodes = vec![NodeStats::default()];
        arena.fill(&mut nodes);
        assert_eq!(
            (nodes[0].pending_blocks, nodes[0].pending_bytes),
            (1, 4 * MIB)
        );
        assert_eq!(nodes[0].pinned_bytes, 4 * MIB);

        done.store(true, Ordering::Release);
        arena.settle_pending(usize::MAX, &mut evicted);
        assert_eq!(arena.take_cached(fit(4 * MIB, PAGE)), Some(block));
        assert!(evicted.is_empty());
    }

    #[test]
    fn work_is_recorded_only_inside_a_live_block() {
        let topo = NumaTopology::single_node();
        let mut arena = Arena::new(&topo, 0);
        arena.insert_live(block(0x40_0000, 4 * MIB, false));
        for addr in [0x40_0000 - 1, 0x40_0000 + 4 * MIB, 0] {
            assert!(
                arena.record_in_flight(addr, Flag::unfinished().0).is_err(),
                "{addr:#x}"
            );
        }
        assert!(arena
            .record_in_flight(0x40_0000 + 4 * MIB - 1, Flag::unfinished().0)
            .is_ok());
    }

    #[test]
    fn pending_bytes_count_against_the_limit_and_are_never_evicted() {
        let topo = NumaTopology::single_node();
        let mut arena = Arena::new(&topo, 0);
        let mut evicted = Vec::new();
        arena.cache(block(0x1000_0000, 4 * MIB, false), 8 * MIB, &mut evicted);
        let first = live_in_use(&mut arena, 0x2000_0000);
        let second = live_in_use(&mut arena, 0x3000_0000);
        for addr in [0x2000_0000, 0x3000_0000] {
            let (block, work) = arena.remove_live(addr).unwrap();
            arena.free(block, work, 8 * MIB, &mut evicted);
        }
        assert_eq!(
            evicted,
            [block(0x1000_0000, 4 * MIB, false)],
            "ready blocks go first"
        );
        assert_eq!(arena.drain_cached(), [], "trim skips blocks in flight");
        first.store(true, Ordering::Release);
        assert_eq!(arena.drain_cached(), [block(0x2000_0000, 4 * MIB, true)]);
        let pending = arena.drain_pending();
        assert_eq!(pending.len(), 1);
        assert!(
            !second.load(Ordering::Acquire),
            "draining does not wait: the caller does"
        );
        let mut nodes = vec![NodeStats::default()];
        arena.fill(&mut nodes);
        assert_eq!((nodes[0].pending_bytes, nodes[0].pinned_bytes), (0, 0));
    }

    #[test]
    fn a_block_over_the_limit_waits_for_its_work_before_eviction() {
        let topo = NumaTopology::single_node();
        let mut arena = Arena::new(&topo, 0);
        let mut evicted = Vec::new();
        let done = live_in_use(&mut arena, 0x2000_0000);
        let (block, work) = arena.remove_live(0x2000_0000).unwrap();
        arena.free(block, work, 2 * MIB, &mut evicted);
        assert!(evicted.is_empty(), "a block in flight is never released");
        done.store(true, Ordering::Release);
        arena.settle_pending(2 * MIB, &mut evicted);
        assert_eq!(evicted, [block]);
    }

    #[test]
    fn live_accounting_and_peak() {
        let topo = NumaTopology::two_node(20);
        let mut arena = Arena::new(&topo, 1);
        arena.insert_live(block(0x1000, 4 * MIB, false));
        arena.insert_live(block(0x2000, 2 * MIB, false));
        assert_eq!(
            arena.remove_live(0x1000).map(|b| b.0.capacity),
            Some(4 * MIB)
        );
        assert!(arena.remove_live(0x1000).is_none());
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
