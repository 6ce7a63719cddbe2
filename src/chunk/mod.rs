//! Chunks: the mappings the arenas carve blocks from, and the guards that own every resource
//! below a block (`memory.rs`): a chunk, a dedicated block or a shared pool holds a [`Memory`]
//! (its mapping and its registrations, `ranges.rs`: the whole mapping, or one per chunk of a
//! pool), released once, every range unregistered before the mapping is unmapped. Where the
//! memory comes from is a [`ChunkSource`] (`source.rs`): anonymous memory for chunks and
//! dedicated blocks, a shared memory file ([`SharedFile`]) for a pool.
//!
//! A chunk is one mapping of one kind (node, policy, pinning flags), made in four steps:
//!
//! 1. `mmap` of 32 MiB to 1 GiB, 2 MiB aligned ([`Mapping`]);
//! 2. `madvise(MADV_HUGEPAGE)` for chunks that serve blocks of 2 MiB and more, `MADV_NOHUGEPAGE`
//!    for the others (a small block must not make a whole huge page resident);
//! 3. `mbind` of the whole chunk, once;
//! 4. with pinning: populate the whole chunk and `cuMemHostRegister` it, once
//!    ([`Memory::register`]); a registration never covers more than one chunk, so a block carved
//!    from it never straddles two.
//!
//! Unpinned chunks are populated (or, when blocks are faulted in where touched, handed out) as
//! they are carved: the chunk keeps, per granule (2 MiB in a huge-page chunk, where the kernel
//! faults whole huge pages, else a page), whether it may be resident and whether it may hold data
//! ("dirty"), so that each granule is populated once and zeroed only when it may not be zero.
//! Purging (`MADV_DONTNEED`) whole idle granules clears both.
//!
//! The bit bookkeeping runs under the arena lock and makes no system call; the calls themselves
//! (populating a [`Part`] claimed from a [`Span`], [`purge`]) run outside it, on ranges the
//! caller owns for the time being.
//!
//! Unsafe code here relies on the guards owning their mapping and registration alone; `purge` is
//! called only on a range taken out of its carver.
#![allow(unsafe_code)]

use std::ptr::NonNull;

mod memory;
mod place;
mod ranges;
mod source;

pub(crate) use memory::{ChunkRelease, Mapping, Memory, Part};
pub(crate) use place::{Cause, Numa, PinPolicy, Place, Placer, Progress, Rules, Seams};
pub(crate) use ranges::{page_locked_bytes, PinFlags};
#[cfg(target_os = "linux")]
pub(crate) use source::SharedFile;
pub(crate) use source::{ChunkSource, ANONYMOUS};

use crate::Error;

/// A byte range of a chunk that the caller populates, zeroes or purges outside the arena lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl Span {
    pub(crate) fn ptr(self) -> Option<NonNull<u8>> {
        NonNull::new(self.addr as *mut u8)
    }

    /// The part of the span inside `addr..addr+len`, if any.
    fn clip(self, addr: usize, len: usize) -> Option<Span> {
        let start = self.addr.max(addr);
        let end = (self.addr + self.len).min(addr.saturating_add(len));
        (start < end).then_some(Span {
            addr: start,
            len: end - start,
        })
    }
}

/// One bit per granule, in 64-bit words.
#[derive(Debug)]
struct Bits(Box<[u64]>);

impl Bits {
    fn new(granules: usize, set: bool) -> Result<Bits, Error> {
        let words = granules.div_ceil(64);
        let mut bits = Vec::new();
        bits.try_reserve_exact(words).map_err(|_| Error::Syscall {
            call: "chunk bitmap allocation",
            errno: libc::ENOMEM,
        })?;
        bits.resize(words, if set { u64::MAX } else { 0 });
        // Exactly as long as reserved: no reallocation.
        Ok(Bits(bits.into_boxed_slice()))
    }

    fn get(&self, i: usize) -> bool {
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    fn set(&mut self, i: usize, on: bool) {
        if let Some(w) = self.0.get_mut(i / 64) {
            if on {
                *w |= 1 << (i % 64);
            } else {
                *w &= !(1 << (i % 64));
            }
        }
    }
}

/// A chunk: its memory (mapping and registration), and which granules are resident or dirty.
#[derive(Debug)]
pub(crate) struct Chunk {
    memory: Memory,
    granule_shift: u32,
    populated: Bits,
    dirty: Bits,
    resident: usize,
    /// Made by a reservation: kept when idle, until trimmed or memory runs short.
    reserved: bool,
}

impl Chunk {
    /// An unregistered chunk of `mapping` (a multiple of `granule` long, from a source for the
    /// whole process: the arena purges through it), with nothing resident, tracked in granules
    /// of `granule` bytes (a power of two).
    pub(crate) fn new(mapping: Mapping, granule: usize) -> Result<Chunk, Error> {
        let granules = mapping.len().div_ceil(granule);
        if mapping.process_source().is_none() {
            return Err(Error::InvalidRange {
                addr: mapping.ptr().as_ptr() as usize,
                len: mapping.len(),
            });
        }
        Ok(Chunk {
            populated: Bits::new(granules, false)?,
            dirty: Bits::new(granules, false)?,
            resident: 0,
            granule_shift: granule.trailing_zeros(),
            memory: Memory::new(mapping),
            reserved: false,
        })
    }

    /// Marks the chunk as made by a reservation (see [`Self::reserved`]).
    pub(crate) fn set_reserved(&mut self) {
        self.reserved = true;
    }

    /// Whether a reservation made it: decay leaves it alone.
    pub(crate) fn reserved(&self) -> bool {
        self.reserved
    }

    /// Registers the whole chunk with `register`, which faults in every page not yet resident
    /// (under the chunk's policy): all of it is resident afterwards. The caller populated and
    /// checked it first.
    pub(crate) fn register(
        &mut self,
        register: impl FnOnce(&mut Memory) -> Result<(), Error>,
    ) -> Result<(), Error> {
        register(&mut self.memory)?;
        let granules = self.len().div_ceil(1 << self.granule_shift);
        for g in 0..granules {
            self.populated.set(g, true);
        }
        self.resident = self.len();
        Ok(())
    }

    /// Where the chunk's memory came from.
    pub(crate) fn source(&self) -> &'static dyn ChunkSource {
        // A chunk's source is one for the whole process (`Chunk::new`); anonymous once released.
        self.memory.source().unwrap_or(&ANONYMOUS)
    }

    pub(crate) fn base(&self) -> usize {
        self.memory.base()
    }

    pub(crate) fn len(&self) -> usize {
        self.memory.len()
    }

    pub(crate) fn pinned(&self) -> bool {
        self.memory.pinned()
    }

    /// Bytes of resident granules.
    pub(crate) fn resident(&self) -> usize {
        self.resident
    }

    /// The granules `[first, last]` that `addr..addr+len` touches (clipped to the chunk).
    fn touched(&self, addr: usize, len: usize) -> Option<(usize, usize)> {
        let (base, end) = (self.base(), self.base() + self.len());
        let (start, stop) = (addr.max(base), addr.saturating_add(len).min(end));
        (start < stop).then(|| {
            (
                (start - base) >> self.granule_shift,
                (stop - 1 - base) >> self.granule_shift,
            )
        })
    }

    /// The span of granules `first..=last`, clipped to the chunk.
    fn span(&self, first: usize, last: usize) -> Span {
        let base = self.base();
        let addr = base + (first << self.granule_shift);
        let end = (base + ((last + 1) << self.granule_shift)).min(base + self.len());
        Span {
            addr,
            len: end - addr,
        }
    }

    /// Marks the granules of `addr..addr+len` resident and returns the part of that range the
    /// caller must populate now (from the first to the last granule that was not), if any.
    /// Clipped to the range: a granule shared with a neighbour is populated only in the
    /// caller's part (the rest faults in on first touch; in a huge-page chunk the kernel makes
    /// the whole huge page resident anyway), so that populating never writes to memory another
    /// block may use (the touch fallback of old kernels writes a zero per page).
    ///
    /// A populate that fails leaves the granules marked: "resident" only ever means "may be
    /// resident", which is what zeroing and purging must assume.
    pub(crate) fn plan_populate(&mut self, addr: usize, len: usize) -> Option<Span> {
        let (first, last) = self.touched(addr, len)?;
        let mut todo: Option<(usize, usize)> = None;
        for g in first..=last {
            if !self.populated.get(g) {
                self.populated.set(g, true);
                self.resident += 1 << self.granule_shift;
                todo = Some(todo.map_or((g, g), |(f, _)| (f, g)));
            }
        }
        todo.and_then(|(f, l)| self.span(f, l).clip(addr, len))
    }

    /// Marks every granule resident and returns the part never populated yet, to populate while
    /// the chunk is borrowed: a chunk being made, nobody else's yet.
    pub(crate) fn plan_populate_whole(&mut self) -> Option<Part<'_>> {
        let base = self.base();
        let span = self.plan_populate(base, self.len())?;
        self.memory.part(span.addr - base, span.len)
    }

    /// `span` of the chunk as a part its caller uses alone (`None` outside the chunk); the part
    /// of an unpinned chunk not reserved may give its pages back ([`Part::clear`]).
    ///
    /// # Safety
    /// The carver took the span out for the caller (a block just handed out, or the room it just
    /// grew into): nobody else uses it until the caller hands it to its user or back to the
    /// carver, after which the part is not used.
    pub(crate) unsafe fn claim(&self, span: Span) -> Option<Part<'static>> {
        let inside = span.addr >= self.base()
            && span
                .addr
                .checked_add(span.len)
                .is_some_and(|end| end <= self.base() + self.len());
        // Reserved room stays resident: its pages are written, never given back here.
        let source = (!self.pinned() && !self.reserved()).then(|| self.source());
        // SAFETY: inside this chunk's mapping, the caller's alone (forwarded); an unpinned
        // chunk's mapping is its source's and never registered.
        inside.then(|| unsafe { span.claim(source) }).flatten()
    }

    /// Marks the granules of `span` resident and dirty again (a purge of it failed).
    pub(crate) fn purge_failed(&mut self, span: Span) {
        if let Some((first, last)) = self.touched(span.addr, span.len) {
            for g in first..=last {
                if !self.populated.get(g) {
                    self.populated.set(g, true);
                    self.resident += 1 << self.granule_shift;
                }
                self.dirty.set(g, true);
            }
        }
    }

    /// Whether any granule that `addr..addr+len` touches may be resident.
    pub(crate) fn any_resident(&self, addr: usize, len: usize) -> bool {
        self.touched(addr, len)
            .is_some_and(|(first, last)| (first..=last).any(|g| self.populated.get(g)))
    }

    /// Hands `addr..addr+len` out: marks it dirty, and returns the part that may not be zero
    /// (from the first to the last granule that was dirty), which a zeroed request must clear.
    pub(crate) fn hand_out(&mut self, addr: usize, len: usize) -> Option<Span> {
        let (first, last) = self.touched(addr, len)?;
        let mut dirty: Option<(usize, usize)> = None;
        for g in first..=last {
            if self.dirty.get(g) {
                dirty = Some(dirty.map_or((g, g), |(f, _)| (f, g)));
            }
            self.dirty.set(g, true);
        }
        dirty.and_then(|(f, l)| self.span(f, l).clip(addr, len))
    }

    /// Marks the whole granules inside the free range `addr..addr+len` as neither resident nor
    /// dirty and returns the span the caller must purge (`MADV_DONTNEED`): every one of them that
    /// may be resident or hold data. Never for a pinned chunk (registered pages cannot be
    /// dropped).
    pub(crate) fn plan_purge(&mut self, addr: usize, len: usize) -> Option<Span> {
        if self.pinned() {
            return None;
        }
        let (base, granule) = (self.base(), 1usize << self.granule_shift);
        // Chunks are whole granules long: rounding the end down stays inside the chunk.
        let start = addr.max(base).checked_sub(base)?.next_multiple_of(granule);
        let end = addr
            .saturating_add(len)
            .min(base + self.len())
            .checked_sub(base)?
            & !(granule - 1);
        if start >= end {
            return None;
        }
        let (first, last) = (start >> self.granule_shift, (end - 1) >> self.granule_shift);
        let mut resident: Option<(usize, usize)> = None;
        for g in first..=last {
            if self.populated.get(g) || self.dirty.get(g) {
                resident = Some(resident.map_or((g, g), |(f, _)| (f, g)));
            }
            if self.populated.get(g) {
                self.resident = self.resident.saturating_sub(granule);
            }
            // Every such granule lies in the span returned: cleared only as it is purged.
            self.populated.set(g, false);
            self.dirty.set(g, false);
        }
        resident.map(|(f, l)| self.span(f, l))
    }

    /// Unregisters (when registered), then unmaps (see [`Memory::release`]).
    pub(crate) fn release(self) -> ChunkRelease {
        self.memory.release()
    }
}

/// Gives the pages of `span` back to `source`, the source of the chunk it lies in (see
/// [`ChunkSource::purge`]).
///
/// # Safety
/// `span` lies in an unpinned chunk of `source`, and nobody uses it: it is free in the arena's
/// carver and held out of it (taken as in use) while this runs.
pub(crate) unsafe fn purge(source: &dyn ChunkSource, span: Span) -> Result<(), Error> {
    let Some(ptr) = span.ptr() else {
        return Ok(());
    };
    // SAFETY: forwarded from the caller: the range is the source's, unused, and not registered.
    unsafe { source.purge(ptr, span.len) }
}

#[cfg(test)]
mod tests;
