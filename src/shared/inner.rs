//! What a pool's handle and its background registration share, and the detach when both are gone.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::pool::pinning::Pinned;
use crate::pool::PoolMap;
use crate::sys;

/// What the pool's handle and its background registration share; dropped (detached) when both
/// are gone: unregistered, then unmapped, then the file closed.
pub(super) struct Inner {
    pub(super) pinned: Pinned,
    pub(super) map: PoolMap,
    pub(super) fd: OwnedFd,
    pub(super) path: Option<PathBuf>,
    /// The process that attached (and counted itself in the header), and its fork generation.
    pub(super) attached_by: (u32, u32),
    /// How long this process waits for a lock of the pool another holds.
    pub(super) lock_wait: Duration,
}

impl Inner {
    /// Whether this is a forked child's copy of another process's attachment: the child was not
    /// counted in the header, its registrations are the parent's (CUDA is unusable here), and
    /// their list's locks may have been held by a parent's thread at the fork. The fork
    /// generation tells a child even where the pid of a gone ancestor was reused; the pid, even
    /// where the crate's fork handlers were not linked in.
    pub(super) fn inherited(&self) -> bool {
        self.attached_by != (sys::process_id(), crate::fork::generation())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.inherited() {
            // Only the child's own mapping goes; the count and the registrations are the
            // parent's.
            return;
        }
        if !self.pinned.release(&self.map) {
            self.map.keep_mapped();
        }
        self.map.header().attached.fetch_sub(1, Ordering::AcqRel);
    }
}
