//! Shared pools: one memory file that several processes map, its pages placed on one node and
//! populated once, carved by every process that maps it. This module holds what lives in the
//! file: the header at its start ([`Header`]: magic, kind, layout version, layout tag, size, node,
//! chunk size, who made it and whether it is ready, how many processes are attached and how many
//! registrations they hold) and the extent table (`extents/`) under the header's carving lock;
//! this process's view of the file ([`Pool`]: its [`Memory`], mapped through the file's
//! [`SharedFile`] source, which also holds this process's registrations of its chunks, and its
//! keys to the pool's locks, `locks.rs`); and the steps that make each chunk ready (`chunks.rs`,
//! through the one placer: place, populate, check, register). The front end (`shared.rs`)
//! opens the files and runs the registrations in the background.
//!
//! Unsafe code here relies on the header being at the start of the mapping of the pool's file
//! that the [`Pool`]'s memory owns: its fields are written once, by the creator, before the
//! magic says the header is there, and afterwards change only as atomics or under the mutex.
#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::mem::{align_of, size_of};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) mod chunks;
pub(crate) mod extents;
mod locks;

use crate::chunk::{Mapping, Memory, SharedFile};
use crate::sys::{self, SharedMutex};
use crate::Error;
use extents::{ExtentTable, MAX_ALIGN};
pub(crate) use locks::PoolGuard;
use locks::PoolKeys;

/// The first eight bytes of a pool's file.
const MAGIC: u64 = u64::from_le_bytes(*b"NGApool\0");
/// What the file holds (a pool carved in extents), and the layout of its header.
pub(crate) const KIND: u32 = 1;
pub(crate) const VERSION: u32 = 6;
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
    "extent table size",
    "extent table alignment",
    "pointer width (bits)",
    "byte order mark",
    "C library (1 glibc, 2 musl, 3 other)",
];

/// This build's layout tag (see [`LAYOUT_FIELDS`]).
const LAYOUT: [u32; 9] = [
    size_of::<Header>() as u32,
    align_of::<Header>() as u32,
    size_of::<SharedMutex>() as u32,
    align_of::<SharedMutex>() as u32,
    size_of::<ExtentTable>() as u32,
    align_of::<ExtentTable>() as u32,
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
    /// The pool's id, random, set when it is made: a handle carries it ([`Pool::id`]).
    id: u32,
    /// Serialises the chunk registrations of every process attached, so that two never hold
    /// the driver's lock for this pool at once; reachable only by the pool's own users (no
    /// file another user can open and hold).
    register: SharedMutex,
    /// The carving lock: the extent table is its holder's.
    mutex: SharedMutex,
    extents: UnsafeCell<ExtentTable>,
}

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

/// A pool's file as this process maps it: its [`Memory`] (the whole file mapped through its
/// [`SharedFile`] source, and this process's registrations of its chunks, one range each,
/// unregistered before the mapping goes), this process's copy of the header's chunk and id,
/// which another process's stray write to the header cannot change, and its keys to the
/// pool's locks.
#[derive(Debug)]
pub(crate) struct Pool {
    memory: Memory,
    file: Arc<SharedFile>,
    /// The file's path, or `<fd N>`: what its errors name.
    name: PathBuf,
    chunk: u64,
    id: u32,
    keys: PoolKeys,
}

/// Maps bytes `0..len` of `fd` (the whole file, `name` in errors) through its source, aligned
/// for the largest block alignment.
///
/// Every process maps it writable, readers too: each carves it, and a read-only mapping
/// cannot be registered with CUDA on every GPU (B300).
///
/// # Errors
/// [`Error::PoolReadOnly`] when `fd` is open read-only, or the kernel refuses a writable
/// shared mapping of it (`EACCES`, `EPERM`); [`Error::PoolDescriptor`] when it is open
/// write-only or as a path only (`O_PATH`).
pub(crate) fn map(
    fd: OwnedFd,
    len: usize,
    name: &Path,
) -> Result<(Mapping, Arc<SharedFile>), Error> {
    check_access(fd.as_fd(), name)?;
    let file = Arc::new(SharedFile::new(fd));
    let mapping = Mapping::held(file.clone(), len, MAX_ALIGN as usize).map_err(|e| match e {
        Error::Syscall {
            errno: libc::EACCES | libc::EPERM,
            ..
        } => Error::PoolReadOnly { path: name.into() },
        e => e,
    })?;
    Ok((mapping, file))
}

impl Pool {
    /// Writes the header of a new pool into `mapping` (of `file`) and publishes it (the magic
    /// last); its chunks are `chunk` bytes from [`DATA_START`].
    ///
    /// # Safety
    /// The file is new (all zeros) and no other process uses it yet.
    pub(crate) unsafe fn init(
        mapping: Mapping,
        file: Arc<SharedFile>,
        name: PathBuf,
        (node, huge, chunk): (usize, bool, u64),
    ) -> Result<Pool, Error> {
        let len = mapping.len();
        let header = mapping.ptr().as_ptr().cast::<Header>();
        let id = sys::random_u32()?;
        // SAFETY: the caller's file, ours alone until the magic is stored; the fields are
        // plain data at their place in the mapping, which is at least DATA_START long.
        unsafe {
            (*header).kind = KIND;
            (*header).version = VERSION;
            (*header).layout = LAYOUT;
            (*header).size = len as u64;
            (*header).node = node as u32;
            (*header).huge = u32::from(huge);
            (*header).chunk = chunk;
            (*header).creator = sys::process_id();
            (*header).id = id;
            SharedMutex::init(std::ptr::addr_of_mut!((*header).mutex));
            SharedMutex::init(std::ptr::addr_of_mut!((*header).register));
            (*UnsafeCell::raw_get(std::ptr::addr_of!((*header).extents))).init(
                DATA_START as u64,
                len as u64,
                chunk,
            );
        }
        // SAFETY: written above, in the mapping `mapping` keeps.
        let keys = PoolKeys::new(file.fd(), unsafe { &*header }, &name)?;
        let pool = Pool {
            memory: Memory::ranged(mapping, DATA_START, chunk as usize)?,
            file,
            name,
            chunk,
            id,
            keys,
        };
        pool.header().magic.store(MAGIC, Ordering::Release);
        Ok(pool)
    }

    /// Checks that `mapping` (of `file`) holds a pool of this build whose size is the file's,
    /// and keeps its chunk and id.
    pub(crate) fn check(
        mapping: Mapping,
        file: Arc<SharedFile>,
        name: PathBuf,
    ) -> Result<Pool, Error> {
        let path = name.as_path();
        // SAFETY: the file is at least DATA_START bytes (checked before mapping), mapped while
        // `mapping` lives, and page aligned, which is enough for the header.
        let header = unsafe { &*mapping.ptr().as_ptr().cast::<Header>() };
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
        let len = mapping.len() as u64;
        if header.size > len {
            return Err(corrupt(
                "the file is shorter than the pool's size in its header (truncated)",
            ));
        }
        if header.size != len {
            return Err(corrupt(
                "the file is longer than the pool's size in its header",
            ));
        }
        if header.chunk == 0 || !header.chunk.is_multiple_of(MAX_ALIGN) {
            return Err(corrupt("its chunk size is not a multiple of 2 MiB"));
        }
        // SAFETY: the header's extent table, in this mapping; its geometry is set once, when
        // the pool is made.
        let geometry = unsafe { extents::geometry(header.extents.get()) };
        if geometry != (DATA_START as u64, header.size, header.chunk) {
            // Blocks could straddle two registrations, or lie over the header.
            return Err(corrupt(
                "its extent table's bounds or chunk differ from its header's",
            ));
        }
        let (chunk, id) = (header.chunk, header.id);
        let keys = PoolKeys::new(file.fd(), header, &name)?;
        Ok(Pool {
            memory: Memory::ranged(mapping, DATA_START, chunk as usize)?,
            file,
            name,
            chunk,
            id,
            keys,
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

    /// The mapping's start (this process's address of the pool's offset 0).
    pub(crate) fn base(&self) -> usize {
        self.memory.base()
    }

    pub(crate) fn len(&self) -> usize {
        self.memory.len()
    }

    /// The pool's memory: its mapping and this process's registrations of its chunks.
    pub(crate) fn memory(&self) -> &Memory {
        &self.memory
    }

    /// The pool's memory, to disown its registrations in a forked child.
    pub(crate) fn memory_mut(&mut self) -> &mut Memory {
        &mut self.memory
    }

    /// The file's descriptor.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.file.fd()
    }

    /// The header (as [`Self::init`] wrote it or [`Self::check`] found it).
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the mapping is the whole file, at least DATA_START bytes (checked before
        // mapping), mapped while `self.memory` lives (a pool's memory is released only when
        // dropped), and page aligned, which is enough for the header.
        unsafe { &*(self.memory.base() as *const Header) }
    }

    /// Whether the creator finished placing and populating it.
    pub(crate) fn ready(&self) -> bool {
        self.header().ready.load(Ordering::Acquire) != 0
    }

    /// Says the pool is placed, populated and checked.
    pub(crate) fn set_ready(&self) {
        self.header().ready.store(1, Ordering::Release);
    }

    /// Maps the pool's pages, populated by its creator, into this process's page tables
    /// (`MADV_POPULATE_READ`: nothing is allocated nor written), so that the page check sees
    /// them and first touches do not fault.
    pub(crate) fn map_in_pages(&self) {
        if let Some(ptr) = NonNull::new(self.memory.base() as *mut u8) {
            // SAFETY: our mapping, whole, mapped while `self` lives.
            let _ = unsafe { sys::map_in(ptr, self.memory.len()) };
        }
    }

    /// Checks where the pages of `offset..offset+len` of the pool are (`move_pages`, counted
    /// by [`sys::census`]); `Ok` too when the kernel does not say (`move_pages` refused).
    ///
    /// # Errors
    /// [`Error::PoolWrongNode`] when some are on another node than `node`, or, when
    /// `absent_counts`, not resident.
    pub(crate) fn check_node(
        &self,
        offset: usize,
        len: usize,
        node: usize,
        absent_counts: bool,
    ) -> Result<(), Error> {
        let Some(ptr) = NonNull::new(self.base().wrapping_add(offset) as *mut u8) else {
            return Ok(());
        };
        // SAFETY: a range of our mapping (the caller's offsets), mapped while `self` lives.
        let Ok(census) = (unsafe { sys::census(ptr, len, node) }) else {
            return Ok(());
        };
        let elsewhere = census.elsewhere + if absent_counts { census.absent } else { 0 };
        if elsewhere == 0 {
            return Ok(());
        }
        // A page off the node, for the error: where it is, or its status.
        let mut found = node as i32;
        // SAFETY: as above.
        let _ = unsafe {
            sys::page_nodes(ptr, len, |_, n| {
                if n != node as i32 && (n >= 0 || absent_counts) && found == node as i32 {
                    found = n;
                }
            })
        };
        Err(Error::PoolWrongNode {
            path: self.name.clone(),
            node,
            elsewhere,
            pages: census.pages,
            found,
        })
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

#[cfg(test)]
mod tests;
