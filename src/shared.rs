//! Shared pools: one placed, populated copy of memory on a node that every process on it maps
//! and allocates from ([`SharedPool`]).
//!
//! A pool is a memory file (`memfd_create`, sealed against resizing, or a file under `/dev/shm`
//! or a hugetlbfs mount, which cannot be sealed), placed on its node before any page is touched
//! (`mbind`), populated once by the node's bound workers and checked page by page
//! (`move_pages`). Other processes attach by descriptor
//! (inherited, or passed over a Unix socket: [`SharedPool::send`], [`SharedPool::receive`]) or
//! by path ([`SharedPool::attach`]). Blocks are named across processes by a [`PoolHandle`] (an
//! offset into the pool, the pool's id and the block's serial), which each process turns into
//! its own pointer; the extent table
//! lives in the pool, under a lock that passes on once the kernel says its holder is gone (in
//! any PID namespace, zombie or not), so a block freed by any process returns to the pool, and a
//! process killed while holding the lock does not wedge the others.
//!
//! # Trust
//! A pool at a path is made under a private name (`O_EXCL`, mode 0600 or the one the creator
//! names), and linked into place only once it is whole: nobody sees it half made. Attaching by
//! path refuses a file owned by another user than this process's and root, or that others may
//! write, unless the caller names that owner or mode ([`PoolAttach`]). Every lock a pool's
//! processes share lives inside the pool, so only they can hold it; the waits for it end after
//! a deadline that names the holder, or when cancelled. Descriptors are close-on-exec unless
//! the creator asks to inherit them. Whatever another attached process writes into the pool's
//! state, a locker checks it before use and rebuilds it when it does not hold together: no
//! panic, no block handed out twice from a table read past its end.
//!
//! [`SharedPool`]'s methods, `Drop` and `Debug` are here (its `Allocator` is beside the block that
//! frees itself, `block.rs`); the work of making, attaching and registering is its helpers'
//! ([`SharedPoolBuilder`], [`PoolAttach`], [`PoolRegistration`]). `build.rs` makes a pool (the
//! file, its size against the node, the header, then each chunk placed, populated and checked by
//! `pool/chunks.rs`); `attach.rs` checks a file before attaching (its owner and mode when at a
//! path, then that it is a whole, ready pool of this build on its node); `register.rs` registers this
//! process's mapping in the background, chunk by chunk, through the same step function.
//!
//! Unsafe code here relies on allocator-api2's contract for the `Allocator` implementations:
//! a block is live in the pool until freed, and lies inside the mapping the pool owns.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::pool::{Pool, PoolGuard, DATA_START};
use crate::process::job::Job;
use crate::stats::Counters;
use crate::sys::{self, lock::Lock};
use crate::{Error, GpuSelector};

mod attach;
mod block;
mod build;
mod inner;
mod register;
mod stats;

pub use attach::PoolAttach;
pub use block::{PoolHandle, SharedBlock};
pub use build::SharedPoolBuilder;
use inner::Inner;
pub use register::{PoolRegistration, RegisterProgress};
pub use stats::PoolStats;

/// How long a process waits for a pool's lock another process holds, by default.
const LOCK_WAIT: Duration = Duration::from_secs(30);
/// The permission bits an attached file may have by default: none letting others write it.
const TRUSTED_MODE: u32 = 0o755;

/// A pool of memory on one node that several processes map and allocate from.
///
/// Dropping it detaches this process: its mapping goes; the pages live while any process maps
/// the pool (or while its path exists). Blocks stay allocated in the pool until some process
/// frees them. A child forked from an attached process inherits the value but is not counted
/// as attached, nor does it register: dropping it there unmaps the child's mapping alone; a
/// child that means to attach calls [`SharedPool::attach_fd`] with a duplicate of [`fd`](Self::fd).
///
/// A process that ends without dropping it (`std::process::exit`, a pool in a static) is not
/// detached: at exit the crate neither unregisters nor unmaps it (the kernel unmaps the pool as
/// the process ends, and the driver releases the process's registrations with it), a
/// registration under way makes no driver call once the driver's teardown may have begun, and
/// the pool's `attached` count keeps counting the process.
///
/// Every process maps the pool readable and writable, readers too: each carves it, and a
/// read-only mapping cannot be registered with CUDA on every GPU.
///
/// Each attached process registers its own mapping
/// ([`register_in_background`](Self::register_in_background)), one registration per chunk
/// (256 MiB unless [`SharedPoolBuilder::chunk`] says otherwise; no block crosses two), one
/// process at a time per pool. The kernel's locked-memory charge and the driver's page table
/// (16 B per 4 KiB page) fall on each registering process: N processes pay N times for memory
/// that is there once. A process without a driver uses the pool unpinned. A process killed
/// while holding the pool's lock does not wedge the others (the next locker rebuilds the
/// extent table), and [`reclaim`](Self::reclaim) frees the blocks a process that is gone left.
///
/// # Locks
/// Each attached process holds a lock of the kernel's on the pool's file (an open file
/// description's, on a byte past its end) for as long as it is attached, and a lock of the
/// pool passes from its holder to a waiter only once the kernel has dropped the holder's: a
/// holder that died (even if not yet reaped), in this PID namespace or another, gives the lock
/// up within 10 ms; a live one keeps it however its process ids look from elsewhere. A forked
/// child takes keys of its own at its first lock of an inherited pool; until then (or until it
/// drops the pool, execs or exits) it keeps its parent's, and a parent that dies holding a
/// lock then holds it until the child lets go of them. Each attachment opens the pool's file
/// once more for this (through `/proc/self/fd`): a process must be one that may open the file.
///
/// Every wait for a lock of the pool that a live process holds ends after the pool's lock
/// wait (30 s unless [`SharedPoolBuilder::lock_wait`] or [`PoolAttach::lock_wait`] say
/// otherwise): [`Error::PoolLockHeld`] names the holder; [`allocate`](Self::allocate) returns
/// `None`, [`stats`](Self::stats) leaves the carving counts at zero, and the calls that return
/// a `Result` return that error.
///
/// Once registered ([`register_in_background`](Self::register_in_background)) its memory is
/// page-locked: a copy queued from or to a block returns before the DMA ends, and cudarc's safe
/// API does not wait for it. Synchronize the stream (or wait on an event recorded after the copy)
/// before writing a block a copy reads, reading one a download writes, or freeing either.
pub struct SharedPool {
    inner: Arc<Inner>,
    /// The registration under way in the background, cancelled at detach.
    background: Lock<Option<Arc<Job>>>,
}

impl SharedPool {
    /// This process's handle of `pool`, its placer's steps counted in `counters`.
    fn new(
        pool: Pool,
        path: Option<PathBuf>,
        lock_wait: Duration,
        counters: Counters,
    ) -> SharedPool {
        SharedPool {
            inner: Arc::new(Inner {
                pool,
                path,
                attached_by: (sys::process_id(), crate::fork::generation()),
                lock_wait,
                counters,
            }),
            background: Lock::new(None),
        }
    }

    /// A builder for a pool of `size` bytes (rounded up to 2 MiB, its first 2 MiB included:
    /// the header, about 160 KiB, then blocks from 2 MiB on).
    pub fn builder(size: usize) -> SharedPoolBuilder {
        SharedPoolBuilder::new(size)
    }

    /// How to attach with other than the defaults: more owners or modes trusted, another lock
    /// wait.
    pub fn attacher() -> PoolAttach {
        PoolAttach {
            owners: Vec::new(),
            mode: TRUSTED_MODE,
            lock_wait: LOCK_WAIT,
        }
    }

    /// Attaches to the pool at `path`: a file owned by this process's effective user or root,
    /// which no other user may write (see [`SharedPool::attacher`] to trust more). A symbolic
    /// link at `path` is not followed (`O_NOFOLLOW`; the folders above it are).
    ///
    /// # Errors
    /// [`Error::PoolUntrusted`] for a file of another owner, or that others may write;
    /// [`Error::PoolSymlink`] for a symbolic link;
    /// [`Error::PoolPermission`] for one this process may not open for reading and writing;
    /// [`Error::PoolForeign`], [`Error::PoolVersion`], [`Error::PoolLayout`],
    /// [`Error::PoolCorrupt`] for a file that is not a pool of this build, [`Error::PoolSparse`]
    /// for one whose pages are not all there (nothing of it is allocated by the attach);
    /// [`Error::PoolStale`]
    /// for one left half made by a creator that is gone; [`Error::PoolWrongNode`] for one whose
    /// pages are not on its node; [`Error::PoolReadOnly`] for a file or descriptor this process
    /// may not map for writing, [`Error::PoolDescriptor`] for a descriptor open write-only or
    /// as a path only; [`Error::PoolLockHeld`] when a live process holds the pool's lock for
    /// all of the lock wait. A refused attach changes nothing in the file, but for one thing:
    /// finding the pool's lock left by a process that died holding it, or its extent table
    /// not holding together, it repairs the extent table (as any locker would) before it
    /// checks where the pages are.
    pub fn attach(path: impl AsRef<Path>) -> Result<SharedPool, Error> {
        SharedPool::attacher().attach(path)
    }

    /// Attaches to the pool whose file `fd` is (inherited, or from [`SharedPool::receive`]):
    /// trusted as its sender is, with no owner or mode check.
    ///
    /// # Errors
    /// As [`SharedPool::attach`], but for the trust check.
    pub fn attach_fd(fd: OwnedFd) -> Result<SharedPool, Error> {
        SharedPool::attacher().attach_fd(fd)
    }

    /// Sends the pool's file descriptor over `socket` (`SCM_RIGHTS`), for
    /// [`SharedPool::receive`] in the process at the other end.
    pub fn send(&self, socket: &UnixStream) -> Result<(), Error> {
        sys::send_fd(socket.as_fd(), self.inner.pool.fd())
    }

    /// Receives a pool's descriptor [`SharedPool::send`] sent over `socket`, and attaches.
    ///
    /// # Errors
    /// As [`SharedPool::attach`], or the socket's.
    pub fn receive(socket: &UnixStream) -> Result<SharedPool, Error> {
        SharedPool::attach_fd(sys::recv_fd(socket.as_fd())?)
    }

    /// The pool's file descriptor: a child inherits it across `fork`, and attaches with
    /// [`SharedPool::attach_fd`]. It is close-on-exec (an exec'd program does not get it)
    /// unless the pool was made with [`SharedPoolBuilder::inherit`] (or the caller cleared the
    /// flag).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.pool.fd()
    }

    /// The pool's path, when it has one.
    pub fn path(&self) -> Option<&Path> {
        self.inner.path.as_deref()
    }

    /// Carves a block of `layout` (alignment up to 2 MiB, no larger than a chunk), freed when
    /// the returned value drops; `None` when the pool has no room for it, or its lock could not
    /// be taken (a live process held it for all of the lock wait).
    /// [`SharedBlock::into_handle`] hands it to another process, which adopts it with
    /// [`from_handle`](Self::from_handle).
    pub fn allocate(&self, layout: Layout) -> Option<SharedBlock<'_>> {
        let handle = self.allocate_handle(layout)?;
        Some(SharedBlock::new(self, handle))
    }

    /// Adopts the live block `handle` names (from [`SharedBlock::into_handle`] in this or
    /// another process): it is freed when the returned value drops, and is this process's from
    /// now on ([`reclaim`](Self::reclaim) of the process that carved it leaves it be).
    ///
    /// # Errors
    /// [`Error::PoolHandle`] when the handle is another pool's, or names no live block.
    ///
    /// # Safety
    /// From now on the returned value is the block's only owner: no process frees the block by
    /// another handle or adoption, nor uses it after the value dropped.
    pub unsafe fn from_handle(&self, handle: PoolHandle) -> Result<SharedBlock<'_>, Error> {
        self.mine(handle)?;
        let pid = sys::process_id();
        let mut guard = self.lock(pid)?;
        if !guard
            .extents()
            .adopt(handle.offset, handle.len, handle.serial, pid)
        {
            return Err(self.bad_handle(handle, "it was freed already, or never carved"));
        }
        Ok(SharedBlock::new(self, handle))
    }

    /// Carves a block of `layout` as [`allocate`](Self::allocate) does, as a handle only: the
    /// block stays live until some process [`free`](Self::free)s it or adopts it
    /// ([`from_handle`](Self::from_handle)).
    pub fn allocate_handle(&self, layout: Layout) -> Option<PoolHandle> {
        let pid = sys::process_id();
        let mut guard = self.lock(pid).ok()?;
        let table = guard.extents();
        let block = table.allocate(layout.size() as u64, layout.align() as u64, pid)?;
        let serial = table.find(block.offset)?.serial;
        Some(self.handle(block.offset, block.len, serial))
    }

    fn handle(&self, offset: u64, len: u64, serial: u32) -> PoolHandle {
        PoolHandle {
            offset,
            len,
            pool: self.inner.pool.id(),
            serial,
        }
    }

    /// Frees the live block `handle` names, whichever process carved it: it returns to the pool.
    ///
    /// # Errors
    /// [`Error::PoolHandle`] when the handle is another pool's, or no live block of its length
    /// and serial starts at its offset (freed already, even if another block was carved there
    /// since); the pool's lock's error when it could not be taken ([`Error::PoolLockHeld`],
    /// [`Error::PoolCorrupt`]), the block left as it was.
    ///
    /// # Safety
    /// Nothing in any process uses the block afterwards (a GPU copy still in flight included),
    /// and it is not owned by a value the pool's `Allocator` impl serves (a `Vec` in the pool
    /// frees its block itself): its range may be handed out again at once.
    pub unsafe fn free(&self, handle: PoolHandle) -> Result<(), Error> {
        self.mine(handle)?;
        let pid = sys::process_id();
        let mut guard = self.lock(pid)?;
        let expect = Some((handle.len, handle.serial));
        match guard.extents().free(handle.offset, expect, pid) {
            Ok(_) => Ok(()),
            Err(_) => Err(self.bad_handle(handle, "it was freed already, or never carved")),
        }
    }

    /// The pool's carving lock, for process `pid` (this one's), within the lock wait.
    fn lock(&self, pid: u32) -> Result<PoolGuard<'_>, Error> {
        self.inner.pool.lock(self.inner.lock_wait, pid)
    }

    /// Refuses a handle of another pool.
    fn mine(&self, handle: PoolHandle) -> Result<(), Error> {
        if handle.pool == self.inner.pool.id() {
            Ok(())
        } else {
            Err(self.bad_handle(
                handle,
                "it is a handle of another pool (its pool id differs)",
            ))
        }
    }

    fn bad_handle(&self, handle: PoolHandle, reason: &'static str) -> Error {
        Error::PoolHandle {
            path: self.inner.pool.name().into(),
            offset: handle.offset,
            len: handle.len,
            reason,
        }
    }

    /// Frees the block at `offset` that a value of this process owned and dropped (a
    /// [`SharedBlock`], a collection in the pool). In a forked child the value is a copy of the
    /// parent's, which still owns the block: there only a block the child carved itself is freed.
    fn free_owned(&self, offset: u64, expect: Option<(u64, u32)>) {
        let pid = sys::process_id();
        let Ok(mut guard) = self.lock(pid) else {
            return;
        };
        let table = guard.extents();
        if !self.inner.inherited_by(pid) || table.find(offset).is_some_and(|live| live.pid == pid) {
            let _ = table.free(offset, expect, pid);
        }
    }

    /// Frees every live block process `pid` carved, once that process is gone (killed before
    /// it freed them: nothing else ever frees them); how many blocks, and their bytes, went
    /// back to the pool. Every live block is recorded with the pid of the process that carved
    /// it; pids are of the pool creator's pid namespace only if every attached process shares
    /// it.
    ///
    /// # Errors
    /// [`Error::PoolOwnerAlive`] while a process `pid` exists (checked under the pool's lock, so
    /// that none with that pid carves meanwhile).
    ///
    /// # Safety
    /// No process uses any of those blocks afterwards: a block `pid` carved and handed to a
    /// process still running (by its handle) is freed too, and may be handed out again at once.
    pub unsafe fn reclaim(&self, pid: u32) -> Result<(usize, u64), Error> {
        let me = sys::process_id();
        let mut guard = self.lock(me)?;
        if sys::process_alive(pid) {
            return Err(Error::PoolOwnerAlive { pid });
        }
        Ok(guard.extents().reclaim(pid, me))
    }

    /// Whether `handle` is this pool's, and names a live block (its offset, length and serial).
    ///
    /// # Errors
    /// The pool's lock's, when it could not be taken ([`Error::PoolLockHeld`],
    /// [`Error::PoolCorrupt`]): whether the block is live is not known then.
    pub fn is_live(&self, handle: PoolHandle) -> Result<bool, Error> {
        if self.mine(handle).is_err() {
            return Ok(false);
        }
        let mut guard = self.lock(sys::process_id())?;
        let live = guard.extents().find(handle.offset);
        Ok(live.is_some_and(|live| (live.block.len, live.serial) == (handle.len, handle.serial)))
    }

    /// This process's pointer to the block `handle` names (`None` when it is another pool's
    /// handle, or lies outside the pool's blocks). The bytes are shared with every attached
    /// process: writing them while another process reads or writes them is a data race; use
    /// the block as agreed.
    pub fn ptr(&self, handle: PoolHandle) -> Option<NonNull<u8>> {
        let end = handle.offset.checked_add(handle.len)?;
        if self.mine(handle).is_err()
            || handle.offset < DATA_START as u64
            || end > self.inner.pool.len() as u64
        {
            return None;
        }
        NonNull::new(self.inner.pool.base().wrapping_add(handle.offset as usize) as *mut u8)
    }

    /// The handle of the live block starting at `ptr`, a pointer of this process; `None` when
    /// no live block starts there.
    ///
    /// # Errors
    /// The pool's lock's, when it could not be taken ([`Error::PoolLockHeld`],
    /// [`Error::PoolCorrupt`]).
    pub fn handle_of(&self, ptr: NonNull<u8>) -> Result<Option<PoolHandle>, Error> {
        let Some(offset) = (ptr.as_ptr() as usize).checked_sub(self.inner.pool.base()) else {
            return Ok(None);
        };
        let mut guard = self.lock(sys::process_id())?;
        let live = guard.extents().find(offset as u64);
        Ok(live.map(|live| self.handle(live.block.offset, live.block.len, live.serial)))
    }

    /// Checks where the pool's pages are now (`move_pages`, each page this process maps).
    ///
    /// # Errors
    /// [`Error::PoolWrongNode`] when some are elsewhere.
    pub fn check_placement(&self) -> Result<(), Error> {
        let pool = &self.inner.pool;
        let node = pool.header().node as usize;
        pool.check_node(DATA_START, pool.len() - DATA_START, node, false)
    }

    /// What the pool holds now.
    pub fn stats(&self) -> PoolStats {
        let header = self.inner.pool.header();
        let (registered_chunks, registered_bytes) = if self.inner.inherited() {
            (0, 0)
        } else {
            self.inner.pool.memory().registered()
        };
        let registrations = header.registrations.load(Ordering::Acquire);
        let mut stats = PoolStats {
            registrations,
            registered_bytes_all: registrations.saturating_mul(self.inner.pool.chunk()),
            registered_chunks,
            registered_bytes,
            pool_bytes: self.inner.pool.len(),
            usable_bytes: self.inner.pool.len() - DATA_START,
            live_bytes: 0,
            live_blocks: 0,
            attached: header.attached.load(Ordering::Acquire) as usize,
            allocations: 0,
            frees: 0,
            rebuilds: 0,
            node: header.node as usize,
            huge_pages: header.huge != 0,
            pages_checked: self.inner.counters.pages_checked.get(),
        };
        if let Ok(mut guard) = self.lock(sys::process_id()) {
            let table = guard.extents();
            stats.live_bytes = table.live_bytes as usize;
            stats.live_blocks = table.live().len();
            stats.allocations = table.allocations;
            stats.frees = table.frees;
            stats.rebuilds = table.rebuilds;
        }
        stats
    }

    /// Registers this process's mapping of the pool with `gpu`'s CUDA context on a thread of
    /// its own, chunk by chunk (each chunk one `cuMemHostRegister`, holding the pool's
    /// registration lock, which lives in the pool, so that two of its processes do not register
    /// at the same moment), within `pin_limit` bytes page-locked by this process through the
    /// crate. Blocks are usable meanwhile (unpinned until their chunk is registered); the
    /// returned [`PoolRegistration`] reports progress, waits, cancels. Chunks registered already are skipped. A
    /// process without a driver, or that does not pin, just does not call this: the pool works
    /// unpinned.
    ///
    /// # What it costs each process
    /// Page-locking is charged per process, not per pool: the kernel counts the registered
    /// bytes against this process (its locked memory), and the driver keeps a page table for
    /// this process's registration (16 bytes per 4 KiB page, about 0.4 %). Every process that
    /// registers the pool pays that again, though the memory is there once: plan a host's
    /// headroom for the number of registering processes ([`PoolStats::registered_bytes`](super::PoolStats::registered_bytes) is
    /// this process's share, [`PoolStats::registrations`](super::PoolStats::registrations) every process's chunks).
    ///
    /// A wait for the registration lock stops when the registration is cancelled (or the pool
    /// dropped), and fails with [`Error::PoolLockHeld`], naming the holder, after the pool's
    /// lock wait ([`SharedPoolBuilder::lock_wait`](crate::SharedPoolBuilder::lock_wait),
    /// [`PoolAttach::lock_wait`](crate::PoolAttach::lock_wait)).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without a usable driver (or in a forked child, for a pool it
    /// inherited), [`Error::GpuNotFound`]; a failure to
    /// start the thread. Later errors (a chunk refused, [`Error::PinLimit`]) come from the
    /// handle; the chunks registered before stay so until detach.
    pub fn register_in_background(
        &self,
        gpu: GpuSelector,
        pin_limit: usize,
    ) -> Result<PoolRegistration, Error> {
        let (registration, job) = PoolRegistration::start(&self.inner, gpu, pin_limit)?;
        // Cancelled at detach.
        *self.background.lock() = Some(job);
        Ok(registration)
    }

    /// Holds the pool's lock for `f` (`unstable::hold_pool_lock`: for test programs that kill
    /// a process holding it).
    pub(crate) fn with_lock_held<T>(&self, f: impl FnOnce() -> T) -> Result<T, Error> {
        let guard = self.lock(sys::process_id())?;
        let outcome = f();
        drop(guard);
        Ok(outcome)
    }

    /// Holds the pool's registration lock for `f` (`unstable::hold_registration_lock`).
    pub(crate) fn with_registration_lock_held<T>(&self, f: impl FnOnce() -> T) -> Result<T, Error> {
        let never = std::sync::atomic::AtomicBool::new(false);
        let guard = self
            .inner
            .pool
            .lock_registration(&never, self.inner.lock_wait)?;
        let outcome = f();
        drop(guard);
        Ok(outcome)
    }
}

impl Drop for SharedPool {
    /// Detaches: a registration under way stops after its chunk, and once it has, every chunk
    /// this process registered is unregistered, then the pool unmapped.
    fn drop(&mut self) {
        // A forked child has no registration thread (and its lock may be a parent's thread's).
        if self.inner.inherited() {
            return;
        }
        if let Some(job) = self.background.lock().take() {
            job.cancel();
        }
    }
}

impl fmt::Debug for SharedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedPool")
            .field("path", &self.inner.path)
            .field("stats", &self.stats())
            .finish()
    }
}

fn io_error(path: Option<&Path>, e: &std::io::Error) -> Error {
    Error::Io {
        path: path.map_or_else(|| PathBuf::from("<pool fd>"), Path::to_path_buf),
        kind: e.kind(),
        errno: e.raw_os_error(),
    }
}

/// A path to name a pool by in errors: its own, or its descriptor.
fn shown(path: Option<&Path>, fd: &impl AsFd) -> PathBuf {
    use std::os::fd::AsRawFd;
    path.map_or_else(
        || PathBuf::from(format!("<fd {}>", fd.as_fd().as_raw_fd())),
        Path::to_path_buf,
    )
}
