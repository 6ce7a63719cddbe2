//! The arena's rows of the stats: per node, and per kind of chunk.

use super::{Arena, Heap};
use crate::chunk::Chunk;
use crate::stats::{HeapStats, NodeStats};

impl Arena {
    /// Fills in this node's row.
    pub(crate) fn fill(&self, row: &mut NodeStats) {
        row.live_bytes = self.live_bytes;
        row.peak_live_bytes = self.peak_live_bytes;
        row.live_blocks = self.live.len();
        row.pending_bytes = self.pending.bytes();
        row.pending_blocks = self.pending.len();
        let mut heaps = HeapStats::default();
        for heap in &self.heaps {
            heaps.add(&self.heap_stats(heap));
        }
        row.cached_bytes = heaps.free_bytes + self.cached.bytes();
        row.cached_blocks = heaps.free_ranges + self.cached.len();
        row.pinned_bytes = heaps.pinned_bytes + self.pinned_dedicated;
        row.chunks = heaps.chunks;
        row.mapped_bytes = heaps.mapped_bytes;
        row.resident_bytes = heaps.resident_bytes;
        row.free_bytes = heaps.free_bytes;
        row.free_ranges = heaps.free_ranges;
        row.largest_free = heaps.largest_free;
        row.registrations = heaps.registrations;
        row.purged_bytes = heaps.purged_bytes;
        row.decay_released = self.decay_released;
    }

    /// One row per kind of chunk this arena holds.
    pub(crate) fn heap_rows(&self) -> impl Iterator<Item = HeapStats> + '_ {
        self.heaps.iter().map(|heap| self.heap_stats(heap))
    }

    pub(super) fn heap_stats(&self, heap: &Heap) -> HeapStats {
        let carver = heap.carver.stats();
        let resident: usize = heap.chunks.iter().flatten().map(Chunk::resident).sum();
        HeapStats {
            node: self.node,
            policy: heap.key.kind.policy,
            pinned: heap.key.kind.pinned,
            huge_pages: heap.key.huge,
            reserved: heap.key.reserved,
            chunks: carver.regions,
            mapped_bytes: carver.region_bytes,
            resident_bytes: resident,
            pinned_bytes: if heap.key.kind.pinned {
                carver.region_bytes
            } else {
                0
            },
            free_bytes: carver.free_bytes,
            free_ranges: carver.free_ranges,
            largest_free: carver.largest_free,
            chunks_made: heap.chunks_made,
            registrations: heap.registrations,
            purged_bytes: heap.purged,
        }
    }
}
