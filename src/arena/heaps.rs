//! The heaps: for each kind of chunk, its chunks and the carver over them. Blocks are carved
//! from them, given back, grown and shrunk where they lie; chunks are added as they are made,
//! and taken out again when wholly free; idle free ranges are taken out to purge.
//!
//! Unsafe code here relies on the carver: a range it just handed out (or a block just grew
//! into) is nobody's but the caller's.
#![allow(unsafe_code)]

use super::block::{Block, Carving, HeapKey, Shortage, Slot};
use super::carve::{Carver, Range};
use super::released::{Purge, PurgeFailures, Released};
use super::{CHUNK_ALIGN, CHUNK_FIRST, CHUNK_MAX};
use crate::chunk::{Chunk, Part, Span};
use crate::stats::HeapStats;

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

    /// Its row of the stats, for a heap of `node`.
    fn stats(&self, node: usize) -> HeapStats {
        let carver = self.carver.stats();
        let resident: usize = self.chunks.iter().flatten().map(Chunk::resident).sum();
        HeapStats {
            node,
            policy: self.key.kind.policy,
            pinned: self.key.kind.pinned,
            huge_pages: self.key.huge,
            reserved: self.key.reserved,
            chunks: carver.regions,
            mapped_bytes: carver.region_bytes,
            resident_bytes: resident,
            pinned_bytes: if self.key.kind.pinned {
                carver.region_bytes
            } else {
                0
            },
            free_bytes: carver.free_bytes,
            free_ranges: carver.free_ranges,
            largest_free: carver.largest_free,
            chunks_made: self.chunks_made,
            registrations: self.registrations,
            purged_bytes: self.purged,
        }
    }
}

/// Every heap of one arena, in the order they were made: a [`Slot`] and a [`Purge`] name their
/// heap by its index here.
#[derive(Default)]
pub(super) struct Heaps {
    heaps: Vec<Heap>,
}

impl Heaps {
    /// The index of the heap of `key`.
    pub(super) fn index(&self, key: HeapKey) -> Option<usize> {
        self.heaps.iter().position(|h| h.key == key)
    }

    /// Number of heaps.
    pub(super) fn len(&self) -> usize {
        self.heaps.len()
    }

    /// Whether heap `h`'s chunks are page-locked.
    pub(super) fn pinned(&self, h: usize) -> bool {
        self.heaps[h].key.kind.pinned
    }

    /// Carves `size` bytes at a multiple of `align` from heap `h`, for a block on `node` live for
    /// GPU `for_gpu`: its slot, and the carving for the caller. `Ok(None)`: no chunk has room;
    /// `Err(())`: the carver's table could not grow.
    pub(super) fn carve(
        &mut self,
        h: usize,
        size: usize,
        align: usize,
        node: usize,
        for_gpu: Option<u32>,
    ) -> Result<Option<(Slot, Carving)>, ()> {
        let heap = &mut self.heaps[h];
        let Some(range) = heap.carver.carve(size, align).map_err(drop)? else {
            return Ok(None);
        };
        let kind = heap.key.kind;
        let Some(chunk) = heap.chunk_mut(range.region) else {
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
            node,
            kind,
            routed_for: for_gpu,
        };
        let slot = Slot {
            heap: h,
            region: range.region,
            handle: range.handle,
        };
        let carving = Carving {
            block,
            part,
            populate,
            dirty,
        };
        Ok(Some((slot, carving)))
    }

    /// How long the next chunk of `key` is for a request that needs `need` bytes of it.
    pub(super) fn next_chunk_len(&self, key: HeapKey, need: usize) -> usize {
        let next = self
            .index(key)
            .map_or(CHUNK_FIRST, |h| self.heaps[h].next_chunk);
        next.max(need.next_multiple_of(CHUNK_ALIGN))
    }

    /// Adds a chunk made for `key` at `now`; gives it back when the bookkeeping could not grow.
    pub(super) fn add_chunk(&mut self, key: HeapKey, chunk: Chunk, now: u64) -> Result<(), Chunk> {
        let heap = match self.index(key) {
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

    /// Frees the carved block at `addr` back to its carver, dirty, stamped `now`.
    pub(super) fn free(&mut self, slot: Slot, addr: usize, now: u64) {
        let _ = self.heaps[slot.heap].carver.free(slot.handle, addr, now);
    }

    /// Gives a freed carved block at `addr` back to its carver: idle since `now`, but in a
    /// reserved chunk, whose free space is not idle.
    pub(super) fn give_back(&mut self, slot: Slot, addr: usize, now: u64) {
        let heap = &mut self.heaps[slot.heap];
        let reserved = heap.chunk_mut(slot.region).is_some_and(|c| c.reserved());
        // A reserved chunk's free space is not idle: out of the decay's sight.
        let _ = if reserved {
            heap.carver.give_back_clean(slot.handle, addr)
        } else {
            heap.carver.free(slot.handle, addr, now)
        };
    }

    /// Grows or shrinks the carved block at `addr` of `old` bytes to `new_size` where it lies
    /// (see [`Arena::resize_carved`](super::Arena::resize_carved)): `None` when there is no room.
    pub(super) fn resize(
        &mut self,
        slot: Slot,
        addr: usize,
        old: usize,
        new_size: usize,
        now: u64,
    ) -> Option<Option<Part<'static>>> {
        let heap = &mut self.heaps[slot.heap];
        let resized = if new_size > old {
            heap.carver.grow_in_place(slot.handle, addr, new_size)
        } else if new_size < old {
            heap.carver
                .shrink_in_place(slot.handle, addr, new_size, now)
                .unwrap_or(false)
        } else {
            true
        };
        if !resized {
            return None;
        }
        let populate = if new_size > old {
            let grown = (addr + old, new_size - old);
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
        Some(populate)
    }

    /// The start of the carved range in use that contains `addr`.
    pub(super) fn used_start(&self, addr: usize) -> Option<usize> {
        self.heaps
            .iter()
            .find_map(|h| h.carver.used_containing(addr))
            .map(|range| range.addr)
    }

    /// Resident idle bytes of the unpinned heaps (pinned chunks' free space cannot be purged: it
    /// decays whole).
    pub(super) fn idle_unpinned(&self) -> usize {
        let unpinned = self.heaps.iter().filter(|h| !h.key.kind.pinned);
        unpinned.map(Heap::idle_resident).sum()
    }

    /// One row of the stats per heap, for the arena of `node`.
    pub(super) fn rows(&self, node: usize) -> impl Iterator<Item = HeapStats> + '_ {
        self.heaps.iter().map(move |heap| heap.stats(node))
    }

    /// Takes the chunks of heap `h` wholly free since `since` out, into `out`; reserved chunks
    /// only when everything idle goes (`everything`: trim, memory pressure).
    pub(super) fn release_free_chunks(
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
            // Growth starts over when the heap is empty again.
            heap.next_chunk = if heap.carver.regions().next().is_none() {
                CHUNK_FIRST
            } else {
                (heap.next_chunk / 2).max(CHUNK_FIRST)
            };
            let _ = out.chunks.push(chunk);
        }
        released
    }

    /// Takes the free ranges of heap `h` idle since `since` out of its carver, and hands their
    /// resident granules to `out` to purge.
    pub(super) fn purge_idle(
        &mut self,
        h: usize,
        since: u64,
        bytes: usize,
        out: &mut Released,
    ) -> usize {
        let mut released = 0;
        let heap = &mut self.heaps[h];
        while released < bytes && !out.purges.is_full() {
            let Some(range) = heap.carver.take_idle(since) else {
                break;
            };
            let planned = heap.chunk_mut(range.region).and_then(|chunk| {
                let span = chunk.plan_purge(range.addr, range.size)?;
                Some((span, chunk.source()))
            });
            match planned {
                Some((span, source)) => {
                    released += span.len;
                    heap.purged += span.len as u64;
                    let _ = out.purges.push(Purge {
                        heap: h,
                        range,
                        span,
                        source,
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

    /// Bytes of the chunks that giving idle memory back could free now for a request short of
    /// `want` (see [`Arena::releasable`](super::Arena::releasable)).
    pub(super) fn releasable(&self, want: Shortage) -> usize {
        self.heaps
            .iter()
            .map(|h| match want {
                Shortage::AddressSpace => h.carver.stats().free_bytes,
                Shortage::Memory if h.key.kind.pinned => h.wholly_free_bytes(),
                Shortage::Memory => h.idle_resident(),
                Shortage::PageLocked if h.key.kind.pinned => h.wholly_free_unreserved_bytes(),
                Shortage::PageLocked => 0,
            })
            .sum()
    }

    /// Takes back ranges purged outside the lock at `now`: free again, and known to be zero.
    ///
    /// Each comes with whether its purge worked: one that failed (`MADV_DONTNEED` refuses locked
    /// memory) keeps its data, so it goes back dirty and resident, and unpurgeable: not offered
    /// again until it merges with another range; its bytes no longer count as purged. A range
    /// still touching a resident granule (one shared with a neighbour, purged with neither) goes
    /// back dirty too, so that a later merge purges it. Returns the purges that failed.
    pub(super) fn purged(
        &mut self,
        purges: impl Iterator<Item = (Purge, bool)>,
        now: u64,
    ) -> PurgeFailures {
        let mut failed = PurgeFailures::default();
        for (purge, done) in purges {
            let Some(heap) = self.heaps.get_mut(purge.heap) else {
                continue;
            };
            let Range {
                addr,
                size,
                region,
                handle,
            } = purge.range;
            if !done {
                if let Some(chunk) = heap.chunk_mut(region) {
                    chunk.purge_failed(purge.span);
                }
                heap.purged = heap.purged.saturating_sub(purge.span.len as u64);
                failed.count += 1;
                failed.bytes += purge.span.len;
                let _ = heap.carver.give_back_unpurged(handle, addr);
                continue;
            }
            let resident = heap
                .chunk_mut(region)
                .is_some_and(|chunk| chunk.any_resident(addr, size));
            let _ = if resident {
                heap.carver.free(handle, addr, now)
            } else {
                heap.carver.give_back_clean(handle, addr)
            };
        }
        failed
    }
}
