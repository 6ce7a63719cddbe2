//! Idle memory goes back to the kernel: free ranges idle for the decay time are purged
//! (`MADV_DONTNEED`, outside the lock), chunks wholly free as long are released (pinned ones
//! after ten times as long), and the same at once for memory pressure and `trim()`.
//!
//! A purge fails on locked memory (`mlock`, `mlockall`): such a range goes back unpurgeable
//! (see the carver), so that none of these loops offers it again and again, and its bytes count
//! as nothing to give back.

use super::carve::Range;
use super::{Arena, Purge, PurgeFailures, Released, Shortage, CHUNK_FIRST, PINNED_DECAY_FACTOR};
use crate::chunk::Chunk;

impl Arena {
    /// Idle memory: free ranges not used for `decay_ms` are purged, chunks wholly free for as
    /// long (pinned ones ten times as long) released. Looks at most four times per `decay_ms`;
    /// stops when `out` is full.
    pub(crate) fn decay(&mut self, decay_ms: u64, out: &mut Released) {
        let now = self.now();
        if now < self.next_decay {
            return;
        }
        self.next_decay = now.saturating_add(decay_ms / 4);
        self.release_idle(decay_ms, usize::MAX, Shortage::Memory, false, out);
    }

    /// Gives back memory idle for at least `age` milliseconds — chunks wholly free for as long
    /// released (pinned ones: idle ten times as long), free ranges purged, then cached dedicated
    /// blocks — until `bytes` were given back or `out` is full; `Shortage::AddressSpace` counts
    /// only what unmaps (purging keeps the mapping). Reserved chunks go only with `everything`
    /// (trim, memory pressure). Returns the bytes given back.
    pub(super) fn release_idle(
        &mut self,
        age: u64,
        bytes: usize,
        want: Shortage,
        everything: bool,
        out: &mut Released,
    ) -> usize {
        let now = self.now();
        let mut released = 0usize;
        let page_locked = want == Shortage::PageLocked;
        // The pinned limit: reservations keep their page-locked chunks.
        let everything = everything && !page_locked;
        for h in 0..self.heaps.len() {
            let pinned = self.heaps[h].key.kind.pinned;
            // A forked child's pinned chunks are the parent's registrations: left alone.
            if (pinned && self.in_child) || (page_locked && !pinned) {
                continue;
            }
            let chunk_age = if pinned {
                age.saturating_mul(PINNED_DECAY_FACTOR)
            } else {
                age
            };
            if let Some(since) = now.checked_sub(chunk_age) {
                let left = bytes - released.min(bytes);
                released += self.release_free_chunks(h, since, everything, left, out);
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
            let old = self
                .cached
                .pop_cached_where(cached_by, |block| !page_locked || block.kind.pinned);
            let Some(old) = old else {
                break;
            };
            released += old.block.capacity;
            self.evict(old, out);
        }
        released
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

    /// Takes the free ranges of unpinned chunks idle for at least `age` milliseconds out, into
    /// `out`, to purge (the decay thread: chunks and cached blocks stay).
    pub(crate) fn purge_idle_ranges(&mut self, age: u64, out: &mut Released) {
        let Some(since) = self.now().checked_sub(age) else {
            return;
        };
        for h in 0..self.heaps.len() {
            if !self.heaps[h].key.kind.pinned {
                self.purge_idle(h, since, usize::MAX, out);
            }
        }
    }

    /// Takes cached dedicated blocks cached at least `age` milliseconds ago out, into `out`, to
    /// release (the decay thread; counted in the node's `decay_released`).
    pub(crate) fn release_idle_dedicated(&mut self, age: u64, out: &mut Released) {
        let Some(since) = self.now().checked_sub(age) else {
            return;
        };
        while !out.blocks.is_full() {
            let Some(block) = self.cached.pop_cached_by(since) else {
                break;
            };
            self.decay_released += 1;
            self.evict(block, out);
        }
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
        self.release_idle(0, bytes, want, true, out)
    }

    /// Everything idle now, for `trim()`: completed pending blocks, free ranges, wholly free
    /// chunks, cached dedicated blocks. `false` when `out` filled up before the end.
    pub(crate) fn trim(&mut self, out: &mut Released) -> bool {
        self.settle_pending(0, out);
        self.release_idle(0, usize::MAX, Shortage::Memory, true, out);
        !out.full()
    }

    /// Bytes that giving idle memory back could free now for a request short of `want`:
    /// resident idle memory (free space of unpinned chunks but the ranges whose purge failed,
    /// wholly free pinned chunks) or, for
    /// address space, every free byte of the chunks, or, for page-locked bytes, wholly free
    /// pinned chunks not reserved; and cached dedicated blocks (pinned ones for page-locked
    /// bytes).
    pub(crate) fn releasable(&self, want: Shortage) -> usize {
        let chunks: usize = self
            .heaps
            .iter()
            .map(|h| match want {
                Shortage::AddressSpace => h.carver.stats().free_bytes,
                Shortage::Memory if h.key.kind.pinned => h.wholly_free_bytes(),
                Shortage::Memory => h.idle_resident(),
                Shortage::PageLocked if h.key.kind.pinned => h.wholly_free_unreserved_bytes(),
                Shortage::PageLocked => 0,
            })
            .sum();
        let cached = match want {
            Shortage::PageLocked => self.cached.pinned_bytes(),
            _ => self.cached.bytes(),
        };
        chunks + cached
    }

    /// Takes back ranges purged outside the lock: free again, and known to be zero.
    ///
    /// Each comes with whether its purge worked: one that failed (`MADV_DONTNEED` refuses locked
    /// memory) keeps its data, so it goes back dirty and resident, and unpurgeable: not offered
    /// again until it merges with another range; its bytes no longer count as purged. A range
    /// still touching a resident granule (one shared with a neighbour, purged with neither) goes
    /// back dirty too, so that a later merge purges it. Returns the purges that failed.
    pub(crate) fn purged(&mut self, purges: impl Iterator<Item = (Purge, bool)>) -> PurgeFailures {
        let now = self.now();
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
