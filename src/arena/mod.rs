//! The per-node arena: chunks of each kind with the carver that carves blocks of any size from
//! them (`carve/`), the dedicated blocks (too large to carve, or growing) and their cache
//! (`index.rs`), blocks waiting for GPU work (`pending.rs`), idle memory's decay, and per-node
//! accounting.
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

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Instant;

mod carve;
mod decay;
mod dedicated;
mod heaps;
mod index;
mod pending;
mod released;
mod report;

use carve::{Carver, Handle};
use index::CacheIndex;
#[cfg(test)]
pub(crate) use pending::double as pending_double;
use pending::PendingList;
pub(crate) use pending::{settle, InFlight, Work};
pub(crate) use released::{count_release, Purge, PurgeFailures, Released};

use crate::chunk::{Chunk, Memory, Part, Span};
use crate::cuda::RegisterFlags;
use crate::stats::GpuStats;
use crate::sys::MemPolicy;

/// Size classes per power of two: with 8, rounding wastes at most 1/8 = 12.5% of a request.
const CLASSES_PER_DOUBLING: u32 = 8;
/// How many times its size a cached block handed to a growing block may be ([`Fit::for_growth`]):
/// four covers two doublings, which a dedicated block makes in place.
const GROWTH_ROOM: usize = 4;

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
/// After a chunk's registration failed under `pin=on`, requests for page-locked blocks are served
/// unpinned for this long (milliseconds) before registering is tried again.
const REGISTRATION_RETRY_MS: u64 = 1000;
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
    /// Registered with CUDA, with these flags (default when not pinned).
    pub(crate) pinned: bool,
    pub(crate) flags: RegisterFlags,
    /// Pages faulted in where touched, not populated when handed out (unpinned only): such
    /// blocks and chunks never serve a value that populates, nor the other way round, so that
    /// a granule marked populated is resident for every value carving it.
    pub(crate) lazy: bool,
    /// Pages checked to be on the policy's nodes when populated (`verify=on`): a value that
    /// checks takes no granule another value populated unchecked.
    pub(crate) verified: bool,
}

impl Kind {
    /// An unpinned block under `policy`, populated when handed out.
    pub(crate) const fn unpinned(policy: MemPolicy) -> Kind {
        Kind {
            policy,
            pinned: false,
            flags: RegisterFlags {
                devicemap: false,
                read_only: false,
            },
            lazy: false,
            verified: false,
        }
    }
}

impl Kind {
    /// The same kind unpinned (a registration that failed under `pin=on`).
    pub(crate) fn without_pinning(self) -> Kind {
        Kind {
            pinned: false,
            flags: RegisterFlags::default(),
            ..self
        }
    }
}

impl Default for Kind {
    /// An unpinned block under the default policy.
    fn default() -> Self {
        Kind::unpinned(MemPolicy::Preferred)
    }
}

/// The chunks one request may be carved from: its kind, whether they are huge-page chunks (for
/// blocks of 2 MiB and more) or small-page ones, and whether a reservation of bytes made them
/// (a heap of its own, populated whole, that serves requests of every size first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HeapKey {
    pub(crate) kind: Kind,
    pub(crate) huge: bool,
    pub(crate) reserved: bool,
}

/// What a request that failed for want of memory needs given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shortage {
    /// Memory (a failed populate, a cgroup limit): purging resident free space helps.
    Memory,
    /// Address space (a failed `mmap`): only unmapping helps.
    AddressSpace,
    /// Page-locked bytes (the pinned limit): only unregistering helps, and reserved chunks stay.
    PageLocked,
}

/// What one block handed out is: where, how large, on which node, made how. It owns nothing:
/// its memory is its chunk's ([`Backing::Carved`]) or its own ([`Backing::Dedicated`]), held by
/// the arena's record of it.
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
    /// CUDA ordinal of the GPU the request it is live for was routed to (per-GPU stats).
    pub(crate) routed_for: Option<u32>,
}

/// Where a carved block came from: its heap and its carver record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    heap: usize,
    /// The carver region (chunk) it lies in: stable while the block is used.
    region: u32,
    handle: Handle,
}

/// Who holds a block's memory: its chunk (the block is a carver record), or the block itself
/// (a dedicated mapping, and its registration when pinned).
#[derive(Debug)]
pub(crate) enum Backing {
    Carved(Slot),
    Dedicated(Memory),
}

/// A dedicated block outside the live set (cached, made, handed out for release): what it is,
/// and the memory it owns. Released by its memory, once: moving it is the only way to pass it
/// on.
#[derive(Debug)]
pub(crate) struct Dedicated {
    pub(crate) block: Block,
    pub(crate) memory: Memory,
}

impl Dedicated {
    /// A dedicated block over `memory` (its whole mapping).
    pub(crate) fn new(memory: Memory, node: usize, kind: Kind, routed_for: Option<u32>) -> Self {
        let block = Block {
            addr: memory.base(),
            capacity: memory.len(),
            node,
            kind,
            routed_for,
        };
        Dedicated { block, memory }
    }
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

    /// The same request for the new place of a block that `realloc` grows: a cached block up to
    /// [`GROWTH_ROOM`] times the request's class serves it too. The block then grows in place
    /// (a dedicated block keeps any size from half its capacity up), so a doubling `Vec` spends
    /// two more doublings in memory already resident instead of mapping and populating fresh
    /// pages each time while the larger block it used last time idles in the cache or is
    /// evicted to make room for them.
    pub(crate) fn for_growth(self) -> Fit {
        Fit {
            most: self.most.max(self.least.saturating_mul(GROWTH_ROOM)),
            ..self
        }
    }

    /// Whether `block` may serve the request.
    pub(crate) fn admits(&self, block: &Block) -> bool {
        (self.least..=self.most).contains(&block.capacity)
            && block.addr.is_multiple_of(self.align)
            && block.kind == self.kind
    }
}

/// A block handed out, who holds its memory, and the GPU work recorded against it.
pub(crate) struct Live {
    pub(crate) block: Block,
    backing: Backing,
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
    /// The block's bytes, the caller's alone until it hands the block to its user (or back).
    pub(crate) part: Part<'static>,
    /// Granules never populated yet (unpinned chunks only).
    pub(crate) populate: Option<Span>,
    /// The span that may hold old data: a zeroed request clears it.
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
    /// count as the block's) that giving back could free: free ranges whose purge failed count
    /// only when their chunk is wholly free (released, not purged).
    fn idle_resident(&self) -> usize {
        let resident: usize = self.chunks.iter().flatten().map(Chunk::resident).sum();
        resident.saturating_sub(self.carver.used_bytes() + self.carver.unpurgeable_bytes())
    }

    /// Bytes of the chunks that are wholly free.
    fn wholly_free_bytes(&self) -> usize {
        self.wholly_free_where(|_| true)
    }

    /// Bytes of the chunks that are wholly free and not reserved.
    fn wholly_free_unreserved_bytes(&self) -> usize {
        self.wholly_free_where(|chunk| !chunk.is_some_and(Chunk::reserved))
    }

    fn wholly_free_where(&self, wanted: impl Fn(Option<&Chunk>) -> bool) -> usize {
        let carver = &self.carver;
        carver
            .regions()
            .filter(|&(region, _, _)| carver.wholly_free(region).is_some())
            .filter(|&(region, _, _)| {
                wanted(self.chunks.get(region as usize).and_then(Option::as_ref))
            })
            .map(|(_, _, len)| len)
            .sum()
    }

    fn chunk_mut(&mut self, region: u32) -> Option<&mut Chunk> {
        self.chunks.get_mut(region as usize)?.as_mut()
    }
}

/// State behind one node's lock.
pub(crate) struct Arena {
    node: usize,
    /// The arena's clock starts here (milliseconds for the carvers' idle stamps).
    epoch: Instant,
    /// Every live block, by address.
    live: HashMap<usize, Live, BuildHasherDefault<AddrHasher>>,
    /// Live blocks with GPU work recorded: the pending list keeps room for each.
    live_with_work: usize,
    /// Live dedicated blocks: the dedicated cache keeps room for each.
    live_dedicated: usize,
    /// Dedicated blocks out of the live set while they grow ([`Self::take_growable`]): every
    /// insert keeps room in the live set and the cache for them to come back.
    moving: usize,
    heaps: Vec<Heap>,
    cached: CacheIndex,
    pending: PendingList,
    /// Page-locked dedicated blocks' bytes (live, pending and cached).
    pinned_dedicated: usize,
    peak_live_bytes: usize,
    /// Highest live plus pending bytes seen: bounds the dedicated cache (see [`Self::budget`]).
    peak_in_use: usize,
    /// Bytes of the live blocks.
    live_bytes: usize,
    /// Live blocks per GPU they were handed out for, in ordinal order.
    gpus: Vec<GpuStats>,
    /// In a forked child: page-locked memory is not reused (the child's copy is not registered,
    /// and a driver may keep registered ranges out of the child altogether).
    in_child: bool,
    /// Set by the fork handler; the next settling moves page-locked cached blocks out.
    pinned_cache_stale: bool,
    /// When idle memory is looked at next (arena milliseconds).
    next_decay: u64,
    /// When a chunk's registration last failed (arena milliseconds).
    registration_failed_at: Option<u64>,
    /// Cached dedicated blocks the decay thread released.
    decay_released: u64,
}

impl Arena {
    /// An empty arena for blocks on `node`.
    pub(crate) fn new(node: usize) -> Self {
        Arena {
            node,
            epoch: Instant::now(),
            live: HashMap::default(),
            live_with_work: 0,
            live_dedicated: 0,
            moving: 0,
            heaps: Vec::new(),
            cached: CacheIndex::default(),
            pending: PendingList::default(),
            pinned_dedicated: 0,
            peak_live_bytes: 0,
            peak_in_use: 0,
            live_bytes: 0,
            gpus: Vec::new(),
            in_child: false,
            pinned_cache_stale: false,
            next_decay: 0,
            registration_failed_at: None,
            decay_released: 0,
        }
    }

    /// The node whose blocks this arena holds.
    pub(crate) fn node(&self) -> usize {
        self.node
    }

    /// Records that a chunk's registration failed (under `pin=on`).
    pub(crate) fn registration_failed(&mut self) {
        self.registration_failed_at = Some(self.now());
    }

    /// Whether a chunk's registration failed within the last [`REGISTRATION_RETRY_MS`].
    pub(crate) fn registration_failed_lately(&self) -> bool {
        self.registration_failed_at
            .is_some_and(|at| self.now().saturating_sub(at) < REGISTRATION_RETRY_MS)
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

    /// Records a live block; the map has room (reserved by the caller).
    fn insert_live(&mut self, block: Block, backing: Backing) {
        self.account(&block, true);
        self.live_dedicated += usize::from(matches!(backing, Backing::Dedicated(_)));
        let work = Work::new();
        let live = Live {
            block,
            backing,
            work,
        };
        self.live.insert(block.addr, live);
        let live = self.live_bytes();
        self.peak_live_bytes = self.peak_live_bytes.max(live);
        self.peak_in_use = self.peak_in_use.max(live + self.pending.bytes());
    }

    /// Adds (or removes) a live block's bytes to the node's and its GPU's rows. Saturating: a free
    /// path must not panic, even on accounting that drifted.
    fn account(&mut self, block: &Block, live: bool) {
        self.live_bytes = if live {
            self.live_bytes.saturating_add(block.capacity)
        } else {
            self.live_bytes.saturating_sub(block.capacity)
        };
        // A free finds the row its allocation made (it adds none: the free path allocates nothing).
        let row = if live {
            self.gpu_row(block.routed_for)
        } else {
            let ordinal = block.routed_for;
            self.gpus
                .iter_mut()
                .find(|row| Some(row.ordinal) == ordinal)
        };
        if let Some(row) = row {
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

    /// Looks up a live block by address, and whether it is dedicated (a mapping of its own).
    pub(crate) fn live_block(&self, addr: usize) -> Option<(Block, bool)> {
        let live = self.live.get(&addr)?;
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
                    matches!(l.backing, Backing::Dedicated(_))
                        && (l.block.addr..l.block.addr + l.block.capacity).contains(&addr)
                })
                .map(|l| l.block.addr)
        })
    }

    /// Removes a live block and its recorded work; `None` if the address was not handed out by
    /// this arena.
    pub(crate) fn remove_live(&mut self, addr: usize) -> Option<Live> {
        let live = self.live.remove(&addr)?;
        self.live_dedicated = self
            .live_dedicated
            .saturating_sub(usize::from(matches!(live.backing, Backing::Dedicated(_))));
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

    /// Starts the peak over from the bytes live now (`reset_peaks()`). The cache budget keeps its
    /// own high-water mark: a statistics call does not release cached blocks.
    pub(crate) fn reset_peak(&mut self) {
        self.peak_live_bytes = self.live_bytes();
        for row in &mut self.gpus {
            row.peak_live_bytes = row.live_bytes;
        }
    }

    fn live_bytes(&self) -> usize {
        self.live_bytes
    }

    /// The rows of the GPUs this node's arena has served.
    pub(crate) fn gpus(&self) -> &[GpuStats] {
        &self.gpus
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests;
