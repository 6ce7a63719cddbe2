//! The per-node arena: chunks of each kind with the carver that carves blocks of any size from
//! them (`heaps.rs`, `carve/`), the dedicated blocks (too large to carve, or growing) and their
//! cache (`dedicated.rs`, `index.rs`), the live blocks and their accounting (`live.rs`), blocks
//! waiting for GPU work (`pending.rs`), and idle memory's decay (`decay.rs`, `clock.rs`). What a
//! block is lives in `block.rs`; [`Arena`] holds one of each and is their one entry point.
//!
//! There is one arena per NUMA node for the whole process (`process/nodes.rs`), shared by every
//! allocator value. An arena is only touched under its lock (`sys/lock.rs`), from inside the
//! re-entrancy guard. Slow work — mapping, populating, pinning, purging, unmapping — happens
//! outside the lock: the arena hands out what to do ([`Carving`], [`Released`]) and takes back
//! the results.
//!
//! What the free path does here allocates nothing: a carved block goes back to its carver (which
//! relinks records), a dedicated one into a cache whose room was reserved before, a block with
//! GPU work into a pending list whose room was reserved when the work was recorded, and what is
//! to be released is handed out in fixed-size arrays.

mod block;
mod carve;
mod clock;
mod decay;
mod dedicated;
mod heaps;
mod index;
mod live;
mod pending;
mod released;

use block::{Backing, GROWTH_ROOM};
pub(crate) use block::{Block, Carving, Dedicated, Fit, HeapKey, Kind, Shortage};
use clock::Clock;
use dedicated::DedicatedBlocks;
use heaps::Heaps;
use live::{Live, LiveSet};
#[cfg(test)]
pub(crate) use pending::double as pending_double;
use pending::PendingList;
pub(crate) use pending::{settle, InFlight};
pub(crate) use released::{count_release, Purge, PurgeFailures, Released};

use crate::chunk::{Chunk, Part};
use crate::stats::{GpuStats, HeapStats, NodeStats};

/// Size classes per power of two: with 8, rounding wastes at most 1/8 = 12.5% of a request.
const CLASSES_PER_DOUBLING: u32 = 8;

/// The largest chunk, and the most one registration covers.
pub(crate) const CHUNK_MAX: usize = 1 << 30;
/// A heap's first chunk; each next one doubles, up to [`CHUNK_MAX`].
pub(crate) const CHUNK_FIRST: usize = 32 << 20;
/// Chunks are whole multiples of this (a huge page), and aligned to it.
pub(crate) const CHUNK_ALIGN: usize = 2 << 20;
/// Requests of at least this size get a mapping of their own: cached whole, grown by moving its
/// pages (`mremap`) rather than by copying (a `Vec` growing to 256 MiB: 0.49× mimalloc's time,
/// where carving every size up to 512 MiB took 1.02×).
pub(crate) const DEDICATED_MIN: usize = 64 << 20;

/// The capacity given to a dedicated request of `size` bytes: `size` rounded up to one of 8
/// classes per power of two, and to whole pages.
pub(crate) fn class_size(size: usize, page_size: usize) -> Option<usize> {
    let size = size.max(1);
    let octave = usize::BITS - 1 - size.leading_zeros();
    let step_shift = octave.saturating_sub(CLASSES_PER_DOUBLING.trailing_zeros());
    let step = (1usize << step_shift).max(page_size);
    size.checked_next_multiple_of(step)
}

/// State behind one node's lock: one value per job, composed here.
pub(crate) struct Arena {
    node: usize,
    /// Arena milliseconds, and the times the arena keeps.
    clock: Clock,
    /// Every block handed out, and the node's and GPUs' live bytes.
    live: LiveSet,
    /// Each kind's chunks and the carver over them.
    heaps: Heaps,
    /// Dedicated blocks out of the live set (cached, growing), and their page-locked bytes.
    dedicated: DedicatedBlocks,
    /// Freed blocks GPU work may still use.
    pending: PendingList,
    /// Highest live plus pending bytes seen: bounds the dedicated cache (see [`Self::budget`]).
    peak_in_use: usize,
    /// In a forked child: page-locked memory is not reused (the child's copy is not registered,
    /// and a driver may keep registered ranges out of the child altogether).
    in_child: bool,
    /// Set by the fork handler; the next settling moves page-locked cached blocks out.
    pinned_cache_stale: bool,
}

impl Arena {
    /// An empty arena for blocks on `node`.
    pub(crate) fn new(node: usize) -> Self {
        Arena {
            node,
            clock: Clock::new(),
            live: LiveSet::new(node),
            heaps: Heaps::default(),
            dedicated: DedicatedBlocks::default(),
            pending: PendingList::default(),
            peak_in_use: 0,
            in_child: false,
            pinned_cache_stale: false,
        }
    }

    /// The node whose blocks this arena holds.
    pub(crate) fn node(&self) -> usize {
        self.node
    }

    /// Records that a chunk's registration failed (under `pin=on`).
    pub(crate) fn registration_failed(&mut self) {
        self.clock.registration_failed();
    }

    /// Whether a chunk's registration failed lately (see
    /// [`Clock::registration_failed_lately`]).
    pub(crate) fn registration_failed_lately(&self) -> bool {
        self.clock.registration_failed_lately()
    }

    /// Called by the fork handler in the child: page-locked memory will no longer be reused. No
    /// work is done here; the next allocation releases the cached dedicated blocks.
    pub(crate) fn enter_child(&mut self) {
        self.in_child = true;
        self.pinned_cache_stale = true;
    }

    // The live set.

    /// Records a live block; the map has room (reserved by the caller).
    fn insert_live(&mut self, block: Block, backing: Backing) {
        self.live.insert(block, backing);
        self.peak_in_use = self
            .peak_in_use
            .max(self.live.bytes() + self.pending.bytes());
    }

    /// Looks up a live block by address, and whether it is dedicated (a mapping of its own).
    pub(crate) fn live_block(&self, addr: usize) -> Option<(Block, bool)> {
        let live = self.live.get(addr)?;
        Some((live.block, matches!(live.backing, Backing::Dedicated(_))))
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
        let reserved = self.pending.reserve(self.live.with_work() + 1);
        self.live.record(start, work, reserved)
    }

    /// The start of the live block containing `addr`.
    fn live_start(&self, addr: usize) -> Option<usize> {
        if self.live.contains(addr) {
            return Some(addr);
        }
        let carved = self
            .heaps
            .used_start(addr)
            .filter(|&start| self.live.contains(start));
        carved.or_else(|| self.live.dedicated_containing(addr))
    }

    /// Removes a live block and its recorded work; `None` if the address was not handed out by
    /// this arena.
    pub(crate) fn remove_live(&mut self, addr: usize) -> Option<Live> {
        self.live.remove(addr)
    }

    // Carved blocks (`heaps.rs`).

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
            .heaps
            .index(key)
            .filter(|_| !(self.in_child && key.kind.pinned))
        else {
            return Ok(None);
        };
        if !self.live.try_reserve(1) {
            return Err(());
        }
        let carved = self.heaps.carve(heap, size, align, self.node, for_gpu)?;
        let Some((slot, carving)) = carved else {
            return Ok(None);
        };
        self.insert_live(carving.block, Backing::Carved(slot));
        Ok(Some(carving))
    }

    /// Takes back a carved block whose populate failed, unused (its granules stay marked as
    /// may-be-resident: populating may have got some of them in).
    pub(crate) fn populate_failed(&mut self, block: Block) {
        let Some(live) = self.remove_live(block.addr) else {
            return;
        };
        if let Backing::Carved(slot) = live.backing {
            let now = self.clock.now();
            self.heaps.free(slot, block.addr, now);
        }
    }

    /// How long the next chunk of `key` is for a request that needs `need` bytes of it.
    pub(crate) fn next_chunk_len(&self, key: HeapKey, need: usize) -> usize {
        self.heaps.next_chunk_len(key, need)
    }

    /// Adds a chunk made for `key` outside the lock; gives it back when the bookkeeping could not
    /// grow (the caller releases it).
    pub(crate) fn add_chunk(&mut self, key: HeapKey, chunk: Chunk) -> Result<(), Chunk> {
        let now = self.clock.now();
        self.heaps.add_chunk(key, chunk, now)
    }

    /// Grows or shrinks the live carved block at `addr` to `new_size` bytes (a multiple of the
    /// page size) where it lies: into the free range after it, or by freeing its tail. `Some`
    /// with the span to populate (growth into granules never resident); `None`: not carved, or
    /// no room (nothing changed).
    pub(crate) fn resize_carved(
        &mut self,
        addr: usize,
        new_size: usize,
    ) -> Option<Option<Part<'static>>> {
        let (old, slot) = self.live.resizable(addr, new_size)?;
        let now = self.clock.now();
        let populate = self.heaps.resize(slot, addr, old.capacity, new_size, now)?;
        self.live.resized(old, new_size);
        Some(populate)
    }

    /// Undoes a growth in place whose populate failed: the block is `old` again.
    pub(crate) fn grow_failed(&mut self, old: Block) {
        let _ = self.resize_carved(old.addr, old.capacity);
    }

    // Frees, and blocks waiting for GPU work (`pending.rs`).

    /// Takes back a freed block: pending while any of its work is not complete, else back to its
    /// carver or cached (see [`Self::cache`]). Allocates nothing.
    pub(crate) fn free(&mut self, mut live: Live, limit: usize, out: &mut Released) {
        if settle(&mut live.work) {
            let now = self.clock.now();
            self.give_back(live.block, live.backing, now, limit, out);
            self.hold_within(limit, out);
        } else {
            self.pending.push(live.block, live.backing, live.work);
            self.evict_beyond(limit, out);
        }
    }

    /// Moves pending blocks whose work has completed back (evicting beyond `limit` into `out`).
    /// Polls, never waits: O(pending).
    pub(crate) fn settle_pending(&mut self, limit: usize, out: &mut Released) {
        if self.pinned_cache_stale {
            self.pinned_cache_stale = false;
            let more = self.live.dedicated() + self.pending.len();
            self.dedicated.release_pinned(more, out);
        }
        if self.pending.len() == 0 {
            return;
        }
        let now = self.clock.now();
        let mut cursor = 0;
        while let Some((block, backing)) = self.pending.take_ready(&mut cursor) {
            self.give_back(block, backing, now, limit, out);
        }
    }

    /// A freed block without work in flight: back to its carver, or into the dedicated cache.
    fn give_back(
        &mut self,
        block: Block,
        backing: Backing,
        now: u64,
        limit: usize,
        out: &mut Released,
    ) {
        match backing {
            Backing::Carved(slot) => self.heaps.give_back(slot, block.addr, now),
            Backing::Dedicated(memory) => self.cache(Dedicated { block, memory }, limit, out),
        }
    }

    /// Whether a pending block would have served this request (a miss deferred by GPU work).
    pub(crate) fn pending_fits(&self, fit: Fit) -> bool {
        self.pending.holds_fit(fit)
    }

    // Dedicated blocks (`dedicated.rs`).

    /// Takes a cached dedicated block that fits (see
    /// [`CacheIndex::take`](index::CacheIndex::take)).
    pub(crate) fn take_cached(&mut self, fit: Fit) -> Option<Dedicated> {
        self.dedicated.cached.take(fit)
    }

    /// Whether a cached dedicated block would serve this request.
    pub(crate) fn holds_fit(&self, fit: Fit) -> bool {
        self.dedicated.cached.holds(fit)
    }

    /// Takes the live dedicated block at `addr` out of the live set when it may grow by moving
    /// its pages (`mremap`) into a block of `kind` of `capacity` bytes: made with that kind, not
    /// page-locked (a registration is tied to the address), no GPU work recorded against it, and
    /// smaller (a block shrunk in place keeps its capacity: it may already be as large). Out of
    /// the live set before its pages move: once they have, another thread may map a new block
    /// at this address and record it live.
    pub(crate) fn take_growable(
        &mut self,
        addr: usize,
        kind: Kind,
        capacity: usize,
    ) -> Option<Dedicated> {
        let live = self.live.get(addr)?;
        let growable = matches!(&live.backing, Backing::Dedicated(m) if m.movable())
            && live.block.kind == kind
            && !kind.pinned
            && live.work.is_empty()
            && live.block.capacity < capacity;
        // Room for it to come back, grown or not, kept by every insert until then.
        if !growable || !self.reserve_dedicated(self.dedicated.moving + 1) {
            return None;
        }
        let live = self.remove_live(addr)?;
        self.dedicated.moving += 1;
        match live.backing {
            Backing::Dedicated(memory) => Some(Dedicated {
                block: live.block,
                memory,
            }),
            Backing::Carved(_) => None,
        }
    }

    /// Records live again, as the user's, a block [`Self::take_growable`] took out: grown (a new
    /// address) or not. The room it needs was kept since, so this allocates nothing.
    pub(crate) fn return_grown(
        &mut self,
        dedicated: Dedicated,
        limit: usize,
        out: &mut Released,
    ) -> Result<Block, Dedicated> {
        self.dedicated.moving = self.dedicated.moving.saturating_sub(1);
        self.insert_created(dedicated, limit, out)
    }

    /// Room in the live set for `more` blocks, and in the cache for every dedicated block out
    /// (live, pending, growing) and `more`: a free must not allocate, nor a grown block's
    /// return. False when it could not be had.
    fn reserve_dedicated(&mut self, more: usize) -> bool {
        let moving = self.dedicated.moving;
        let out = self.live.dedicated() + self.pending.len() + moving + more;
        self.live.try_reserve(moving + more) && self.dedicated.cached.reserve(out)
    }

    /// Records a dedicated block handed out to the user, and returns what it is (room reserved
    /// first: when none could be had it is given back, not recorded).
    pub(crate) fn insert_dedicated(&mut self, dedicated: Dedicated) -> Result<Block, Dedicated> {
        if !self.reserve_dedicated(1) {
            return Err(dedicated);
        }
        let Dedicated { block, memory } = dedicated;
        self.insert_live(block, Backing::Dedicated(memory));
        Ok(block)
    }

    /// Records a dedicated block just created for a request, then evicts what the cache may no
    /// longer hold now that live bytes grew (see [`Self::budget`]). Given back when it could not
    /// be recorded (the caller releases it).
    pub(crate) fn insert_created(
        &mut self,
        dedicated: Dedicated,
        limit: usize,
        out: &mut Released,
    ) -> Result<Block, Dedicated> {
        let block = self.insert_dedicated(dedicated)?;
        self.dedicated.note_created(&block);
        self.evict_beyond(limit, out);
        Ok(block)
    }

    /// Caches a dedicated block made ahead of the requests that will want it (`reserve`). A
    /// reservation says how much will be in use at once, so it raises the high-water mark the
    /// budget follows (see [`Self::budget`]) to everything held now plus the block; only `limit`
    /// can evict it.
    pub(crate) fn insert_reserved(
        &mut self,
        dedicated: Dedicated,
        limit: usize,
        out: &mut Released,
    ) {
        // No room to be had: `cache` hands it out for release instead.
        let _ = self.dedicated.cached.reserve(1);
        let block = dedicated.block;
        self.dedicated.note_created(&block);
        let held = self.live.bytes()
            + self.pending.bytes()
            + self.dedicated.cached.bytes()
            + block.capacity;
        self.peak_in_use = self.peak_in_use.max(held);
        self.cache(dedicated, limit, out);
    }

    // Stats.

    /// Starts the peak over from the bytes live now (`reset_peaks()`). The cache budget keeps its
    /// own high-water mark: a statistics call does not release cached blocks.
    pub(crate) fn reset_peak(&mut self) {
        self.live.reset_peak();
    }

    /// The rows of the GPUs this node's arena has served.
    pub(crate) fn gpus(&self) -> &[GpuStats] {
        self.live.gpus()
    }

    /// Fills in this node's row.
    pub(crate) fn fill(&self, row: &mut NodeStats) {
        self.live.fill(row);
        row.pending_bytes = self.pending.bytes();
        row.pending_blocks = self.pending.len();
        let mut heaps = HeapStats::default();
        for heap in self.heap_rows() {
            heaps.add(&heap);
        }
        row.cached_bytes = heaps.free_bytes + self.dedicated.cached.bytes();
        row.cached_blocks = heaps.free_ranges + self.dedicated.cached.len();
        row.pinned_bytes = heaps.pinned_bytes + self.dedicated.pinned;
        row.chunks = heaps.chunks;
        row.mapped_bytes = heaps.mapped_bytes;
        row.resident_bytes = heaps.resident_bytes;
        row.free_bytes = heaps.free_bytes;
        row.free_ranges = heaps.free_ranges;
        row.largest_free = heaps.largest_free;
        row.registrations = heaps.registrations;
        row.purged_bytes = heaps.purged_bytes;
        row.decay_released = self.dedicated.decay_released;
    }

    /// One row per kind of chunk this arena holds.
    pub(crate) fn heap_rows(&self) -> impl Iterator<Item = HeapStats> + '_ {
        self.heaps.rows(self.node)
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests;
