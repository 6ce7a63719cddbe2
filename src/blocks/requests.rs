//! What the front ends ask of the large path, and all they may ask: allocate, free, resize in
//! place, grow without copying, trim, attach GPU work, reset peaks. Each call runs inside the
//! re-entrancy guard; `near` is the node whose arena is looked at first (the calling thread's
//! likely one: a block is most often freed where it was allocated).

use std::alloc::Layout;
use std::ptr::NonNull;

use super::{carved, written, Blocks, CarvedPath, DedicatedPath, Resolved, HUGE_PAGE};
use crate::arena::{Block, InFlight, Released};
use crate::process::NODES;
use crate::sys;

/// The least size of a growing block given a mapping of its own: below it a copy is cheap, and
/// above it such blocks cost at most two kernel mappings per 8 MiB (a process may have about
/// 65,000) and the dedicated cache holds at most its limit over 8 MiB (512 for 4 GiB).
pub(crate) const GROWS_BY_REMAP_MIN: usize = 4 * HUGE_PAGE;

impl Blocks {
    /// A block for `layout` (of at least the threshold) for `target`: carved from a chunk below
    /// the dedicated size, else from reserved room, else a dedicated mapping (cached or new);
    /// zeroed when asked. A block `growing` (the new place of a block `realloc` grows) of at
    /// least [`GROWS_BY_REMAP_MIN`] gets a dedicated mapping when unpinned, whatever its size, so
    /// that its next growth moves its pages instead of its bytes ([`Self::grow_without_copy`]).
    /// `None` when it cannot be had (counted).
    pub(crate) fn allocate(
        &self,
        layout: Layout,
        zeroed: bool,
        growing: bool,
        target: &Resolved,
    ) -> Option<NonNull<u8>> {
        let block = self.allocate_block(layout, zeroed, growing, target);
        if block.is_none() {
            self.counters.failed_allocations.incr();
        }
        NonNull::new(block?.addr as *mut u8)
    }

    fn allocate_block(
        &self,
        layout: Layout,
        zeroed: bool,
        growing: bool,
        target: &Resolved,
    ) -> Option<Block> {
        // Before any carving or mapping: `pin=strict` takes no unpinned block, and maps none.
        let kind = self
            .kind(target)
            .map_err(|e| self.counters.record_strict_refusal(&e))
            .ok()?;
        self.counters.record_request(layout.size());
        let page_size = self.page_size();
        let size = layout.size().checked_next_multiple_of(page_size)?;
        let align = layout.align().max(page_size);
        let grows_by_remap = growing && !kind.pinned && size >= GROWS_BY_REMAP_MIN;
        let carver = CarvedPath { blocks: self };
        if carved(size, align) && !grows_by_remap {
            carver.carve(size, align, zeroed, target, kind)
        } else if let Some(block) = carver.carve_reserved(size, align, zeroed, target, kind) {
            Some(block)
        } else {
            DedicatedPath { blocks: self }.dedicated(layout, zeroed, growing, target, kind)
        }
    }

    /// Takes back the live block at `addr`, whichever value or thread allocated it: pending while
    /// GPU work recorded against it runs, else back to its chunk's free space or the dedicated
    /// cache; idle memory is looked at, and what is to be released, released. False when no
    /// arena holds a live block starting at `addr` (counted: the caller frees it elsewhere).
    /// Allocates nothing.
    pub(crate) fn free(&self, addr: usize, near: usize) -> bool {
        let mut out = Released::default();
        let (limit, decay) = (self.settings.cache_limit, self.settings.decay_ms);
        let found = NODES.find_map(near, |arena| {
            let live = arena.remove_live(addr)?;
            // The switch tests use to show that they catch reuse during GPU work.
            let live = if sys::fault::in_flight_ignored() {
                live.without_work()
            } else {
                live
            };
            let capacity = live.block.capacity;
            arena.free(live, limit, &mut out);
            arena.decay(decay, &mut out);
            Some((arena.node(), capacity))
        });
        let Some((node, capacity)) = found else {
            self.counters.foreign_frees.incr();
            return false;
        };
        self.counters.frees.incr();
        // Before `finish` releases anything: a block given back is still mapped here.
        written::freed(addr, capacity);
        self.finish(node, &mut out);
        true
    }

    /// The live block at `addr` is being reallocated: what its user writes is no longer seen
    /// at its free (a copy reads it whole; a move takes its pages elsewhere).
    pub(crate) fn reallocating(&self, addr: usize) {
        written::forget(addr);
    }

    /// Resizes the live block at `addr` where it lies: a carved block grows into the free range
    /// after it or gives its tail back; a dedicated one is kept when `new` fits its capacity
    /// without wasting more than half of it.
    pub(crate) fn resize_in_place(&self, addr: usize, new: Layout, near: usize) -> bool {
        if !addr.is_multiple_of(new.align()) {
            return false;
        }
        let Some(size) = new.size().checked_next_multiple_of(self.page_size()) else {
            return false;
        };
        let resized = NODES.find_map(near, |arena| {
            let (block, dedicated) = arena.live_block(addr)?;
            Some(match arena.resize_carved(addr, size) {
                Some(populate) => Ok((arena.node(), block, populate)),
                None => Err((block, dedicated)),
            })
        });
        let fits = match resized {
            None => false,
            // Dedicated, or a carved block without room next to it.
            Some(Err((b, dedicated))) => {
                dedicated && new.size() <= b.capacity && new.size() >= b.capacity / 2
            }
            Some(Ok((node, old, populate))) => {
                CarvedPath { blocks: self }.populate_grown(node, old, populate)
            }
        };
        if fits {
            self.counters.in_place_reallocs.incr();
        }
        fits
    }

    /// Grows the live block at `addr` to `new` when no cached block fits the new size: its pages
    /// move into a larger mapping whose tail is placed and populated (see
    /// [`DedicatedPath::grow_block`]), so a growing `Vec` leaves no smaller blocks behind and is never
    /// copied. Only for unpinned dedicated blocks without GPU work recorded (a registration is
    /// tied to the address), in `target`'s arena. `None`: move by copying instead (also when a
    /// cached block it could grow into fits, [`Fit::for_growth`](crate::arena::Fit::for_growth): reuse comes first).
    pub(crate) fn grow_without_copy(
        &self,
        addr: usize,
        new: Layout,
        target: &Resolved,
    ) -> Option<NonNull<u8>> {
        // Refused under `pin=strict`: so is, and counted, the move that follows.
        let dedicated_path = DedicatedPath { blocks: self };
        let (capacity, fit) = dedicated_path.fit(new, self.kind(target).ok()?)?;
        let node = target.host_node;
        let old = {
            let mut arena = NODES.lock(node)?;
            if arena.holds_fit(fit.for_growth()) {
                return None;
            }
            arena.take_growable(addr, fit.kind, capacity)?
        };
        let sizes = (new.size(), capacity);
        let grown = dedicated_path.grow_block(old, sizes, fit.align, &target.nodes);
        let (moved, dedicated) = match grown {
            Ok(grown) => (true, grown),
            // Still where it was: a failed grow moves nothing.
            Err(old) => (false, old),
        };
        // Live again, grown or not: its room was kept (`Arena::take_growable`), so it is
        // recorded. Were it not, it holds the user's data: it stays mapped, unrecorded, rather
        // than released.
        let new_addr = dedicated.block.addr;
        let limit = self.settings.cache_limit;
        let recorded =
            self.with_arena(node, |arena, out| arena.return_grown(dedicated, limit, out));
        if let Some(Err(unrecorded)) = recorded {
            unrecorded.leave_mapped();
        }
        if !moved {
            return None;
        }
        // Counted as a move: a new block (a miss) and the old one freed.
        self.counters.record_request(new.size());
        for counter in [
            &self.counters.cache_misses,
            &self.counters.frees,
            &self.counters.grown_without_copy,
        ] {
            counter.incr();
        }
        NonNull::new(new_addr as *mut u8)
    }

    /// Gives back everything idle in every node's arena: free ranges purged, wholly free chunks
    /// and cached dedicated blocks released, pending blocks whose GPU work completed too.
    pub(crate) fn trim(&self) {
        for arena in NODES.arenas() {
            loop {
                let mut out = Released::default();
                let (node, done) = {
                    let mut arena = arena.lock();
                    (arena.node(), arena.trim(&mut out))
                };
                self.finish(node, &mut out);
                if done {
                    break;
                }
            }
        }
    }

    /// Attaches `work` to the live block containing `addr` (anywhere inside it): when the block
    /// is freed before `work` completed, it waits in the pending list instead of the cache.
    /// Gives `work` back when no live block contains `addr`.
    pub(crate) fn record_in_flight(
        &self,
        addr: usize,
        work: Box<dyn InFlight>,
        near: usize,
    ) -> Result<(), Box<dyn InFlight>> {
        let mut work = Some(work);
        let recorded = NODES.find_map(near, |arena| {
            match arena.record_in_flight(addr, work.take()?) {
                Ok(()) => Some(()),
                Err(back) => {
                    work = Some(back);
                    None
                }
            }
        });
        match (recorded, work) {
            (None, Some(work)) => Err(work),
            _ => {
                self.counters.in_flight_recorded.incr();
                Ok(())
            }
        }
    }
}
