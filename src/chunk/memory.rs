//! The resources a chunk or a dedicated block owns, each held by a value that releases it:
//! a [`Mapping`] (given back to its source on drop), a [`Registration`] (unregistered on drop),
//! and [`Memory`], the two together, released in order (unregistered, then unmapped) once, by
//! [`Memory::release`] or on drop. A [`Part`] is the right to touch some bytes alone for a
//! while: borrowed from a mapping held mutably, or claimed from a span the carver handed out.
//!
//! Unsafe code here relies on these guards owning their mapping and registration alone, and on
//! a part's bytes being used by its holder only.
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::source::{ChunkSource, ANONYMOUS};
use super::Span;
use crate::cuda::{Gpu, RegisterFlags};
use crate::sys::{self, MbindFlags, MemPolicy, NodeMask, HUGE_PAGE};
use crate::Error;

/// A mapping from a [`ChunkSource`]; given back to it on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    source: &'static dyn ChunkSource,
    /// Kernel mappings (VMAs) the range spans: one, until pages moved onto part of it
    /// ([`Self::move_onto`]) made the moved head one and the rest another.
    pieces: u32,
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
        Ok(Mapping {
            ptr,
            len,
            source,
            pieces: 1,
        })
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
            source: Some(self.source),
            _owner: PhantomData,
        })
    }

    /// The whole mapping, to use alone while the borrow lasts.
    pub(crate) fn whole(&mut self) -> Part<'_> {
        Part {
            ptr: self.ptr,
            len: self.len,
            source: Some(self.source),
            _owner: PhantomData,
        }
    }

    /// Whether [`Self::move_onto`] may move it: memory whose pages `mremap` moves, in one kernel
    /// mapping (or the kernel moves several at once).
    pub(crate) fn movable(&self) -> bool {
        self.source.moves_by_remap() && (self.pieces == 1 || sys::moves_several_mappings())
    }

    /// Moves this mapping's pages onto the head of `dest` (`mremap`: nothing is copied); `dest`
    /// then holds them, and this range is gone. Both must be [movable](Self::movable) and `dest`
    /// at least as long. On failure this mapping is as it was; `dest`'s head may be unmapped
    /// (see [`sys::move_mapping`]), which dropping `dest` covers.
    pub(crate) fn move_onto(self, dest: &mut Mapping) -> Result<(), (Mapping, Error)> {
        if !(self.movable() && dest.source.moves_by_remap()) || dest.len < self.len {
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
        if !(self.movable() && dest.source.moves_by_remap()) || dest.len < self.len {
            return Err(self);
        }
        // SAFETY: both are mappings of ours whose pages mremap moves, that nobody else uses
        // (both owned); they do not overlap (two live mappings); this one is one kernel mapping
        // or the kernel moves several; both guards are forgotten once the move replaced `dest`'s
        // range and removed this one.
        match unsafe { sys::move_and_grow(self.ptr, self.len, dest.ptr, dest.len) } {
            Ok(()) => {
                let grown = Mapping {
                    pieces: self.pieces,
                    ..dest
                };
                self.forget();
                dest.forget();
                Ok(grown)
            }
            Err(_) => Err(self),
        }
    }

    /// Gives up the mapping without unmapping it: the driver may still hold it (a failed
    /// unregistration), or its range moved elsewhere.
    fn forget(self) {
        std::mem::forget(self);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the guard's source made this mapping, whole, and the guard owns it alone;
        // nothing uses it any more (its owner is dropped only once no block of it is live or
        // pending), and a registration is released before its mapping (`Memory`).
        let _ = unsafe { self.source.unmap(self.ptr, self.len) };
    }
}

/// Bytes to use alone while `'a` lasts: part of a mapping borrowed mutably, or a span the carver
/// took out for its caller ([`Span::claim`]).
#[derive(Debug)]
pub(crate) struct Part<'a> {
    ptr: NonNull<u8>,
    len: usize,
    /// The source of the range while it is unregistered: [`Self::clear`] may give its pages back.
    source: Option<&'static dyn ChunkSource>,
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

/// A `cuMemHostRegister` of a whole mapping, counted in the page-locked bytes while it lasts.
/// Only a [`Memory`] holds one, and releases it ([`Memory::release`], or on drop) before the
/// mapping.
#[derive(Debug)]
struct Registration {
    gpu: &'static Gpu,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a registration may be released from any thread (the context is pushed for the call).
unsafe impl Send for Registration {}

impl Registration {
    /// Unregisters; an error means the range may still be the driver's and must stay mapped
    /// (and counted page-locked).
    fn release(self) -> Result<(), Error> {
        // SAFETY: `ptr` is the base of a successful registration, still mapped (its memory
        // releases the mapping after this), released once (this consumes it).
        unsafe { self.gpu.unregister(self.ptr) }?;
        give_page_locked(self.len);
        Ok(())
    }
}

/// How a range is registered: the driver's flags, and the pinned limit it must stay within.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PinFlags {
    /// The driver's flags.
    pub(crate) register: RegisterFlags,
    /// The most bytes the process may hold page-locked through the allocator.
    pub(crate) limit: usize,
}

/// What releasing a chunk or a dedicated block did, for the counters.
#[derive(Debug, Default)]
pub(crate) struct ChunkRelease {
    /// The unregistration's time and outcome, when it was registered.
    pub(crate) unregistered: Option<(Duration, Result<(), Error>)>,
    /// Whether the mapping was unmapped (false: kept, as the driver may still hold it).
    pub(crate) unmapped: bool,
}

/// A mapping and, once registered, its registration: released in that order, once.
#[derive(Debug)]
pub(crate) struct Memory {
    /// `None` only once released.
    mapping: Option<Mapping>,
    registration: Option<Registration>,
}

impl Memory {
    /// Unregistered memory of `mapping`.
    pub(crate) fn new(mapping: Mapping) -> Memory {
        Memory {
            mapping: Some(mapping),
            registration: None,
        }
    }

    /// The mapping (until released).
    pub(crate) fn mapping(&self) -> Option<&Mapping> {
        self.mapping.as_ref()
    }

    /// `offset..offset+len` of the mapping, to use alone while the borrow lasts (`None` once
    /// released or outside it); registered, its pages stay (see [`Part::clear`]).
    pub(crate) fn part(&mut self, offset: usize, len: usize) -> Option<Part<'_>> {
        let registered = self.registration.is_some();
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

    /// Where the memory came from.
    pub(crate) fn source(&self) -> &'static dyn ChunkSource {
        self.mapping().map_or(&ANONYMOUS, Mapping::source)
    }

    pub(crate) fn pinned(&self) -> bool {
        self.registration.is_some()
    }

    /// Whether [`Self::move_onto`] may move it: unregistered, and its mapping
    /// [movable](Mapping::movable).
    pub(crate) fn movable(&self) -> bool {
        self.registration.is_none() && self.mapping().is_some_and(Mapping::movable)
    }

    /// Registers the whole mapping through `gpu` (PORTABLE, plus DEVICEMAP and READ_ONLY as
    /// asked), unless it is registered already, or that would page-lock more than `flags.limit`
    /// bytes in the process.
    pub(crate) fn register(&mut self, gpu: &'static Gpu, flags: PinFlags) -> Result<(), Error> {
        let (Some(mapping), None) = (&self.mapping, &self.registration) else {
            return Err(Error::InvalidRange {
                addr: self.base(),
                len: self.len(),
            });
        };
        let (ptr, len) = (mapping.ptr(), mapping.len());
        take_page_locked(len, flags.limit)?;
        // SAFETY: a live mapping of this crate, not registered yet, that stays mapped until the
        // registration is released: this value releases it first.
        if let Err(e) = unsafe { gpu.register(ptr, len, flags.register) } {
            give_page_locked(len);
            return Err(e);
        }
        self.registration = Some(Registration { gpu, ptr, len });
        Ok(())
    }

    /// Moves this memory's pages onto the head of `dest`'s (see [`Mapping::move_onto`]); both
    /// must be unregistered. When they cannot move, gives this memory back: both are as they
    /// were.
    pub(crate) fn move_onto(mut self, dest: &mut Memory) -> Result<(), Memory> {
        // A registration is tied to its address: registered pages do not move.
        let (Some(to), None, true) = (dest.mapping.as_mut(), &dest.registration, self.movable())
        else {
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

    /// Unregisters (when registered), then unmaps. A failed unregistration, or one refused in a
    /// forked child (the range is the parent's registration, and the driver may have kept it out
    /// of the child), leaves the mapping in place: unmapping a range the driver still holds
    /// would make a later mapping at this address fail to register (712).
    pub(crate) fn release(mut self) -> ChunkRelease {
        self.release_now()
    }

    fn release_now(&mut self) -> ChunkRelease {
        let mut outcome = ChunkRelease::default();
        if let Some(registration) = self.registration.take() {
            let start = Instant::now();
            let result = registration.release();
            let failed = result.is_err();
            outcome.unregistered = Some((start.elapsed(), result));
            if failed {
                if let Some(mapping) = self.mapping.take() {
                    mapping.forget();
                }
                return outcome;
            }
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
