//! The process's fork generation: 0 in the process that loaded the crate, one more in each child
//! forked since (counted by the child fork handler, `process/`). The one record of whether this
//! process is a forked child.
//!
//! CUDA is unusable in a forked child: every cache of driver state (a retained context, a recorded
//! event, a buffer's event) stores the generation it was made in, and one made in an earlier
//! generation is left alone instead of handed to the driver.

use std::sync::atomic::{AtomicU32, Ordering};

/// Forks counted so far in this process's line.
static GENERATION: AtomicU32 = AtomicU32::new(0);

/// The current fork generation.
pub(crate) fn generation() -> u32 {
    // Relaxed: the value changes only in the child handler, before the child has other threads.
    GENERATION.load(Ordering::Relaxed)
}

/// Counts a fork; called once in each child, from the child fork handler.
pub(crate) fn count_fork_in_child() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
}
