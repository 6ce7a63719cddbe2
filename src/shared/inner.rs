//! What a pool's handle and its background registration share, and the detach when both are gone.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::pool::Pool;
use crate::stats::Counters;
use crate::sys;

/// What the pool's handle and its background registration share; dropped (detached) when both
/// are gone: the pool's memory unregisters this process's registrations of its chunks, then
/// unmaps it, and the file is closed with its last mapping.
pub(super) struct Inner {
    pub(super) pool: Pool,
    pub(super) path: Option<PathBuf>,
    /// The process that attached (and counted itself in the header), and its fork generation.
    pub(super) attached_by: (u32, u32),
    /// How long this process waits for a lock of the pool another holds.
    pub(super) lock_wait: Duration,
    /// What the placer did for this process: the creator's placement, populate and page
    /// check, and this process's registrations.
    pub(super) counters: Counters,
}

impl Inner {
    /// Whether this is a forked child's copy of another process's attachment: the child was not
    /// counted in the header, and its registrations are the parent's (CUDA is unusable here).
    /// The fork generation tells a child even where the pid of a gone ancestor was reused; the
    /// pid, even where the crate's fork handlers were not linked in.
    pub(super) fn inherited(&self) -> bool {
        self.inherited_by(sys::process_id())
    }

    /// [`Self::inherited`] in process `pid` (this process's id, which the caller has at hand).
    pub(super) fn inherited_by(&self, pid: u32) -> bool {
        self.attached_by != (pid, crate::fork::generation())
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
        // Counted off while the header is mapped; the pool's memory then unregisters each of
        // them, then unmaps, as it drops (a range the driver refuses keeps it mapped).
        let (held, _) = self.pool.memory().registered();
        let header = self.pool.header();
        header
            .registrations
            .fetch_sub(held as u64, Ordering::AcqRel);
        self.pool.header().attached.fetch_sub(1, Ordering::AcqRel);
    }
}
