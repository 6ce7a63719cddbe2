//! Attaching to a pool: with other than the defaults (the owners and modes trusted, the lock
//! wait), the trust check of a file at a path (no symbolic link followed, its owner and mode),
//! and the checks of the file that make it this process's [`SharedPool`] (its length, its pages
//! all there, its header, its pages on its node).

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{io_error, shown, SharedPool};
use crate::pool::extents::MAX_ALIGN;
use crate::pool::{self, Pool, DATA_START};
use crate::stats::Counters;
use crate::sys;
use crate::Error;

/// How long attaching waits for a live creator to finish populating (only a pool of an older
/// layout, or one whose header was changed, is ever seen unfinished: a pool is linked into its
/// path once it is ready).
const READY_WAIT: Duration = Duration::from_secs(60);

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

    /// Attaches to the pool at `path`, once its file passed the trust check. A symbolic link
    /// at `path` is refused, not followed (`O_NOFOLLOW`): another user may have planted it
    /// where the sticky bit does not protect links (`fs.protected_symlinks`).
    ///
    /// # Errors
    /// As [`SharedPool::attach`].
    pub fn attach(&self, path: impl AsRef<Path>) -> Result<SharedPool, Error> {
        let path = path.as_ref();
        let uid = sys::effective_uid();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP)
                    if std::fs::symlink_metadata(path)
                        .is_ok_and(|m| m.file_type().is_symlink()) =>
                {
                    Error::PoolSymlink { path: path.into() }
                }
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
        self.attach_file(file, Some(path.to_path_buf()))
    }

    /// Attaches to the pool whose file `fd` is (inherited, or from [`SharedPool::receive`]).
    /// A descriptor is trusted as its sender is: no owner or mode check.
    ///
    /// # Errors
    /// As [`SharedPool::attach_fd`].
    pub fn attach_fd(&self, fd: OwnedFd) -> Result<SharedPool, Error> {
        self.attach_file(File::from(fd), None)
    }

    /// Attaches to the pool whose file `file` is (at `path`, if it has one), once trusted: checks
    /// it is a whole, ready pool of this build with its pages on its node, and counts this
    /// process in. A file whose pages are not all there is refused before it is mapped: the
    /// page check would allocate them (a sparse file of any size fills its filesystem).
    fn attach_file(&self, file: File, path: Option<PathBuf>) -> Result<SharedPool, Error> {
        let shown_path = path.clone().unwrap_or_else(|| shown(None, &file.as_fd()));
        // Before reading it: a descriptor that cannot be read would look like no pool.
        pool::check_access(file.as_fd(), &shown_path)?;
        let meta = file.metadata().map_err(|e| io_error(path.as_deref(), &e))?;
        let len = meta.len() as usize;
        let mut magic = [0; 8];
        // At offset 0 whatever the file's position: an inherited descriptor shares its
        // position with every process holding it.
        // A file shorter than that is not a pool: its zeros are no magic.
        let _ = file.read_exact_at(&mut magic, 0);
        // In this machine's byte order, as the creator's atomic store wrote it.
        pool::check_magic(u64::from_ne_bytes(magic), &shown_path)?;
        if len < DATA_START + MAX_ALIGN as usize {
            return Err(Error::PoolCorrupt {
                path: shown_path,
                reason: "the file is shorter than a pool's header and one block (truncated)",
            });
        }
        if !len.is_multiple_of(MAX_ALIGN as usize) {
            return Err(Error::PoolCorrupt {
                path: shown_path,
                reason: "its file's length is not a multiple of 2 MiB, as every pool's is \
                         (truncated, or written past its end)",
            });
        }
        // `st_blocks` counts 512-byte units allocated; the header's chunk is allocated only
        // where written.
        let (allocated, needed) = (meta.blocks().saturating_mul(512), (len - DATA_START) as u64);
        if allocated < needed {
            return Err(Error::PoolSparse {
                path: shown_path,
                allocated,
                needed,
            });
        }
        let fd = OwnedFd::from(file);
        let (mapping, file) = pool::map(fd, len, &shown_path)?;
        let pool = Pool::check(mapping, file, shown_path.clone())?;
        let header = pool.header();
        let start = Instant::now();
        while !pool.ready() {
            if !sys::process_alive(header.creator) {
                return Err(Error::PoolStale {
                    path: shown_path,
                    pid: header.creator,
                });
            }
            if start.elapsed() > READY_WAIT {
                return Err(Error::PoolCorrupt {
                    path: shown_path,
                    reason: "its creator has not finished making it in 60 s",
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Admits the extent table (rebuilt if it does not hold together), or names the
        // process that holds the lock past the wait.
        drop(pool.lock(self.lock_wait, sys::process_id())?);
        pool.map_in_pages();
        pool.check_node(DATA_START, len - DATA_START, header.node as usize, false)?;
        header.attached.fetch_add(1, Ordering::AcqRel);
        Ok(SharedPool::new(
            pool,
            path,
            self.lock_wait,
            Counters::default(),
        ))
    }
}
