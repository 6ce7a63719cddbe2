//! Dedicated blocks: requests too large to carve (and blocks `realloc` grows) get a mapping of
//! their own, cached whole when freed and reused for a request of nearly their size, under a
//! budget that follows the most that was in use at once.

use super::{Arena, Backing, Block, Dedicated, Fit, Kind, Released, CLASSES_PER_DOUBLING};

impl Dedicated {
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

impl Arena {
    /// Takes a cached dedicated block that fits (see
    /// [`CacheIndex::take`](super::CacheIndex::take)).
    pub(crate) fn take_cached(&mut self, fit: Fit) -> Option<Dedicated> {
        self.cached.take(fit)
    }

    /// Whether a cached dedicated block would serve this request.
    pub(crate) fn holds_fit(&self, fit: Fit) -> bool {
        self.cached.holds(fit)
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
        let live = self.live.get(&addr)?;
        let growable = matches!(&live.backing, Backing::Dedicated(m) if m.movable())
            && live.block.kind == kind
            && !kind.pinned
            && live.work.is_empty()
            && live.block.capacity < capacity;
        // Room for it to come back, grown or not, kept by every insert until then.
        if !growable || !self.reserve_dedicated(self.moving + 1) {
            return None;
        }
        let live = self.remove_live(addr)?;
        self.moving += 1;
        match live.backing {
            Backing::Dedicated(memory) => Some(Dedicated {
                block: live.block,
                memory,
            }),
            Backing::Carved(_) => None,
        }
    }

    /// Whether a pending block would have served this request (a miss deferred by GPU work).
    pub(crate) fn pending_fits(&self, fit: Fit) -> bool {
        self.pending.holds_fit(fit)
    }

    /// Records live again, as the user's, a block [`Self::take_growable`] took out: grown (a new
    /// address) or not. The room it needs was kept since, so this allocates nothing.
    pub(crate) fn return_grown(
        &mut self,
        dedicated: Dedicated,
        limit: usize,
        out: &mut Released,
    ) -> Result<Block, Dedicated> {
        self.moving = self.moving.saturating_sub(1);
        self.insert_created(dedicated, limit, out)
    }

    /// Room in the live set for `more` blocks, and in the cache for every dedicated block out
    /// (live, pending, growing) and `more`: a free must not allocate, nor a grown block's
    /// return. False when it could not be had.
    fn reserve_dedicated(&mut self, more: usize) -> bool {
        let out = self.live_dedicated + self.pending.len() + self.moving + more;
        self.live.try_reserve(self.moving + more).is_ok() && self.cached.reserve(out)
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

    /// Caches a freed dedicated block, then evicts the oldest cached blocks while cached and
    /// pending bytes exceed the budget (`limit`, and the live high-water mark, see
    /// [`Self::budget`]). A block larger than the whole limit is evicted alone rather than
    /// emptying the cache, and so is a page-locked block in a forked child. Pending blocks are
    /// never evicted: GPU work may still use them.
    pub(crate) fn cache(&mut self, dedicated: Dedicated, limit: usize, out: &mut Released) {
        let block = dedicated.block;
        if block.capacity > limit || (block.kind.pinned && self.in_child) {
            self.evict(dedicated, out);
            return;
        }
        if let Err(dedicated) = self.cached.insert(dedicated, self.now()) {
            self.evict(dedicated, out);
            return;
        }
        self.evict_beyond(limit, out);
    }

    /// Hands a dedicated block out for release. When `out` is full (only after many evictions
    /// in one operation) it stays cached beyond the budget, for a later operation to evict; when
    /// even that finds no room it is left mapped and forgotten rather than tracked wrongly.
    pub(super) fn evict(&mut self, dedicated: Dedicated, out: &mut Released) {
        self.forget_pinned(&dedicated.block);
        if let Err(dedicated) = out.blocks.push(dedicated) {
            let block = dedicated.block;
            match self.cached.insert(dedicated, self.now()) {
                Ok(()) => self.note_created(&block),
                Err(dedicated) => dedicated.leave_mapped(),
            }
        }
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
        self.note_created(&block);
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
        let _ = self.cached.reserve(1);
        let block = dedicated.block;
        self.note_created(&block);
        let held = self.live_bytes() + self.pending.bytes() + self.cached.bytes() + block.capacity;
        self.peak_in_use = self.peak_in_use.max(held);
        self.cache(dedicated, limit, out);
    }

    /// Pinned dedicated bytes include live, pending and cached blocks.
    pub(super) fn note_created(&mut self, block: &Block) {
        if block.kind.pinned {
            self.pinned_dedicated += block.capacity;
        }
    }

    /// Bytes the dedicated cache and the pending list may hold: at most `limit`, and no more than
    /// keeps live, pending and cached bytes within 1/8 above the most that was live and pending
    /// at once. Reuse never needs more (what was in use at once fits).
    pub(super) fn budget(&self, limit: usize) -> usize {
        self.budget_with(limit, 0)
    }

    /// [`Self::budget`] once `more` bytes more are live.
    fn budget_with(&self, limit: usize, more: usize) -> usize {
        let live = self.live_bytes().saturating_add(more);
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
        self.evict_to(self.budget_with(limit, capacity), out);
    }

    pub(super) fn evict_beyond(&mut self, limit: usize, out: &mut Released) {
        self.evict_to(self.budget(limit), out);
    }

    /// Evicts the oldest cached blocks while cached and pending bytes pass `budget`.
    fn evict_to(&mut self, budget: usize, out: &mut Released) {
        while self.cached.bytes() + self.pending.bytes() > budget && !out.blocks.is_full() {
            let Some(old) = self.cached.pop_oldest() else {
                break;
            };
            self.evict(old, out);
        }
    }

    pub(super) fn forget_pinned(&mut self, block: &Block) {
        if block.kind.pinned {
            self.pinned_dedicated = self.pinned_dedicated.saturating_sub(block.capacity);
        }
    }
}
