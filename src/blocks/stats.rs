//! A value's share of the stats: the node rows from the process's arenas (read only where an
//! arena exists), the value's counters, and what the process's decay thread released (added to
//! every value's, as releases are counted the same way whoever releases).

use crate::process::NODES;
use crate::stats::{Counters, Stats};

/// The stats side of a value's large path.
pub(crate) struct ValueStats<'a> {
    pub(super) counters: &'a Counters,
}

impl ValueStats<'_> {
    /// Starts the peaks over: each node's (the arenas are the process's), this value's longest
    /// times and the decay thread's.
    pub(crate) fn reset_peaks(&self) {
        for arena in NODES.arenas() {
            arena.lock().reset_peak();
        }
        self.counters.reset_peaks();
        // Its longest times are added into every value's, as its releases are.
        if let Some(decay) = crate::process::decay::counters() {
            decay.reset_peaks();
        }
    }

    /// Fills the node rows of `stats` (and the GPU and heap rows they hold) from the arenas that
    /// exist, this value's counters, and what the decay thread released.
    pub(crate) fn fill(&self, stats: &mut Stats) {
        for row in &mut stats.nodes {
            // Read only the arenas that exist: creating one here would cost every later fork.
            if let Some(arena) = NODES.existing(row.node).map(|arena| arena.lock()) {
                arena.fill(row);
                stats.gpus.extend_from_slice(arena.gpus());
                stats.heaps.extend(arena.heap_rows());
            }
        }
        self.fill_counters(stats);
    }

    /// Copies this value's counters into `stats`, and adds what the decay thread released:
    /// released memory is counted the same way whoever released it. Allocates nothing (see
    /// `Counters::fill`).
    pub(crate) fn fill_counters(&self, stats: &mut Stats) {
        self.counters.fill(stats);
        if let Some(decay) = crate::process::decay::counters() {
            decay.add_releases(stats);
        }
    }
}
