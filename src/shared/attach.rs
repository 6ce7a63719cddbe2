//! Attaching with other than the defaults: the owners and modes trusted, the lock wait.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use super::{io_error, SharedPool};
use crate::sys;
use crate::Error;

/// How to attach to a [`SharedPool`] by path or descriptor ([`SharedPool::attacher`]): whom to
/// trust beyond this process's user and root, and how long to wait for the pool's locks.
#[derive(Clone, Debug)]
pub struct PoolAttach {
    pub(super) owners: Vec<u32>,
    pub(super) mode: u32,
    pub(super) lock_wait: Duration,
}

impl PoolAttach {
    /// Trusts a pool file owned by user `uid` too (by default only one of this process's
    /// effective user, or root's).
    pub fn allow_owner(mut self, uid: u32) -> Self {
        self.owners.push(uid);
        self
    }

    /// Trusts a pool file whose permission bits are within `mode` (by default 0o755: none that
    /// lets its group or others write it). `allow_mode(0o666)` accepts a pool every user may
    /// write: any of them may then change it under this process.
    pub fn allow_mode(mut self, mode: u32) -> Self {
        self.mode = mode;
        self
    }

    /// How long to wait for a lock of the pool another process holds (default 30 s): at
    /// attach, and for each chunk's registration, before [`Error::PoolLockHeld`].
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// Attaches to the pool at `path`, once its file passed the trust check.
    ///
    /// # Errors
    /// As [`SharedPool::attach`].
    pub fn attach(&self, path: impl AsRef<Path>) -> Result<SharedPool, Error> {
        let path = path.as_ref();
        let uid = sys::effective_uid();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EACCES | libc::EPERM) => {
                    let meta = std::fs::metadata(path).ok();
                    Error::PoolPermission {
                        path: path.into(),
                        owner: meta.as_ref().map(std::os::unix::fs::MetadataExt::uid),
                        mode: meta
                            .as_ref()
                            .map(|m| std::os::unix::fs::MetadataExt::mode(m) & 0o7777),
                        uid,
                    }
                }
                Some(libc::EROFS) => Error::PoolReadOnly { path: path.into() },
                _ => io_error(Some(path), &e),
            })?;
        let (owner, mode, regular) = sys::file_owner(file.as_fd())?;
        if !regular {
            return Err(Error::PoolForeign {
                path: path.into(),
                found: 0,
            });
        }
        let foreign_owner = owner != uid && owner != 0 && !self.owners.contains(&owner);
        let open_mode = mode & !self.mode & 0o7777 != 0;
        if foreign_owner || open_mode {
            return Err(Error::PoolUntrusted {
                path: path.into(),
                owner,
                mode,
                uid,
                foreign_owner,
                open_mode,
            });
        }
        SharedPool::attach_file(file, Some(path.to_path_buf()), self.lock_wait)
    }

    /// Attaches to the pool whose file `fd` is (inherited, or from [`SharedPool::receive`]).
    /// A descriptor is trusted as its sender is: no owner or mode check.
    ///
    /// # Errors
    /// As [`SharedPool::attach_fd`].
    pub fn attach_fd(&self, fd: OwnedFd) -> Result<SharedPool, Error> {
        SharedPool::attach_file(File::from(fd), None, self.lock_wait)
    }
}
