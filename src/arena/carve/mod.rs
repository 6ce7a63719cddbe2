//! The carver: which parts of an arena's regions are handed out, which are free, and since when.
//!
//! A region is a chunk of address space the arena has mapped (and maybe placed and page-locked);
//! blocks of any size are carved from regions and merged back when freed. This module only does
//! the bookkeeping: no syscalls, no statics, no clock (time comes in as `now`, in milliseconds),
//! so it is tested alone, by sequences of random operations against a model.
//!
//! **Ranges.** Every range, free or used, is a node in a side table (`Vec<Node>`; released slots
//! are chained and reused). Nodes of a region form its physical list, in address order, tiling
//! the region exactly: a freed range merges with the free ranges beside it in that list, so two
//! regions that happen to be adjacent in the address space never merge, and no block straddles
//! two registrations. Merging only relinks and releases nodes, so the free path never allocates
//! (a free must succeed when the inner allocator is exhausted). The paths that may need new
//! nodes (`add_region`, a split in `carve` or `shrink_in_place`) reserve them with
//! `try_reserve` before anything changes, and fail with [`NoRoom`] with nothing changed.
//!
//! **Search: TLSF** (two-level segregated fit). Free ranges sit in one list per size class:
//! the first level is the power of two of the size in quanta, the second splits each power of
//! two in 32 (below 64 quanta every size has a class of its own), and two levels of bitmaps
//! find the first non-empty class at or above a class in O(1). A request of `size` at `align`
//! needs at most `align - quantum` bytes of padding (free ranges start at multiples of the
//! quantum); it is rounded up to the next class boundary, so the head of any class found fits
//! (good fit). Only when that finds nothing are the lists below it scanned for a range that
//! fits anyway (exactly, or thanks to its alignment): `carve` fails only when nothing fits.
//! A split leaves `[padding free][used][tail free]`.
//!
//! **Idle tracking.** Every free range has a stamp (when it last became free or grew by a
//! merge) and a dirty flag: its memory may be resident. Fresh regions may be added clean, and a
//! range purged by the caller is given back clean; anything freed by the user is dirty. Dirty
//! free ranges are also linked in an idle list, oldest stamp first, so that decay
//! ([`Carver::take_idle`]) finds the next one to purge in O(1). A merged range is dirty if any
//! part is; it takes the place of a dirty part with its stamp when there is one, else it is
//! inserted from the tail (O(1) while stamps do not decrease). A taken range whose purge failed
//! (locked memory) comes back dirty but unpurgeable, out of the idle list: decay and `trim()`
//! would otherwise take it again at once, forever. It is offered again once it merges with
//! another range (something was freed beside it); the pieces a carve leaves of it stay as they
//! were.

use std::mem;

#[cfg(test)]
mod check;
#[cfg(test)]
mod fuzz;
mod report;
mod table;
#[cfg(test)]
mod tests;

use table::{class_at_least, class_of, Idle, Node, State, CLASSES, FL_COUNT, NONE, SL_COUNT};

/// A node index: names a used range, and stays valid while the range is used.
pub(crate) type Handle = u32;
/// An index into the regions table; the slots of removed regions are reused.
pub(crate) type RegionId = u32;

/// A range handed out (or taken for purging).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) addr: usize,
    pub(crate) size: usize,
    pub(crate) region: RegionId,
    pub(crate) handle: Handle,
}

/// The side table could not grow (the inner allocator is exhausted); nothing was changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NoRoom;

/// Totals over all regions; every field but `largest_free` is kept as the ranges change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CarverStats {
    pub(crate) regions: usize,
    pub(crate) region_bytes: usize,
    /// Ranges handed out, and ranges taken by [`Carver::take_idle`] until they are given back.
    pub(crate) used_bytes: usize,
    pub(crate) used_ranges: usize,
    pub(crate) free_bytes: usize,
    pub(crate) free_ranges: usize,
    pub(crate) largest_free: usize,
    /// Free bytes whose memory may be resident (the idle list's, and the unpurgeable ones).
    pub(crate) dirty_free_bytes: usize,
    /// Of those, bytes whose purge failed ([`Carver::give_back_unpurged`]).
    pub(crate) unpurgeable_bytes: usize,
}

/// How a used range comes back ([`Carver::release`]).
#[derive(Clone, Copy)]
enum Back {
    /// Freed by the user at this time: dirty.
    Freed(u64),
    /// Purged: clean.
    Purged,
    /// Its purge failed: dirty, and unpurgeable unless it merges.
    Unpurged,
}

enum RegionSlot {
    Live {
        base: usize,
        len: usize,
        /// The node at `base`.
        first: u32,
    },
    Vacant {
        next: RegionId,
    },
}

/// The range allocator of one arena (see the module docs).
pub(crate) struct Carver {
    quantum: usize,
    shift: u32,
    nodes: Vec<Node>,
    vacant_node: u32,
    vacant_nodes: usize,
    regions: Vec<RegionSlot>,
    vacant_region: RegionId,
    /// Live region ids by base address, for finding the region holding an address.
    by_base: Vec<RegionId>,
    /// Bit `f`: some class of first level `f` is non-empty; `second[f]` bit `s`: class `(f, s)` is.
    first: u64,
    second: [u32; FL_COUNT],
    heads: [u32; CLASSES],
    idle_head: u32,
    idle_tail: u32,
    /// Kept as ranges change; `largest_free` is found when asked.
    stats: CarverStats,
}

/// The padding before `size` bytes at a multiple of `align` in `node`, if they fit.
fn fit(node: &Node, size: usize, align: usize) -> Option<usize> {
    let pad = node.start.checked_next_multiple_of(align)? - node.start;
    (pad.checked_add(size)? <= node.size).then_some(pad)
}

impl Carver {
    /// A carver for sizes and addresses in multiples of `quantum` (the page size; rounded up to a
    /// power of two). Allocates nothing.
    pub(crate) const fn new(quantum: usize) -> Carver {
        let quantum = match quantum.checked_next_power_of_two() {
            Some(q) => q,
            None => 1 << (usize::BITS - 1),
        };
        Carver {
            quantum,
            shift: quantum.trailing_zeros(),
            nodes: Vec::new(),
            vacant_node: NONE,
            vacant_nodes: 0,
            regions: Vec::new(),
            vacant_region: NONE,
            by_base: Vec::new(),
            first: 0,
            second: [0; FL_COUNT],
            heads: [NONE; CLASSES],
            idle_head: NONE,
            idle_tail: NONE,
            stats: CarverStats {
                regions: 0,
                region_bytes: 0,
                used_bytes: 0,
                used_ranges: 0,
                free_bytes: 0,
                free_ranges: 0,
                largest_free: 0,
                dirty_free_bytes: 0,
                unpurgeable_bytes: 0,
            },
        }
    }

    /// Adds [base, base+len) as one free range of a new region. clean: fresh memory, not in the idle list.
    ///
    /// `base` and `len` are multiples of the quantum, and the region overlaps no other (the
    /// caller mapped it).
    pub(crate) fn add_region(
        &mut self,
        base: usize,
        len: usize,
        now: u64,
        clean: bool,
    ) -> Result<RegionId, NoRoom> {
        debug_assert!(base.is_multiple_of(self.quantum) && len.is_multiple_of(self.quantum));
        debug_assert!(len > 0 && base.checked_add(len).is_some());
        self.reserve_nodes(1)?;
        let new_slot = self.vacant_region == NONE;
        if new_slot && self.regions.len() >= NONE as usize {
            return Err(NoRoom);
        }
        if new_slot {
            self.regions.try_reserve(1).map_err(|_| NoRoom)?;
        }
        self.by_base.try_reserve(1).map_err(|_| NoRoom)?;

        let id = if new_slot {
            self.regions.len() as RegionId
        } else {
            self.vacant_region
        };
        let node = self.new_node(Node::free(base, len, id, !clean, now));
        let slot = RegionSlot::Live {
            base,
            len,
            first: node,
        };
        if new_slot {
            self.regions.push(slot);
        } else if let Some(vacant) = self.regions.get_mut(id as usize) {
            if let RegionSlot::Vacant { next } = mem::replace(vacant, slot) {
                self.vacant_region = next;
            }
        }
        let at = self.by_base.partition_point(|&r| self.base_of(r) < base);
        debug_assert!(self
            .regions()
            .all(|(_, b, l)| b + l <= base || base + len <= b));
        self.by_base.insert(at, id);
        self.stats.regions += 1;
        self.stats.region_bytes += len;
        self.enlist(node, Idle::Sorted);
        Ok(id)
    }

    /// Carves `size` bytes at a multiple of `align`: Ok(None) when no free range fits (nothing changed).
    ///
    /// `size` is rounded up to a multiple of the quantum (0 counts as 1), which the range's size
    /// says; an `align` below the quantum means the quantum.
    pub(crate) fn carve(&mut self, size: usize, align: usize) -> Result<Option<Range>, NoRoom> {
        let align = align.max(self.quantum);
        debug_assert!(align.is_power_of_two());
        let Some(size) = self.round(size.max(1)) else {
            return Ok(None);
        };
        if !align.is_power_of_two() {
            return Ok(None);
        }
        let Some((i, pad)) = self.find(size, align) else {
            return Ok(None);
        };
        let Some(&n) = self.node(i) else {
            return Ok(None);
        };
        let tail = n.size - pad - size;
        self.reserve_nodes(usize::from(pad > 0) + usize::from(tail > 0))?;

        // Padding and tail take the source's place in the idle list: they have its stamp (and
        // stay unpurgeable if it was: their memory is the same).
        let piece = |start, size| Node {
            unpurgeable: n.unpurgeable,
            ..Node::free(start, size, n.region, n.dirty, n.stamp)
        };
        let mut after = self.delist(i);
        if pad > 0 {
            let p = self.new_node(piece(n.start, pad));
            self.phys_link_before(i, p);
            self.enlist(p, Idle::After(after));
            after = p;
        }
        if tail > 0 {
            let start = n.start + pad + size;
            let t = self.new_node(piece(start, tail));
            self.phys_link_after(i, t);
            self.enlist(t, Idle::After(after));
        }
        let range = self.make_used(i, n.start + pad, size);
        Ok(range)
    }

    /// Frees the Used range (handle, addr): merges with free neighbours in its region; the result is dirty,
    /// stamped `now`. Returns the freed range as it was handed out; None (nothing changed) if handle/addr
    /// do not name a Used range. NEVER ALLOCATES.
    ///
    /// The stamp is the latest of `now` and the merged neighbours' stamps.
    pub(crate) fn free(&mut self, handle: Handle, addr: usize, now: u64) -> Option<Range> {
        self.release(handle, addr, Back::Freed(now))
    }

    /// Like free, but the freed range counts as clean (not resident: the caller purged it); merged with
    /// dirty neighbours the result is dirty with their stamp. NEVER ALLOCATES.
    ///
    /// With clean neighbours only (or none) it stays clean and keeps the latest stamp of the parts:
    /// its own is the one it had when it was carved or taken (for [`Self::take_idle`]'s ranges,
    /// when it became idle), so [`Self::wholly_free`] tells how long the region has been idle.
    pub(crate) fn give_back_clean(&mut self, handle: Handle, addr: usize) -> Option<Range> {
        self.release(handle, addr, Back::Purged)
    }

    /// Gives back a range [`Self::take_idle`] took whose purge failed: dirty, with the stamp it
    /// had when it became idle, and out of the idle list, so that no later `take_idle` offers it
    /// again. Merged with a free neighbour (freed while it was purged) it is dirty and in the
    /// idle list again, with the latest stamp of the parts. NEVER ALLOCATES.
    pub(crate) fn give_back_unpurged(&mut self, handle: Handle, addr: usize) -> Option<Range> {
        self.release(handle, addr, Back::Unpurged)
    }

    /// Grows the Used range to new_size (> its size) into the free range right after it in its region, if
    /// that is large enough (splitting it; no new node needed). NEVER ALLOCATES. false: nothing changed.
    ///
    /// `new_size` is rounded up to the quantum; true means the range's size is now that (also
    /// when it already was).
    pub(crate) fn grow_in_place(&mut self, handle: Handle, addr: usize, new_size: usize) -> bool {
        let (Some(n), Some(new)) = (self.used(handle, addr), self.round(new_size)) else {
            return false;
        };
        if new <= n.size {
            return new == n.size;
        }
        let delta = new - n.size;
        let Some(&r) = self.node(n.phys_next).filter(|r| r.state == State::Free) else {
            return false;
        };
        if r.size < delta {
            return false;
        }
        let next = n.phys_next;
        let after = self.delist(next);
        if r.size == delta {
            self.phys_unlink(next);
            self.vacate(next);
        } else if let Some(rest) = self.node_mut(next) {
            // The rest keeps its stamp, so its place in the idle list too.
            rest.start += delta;
            rest.size -= delta;
            self.enlist(next, Idle::After(after));
        }
        if let Some(used) = self.node_mut(handle) {
            used.size = new;
        }
        self.stats.used_bytes += delta;
        true
    }

    /// Shrinks the Used range to new_size (< its size, > 0); the tail becomes free (merged with a free
    /// neighbour after it), dirty, stamped now.
    ///
    /// `new_size` is rounded up to the quantum; Ok(true) means the range's size is now that (also
    /// when it already was); Ok(false): not a used range, or not a shrink. A new node is needed
    /// only when the range after it is not free: Err(NoRoom) when it cannot be had.
    pub(crate) fn shrink_in_place(
        &mut self,
        handle: Handle,
        addr: usize,
        new_size: usize,
        now: u64,
    ) -> Result<bool, NoRoom> {
        let (Some(n), Some(new)) = (self.used(handle, addr), self.round(new_size)) else {
            return Ok(false);
        };
        if new_size == 0 || new > n.size {
            return Ok(false);
        }
        let delta = n.size - new;
        if delta == 0 {
            return Ok(true);
        }
        match self.node(n.phys_next).filter(|r| r.state == State::Free) {
            Some(&r) => {
                let next = n.phys_next;
                let after = self.delist(next);
                let stamp = r.stamp.max(now);
                let place = if r.idle() && r.stamp == stamp {
                    Idle::After(after)
                } else {
                    Idle::Sorted
                };
                if let Some(grown) = self.node_mut(next) {
                    grown.start -= delta;
                    grown.size += delta;
                    grown.dirty = true;
                    grown.unpurgeable = false;
                    grown.stamp = stamp;
                }
                self.enlist(next, place);
            }
            None => {
                self.reserve_nodes(1)?;
                let t = self.new_node(Node::free(addr + new, delta, n.region, true, now));
                self.phys_link_after(handle, t);
                self.enlist(t, Idle::Sorted);
            }
        }
        if let Some(used) = self.node_mut(handle) {
            used.size = new;
        }
        self.stats.used_bytes -= delta;
        Ok(true)
    }

    /// The oldest dirty free range (not unpurgeable) whose stamp <= idle_since, taken out of the
    /// free lists as Used (so no carve can hand it out while the caller purges it outside the
    /// arena lock; the caller then calls give_back_clean). None when there is none. NEVER
    /// ALLOCATES.
    pub(crate) fn take_idle(&mut self, idle_since: u64) -> Option<Range> {
        let i = self.idle_head;
        let n = *self.node(i).filter(|n| n.stamp <= idle_since)?;
        self.delist(i);
        self.make_used(i, n.start, n.size)
    }

    /// `size` rounded up to the quantum.
    fn round(&self, size: usize) -> Option<usize> {
        size.checked_next_multiple_of(self.quantum)
    }

    /// The node `handle` if it is the used range at `addr`: a stale pair names a node released
    /// (or reused) since, whose state or start differ.
    fn used(&self, handle: Handle, addr: usize) -> Option<Node> {
        self.node(handle)
            .filter(|n| n.state == State::Used && n.start == addr)
            .copied()
    }

    fn base_of(&self, region: RegionId) -> usize {
        match self.regions.get(region as usize) {
            Some(RegionSlot::Live { base, .. }) => *base,
            _ => 0,
        }
    }

    /// A free node, and the padding before `size` bytes at `align` in it.
    fn find(&self, size: usize, align: usize) -> Option<(u32, usize)> {
        let slack = align - self.quantum;
        let good = size
            .checked_add(slack)
            .and_then(|want| class_at_least(want >> self.shift))
            .and_then(|class| self.first_listed(class));
        if let Some(class) = good {
            let i = self.head(class);
            if let Some(pad) = self.node(i).and_then(|n| fit(n, size, align)) {
                return Some((i, pad));
            }
        }
        // Nothing in a class that surely fits: look for one that fits anyway, smallest first.
        let mut class = class_of(size >> self.shift);
        while let Some(listed) = self.first_listed(class) {
            let mut i = self.head(listed);
            while let Some(n) = self.node(i) {
                if let Some(pad) = fit(n, size, align) {
                    return Some((i, pad));
                }
                i = n.free_next;
            }
            class = listed + 1;
        }
        None
    }

    /// Turns the node into the used range [start, start+size).
    fn make_used(&mut self, i: u32, start: usize, size: usize) -> Option<Range> {
        let n = self.node_mut(i)?;
        n.state = State::Used;
        n.start = start;
        n.size = size;
        let range = Range {
            addr: start,
            size,
            region: n.region,
            handle: i,
        };
        self.stats.used_bytes += size;
        self.stats.used_ranges += 1;
        Some(range)
    }

    /// Frees a used range as `back` says, merging it with its free neighbours (see
    /// [`Self::free`], [`Self::give_back_clean`] and [`Self::give_back_unpurged`] for the
    /// stamps).
    fn release(&mut self, handle: Handle, addr: usize, back: Back) -> Option<Range> {
        let n = self.used(handle, addr)?;
        let range = Range {
            addr,
            size: n.size,
            region: n.region,
            handle,
        };
        let free_at = |i: u32| {
            self.node(i)
                .filter(|x| x.state == State::Free)
                .map(|x| (i, *x))
        };
        let (left, right) = (free_at(n.phys_prev), free_at(n.phys_next));
        let parts = || [left, right].into_iter().flatten().map(|(_, x)| x);
        let latest = || parts().map(|x| x.stamp).fold(n.stamp, u64::max);
        let (dirty, unpurgeable, stamp) = match back {
            Back::Freed(now) => (true, false, parts().map(|x| x.stamp).fold(now, u64::max)),
            Back::Purged => match parts().filter(|x| x.dirty).map(|x| x.stamp).max() {
                Some(stamp) => (true, false, stamp),
                None => (false, false, latest()),
            },
            // Alone it stays out of decay's way; merged, the whole is worth a purge again.
            Back::Unpurged => (true, parts().next().is_none(), latest()),
        };
        // A neighbour in the idle list with the result's stamp gives up its place there. It is
        // unlinked last, so that its predecessor there is still linked.
        let anchor = [left, right]
            .into_iter()
            .flatten()
            .find(|(_, x)| dirty && !unpurgeable && x.idle() && x.stamp == stamp)
            .map(|(i, _)| i);
        let order = if anchor.is_some() && anchor == left.map(|(i, _)| i) {
            [right, left]
        } else {
            [left, right]
        };
        let (mut start, mut size, mut place) = (n.start, n.size, Idle::Sorted);
        for (i, x) in order.into_iter().flatten() {
            let after = self.delist(i);
            if Some(i) == anchor {
                place = Idle::After(after);
            }
            self.phys_unlink(i);
            self.vacate(i);
            start = start.min(x.start);
            size += x.size;
        }
        let merged = self.node_mut(handle)?;
        merged.state = State::Free;
        merged.start = start;
        merged.size = size;
        merged.dirty = dirty;
        merged.unpurgeable = unpurgeable;
        merged.stamp = stamp;
        self.stats.used_bytes -= range.size;
        self.stats.used_ranges -= 1;
        self.enlist(handle, place);
        Some(range)
    }
}
