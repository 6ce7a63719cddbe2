//! The arena's clock: milliseconds since the arena was made (the carvers' idle stamps, the
//! dedicated cache's), when idle memory is looked at next, and when a chunk's registration last
//! failed.

use std::time::Instant;

/// After a chunk's registration failed under `pin=on`, requests for page-locked blocks are served
/// unpinned for this long (milliseconds) before registering is tried again.
const REGISTRATION_RETRY_MS: u64 = 1000;

/// One arena's clock and the times it keeps.
pub(super) struct Clock {
    /// The arena's clock starts here.
    epoch: Instant,
    /// When idle memory is looked at next (arena milliseconds).
    pub(super) next_decay: u64,
    /// When a chunk's registration last failed (arena milliseconds).
    registration_failed_at: Option<u64>,
}

impl Clock {
    /// A clock starting now.
    pub(super) fn new() -> Clock {
        Clock {
            epoch: Instant::now(),
            next_decay: 0,
            registration_failed_at: None,
        }
    }

    /// Milliseconds since the arena was made.
    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether idle memory is to be looked at now: at most four times per `decay_ms` (the next
    /// time is set when it is).
    pub(super) fn decay_due(&mut self, decay_ms: u64) -> bool {
        let now = self.now();
        if now < self.next_decay {
            return false;
        }
        self.next_decay = now.saturating_add(decay_ms / 4);
        true
    }

    /// Records that a chunk's registration failed (under `pin=on`).
    pub(super) fn registration_failed(&mut self) {
        self.registration_failed_at = Some(self.now());
    }

    /// Whether a chunk's registration failed within the last [`REGISTRATION_RETRY_MS`].
    pub(super) fn registration_failed_lately(&self) -> bool {
        self.registration_failed_at
            .is_some_and(|at| self.now().saturating_sub(at) < REGISTRATION_RETRY_MS)
    }
}
