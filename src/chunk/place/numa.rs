//! Whether an allocator value still places its memory with `mbind`, and why not.

use std::sync::atomic::{AtomicI32, Ordering::Relaxed};

use crate::Error;

/// Whether an allocator value still places with `mbind`: not when its topology could not be
/// read, nor once the kernel refused the call (seccomp). Kept per value: each reports what it
/// met, and a refusal a fault test injects stays with the value that met it.
#[derive(Debug)]
pub(crate) struct Numa {
    /// Why the topology could not be read (then blocks go unplaced).
    topology_error: Option<Error>,
    /// The errno with which the kernel refused `mbind` (0: never). An atomic rather than a
    /// `OnceLock`, which a fork during its initialisation would leave blocking in the child.
    mbind_refused: AtomicI32,
}

impl Numa {
    /// Placement with `topology_error` (`None`: the topology was read).
    pub(crate) fn new(topology_error: Option<Error>) -> Numa {
        Numa {
            topology_error,
            mbind_refused: AtomicI32::new(0),
        }
    }

    /// Whether blocks are still placed with `mbind`.
    pub(crate) fn placing(&self) -> bool {
        self.topology_error.is_none() && self.mbind_refused.load(Relaxed) == 0
    }

    /// Records that the kernel refused `mbind` with `errno`: later blocks go unplaced.
    pub(super) fn refuse(&self, errno: i32) {
        // The first refusal is the one reported; a zero errno would read as "never".
        let _ = self
            .mbind_refused
            .compare_exchange(0, errno.max(1), Relaxed, Relaxed);
    }

    /// Why NUMA placement is off, if it is.
    pub(crate) fn unavailable(&self) -> Option<Error> {
        self.topology_error.clone().or_else(|| self.refusal())
    }

    /// The kernel's refusal of `mbind` after initialisation, if any (no heap data: the exit
    /// report reads it).
    pub(crate) fn refusal(&self) -> Option<Error> {
        let errno = self.mbind_refused.load(Relaxed);
        (errno != 0).then_some(Error::NumaUnavailable {
            call: "mbind",
            errno,
        })
    }
}
