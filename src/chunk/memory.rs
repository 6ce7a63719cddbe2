//! The resources a chunk, a dedicated block or a shared pool owns, each held by a value that
//! releases it: a [`Mapping`] (given back to its source on drop), its registrations
//! (`ranges.rs`: one range, or one per chunk of a pool), and [`Memory`], the two together,
//! released in order (every range unregistered, then unmapped) once, by [`Memory::release`] or
//! on drop. A [`Part`] is the right to touch some bytes alone for a
//! while: borrowed from a mapping held mutably, or claimed from a span the carver handed out.
//!
//! Unsafe code here relies on these guards owning their mapping and registration alone, and on
//! a part's bytes being used by its holder only.
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use super::ranges::{PinFlags, Registrations};
use super::source::ChunkSource;
use super::Span;
use crate::cuda::Gpu;
use crate::sys::{self, MbindFlags, MemPolicy, NodeMask, HUGE_PAGE};
use crate::Error;

/// Who made a mapping and takes it back.
#[derive(Debug)]
enum Owner {
    /// A source for the whole process (anonymous memory; a test double).
    Process(&'static dyn ChunkSource),
    /// A source the mapping holds a share of (a shared pool's file): it lives until its last
    /// mapping is given back.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    Held(Arc<dyn ChunkSource + Send>),
}

impl Owner {
    fn get(&self) -> &dyn ChunkSource {
        match self {
            Owner::Process(source) => *source,
            Owner::Held(source) => &**source,
        }
    }
}

/// A mapping from a [`ChunkSource`]; given back to it on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    source: Owner,
    /// Kernel mappings (VMAs) the range spans: one, until pages moved onto part of it
    /// ([`Self::move_onto`]) made the moved head one and the rest another.
    pieces: u32,
}

// SAFETY: the mapping is this guard's alone; moving the guard between threads moves the right to
// unmap it, which any thread may exercise.
unsafe impl Send for Mapping {}
// SAFETY: shared, the guard gives out only its address, length and source (itself `Sync`), never
// the bytes: those are reached through `&mut` (a part) or by its owner's own contract.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` fresh bytes from `source` at a multiple of `align` (see [`ChunkSource::map`]).
    pub(crate) fn new(
        source: &'static dyn ChunkSource,
        len: usize,
        align: usize,
    ) -> Result<Mapping, Error> {
        Mapping::map_from(Owner::Process(source), len, align)
    }

    /// Maps `len` fresh bytes from `source`, which the mapping holds a share of until it is
    /// given back (a shared pool's file: see [`SharedFile`](super::SharedFile)).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    pub(crate) fn held(
        source: Arc<dyn ChunkSource + Send>,
        len: usize,
        align: usize,
    ) -> Result<Mapping, Error> {
        Mapping::map_from(Owner::Held(source), len, align)
    }

    fn map_from(source: Owner, len: usize, align: usize) -> Result<Mapping, Error> {
        let ptr = source.get().map(len, align)?;
        Ok(Mapping {
            ptr,
            len,
            source,
            pieces: 1,
        })
    }

    /// Where the mapping came from, when that is a source for the whole process.
    pub(crate) fn process_source(&self) -> Option<&'static dyn ChunkSource> {
        match self.source {
            Owner::Process(source) => Some(source),
            Owner::Held(_) => None,
        }
    }

    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// `offset..offset+len` of the mapping, to use alone while the borrow lasts.
    pub(crate) fn part(&mut self, offset: usize, len: usize) -> Result<Part<'_>, Error> {
        let invalid = Error::InvalidRange {
            addr: (self.ptr.as_ptr() as usize).saturating_add(offset),
            len,
        };
        if offset.checked_add(len).is_none_or(|end| end > self.len) || len == 0 {
            return Err(invalid);
        }
        // SAFETY: inside the mapping, which this guard owns and the caller borrows mutably.
        let ptr = unsafe { self.ptr.add(offset) };
        // A mapping outside a `Memory` is never registered.
        Ok(Part {
            ptr,
            len,
            source: Some(self.source.get()),
            _owner: PhantomData,
        })
    }

    /// The whole mapping, to use alone while the borrow lasts.
    pub(crate) fn whole(&mut self) -> Part<'_> {
        Part {
            ptr: self.ptr,
            len: self.len,
            source: Some(self.source.get()),
            _owner: PhantomData,
        }
    }

    /// Whether [`Self::move_onto`] may move it: memory whose pages `mremap` moves, in one kernel
    /// mapping (or the kernel moves several at once).
    pub(crate) fn movable(&self) -> bool {
        self.source.get().moves_by_remap() && (self.pieces == 1 || sys::moves_several_mappings())
    }

    /// Moves this mapping's pages onto the head of `dest` (`mremap`: nothing is copied); `dest`
    /// then holds them, and this range is gone. Both must be [movable](Self::movable) and `dest`
    /// at least as long. On failure this mapping is as it was; `dest`'s head may be unmapped
    /// (see [`sys::move_mapping`]), which dropping `dest` covers.
    pub(crate) fn move_onto(self, dest: &mut Mapping) -> Result<(), (Mapping, Error)> {
        if !(self.movable() && dest.source.get().moves_by_remap()) || dest.len < self.len {
            let e = Error::InvalidRange {
                addr: dest.ptr.as_ptr() as usize,
                len: self.len,
            };
            return Err((self, e));
        }
        // SAFETY: both are mappings of ours whose pages mremap moves, that nobody else uses
        // (this one is owned, `dest` borrowed mutably); they do not overlap (two live
        // mappings); this one is one kernel mapping or the kernel moves several; it is
        // forgotten once its range is gone.
        match unsafe { sys::move_mapping(self.ptr, dest.ptr, self.len) } {
            Ok(()) => {
                dest.pieces = self.pieces + u32::from(dest.len > self.len);
                self.forget();
                Ok(())
            }
            Err(e) => Err((self, e)),
        }
    }

    /// Moves this mapping's pages to `dest`'s place and grows it there to `dest`'s length, as
    /// one kernel mapping ([`sys::move_and_grow`]): the rest are fresh pages under this mapping's
    /// NUMA policy and advice, faulted in where touched, so a mapping grown so stays one piece
    /// and may grow again on any kernel. Both must be [movable](Self::movable), `dest` at least
    /// as long. On failure this mapping is as it was, and `dest` is given back (dropped).
    pub(crate) fn grow_into(self, dest: Mapping) -> Result<Mapping, Mapping> {
        if !(self.movable() && dest.source.get().moves_by_remap()) || dest.len < self.len {
            return Err(self);
        }
        // SAFETY: both are mappings of ours whose pages mremap moves, that nobody else uses
        // (both owned); they do not overlap (two live mappings); this one is one kernel mapping
        // or the kernel moves several; both guards are forgotten once the move replaced `dest`'s
        // range and removed this one.
        match unsafe { sys::move_and_grow(self.ptr, self.len, dest.ptr, dest.len) } {
            Ok(()) => {
                let mut grown = dest;
                grown.pieces = self.pieces;
                self.forget();
                Ok(grown)
            }
            Err(_) => Err(self),
        }
    }

    /// Gives back the pages past `len` (a whole number of pages, shorter than now): the head
    /// keeps its address and pages. Only for memory whose pages `mremap` moves (private
    /// anonymous: its ranges are plain kernel mappings); `false`, unchanged, otherwise or when
    /// the kernel refuses.
    pub(crate) fn truncate(&mut self, len: usize) -> bool {
        if !self.source.get().moves_by_remap() {
            return false;
        }
        // SAFETY: the guard owns the mapping alone and its owner gives up the tail.
        let truncated = unsafe { sys::truncate_mapping(self.ptr, self.len, len) }.is_ok();
        if truncated {
            self.len = len;
        }
        truncated
    }

    /// Gives up the mapping without unmapping it: the driver may still hold it (a failed
    /// unregistration), or its range moved elsewhere. A held source (a pool's file) then stays
    /// open with it.
    fn forget(self) {
        std::mem::forget(self);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the guard's source made this mapping, whole, and the guard owns it alone;
        // nothing uses it any more (its owner is dropped only once no block of it is live or
        // pending), and a registration is released before its mapping (`Memory`).
        let _ = unsafe { self.source.get().unmap(self.ptr, self.len) };
    }
}

/// Bytes to use alone while `'a` lasts: part of a mapping borrowed mutably, or a span the carver
/// took out for its caller ([`Span::claim`]).
#[derive(Debug)]
pub(crate) struct Part<'a> {
    ptr: NonNull<u8>,
    len: usize,
    /// The source of the range while it is unregistered: [`Self::clear`] may give its pages back.
    source: Option<&'a dyn ChunkSource>,
    _owner: PhantomData<&'a mut [u8]>,
}

// SAFETY: the part is its holder's alone, whichever thread holds it.
unsafe impl Send for Part<'_> {}

impl Span {
    /// The span as a part its caller uses alone (`None` for a null address), whose pages
    /// [`Part::clear`] may give back to `source` (`None`: written instead).
    ///
    /// # Safety
    /// The span is mapped and nobody else uses it until the caller hands it to its user or back
    /// to the carver, after which the part is not used; `source`, when given, mapped it and it is
    /// not registered.
    pub(crate) unsafe fn claim(
        self,
        source: Option<&'static dyn ChunkSource>,
    ) -> Option<Part<'static>> {
        Some(Part {
            ptr: self.ptr()?,
            len: self.len,
            source,
            _owner: PhantomData,
        })
    }
}

impl Part<'_> {
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The part of `span` inside this part, to use alone while borrowed.
    pub(crate) fn sub(&mut self, span: Span) -> Option<Part<'_>> {
        let start = self.ptr.as_ptr() as usize;
        let inside = span.addr >= start
            && span
                .addr
                .checked_add(span.len)
                .is_some_and(|end| end <= start + self.len);
        Some(Part {
            ptr: span.ptr().filter(|_| inside && span.len > 0)?,
            len: span.len,
            source: self.source,
            _owner: PhantomData,
        })
    }

    /// Sets the NUMA policy of the part (see [`sys::bind`]).
    pub(crate) fn bind(
        &mut self,
        policy: MemPolicy,
        nodes: &NodeMask,
        flags: MbindFlags,
    ) -> Result<(), Error> {
        // SAFETY: a mapping of this crate used by its holder alone.
        unsafe { sys::bind(self.ptr, self.len, policy, nodes, flags) }
    }

    /// Calls `f(page index, node)` for each page (see [`sys::page_nodes`]).
    pub(crate) fn page_nodes(&self, f: impl FnMut(usize, i32)) -> Result<(), Error> {
        // SAFETY: a mapping of this crate, which stays mapped while the part lives.
        unsafe { sys::page_nodes(self.ptr, self.len, f) }
    }

    /// Advises huge pages for the part, or none (a hint: a no-op without THP).
    pub(crate) fn advise_huge(&mut self, huge: bool) {
        // SAFETY: a mapping of this crate used by its holder alone.
        let _ = unsafe {
            if huge {
                sys::advise_hugepage(self.ptr, self.len)
            } else {
                sys::advise_nohugepage(self.ptr, self.len)
            }
        };
    }

    /// Writes zeros over the part.
    pub(crate) fn zero(&mut self) {
        // SAFETY: mapped, writable, and used by its holder alone.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), 0, self.len) };
    }

    /// Makes the part read as zero. With `drop_pages`, the whole huge pages inside an
    /// unregistered part go back to its source instead of being written (they come back zero
    /// where they are next touched, under the range's NUMA policy, and take no memory until
    /// then); the rest is written with zeros.
    pub(crate) fn clear(&mut self, drop_pages: bool) {
        let start = self.ptr.as_ptr() as usize;
        let end = start + self.len;
        let inner = start.next_multiple_of(HUGE_PAGE)..end & !(HUGE_PAGE - 1);
        if let (true, Some(source)) = (drop_pages && inner.start < inner.end, self.source) {
            // SAFETY: `inner` lies inside the part, which is `source`'s (`source` is set only on
            // parts of its mappings), unregistered, and used by its holder alone.
            let dropped = unsafe {
                let ptr = self.ptr.add(inner.start - start);
                source.purge(ptr, inner.end - inner.start)
            };
            if dropped.is_ok() {
                // SAFETY: the edges lie inside the part: mapped, writable, its holder's alone.
                unsafe {
                    std::ptr::write_bytes(self.ptr.as_ptr(), 0, inner.start - start);
                    std::ptr::write_bytes(
                        self.ptr.add(inner.end - start).as_ptr(),
                        0,
                        end - inner.end,
                    );
                }
                return;
            }
        }
        self.zero();
    }
}

/// What releasing a chunk or a dedicated block did, for the counters.
#[derive(Debug, Default)]
pub(crate) struct ChunkRelease {
    /// The unregistration's time and outcome, when it was registered.
    pub(crate) unregistered: Option<(Duration, Result<(), Error>)>,
    /// Whether the mapping was unmapped (false: kept, as the driver may still hold it).
    pub(crate) unmapped: bool,
}

/// A mapping and its registrations: every registered range is unregistered before the mapping
/// goes, once, by [`Memory::release`] or on drop. A chunk or a dedicated block registers its
/// whole mapping at once ([`Memory::new`], [`Memory::register`]); a shared pool registers its
/// chunks one by one, from a thread of its own while the pool is in use ([`Memory::ranged`],
/// [`Memory::register_range`]).
#[derive(Debug)]
pub(crate) struct Memory {
    /// `None` only once released, or kept mapped for the driver (an unregistration failed).
    mapping: Option<Mapping>,
    registrations: Registrations,
}

impl Memory {
    /// Unregistered memory of `mapping`, registered whole if at all.
    pub(crate) fn new(mapping: Mapping) -> Memory {
        Memory {
            registrations: Registrations::whole(mapping.len()),
            mapping: Some(mapping),
        }
    }

    /// Unregistered memory of `mapping`, registered in ranges: `first + i * step` for `step`
    /// bytes each (the last to the mapping's end).
    ///
    /// # Errors
    /// [`Error::InvalidRange`] for a `step` of 0 or a `first` past the mapping; the failure to
    /// allocate a slot per range.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    pub(crate) fn ranged(mapping: Mapping, first: usize, step: usize) -> Result<Memory, Error> {
        Ok(Memory {
            registrations: Registrations::grid(mapping.len(), first, step)?,
            mapping: Some(mapping),
        })
    }

    /// The mapping (until released).
    pub(crate) fn mapping(&self) -> Option<&Mapping> {
        self.mapping.as_ref()
    }

    /// `offset..offset+len` of the mapping, to use alone while the borrow lasts (`None` once
    /// released or outside it); registered, its pages stay (see [`Part::clear`]).
    pub(crate) fn part(&mut self, offset: usize, len: usize) -> Option<Part<'_>> {
        let registered = self.registrations.any();
        let mut part = self.mapping.as_mut()?.part(offset, len).ok()?;
        if registered {
            part.source = None;
        }
        Some(part)
    }

    /// The mapping's start, 0 once released.
    pub(crate) fn base(&self) -> usize {
        self.mapping().map_or(0, |m| m.ptr().as_ptr() as usize)
    }

    pub(crate) fn len(&self) -> usize {
        self.mapping().map_or(0, Mapping::len)
    }

    /// Where the memory came from, when that is a process-wide source (`None` for a source the
    /// mapping holds a share of, or once released).
    pub(crate) fn source(&self) -> Option<&'static dyn ChunkSource> {
        self.mapping().and_then(Mapping::process_source)
    }

    /// Whether any range is (or may be) registered.
    pub(crate) fn pinned(&self) -> bool {
        self.registrations.any()
    }

    /// Whether [`Self::move_onto`] may move it: unregistered, and its mapping
    /// [movable](Mapping::movable).
    pub(crate) fn movable(&self) -> bool {
        !self.registrations.any() && self.mapping().is_some_and(Mapping::movable)
    }

    /// How many registration ranges it has (1 unless [`Self::ranged`]).
    pub(crate) fn ranges(&self) -> usize {
        self.registrations.count()
    }

    /// Range `index`: its offset in the mapping and its length.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    pub(crate) fn range(&self, index: usize) -> Option<(usize, usize)> {
        self.registrations.range(index)
    }

    /// Whether range `index` is registered now.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    pub(crate) fn range_registered(&self, index: usize) -> bool {
        self.registrations.is_registered(index)
    }

    /// Ranges registered now, and their bytes.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    pub(crate) fn registered(&self) -> (usize, usize) {
        self.registrations.registered()
    }

    /// Registers the whole mapping (each of its ranges) through `gpu` (PORTABLE, plus
    /// DEVICEMAP and READ_ONLY as asked), unless a range is registered already, or that would
    /// page-lock more than `flags.limit` bytes in the process. A range registered before a
    /// failure stays so, and is released with the memory.
    pub(crate) fn register(&mut self, gpu: &'static Gpu, flags: PinFlags) -> Result<(), Error> {
        let invalid = Error::InvalidRange {
            addr: self.base(),
            len: self.len(),
        };
        if self.registrations.any() {
            return Err(invalid);
        }
        for index in 0..self.ranges() {
            self.register_range(index, gpu, flags)?
                .ok_or_else(|| invalid.clone())?;
        }
        Ok(())
    }

    /// Registers range `index` through `gpu` within `flags.limit` page-locked bytes; the
    /// driver call's time, or `None` when it is registered already (or another thread is
    /// registering it now). Any thread may register ranges while others read the counts; the
    /// ranges are unregistered before the mapping goes, as the whole one is.
    ///
    /// # Errors
    /// [`Error::InvalidRange`] for an index past the ranges, or memory released;
    /// [`Error::PinLimit`]; the driver's error.
    pub(crate) fn register_range(
        &self,
        index: usize,
        gpu: &'static Gpu,
        flags: PinFlags,
    ) -> Result<Option<Duration>, Error> {
        let base = self.mapping().ok_or(Error::InvalidRange {
            addr: 0,
            len: index,
        })?;
        // SAFETY: the ranges divide this live mapping, which this value unmaps only after every
        // range is unregistered (`release_now`), and which stays while `self` is borrowed.
        unsafe { self.registrations.register(base.ptr(), index, gpu, flags) }
    }

    /// Forgets the registrations without a driver call: they are another process's (a forked
    /// child's copy of memory its parent registered; CUDA is unusable in the child). Dropped
    /// afterwards, the memory is unmapped in this process alone.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    pub(crate) fn disown(&mut self) {
        self.registrations.disown();
    }

    /// Moves this memory's pages onto the head of `dest`'s (see [`Mapping::move_onto`]); both
    /// must be unregistered. When they cannot move, gives this memory back: both are as they
    /// were.
    pub(crate) fn move_onto(mut self, dest: &mut Memory) -> Result<(), Memory> {
        // A registration is tied to its address: registered pages do not move.
        let (Some(to), false, true) = (
            dest.mapping.as_mut(),
            dest.registrations.any(),
            self.movable(),
        ) else {
            return Err(self);
        };
        let Some(from) = self.mapping.take() else {
            return Err(self);
        };
        from.move_onto(to).map_err(|(from, _)| {
            self.mapping = Some(from);
            self
        })
    }

    /// Gives back the pages past `len` (see [`Mapping::truncate`]); only unregistered memory
    /// registered whole if at all (so its one range becomes the shorter mapping).
    pub(crate) fn truncate(&mut self, len: usize) -> bool {
        let whole = matches!(self.registrations, Registrations::Whole(..));
        if !whole || self.registrations.any() {
            return false;
        }
        let truncated = self.mapping.as_mut().is_some_and(|m| m.truncate(len));
        if truncated {
            self.registrations = Registrations::whole(len);
        }
        truncated
    }

    /// Moves this memory's pages to `dest` and grows it to `dest`'s length (see
    /// [`Mapping::grow_into`]); it must be unregistered. When it cannot, gives it back as it was
    /// (`dest` dropped).
    pub(crate) fn grow_into(mut self, dest: Mapping) -> Result<Memory, Memory> {
        let (true, Some(from)) = (self.movable(), self.mapping.take()) else {
            return Err(self);
        };
        match from.grow_into(dest) {
            Ok(grown) => Ok(Memory::new(grown)),
            Err(from) => {
                self.mapping = Some(from);
                Err(self)
            }
        }
    }

    /// Unregisters every registered range, then unmaps. A failed unregistration, or one
    /// refused in a forked child (the range is the parent's registration, and the driver may
    /// have kept it out of the child), leaves the mapping in place: unmapping a range the
    /// driver still holds would make a later mapping at this address fail to register (712).
    pub(crate) fn release(mut self) -> ChunkRelease {
        self.release_now()
    }

    fn release_now(&mut self) -> ChunkRelease {
        let base = self.mapping.as_ref().map(Mapping::ptr);
        // SAFETY: the ranges divide this mapping, still mapped: it goes only after this.
        let unregistered = base
            .and_then(|base| unsafe { self.registrations.unregister(base) })
            .map(|u| (u.took, u.error.map_or(Ok(()), Err)));
        let mut outcome = ChunkRelease {
            unregistered,
            unmapped: false,
        };
        if self.registrations.any_failed() {
            if let Some(mapping) = self.mapping.take() {
                mapping.forget();
            }
            return outcome;
        }
        outcome.unmapped = self.mapping.take().is_some();
        outcome
    }
}

impl Drop for Memory {
    /// The same order as [`Memory::release`], for memory dropped without it.
    fn drop(&mut self) {
        self.release_now();
    }
}
