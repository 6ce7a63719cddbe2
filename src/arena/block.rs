//! What a block is: its kind, the heap it is carved from, where its memory comes from, and the
//! records that pass one around (a dedicated block outside the live set, a request's fit in the
//! cache, a carving just handed out).

use super::carve::Handle;
use super::CLASSES_PER_DOUBLING;
use crate::chunk::{Memory, Part, Span};
use crate::cuda::RegisterFlags;
use crate::sys::MemPolicy;

/// How many times its size a cached block handed to a growing block may be ([`Fit::for_growth`]),
/// and a cached block a new block is made of
/// ([`Arena::make_room_from_cache`](super::Arena::make_room_from_cache)):
/// four covers two doublings, which a dedicated block makes in place.
pub(crate) const GROWTH_ROOM: usize = 4;

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
    pub(super) heap: usize,
    /// The carver region (chunk) it lies in: stable while the block is used.
    pub(super) region: u32,
    pub(super) handle: Handle,
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

    /// Forgets a block, leaving it mapped (and registered) rather than releasing it under the
    /// arena's lock, tracking it wrongly, or unmapping data its user holds: a block no list had
    /// room for (only after many evictions in one operation).
    pub(crate) fn leave_mapped(self) {
        std::mem::forget(self);
    }

    /// Makes its first `len` bytes read as zero (a cached block handed out for a zeroed
    /// request); with `drop_pages`, unpinned, by giving their pages back (see [`Part::clear`](crate::chunk::Part::clear)).
    pub(crate) fn zero(&mut self, len: usize, drop_pages: bool) {
        let len = len.min(self.block.capacity);
        if let Some(mut part) = self.memory.part(0, len) {
            part.clear(drop_pages);
        }
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
