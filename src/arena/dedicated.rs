//! Dedicated blocks: requests too large to carve (and blocks `realloc` grows) get a mapping of
//! their own, cached whole when freed and reused for a request of nearly their size, under a
//! budget that follows the most that was in use at once (see
//! [`Arena::budget`](super::Arena::budget)).

use super::block::{Block, Dedicated};
use super::clock::Clock;
use super::index::CacheIndex;
use super::released::Released;

/// An arena's dedicated blocks outside the live set: the cache of freed ones, those out while
/// they grow, and the page-locked bytes of every dedicated block.
#[derive(Default)]
pub(super) struct DedicatedBlocks {
    /// Freed blocks, reused for a request of nearly their size (`index.rs`).
    pub(super) cached: CacheIndex,
    /// Blocks out of the live set while they grow
    /// ([`Arena::take_growable`](super::Arena::take_growable)): every insert keeps room in the
    /// live set and the cache for them to come back.
    pub(super) moving: usize,
    /// Page-locked dedicated blocks' bytes (live, pending and cached).
    pub(super) pinned: usize,
    /// Cached blocks the decay thread released.
    pub(super) decay_released: u64,
}

impl DedicatedBlocks {
    /// Counts a block just made: pinned dedicated bytes include live, pending and cached blocks.
    pub(super) fn note_created(&mut self, block: &Block) {
        if block.kind.pinned {
            self.pinned += block.capacity;
        }
    }

    /// Stops counting a block handed out for release.
    pub(super) fn forget_pinned(&mut self, block: &Block) {
        if block.kind.pinned {
            self.pinned = self.pinned.saturating_sub(block.capacity);
        }
    }

    /// Caches a freed block; false when it was evicted instead: a block larger than the whole
    /// `limit` (rather than emptying the cache), a page-locked block in a forked child, or one
    /// the cache has no room for.
    pub(super) fn cache(
        &mut self,
        dedicated: Dedicated,
        limit: usize,
        in_child: bool,
        clock: &Clock,
        out: &mut Released,
    ) -> bool {
        let block = dedicated.block;
        if block.capacity > limit || (block.kind.pinned && in_child) {
            self.evict(dedicated, clock, out);
            return false;
        }
        if let Err(dedicated) = self.cached.insert(dedicated, clock.now()) {
            self.evict(dedicated, clock, out);
            return false;
        }
        true
    }

    /// Hands a dedicated block out for release. When `out` is full (only after many evictions
    /// in one operation) it stays cached beyond the budget, for a later operation to evict; when
    /// even that finds no room it is left mapped and forgotten rather than tracked wrongly.
    pub(super) fn evict(&mut self, dedicated: Dedicated, clock: &Clock, out: &mut Released) {
        self.forget_pinned(&dedicated.block);
        if let Err(dedicated) = out.blocks.push(dedicated) {
            let block = dedicated.block;
            match self.cached.insert(dedicated, clock.now()) {
                Ok(()) => self.note_created(&block),
                Err(dedicated) => dedicated.leave_mapped(),
            }
        }
    }

    /// Evicts the oldest cached blocks while cached and `pending` bytes pass `budget`.
    pub(super) fn evict_to(
        &mut self,
        budget: usize,
        pending: usize,
        clock: &Clock,
        out: &mut Released,
    ) {
        while self.cached.bytes() + pending > budget && !out.blocks.is_full() {
            let Some(old) = self.cached.pop_oldest() else {
                break;
            };
            self.evict(old, clock, out);
        }
    }

    /// Evicts the blocks cached at `cached_by` or before (only page-locked ones with
    /// `page_locked`), oldest first, until `bytes` were given back or `out` is full. Returns the
    /// bytes given back.
    pub(super) fn release_idle(
        &mut self,
        cached_by: u64,
        bytes: usize,
        page_locked: bool,
        clock: &Clock,
        out: &mut Released,
    ) -> usize {
        let mut released = 0;
        while released < bytes && !out.blocks.is_full() {
            let old = self
                .cached
                .pop_cached_where(cached_by, |block| !page_locked || block.kind.pinned);
            let Some(old) = old else {
                break;
            };
            released += old.block.capacity;
            self.evict(old, clock, out);
        }
        released
    }

    /// Evicts the blocks cached at `since` or before, for the decay thread (counted in
    /// `decay_released`).
    pub(super) fn release_cached_by(&mut self, since: u64, clock: &Clock, out: &mut Released) {
        while !out.blocks.is_full() {
            let Some(block) = self.cached.pop_cached_by(since) else {
                break;
            };
            self.decay_released += 1;
            self.evict(block, clock, out);
        }
    }

    /// Hands the page-locked cached blocks out for release (a forked child: page-locked memory
    /// is not reused), keeping room in the cache for `more` blocks beyond the others.
    pub(super) fn release_pinned(&mut self, more: usize, out: &mut Released) {
        let mut kept = CacheIndex::default();
        // Room for all of them; short of it, `out` takes what does not fit.
        let _ = kept.reserve(self.cached.len() + more);
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
}
