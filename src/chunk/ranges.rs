//! The registrations of one mapping, range by range ([`Registrations`]): one range for a chunk
//! or a dedicated block (the whole mapping), one per chunk for a shared pool, whose ranges are
//! registered one by one in the background while the pool is in use.
//!
//! Each range has a slot, an atomic pointer to the GPU that registered it: no lock, so the
//! thread that registers, the readers of the counts and a forked child never wait on one
//! another, and releasing allocates nothing. Only [`Memory`](super::Memory) holds
//! registrations, and it unregisters them (`&mut`, so no registration is under way) before it
//! unmaps.
//!
//! Unsafe code here relies on the caller's promise that the ranges lie in a mapping that stays
//! mapped until they are unregistered.
#![allow(unsafe_code)]
// Off Linux there are no shared pools: only whole-mapping registrations.
#![cfg_attr(not(target_os = "linux"), allow(dead_code))]

use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::cuda::{Gpu, RegisterFlags};
use crate::Error;

/// Bytes the process holds page-locked through the allocator: registered chunks, dedicated
/// blocks and pool chunks, counted from before each registration (so that two threads cannot
/// both pass the limit) until it is released.
static PAGE_LOCKED: AtomicUsize = AtomicUsize::new(0);

/// Bytes page-locked through the allocator now, in the whole process.
pub(crate) fn page_locked_bytes() -> usize {
    PAGE_LOCKED.load(Ordering::Relaxed)
}

/// Counts `len` more bytes as page-locked, unless that would pass `limit`.
fn take_page_locked(len: usize, limit: usize) -> Result<(), Error> {
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
fn give_page_locked(len: usize) {
    PAGE_LOCKED.fetch_sub(len, Ordering::AcqRel);
}

/// How a range is registered: the driver's flags, and the pinned limit it must stay within.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PinFlags {
    /// The driver's flags.
    pub(crate) register: RegisterFlags,
    /// The most bytes the process may hold page-locked through the allocator.
    pub(crate) limit: usize,
}

/// Marks a slot whose range a thread is registering now.
static BUSY_MARK: u8 = 1;
/// Marks a slot whose unregistration failed: the driver may still hold the range.
static FAILED_MARK: u8 = 2;

fn busy() -> *mut Gpu {
    ptr::addr_of!(BUSY_MARK).cast_mut().cast()
}

fn failed() -> *mut Gpu {
    ptr::addr_of!(FAILED_MARK).cast_mut().cast()
}

/// The registered ranges of a mapping of `len` bytes, a slot each: the whole mapping, or range
/// `i` = `first + i * step .. min(first + (i + 1) * step, len)` of a grid (boxed: chunks and
/// dedicated blocks, the many, keep their one slot inline). A slot is null (not registered),
/// the GPU that registered it, busy (being registered) or failed (its unregistration failed).
#[derive(Debug)]
pub(super) enum Registrations {
    Whole(AtomicPtr<Gpu>, usize),
    Grid(Box<Grid>),
}

/// The ranges of [`Registrations::Grid`].
#[derive(Debug)]
pub(super) struct Grid {
    first: usize,
    step: usize,
    len: usize,
    slots: Box<[AtomicPtr<Gpu>]>,
}

/// What unregistering every range did.
#[derive(Debug)]
pub(super) struct Unregistered {
    /// The driver calls' time, all together.
    pub(super) took: Duration,
    /// The first failure: that range (and any other that failed) may still be the driver's.
    pub(super) error: Option<Error>,
}

impl Registrations {
    /// One range, the whole of a mapping of `len` bytes.
    pub(super) fn whole(len: usize) -> Registrations {
        Registrations::Whole(AtomicPtr::new(ptr::null_mut()), len)
    }

    /// The ranges `first + i * step` (each `step` bytes, the last to `len`) of a mapping of
    /// `len` bytes.
    ///
    /// # Errors
    /// [`Error::InvalidRange`] for a `step` of 0 or a `first` not inside the mapping; the
    /// slots' allocation's failure.
    pub(super) fn grid(len: usize, first: usize, step: usize) -> Result<Registrations, Error> {
        if step == 0 || first >= len {
            return Err(Error::InvalidRange {
                addr: first,
                len: step,
            });
        }
        let count = (len - first).div_ceil(step);
        let mut slots = Vec::new();
        slots.try_reserve_exact(count).map_err(|_| Error::Syscall {
            call: "registration slots allocation",
            errno: libc::ENOMEM,
        })?;
        slots.resize_with(count, || AtomicPtr::new(ptr::null_mut()));
        Ok(Registrations::Grid(Box::new(Grid {
            first,
            step,
            len,
            slots: slots.into_boxed_slice(),
        })))
    }

    fn slots(&self) -> &[AtomicPtr<Gpu>] {
        match self {
            Registrations::Whole(slot, _) => std::slice::from_ref(slot),
            Registrations::Grid(grid) => &grid.slots,
        }
    }

    /// How many ranges there are.
    pub(super) fn count(&self) -> usize {
        self.slots().len()
    }

    /// Range `index`: its offset in the mapping and its length.
    pub(super) fn range(&self, index: usize) -> Option<(usize, usize)> {
        let grid = match self {
            Registrations::Whole(_, len) => return (index == 0).then_some((0, *len)),
            Registrations::Grid(grid) => grid,
        };
        let start = grid.first.checked_add(index.checked_mul(grid.step)?)?;
        (index < grid.slots.len() && start < grid.len)
            .then(|| (start, grid.step.min(grid.len - start)))
    }

    /// Whether any range may be registered (busy and failed ones included).
    pub(super) fn any(&self) -> bool {
        self.slots()
            .iter()
            .any(|s| !s.load(Ordering::Acquire).is_null())
    }

    /// Whether an unregistration failed: the mapping must stay.
    pub(super) fn any_failed(&self) -> bool {
        self.slots()
            .iter()
            .any(|s| s.load(Ordering::Acquire) == failed())
    }

    /// Whether range `index` is registered now.
    pub(super) fn is_registered(&self, index: usize) -> bool {
        self.slots()
            .get(index)
            .is_some_and(|s| registered(s.load(Ordering::Acquire)).is_some())
    }

    /// Ranges registered now, and their bytes.
    pub(super) fn registered(&self) -> (usize, usize) {
        let mut total = (0, 0);
        for (i, slot) in self.slots().iter().enumerate() {
            if let (Some(_), Some((_, len))) =
                (registered(slot.load(Ordering::Acquire)), self.range(i))
            {
                total = (total.0 + 1, total.1 + len);
            }
        }
        total
    }

    /// Registers range `index` (of the mapping at `base`) through `gpu` within `flags.limit`
    /// page-locked bytes; the driver call's time, or `None` when it is registered already (or
    /// another thread is registering it now).
    ///
    /// # Safety
    /// `base` is the start of the mapping these ranges divide, live, and mapped until every
    /// range is unregistered ([`Self::unregister`]) or given up ([`Self::disown`]).
    pub(super) unsafe fn register(
        &self,
        base: NonNull<u8>,
        index: usize,
        gpu: &'static Gpu,
        flags: PinFlags,
    ) -> Result<Option<Duration>, Error> {
        let ((offset, len), Some(slot)) = (
            self.range(index).ok_or(Error::InvalidRange {
                addr: base.as_ptr() as usize,
                len: index,
            })?,
            self.slots().get(index),
        ) else {
            return Err(Error::InvalidRange {
                addr: base.as_ptr() as usize,
                len: index,
            });
        };
        // Claimed: no other thread registers this range until the slot is set again.
        if slot
            .compare_exchange(ptr::null_mut(), busy(), Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Ok(None);
        }
        if let Err(e) = take_page_locked(len, flags.limit) {
            slot.store(ptr::null_mut(), Ordering::Release);
            return Err(e);
        }
        // SAFETY: inside the caller's mapping, which stays mapped until this range is
        // unregistered (forwarded); the range is not registered (its slot was null).
        let ptr = unsafe { base.add(offset) };
        let start = Instant::now();
        // SAFETY: as above; a range of a live mapping, not registered yet, unregistered (by
        // `unregister`) before its mapping goes.
        let outcome = unsafe { gpu.register(ptr, len, flags.register) };
        let took = start.elapsed();
        match outcome {
            Ok(()) => {
                slot.store(ptr::from_ref(gpu).cast_mut(), Ordering::Release);
                Ok(Some(took))
            }
            Err(e) => {
                give_page_locked(len);
                slot.store(ptr::null_mut(), Ordering::Release);
                Err(e)
            }
        }
    }

    /// Unregisters every registered range (of the mapping at `base`); `None` when none was.
    /// A range the driver refused stays marked failed: its mapping must stay
    /// ([`Self::any_failed`]).
    ///
    /// # Safety
    /// `base` is the start of the mapping these ranges divide, still mapped.
    pub(super) unsafe fn unregister(&mut self, base: NonNull<u8>) -> Option<Unregistered> {
        let mut done: Option<Unregistered> = None;
        for (index, slot) in self.slots().iter().enumerate() {
            let (Some((offset, len)), Some(gpu)) =
                (self.range(index), registered(slot.load(Ordering::Acquire)))
            else {
                continue;
            };
            let outcome = done.get_or_insert(Unregistered {
                took: Duration::ZERO,
                error: None,
            });
            let start = Instant::now();
            // SAFETY: the base of a successful registration of this range (its slot names the
            // GPU), in the caller's mapping, still mapped; released once (the slot changes).
            let result = unsafe { gpu.unregister(base.add(offset)) };
            outcome.took += start.elapsed();
            match result {
                Ok(()) => {
                    give_page_locked(len);
                    slot.store(ptr::null_mut(), Ordering::Release);
                }
                Err(e) => {
                    slot.store(failed(), Ordering::Release);
                    outcome.error.get_or_insert(e);
                }
            }
        }
        done
    }

    /// Forgets every registration without a driver call: they are another process's (a forked
    /// child's copy of its parent's memory, where CUDA is unusable).
    pub(super) fn disown(&mut self) {
        for slot in self.slots() {
            slot.store(ptr::null_mut(), Ordering::Release);
        }
    }
}

/// The GPU a slot's value names, if it names one (not null, busy nor failed).
fn registered(value: *mut Gpu) -> Option<&'static Gpu> {
    if value == busy() || value == failed() {
        return None;
    }
    // SAFETY: a slot holds null, a mark, or a `&'static Gpu` stored by `register`.
    unsafe { value.cast_const().as_ref() }
}
