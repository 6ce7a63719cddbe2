//! What an arena operation leaves to do outside the lock, in fixed-size arrays: a free fills
//! them without allocating.
//!
//! Unsafe code here relies on ranges the arena took out of its carver to purge: unused and unpinned
//! while purged.
#![allow(unsafe_code)]

use super::carve::Range;
use super::{Arena, Dedicated};
use crate::chunk::{self, Chunk, ChunkRelease, ChunkSource, Span};
use crate::stats::Counters;
use crate::sys::lock::Lock;

/// What an arena operation leaves for the caller to do outside the lock: dedicated blocks to
/// release, chunks to release, idle ranges to purge (then [`Arena::purged`]). Fixed-size, so that
/// a free fills it without allocating; an operation that finds it full leaves the rest for later.
#[derive(Default)]
pub(crate) struct Released {
    pub(crate) blocks: Bounded<Dedicated, 8>,
    pub(crate) chunks: Bounded<Chunk, 4>,
    pub(crate) purges: Bounded<Purge, PURGES>,
}

impl Released {
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty() && self.chunks.is_empty() && self.purges.is_empty()
    }

    pub(super) fn full(&self) -> bool {
        self.blocks.is_full() || self.chunks.is_full() || self.purges.is_full()
    }
}

/// Idle ranges one operation hands out to purge, at most.
const PURGES: usize = 16;

/// The purges of one [`Released`] that failed (locked memory), for the caller's counters and
/// for what it may say it gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PurgeFailures {
    pub(crate) count: u64,
    pub(crate) bytes: usize,
}

impl Released {
    /// Purges the ranges handed out (`MADV_DONTNEED`, outside the lock), then gives them back
    /// to `arena`, with whether each purge worked; returns the ones that failed.
    pub(crate) fn purge_into(&mut self, arena: &Lock<Arena>) -> PurgeFailures {
        if self.purges.is_empty() {
            return PurgeFailures::default();
        }
        let mut done = [false; PURGES];
        for (purge, done) in self.purges.iter().zip(&mut done) {
            // SAFETY: the arena took each range out of its carver for this: unused, unpinned.
            *done = unsafe { chunk::purge(purge.source, purge.span) }.is_ok();
        }
        arena.lock().purged(self.purges.drain().zip(done))
    }
}

/// An idle free range taken out of its carver while the caller purges `span` of it.
#[derive(Debug)]
pub(crate) struct Purge {
    pub(super) heap: usize,
    pub(super) range: Range,
    pub(crate) span: Span,
    /// The source of the chunk the range lies in, which purges it.
    pub(crate) source: &'static dyn ChunkSource,
}

/// At most `N` values, on the stack.
pub(crate) struct Bounded<T, const N: usize> {
    items: [Option<T>; N],
    len: usize,
}

impl<T, const N: usize> Default for Bounded<T, N> {
    fn default() -> Self {
        Bounded {
            items: [const { None }; N],
            len: 0,
        }
    }
}

impl<T, const N: usize> Bounded<T, N> {
    /// Adds `item`; gives it back when full.
    pub(crate) fn push(&mut self, item: T) -> Result<(), T> {
        match self.items.get_mut(self.len) {
            Some(slot) => {
                *slot = Some(item);
                self.len += 1;
                Ok(())
            }
            None => Err(item),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn is_full(&self) -> bool {
        self.len == N
    }

    /// The items, in the order pushed.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.items[..self.len].iter().flatten()
    }

    /// Takes every item out, in the order pushed.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        let len = std::mem::take(&mut self.len);
        self.items[..len].iter_mut().filter_map(Option::take)
    }
}

impl Released {
    /// The release protocol, for every caller (a request, `trim`, the decay thread): releases
    /// the dedicated blocks and chunks an operation on `arena` handed out (unregistered, then
    /// unmapped), purges the idle ranges and gives them back, and counts all of it in
    /// `counters`. Returns the purges that failed. Allocates nothing.
    pub(crate) fn finish(
        &mut self,
        arena: Option<&Lock<Arena>>,
        counters: &Counters,
    ) -> PurgeFailures {
        for dedicated in self.blocks.drain() {
            count_release(counters, dedicated.memory.release());
        }
        for chunk in self.chunks.drain() {
            count_release(counters, chunk.release());
        }
        let failed = arena.map_or_else(PurgeFailures::default, |arena| self.purge_into(arena));
        counters.purge_failures.add(failed.count);
        failed
    }
}

/// Counts what releasing a block or chunk did.
pub(crate) fn count_release(counters: &Counters, released: ChunkRelease) {
    if let Some((time, result)) = released.unregistered {
        counters.unpin.record(time);
        match result {
            Ok(()) => counters.unregistrations.incr(),
            Err(e) => counters.record_unregister_failure(&e),
        }
    }
    if released.unmapped {
        counters.released_blocks.incr();
    }
}
