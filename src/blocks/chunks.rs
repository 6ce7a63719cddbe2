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

use super::pressure::{shortage, shortage_bytes, Pressure};
use super::{reserved_key, Blocks, Resolved, HUGE_PAGE};
use crate::arena::{
    Block, Carving, Fit, HeapKey, Kind, Released, Shortage, CHUNK_ALIGN, CHUNK_MAX,
};
use crate::chunk::{Chunk, Part, PinPolicy, Span};
use crate::topology::live;
use crate::Error;

/// The carving side of a value's large path.
pub(crate) struct CarvedPath<'a> {
    pub(super) blocks: &'a Blocks,
}

impl CarvedPath<'_> {
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
        // A block that may be barely touched takes small pages, so that each touch makes a page
        // resident, not 2 MiB (a dedicated one follows the fault-cost rule: `process/faults.rs`).
        let huge = self.blocks.settings.huge_pages
            && size >= HUGE_PAGE
            && !self.blocks.suspects_barely_touched(kind, zeroed, size);
        let key = HeapKey {
            kind,
            huge,
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
        let key = reserved_key(kind, self.blocks.settings.huge_pages);
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
        let strict = PinPolicy::of(self.blocks.settings.pin).strict();
        let mut made = false;
        let block = (|| {
            // Another thread may carve the new chunk first: then make another, twice at most.
            for _ in 0..3 {
                let mut out = Released::default();
                let carving = {
                    let mut arena = self.blocks.arena(target.host_node)?;
                    if key.kind.pinned && !strict && arena.registration_failed_lately() {
                        // `pin=on` after a failed registration: unpinned chunks for a while,
                        // rather than mapping and populating one to try again at each request.
                        // The arenas are the process's: another value's failure must not
                        // hand a `pin=strict` value unpinned memory.
                        key.kind = key.kind.without_pinning();
                    }
                    arena.settle_pending(self.blocks.settings.cache_limit, &mut out);
                    let carving = arena.carve(key, size, align, target.ordinal);
                    // After carving: idle ranges taken out to purge must not be the room needed.
                    arena.decay(self.blocks.settings.decay_ms, &mut out);
                    if make && matches!(carving, Ok(None)) {
                        let fit = Fit::new(size, size, align, kind);
                        if arena.pending_fits(fit) {
                            self.blocks.counters.reuse_deferred.incr();
                        }
                    }
                    carving
                };
                self.blocks.finish(target.host_node, &mut out);
                match carving {
                    Ok(Some(carving)) => return self.prepare(carving, zeroed, target),
                    Err(()) => return None,
                    Ok(None) if !make => return None,
                    Ok(None) => {
                        let need = size + align.saturating_sub(self.blocks.page_size());
                        let chunk = self.new_chunk(key, need, target).ok()?;
                        made = true;
                        if key.kind.pinned && !chunk.pinned() {
                            // Registration failed under `pin=on`: served unpinned (the next
                            // round carves from the unpinned chunks).
                            key.kind = key.kind.without_pinning();
                            if let Some(mut arena) = self.blocks.arena(target.host_node) {
                                arena.registration_failed();
                            }
                        }
                        self.blocks.add_chunk(target.host_node, key, chunk)?;
                    }
                }
            }
            None
        })();
        // A hit: carved from chunks there were; anything else (a new chunk, a failure) a miss,
        // except reserved room not found (the dedicated path counts that request).
        match (block.is_some() && !made, make) {
            (true, _) => self.blocks.counters.cache_hits.incr(),
            (false, true) => self.blocks.counters.cache_misses.incr(),
            (false, false) => {}
        }
        block
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
            let root = std::path::Path::new(self.blocks.settings.sysfs_root);
            if len >= HUGE_PAGE && live::node_memory_low(root, block.node) {
                Pressure {
                    blocks: self.blocks,
                }
                .give_back_for(block.node, len, Shortage::Memory);
            }
            let start = unpopulated.ptr().as_ptr() as usize;
            let plan = self
                .blocks
                .populate_plan(block.kind, zeroed, block.capacity, (start, len));
            let placer = self.blocks.placer();
            let populate = |part: &mut Part<'_>| {
                if plan.head == 0 || plan.head >= len {
                    return placer.populate_part(part, &target.nodes, plan.head > 0);
                }
                // Its head: the cgroup's room for all of it, then the head populated.
                placer.populate_part(part, &target.nodes, false)?;
                let head = Span {
                    addr: start,
                    len: plan.head,
                };
                part.sub(head).map_or(Ok(()), |mut head| {
                    placer.populate_part(&mut head, &target.nodes, true)
                })
            };
            let mut populated = populate(&mut unpopulated);
            if let Err(e) = &populated {
                // Idle memory of the node may make room (the block itself is live: it stays).
                if (Pressure {
                    blocks: self.blocks,
                })
                .relieves(block.node, len, e)
                {
                    populated = populate(&mut unpopulated);
                }
            }
            if let Err(e) = populated {
                self.blocks.counters.record_block_failure(&e);
                if let Some(mut arena) = self.blocks.arena(block.node) {
                    arena.populate_failed(block);
                }
                return None;
            }
            if let Some(watch) = plan.watch {
                watch.set(block.addr, block.capacity, start);
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
        let nodes = self.blocks.policy_nodes_of(node);
        let populate = self.blocks.populates_request(old.kind, false);
        if self
            .blocks
            .placer()
            .populate_part(&mut part, &nodes, populate)
            .is_ok()
        {
            return true;
        }
        // Not a failed request: the caller moves the block instead.
        if let Some(mut arena) = self.blocks.arena(node) {
            arena.grow_failed(old);
        }
        false
    }

    /// A new chunk for `key` with room for `need` bytes, placed for `target`; pinned when the kind
    /// is and the registration works (else, under `pin=on`, an unpinned chunk, counted; `pin=on`
    /// without a GPU for the target counts its unpinned chunks too). A chunk
    /// that fails for want of memory is tried again smaller (only as large as `need`), then
    /// after giving idle memory of the node back — unless there is too little to give back.
    fn new_chunk(&self, key: HeapKey, need: usize, target: &Resolved) -> Result<Chunk, Error> {
        let node = target.host_node;
        let planned = self
            .blocks
            .arena(node)
            .map_or(need, |arena| arena.next_chunk_len(key, need))
            .min(
                self.blocks
                    .chunk_max(key.kind.pinned)
                    .max(need.next_multiple_of(CHUNK_ALIGN)),
            );
        let least = need.next_multiple_of(CHUNK_ALIGN);
        let mut made = self.make_chunk(key, planned, target);
        if made.as_ref().is_err_and(shortage) && planned > least {
            made = self.make_chunk(key, least, target);
        }
        if let Err(e) = &made {
            let needed = shortage_bytes(e, need);
            if (Pressure {
                blocks: self.blocks,
            })
            .relieves(node, needed, e)
            {
                made = self.make_chunk(key, least, target);
            }
        }
        made.inspect_err(|e| self.blocks.counters.record_block_failure(e))
    }

    /// A chunk of `len` bytes for `key` from the process's chunk source, made by the placer:
    /// pinned as the value's pin policy decides for the kind (a pinned kind registers; `pin=on`
    /// backs off to unpinned chunks when the kind lost its pinning).
    fn make_chunk(&self, key: HeapKey, len: usize, target: &Resolved) -> Result<Chunk, Error> {
        let blocks = self.blocks;
        let pin = PinPolicy::decide(blocks.settings.pin, key.kind.pinned);
        let source = blocks.process.source();
        blocks
            .placer()
            .chunk(source, len, key.huge, &target.place(), pin)
    }
}
