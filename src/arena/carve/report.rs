//! What the carver holds, read without changing it: the used range at an address, whole
//! regions, and the byte counts behind the arena's stats.

use super::*;

impl Carver {
    /// The Used range containing addr (anywhere inside), if any: O(log regions + ranges of that region).
    pub(crate) fn used_containing(&self, addr: usize) -> Option<Range> {
        let at = self.by_base.partition_point(|&r| self.base_of(r) <= addr);
        let region = *self.by_base.get(at.checked_sub(1)?)?;
        let Some(RegionSlot::Live { first, .. }) = self.regions.get(region as usize) else {
            return None;
        };
        let mut i = *first;
        while let Some(n) = self.node(i) {
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
        let Some(RegionSlot::Live { first, .. }) = self.regions.get(region as usize) else {
            return None;
        };
        let n = self.node(*first)?;
        (n.state == State::Free && n.phys_next == NONE).then_some(n.stamp)
    }

    /// The live regions in address order: (id, base, len).
    pub(crate) fn regions(&self) -> impl Iterator<Item = (RegionId, usize, usize)> + '_ {
        self.by_base
            .iter()
            .filter_map(|&id| match self.regions.get(id as usize) {
                Some(RegionSlot::Live { base, len, .. }) => Some((id, *base, *len)),
                _ => None,
            })
    }

    /// Removes a wholly free region, returning (base, len); None (nothing changed) otherwise. NEVER ALLOCATES.
    pub(crate) fn remove_region(&mut self, region: RegionId) -> Option<(usize, usize)> {
        self.wholly_free(region)?;
        let slot = self.regions.get_mut(region as usize)?;
        let RegionSlot::Live { base, len, first } = mem::replace(
            slot,
            RegionSlot::Vacant {
                next: self.vacant_region,
            },
        ) else {
            return None;
        };
        self.vacant_region = region;
        self.delist(first);
        self.vacate(first);
        if let Some(at) = self.by_base.iter().position(|&r| r == region) {
            self.by_base.remove(at);
        }
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
                let Some(RegionSlot::Live { first, .. }) = self.regions.get(region as usize) else {
                    return None;
                };
                let n = self.node(*first)?;
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
        if let Some(top) = u64::BITS.checked_sub(1 + self.first.leading_zeros()) {
            let second = self.second.get(top as usize).copied().unwrap_or(0);
            if let Some(sl) = u32::BITS.checked_sub(1 + second.leading_zeros()) {
                let mut i = self.head(top as usize * SL_COUNT + sl as usize);
                while let Some(n) = self.node(i) {
                    stats.largest_free = stats.largest_free.max(n.size);
                    i = n.free_next;
                }
            }
        }
        stats
    }
}
