//! The per-node arena: live blocks, the cache of freed blocks (`index.rs`), blocks waiting for GPU
//! work (`pending.rs`), and per-node accounting.
//!
//! There is one arena per NUMA node for the whole process (`nodes.rs`), shared by every allocator
//! value. An arena is only touched under its lock (`lock.rs`), from inside the re-entrancy guard
//! (its maps allocate through the inner allocator). Slow work — mapping, populating, pinning,
//! unmapping — happens outside the lock; the arena only moves [`Block`] records around.

use std::collections::BTreeMap;

mod index;
mod nodes;
mod pending;

use index::CacheIndex;
pub(crate) use nodes::NODES;
#[cfg(test)]
pub(crate) use pending::double as pending_double;
use pending::PendingList;
pub(crate) use pending::{settle, InFlight, Work};

use crate::buffer::{NumaAllocTracker, NumaBuffer};
use crate::stats::{GpuStats, NodeStats};
use crate::sys::MemPolicy;
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

/// What a block was made with, beyond its node and size: a cached block serves only requests
/// that ask for the same. The GPU whose context registered a block is not part of it: blocks are
/// registered PORTABLE, so every GPU's context may use them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Kind {
    /// The `mbind` policy asked for (a block left unplaced, which is counted, keeps it: it
    /// serves the same requests as a placed one would).
    pub(crate) policy: MemPolicy,
    /// Registered with CUDA, with `CU_MEMHOSTREGISTER_DEVICEMAP` and `_READ_ONLY` as given.
    pub(crate) pinned: bool,
    pub(crate) devicemap: bool,
    pub(crate) read_only: bool,
}

impl Default for Kind {
    /// An unpinned block under the default policy.
    fn default() -> Self {
        Kind {
            policy: MemPolicy::Preferred,
            pinned: false,
            devicemap: false,
            read_only: false,
        }
    }
}

/// One mapping made by the large path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// Start address (the pointer handed out).
    pub(crate) addr: usize,
    /// Mapped bytes.
    pub(crate) capacity: usize,
    /// The node whose arena it belongs to.
    pub(crate) node: usize,
    /// What it was made with (see [`Kind`]).
    pub(crate) kind: Kind,
    /// CUDA ordinal of the device whose context registered it (for unregistering).
    pub(crate) gpu: Option<u32>,
    /// CUDA ordinal of the GPU the request it is live for was routed to (per-GPU stats).
    pub(crate) for_gpu: Option<u32>,
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
    /// What the block must have been made with.
    pub(crate) kind: Kind,
}

impl Fit {
    /// For a request of `size` bytes whose class is `capacity`, served by blocks of `kind`.
    pub(crate) fn new(size: usize, capacity: usize, align: usize, kind: Kind) -> Fit {
        let most = size.saturating_add(size / CLASSES_PER_DOUBLING as usize);
        Fit {
            least: capacity,
            most: most.max(capacity),
            align,
            kind,
        }
    }

    /// Whether `block` may serve the request.
    pub(crate) fn admits(&self, block: &Block) -> bool {
        (self.least..=self.most).contains(&block.capacity)
            && block.addr.is_multiple_of(self.align)
            && block.kind == self.kind
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
    /// Highest live plus pending bytes seen: the memory the program (and its GPU work) needed
    /// at once, which bounds the cache (see [`Self::budget`]).
    peak_in_use: usize,
    tracker: NumaAllocTracker,
    /// Live blocks per GPU they were handed out for, in ordinal order.
    gpus: Vec<GpuStats>,
    /// In a forked child: page-locked blocks are not reused (the child's copy is not registered,
    /// and a driver may keep registered ranges out of the child altogether), only released.
    in_child: bool,
    /// Set by the fork handler; the next settling moves page-locked cached blocks out.
    pinned_cache_stale: bool,
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
            peak_in_use: 0,
            tracker: NumaAllocTracker::new(topology),
            gpus: Vec::new(),
            in_child: false,
            pinned_cache_stale: false,
        }
    }

    /// Called by the fork handler in the child: page-locked blocks will no longer be reused. No
    /// work is done here; the next allocation releases the cached ones.
    pub(crate) fn enter_child(&mut self) {
        self.in_child = true;
        self.pinned_cache_stale = true;
    }

    /// Moves pending blocks whose work has completed into the cache (evicting beyond `limit` into
    /// `evicted`). Polls, never waits: O(pending).
    pub(crate) fn settle_pending(&mut self, limit: usize, evicted: &mut Vec<Block>) {
        if self.pinned_cache_stale {
            self.pinned_cache_stale = false;
            for block in self.cached.drain() {
                if block.kind.pinned {
                    self.forget_pinned(&block);
                    evicted.push(block);
                } else {
                    self.cached.insert(block);
                }
            }
        }
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

    /// Whether a cached block would serve this request.
    pub(crate) fn holds_fit(&self, fit: Fit) -> bool {
        self.cached.holds(fit)
    }

    /// The live block at `addr` when it may grow by moving its pages (`mremap`) into a block of
    /// `kind` (the tail is placed with the grower's policy): made with that kind, not
    /// page-locked (a registration is tied to the address), and no GPU work recorded against it.
    pub(crate) fn growable(&self, addr: usize, kind: Kind) -> Option<Block> {
        self.live
            .get(&addr)
            .filter(|live| {
                live.block.kind == kind && !live.block.kind.pinned && live.work.is_empty()
            })
            .map(|live| live.block)
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
        if let Some(row) = self.gpu_row(block.for_gpu) {
            row.live_bytes += block.capacity;
            row.live_blocks += 1;
            row.pinned_bytes += if block.kind.pinned { block.capacity } else { 0 };
            row.peak_live_bytes = row.peak_live_bytes.max(row.live_bytes);
        }
        let work = Work::new();
        self.live.insert(block.addr, Live { block, work });
        let live = self.live_bytes();
        self.peak_live_bytes = self.peak_live_bytes.max(live);
        self.peak_in_use = self.peak_in_use.max(live + self.pending.bytes());
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
        if let Some(row) = self.gpu_row(block.for_gpu) {
            // Saturating: a free path must not panic, even on accounting that drifted.
            row.live_bytes = row.live_bytes.saturating_sub(block.capacity);
            row.live_blocks = row.live_blocks.saturating_sub(1);
            if block.kind.pinned {
                row.pinned_bytes = row.pinned_bytes.saturating_sub(block.capacity);
            }
        }
        Some((block, work))
    }

    /// The row of GPU `ordinal`, added if it is new.
    fn gpu_row(&mut self, ordinal: Option<u32>) -> Option<&mut GpuStats> {
        let ordinal = ordinal?;
        let at = match self.gpus.binary_search_by_key(&ordinal, |row| row.ordinal) {
            Ok(at) => at,
            Err(at) => {
                let row = GpuStats {
                    ordinal,
                    node: self.node,
                    ..GpuStats::default()
                };
                self.gpus.insert(at, row);
                at
            }
        };
        self.gpus.get_mut(at)
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
    /// exceed the budget (`limit`, and the live high-water mark, see [`Self::budget`]). A block larger than the whole limit is evicted alone rather than emptying
    /// the cache, and so is a page-locked block in a forked child. Pending blocks are never
    /// evicted: GPU work may still use them.
    pub(crate) fn cache(&mut self, block: Block, limit: usize, evicted: &mut Vec<Block>) {
        if block.capacity > limit || (block.kind.pinned && self.in_child) {
            self.forget_pinned(&block);
            evicted.push(block);
            return;
        }
        self.cached.insert(block);
        self.evict_beyond(limit, evicted);
    }

    /// Records a block just created for a request, then evicts what the cache may no longer
    /// hold now that live bytes grew (see [`Self::budget`]).
    pub(crate) fn insert_created(&mut self, block: Block, limit: usize, evicted: &mut Vec<Block>) {
        self.note_created(&block);
        self.insert_live(block);
        self.evict_beyond(limit, evicted);
    }

    /// Caches a block made ahead of the requests that will want it (`reserve`). A reservation
    /// says how much will be in use at once, so it raises the high-water mark the budget follows
    /// (see [`Self::budget`]) to everything held now plus the block; only `limit` can evict it.
    pub(crate) fn insert_reserved(&mut self, block: Block, limit: usize, evicted: &mut Vec<Block>) {
        self.note_created(&block);
        let held = self.live_bytes() + self.pending.bytes() + self.cached.bytes() + block.capacity;
        self.peak_in_use = self.peak_in_use.max(held);
        self.cache(block, limit, evicted);
    }

    /// Pinned bytes include live, pending and cached blocks.
    fn note_created(&mut self, block: &Block) {
        if block.kind.pinned {
            self.pinned_bytes += block.capacity;
        }
    }

    /// Bytes the cache and the pending list may hold: at most `limit`, and no more than keeps
    /// live, pending and cached bytes within 1/8 above the most that was live and pending at
    /// once. Reuse never needs more (what was in use at once fits); a cache beyond it holds
    /// blocks the program has moved on from, such as a growing `Vec`'s smaller sizes, populated
    /// (maybe page-locked) for nothing.
    fn budget(&self, limit: usize) -> usize {
        let peak = self.peak_in_use;
        let roof = peak.saturating_add(peak / CLASSES_PER_DOUBLING as usize);
        limit.min(roof.saturating_sub(self.live_bytes()))
    }

    fn evict_beyond(&mut self, limit: usize, evicted: &mut Vec<Block>) {
        let budget = self.budget(limit);
        while self.cached.bytes() + self.pending.bytes() > budget {
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

    /// Removes the oldest cached blocks until they sum to at least `bytes` (or the cache is
    /// empty), returning them for release.
    pub(crate) fn release_oldest(&mut self, bytes: usize) -> Vec<Block> {
        let mut released = Vec::new();
        let mut sum = 0usize;
        while sum < bytes {
            let Some(old) = self.cached.pop_oldest() else {
                break;
            };
            sum += old.capacity;
            self.forget_pinned(&old);
            released.push(old);
        }
        released
    }

    fn forget_pinned(&mut self, block: &Block) {
        if block.kind.pinned {
            self.pinned_bytes = self.pinned_bytes.saturating_sub(block.capacity);
        }
    }

    /// Starts the peak over from the bytes live now (`reset_peaks()`). The cache budget keeps its
    /// own high-water mark: a statistics call does not release cached blocks.
    pub(crate) fn reset_peak(&mut self) {
        self.peak_live_bytes = self.live_bytes();
        for row in &mut self.gpus {
            row.peak_live_bytes = row.live_bytes;
        }
    }

    fn live_bytes(&self) -> usize {
        self.tracker.total_bytes()
    }

    /// The rows of the GPUs this node's arena has served.
    pub(crate) fn gpus(&self) -> &[GpuStats] {
        &self.gpus
    }

    /// Fills in this node's row.
    pub(crate) fn fill(&self, row: &mut NodeStats) {
        row.live_bytes = self.tracker.bytes_on_node(self.node).unwrap_or(0);
        row.peak_live_bytes = self.peak_live_bytes;
        row.cached_bytes = self.cached.bytes();
        row.pinned_bytes = self.pinned_bytes;
        row.live_blocks = self.live.len();
        row.cached_blocks = self.cached.len();
        row.pending_bytes = self.pending.bytes();
        row.pending_blocks = self.pending.len();
    }
}

#[cfg(test)]
mod tests;
