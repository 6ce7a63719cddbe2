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
//! **Search: TLSF** (two-level segregated fit, `table.rs`): free ranges sit in one list per
//! size class, found in O(1) by two levels of bitmaps; `carve` fails only when no free range
//! fits. A split leaves `[padding free][used][tail free]`.
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

#[cfg(test)]
mod check;
#[cfg(test)]
mod fuzz;
mod regions;
mod table;
#[cfg(test)]
mod tests;

use regions::Regions;
use table::{Idle, Node, Nodes, State};

/// "No node", "no region": the end of every list and chain.
const NONE: u32 = u32::MAX;

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

/// The range allocator of one arena (see the module docs).
pub(crate) struct Carver {
    quantum: usize,
    /// Every range, and the lists threaded through them (`table.rs`).
    nodes: Nodes,
    /// The regions, by id and by base address (`regions.rs`).
    regions: Regions,
    /// Kept as ranges change; `largest_free` is found when asked.
    stats: CarverStats,
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
            nodes: Nodes::new(quantum.trailing_zeros()),
            regions: Regions::new(),
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
        self.nodes.reserve(1)?;
        let id = self.regions.reserve()?;
        let node = self.nodes.add(Node::free(base, len, id, !clean, now));
        self.regions.insert(id, base, len, node);
        self.stats.regions += 1;
        self.stats.region_bytes += len;
        self.nodes.enlist(node, Idle::Sorted, &mut self.stats);
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
        let Some((i, pad)) = self.nodes.find(size, align) else {
            return Ok(None);
        };
        let Some(&n) = self.nodes.node(i) else {
            return Ok(None);
        };
        let tail = n.size - pad - size;
        self.nodes
            .reserve(usize::from(pad > 0) + usize::from(tail > 0))?;

        // Padding and tail take the source's place in the idle list: they have its stamp (and
        // stay unpurgeable if it was: their memory is the same).
        let piece = |start, size| Node {
            unpurgeable: n.unpurgeable,
            ..Node::free(start, size, n.region, n.dirty, n.stamp)
        };
        let mut after = self.nodes.delist(i, &mut self.stats);
        if pad > 0 {
            let p = self.nodes.add(piece(n.start, pad));
            self.nodes.phys_link_before(i, p, &mut self.regions);
            self.nodes.enlist(p, Idle::After(after), &mut self.stats);
            after = p;
        }
        if tail > 0 {
            let start = n.start + pad + size;
            let t = self.nodes.add(piece(start, tail));
            self.nodes.phys_link_after(i, t);
            self.nodes.enlist(t, Idle::After(after), &mut self.stats);
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
        let (Some(n), Some(new)) = (self.nodes.used(handle, addr), self.round(new_size)) else {
            return false;
        };
        if new <= n.size {
            return new == n.size;
        }
        let delta = new - n.size;
        let Some(&r) = self
            .nodes
            .node(n.phys_next)
            .filter(|r| r.state == State::Free)
        else {
            return false;
        };
        if r.size < delta {
            return false;
        }
        let next = n.phys_next;
        let after = self.nodes.delist(next, &mut self.stats);
        if r.size == delta {
            self.nodes.phys_unlink(next, &mut self.regions);
            self.nodes.vacate(next);
        } else if let Some(rest) = self.nodes.node_mut(next) {
            // The rest keeps its stamp, so its place in the idle list too.
            rest.start += delta;
            rest.size -= delta;
            self.nodes.enlist(next, Idle::After(after), &mut self.stats);
        }
        if let Some(used) = self.nodes.node_mut(handle) {
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
        let (Some(n), Some(new)) = (self.nodes.used(handle, addr), self.round(new_size)) else {
            return Ok(false);
        };
        if new_size == 0 || new > n.size {
            return Ok(false);
        }
        let delta = n.size - new;
        if delta == 0 {
            return Ok(true);
        }
        match self
            .nodes
            .node(n.phys_next)
            .filter(|r| r.state == State::Free)
        {
            Some(&r) => {
                let next = n.phys_next;
                let after = self.nodes.delist(next, &mut self.stats);
                let stamp = r.stamp.max(now);
                let place = if r.idle() && r.stamp == stamp {
                    Idle::After(after)
                } else {
                    Idle::Sorted
                };
                if let Some(grown) = self.nodes.node_mut(next) {
                    grown.start -= delta;
                    grown.size += delta;
                    grown.dirty = true;
                    grown.unpurgeable = false;
                    grown.stamp = stamp;
                }
                self.nodes.enlist(next, place, &mut self.stats);
            }
            None => {
                self.nodes.reserve(1)?;
                let t = self
                    .nodes
                    .add(Node::free(addr + new, delta, n.region, true, now));
                self.nodes.phys_link_after(handle, t);
                self.nodes.enlist(t, Idle::Sorted, &mut self.stats);
            }
        }
        if let Some(used) = self.nodes.node_mut(handle) {
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
        let i = self.nodes.idle_head;
        let n = *self.nodes.node(i).filter(|n| n.stamp <= idle_since)?;
        self.nodes.delist(i, &mut self.stats);
        self.make_used(i, n.start, n.size)
    }

    /// `size` rounded up to the quantum.
    fn round(&self, size: usize) -> Option<usize> {
        size.checked_next_multiple_of(self.quantum)
    }

    /// Turns the node into the used range [start, start+size).
    fn make_used(&mut self, i: u32, start: usize, size: usize) -> Option<Range> {
        let n = self.nodes.node_mut(i)?;
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
        let n = self.nodes.used(handle, addr)?;
        let range = Range {
            addr,
            size: n.size,
            region: n.region,
            handle,
        };
        let free_at = |i: u32| {
            self.nodes
                .node(i)
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
            let after = self.nodes.delist(i, &mut self.stats);
            if Some(i) == anchor {
                place = Idle::After(after);
            }
            self.nodes.phys_unlink(i, &mut self.regions);
            self.nodes.vacate(i);
            start = start.min(x.start);
            size += x.size;
        }
        let merged = self.nodes.node_mut(handle)?;
        merged.state = State::Free;
        merged.start = start;
        merged.size = size;
        merged.dirty = dirty;
        merged.unpurgeable = unpurgeable;
        merged.stamp = stamp;
        self.stats.used_bytes -= range.size;
        self.stats.used_ranges -= 1;
        self.nodes.enlist(handle, place, &mut self.stats);
        Some(range)
    }

    /// The Used range containing addr (anywhere inside), if any: O(log regions + ranges of that region).
    pub(crate) fn used_containing(&self, addr: usize) -> Option<Range> {
        let (region, first) = self.regions.at_or_below(addr)?;
        let mut i = first;
        while let Some(n) = self.nodes.node(i) {
            if addr < n.start {
                return None;
            }
            if addr - n.start < n.size {
                return (n.state == State::Used).then_some(Range {
                    addr: n.start,
                    size: n.size,
                    region,
                    handle: i,
                });
            }
            i = n.phys_next;
        }
        None
    }

    /// Whether the region is one free range, and its stamp.
    pub(crate) fn wholly_free(&self, region: RegionId) -> Option<u64> {
        let n = self.nodes.node(self.regions.first(region)?)?;
        (n.state == State::Free && n.phys_next == NONE).then_some(n.stamp)
    }

    /// The live regions in address order: (id, base, len).
    pub(crate) fn regions(&self) -> impl Iterator<Item = (RegionId, usize, usize)> + '_ {
        self.regions.iter()
    }

    /// Removes a wholly free region, returning (base, len); None (nothing changed) otherwise. NEVER ALLOCATES.
    pub(crate) fn remove_region(&mut self, region: RegionId) -> Option<(usize, usize)> {
        self.wholly_free(region)?;
        let (base, len, first) = self.regions.remove(region)?;
        self.nodes.delist(first, &mut self.stats);
        self.nodes.vacate(first);
        self.stats.regions -= 1;
        self.stats.region_bytes -= len;
        Some((base, len))
    }

    /// Bytes of the unpurgeable free ranges that are not a whole region (releasing a region
    /// gives its memory back anyway): O(regions).
    pub(crate) fn unpurgeable_bytes(&self) -> usize {
        let whole: usize = self
            .regions()
            .filter_map(|(region, _, len)| {
                let n = self.nodes.node(self.regions.first(region)?)?;
                (n.state == State::Free && n.phys_next == NONE && n.unpurgeable).then_some(len)
            })
            .sum();
        self.stats.unpurgeable_bytes.saturating_sub(whole)
    }

    /// Bytes of used ranges: O(1).
    pub(crate) fn used_bytes(&self) -> usize {
        self.stats.used_bytes
    }

    /// The totals: O(1), except `largest_free`, found in the top non-empty class's list.
    pub(crate) fn stats(&self) -> CarverStats {
        let mut stats = self.stats;
        stats.largest_free = stats.largest_free.max(self.nodes.largest_free());
        stats
    }
}
