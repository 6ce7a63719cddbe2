//! The per-node arena: chunks of each kind with the carver that carves blocks of any size from
//! them (`carve.rs`), the dedicated blocks too large to carve and their cache (`index.rs`), blocks
//! waiting for GPU work (`pending.rs`), idle memory's decay, and per-node accounting.
//!
//! There is one arena per NUMA node for the whole process (`nodes.rs`), shared by every allocator
//! value. An arena is only touched under its lock (`lock.rs`), from inside the re-entrancy guard.
//! Slow work — mapping, populating, pinning, purging, unmapping — happens outside the lock: the
//! arena hands out what to do ([`Carving`], [`Released`]) and takes back the results.
//!
//! What the free path does here allocates nothing: a carved block goes back to its carver (which
//! relinks records), a dedicated one into a cache whose room was reserved before, a block with
//! GPU work into a pending list whose room was reserved when the work was recorded, and what is
//! to be released is handed out in fixed-size arrays.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Instant;

mod carve;
mod index;
mod nodes;
mod pending;

use carve::{Carver, Handle, Range};
use index::CacheIndex;
pub(crate) use nodes::NODES;
#[cfg(test)]
pub(crate) use pending::double as pending_double;
use pending::PendingList;
pub(crate) use pending::{settle, InFlight, Work};

use crate::buffer::{NumaAllocTracker, NumaBuffer};
use crate::chunk::{Chunk, ChunkRelease, Span};
use crate::stats::{GpuStats, HeapStats, NodeStats};
use crate::sys::MemPolicy;
use crate::NumaTopology;

/// Size classes per power of two: with 8, rounding wastes at most 1/8 = 12.5% of a request.
const CLASSES_PER_DOUBLING: u32 = 8;

/// The largest chunk, and the most one registration covers.
pub(crate) const CHUNK_MAX: usize = 1 << 30;
/// A heap's first chunk; each next one doubles, up to [`CHUNK_MAX`].
const CHUNK_FIRST: usize = 32 << 20;
/// Chunks are whole multiples of this (a huge page), and aligned to it.
pub(crate) const CHUNK_ALIGN: usize = 2 << 20;
/// Requests of at least this size get a mapping of their own (half the largest chunk).
pub(crate) const DEDICATED_MIN: usize = CHUNK_MAX / 2;
/// Wholly free pinned chunks decay this many times more slowly than unpinned memory: making one
/// again costs a populate and a registration.
const PINNED_DECAY_FACTOR: u64 = 10;

/// The capacity given to a dedicated request of `size` bytes: `size` rounded up to one of 8
/// classes per power of two, and to whole pages.
pub(crate) fn class_size(size: usize, page_size: usize) -> Option<usize> {
    let size = size.max(1);
    let octave = usize::BITS - 1 - size.leading_zeros();
    let step_shift = octave.saturating_sub(CLASSES_PER_DOUBLING.trailing_zeros());
    let step = (1usize << step_shift).max(page_size);
    size.checked_next_multiple_of(step)
}

/// What a block was made with, beyond its node and size: a block serves only requests that ask
/// for the same. The GPU whose context registered a block is not part of it: blocks are
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

/// The chunks one request may be carved from: its kind, and whether they are huge-page chunks
/// (for blocks of 2 MiB and more) or small-page ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HeapKey {
    pub(crate) kind: Kind,
    pub(crate) huge: bool,
}

/// What a request that failed for want of memory needs given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shortage {
    /// Memory (a failed populate, a cgroup limit): purging resident free space helps.
    Memory,
    /// Address space (a failed `mmap`): only unmapping helps.
    AddressSpace,
}

/// One block handed out: carved from a chunk, or a dedicated mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// Start address (the pointer handed out).
    pub(crate) addr: usize,
    /// Bytes it spans.
    pub(crate) capacity: usize,
    /// The node whose arena it belongs to.
    pub(crate) node: usize,
    /// What it was made with (see [`Kind`]).
    pub(crate) kind: Kind,
    /// CUDA ordinal of the device whose context registered a dedicated block (for
    /// unregistering; a carved block's chunk holds its registration).
    pub(crate) gpu: Option<u32>,
    /// CUDA ordinal of the GPU the request it is live for was routed to (per-GPU stats).
    pub(crate) for_gpu: Option<u32>,
}

/// Where a carved block came from: its heap and its carver record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    heap: usize,
    handle: Handle,
}

/// The cached dedicated blocks that may serve one request.
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
pub(crate) struct Live {
    pub(crate) block: Block,
    slot: Option<Slot>,
    work: Work,
}

impl Live {
    /// The same block with its recorded work dropped (tests switch stream-ordered reuse off).
    pub(crate) fn without_work(self) -> Live {
        Live {
            work: Work::new(),
            ..self
        }
    }
}

/// A carved block just handed out, and what the caller must do to it outside the lock.
#[derive(Debug)]
pub(crate) struct Carving {
    pub(crate) block: Block,
    /// Granules never populated yet (unpinned chunks only).
    pub(crate) populate: Option<Span>,
    /// The part that may hold old data: a zeroed request clears it.
    pub(crate) dirty: Option<Span>,
}

/// Hashes page-aligned addresses for the live map: the page number, scrambled by a multiply
/// (hashbrown reads the top bits).
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, addr: usize) {
        self.0 = ((addr as u64) >> 12).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The chunks of one [`HeapKey`] and their carver.
struct Heap {
    key: HeapKey,
    carver: Carver,
    /// By carver region id.
    chunks: Vec<Option<Chunk>>,
    /// The length of the next chunk made (doubling, up to [`CHUNK_MAX`]).
    next_chunk: usize,
    /// Chunks made, and registered, over the heap's life.
    chunks_made: u64,
    registrations: u64,
    /// Bytes given back to the kernel by purging idle free ranges.
    purged: u64,
}

impl Heap {
    /// Resident bytes of the chunks not in live or pending blocks (granules shared with a block
    /// count as the block's).
    fn idle_resident(&self) -> usize {
        let resident: usize = self.chunks.iter().flatten().map(Chunk::resident).sum();
        resident.saturating_sub(self.carver.used_bytes())
    }

    fn chunk_mut(&mut self, region: u32) -> Option<&mut Chunk> {
        self.chunks.get_mut(region as usize)?.as_mut()
    }
}

/// What an arena operation leaves for the caller to do outside the lock: dedicated blocks to
/// release, chunks to release, idle ranges to purge (then [`Arena::purged`]). Fixed-size, so that
/// a free fills it without allocating; an operation that finds it full leaves the rest for later.
#[derive(Default)]
pub(crate) struct Released {
    pub(crate) blocks: Bounded<Block, 8>,
    pub(crate) chunks: Bounded<Chunk, 4>,
    pub(crate) purges: Bounded<Purge, 16>,
}

impl Released {
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty() && self.chunks.is_empty() && self.purges.is_empty()
    }

    fn full(&self) -> bool {
        self.blocks.is_full() || self.chunks.is_full() || self.purges.is_full()
    }
}

/// An idle free range taken out of its carver while the caller purges `span` of it.
#[derive(Debug)]
pub(crate) struct Purge {
    heap: usize,
    range: Range,
    pub(crate) span: Span,
}

/// At most `N` values, on the stack.
pub(crate) struct Bounded<T, const N: usize> {
    items: [Option<T>; N],
    len: usize,
}

impl<T, const N: usize> Default for Bounded<T, N> {
    fn default() -> Self {
        Bounded {
            items: [const { None }; N],
            len: 0,
        }
    }
}

impl<T, const N: usize> Bounded<T, N> {
    /// Adds `item`; gives it back when full.
    pub(crate) fn push(&mut self, item: T) -> Result<(), T> {
        match self.items.get_mut(self.len) {
            Some(slot) => {
                *slot = Some(item);
                self.len += 1;
                Ok(())
            }
            None => Err(item),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn is_full(&self) -> bool {
        self.len == N
    }

    /// The items, in the order pushed.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.items[..self.len].iter().flatten()
    }

    /// Takes every item out, in the order pushed.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        let len = std::mem::take(&mut self.len);
        self.items[..len].iter_mut().filter_map(Option::take)
    }
}

/// State behind one node's lock.
pub(crate) struct Arena {
    node: usize,
    topology: NumaTopology,
    /// The arena's clock starts here (milliseconds for the carvers' idle stamps).
    epoch: Instant,
    /// Every live block, by address.
    live: HashMap<usize, Live, BuildHasherDefault<AddrHasher>>,
    /// Live blocks with GPU work recorded: the pending list keeps room for each.
    live_with_work: usize,
    heaps: Vec<Heap>,
    cached: CacheIndex,
    pending: PendingList,
    /// Page-locked dedicated blocks' bytes (live, pending and cached).
    pinned_dedicated: usize,
    peak_live_bytes: usize,
    /// Highest live plus pending bytes seen: bounds the dedicated cache (see [`Self::budget`]).
    peak_in_use: usize,
    tracker: NumaAllocTracker,
    /// Live blocks per GPU they were handed out for, in ordinal order.
    gpus: Vec<GpuStats>,
    /// In a forked child: page-locked memory is not reused (the child's copy is not registered,
    /// and a driver may keep registered ranges out of the child altogether).
    in_child: bool,
    /// Set by the fork handler; the next settling moves page-locked cached blocks out.
    pinned_cache_stale: bool,
    /// When idle memory is looked at next (arena milliseconds).
    next_decay: u64,
}

impl Arena {
    /// An empty arena for blocks on `node` (one of `topology`'s nodes).
    pub(crate) fn new(topology: &NumaTopology, node: usize) -> Self {
        Arena {
            node,
            topology: topology.clone(),
            epoch: Instant::now(),
            live: HashMap::default(),
            live_with_work: 0,
            heaps: Vec::new(),
            cached: CacheIndex::default(),
            pending: PendingList::default(),
            pinned_dedicated: 0,
            peak_live_bytes: 0,
            peak_in_use: 0,
            tracker: NumaAllocTracker::new(topology),
            gpus: Vec::new(),
            in_child: false,
            pinned_cache_stale: false,
            next_decay: 0,
        }
    }

    /// The node whose blocks this arena holds.
    pub(crate) fn node(&self) -> usize {
        self.node
    }

    /// Milliseconds since the arena was made.
    pub(crate) fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Called by the fork handler in the child: page-locked memory will no longer be reused. No
    /// work is done here; the next allocation releases the cached dedicated blocks.
    pub(crate) fn enter_child(&mut self) {
        self.in_child = true;
        self.pinned_cache_stale = true;
    }

    fn heap_index(&self, key: HeapKey) -> Option<usize> {
        self.heaps.iter().position(|h| h.key == key)
    }

    /// Carves `size` bytes (a multiple of the page size) at a multiple of `align` from a chunk of
    /// `key`, and records the block live for `for_gpu`. `Ok(None)`: no chunk has room (make one,
    /// [`Self::add_chunk`]); `Err(())`: the bookkeeping could not grow.
    pub(crate) fn carve(
        &mut self,
        key: HeapKey,
        size: usize,
        align: usize,
        for_gpu: Option<u32>,
    ) -> Result<Option<Carving>, ()> {
        // In a forked child pinned chunks are the parent's registrations: never handed out again.
        let Some(heap) = self
            .heap_index(key)
            .filter(|_| !(self.in_child && key.kind.pinned))
        else {
            return Ok(None);
        };
        self.live.try_reserve(1).map_err(drop)?;
        let Some(range) = self.heaps[heap].carver.carve(size, align).map_err(drop)? else {
            return Ok(None);
        };
        let Some(chunk) = self.heaps[heap].chunk_mut(range.region) else {
            // Cannot happen: every region has its chunk. Keep the range out of use.
            return Ok(None);
        };
        let populate = chunk.plan_populate(range.addr, range.size);
        let dirty = chunk.hand_out(range.addr, range.size);
        let block = Block {
            addr: range.addr,
            capacity: range.size,
            node: self.node,
            kind: key.kind,
            gpu: None,
            for_gpu,
        };
        let slot = Slot {
            heap,
            handle: range.handle,
        };
        self.insert_live(block, Some(slot));
        Ok(Some(Carving {
            block,
            populate,
            dirty,
        }))
    }

    /// Undoes a carving whose populate failed: its granules are marked not resident again and
    /// the block goes back, unused.
    pub(crate) fn populate_failed(&mut self, block: Block, span: Span) {
        let Some(live) = self.remove_live(block.addr) else {
            return;
        };
        if let Some(slot) = live.slot {
            let heap = &mut self.heaps[slot.heap];
            if let Some(range) = heap.carver.free(slot.handle, block.addr, 0) {
                if let Some(chunk) = heap.chunk_mut(range.region) {
                    chunk.populate_failed(span);
                }
            }
        }
    }

    /// How long the next chunk of `key` is for a request that needs `need` bytes of it.
    pub(crate) fn next_chunk_len(&self, key: HeapKey, need: usize) -> usize {
        let next = self
            .heap_index(key)
            .map_or(CHUNK_FIRST, |h| self.heaps[h].next_chunk);
        next.max(need.next_multiple_of(CHUNK_ALIGN))
    }

    /// Adds a chunk made for `key` outside the lock; gives it back when the bookkeeping could not
    /// grow (the caller releases it).
    pub(crate) fn add_chunk(&mut self, key: HeapKey, chunk: Chunk) -> Result<(), Chunk> {
        let heap = match self.heap_index(key) {
            Some(heap) => heap,
            None => {
                if self.heaps.try_reserve(1).is_err() {
                    return Err(chunk);
                }
                self.heaps.push(Heap {
                    key,
                    carver: Carver::new(crate::sys::page_size()),
                    chunks: Vec::new(),
                    next_chunk: CHUNK_FIRST,
                    chunks_made: 0,
                    registrations: 0,
                    purged: 0,
                });
                self.heaps.len() - 1
            }
        };
        let now = self.now();
        let heap = &mut self.heaps[heap];
        if heap.chunks.try_reserve(1).is_err() {
            return Err(chunk);
        }
        let Ok(region) = heap.carver.add_region(chunk.base(), chunk.len(), now, true) else {
            return Err(chunk);
        };
        let at = region as usize;
        if heap.chunks.len() <= at {
            heap.chunks.resize_with(at + 1, || None);
        }
        heap.chunks_made += 1;
        heap.registrations += u64::from(chunk.pinned());
        heap.next_chunk = (chunk.len().max(heap.next_chunk) * 2).min(CHUNK_MAX);
        heap.chunks[at] = Some(chunk);
        Ok(())
    }

    /// Moves pending blocks whose work has completed back (evicting beyond `limit` into `out`).
    /// Polls, never waits: O(pending).
    pub(crate) fn settle_pending(&mut self, limit: usize, out: &mut Released) {
        if self.pinned_cache_stale {
            self.pinned_cache_stale = false;
            let mut kept = CacheIndex::default();
            while let Some(block) = self.cached.pop_oldest() {
                let block = if block.kind.pinned {
                    self.forget_pinned(&block);
                    match out.blocks.push(block) {
                        Ok(()) => continue,
                        Err(block) => block,
                    }
                } else {
                    block
                };
                if let Err(block) = kept.insert(block, 0) {
                    let _ = out.blocks.push(block);
                }
            }
            self.cached = kept;
        }
        if self.pending.len() == 0 {
            return;
        }
        let now = self.now();
        let mut cursor = 0;
        while let Some((block, slot)) = self.pending.take_ready(&mut cursor) {
            self.give_back(block, slot, now, limit, out);
        }
    }

    /// A freed block without work in flight: back to its carver, or into the dedicated cache.
    fn give_back(
        &mut self,
        block: Block,
        slot: Option<Slot>,
        now: u64,
        limit: usize,
        out: &mut Released,
    ) {
        match slot {
            Some(slot) => {
                let _ = self.heaps[slot.heap]
                    .carver
                    .free(slot.handle, block.addr, now);
            }
            None => self.cache(block, limit, out),
        }
    }

    /// Takes a cached dedicated block that fits (see [`CacheIndex::take`]).
    pub(crate) fn take_cached(&mut self, fit: Fit) -> Option<Block> {
        self.cached.take(fit)
    }

    /// Whether a cached dedicated block would serve this request.
    pub(crate) fn holds_fit(&self, fit: Fit) -> bool {
        self.cached.holds(fit)
    }

    /// The live dedicated block at `addr` when it may grow by moving its pages (`mremap`) into a
    /// block of `kind`: made with that kind, not page-locked (a registration is tied to the
    /// address), and no GPU work recorded against it.
    pub(crate) fn growable(&self, addr: usize, kind: Kind) -> Option<Block> {
        self.live
            .get(&addr)
            .filter(|live| {
                live.slot.is_none()
                    && live.block.kind == kind
                    && !live.block.kind.pinned
                    && live.work.is_empty()
            })
            .map(|live| live.block)
    }

    /// Whether a pending block would have served this request (a miss deferred by GPU work).
    pub(crate) fn pending_fits(&self, fit: Fit) -> bool {
        self.pending.holds_fit(fit)
    }

    /// Records a dedicated block handed out to the user (room reserved first: `false` when none
    /// could be had, and the block is not recorded).
    pub(crate) fn insert_dedicated(&mut self, block: Block) -> bool {
        if self.live.try_reserve(1).is_err() {
            return false;
        }
        self.insert_live(block, None);
        true
    }

    /// Records a live block; the map has room (reserved by the caller).
    fn insert_live(&mut self, block: Block, slot: Option<Slot>) {
        self.account(&block, true);
        let work = Work::new();
        self.live.insert(block.addr, Live { block, slot, work });
        let live = self.live_bytes();
        self.peak_live_bytes = self.peak_live_bytes.max(live);
        self.peak_in_use = self.peak_in_use.max(live + self.pending.bytes());
    }

    /// Adds (or removes) a live block's bytes to the node's and its GPU's rows. Saturating: a free
    /// path must not panic, even on accounting that drifted.
    fn account(&mut self, block: &Block, live: bool) {
        if let Ok(buffer) = NumaBuffer::on_node(&self.topology, self.node, block.capacity) {
            // Cannot fail: the tracker was built from the topology that contains `self.node`.
            let _ = if live {
                self.tracker.record(&buffer)
            } else {
                self.tracker.release(&buffer)
            };
        }
        if let Some(row) = self.gpu_row(block.for_gpu) {
            let pinned = if block.kind.pinned { block.capacity } else { 0 };
            if live {
                row.live_bytes += block.capacity;
                row.live_blocks += 1;
                row.pinned_bytes += pinned;
                row.peak_live_bytes = row.peak_live_bytes.max(row.live_bytes);
            } else {
                row.live_bytes = row.live_bytes.saturating_sub(block.capacity);
                row.live_blocks = row.live_blocks.saturating_sub(1);
                row.pinned_bytes = row.pinned_bytes.saturating_sub(pinned);
            }
        }
    }

    /// Looks up a live block by address.
    pub(crate) fn live_block(&self, addr: usize) -> Option<Block> {
        self.live.get(&addr).map(|live| live.block)
    }

    /// Attaches `work` to the live block containing `addr`; gives it back when there is none, or
    /// when the pending list cannot reserve room for the block (its free must not allocate).
    pub(crate) fn record_in_flight(
        &mut self,
        addr: usize,
        work: Box<dyn InFlight>,
    ) -> Result<(), Box<dyn InFlight>> {
        let Some(start) = self.live_start(addr) else {
            return Err(work);
        };
        let reserved = self.pending.reserve(self.live_with_work + 1);
        let Some(live) = self.live.get_mut(&start) else {
            return Err(work);
        };
        // Counted already: the pending list has room for this block.
        let counted = !live.work.is_empty();
        // A long-lived block recorded on every copy: keep only the work still running.
        settle(&mut live.work);
        let room = (counted || reserved) && live.work.try_reserve(1).is_ok();
        let result = if room {
            live.work.push(work);
            Ok(())
        } else {
            Err(work)
        };
        match (counted, !live.work.is_empty()) {
            (false, true) => self.live_with_work += 1,
            (true, false) => self.live_with_work = self.live_with_work.saturating_sub(1),
            _ => {}
        }
        result
    }

    /// The start of the live block containing `addr`.
    fn live_start(&self, addr: usize) -> Option<usize> {
        if self.live.contains_key(&addr) {
            return Some(addr);
        }
        let carved = self
            .heaps
            .iter()
            .find_map(|h| h.carver.used_containing(addr))
            .map(|range| range.addr)
            .filter(|start| self.live.contains_key(start));
        carved.or_else(|| {
            self.live
                .values()
                .find(|l| {
                    l.slot.is_none()
                        && (l.block.addr..l.block.addr + l.block.capacity).contains(&addr)
                })
                .map(|l| l.block.addr)
        })
    }

    /// Removes a live block and its recorded work; `None` if the address was not handed out by
    /// this arena.
    pub(crate) fn remove_live(&mut self, addr: usize) -> Option<Live> {
        let live = self.live.remove(&addr)?;
        if !live.work.is_empty() {
            self.live_with_work = self.live_with_work.saturating_sub(1);
        }
        self.account(&live.block, false);
        Some(live)
    }

    /// The row of GPU `ordinal`, added if it is new.
    fn gpu_row(&mut self, ordinal: Option<u32>) -> Option<&mut GpuStats> {
        let ordinal = ordinal?;
        let at = match self.gpus.binary_search_by_key(&ordinal, |row| row.ordinal) {
            Ok(at) => at,
            Err(at) => {
                if self.gpus.try_reserve(1).is_err() {
                    return None;
                }
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

    /// Takes back a freed block: pending while any of its work is not complete, else back to its
    /// carver or cached (see [`Self::cache`]). Allocates nothing.
    pub(crate) fn free(&mut self, mut live: Live, limit: usize, out: &mut Released) {
        if settle(&mut live.work) {
            let now = self.now();
            self.give_back(live.block, live.slot, now, limit, out);
            self.hold_within(limit, out);
        } else {
            self.pending.push(live.block, live.slot, live.work);
            self.evict_beyond(limit, out);
        }
    }

    /// Gives the oldest idle memory back while idle memory that may be resident (dirty free
    /// ranges, cached dedicated blocks) is above `limit`.
    fn hold_within(&mut self, limit: usize, out: &mut Released) {
        let idle = self.heaps.iter().map(Heap::idle_resident).sum::<usize>() + self.cached.bytes();
        if idle > limit {
            self.release_idle(0, idle - limit, Shortage::Memory, out);
        }
    }

    /// Caches a freed dedicated block, then evicts the oldest cached blocks while cached and
    /// pending bytes exceed the budget (`limit`, and the live high-water mark, see
    /// [`Self::budget`]). A block larger than the whole limit is evicted alone rather than
    /// emptying the cache, and so is a page-locked block in a forked child. Pending blocks are
    /// never evicted: GPU work may still use them.
    pub(crate) fn cache(&mut self, block: Block, limit: usize, out: &mut Released) {
        if block.capacity > limit || (block.kind.pinned && self.in_child) {
            self.evict(block, out);
            return;
        }
        if let Err(block) = self.cached.insert(block, self.now()) {
            self.evict(block, out);
            return;
        }
        self.evict_beyond(limit, out);
    }

    /// Hands a dedicated block out for release. When `out` is full (only after many evictions
    /// in one operation) it stays cached beyond the budget, for a later operation to evict; when
    /// even that finds no room it is left mapped and forgotten rather than tracked wrongly.
    fn evict(&mut self, block: Block, out: &mut Released) {
        self.forget_pinned(&block);
        if let Err(block) = out.blocks.push(block) {
            self.note_created(&block);
            let _ = self.cached.insert(block, self.now());
        }
    }

    /// Records a dedicated block just created for a request, then evicts what the cache may no
    /// longer hold now that live bytes grew (see [`Self::budget`]). `false` when it could not be
    /// recorded (the caller releases it).
    pub(crate) fn insert_created(
        &mut self,
        block: Block,
        limit: usize,
        out: &mut Released,
    ) -> bool {
        if !self.insert_dedicated(block) {
            return false;
        }
        self.note_created(&block);
        self.evict_beyond(limit, out);
        true
    }

    /// Caches a dedicated block made ahead of the requests that will want it (`reserve`). A
    /// reservation says how much will be in use at once, so it raises the high-water mark the
    /// budget follows (see [`Self::budget`]) to everything held now plus the block; only `limit`
    /// can evict it.
    pub(crate) fn insert_reserved(&mut self, block: Block, limit: usize, out: &mut Released) {
        self.note_created(&block);
        let held = self.live_bytes() + self.pending.bytes() + self.cached.bytes() + block.capacity;
        self.peak_in_use = self.peak_in_use.max(held);
        self.cache(block, limit, out);
    }

    /// Pinned dedicated bytes include live, pending and cached blocks.
    fn note_created(&mut self, block: &Block) {
        if block.kind.pinned {
            self.pinned_dedicated += block.capacity;
        }
    }

    /// Bytes the dedicated cache and the pending list may hold: at most `limit`, and no more than
    /// keeps live, pending and cached bytes within 1/8 above the most that was live and pending
    /// at once. Reuse never needs more (what was in use at once fits).
    fn budget(&self, limit: usize) -> usize {
        let peak = self.peak_in_use;
        let roof = peak.saturating_add(peak / CLASSES_PER_DOUBLING as usize);
        limit.min(roof.saturating_sub(self.live_bytes()))
    }

    fn evict_beyond(&mut self, limit: usize, out: &mut Released) {
        let budget = self.budget(limit);
        while self.cached.bytes() + self.pending.bytes() > budget && !out.blocks.is_full() {
            let Some(old) = self.cached.pop_oldest() else {
                break;
            };
            self.evict(old, out);
        }
    }

    /// Idle memory: free ranges not used for `decay_ms` are purged, chunks wholly free for as
    /// long (pinned ones ten times as long) released. Looks at most four times per `decay_ms`;
    /// stops when `out` is full.
    pub(crate) fn decay(&mut self, decay_ms: u64, out: &mut Released) {
        let now = self.now();
        if now < self.next_decay {
            return;
        }
        self.next_decay = now.saturating_add(decay_ms / 4);
        self.release_idle(decay_ms, usize::MAX, Shortage::Memory, out);
    }

    /// Gives back memory idle for at least `age` milliseconds — chunks wholly free for as long
    /// released (pinned ones: idle ten times as long), free ranges purged, then cached dedicated
    /// blocks — until `bytes` were given back or `out` is full; `Shortage::AddressSpace` counts
    /// only what unmaps (purging keeps the mapping). Returns the bytes given back.
    fn release_idle(
        &mut self,
        age: u64,
        bytes: usize,
        want: Shortage,
        out: &mut Released,
    ) -> usize {
        let now = self.now();
        let mut released = 0usize;
        for h in 0..self.heaps.len() {
            let pinned = self.heaps[h].key.kind.pinned;
            // A forked child's pinned chunks are the parent's registrations: left alone.
            if pinned && self.in_child {
                continue;
            }
            let chunk_age = if pinned {
                age.saturating_mul(PINNED_DECAY_FACTOR)
            } else {
                age
            };
            if let Some(since) = now.checked_sub(chunk_age) {
                let left = bytes - released.min(bytes);
                released += self.release_free_chunks(h, since, age == 0, left, out);
            }
            if let Some(since) = now.checked_sub(age).filter(|_| !pinned) {
                let purged = self.purge_idle(h, since, bytes - released.min(bytes), out);
                if want == Shortage::Memory {
                    released += purged;
                }
            }
        }
        let cached_by = now.saturating_sub(age);
        while released < bytes && !out.blocks.is_full() && age != u64::MAX {
            let Some(old) = self.cached.pop_cached_by(cached_by) else {
                break;
            };
            released += old.capacity;
            self.evict(old, out);
        }
        released
    }

    /// Takes the chunks of heap `h` wholly free since `since` out, into `out`; reserved chunks
    /// only when everything idle goes (`everything`: trim, memory pressure).
    fn release_free_chunks(
        &mut self,
        h: usize,
        since: u64,
        everything: bool,
        bytes: usize,
        out: &mut Released,
    ) -> usize {
        let mut released = 0;
        let heap = &mut self.heaps[h];
        while released < bytes && !out.chunks.is_full() {
            let (carver, chunks) = (&heap.carver, &heap.chunks);
            let idle = carver
                .regions()
                .map(|(region, _, _)| region)
                .filter(|&region| {
                    everything
                        || !chunks
                            .get(region as usize)
                            .and_then(Option::as_ref)
                            .is_some_and(Chunk::reserved)
                })
                .find(|&region| carver.wholly_free(region).is_some_and(|t| t <= since));
            let Some(chunk) = idle
                .and_then(|region| heap.carver.remove_region(region).map(|_| region))
                .and_then(|region| heap.chunks.get_mut(region as usize)?.take())
            else {
                break;
            };
            released += chunk.len();
            heap.next_chunk = (heap.next_chunk / 2).max(CHUNK_FIRST);
            let _ = out.chunks.push(chunk);
        }
        released
    }

    /// Takes the free ranges of heap `h` idle since `since` out of its carver, and hands their
    /// resident granules to `out` to purge.
    fn purge_idle(&mut self, h: usize, since: u64, bytes: usize, out: &mut Released) -> usize {
        let mut released = 0;
        let heap = &mut self.heaps[h];
        while released < bytes && !out.purges.is_full() {
            let Some(range) = heap.carver.take_idle(since) else {
                break;
            };
            let span = heap
                .chunk_mut(range.region)
                .and_then(|chunk| chunk.plan_purge(range.addr, range.size));
            match span {
                Some(span) => {
                    released += span.len;
                    heap.purged += span.len as u64;
                    let _ = out.purges.push(Purge {
                        heap: h,
                        range,
                        span,
                    });
                }
                // Nothing resident in it: back at once.
                None => {
                    let _ = heap.carver.give_back_clean(range.handle, range.addr);
                }
            }
        }
        released
    }

    /// Gives back idle memory for a request that failed for want of `bytes`: free ranges and
    /// wholly free chunks whatever their age, then cached dedicated blocks. Returns the bytes
    /// given back (fewer when `out` filled up: call again after releasing it).
    pub(crate) fn release_for(
        &mut self,
        bytes: usize,
        want: Shortage,
        out: &mut Released,
    ) -> usize {
        self.release_idle(0, bytes, want, out)
    }

    /// Everything idle now, for `trim()`: completed pending blocks, free ranges, wholly free
    /// chunks, cached dedicated blocks. `false` when `out` filled up before the end.
    pub(crate) fn trim(&mut self, out: &mut Released) -> bool {
        self.settle_pending(0, out);
        self.release_idle(0, usize::MAX, Shortage::Memory, out);
        !out.full()
    }

    /// Bytes that giving idle memory back could free now: resident free space and cached
    /// dedicated blocks.
    pub(crate) fn releasable(&self) -> usize {
        let free: usize = self.heaps.iter().map(|h| h.carver.stats().free_bytes).sum();
        free + self.cached.bytes()
    }

    /// Takes back ranges purged outside the lock: free again, and known to be zero.
    pub(crate) fn purged(&mut self, purges: impl Iterator<Item = Purge>) {
        for purge in purges {
            if let Some(heap) = self.heaps.get_mut(purge.heap) {
                let _ = heap
                    .carver
                    .give_back_clean(purge.range.handle, purge.range.addr);
            }
        }
    }

    /// Grows or shrinks the live carved block at `addr` to `new_size` bytes (a multiple of the
    /// page size) where it lies: into the free range after it, or by freeing its tail. `Some`
    /// with the span to populate (growth into granules never resident); `None`: not carved, or
    /// no room (nothing changed).
    pub(crate) fn resize_carved(&mut self, addr: usize, new_size: usize) -> Option<Option<Span>> {
        let live = self.live.get(&addr)?;
        let (slot, old) = (live.slot?, live.block);
        let now = self.now();
        let heap = &mut self.heaps[slot.heap];
        let resized = if new_size > old.capacity {
            heap.carver.grow_in_place(slot.handle, addr, new_size)
        } else if new_size < old.capacity {
            heap.carver
                .shrink_in_place(slot.handle, addr, new_size, now)
                .unwrap_or(false)
        } else {
            true
        };
        if !resized {
            return None;
        }
        let populate = if new_size > old.capacity {
            let grown = (addr + old.capacity, new_size - old.capacity);
            heap.carver
                .used_containing(addr)
                .and_then(|range| heap.chunk_mut(range.region))
                .and_then(|chunk| {
                    let span = chunk.plan_populate(grown.0, grown.1);
                    let _ = chunk.hand_out(grown.0, grown.1);
                    span
                })
        } else {
            None
        };
        self.account(&old, false);
        let new = Block {
            capacity: new_size,
            ..old
        };
        self.account(&new, true);
        if let Some(live) = self.live.get_mut(&addr) {
            live.block = new;
        }
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes());
        Some(populate)
    }

    /// Undoes a growth in place whose populate failed: the block is `old` again, and the
    /// granules of `span` are marked not resident.
    pub(crate) fn grow_failed(&mut self, old: Block, span: Span) {
        let _ = self.resize_carved(old.addr, old.capacity);
        let slot = self.live.get(&old.addr).and_then(|live| live.slot);
        if let Some(slot) = slot {
            let heap = &mut self.heaps[slot.heap];
            if let Some(range) = heap.carver.used_containing(old.addr) {
                if let Some(chunk) = heap.chunk_mut(range.region) {
                    chunk.populate_failed(span);
                }
            }
        }
    }

    fn forget_pinned(&mut self, block: &Block) {
        if block.kind.pinned {
            self.pinned_dedicated = self.pinned_dedicated.saturating_sub(block.capacity);
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
        row.live_blocks = self.live.len();
        row.pending_bytes = self.pending.bytes();
        row.pending_blocks = self.pending.len();
        let mut heaps = HeapStats::default();
        for heap in &self.heaps {
            heaps.add(&self.heap_stats(heap));
        }
        row.cached_bytes = heaps.free_bytes + self.cached.bytes();
        row.cached_blocks = heaps.free_ranges + self.cached.len();
        row.pinned_bytes = heaps.pinned_bytes + self.pinned_dedicated;
        row.chunks = heaps.chunks;
        row.mapped_bytes = heaps.mapped_bytes;
        row.resident_bytes = heaps.resident_bytes;
        row.largest_free = heaps.largest_free;
        row.registrations = heaps.registrations;
        row.purged_bytes = heaps.purged_bytes;
    }

    /// One row per kind of chunk this arena holds.
    pub(crate) fn heap_rows(&self) -> impl Iterator<Item = HeapStats> + '_ {
        self.heaps.iter().map(|heap| self.heap_stats(heap))
    }

    fn heap_stats(&self, heap: &Heap) -> HeapStats {
        let carver = heap.carver.stats();
        let resident: usize = heap.chunks.iter().flatten().map(Chunk::resident).sum();
        HeapStats {
            node: self.node,
            policy: heap.key.kind.policy,
            pinned: heap.key.kind.pinned,
            huge_pages: heap.key.huge,
            chunks: carver.regions,
            mapped_bytes: carver.region_bytes,
            resident_bytes: resident,
            pinned_bytes: if heap.key.kind.pinned {
                carver.region_bytes
            } else {
                0
            },
            free_bytes: carver.free_bytes,
            free_ranges: carver.free_ranges,
            largest_free: carver.largest_free,
            chunks_made: heap.chunks_made,
            registrations: heap.registrations,
            purged_bytes: heap.purged,
        }
    }
}

/// What releasing the chunks of `out` did (for the caller's counters).
pub(crate) fn release_chunks(out: &mut Released, mut counted: impl FnMut(ChunkRelease)) {
    for chunk in out.chunks.drain() {
        counted(chunk.release());
    }
}

#[cfg(test)]
mod tests;
