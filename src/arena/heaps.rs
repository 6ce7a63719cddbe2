//! Carving: blocks cut from a heap's chunks, given back to them (or to the pending list while
//! GPU work uses them), grown and shrunk where they lie; chunks added as they are made.
//!
//! Unsafe code here relies on the carver: a range it just handed out (or a block just grew
//! into) is nobody's but the caller's.
#![allow(unsafe_code)]

use super::carve::Carver;
use super::index::CacheIndex;
use super::settle;
use super::{
    Arena, Backing, Block, Carving, Dedicated, Heap, HeapKey, Live, Released, Shortage, Slot,
    CHUNK_ALIGN, CHUNK_FIRST, CHUNK_MAX,
};
use crate::chunk::{Chunk, Part, Span};

impl Arena {
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
        let span = Span {
            addr: range.addr,
            len: range.size,
        };
        // SAFETY: the range was just carved: nobody else has it until the caller hands it out.
        let Some(part) = (unsafe { chunk.claim(span) }) else {
            // Cannot happen: chunks are never at address 0. Keep the range out of use.
            return Ok(None);
        };
        let block = Block {
            addr: range.addr,
            capacity: range.size,
            node: self.node,
            kind: key.kind,
            routed_for: for_gpu,
        };
        let slot = Slot {
            heap,
            region: range.region,
            handle: range.handle,
        };
        self.insert_live(block, Backing::Carved(slot));
        Ok(Some(Carving {
            block,
            part,
            populate,
            dirty,
        }))
    }

    /// Takes back a carved block whose populate failed, unused (its granules stay marked as
    /// may-be-resident: populating may have got some of them in).
    pub(crate) fn populate_failed(&mut self, block: Block) {
        let Some(live) = self.remove_live(block.addr) else {
            return;
        };
        if let Backing::Carved(slot) = live.backing {
            let now = self.now();
            let _ = self.heaps[slot.heap]
                .carver
                .free(slot.handle, block.addr, now);
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
            // Room for all of them; short of it, `out` takes what does not fit.
            let _ = kept.reserve(self.cached.len() + self.live_dedicated + self.pending.len());
            while let Some(cached) = self.cached.pop_oldest() {
                let cached = if cached.block.kind.pinned {
                    self.forget_pinned(&cached.block);
                    match out.blocks.push(cached) {
                        Ok(()) => continue,
                        Err(cached) => cached,
                    }
                } else {
                    cached
                };
                if let Err(cached) = kept.insert(cached, 0) {
                    if let Err(cached) = out.blocks.push(cached) {
                        Dedicated::leave_mapped(cached);
                    }
                }
            }
            self.cached = kept;
        }
        if self.pending.len() == 0 {
            return;
        }
        let now = self.now();
        let mut cursor = 0;
        while let Some((block, backing)) = self.pending.take_ready(&mut cursor) {
            self.give_back(block, backing, now, limit, out);
        }
    }

    /// A freed block without work in flight: back to its carver, or into the dedicated cache.
    pub(super) fn give_back(
        &mut self,
        block: Block,
        backing: Backing,
        now: u64,
        limit: usize,
        out: &mut Released,
    ) {
        match backing {
            Backing::Carved(slot) => {
                let heap = &mut self.heaps[slot.heap];
                let reserved = heap.chunk_mut(slot.region).is_some_and(|c| c.reserved());
                // A reserved chunk's free space is not idle: out of the decay's sight.
                let _ = if reserved {
                    heap.carver.give_back_clean(slot.handle, block.addr)
                } else {
                    heap.carver.free(slot.handle, block.addr, now)
                };
            }
            Backing::Dedicated(memory) => self.cache(Dedicated { block, memory }, limit, out),
        }
    }

    /// Takes back a freed block: pending while any of its work is not complete, else back to its
    /// carver or cached (see [`Self::cache`]). Allocates nothing.
    pub(crate) fn free(&mut self, mut live: Live, limit: usize, out: &mut Released) {
        if settle(&mut live.work) {
            let now = self.now();
            self.give_back(live.block, live.backing, now, limit, out);
            self.hold_within(limit, out);
        } else {
            self.pending.push(live.block, live.backing, live.work);
            self.evict_beyond(limit, out);
        }
    }

    /// Gives the oldest idle memory back while idle memory that may be resident (dirty free
    /// ranges, cached dedicated blocks) is above `limit`.
    pub(super) fn hold_within(&mut self, limit: usize, out: &mut Released) {
        // Pinned chunks' free space cannot be purged: it does not count (it decays whole).
        let unpinned = self.heaps.iter().filter(|h| !h.key.kind.pinned);
        let idle = unpinned.map(Heap::idle_resident).sum::<usize>() + self.cached.bytes();
        if idle > limit {
            self.release_idle(0, idle - limit, Shortage::Memory, false, out);
        }
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
        let live = self.live.get_mut(&addr)?;
        // A tail GPU work may still use must not be carved again: such a block moves instead.
        if new_size < live.block.capacity && !live.work.is_empty() {
            if !settle(&mut live.work) {
                return None;
            }
            self.live_with_work = self.live_with_work.saturating_sub(1);
        }
        let live = self.live.get(&addr)?;
        let (Backing::Carved(slot), old) = (&live.backing, live.block) else {
            return None;
        };
        let slot = *slot;
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
            heap.chunk_mut(slot.region).and_then(|chunk| {
                let span = chunk.plan_populate(grown.0, grown.1);
                let _ = chunk.hand_out(grown.0, grown.1);
                // SAFETY: the span lies in the room the block just grew into, which only the
                // caller (resizing it) uses.
                span.and_then(|s| unsafe { chunk.claim(s) })
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

    /// Undoes a growth in place whose populate failed: the block is `old` again.
    pub(crate) fn grow_failed(&mut self, old: Block) {
        let _ = self.resize_carved(old.addr, old.capacity);
    }
}
