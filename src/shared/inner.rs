//! What a pool's handle and its background registration share, and the detach when both are gone.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::pool::Pool;
use crate::sys;

/// What the pool's handle and its background registration share; dropped (detached) when both
/// are gone: this process's registrations of the pool's chunks are released, then the mapping
/// (both by the pool's memory, in that order), and the file is closed with the last mapping.
pub(super) struct Inner {
    pub(super) pool: Pool,
    pub(super) path: Option<PathBuf>,
    /// The process that attached (and counted itself in the header), and its fork generation.
    pub(super) attached_by: (u32, u32),
    /// How long this process waits for a lock of the pool another holds.
    pub(super) lock_wait: Duration,
}

impl Inner {
    /// Whether this is a forked child's copy of another process's attachment: the child was not
    /// counted in the header, and its registrations are the parent's (CUDA is unusable here).
    /// The fork generation tells a child even where the pid of a gone ancestor was reused; the
    /// pid, even where the crate's fork handlers were not linked in.
    pub(super) fn inherited(&self) -> bool {
        self.attached_by != (sys::process_id(), crate::fork::generation())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.inherited() {
            // Only the child's own mapping goes; the count and the registrations are the
            // parent's.
            self.pool.memory_mut().disown();
            return;
        }
        // Unregistered now, while the header is mapped to count them; a range the driver
        // refused keeps the whole mapping in place when the memory drops.
        if let Some(released) = self.pool.memory_mut().unregister() {
            let header = self.pool.header();
            header
                .registrations
                .fetch_sub(released.ranges as u64, Ordering::AcqRel);
        }
        self.pool.header().attached.fetch_sub(1, Ordering::AcqRel);
    }
}
