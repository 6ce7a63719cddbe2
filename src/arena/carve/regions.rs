//! The carver's regions: by id (the slots of removed regions chained and reused), and by base
//! address, for finding the region holding an address. Each live region names the first node
//! of its physical list (`table.rs` keeps the nodes).

use std::mem;

use super::{NoRoom, RegionId, NONE};

pub(super) enum RegionSlot {
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

/// The regions table and its index by base address.
pub(super) struct Regions {
    pub(super) slots: Vec<RegionSlot>,
    /// The first vacant slot (`NONE` for none), chained through `Vacant::next`.
    pub(super) vacant: RegionId,
    /// Live region ids by base address.
    pub(super) by_base: Vec<RegionId>,
}

impl Regions {
    pub(super) const fn new() -> Regions {
        Regions {
            slots: Vec::new(),
            vacant: NONE,
            by_base: Vec::new(),
        }
    }

    /// Makes room for one more region, and returns the id [`Self::insert`] will give it;
    /// `NoRoom` (nothing changed) when the tables cannot grow.
    pub(super) fn reserve(&mut self) -> Result<RegionId, NoRoom> {
        let new_slot = self.vacant == NONE;
        if new_slot && self.slots.len() >= NONE as usize {
            return Err(NoRoom);
        }
        if new_slot {
            self.slots.try_reserve(1).map_err(|_| NoRoom)?;
        }
        self.by_base.try_reserve(1).map_err(|_| NoRoom)?;
        Ok(if new_slot {
            self.slots.len() as RegionId
        } else {
            self.vacant
        })
    }

    /// Adds [base, base+len), whose physical list starts at node `first`, as region `id` (what
    /// [`Self::reserve`] returned just before: never allocates). It overlaps no other region.
    pub(super) fn insert(&mut self, id: RegionId, base: usize, len: usize, first: u32) {
        let slot = RegionSlot::Live { base, len, first };
        if self.vacant == NONE {
            self.slots.push(slot);
        } else if let Some(vacant) = self.slots.get_mut(id as usize) {
            if let RegionSlot::Vacant { next } = mem::replace(vacant, slot) {
                self.vacant = next;
            }
        }
        let at = self.by_base.partition_point(|&r| self.base_of(r) < base);
        debug_assert!(self
            .iter()
            .all(|(_, b, l)| b + l <= base || base + len <= b));
        self.by_base.insert(at, id);
    }

    /// Removes a live region, returning (base, len, first node); None (nothing changed)
    /// otherwise. Never allocates.
    pub(super) fn remove(&mut self, region: RegionId) -> Option<(usize, usize, u32)> {
        let slot = self.slots.get_mut(region as usize)?;
        let RegionSlot::Live { base, len, first } =
            mem::replace(slot, RegionSlot::Vacant { next: self.vacant })
        else {
            return None;
        };
        self.vacant = region;
        if let Some(at) = self.by_base.iter().position(|&r| r == region) {
            self.by_base.remove(at);
        }
        Some((base, len, first))
    }

    /// The first node of a live region.
    pub(super) fn first(&self, region: RegionId) -> Option<u32> {
        match self.slots.get(region as usize) {
            Some(RegionSlot::Live { first, .. }) => Some(*first),
            _ => None,
        }
    }

    /// Makes `node` the first of a live region's physical list.
    pub(super) fn set_first(&mut self, region: RegionId, node: u32) {
        if let Some(RegionSlot::Live { first, .. }) = self.slots.get_mut(region as usize) {
            *first = node;
        }
    }

    fn base_of(&self, region: RegionId) -> usize {
        match self.slots.get(region as usize) {
            Some(RegionSlot::Live { base, .. }) => *base,
            _ => 0,
        }
    }

    /// The live region with the highest base at or below `addr`, and its first node: O(log
    /// regions).
    pub(super) fn at_or_below(&self, addr: usize) -> Option<(RegionId, u32)> {
        let at = self.by_base.partition_point(|&r| self.base_of(r) <= addr);
        let region = *self.by_base.get(at.checked_sub(1)?)?;
        Some((region, self.first(region)?))
    }

    /// The live regions in address order: (id, base, len).
    pub(super) fn iter(&self) -> impl Iterator<Item = (RegionId, usize, usize)> + '_ {
        self.by_base
            .iter()
            .filter_map(|&id| match self.slots.get(id as usize) {
                Some(RegionSlot::Live { base, len, .. }) => Some((id, *base, *len)),
                _ => None,
            })
    }
}
