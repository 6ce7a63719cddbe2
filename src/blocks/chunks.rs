//! The carved path: a request below [`DEDICATED_MIN`](crate::arena::DEDICATED_MIN) (not a
//! growing one) gets a block carved from a chunk of its kind in its node's arena; a chunk is made
//! when none has room.
//!
//! 1. Under the arena lock: settle pending blocks, look at idle memory (decay), carve.
//! 2. Outside it: populate the granules of the block never populated (and check their pages
//!    under `policy=bind` or `verify=on`), zero what may hold old data when zeroed memory was
//!    asked for; release and purge what the arena handed out.
//! 3. When no chunk has room: make one (map, advise, bind; pinned: populate whole, check,
//!    register), add it, carve again. A shortage gives idle memory of the node back and
//!    retries, unless what could be given back is too little to help.
//!
use std::time::Instant;

use super::{reserved_key, shortage, shortage_kind, Blocks, Resolved, HUGE_PAGE};
use crate::arena::{
    count_release, Arena, Block, Carving, Fit, HeapKey, Kind, PurgeFailures, Released, Shortage,
    CHUNK_ALIGN, CHUNK_MAX,
};
use crate::chunk::{Chunk, Mapping, Part, Span};
use crate::config::PinMode;
use crate::process::NODES;
use crate::sys::lock::Guard;
use crate::sys::NodeMask;
use crate::topology::sysfs;
use crate::Error;

impl Blocks {
    /// A block of `size` bytes (a multiple of the page size) at a multiple of `align`, carved for
    /// `target` from chunks of `kind`; zeroed when asked. `None` when it cannot be had.
    pub(crate) fn carve(
        &self,
        size: usize,
        align: usize,
        zeroed: bool,
        target: &Resolved,
        kind: Kind,
    ) -> Option<Block> {
        if let Some(block) = self.carve_reserved(size, align, zeroed, target, kind) {
            return Some(block);
        }
        let key = HeapKey {
            kind,
            huge: self.settings.huge_pages && size >= HUGE_PAGE,
            reserved: false,
        };
        self.carve_from(key, size, align, zeroed, target, true)
    }

    /// A block carved from the room a reservation of bytes made for `kind` (served before any
    /// other, whatever the size, up to a chunk's: those chunks are populated whole, so a small
    /// block sharing a huge page makes nothing more resident), when there is such room; `None`
    /// (nothing counted) otherwise.
    pub(crate) fn carve_reserved(
        &self,
        size: usize,
        align: usize,
        zeroed: bool,
        target: &Resolved,
        kind: Kind,
    ) -> Option<Block> {
        let key = reserved_key(kind, self.settings.huge_pages);
        // A heap without room (or none at all) carves nothing: `carve_from` then returns `None`.
        if !super::reserve::bytes_reserved() || size.saturating_add(align) > CHUNK_MAX {
            return None;
        }
        self.carve_from(key, size, align, zeroed, target, false)
    }

    /// [`Self::carve`] from `key`'s heap; `make`: whether a chunk is made when none has room.
    fn carve_from(
        &self,
        mut key: HeapKey,
        size: usize,
        align: usize,
        zeroed: bool,
        target: &Resolved,
        make: bool,
    ) -> Option<Block> {
        let kind = key.kind;
        let mut made = false;
        let block = (|| {
            // Another thread may carve the new chunk first: then make another, twice at most.
            for _ in 0..3 {
                let mut out = Released::default();
                let carving = {
                    let mut arena = self.arena(target.host_node)?;
                    if key.kind.pinned && arena.registration_failed_lately() {
                        // `pin=on` after a failed registration: unpinned chunks for a while,
                        // rather than mapping and populating one to try again at each request.
                        key.kind = key.kind.without_pinning();
                    }
                    arena.settle_pending(self.settings.cache_limit, &mut out);
                    let carving = arena.carve(key, size, align, target.ordinal);
                    // After carving: idle ranges taken out to purge must not be the room needed.
                    arena.decay(self.settings.decay_ms, &mut out);
                    if make && matches!(carving, Ok(None)) {
                        let fit = Fit::new(size, size, align, kind);
                        if arena.pending_fits(fit) {
                            self.counters.reuse_deferred.incr();
                        }
                    }
                    carving
                };
                self.finish(target.host_node, &mut out);
                match carving {
                    Ok(Some(carving)) => return self.prepare(carving, zeroed, target),
                    Err(()) => return None,
                    Ok(None) if !make => return None,
                    Ok(None) => {
                        let need = size + align.saturating_sub(self.page_size);
                        let chunk = self.new_chunk(key, need, target).ok()?;
                        made = true;
                        if key.kind.pinned && !chunk.pinned() {
                            // Registration failed under `pin=on`: served unpinned (the next
                            // round carves from the unpinned chunks).
                            key.kind = key.kind.without_pinning();
                            if let Some(mut arena) = self.arena(target.host_node) {
                                arena.registration_failed();
                            }
                        }
                        self.add_chunk(target.host_node, key, chunk)?;
                    }
                }
            }
            None
        })();
        // A hit: carved from chunks there were; anything else (a new chunk, a failure) a miss,
        // except reserved room not found (the dedicated path counts that request).
        match (block.is_some() && !made, make) {
            (true, _) => self.counters.cache_hits.incr(),
            (false, true) => self.counters.cache_misses.incr(),
            (false, false) => {}
        }
        block
    }

    /// Adds a chunk made for `key` to `node`'s arena (releasing it when that fails).
    pub(crate) fn add_chunk(&self, node: usize, key: HeapKey, chunk: Chunk) -> Option<()> {
        let added = self
            .arena(node)
            .map(|mut arena| arena.add_chunk(key, chunk));
        match added {
            Some(Ok(())) => {
                if self.settings.decay_thread {
                    crate::process::decay::ensure_running(
                        self.settings.decay_ms,
                        self.settings.sysfs_root,
                    );
                }
                Some(())
            }
            Some(Err(chunk)) => {
                count_release(&self.counters, chunk.release());
                None
            }
            None => None,
        }
    }

    /// Populates, checks and zeroes a carved block outside the lock; gives it back on failure.
    fn prepare(&self, carving: Carving, zeroed: bool, target: &Resolved) -> Option<Block> {
        let Carving {
            block,
            mut part,
            populate,
            dirty,
        } = carving;
        if let Some(mut unpopulated) = populate.and_then(|span| part.sub(span)) {
            let len = unpopulated.len();
            // A node running low (a cpuset confined to it, say) gets its idle memory back first,
            // before the block's pages are populated or touched: the kernel cannot reclaim it,
            // and the OOM killer would come before a failure.
            let root = std::path::Path::new(self.settings.sysfs_root);
            if len >= HUGE_PAGE && sysfs::node_memory_low(root, block.node) {
                self.give_back_for(block.node, len, Shortage::Memory);
            }
            let populate = self.populates_request(block.kind, zeroed);
            let mut populated = self.populate_part(&mut unpopulated, &target.nodes, populate);
            if let Err(e) = &populated {
                // Idle memory of the node may make room (the block itself is live: it stays).
                if shortage(e) && self.give_back_for(block.node, len, shortage_kind(e)) {
                    self.counters.pressure_retries.incr();
                    populated = self.populate_part(&mut unpopulated, &target.nodes, populate);
                }
            }
            if let Err(e) = populated {
                self.counters.record_block_failure(&e);
                if let Some(mut arena) = self.arena(block.node) {
                    arena.populate_failed(block);
                }
                return None;
            }
        }
        Some(self.cleared(block, part, dirty, zeroed))
    }

    /// `block`, its `dirty` part cleared when `zeroed` (pages given back rather than written
    /// when its last user barely touched them: [`Blocks::clears_by_dropping`]).
    fn cleared(
        &self,
        block: Block,
        mut part: Part<'static>,
        dirty: Option<Span>,
        zeroed: bool,
    ) -> Block {
        if let (true, Some(mut dirty)) = (zeroed, dirty.and_then(|span| part.sub(span))) {
            let drop = Blocks::clears_by_dropping(block.kind, dirty.ptr(), dirty.len());
            dirty.clear(drop);
        }
        block
    }

    /// Populates what a carved block grown in place from `old` took of granules never
    /// populated (a block grown by `realloc` is written whole: see
    /// [`Blocks::populates_request`]); on failure shrinks it back to `old` and says so.
    pub(crate) fn populate_grown(
        &self,
        node: usize,
        old: Block,
        populate: Option<Part<'static>>,
    ) -> bool {
        let Some(mut part) = populate else {
            return true;
        };
        let nodes = self.policy_nodes_of(node);
        if self
            .populate_part(&mut part, &nodes, self.populates_request(old.kind, false))
            .is_ok()
        {
            return true;
        }
        // Not a failed request: the caller moves the block instead.
        if let Some(mut arena) = self.arena(node) {
            arena.grow_failed(old);
        }
        false
    }

    /// Populates a part of a chunk never populated (several threads for big parts) and checks
    /// its pages where the settings ask for it; without `populate` (a lazy kind) only checks
    /// that the cgroup's limit leaves room for it, as its pages are faulted in where touched.
    fn populate_part(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
        populate: bool,
    ) -> Result<(), Error> {
        self.memory_limits.check(part.len())?;
        if !populate {
            return Ok(());
        }
        let start = Instant::now();
        let populated = self.populate(part, nodes);
        self.counters.populate.record(start.elapsed());
        populated?;
        if self.numa_placement() {
            self.check_placement(part, nodes)?;
        }
        Ok(())
    }

    /// A new chunk for `key` with room for `need` bytes, placed for `target`; pinned when the kind
    /// is and the registration works (else, under `pin=on`, an unpinned chunk, counted; `pin=on`
    /// without a GPU for the target counts its unpinned chunks too). A chunk
    /// that fails for want of memory is tried again smaller (only as large as `need`), then
    /// after giving idle memory of the node back — unless there is too little to give back.
    fn new_chunk(&self, key: HeapKey, need: usize, target: &Resolved) -> Result<Chunk, Error> {
        let node = target.host_node;
        let planned = self
            .arena(node)
            .map_or(need, |arena| arena.next_chunk_len(key, need))
            .min(
                self.chunk_max(key.kind.pinned)
                    .max(need.next_multiple_of(CHUNK_ALIGN)),
            );
        let least = need.next_multiple_of(CHUNK_ALIGN);
        let mut made = self.make_chunk(key, planned, target);
        if made.as_ref().is_err_and(shortage) && planned > least {
            made = self.make_chunk(key, least, target);
        }
        if let Err(e) = &made {
            if shortage(e) && self.give_back_for(node, shortage_bytes(e, need), shortage_kind(e)) {
                self.counters.pressure_retries.incr();
                made = self.make_chunk(key, least, target);
            }
        }
        made.inspect_err(|e| self.counters.record_block_failure(e))
    }

    /// Gives idle memory of `node` back for a request short of `bytes`; `false` (nothing given
    /// back) when all there is to give back could not cover it. Purges that failed (locked
    /// memory) gave nothing back, and are not tried again.
    pub(crate) fn give_back_for(&self, node: usize, bytes: usize, want: Shortage) -> bool {
        let Some(mut arena) = self.arena(node) else {
            return false;
        };
        if arena.releasable(want) < bytes {
            return false;
        }
        let mut given = 0;
        loop {
            let mut out = Released::default();
            let released = arena.release_for(bytes - given, want, &mut out);
            drop(arena);
            let count = out.blocks.iter().count() + out.chunks.iter().count();
            self.counters.pressure_released_blocks.add(count as u64);
            let failed = self.finish(node, &mut out);
            given += released.saturating_sub(failed.bytes);
            if released == 0 || given >= bytes {
                return given > 0;
            }
            arena = match self.arena(node) {
                Some(arena) => arena,
                None => return given > 0,
            };
        }
    }

    /// Maps, advises, places and (for a pinned kind) populates, checks and registers a chunk of
    /// `len` bytes.
    pub(crate) fn make_chunk(
        &self,
        key: HeapKey,
        len: usize,
        target: &Resolved,
    ) -> Result<Chunk, Error> {
        if key.kind.pinned {
            // A pinned chunk is populated whole.
            self.memory_limits.check(len)?;
        }
        let mapping = Mapping::new(self.source, len, CHUNK_ALIGN)?;
        self.place_chunk(key, mapping, target).inspect_err(|_| {
            // The mapping went with the error (its guard unmapped it).
            self.counters.released_blocks.incr();
        })
    }

    /// Steps 2-4 of a chunk (see [`Self::make_chunk`]).
    fn place_chunk(
        &self,
        key: HeapKey,
        mapping: Mapping,
        target: &Resolved,
    ) -> Result<Chunk, Error> {
        let mut chunk = self.placed_chunk(key, mapping, target)?;
        if key.kind.pinned {
            self.populate_chunk(&mut chunk, target)?;
            if let Err(e) = self.register_chunk(&mut chunk, target) {
                if self.settings.pin == PinMode::Strict {
                    return Err(e);
                }
            }
        }
        if !chunk.pinned() && self.settings.pin != PinMode::Off {
            // Pinning was asked for and this chunk has none: a fallback (`pin=off` has none).
            self.counters.unpinned_blocks.incr();
        }
        Ok(chunk)
    }

    /// Steps 2 and 3 of a chunk: advised and placed, nothing populated.
    pub(crate) fn placed_chunk(
        &self,
        key: HeapKey,
        mut mapping: Mapping,
        target: &Resolved,
    ) -> Result<Chunk, Error> {
        let mut whole = mapping.whole();
        whole.advise_huge(key.huge);
        self.place(&mut whole, &target.nodes)?;
        let granule = if key.huge { HUGE_PAGE } else { self.page_size };
        Chunk::new(mapping, granule)
    }

    /// Populates and checks a whole chunk (before it is registered, or for a reservation).
    pub(crate) fn populate_chunk(&self, chunk: &mut Chunk, target: &Resolved) -> Result<(), Error> {
        if let Some(mut part) = chunk.plan_populate_whole() {
            self.populate_part(&mut part, &target.nodes, true)?;
        }
        Ok(())
    }

    /// Registers a populated chunk through the target's GPU, counted.
    pub(crate) fn register_chunk(&self, chunk: &mut Chunk, target: &Resolved) -> Result<(), Error> {
        chunk.register(|memory| self.register(target.gpu, memory))
    }

    /// Does what an arena operation on `node` left to do outside its lock (see
    /// [`Released::finish`]), counted in this value's counters. Returns the purges that failed.
    pub(crate) fn finish(&self, node: usize, out: &mut Released) -> PurgeFailures {
        out.finish(NODES.existing(node), &self.counters)
    }

    /// Runs `f` on `node`'s arena, then does what it left to do.
    pub(crate) fn with_arena<T>(
        &self,
        node: usize,
        f: impl FnOnce(&mut Guard<'_, Arena>, &mut Released) -> T,
    ) -> Option<T> {
        let mut out = Released::default();
        let result = {
            let mut arena = self.arena(node)?;
            f(&mut arena, &mut out)
        };
        self.finish(node, &mut out);
        Some(result)
    }
}

/// How many bytes a request short of memory by `error` needs given back.
fn shortage_bytes(error: &Error, need: usize) -> usize {
    match error {
        Error::MemoryLimit {
            available,
            requested,
            ..
        } => requested.saturating_sub(*available),
        _ => need,
    }
}
