//! Chunks: the mappings the arenas carve blocks from, each resource owned by a guard.
//!
//! A chunk is one anonymous mapping of one kind (node, policy, pinning flags), made in four steps:
//!
//! 1. `mmap` of 32 MiB to 1 GiB, 2 MiB aligned ([`Mapping`]);
//! 2. `madvise(MADV_HUGEPAGE)` for chunks that serve blocks of 2 MiB and more, `MADV_NOHUGEPAGE`
//!    for the others (a small block must not make a whole huge page resident);
//! 3. `mbind` of the whole chunk, once;
//! 4. with pinning: populate the whole chunk and `cuMemHostRegister` it, once
//!    ([`Registration`]); a registration never covers more than one chunk, so a block carved
//!    from it never straddles two.
//!
//! Unpinned chunks are populated as they are carved: the chunk keeps, per granule (2 MiB in a
//! huge-page chunk, where the kernel faults whole huge pages, else a page), whether it is
//! resident and whether it may hold data ("dirty"), so that each granule is populated once and
//! zeroed only when it may not be zero. Purging (`MADV_DONTNEED`) whole idle granules clears both.
//!
//! The bit bookkeeping runs under the arena lock and makes no system call; the calls themselves
//! (populating a [`Span`] in `blocks/chunks.rs`, [`purge`]) run outside it, on ranges
//! the caller owns for the time being.
//!
//! Unsafe code here relies on the guards own their mapping and registration alone; `purge` is
//! called only on a range taken out of its carver.
#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod source;

pub(crate) use source::{ChunkSource, ANONYMOUS};

use crate::cuda::{Gpu, RegisterFlags};
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

/// A mapping from a [`ChunkSource`]; given back to it on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    source: &'static dyn ChunkSource,
}

// SAFETY: the mapping is this guard's alone; moving the guard between threads moves the right to
// unmap it, which any thread may exercise.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps `len` fresh bytes from `source` at a multiple of `align` (see [`ChunkSource::map`]).
    pub(crate) fn new(
        source: &'static dyn ChunkSource,
        len: usize,
        align: usize,
    ) -> Result<Mapping, Error> {
        let ptr = source.map(len, align)?;
        Ok(Mapping { ptr, len, source })
    }

    /// Where the mapping came from.
    pub(crate) fn source(&self) -> &'static dyn ChunkSource {
        self.source
    }

    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Gives up the mapping without unmapping it: the driver may still hold it (a failed
    /// unregistration), or a forked child's range is the parent's registration.
    fn leak(self) {
        std::mem::forget(self);
    }

    /// Lets the mapping outlive this guard, as a dedicated block: the block records its address
    /// and length, and [`release_dedicated`] adopts it back to unmap it.
    pub(crate) fn keep(self) -> NonNull<u8> {
        let ptr = self.ptr;
        self.leak();
        ptr
    }

    /// The anonymous mapping `ptr..ptr+len` that [`Self::keep`] kept (dedicated blocks are
    /// anonymous: they grow by `mremap`).
    ///
    /// # Safety
    /// That mapping exists, came from [`ANONYMOUS`], nothing uses it any more, and it is adopted
    /// once.
    unsafe fn adopt(ptr: NonNull<u8>, len: usize) -> Mapping {
        Mapping {
            ptr,
            len,
            source: &ANONYMOUS,
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the guard's source made this mapping, whole, and the guard owns it alone;
        // nothing uses it any more (the chunk that holds it is only dropped once no block of it
        // is live or pending), and a registration is released before its mapping.
        let _ = unsafe { self.source.unmap(self.ptr, self.len) };
    }
}

/// Bytes the process holds page-locked through the allocator: registered chunks and dedicated
/// blocks, counted from before each registration (so that two threads cannot both pass the
/// limit) until it is released.
static PAGE_LOCKED: AtomicUsize = AtomicUsize::new(0);

/// Bytes page-locked through the allocator now, in the whole process.
pub(crate) fn page_locked_bytes() -> usize {
    PAGE_LOCKED.load(Ordering::Relaxed)
}

/// Counts `len` more bytes as page-locked, unless that would pass `limit`.
pub(crate) fn take_page_locked(len: usize, limit: usize) -> Result<(), Error> {
    PAGE_LOCKED
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |pinned| {
            pinned.checked_add(len).filter(|&total| total <= limit)
        })
        .map(drop)
        .map_err(|pinned| Error::PinLimit {
            requested: len,
            pinned,
            limit,
        })
}

/// Counts `len` page-locked bytes as released (an unregistration, or a registration that
/// failed after [`take_page_locked`]).
pub(crate) fn give_page_locked(len: usize) {
    PAGE_LOCKED.fetch_sub(len, Ordering::AcqRel);
}

/// A `cuMemHostRegister` of a whole chunk, counted in the page-locked bytes while it lasts.
#[derive(Debug)]
pub(crate) struct Registration {
    gpu: &'static Gpu,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a registration may be released from any thread (the context is pushed for the call).
unsafe impl Send for Registration {}

impl Registration {
    /// Registers `ptr..ptr+len` whole through `gpu` (PORTABLE, plus DEVICEMAP and READ_ONLY as
    /// asked), unless that would page-lock more than `flags.limit` bytes in the process.
    ///
    /// # Safety
    /// The range is a live mapping of this crate, not registered yet, that stays mapped until
    /// the registration is released (a chunk releases it before its mapping, in
    /// `Chunk::release` and `Drop`).
    pub(crate) unsafe fn new(
        gpu: &'static Gpu,
        ptr: NonNull<u8>,
        len: usize,
        flags: PinFlags,
    ) -> Result<Registration, Error> {
        take_page_locked(len, flags.limit)?;
        // SAFETY: forwarded from the caller.
        let registered = unsafe { gpu.register(ptr, len, flags.register) };
        if let Err(e) = registered {
            give_page_locked(len);
            return Err(e);
        }
        Ok(Registration { gpu, ptr, len })
    }

    /// Lets the registration outlive this value without releasing it (releasing is always
    /// explicit: a chunk does it before unmapping): a dedicated block records it in its
    /// `Block`, and [`Self::adopt`] takes it back to release it.
    pub(crate) fn keep(self) {}

    /// The registration of `ptr..ptr+len` through `gpu` that [`Self::keep`] kept.
    ///
    /// # Safety
    /// That registration exists, is adopted once, and the range is still mapped.
    pub(crate) unsafe fn adopt(gpu: &'static Gpu, ptr: NonNull<u8>, len: usize) -> Registration {
        Registration { gpu, ptr, len }
    }

    /// Unregisters; an error means the range may still be the driver's and must stay mapped
    /// (and counted page-locked).
    pub(crate) fn release(self) -> Result<(), Error> {
        // SAFETY: `ptr` is the base of a successful registration, still mapped (the mapping is
        // released after this).
        unsafe { self.gpu.unregister(self.ptr) }?;
        give_page_locked(self.len);
        Ok(())
    }
}

/// Unregisters (if `registered_by` that device: a [`Registration`] kept) and unmaps a dedicated
/// block of `len` bytes at `addr` nobody uses any more; what it did, for the caller's counters. A failed unregistration leaves the block mapped: unmapping a range the
/// driver still holds would make a later mapping at this address fail to register (712), and in
/// a forked child the range may not be this block's any more.
///
/// # Safety
/// The block is a mapping of this crate no longer handed out or cached, released once.
pub(crate) unsafe fn release_dedicated(
    addr: usize,
    len: usize,
    registered_by: Option<u32>,
) -> ChunkRelease {
    let mut outcome = ChunkRelease::default();
    let Some(ptr) = NonNull::new(addr as *mut u8) else {
        return outcome;
    };
    // Through the process's context of the device that registered it.
    if let Some(gpu) = registered_by.and_then(Gpu::by_ordinal) {
        let start = Instant::now();
        // SAFETY: the block's registration, kept by `pin`, adopted once (the block is released
        // once); the block is still mapped.
        let unregistered = unsafe { Registration::adopt(gpu, ptr, len) }.release();
        let failed = unregistered.is_err();
        outcome.unregistered = Some((start.elapsed(), unregistered));
        if failed {
            return outcome;
        }
    }
    // SAFETY: the caller guarantees the block is ours, unused and released once.
    drop(unsafe { Mapping::adopt(ptr, len) });
    outcome.unmapped = true;
    outcome
}

/// How a range is registered: the driver's flags, and the pinned limit it must stay within.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PinFlags {
    /// The driver's flags.
    pub(crate) register: RegisterFlags,
    /// The most bytes the process may hold page-locked through the allocator.
    pub(crate) limit: usize,
}

/// What releasing a chunk did, for the counters.
#[derive(Debug, Default)]
pub(crate) struct ChunkRelease {
    /// The unregistration's time and outcome, when the chunk was registered.
    pub(crate) unregistered: Option<(Duration, Result<(), Error>)>,
    /// Whether the mapping was unmapped (false: kept, as the driver may still hold it).
    pub(crate) unmapped: bool,
}

/// One bit per granule, in 64-bit words.
#[derive(Debug)]
struct Bits(Vec<u64>);

impl Bits {
    fn new(granules: usize, set: bool) -> Result<Bits, Error> {
        let words = granules.div_ceil(64);
        let mut bits = Vec::new();
        bits.try_reserve_exact(words).map_err(|_| Error::Syscall {
            call: "chunk bitmap allocation",
            errno: libc::ENOMEM,
        })?;
        bits.resize(words, if set { u64::MAX } else { 0 });
        Ok(Bits(bits))
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

/// A chunk: its mapping, its registration, and which granules are resident or dirty.
#[derive(Debug)]
pub(crate) struct Chunk {
    // Field order is load-bearing: `Drop` releases the registration before the mapping goes.
    registration: Option<Registration>,
    mapping: Option<Mapping>,
    granule_shift: u32,
    populated: Bits,
    dirty: Bits,
    resident: usize,
    /// Made by a reservation: kept when idle, until trimmed or memory runs short.
    reserved: bool,
}

impl Chunk {
    /// An unregistered chunk of `mapping` (a multiple of `granule` long), with nothing resident,
    /// tracked in granules of `granule` bytes (a power of two).
    pub(crate) fn new(mapping: Mapping, granule: usize) -> Result<Chunk, Error> {
        let granules = mapping.len().div_ceil(granule);
        Ok(Chunk {
            populated: Bits::new(granules, false)?,
            dirty: Bits::new(granules, false)?,
            resident: 0,
            granule_shift: granule.trailing_zeros(),
            registration: None,
            mapping: Some(mapping),
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
        register: impl FnOnce(NonNull<u8>, usize) -> Result<Registration, Error>,
    ) -> Result<(), Error> {
        let Some(mapping) = &self.mapping else {
            return Ok(());
        };
        self.registration = Some(register(mapping.ptr(), mapping.len())?);
        let granules = mapping.len().div_ceil(1 << self.granule_shift);
        for g in 0..granules {
            self.populated.set(g, true);
        }
        self.resident = mapping.len();
        Ok(())
    }

    /// Where the chunk's memory came from (its mapping's source; the mapping is only taken by
    /// the release that consumes the chunk).
    pub(crate) fn source(&self) -> &'static dyn ChunkSource {
        self.mapping.as_ref().map_or(&ANONYMOUS, Mapping::source)
    }

    pub(crate) fn base(&self) -> usize {
        self.mapping
            .as_ref()
            .map_or(0, |m| m.ptr().as_ptr() as usize)
    }

    pub(crate) fn len(&self) -> usize {
        self.mapping.as_ref().map_or(0, Mapping::len)
    }

    pub(crate) fn pinned(&self) -> bool {
        self.registration.is_some()
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

    /// Unregisters (when registered), then unmaps. A failed unregistration, or one refused in a
    /// forked child (the range is the parent's registration, and the driver may have kept it
    /// out of the child), leaves the mapping in place.
    pub(crate) fn release(mut self) -> ChunkRelease {
        let mut outcome = ChunkRelease::default();
        if let Some(registration) = self.registration.take() {
            let start = Instant::now();
            let result = registration.release();
            let failed = result.is_err();
            outcome.unregistered = Some((start.elapsed(), result));
            if failed {
                if let Some(mapping) = self.mapping.take() {
                    mapping.leak();
                }
                return outcome;
            }
        }
        outcome.unmapped = self.mapping.take().is_some();
        outcome
    }
}

impl Drop for Chunk {
    /// The same order as [`Chunk::release`], for a chunk dropped without it.
    fn drop(&mut self) {
        if let Some(registration) = self.registration.take() {
            if registration.release().is_err() {
                if let Some(mapping) = self.mapping.take() {
                    mapping.leak();
                }
            }
        }
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
