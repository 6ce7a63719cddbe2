//! Making a shared pool: the file (a memory file, or a path made exclusively), its size
//! against the node's memory and free huge pages, the header, placement, populate and the page
//! check.
//!
//! Unsafe code here relies on a pool's file being new (made here, exclusively) while its header
//! is written and its pages placed: nobody else has it until it is ready.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use super::{io_error, shown, SharedPool, HUGE_PAGE};
use crate::config::Config;
use crate::guard::Inside;
use crate::pool::carve::MAX_ALIGN;
use crate::pool::{PoolMap, DATA_START};
use crate::process::INIT;
use crate::sys;
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
}

impl SharedPoolBuilder {
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

    /// Makes the pool: the file, its placement on the node, populate, the page check.
    ///
    /// # Errors
    /// [`Error::PoolTooLarge`] when the size does not fit the node; [`Error::PoolHugePages`]
    /// without enough free huge pages; [`Error::PoolExists`] when the path exists;
    /// [`Error::PoolWrongNode`] when the pages did not land on the node; a system call's error.
    /// A pool made at a path is removed again when making it failed.
    pub fn create(self) -> Result<SharedPool, Error> {
        let topology = NumaTopology::from_sysfs()?;
        let node = match self.node {
            Some(node) => node,
            None => sys::current_node()?,
        };
        let info = topology.node(node).ok_or(Error::UnknownNode {
            node,
            node_count: topology.node_count(),
        })?;
        let size = self.size.next_multiple_of(MAX_ALIGN as usize);
        if size > info.memory_bytes as usize || size < DATA_START + MAX_ALIGN as usize {
            return Err(Error::PoolTooLarge {
                bytes: self.size,
                node,
                node_bytes: info.memory_bytes,
            });
        }
        if self.huge_pages {
            check_huge_pages(node, size, self.path.as_deref())?;
        }
        let (file, path) = match &self.path {
            Some(path) => (create_file(path)?, Some(path.clone())),
            None => (memfd(self.huge_pages)?, None),
        };
        let made = self.make(file, path.as_deref(), node, size, &info.cpus);
        if made.is_err() {
            if let Some(path) = &path {
                let _ = std::fs::remove_file(path);
            }
        }
        made.map(|(map, fd)| SharedPool::new(map, fd, path))
    }

    fn make(
        &self,
        file: File,
        path: Option<&Path>,
        node: usize,
        size: usize,
        cpus: &[usize],
    ) -> Result<(PoolMap, OwnedFd), Error> {
        file.set_len(size as u64).map_err(|e| io_error(path, &e))?;
        let fd = OwnedFd::from(file);
        if path.is_none() {
            // A memory file: nobody who holds it may resize it from now on. A file at a path
            // cannot be sealed (tmpfs and hugetlbfs files are made sealed against sealing):
            // whoever may write it can still truncate it.
            sys::seal_size(fd.as_fd())?;
        }
        let huge = sys::on_hugetlbfs(fd.as_fd())?;
        let mut map = PoolMap::map(fd.as_fd(), size, shown(path, &fd))?;
        let bound = register_max();
        let chunk = self
            .chunk
            .unwrap_or(bound)
            .min(bound)
            .max(1)
            .next_multiple_of(MAX_ALIGN as usize)
            .min(size - DATA_START) as u64;
        // SAFETY: the file was just made, all zeros, and nobody else has it yet (a path is
        // created exclusively, and attachers wait for it to be ready).
        unsafe { map.init(node, huge, chunk) }?;
        let allowed = sys::process_cpus().unwrap_or_default();
        let cpus = || {
            let mine: Vec<usize> = cpus
                .iter()
                .copied()
                .filter(|c| allowed.contains(c))
                .collect();
            if mine.is_empty() {
                allowed.clone()
            } else {
                mine
            }
        };
        // SAFETY: new, and no page of it touched yet.
        unsafe { map.place(node, cpus, self.populate_threads, huge) }?;
        if let Some((elsewhere, pages, found)) = map.count_elsewhere(node, true) {
            if elsewhere > 0 {
                return Err(Error::PoolWrongNode {
                    path: shown(path, &fd),
                    node,
                    elsewhere,
                    pages,
                    found,
                });
            }
        }
        map.header().attached.fetch_add(1, Ordering::AcqRel);
        map.set_ready();
        Ok((map, fd))
    }
}

impl SharedPool {
    /// A builder for a pool of `size` bytes (rounded up to 2 MiB, its first 2 MiB included:
    /// the header, about 160 KiB, then blocks from 2 MiB on).
    pub fn builder(size: usize) -> SharedPoolBuilder {
        SharedPoolBuilder {
            size,
            node: None,
            huge_pages: false,
            path: None,
            chunk: None,
            populate_threads: 4,
        }
    }
}

/// The allocator's registration bound in this process, read as every allocator value reads it:
/// the default (`Config::DEFAULT`) with `NUMA_GPU_ALLOC`'s settings applied (parsed once per
/// process, under the initialisation lock; a parsed `register_max=` is 2 MiB to 1 GiB, a
/// multiple of 2 MiB).
fn register_max() -> usize {
    // Inside the allocator while the lock is held: parsing allocates, and an allocation that
    // reached a `NumaGpuAlloc` global allocator's initialisation would wait for this lock.
    let _inside = Inside::enter();
    let mut config = Config::DEFAULT;
    INIT.lock().env().apply_to(&mut config);
    config.register_max
}

/// A memory file for a pool, inherited by exec'd children unless the caller says otherwise, and
/// sealed against resizing once sized (`make`).
fn memfd(huge: bool) -> Result<File, Error> {
    let name = CString::new("numa-gpu-alloc pool").unwrap_or_default();
    sys::memfd(&name, huge).map(File::from)
}

/// Creates `path` exclusively, readable and writable by its owner.
fn create_file(path: &Path) -> Result<File, Error> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => Error::PoolExists { path: path.into() },
            _ => io_error(Some(path), &e),
        })
}

/// Refuses a pool of huge pages that the node's free huge pages cannot hold.
fn check_huge_pages(node: usize, size: usize, path: Option<&Path>) -> Result<(), Error> {
    let file = format!(
        "/sys/devices/system/node/node{node}/hugepages/hugepages-{}kB/free_hugepages",
        HUGE_PAGE >> 10
    );
    let free = std::fs::read_to_string(&file)
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(0);
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
