//! Making a shared pool: the file (a memory file, or a private name next to the path, made
//! exclusively and linked to the path once whole), its size against the node's memory, its
//! filesystem's room and free huge pages, the header, placement, populate and the page check.
//!
//! Unsafe code here relies on a pool's file being new (made here, exclusively) while its header
//! is written and its pages placed: nobody else has it until it is ready.

use std::ffi::CString;
use std::fs::{File, OpenOptions, Permissions};
use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{io_error, shown, SharedPool, LOCK_WAIT};
use crate::chunk::{Numa, PinFlags, Placer};
use crate::config::Config;
use crate::cuda::RegisterFlags;
use crate::guard::Inside;
use crate::pool::chunks::{self, Placement, PoolSeams, Steps};
use crate::pool::extents::MAX_ALIGN;
use crate::pool::{self, Pool, DATA_START};
use crate::process::{large_path, LargePath, INIT};
use crate::stats::Counters;
use crate::sys::{self, HUGE_PAGE};
use crate::topology::sysfs::free_huge_pages;
use crate::topology::NumaTopology;
use crate::Error;

/// How to make a [`SharedPool`] (see [`SharedPool::builder`]).
#[derive(Clone, Debug)]
pub struct SharedPoolBuilder {
    size: usize,
    node: Option<usize>,
    huge_pages: bool,
    path: Option<PathBuf>,
    /// `None`: the registration bound.
    chunk: Option<usize>,
    populate_threads: usize,
    mode: u32,
    inherit: bool,
    lock_wait: Duration,
}

impl SharedPoolBuilder {
    /// The defaults for a pool of `size` bytes ([`SharedPool::builder`]).
    pub(super) fn new(size: usize) -> SharedPoolBuilder {
        SharedPoolBuilder {
            size,
            node: None,
            huge_pages: false,
            path: None,
            chunk: None,
            populate_threads: 4,
            mode: 0o600,
            inherit: false,
            lock_wait: LOCK_WAIT,
        }
    }

    /// The node its pages go on (default: the node of the calling thread's CPU).
    pub fn node(mut self, node: usize) -> Self {
        self.node = Some(node);
        self
    }

    /// 2 MiB huge pages (`MFD_HUGETLB | MFD_HUGE_2MB`, or a path on a hugetlbfs mount of 2 MiB
    /// pages), from the huge pages reserved on the node; without, the file is advised for
    /// transparent huge pages, which the kernel gives shared memory only when `shmem_enabled`
    /// allows it.
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// Makes the pool at `path` (under `/dev/shm` or a hugetlbfs mount) instead of a memory
    /// file without a name, so that unrelated processes, and a restarted server, find it.
    pub fn path(mut self, path: impl Into<PathBuf>) -> Self {
        self.path = Some(path.into());
        self
    }

    /// The chunk size, rounded up to 2 MiB (0 is 2 MiB): no block crosses a chunk, and each chunk is one
    /// registration in a pinned process, so it is at most the allocator's registration bound
    /// (`register_max=` in `NUMA_GPU_ALLOC`, 256 MiB by default), which is also the default, and
    /// at most the pool's blocks.
    pub fn chunk(mut self, bytes: usize) -> Self {
        self.chunk = Some(bytes);
        self
    }

    /// How many threads populate it (the caller and the node's bound workers; default 4).
    pub fn populate_threads(mut self, threads: usize) -> Self {
        self.populate_threads = threads.max(1);
        self
    }

    /// The permission bits of a pool made at a path (default 0o600: its owner's alone). Other
    /// users who are to attach need read and write (0o660 and a group they share); those who
    /// attach refuse a file others may write unless they allow its mode by name
    /// ([`PoolAttach::allow_mode`](crate::PoolAttach::allow_mode)).
    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = mode & 0o7777;
        self
    }

    /// Whether the pool's descriptor survives `exec` (default: no, it is close-on-exec, so a
    /// program this process runs does not get the pool unless asked). A child meant to attach
    /// by an inherited descriptor needs it.
    pub fn inherit(mut self, on: bool) -> Self {
        self.inherit = on;
        self
    }

    /// How long this process waits for a lock of the pool another process holds (default
    /// 30 s) before [`Error::PoolLockHeld`], which names the holder.
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// Makes the pool: the file, its placement on the node, populate, the page check.
    ///
    /// A pool at a path is made under a private name beside it (`.NAME.making-PID-N`, mode
    /// 0600), then linked to the path once whole: a process attaching meanwhile finds no file,
    /// never a half-made one. A creator killed while making it leaves that private file (remove
    /// it once its pid is gone).
    ///
    /// # Errors
    /// [`Error::PoolTooSmall`] below a header and one block; [`Error::PoolTooLarge`] when the
    /// size does not fit the node; [`Error::PoolHugePages`] without enough free huge pages;
    /// [`Error::PoolNoSpace`] when the file's filesystem has no room for it;
    /// [`Error::PoolExists`] when the path exists (before the pool is made, or when it is
    /// linked); [`Error::PoolWrongNode`] when the pages did not land on the node; a system
    /// call's error. Nothing is left at the path, nor under the private name, when making it
    /// failed.
    pub fn create(self) -> Result<SharedPool, Error> {
        let (config, large) = process_settings();
        let sysfs_root = Path::new(config.sysfs_root);
        let topology = NumaTopology::from_sysfs_root(sysfs_root)?;
        let node = match self.node {
            Some(node) => node,
            None => sys::current_node()?,
        };
        let info = topology.node(node).ok_or(Error::UnknownNode {
            node,
            node_count: topology.node_count(),
        })?;
        let too_large = || Error::PoolTooLarge {
            bytes: self.size,
            node,
            node_bytes: info.memory_bytes,
        };
        // No rounding past the address space: that is too large, not too small.
        let size = self
            .size
            .checked_next_multiple_of(MAX_ALIGN as usize)
            .ok_or_else(too_large)?;
        let min = DATA_START + MAX_ALIGN as usize;
        if size < min {
            return Err(Error::PoolTooSmall {
                bytes: self.size,
                min,
            });
        }
        if size as u64 > info.memory_bytes {
            return Err(too_large());
        }
        if self.huge_pages {
            check_huge_pages(sysfs_root, node, size, self.path.as_deref())?;
        }
        let placing = Placing {
            large,
            register_max: config.register_max,
            counters: Counters::default(),
        };
        let Some(path) = self.path.clone() else {
            let file = memfd(self.huge_pages, self.inherit)?;
            let pool = self.make(file, None, (node, size), &placing)?;
            return Ok(SharedPool::new(
                pool,
                None,
                self.lock_wait,
                placing.counters,
            ));
        };
        if path.symlink_metadata().is_ok() {
            return Err(Error::PoolExists { path });
        }
        let (file, private) = create_private(&path)?;
        let made = self
            .make(file, Some(&path), (node, size), &placing)
            .and_then(|pool| {
                if self.inherit {
                    sys::set_cloexec(pool.fd(), false)?;
                }
                let fd = pool.fd().try_clone_to_owned();
                File::from(fd.map_err(|e| io_error(Some(&path), &e))?)
                    .set_permissions(Permissions::from_mode(self.mode))
                    .map_err(|e| io_error(Some(&path), &e))?;
                std::fs::hard_link(&private, &path).map_err(|e| match e.kind() {
                    ErrorKind::AlreadyExists => Error::PoolExists { path: path.clone() },
                    _ => io_error(Some(&path), &e),
                })?;
                Ok(pool)
            });
        // Made or not, the private name goes: the pool lives at the path, or nowhere.
        let _ = std::fs::remove_file(&private);
        made.map(|pool| SharedPool::new(pool, Some(path), self.lock_wait, placing.counters))
    }

    /// Makes a pool of `size` bytes on `node` in `file` (at `path`, if it has one), placed
    /// through the placer with `placing`.
    fn make(
        &self,
        file: File,
        path: Option<&Path>,
        (node, size): (usize, usize),
        placing: &Placing,
    ) -> Result<Pool, Error> {
        file.set_len(size as u64).map_err(|e| io_error(path, &e))?;
        let fd = OwnedFd::from(file);
        if path.is_none() {
            // A memory file: nobody who holds it may resize it from now on. A file at a path
            // cannot be sealed (tmpfs and hugetlbfs files are made sealed against sealing):
            // whoever may write it can still truncate it.
            sys::seal_size(fd.as_fd())?;
        }
        let huge = sys::on_hugetlbfs(fd.as_fd())?;
        let name = shown(path, &fd);
        let no_space = |free| Error::PoolNoSpace {
            path: name.clone(),
            needed: size as u64,
            free,
        };
        // tmpfs allocates a file's pages as they are first touched: a full one fails the
        // populate with EFAULT. Said beforehand where the filesystem tells its room.
        if let Some(free) = sys::free_bytes(fd.as_fd())? {
            if free < size as u64 {
                return Err(no_space(Some(free)));
            }
        }
        let filled = |e: Error, fd: BorrowedFd<'_>| match e {
            // Filled meanwhile by another process (a tmpfs's room is shared).
            Error::Syscall {
                errno: libc::EFAULT | libc::ENOSPC | libc::ENOMEM,
                ..
            } if sys::free_bytes(fd).ok().flatten().is_some() => no_space(None),
            e => e,
        };
        let (mapping, file) = pool::map(fd, size, &name)?;
        let bound = placing.register_max;
        let chunk = self
            .chunk
            .unwrap_or(bound)
            .min(bound)
            .max(1)
            .next_multiple_of(MAX_ALIGN as usize)
            .min(size - DATA_START) as u64;
        // SAFETY: the file was just made, all zeros, and nobody else has it yet (a path is
        // created exclusively, and attachers wait for it to be ready).
        let pool = unsafe { Pool::init(mapping, file, name.clone(), (node, huge, chunk)) }?;
        // Nothing is registered here: the flags are the driver's defaults, with no limit.
        let flags = PinFlags {
            register: RegisterFlags::default(),
            limit: usize::MAX,
        };
        let rules = chunks::rules(huge, self.populate_threads, flags, bound);
        let numa = Numa::new(None);
        let steps = Steps {
            placer: Placer {
                rules: &rules,
                numa: &numa,
                counters: &placing.counters,
                seams: &PoolSeams(placing.large),
            },
            // SAFETY: new, no page of it touched yet, and nobody else has it.
            place: Some(unsafe { Placement::new(node) }),
            register: None,
        };
        for index in 0..pool.memory().ranges() {
            chunks::prepare(&pool, index, &steps).map_err(|e| filled(e, pool.fd()))?;
        }
        pool.header().attached.fetch_add(1, Ordering::AcqRel);
        pool.set_ready();
        Ok(pool)
    }
}

/// What a pool's placer needs of the process: its large path (page size, memory limits,
/// populate workers), its registration bound, and the counters the placer counts into.
pub(super) struct Placing {
    pub(super) large: &'static LargePath,
    pub(super) register_max: usize,
    pub(super) counters: Counters,
}

/// The process's settings as every allocator value reads them: the default (`Config::DEFAULT`)
/// with `NUMA_GPU_ALLOC`'s settings applied (parsed once per process, under the initialisation
/// lock): the registration bound (`register_max=`, 2 MiB to 1 GiB, a multiple of 2 MiB) and the
/// sysfs root; and the process's large path, made now if no allocator value made it yet.
pub(super) fn process_settings() -> (Config, &'static LargePath) {
    // Inside the allocator while the lock is held: parsing allocates, and an allocation that
    // reached a `NumaGpuAlloc` global allocator's initialisation would wait for this lock.
    let _inside = Inside::enter();
    let mut config = Config::DEFAULT;
    let mut setup = INIT.lock();
    setup.env().apply_to(&mut config);
    let large = large_path(&mut setup, config.sysfs_root);
    (config, large)
}

/// A memory file for a pool, close-on-exec unless `inherit`, and sealed against resizing once
/// sized (`make`).
fn memfd(huge: bool, inherit: bool) -> Result<File, Error> {
    let name = CString::new("numa-gpu-alloc pool").unwrap_or_default();
    sys::memfd(&name, huge, inherit).map(File::from)
}

/// Creates a file under a private name beside `path` (`.NAME.making-PID-N`), exclusively,
/// readable and writable by its owner alone; the file and its name.
fn create_private(path: &Path) -> Result<(File, PathBuf), Error> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let private = path.with_file_name(format!(
        ".{name}.making-{}-{:08x}",
        sys::process_id(),
        sys::random_u32()?
    ));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&private)
        .map_err(|e| io_error(Some(&private), &e))?;
    Ok((file, private))
}

/// Refuses a pool of huge pages that the node's free huge pages cannot hold.
fn check_huge_pages(
    sysfs_root: &Path,
    node: usize,
    size: usize,
    path: Option<&Path>,
) -> Result<(), Error> {
    let free = free_huge_pages(sysfs_root, node, HUGE_PAGE);
    let needed = size / HUGE_PAGE;
    if free < needed {
        return Err(Error::PoolHugePages {
            needed,
            free,
            place: path.map_or_else(|| PathBuf::from("memfd (MFD_HUGETLB)"), Path::to_path_buf),
        });
    }
    Ok(())
}
