//! The side table of range records, and the lists threaded through it: each region's physical
//! list (address order), one list per size class with its bitmaps, the idle list (oldest stamp
//! first), and the chain of vacant slots. Links are u32 indices with `NONE` for none, and every
//! access goes through `get`, so a bad index ends a walk instead of panicking.
//!
//! **Search: TLSF** (two-level segregated fit). Free ranges sit in one list per size class:
//! the first level is the power of two of the size in quanta, the second splits each power of
//! two in 32 (below 64 quanta every size has a class of its own), and two levels of bitmaps
//! find the first non-empty class at or above a class in O(1). A request of `size` at `align`
//! needs at most `align - quantum` bytes of padding (free ranges start at multiples of the
//! quantum); it is rounded up to the next class boundary, so the head of any class found fits
//! (good fit). Only when that finds nothing are the lists below it scanned for a range that
//! fits anyway (exactly, or thanks to its alignment): a carve fails only when nothing fits.

use std::mem;

use super::regions::Regions;
use super::{CarverStats, Handle, NoRoom, RegionId, NONE};

/// 32 second-level classes per power of two: a class's ranges differ by at most 1/32.
const SL_LOG2: u32 = 5;
pub(super) const SL_COUNT: usize = 1 << SL_LOG2;
/// First level 0 holds sizes below 32 quanta one per class; level `l` holds `[2^(l+4), 2^(l+5))`.
pub(super) const FL_COUNT: usize = (usize::BITS - SL_LOG2 + 1) as usize;
pub(super) const CLASSES: usize = FL_COUNT * SL_COUNT;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    Free,
    Used,
    /// A released slot, chained through `free_next`.
    Vacant,
}

/// One range: its place in its region, in its size class's list and in the idle list (56 bytes
/// on 64-bit targets).
#[derive(Clone, Copy, Debug)]
pub(super) struct Node {
    pub(super) start: usize,
    pub(super) size: usize,
    /// When a free range last became free or grew by a merge; a used range keeps the stamp of
    /// the free range it came from.
    pub(super) stamp: u64,
    pub(super) region: RegionId,
    /// Address order within the region.
    pub(super) phys_prev: u32,
    pub(super) phys_next: u32,
    /// The size class's list (Free), or the chain of vacant slots (`free_next`, Vacant).
    pub(super) free_prev: u32,
    pub(super) free_next: u32,
    /// Oldest stamp first; only dirty free nodes are linked, unpurgeable ones excepted.
    pub(super) idle_prev: u32,
    pub(super) idle_next: u32,
    pub(super) state: State,
    /// The memory may be resident.
    pub(super) dirty: bool,
    /// Dirty, and its purge failed (`MADV_DONTNEED` refuses locked memory): kept out of the
    /// idle list, so that decay does not try it again and again, until it merges with another
    /// range.
    pub(super) unpurgeable: bool,
}

impl Node {
    pub(super) fn free(
        start: usize,
        size: usize,
        region: RegionId,
        dirty: bool,
        stamp: u64,
    ) -> Node {
        Node {
            start,
            size,
            stamp,
            region,
            phys_prev: NONE,
            phys_next: NONE,
            free_prev: NONE,
            free_next: NONE,
            idle_prev: NONE,
            idle_next: NONE,
            state: State::Free,
            dirty,
            unpurgeable: false,
        }
    }

    /// Whether a free node is in the idle list: dirty, and not known to be unpurgeable.
    pub(super) fn idle(&self) -> bool {
        self.dirty && !self.unpurgeable
    }
}

/// Where a dirty range goes in the idle list.
#[derive(Clone, Copy)]
pub(super) enum Idle {
    /// By its stamp, walking back from the tail.
    Sorted,
    /// Right after this node (at the head for `NONE`): the caller knows the order holds.
    After(u32),
}

/// The class of a free range of `units` quanta: the ranges in it hold at least its lower bound.
pub(super) fn class_of(units: usize) -> usize {
    if units < SL_COUNT {
        return units;
    }
    let log = usize::BITS - 1 - units.leading_zeros();
    let shift = log - SL_LOG2;
    (shift as usize + 1) * SL_COUNT + ((units >> shift) - SL_COUNT)
}

/// The smallest class whose lower bound is at least `units`: every range in it holds `units`.
pub(super) fn class_at_least(units: usize) -> Option<usize> {
    if units < SL_COUNT {
        return Some(units);
    }
    let log = usize::BITS - 1 - units.leading_zeros();
    let step = 1usize << (log - SL_LOG2);
    units.checked_add(step - 1).map(class_of)
}

/// The padding before `size` bytes at a multiple of `align` in `node`, if they fit.
fn fit(node: &Node, size: usize, align: usize) -> Option<usize> {
    let pad = node.start.checked_next_multiple_of(align)? - node.start;
    (pad.checked_add(size)? <= node.size).then_some(pad)
}

/// The carver's ranges: the side table, and the lists threaded through it.
pub(super) struct Nodes {
    /// Released slots are chained from `vacant_node` through `free_next`, and reused.
    pub(super) slots: Vec<Node>,
    pub(super) vacant_node: u32,
    pub(super) vacant_nodes: usize,
    /// Sizes are classed in quanta: `size >> shift`.
    pub(super) shift: u32,
    /// Bit `f`: some class of first level `f` is non-empty; `second[f]` bit `s`: class `(f, s)` is.
    pub(super) first: u64,
    pub(super) second: [u32; FL_COUNT],
    pub(super) heads: [u32; CLASSES],
    pub(super) idle_head: u32,
    pub(super) idle_tail: u32,
}

impl Nodes {
    /// An empty table for ranges in quanta of `1 << shift` bytes. Allocates nothing.
    pub(super) const fn new(shift: u32) -> Nodes {
        Nodes {
            slots: Vec::new(),
            vacant_node: NONE,
            vacant_nodes: 0,
            shift,
            first: 0,
            second: [0; FL_COUNT],
            heads: [NONE; CLASSES],
            idle_head: NONE,
            idle_tail: NONE,
        }
    }

    pub(super) fn node(&self, i: u32) -> Option<&Node> {
        self.slots.get(i as usize)
    }

    pub(super) fn node_mut(&mut self, i: u32) -> Option<&mut Node> {
        self.slots.get_mut(i as usize)
    }

    /// Slots in the table, vacant ones too.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// The node `handle` if it is the used range at `addr`: a stale pair names a node released
    /// (or reused) since, whose state or start differ.
    pub(super) fn used(&self, handle: Handle, addr: usize) -> Option<Node> {
        self.node(handle)
            .filter(|n| n.state == State::Used && n.start == addr)
            .copied()
    }

    /// Makes sure `count` nodes can be had without allocating.
    pub(super) fn reserve(&mut self, count: usize) -> Result<(), NoRoom> {
        let more = count.saturating_sub(self.vacant_nodes);
        if more == 0 {
            return Ok(());
        }
        // Indices stay below the NONE sentinel.
        if self.slots.len() + more > NONE as usize {
            return Err(NoRoom);
        }
        self.slots.try_reserve(more).map_err(|_| NoRoom)
    }

    /// A vacant slot or a new one (reserved before: never allocates).
    pub(super) fn add(&mut self, node: Node) -> u32 {
        if let Some(slot) = self.slots.get_mut(self.vacant_node as usize) {
            let i = self.vacant_node;
            self.vacant_node = slot.free_next;
            self.vacant_nodes -= 1;
            *slot = node;
            return i;
        }
        debug_assert!(self.slots.len() < self.slots.capacity());
        self.slots.push(node);
        (self.slots.len() - 1) as u32
    }

    pub(super) fn vacate(&mut self, i: u32) {
        let next = self.vacant_node;
        if let Some(n) = self.node_mut(i) {
            n.state = State::Vacant;
            n.free_next = next;
            self.vacant_node = i;
            self.vacant_nodes += 1;
        }
    }

    pub(super) fn phys_link_after(&mut self, at: u32, i: u32) {
        let next = self.node(at).map_or(NONE, |n| n.phys_next);
        if let Some(n) = self.node_mut(i) {
            n.phys_prev = at;
            n.phys_next = next;
        }
        if let Some(n) = self.node_mut(at) {
            n.phys_next = i;
        }
        if let Some(n) = self.node_mut(next) {
            n.phys_prev = i;
        }
    }

    pub(super) fn phys_link_before(&mut self, at: u32, i: u32, regions: &mut Regions) {
        let (prev, region) = self
            .node(at)
            .map_or((NONE, NONE), |n| (n.phys_prev, n.region));
        if let Some(n) = self.node_mut(i) {
            n.phys_prev = prev;
            n.phys_next = at;
        }
        if let Some(n) = self.node_mut(at) {
            n.phys_prev = i;
        }
        self.set_phys_next(prev, region, i, regions);
    }

    pub(super) fn phys_unlink(&mut self, i: u32, regions: &mut Regions) {
        let Some(&n) = self.node(i) else { return };
        self.set_phys_next(n.phys_prev, n.region, n.phys_next, regions);
        if let Some(next) = self.node_mut(n.phys_next) {
            next.phys_prev = n.phys_prev;
        }
    }

    /// Links `prev` to `next`, or makes `next` the region's first node when `prev` is NONE.
    fn set_phys_next(&mut self, prev: u32, region: RegionId, next: u32, regions: &mut Regions) {
        if let Some(p) = self.node_mut(prev) {
            p.phys_next = next;
        } else {
            regions.set_first(region, next);
        }
    }

    fn head(&self, class: usize) -> u32 {
        self.heads.get(class).copied().unwrap_or(NONE)
    }

    /// The first non-empty class at or above `class`.
    fn first_listed(&self, class: usize) -> Option<usize> {
        let (fl, sl) = (class / SL_COUNT, class % SL_COUNT);
        let here = self.second.get(fl)? & (u32::MAX << sl);
        if here != 0 {
            return Some(fl * SL_COUNT + here.trailing_zeros() as usize);
        }
        let above = self.first & u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0);
        let fl = above.trailing_zeros() as usize;
        let second = self.second.get(fl).copied().filter(|&s| s != 0)?;
        Some(fl * SL_COUNT + second.trailing_zeros() as usize)
    }

    /// A free node, and the padding before `size` bytes at `align` in it (see the module docs).
    pub(super) fn find(&self, size: usize, align: usize) -> Option<(u32, usize)> {
        let slack = align - (1 << self.shift);
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

    /// The largest free range's size, found in the top non-empty class's list.
    pub(super) fn largest_free(&self) -> usize {
        let mut largest = 0;
        if let Some(top) = u64::BITS.checked_sub(1 + self.first.leading_zeros()) {
            let second = self.second.get(top as usize).copied().unwrap_or(0);
            if let Some(sl) = u32::BITS.checked_sub(1 + second.leading_zeros()) {
                let mut i = self.head(top as usize * SL_COUNT + sl as usize);
                while let Some(n) = self.node(i) {
                    largest = largest.max(n.size);
                    i = n.free_next;
                }
            }
        }
        largest
    }

    /// Puts a free node in its class's list and, when dirty and not unpurgeable, in the idle
    /// list, and counts it.
    pub(super) fn enlist(&mut self, i: u32, place: Idle, stats: &mut CarverStats) {
        let Some(&n) = self.node(i) else { return };
        let class = class_of(n.size >> self.shift);
        let Some(head) = self.heads.get_mut(class) else {
            return;
        };
        let old = mem::replace(head, i);
        if let Some(n) = self.node_mut(i) {
            n.free_prev = NONE;
            n.free_next = old;
        }
        if let Some(o) = self.node_mut(old) {
            o.free_prev = i;
        }
        let (fl, sl) = (class / SL_COUNT, class % SL_COUNT);
        if let Some(second) = self.second.get_mut(fl) {
            *second |= 1 << sl;
            self.first |= 1 << fl;
        }
        stats.free_bytes += n.size;
        stats.free_ranges += 1;
        if n.dirty {
            stats.dirty_free_bytes += n.size;
        }
        if n.unpurgeable {
            stats.unpurgeable_bytes += n.size;
        }
        if n.idle() {
            let after = match place {
                Idle::After(after) => after,
                Idle::Sorted => self.idle_place(n.stamp),
            };
            self.idle_link_after(after, i);
        }
    }

    /// Takes a free node out of its lists and its counts; returns its predecessor in the idle
    /// list (NONE if it was the head or is not in it).
    pub(super) fn delist(&mut self, i: u32, stats: &mut CarverStats) -> u32 {
        let Some(&n) = self.node(i) else { return NONE };
        let class = class_of(n.size >> self.shift);
        if let Some(p) = self.node_mut(n.free_prev) {
            p.free_next = n.free_next;
        } else if let Some(head) = self.heads.get_mut(class) {
            *head = n.free_next;
        }
        if let Some(next) = self.node_mut(n.free_next) {
            next.free_prev = n.free_prev;
        }
        if self.head(class) == NONE {
            let (fl, sl) = (class / SL_COUNT, class % SL_COUNT);
            if let Some(second) = self.second.get_mut(fl) {
                *second &= !(1 << sl);
                if *second == 0 {
                    self.first &= !(1 << fl);
                }
            }
        }
        stats.free_bytes -= n.size;
        stats.free_ranges -= 1;
        if n.dirty {
            stats.dirty_free_bytes -= n.size;
        }
        if n.unpurgeable {
            stats.unpurgeable_bytes -= n.size;
        }
        if !n.idle() {
            return NONE;
        }
        match self.node_mut(n.idle_prev) {
            Some(p) => p.idle_next = n.idle_next,
            None => self.idle_head = n.idle_next,
        }
        match self.node_mut(n.idle_next) {
            Some(next) => next.idle_prev = n.idle_prev,
            None => self.idle_tail = n.idle_prev,
        }
        n.idle_prev
    }

    /// The idle node a range stamped `stamp` goes after: the last one not newer.
    fn idle_place(&self, stamp: u64) -> u32 {
        let mut at = self.idle_tail;
        while let Some(n) = self.node(at).filter(|n| n.stamp > stamp) {
            at = n.idle_prev;
        }
        at
    }

    fn idle_link_after(&mut self, after: u32, i: u32) {
        let next = match self.node(after) {
            Some(a) => a.idle_next,
            None => self.idle_head,
        };
        if let Some(n) = self.node_mut(i) {
            n.idle_prev = after;
            n.idle_next = next;
        }
        match self.node_mut(after) {
            Some(a) => a.idle_next = i,
            None => self.idle_head = i,
        }
        match self.node_mut(next) {
            Some(n) => n.idle_prev = i,
            None => self.idle_tail = i,
        }
    }
}
