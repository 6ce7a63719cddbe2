//! Where chunk memory comes from: the seam between the arena's chunks and the memory they carve.
//!
//! A [`ChunkSource`] maps the memory of a chunk, gives it back, and drops the pages of an idle
//! range; the allocator does the rest on the mapping whatever its source: places it (`mbind`),
//! populates it with the node's bound workers, checks where its pages are and registers it with
//! CUDA. [`Anonymous`] (private anonymous `mmap`) is the source of every chunk and dedicated
//! block; a shared pool maps its memory file itself (`pool/`), outside this seam.
//!
//! Unsafe code here relies on the contract of [`ChunkSource`]; [`Anonymous`] meets it with
//! fresh private mappings of its own.
#![allow(unsafe_code)]

use std::fmt;
use std::ptr::NonNull;

use crate::sys;
use crate::Error;

/// A source of chunk memory.
///
/// # Safety
///
/// For every range `map(len, align)` returns, an implementation promises that:
/// - `ptr..ptr+len` is mapped readable and writable, starts at a multiple of `align`, and is used
///   by nobody but the caller until the caller passes that same whole range to
///   [`unmap`](Self::unmap), once;
/// - its pages read as zero until written, and again after [`purge`](Self::purge) of them (the
///   arena zeroes only what may hold old data);
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
