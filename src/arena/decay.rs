//! What the arena gives back. Cached dedicated blocks beyond the budget are evicted, oldest
//! first. Idle memory goes back to the kernel: free ranges idle for the decay time are purged
//! (`MADV_DONTNEED`, outside the lock), chunks wholly free as long are released (pinned ones
//! after ten times as long), and the same at once for memory pressure and `trim()`.
//!
//! A purge fails on locked memory (`mlock`, `mlockall`): such a range goes back unpurgeable
//! (see the carver), so that none of these loops offers it again and again, and its bytes count
//! as nothing to give back.

use super::{
    Arena, Dedicated, Fit, Purge, PurgeFailures, Released, Shortage, CLASSES_PER_DOUBLING,
    GROWTH_ROOM,
};

/// Wholly free pinned chunks decay this many times more slowly than unpinned memory: making one
/// again costs a populate and a registration.
const PINNED_DECAY_FACTOR: u64 = 10;

impl Arena {
    /// Caches a freed dedicated block, then evicts the oldest cached blocks while cached and
    /// pending bytes exceed the budget (`limit`, and the live high-water mark, see
    /// [`Self::budget`]). A block larger than the whole limit is evicted alone rather than
    /// emptying the cache, and so is a page-locked block in a forked child. Pending blocks are
    /// never evicted: GPU work may still use them.
    pub(crate) fn cache(&mut self, dedicated: Dedicated, limit: usize, out: &mut Released) {
        let in_child = self.in_child;
        if self
            .dedicated
            .cache(dedicated, limit, in_child, &self.clock, out)
        {
            self.evict_beyond(limit, out);
        }
    }

    /// Bytes the dedicated cache and the pending list may hold once `more` bytes more are live:
    /// at most `limit`, and no more than keeps live, pending and cached bytes within 1/8 above
    /// the most that was live and pending at once. Reuse never needs more (what was in use at
    /// once fits).
    fn budget(&self, limit: usize, more: usize) -> usize {
        let live = self.live.bytes().saturating_add(more);
        let peak = self.peak_in_use.max(live);
        let roof = peak.saturating_add(peak / CLASSES_PER_DOUBLING as usize);
        limit.min(roof.saturating_sub(live))
    }

    /// Evicts the oldest cached blocks beyond the budget a new dedicated block of `capacity` will
    /// leave once live: before that block is mapped and populated, so that the blocks a phase of
    /// the program stopped using (of sizes the next phase does not ask for) leave before the
    /// next phase's memory comes in, and the process never holds both. Cached blocks within the
    /// budget stay for reuse: together with what is live they fit in what was in use at once.
    pub(crate) fn make_room(&mut self, capacity: usize, limit: usize, out: &mut Released) {
        self.evict_to(self.budget(limit, capacity), out);
    }

    /// [`Self::make_room`], taking out first, for a new block of `fit` (when given; `capacity`
    /// bytes), a cached block it can be made of that making room would evict anyway: a block
    /// of `fit`'s kind up to [`GROWTH_ROOM`] times larger (it shrinks in place) or smaller (its
    /// pages move to the head of the new block, `mremap`), one the budget evicts
    /// ([`CacheIndex::take_to_resize`](super::index::CacheIndex::take_to_resize)), so no block
    /// the budget keeps for reuse is resized. Never a page-locked one (a registration is
    /// tied to the address and length) nor one whose pages were checked (a grown tail is not).
    pub(crate) fn make_room_from_cache(
        &mut self,
        fit: Option<Fit>,
        capacity: usize,
        limit: usize,
        out: &mut Released,
    ) -> Option<Dedicated> {
        let over = (self.dedicated.cached.bytes() + self.pending.bytes())
            .saturating_sub(self.budget(limit, capacity));
        let taken = fit
            .filter(|f| over > 0 && !f.kind.pinned && !f.kind.verified)
            .and_then(|fit| {
                let sizes = (
                    fit.least / GROWTH_ROOM,
                    fit.least.saturating_mul(GROWTH_ROOM),
                );
                let resizable = |d: &Dedicated| d.memory.movable();
                self.dedicated
                    .cached
                    .take_to_resize(fit, sizes, over, resizable)
            });
        self.make_room(capacity, limit, out);
        taken
    }

    pub(super) fn evict_beyond(&mut self, limit: usize, out: &mut Released) {
        self.evict_to(self.budget(limit, 0), out);
    }

    /// Evicts the oldest cached blocks while cached and pending bytes pass `budget`.
    fn evict_to(&mut self, budget: usize, out: &mut Released) {
        let pending = self.pending.bytes();
        self.dedicated.evict_to(budget, pending, &self.clock, out);
    }

    // Idle memory.

    /// Idle memory: free ranges not used for `decay_ms` are purged, chunks wholly free for as
    /// long (pinned ones ten times as long) released. Looks at most four times per `decay_ms`;
    /// stops when `out` is full.
    pub(crate) fn decay(&mut self, decay_ms: u64, out: &mut Released) {
        if self.clock.decay_due(decay_ms) {
            self.release_idle(decay_ms, usize::MAX, Shortage::Memory, false, out);
        }
    }

    /// Gives back memory idle for at least `age` milliseconds — chunks wholly free for as long
    /// released (pinned ones: idle ten times as long), free ranges purged, then cached dedicated
    /// blocks — until `bytes` were given back or `out` is full; `Shortage::AddressSpace` counts
    /// only what unmaps (purging keeps the mapping). Reserved chunks go only with `everything`
    /// (trim, memory pressure). Returns the bytes given back.
    fn release_idle(
        &mut self,
        age: u64,
        bytes: usize,
        want: Shortage,
        everything: bool,
        out: &mut Released,
    ) -> usize {
        let now = self.clock.now();
        let mut released = 0usize;
        let page_locked = want == Shortage::PageLocked;
        // The pinned limit: reservations keep their page-locked chunks.
        let everything = everything && !page_locked;
        for h in 0..self.heaps.len() {
            let pinned = self.heaps.pinned(h);
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
                released += self
                    .heaps
                    .release_free_chunks(h, since, everything, left, out);
            }
            if let Some(since) = now.checked_sub(age).filter(|_| !pinned) {
                let purged = self
                    .heaps
                    .purge_idle(h, since, bytes - released.min(bytes), out);
                if want == Shortage::Memory {
                    released += purged;
                }
            }
        }
        if age != u64::MAX {
            let cached_by = now.saturating_sub(age);
            let left = bytes.saturating_sub(released);
            released += self
                .dedicated
                .release_idle(cached_by, left, page_locked, &self.clock, out);
        }
        released
    }

    /// Gives the oldest idle memory back while idle memory that may be resident (dirty free
    /// ranges, cached dedicated blocks) is above `limit`.
    pub(super) fn hold_within(&mut self, limit: usize, out: &mut Released) {
        // Pinned chunks' free space cannot be purged: it does not count (it decays whole).
        let idle = self.heaps.idle_unpinned() + self.dedicated.cached.bytes();
        if idle > limit {
            self.release_idle(0, idle - limit, Shortage::Memory, false, out);
        }
    }

    /// Takes the free ranges of unpinned chunks idle for at least `age` milliseconds out, into
    /// `out`, to purge (the decay thread: chunks and cached blocks stay).
    pub(crate) fn purge_idle_ranges(&mut self, age: u64, out: &mut Released) {
        let Some(since) = self.clock.now().checked_sub(age) else {
            return;
        };
        for h in 0..self.heaps.len() {
            if !self.heaps.pinned(h) {
                self.heaps.purge_idle(h, since, usize::MAX, out);
            }
        }
    }

    /// Takes cached dedicated blocks cached at least `age` milliseconds ago out, into `out`, to
    /// release (the decay thread; counted in the node's `decay_released`).
    pub(crate) fn release_idle_dedicated(&mut self, age: u64, out: &mut Released) {
        let Some(since) = self.clock.now().checked_sub(age) else {
            return;
        };
        self.dedicated.release_cached_by(since, &self.clock, out);
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
        let chunks = self.heaps.releasable(want);
        let cached = match want {
            Shortage::PageLocked => self.dedicated.cached.pinned_bytes(),
            _ => self.dedicated.cached.bytes(),
        };
        chunks + cached
    }

    /// Takes back ranges purged outside the lock: free again, and known to be zero (see
    /// [`Heaps::purged`](super::heaps::Heaps::purged)). Returns the purges that failed.
    pub(crate) fn purged(&mut self, purges: impl Iterator<Item = (Purge, bool)>) -> PurgeFailures {
        self.heaps.purged(purges, self.clock.now())
    }
}
