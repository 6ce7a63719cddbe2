//! Shared pools: one memory file that several processes map, its pages placed on one node and
//! populated once, carved by every process that maps it. This module holds what lives in the
//! file: the header at its start ([`Header`]: magic, kind, layout version, layout tag, size, node,
//! chunk size, who made it and whether it is ready, how many processes are attached and how many
//! registrations they hold), the carving state (`carve/`) under the header's robust
//! process-shared mutex, and the mapping of the whole file ([`PoolMap`]) with its placement,
//! populate and page check; and this process's registrations of its chunks (`pinning.rs`). The
//! front end (`shared.rs`) opens the files and runs the registrations in the background.
//!
//! Unsafe code here relies on the header being at the start of a mapping of the pool's file,
//! which the [`PoolMap`] owns: its fields are written once, by the creator, before the magic
//! says the header is there, and afterwards change only as atomics or under the mutex.
#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::mem::{align_of, size_of};
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub(crate) mod carve;
pub(crate) mod pinning;

use crate::chunk::Span;
use crate::process::workers;
use crate::sys::{self, Locked, MbindFlags, MemPolicy, NodeMask, RobustMutex};
use crate::Error;
use carve::{Admit, Carve, MAX_ALIGN};

/// The first eight bytes of a pool's file.
const MAGIC: u64 = u64::from_le_bytes(*b"NGApool\0");
/// What the file holds (a pool carved in extents), and the layout of its header.
pub(crate) const KIND: u32 = 1;
pub(crate) const VERSION: u32 = 5;
/// Where blocks start: after the header, on a huge page boundary.
pub(crate) const DATA_START: usize = size_of::<Header>().next_multiple_of(MAX_ALIGN as usize);

/// What [`Header::layout`] records, in its order: the sizes and alignments the header's layout
/// follows from, and the C library of the build. A build where one differs (a 32-bit process,
/// another byte order) would misread every field after the tag. The C library mattered while
/// the locks were `pthread_mutex_t`s (glibc's and musl's differ in layout at one size); the
/// pool's own locks no longer depend on it, and the entry stays until the next layout change.
const LAYOUT_FIELDS: [&str; 9] = [
    "header size",
    "header alignment",
    "mutex size",
    "mutex alignment",
    "carving state size",
    "carving state alignment",
    "pointer width (bits)",
    "byte order mark",
    "C library (1 glibc, 2 musl, 3 other)",
];

/// This build's layout tag (see [`LAYOUT_FIELDS`]).
const LAYOUT: [u32; 9] = [
    size_of::<Header>() as u32,
    align_of::<Header>() as u32,
    size_of::<RobustMutex>() as u32,
    align_of::<RobustMutex>() as u32,
    size_of::<Carve>() as u32,
    align_of::<Carve>() as u32,
    usize::BITS,
    BYTE_ORDER_MARK,
    C_LIBRARY,
];

/// The C library of this build, as [`LAYOUT_FIELDS`] numbers it.
const C_LIBRARY: u32 = if cfg!(target_env = "gnu") {
    1
} else if cfg!(target_env = "musl") {
    2
} else {
    3
};

/// Stored in the machine's byte order: another reads it byte-swapped.
const BYTE_ORDER_MARK: u32 = 0x0102_0304;

/// The start of a pool's file.
#[repr(C)]
pub(crate) struct Header {
    magic: AtomicU64,
    pub(crate) kind: u32,
    pub(crate) version: u32,
    /// The layout tag of the build that made it ([`LAYOUT_FIELDS`]). It and the fields before
    /// it are at the same offsets in every build (8, 4, 4, then u32s from offset 16), so that
    /// any build reads them before trusting the rest.
    layout: [u32; 9],
    /// Bytes of the file, header included.
    pub(crate) size: u64,
    /// The node its pages are on.
    pub(crate) node: u32,
    /// Whether it is of huge pages (hugetlbfs).
    pub(crate) huge: u32,
    /// Blocks never cross a multiple of this from [`DATA_START`]; each chunk is one
    /// registration.
    pub(crate) chunk: u64,
    /// Who made it.
    pub(crate) creator: u32,
    /// Set once its pages are placed, populated and checked.
    ready: AtomicU32,
    /// Processes attached now (as far as the pool knows: one killed does not detach).
    pub(crate) attached: AtomicU32,
    /// Chunk registrations held, all processes together (a killed process's stay counted).
    pub(crate) registrations: AtomicU64,
    /// The pool's id, random, set when it is made: a handle carries it ([`PoolMap::id`]).
    id: u32,
    /// The process holding `mutex` (0: none; a killed holder's stays until the next locker).
    holder: AtomicU32,
    /// The process holding `register` (as for `holder`).
    register_holder: AtomicU32,
    /// Serialises the chunk registrations of every process attached, so that two never hold
    /// the driver's lock for this pool at once; reachable only by the pool's own users (no
    /// file another user can open and hold).
    register: RobustMutex,
    mutex: RobustMutex,
    carve: UnsafeCell<Carve>,
}

/// What a lock of the pool is called in errors, and the slice of a cancellable wait.
const CARVING: &str = "carving";
const REGISTRATION: &str = "registration";
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// Refuses a file whose first eight bytes, read in this machine's byte order, are not the
/// pool's magic: byte-swapped, it is a pool of another byte order (a layout mismatch, said so);
/// anything else is not a pool.
pub(crate) fn check_magic(found: u64, path: &Path) -> Result<(), Error> {
    if found == MAGIC {
        Ok(())
    } else if found == MAGIC.swap_bytes() {
        Err(Error::PoolLayout {
            path: path.into(),
            field: LAYOUT_FIELDS[7],
            found: BYTE_ORDER_MARK.swap_bytes(),
            expected: BYTE_ORDER_MARK,
        })
    } else {
        Err(Error::PoolForeign {
            path: path.into(),
            found,
        })
    }
}

/// A mapping of a whole pool file (shared, readable, writable), unmapped on drop.
#[derive(Debug)]
pub(crate) struct PoolMap {
    ptr: NonNull<u8>,
    len: usize,
    /// The file's path, or `<fd N>`: what its errors name.
    name: PathBuf,
    /// Set when a registration of it could not be released: the range stays mapped.
    keep: AtomicBool,
    /// The chunk, as [`Self::init`] wrote it or [`Self::check`] found it: this process's copy,
    /// which another process's stray write to the header cannot change (0 before either).
    chunk: u64,
    /// The pool's id, kept as `chunk` is.
    id: u32,
}

// SAFETY: the mapping is this value's alone to unmap; the header it points at is made for use
// from any thread of any process (atomics and the mutex).
unsafe impl Send for PoolMap {}
// SAFETY: as above.
unsafe impl Sync for PoolMap {}

impl PoolMap {
    /// Maps bytes `0..len` of `fd` (the whole file, `name` in errors), aligned for the largest
    /// block alignment.
    ///
    /// Every process maps it writable, readers too: each carves it, and a read-only mapping
    /// cannot be registered with CUDA on every GPU (B300).
    ///
    /// # Errors
    /// [`Error::PoolReadOnly`] when `fd` is open read-only, or the kernel refuses a writable
    /// shared mapping of it (`EACCES`, `EPERM`); [`Error::PoolDescriptor`] when it is open
    /// write-only or as a path only (`O_PATH`).
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize, name: PathBuf) -> Result<PoolMap, Error> {
        check_access(fd, &name)?;
        let ptr = sys::map_shared(fd, len, MAX_ALIGN as usize).map_err(|e| match e {
            Error::Syscall {
                errno: libc::EACCES | libc::EPERM,
                ..
            } => Error::PoolReadOnly { path: name.clone() },
            e => e,
        })?;
        Ok(PoolMap {
            ptr,
            len,
            name,
            keep: AtomicBool::new(false),
            chunk: 0,
            id: 0,
        })
    }

    /// The pool's id (this process's copy).
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// The file's path, or `<fd N>`.
    pub(crate) fn name(&self) -> &Path {
        &self.name
    }

    /// The chunk no block crosses, each one registration (this process's copy).
    pub(crate) fn chunk(&self) -> u64 {
        self.chunk
    }

    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Leaves the range mapped when this is dropped: the driver may still hold part of it (an
    /// unregistration refused), and unmapping it would let a later mapping there fail to
    /// register.
    pub(crate) fn keep_mapped(&self) {
        self.keep.store(true, Ordering::Release);
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The header (meaningful once [`Self::check`] passed, or [`Self::init`] ran).
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the file is at least DATA_START bytes (checked before mapping), mapped while
        // `self` lives, and page aligned, which is enough for the header.
        unsafe { &*self.ptr.as_ptr().cast::<Header>() }
    }

    /// Writes the header of a new pool and publishes it (the magic last).
    ///
    /// # Safety
    /// The file is new (all zeros) and no other process uses it yet.
    pub(crate) unsafe fn init(&mut self, node: usize, huge: bool, chunk: u64) -> Result<(), Error> {
        let header = self.ptr.as_ptr().cast::<Header>();
        let id = sys::random_u32()?;
        // SAFETY: the caller's file, ours alone until the magic is stored; the fields are
        // plain data at their place in the mapping.
        unsafe {
            (*header).kind = KIND;
            (*header).version = VERSION;
            (*header).layout = LAYOUT;
            (*header).size = self.len as u64;
            (*header).node = node as u32;
            (*header).huge = u32::from(huge);
            (*header).chunk = chunk;
            (*header).creator = sys::process_id();
            (*header).id = id;
            RobustMutex::init(std::ptr::addr_of_mut!((*header).mutex))?;
            RobustMutex::init(std::ptr::addr_of_mut!((*header).register))?;
            (*UnsafeCell::raw_get(std::ptr::addr_of!((*header).carve))).init(
                DATA_START as u64,
                self.len as u64,
                chunk,
            );
        }
        self.chunk = chunk;
        self.id = id;
        self.header().magic.store(MAGIC, Ordering::Release);
        Ok(())
    }

    /// Checks that the mapping holds a pool of this build whose size is the file's, and keeps
    /// its chunk.
    pub(crate) fn check(&mut self) -> Result<(), Error> {
        let path = self.name.as_path();
        let header = self.header();
        check_magic(header.magic.load(Ordering::Acquire), path)?;
        if (header.kind, header.version) != (KIND, VERSION) {
            return Err(Error::PoolVersion {
                path: path.into(),
                found: (header.kind, header.version),
                expected: (KIND, VERSION),
            });
        }
        let differs = header.layout.iter().zip(LAYOUT).zip(LAYOUT_FIELDS);
        if let Some(((&found, expected), field)) = differs.into_iter().find(|((a, b), _)| **a != *b)
        {
            return Err(Error::PoolLayout {
                path: path.into(),
                field,
                found,
                expected,
            });
        }
        let corrupt = |reason| Error::PoolCorrupt {
            path: path.into(),
            reason,
        };
        if header.size > self.len as u64 {
            return Err(corrupt(
                "the file is shorter than the pool's size in its header (truncated)",
            ));
        }
        if header.size != self.len as u64 {
            return Err(corrupt(
                "the file is longer than the pool's size in its header",
            ));
        }
        if header.chunk == 0 || !header.chunk.is_multiple_of(MAX_ALIGN) {
            return Err(corrupt("its chunk size is not a multiple of 2 MiB"));
        }
        // SAFETY: the header's carving state, in this mapping; its geometry is set once, when
        // the pool is made.
        let geometry = unsafe { carve::geometry(header.carve.get()) };
        if geometry != (DATA_START as u64, header.size, header.chunk) {
            // Blocks could straddle two registrations, or lie over the header.
            return Err(corrupt(
                "its carving state's bounds or chunk differ from its header's",
            ));
        }
        (self.chunk, self.id) = (header.chunk, header.id);
        Ok(())
    }

    /// Whether the creator finished placing and populating it.
    pub(crate) fn ready(&self) -> bool {
        self.header().ready.load(Ordering::Acquire) != 0
    }

    /// Says the pool is placed, populated and checked.
    pub(crate) fn set_ready(&self) {
        self.header().ready.store(1, Ordering::Release);
    }

    /// Places the blocks' pages on `node` (`mbind`, before any is touched), populates them with
    /// the node's bound workers (`cpus`, up to `threads`), and checks where they are
    /// ([`Self::count_elsewhere`]).
    ///
    /// # Safety
    /// The pool is new: no page of its blocks was touched, and no other process uses them yet.
    pub(crate) unsafe fn place(
        &self,
        node: usize,
        cpus: impl FnOnce() -> Vec<usize>,
        threads: usize,
        huge: bool,
    ) -> Result<(), Error> {
        let span = Span {
            addr: self.ptr.as_ptr() as usize + DATA_START,
            len: self.len - DATA_START,
        };
        // SAFETY: the blocks' part of our mapping, which the caller says nobody else uses yet;
        // the part is dropped before this returns.
        let Some(mut part) = (unsafe { span.claim(None) }) else {
            return Err(Error::InvalidRange {
                addr: span.addr,
                len: span.len,
            });
        };
        let flags = MbindFlags {
            strict: true,
            move_existing: false,
        };
        match part.bind(MemPolicy::Bind, &NodeMask::single(node)?, flags) {
            // No NUMA here (seccomp, a kernel without it): the pages go where the kernel puts
            // them, as for the allocator's own blocks; the page check says where.
            Ok(()) | Err(Error::NumaUnavailable { .. }) => {}
            Err(e) => return Err(e),
        }
        if !huge {
            part.advise_huge(true);
        }
        workers::populate(Some(node), cpus, &mut part, threads, !huge)?;
        Ok(())
    }

    /// Maps the pool's pages, populated by its creator, into this process's page tables
    /// (`MADV_POPULATE_READ`: nothing is allocated nor written), so that the page check sees
    /// them and first touches do not fault.
    pub(crate) fn map_in_pages(&self) {
        // SAFETY: our mapping, whole, mapped while `self` lives.
        let _ = unsafe { sys::map_in(self.ptr, self.len) };
    }

    /// How many of the blocks' pages are not on `node` (`move_pages`; pages not resident count
    /// when `absent_counts`), of how many, and a node one of them is on; `None` when the kernel
    /// does not say (`move_pages` refused).
    pub(crate) fn count_elsewhere(
        &self,
        node: usize,
        absent_counts: bool,
    ) -> Option<(usize, usize, i32)> {
        let ptr = NonNull::new(self.ptr.as_ptr().wrapping_add(DATA_START))?;
        let (mut elsewhere, mut pages, mut found) = (0, 0, node as i32);
        // SAFETY: the blocks' part of our mapping, mapped while `self` lives.
        let checked = unsafe {
            sys::page_nodes(ptr, self.len - DATA_START, |_, n| {
                pages += 1;
                if n != node as i32 && (n >= 0 || absent_counts) {
                    elsewhere += 1;
                    found = n;
                }
            })
        };
        checked.ok().map(|()| (elsewhere, pages, found))
    }

    /// Takes the pool's lock (waiting at most `wait`), then admits
    /// the carving state ([`Carve::admit`]): whole, or rebuilt when its holder died or it does
    /// not hold together (a stray write), so that no operation reads a count, index or extent
    /// past its table.
    ///
    /// # Errors
    /// [`Error::PoolLockHeld`] when another process held it all of `wait`, naming it;
    /// [`Error::PoolCorrupt`] when the lock is unrecoverable (`ENOTRECOVERABLE`: a holder died
    /// and the next one released it without repairing the state), or the state could not be
    /// made whole.
    pub(crate) fn lock(&self, wait: Duration) -> Result<PoolGuard<'_>, Error> {
        let header = self.header();
        let locked = header.mutex.lock_for(wait);
        let locked = self.locked(locked, CARVING, &header.holder, wait)?;
        let mut guard = PoolGuard { header };
        let admitted = guard.carve().admit(
            DATA_START as u64,
            self.len as u64,
            self.chunk,
            locked == Locked::OwnerDied,
        );
        if locked == Locked::OwnerDied && admitted != Admit::Broken {
            // SAFETY: held after its owner died, and the state is rebuilt. A broken one is
            // left unmarked: the next locker finds the lock unrecoverable, the pool fenced.
            unsafe { header.mutex.mark_consistent() }?;
        }
        if admitted == Admit::Broken {
            return Err(Error::PoolCorrupt {
                path: self.name.clone(),
                reason: "its carving state does not hold together even after a rebuild",
            });
        }
        Ok(guard)
    }

    /// Takes the lock every process's chunk registrations of this pool are serialised by,
    /// waiting in slices so that `cancel` stops the wait, and at most `wait`; `None` when
    /// cancelled. A holder that died leaves nothing to repair.
    ///
    /// # Errors
    /// [`Error::PoolLockHeld`] when another process held it all of `wait`, naming it.
    pub(crate) fn lock_registration(
        &self,
        cancel: &AtomicBool,
        wait: Duration,
    ) -> Result<Option<RegistrationGuard<'_>>, Error> {
        let header = self.header();
        let start = Instant::now();
        loop {
            if cancel.load(Ordering::Acquire) {
                return Ok(None);
            }
            let slice = WAIT_SLICE.min(wait.saturating_sub(start.elapsed()));
            match header.register.lock_for(slice)? {
                Some(locked) => {
                    if locked == Locked::OwnerDied {
                        // SAFETY: held after its owner died; it guards no state.
                        unsafe { header.register.mark_consistent() }?;
                    }
                    header
                        .register_holder
                        .store(sys::process_id(), Ordering::Release);
                    return Ok(Some(RegistrationGuard { header }));
                }
                None if start.elapsed() >= wait => {
                    return Err(self.held(REGISTRATION, &header.register_holder, wait));
                }
                None => {}
            }
        }
    }

    /// Maps a lock's outcome to this pool's errors, recording this process as its holder.
    fn locked(
        &self,
        locked: Result<Option<Locked>, Error>,
        lock: &'static str,
        holder: &AtomicU32,
        wait: Duration,
    ) -> Result<Locked, Error> {
        let locked = locked.map_err(|e| match e {
            Error::Syscall {
                errno: libc::ENOTRECOVERABLE,
                ..
            } => Error::PoolCorrupt {
                path: self.name.clone(),
                reason: "its lock is unrecoverable (a process died holding it, and the state it \
                         guards was not repaired after)",
            },
            e => e,
        })?;
        let locked = locked.ok_or_else(|| self.held(lock, holder, wait))?;
        holder.store(sys::process_id(), Ordering::Release);
        Ok(locked)
    }

    /// The error for a lock another process held all of `wait`.
    fn held(&self, lock: &'static str, holder: &AtomicU32, wait: Duration) -> Error {
        Error::PoolLockHeld {
            path: self.name.clone(),
            lock,
            pid: holder.load(Ordering::Acquire),
            waited_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// Refuses a descriptor a writable shared mapping cannot be made of.
pub(crate) fn check_access(fd: BorrowedFd<'_>, name: &Path) -> Result<(), Error> {
    let access = match sys::access_mode(fd)? {
        sys::Access::ReadWrite => return Ok(()),
        sys::Access::ReadOnly => return Err(Error::PoolReadOnly { path: name.into() }),
        sys::Access::WriteOnly => "write-only (O_WRONLY)",
        sys::Access::PathOnly => "as a path only (O_PATH)",
    };
    Err(Error::PoolDescriptor {
        path: name.into(),
        access,
    })
}

impl Drop for PoolMap {
    fn drop(&mut self) {
        if self.keep.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: our mapping, whole; its owner unregistered every chunk before dropping it,
        // and nothing points into it afterwards (blocks are used through the pool's borrow).
        let _ = unsafe { sys::unmap(self.ptr, self.len) };
    }
}

/// The pool's lock, held: the carving state is the holder's.
pub(crate) struct PoolGuard<'a> {
    header: &'a Header,
}

impl PoolGuard<'_> {
    pub(crate) fn carve(&mut self) -> &mut Carve {
        // SAFETY: the mutex is held while the guard lives, and the guard is borrowed mutably.
        unsafe { &mut *self.header.carve.get() }
    }
}

impl Drop for PoolGuard<'_> {
    fn drop(&mut self) {
        self.header.holder.store(0, Ordering::Release);
        // SAFETY: this thread took the lock when it made the guard.
        unsafe { self.header.mutex.unlock() };
    }
}

/// The pool's registration lock, held.
pub(crate) struct RegistrationGuard<'a> {
    header: &'a Header,
}

impl Drop for RegistrationGuard<'_> {
    fn drop(&mut self) {
        self.header.register_holder.store(0, Ordering::Release);
        // SAFETY: this thread took the lock when it made the guard.
        unsafe { self.header.register.unlock() };
    }
}

#[cfg(test)]
mod tests;
