//! Where chunk memory comes from: the seam between the arena's chunks and the memory they carve.
//!
//! A [`ChunkSource`] maps the memory of a chunk, gives it back, and drops the pages of an idle
//! range; the allocator does the rest on the mapping whatever its source: places it (`mbind`),
//! populates it with the node's bound workers, checks where its pages are and registers it with
//! CUDA. [`Anonymous`] (private anonymous `mmap`) is the source of every chunk and dedicated
//! block; [`SharedFile`] (a `MAP_SHARED` mapping of a memory file) the source of a shared pool,
//! which each of its processes maps through it.
//!
//! Unsafe code here relies on the contract of [`ChunkSource`]; [`Anonymous`] meets it with
//! fresh private mappings of its own, [`SharedFile`] with one mapping of its file at a time.
#![allow(unsafe_code)]

use std::fmt;
#[cfg(target_os = "linux")]
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
#[cfg(target_os = "linux")]
use std::sync::atomic::{AtomicBool, Ordering};

use crate::sys;
use crate::Error;

/// A source of chunk memory.
///
/// # Safety
///
/// For every range `map(len, align)` returns, an implementation promises that:
/// - `ptr..ptr+len` is mapped readable and writable, starts at a multiple of `align`, and is used
///   in this process by nobody but the caller until the caller passes that same whole range to
///   [`unmap`](Self::unmap), once (a shared file's pages are also those of the other processes
///   that map the file: what they share is theirs to agree on);
/// - its pages read as zero until written, and again after [`purge`](Self::purge) of them (the
///   arena zeroes only what may hold old data); a shared file's read as the file holds them
///   (zero in a new file), which is why arenas take chunks only from sources for the whole
///   process, never from a file;
/// - the kernel's placement and populate calls work on it as on anonymous memory: `mbind` before
///   any page is touched decides where its pages go, `MADV_POPULATE_WRITE` faults them in, and
///   `cuMemHostRegister` may page-lock it;
/// - `map` and `purge` allocate nothing through the global allocator (they run inside it).
pub(crate) unsafe trait ChunkSource: Sync + fmt::Debug {
    /// A fresh range of `len` bytes (a multiple of the page size) at a multiple of `align` (a
    /// power of two, at least the page size), nothing populated.
    fn map(&self, len: usize, align: usize) -> Result<NonNull<u8>, Error>;

    /// Gives back a range [`map`](Self::map) returned.
    ///
    /// # Safety
    /// `ptr..ptr+len` is a whole range this source mapped, no longer used nor registered, and
    /// given back once.
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) -> Result<(), Error>;

    /// Drops the pages of `ptr..ptr+len` (whole pages inside one mapped range): afterwards they
    /// are not resident and read as zero.
    ///
    /// # Safety
    /// The range lies inside a range this source mapped, unused and unregistered while this runs.
    unsafe fn purge(&self, ptr: NonNull<u8>, len: usize) -> Result<(), Error>;

    /// Whether `mremap` moves its ranges' pages to another of its ranges (private anonymous
    /// memory: a dedicated block grows so, without a copy). False unless the source says so.
    fn moves_by_remap(&self) -> bool {
        false
    }
}

/// Private anonymous memory: `mmap` (aligned by trimming the slack), `munmap`, and
/// `MADV_DONTNEED`, after which the kernel hands out zero pages again.
#[derive(Debug)]
pub(crate) struct Anonymous;

/// The one anonymous source.
pub(crate) static ANONYMOUS: Anonymous = Anonymous;

// SAFETY: `map_anonymous` returns a fresh private mapping of exactly `len` bytes at `align`,
// which no one else knows of; anonymous pages read as zero until written and again after
// MADV_DONTNEED; mbind, populate and registration work on them; none of the three calls allocates.
unsafe impl ChunkSource for Anonymous {
    fn map(&self, len: usize, align: usize) -> Result<NonNull<u8>, Error> {
        sys::map_anonymous(len, align)
    }

    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) -> Result<(), Error> {
        // SAFETY: forwarded from the caller: a whole mapping of ours, no longer used.
        unsafe { sys::unmap(ptr, len) }
    }

    unsafe fn purge(&self, ptr: NonNull<u8>, len: usize) -> Result<(), Error> {
        // SAFETY: forwarded from the caller: inside a mapping of ours, unused, unregistered.
        unsafe { sys::advise_dontneed(ptr, len) }
    }

    fn moves_by_remap(&self) -> bool {
        true
    }
}

/// A memory file several processes map (a shared pool's `memfd`, or its file under `/dev/shm`
/// or a hugetlbfs mount): [`map`](ChunkSource::map) maps bytes `0..len` of it shared
/// (`MAP_SHARED`, readable and writable), one mapping at a time; `munmap` gives it back, and
/// `MADV_REMOVE` drops a range's pages from the file (they read as zero again, in every process
/// that maps it). Placement works on it as on anonymous memory, but sets the file's policy:
/// pages go where it says when first faulted, whichever process faults them. It owns the
/// file's descriptor; a mapping holds a share of it ([`Mapping::held`](super::Mapping::held)).
#[cfg(target_os = "linux")]
#[derive(Debug)]
pub(crate) struct SharedFile {
    fd: OwnedFd,
    /// Whether a mapping of it is live: a second one would alias the first's pages.
    mapped: AtomicBool,
}

#[cfg(target_os = "linux")]
impl SharedFile {
    /// The source of the file `fd` is.
    pub(crate) fn new(fd: OwnedFd) -> SharedFile {
        SharedFile {
            fd,
            mapped: AtomicBool::new(false),
        }
    }

    /// The file's descriptor.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

// SAFETY: `map_shared` maps the file fresh at an address of the kernel's choosing, and only one
// mapping is live at a time, so no other range of this process aliases it; a file's pages read
// as the file holds them, as the contract allows a file, and as zero after MADV_REMOVE; mbind,
// populate and registration work on shared file mappings; none of the calls allocates.
#[cfg(target_os = "linux")]
unsafe impl ChunkSource for SharedFile {
    fn map(&self, len: usize, align: usize) -> Result<NonNull<u8>, Error> {
        if self.mapped.swap(true, Ordering::AcqRel) {
            // One mapping of the file at a time: the pool maps it whole, once.
            return Err(Error::InvalidRange { addr: 0, len });
        }
        sys::map_shared(self.fd.as_fd(), len, align).inspect_err(|_| {
            self.mapped.store(false, Ordering::Release);
        })
    }

    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) -> Result<(), Error> {
        // SAFETY: forwarded from the caller: the whole mapping of the file, no longer used.
        unsafe { sys::unmap(ptr, len) }?;
        self.mapped.store(false, Ordering::Release);
        Ok(())
    }

    unsafe fn purge(&self, ptr: NonNull<u8>, len: usize) -> Result<(), Error> {
        // SAFETY: forwarded from the caller: inside the mapping, unused, unregistered.
        unsafe { sys::remove_pages(ptr, len) }
    }
}
