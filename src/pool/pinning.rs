//! This process's registrations of a shared pool: one `cuMemHostRegister` per chunk (a chunk
//! is at most the registration bound, and no block crosses one, so none straddles two), each
//! under the node-wide lock file so that two processes never register at the same moment, and
//! counted in the process's page-locked bytes and in the pool's header. Released (unregistered)
//! before the mapping goes: the pool's owner drops these first.
//!
//! Unsafe code here relies on every registered range lying inside the pool's mapping, which its
//! owner keeps mapped until [`Pinned::release`] ran.

use std::fs::{File, OpenOptions, Permissions};
use std::io::ErrorKind;
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{PoolMap, DATA_START};
use crate::chunk::{give_page_locked, take_page_locked, PinFlags};
use crate::cuda::Gpu;
use crate::sys::{self, lock::Lock};
use crate::Error;

/// The node-wide lock file: every process that registers a pool's chunks on `node` holds it
/// for each chunk's registration.
fn lock_path(node: usize) -> String {
    format!("/dev/shm/numa-gpu-alloc.register.node{node}.lock")
}

struct Registered {
    gpu: &'static Gpu,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a registration may be released from any thread (the context is pushed for the call).
unsafe impl Send for Registered {}

/// The chunks this process registered.
pub(crate) struct Pinned {
    /// Held through a whole registration (the wait for the node's lock file, which another
    /// process may hold for as long as its driver call takes, and this process's call), so that
    /// two threads of this process never register one chunk twice.
    registering: Lock<()>,
    /// The registered chunks, locked only to read or change the list: the pool's stats read
    /// it, and must not wait behind a registration.
    chunks: Lock<Vec<Registered>>,
}

impl Pinned {
    pub(crate) const fn new() -> Pinned {
        Pinned {
            registering: Lock::new(()),
            chunks: Lock::new(Vec::new()),
        }
    }

    /// The chunks of `map` (from its blocks' start), by index: offset and length.
    pub(crate) fn chunk_range(map: &PoolMap, index: usize) -> Option<(usize, usize)> {
        let chunk = map.chunk() as usize;
        let start = DATA_START.checked_add(index.checked_mul(chunk)?)?;
        (start < map.len()).then(|| (start, chunk.min(map.len() - start)))
    }

    /// Registers chunk `index` of `map` through `gpu`, holding the node's lock file, within
    /// `flags.limit` page-locked bytes; how long the driver call took (`None`: registered
    /// already).
    pub(crate) fn register(
        &self,
        map: &PoolMap,
        index: usize,
        gpu: &'static Gpu,
        flags: PinFlags,
    ) -> Result<Option<Duration>, Error> {
        let (offset, len) = Pinned::chunk_range(map, index).ok_or(Error::InvalidRange {
            addr: index,
            len: 0,
        })?;
        let ptr = NonNull::new(map.ptr().as_ptr().wrapping_add(offset))
            .ok_or(Error::InvalidRange { addr: offset, len })?;
        let _one_at_a_time = self.registering.lock();
        if self.chunks.lock().iter().any(|r| r.ptr == ptr) {
            return Ok(None);
        }
        let lock = open_lock(map.header().node as usize)?;
        sys::lock_file(lock.as_fd(), true, true)?;
        take_page_locked(len, flags.limit)?;
        let start = Instant::now();
        // SAFETY: a chunk of the pool's mapping, not registered by this process yet (each
        // index once), mapped until `release` unregistered it.
        let registered = unsafe { gpu.register(ptr, len, flags.register) };
        let took = start.elapsed();
        sys::unlock_file(lock.as_fd());
        if let Err(e) = registered {
            give_page_locked(len);
            return Err(e);
        }
        self.chunks.lock().push(Registered { gpu, ptr, len });
        map.header().registrations.fetch_add(1, Ordering::AcqRel);
        Ok(Some(took))
    }

    /// Chunks registered, and their bytes.
    pub(crate) fn count(&self) -> (usize, usize) {
        let chunks = self.chunks.lock();
        (chunks.len(), chunks.iter().map(|r| r.len).sum())
    }

    /// Unregisters every chunk; false when one could not be (a forked child, the process
    /// exiting, the driver refused): then the mapping must stay.
    pub(crate) fn release(&self, map: &PoolMap) -> bool {
        let mut all = true;
        let chunks = std::mem::take(&mut *self.chunks.lock());
        for r in chunks {
            // SAFETY: the base of a successful registration, still mapped (the owner unmaps
            // only after this), released once (taken out of the list).
            match unsafe { r.gpu.unregister(r.ptr) } {
                Ok(()) => {
                    give_page_locked(r.len);
                    map.header().registrations.fetch_sub(1, Ordering::AcqRel);
                }
                Err(_) => all = false,
            }
        }
        all
    }
}

/// Opens the node's lock file (see [`open_lock_at`]).
fn open_lock(node: usize) -> Result<File, Error> {
    open_lock_at(Path::new(&lock_path(node)))
}

/// Opens a lock file that every user's processes share: read-only when it exists (`flock` needs
/// no write access; a file another user made need not be writable by this one, and opening it
/// with `O_CREAT` in sticky `/dev/shm` is refused under `fs.protected_regular`), else made here
/// and given mode 0666 with `fchmod`, since the umask narrows the mode `open` is given.
///
/// Not through a symbolic link, and only a regular file: anyone may make the path in
/// `/dev/shm`, and opening a FIFO there would wait for a writer forever.
pub(crate) fn open_lock_at(path: &Path) -> Result<File, Error> {
    let io = |e: std::io::Error| Error::Io {
        path: path.into(),
        kind: e.kind(),
        errno: e.raw_os_error(),
    };
    let existing = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    match existing {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
        Ok(file) => {
            let kind = file.metadata().map_err(io)?.file_type();
            if !kind.is_file() {
                return Err(Error::Parse {
                    path: path.into(),
                    expected: "a regular file (the node's registration lock)",
                    found: format!("{kind:?}"),
                });
            }
            return Ok(file);
        }
    }
    let made = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(path);
    match made {
        Ok(file) => {
            file.set_permissions(Permissions::from_mode(0o666))
                .map_err(io)?;
            Ok(file)
        }
        // Made by another process in between.
        Err(e) if e.kind() == ErrorKind::AlreadyExists => open_lock_at(path),
        Err(e) => Err(io(e)),
    }
}
