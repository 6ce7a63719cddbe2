//! Resizing large blocks without a copy: grown or shrunk in place, or moved by `mremap`.

use std::alloc::{GlobalAlloc, Layout};
use std::ptr::NonNull;

use super::NumaGpuAlloc;
use crate::guard::Inside;
use crate::process::NODES;
use crate::runtime::carved::carved;
use crate::runtime::route;

impl<A: GlobalAlloc> NumaGpuAlloc<A> {
    /// Grows a large block when no cached block fits the new size: its pages move into a larger
    /// mapping whose tail is placed and populated (see `Runtime::grow_block`), so a growing `Vec`
    /// leaves no smaller blocks behind and is never copied. Only for unpinned blocks without GPU
    /// work recorded (a registration is tied to the address), already where the calling thread's
    /// blocks go. `None`: move by copying instead (also when a cached block fits: reuse comes
    /// first).
    pub(super) fn grow_without_copy(&self, ptr: *mut u8, new: Layout) -> Option<NonNull<u8>> {
        let (Some(rt), Some(_inside)) = (self.initialised(), Inside::enter()) else {
            return None;
        };
        let target = route::target(rt);
        // Refused under `pin=strict`: so is, and counted, the move that follows.
        let (capacity, fit) = Self::fit(rt, new, rt.kind(&target).ok()?)?;
        if carved(capacity, fit.align) {
            return None;
        }
        let old = {
            let mut arena = rt.arena(target.host_node)?;
            if arena.holds_fit(fit) {
                return None;
            }
            let old = arena.growable(ptr as usize, fit.kind)?;
            // A block shrunk in place keeps its capacity: it may already be as large.
            if capacity <= old.capacity {
                return None;
            }
            // Out of the live set before its pages move: once `mremap` has moved them, another
            // thread may map a new block at this address and record it live.
            arena.remove_live(old.addr);
            old
        };
        // SAFETY: `old` was live, unpinned, without recorded GPU work, and the caller owns it
        // (reallocating it) while this runs.
        let Ok(grown) = (unsafe { rt.grow_block(old, capacity, fit.align, &target.nodes) }) else {
            // Still mapped where it was (a failed grow moves nothing).
            if let Some(mut arena) = rt.arena(old.node) {
                if !arena.insert_dedicated(old) {
                    // No room to record it: given back rather than lost track of.
                    drop(arena);
                    // SAFETY: it is ours (the caller's block, still where it was), and nobody can
                    // free it through the arena any more.
                    unsafe { rt.release_block(old) };
                }
            }
            return None;
        };
        // Counted as a move: a new block (a miss) and the old one freed.
        rt.counters.record_request(new.size());
        for counter in [
            &rt.counters.cache_misses,
            &rt.counters.frees,
            &rt.counters.grown_without_copy,
        ] {
            counter.incr();
        }
        // Its node's arena is the one the old block was found in: it is recorded (and the old
        // pages live there now, so there is nothing to give back if it were not).
        rt.record_created(grown);
        NonNull::new(grown.addr as *mut u8)
    }

    /// Resizes a live block where it lies: a carved block grows into the free range after it
    /// or gives its tail back; a dedicated one is kept when `new` fits its capacity without
    /// wasting more than half of it.
    pub(super) fn resize_in_place(&self, ptr: *mut u8, new: Layout) -> bool {
        let (Some(rt), Some(_inside)) = (self.initialised(), Inside::enter()) else {
            return false;
        };
        if !(ptr as usize).is_multiple_of(new.align()) {
            return false;
        }
        let Some(size) = new.size().checked_next_multiple_of(rt.page_size) else {
            return false;
        };
        let addr = ptr as usize;
        let resized = NODES.find_map(route::likely_node(rt), |arena| {
            let block = arena.live_block(addr)?;
            Some(match arena.resize_carved(addr, size) {
                Some(populate) => Ok((arena.node(), block, populate)),
                None => Err(block),
            })
        });
        let fits = match resized {
            None => false,
            // Dedicated, or a carved block without room next to it.
            Some(Err(b)) => {
                !carved(b.capacity, 0) && new.size() <= b.capacity && new.size() >= b.capacity / 2
            }
            Some(Ok((node, old, populate))) => rt.populate_grown(node, old, populate),
        };
        if fits {
            rt.counters.in_place_reallocs.incr();
        }
        fits
    }
}
