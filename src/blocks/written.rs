//! Whether a large request not asked zeroed will be written whole, learnt per size class from
//! what the process did with earlier blocks of that class.
//!
//! A request not asked zeroed is usually written before it is read, so its pages are populated
//! in bulk by the node's workers ([`Blocks::populates_request`](super::Blocks)). Past
//! `bulk_max=` (256 MiB by default, 0 in the preload library) that bet costs too much when it
//! loses: `sort -S 1G` asks for 1 GiB and touches a few MiB of it, and a C program's oversized
//! table is `malloc`ed, not `calloc`ed; populated whole, their untouched pages take memory that
//! glibc leaves overcommitted. So such a block is populated in bulk only for a size class
//! (an octave of capacities) whose last watched block was written whole:
//!
//! - **Not trusted** (nothing seen yet, or the last look found pages left untouched): the block
//!   is handed out lazily and watched. At its free a few pages spread over it are looked at
//!   (`move_pages`, nothing touched; a page only read is the kernel's shared zero page and does
//!   not count); if every one was written, the class is trusted.
//! - **Trusted:** the next [`CREDIT`] blocks are populated in bulk, unwatched; then one is
//!   populated in bulk but for its tail (at most eight huge pages, a sixteenth of it), which
//!   its user faults in, and watched: its tail written, the class stays trusted; left
//!   untouched, it is not any more. The look costs a few faults, not a block faulted in page by
//!   page (small pages, where huge ones do not pay: seven times as long on the 2-vCPU VM).
//!
//! Pages looked at are odd pages (in the address space), so that a program touching a byte
//! every 2^k pages from an aligned start (a byte per MiB) is not taken for one that wrote its
//! block whole. A watched block that `realloc` moves or copies (reading it whole) is no longer
//! watched. Lazily handed out, a whole write costs a fault per page (a huge page each where
//! huge pages pay): the bulk populate is the gain, not the correctness.
//!
//! Process-wide (the arenas are), one watched block per class at a time, by address and length
//! (a block freed with another length is not it); a watch that stays live through
//! [`SKIPS_MAX`] blocks of its class is replaced. Atomics only: a fork copies them whole, and
//! nothing here allocates or locks. A watch torn by two threads teaches nothing, or the wrong
//! thing once: the cost is a block populated, or not, that should not have been.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Blocks of a trusted class populated in bulk before the next one is watched.
const CREDIT: u32 = 8;
/// Pages looked at when a watched block is freed.
const SAMPLES: usize = 8;
/// The most huge pages (or pages, without huge pages) a watched trusted block leaves to its
/// user to fault in; at most a sixteenth of it.
const TAIL_UNITS: usize = 8;
/// Blocks of a class handed out while its watched block is still live, after which that watch
/// is dropped for a new one (a block that lives on, or was freed with another length).
const SKIPS_MAX: u32 = 64;
/// The size classes: one per octave of capacities (`ilog2`).
const CLASSES: usize = usize::BITS as usize;
/// The watch slot's address while its block is being made (no block starts there).
const CLAIMED: usize = 1;

/// One size class's state.
struct Class {
    /// 0: not trusted; n ≥ 1: trusted, with n − 1 blocks to populate in bulk before the next
    /// watched one.
    trust: AtomicU32,
    /// The watched block's address (0: none; [`CLAIMED`]: being made) and length.
    addr: AtomicUsize,
    len: AtomicUsize,
    /// The part of it looked at: its offset from the block and its length, in pages (high and
    /// low halves).
    sampled: AtomicU64,
    /// Blocks handed out since the watch was set (see [`SKIPS_MAX`]).
    skips: AtomicU32,
}

impl Class {
    const fn new() -> Class {
        Class {
            trust: AtomicU32::new(0),
            addr: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            sampled: AtomicU64::new(0),
            skips: AtomicU32::new(0),
        }
    }

    /// Takes the watch slot for a block about to be made: free, or held too long by another.
    fn claim(&self) -> bool {
        if self
            .addr
            .compare_exchange(0, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            self.skips.store(0, Ordering::Relaxed);
            return true;
        }
        if self.skips.fetch_add(1, Ordering::Relaxed) + 1 < SKIPS_MAX {
            return false;
        }
        self.skips.store(0, Ordering::Relaxed);
        self.addr.store(CLAIMED, Ordering::Relaxed);
        true
    }
}

/// What the process learnt, per size class.
pub(crate) struct Learnt {
    classes: [Class; CLASSES],
}

/// The process's.
pub(crate) static LEARNT: Learnt = Learnt::new();

/// How a new block's never-populated region is populated: its first `head` bytes in bulk, the
/// rest faulted in where its user touches it; `watch`, when the block is to be watched (then
/// [`Watch::set`] once its address is known; dropped, the claim is given up).
pub(crate) struct Plan<'a> {
    pub(crate) head: usize,
    pub(crate) watch: Option<Watch<'a>>,
}

impl Plan<'_> {
    /// All of a region of `len` bytes in bulk, nothing watched.
    pub(crate) fn whole(len: usize) -> Plan<'static> {
        Plan {
            head: len,
            watch: None,
        }
    }

    /// Nothing populated, nothing watched.
    pub(crate) fn lazy() -> Plan<'static> {
        Plan {
            head: 0,
            watch: None,
        }
    }
}

/// A class's watch slot, claimed for a block being made: which part of its region is looked
/// at when it is freed (offset from the region's start, and length).
pub(crate) struct Watch<'a> {
    class: &'a Class,
    offset: usize,
    len: usize,
}

impl Watch<'_> {
    /// Watches the block of `len` bytes at `addr` whose region starts at `region`.
    pub(crate) fn set(self, addr: usize, len: usize, region: usize) {
        let page = crate::sys::page_size();
        let offset = (region + self.offset).saturating_sub(addr) / page;
        let pages = self.len / page;
        let packed = u64::try_from(offset)
            .ok()
            .zip(u64::try_from(pages).ok())
            .filter(|&(o, p)| o <= u64::from(u32::MAX) && p <= u64::from(u32::MAX))
            .map(|(o, p)| o << 32 | p);
        let class = self.class;
        // Dropped, not released: the slot is this block's now (or given up, without a span).
        std::mem::forget(self);
        let Some(packed) = packed else {
            class.addr.store(0, Ordering::Relaxed);
            return;
        };
        class.len.store(len, Ordering::Relaxed);
        class.sampled.store(packed, Ordering::Relaxed);
        class.addr.store(addr, Ordering::Release);
    }
}

impl Drop for Watch<'_> {
    /// The block was not made, or not watched: the slot is free again (unless another took it).
    fn drop(&mut self) {
        let _ = self
            .class
            .addr
            .compare_exchange(CLAIMED, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The size class of a block of `capacity` bytes.
fn class_of(capacity: usize) -> usize {
    capacity.max(1).ilog2() as usize
}

impl Learnt {
    pub(crate) const fn new() -> Learnt {
        Learnt {
            classes: [const { Class::new() }; CLASSES],
        }
    }

    /// How a new block of `capacity` bytes for a request not asked zeroed is populated, whose
    /// never-populated region is `len` bytes at `start` (an address, or any number congruent to
    /// it modulo `unit`): whole up to `bulk_max`; beyond, as its class's trust says (see the
    /// module's docs). `unit`: the memory's page (a huge page where huge pages are advised), so
    /// that a tail left to fault in is whole pages of it. A region of less than half the block
    /// (the rest resident already) teaches little: it is not watched.
    pub(crate) fn plan(
        &self,
        bulk_max: usize,
        capacity: usize,
        (start, len): (usize, usize),
        unit: usize,
    ) -> Plan<'_> {
        if capacity <= bulk_max {
            return Plan::whole(len);
        }
        let class = &self.classes[class_of(capacity)];
        let credit = class
            .trust
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n > 1).then(|| n - 1)
            });
        let trusted = match credit {
            Ok(_) => return Plan::whole(len),
            Err(n) => n > 0,
        };
        if len < capacity / 2 || !class.claim() {
            return if trusted {
                Plan::whole(len)
            } else {
                Plan::lazy()
            };
        }
        let head = if trusted {
            let unit = unit.max(1);
            let tail = (len / 16).clamp(unit, TAIL_UNITS * unit).min(len);
            // The tail starts on a unit, so that populating the head faults none of its pages.
            let tail_start = (start + len - tail) / unit * unit;
            tail_start.saturating_sub(start)
        } else {
            0
        };
        Plan {
            head,
            watch: Some(Watch {
                class,
                offset: head,
                len: len - head,
            }),
        }
    }

    /// Whether a block of `capacity` bytes for a request not asked zeroed is populated in bulk,
    /// whole or nearly: up to `bulk_max`, or while its class is trusted (a look, not a plan:
    /// another thread may change it before [`Self::plan`]).
    pub(crate) fn trusted(&self, bulk_max: usize, capacity: usize) -> bool {
        capacity <= bulk_max
            || self.classes[class_of(capacity)]
                .trust
                .load(Ordering::Relaxed)
                > 0
    }

    /// Forgets what was learnt of the class of `capacity` (for tests of the process's).
    #[cfg(test)]
    pub(crate) fn reset(&self, capacity: usize) {
        let class = &self.classes[class_of(capacity)];
        class.trust.store(0, Ordering::Relaxed);
        class.addr.store(0, Ordering::Relaxed);
    }

    /// Called with a block just freed (its address and capacity; still mapped, held in its
    /// arena or about to be released by the caller): when it is its class's watched block,
    /// looks at how much of it its user wrote and sets the class's trust. Every free passes
    /// here: one load when it is not.
    pub(crate) fn freed(&self, addr: usize, capacity: usize) {
        let class = &self.classes[class_of(capacity)];
        if addr <= CLAIMED
            || class.addr.load(Ordering::Acquire) != addr
            || class.len.load(Ordering::Relaxed) != capacity
        {
            return;
        }
        let sampled = class.sampled.load(Ordering::Relaxed);
        if class
            .addr
            .compare_exchange(addr, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        let page = crate::sys::page_size();
        let (offset, pages) = ((sampled >> 32) as usize, (sampled & 0xffff_ffff) as usize);
        // A span torn by another thread's watch may lie outside the block: nothing is learnt.
        let Some(start) = offset
            .checked_mul(page)
            .filter(|&o| pages > 0 && o + pages * page <= capacity)
            .map(|o| addr + o)
        else {
            return;
        };
        if let Some(whole) = written_whole(start, pages, page) {
            class
                .trust
                .store(if whole { CREDIT + 1 } else { 0 }, Ordering::Relaxed);
        }
    }

    /// Stops watching the block at `addr` (it moves: a `realloc` copies it, reading it whole, or
    /// grows it by moving its pages); whether it was watched.
    pub(crate) fn forget(&self, addr: usize) -> bool {
        addr > CLAIMED
            && self.classes.iter().any(|class| {
                class.addr.load(Ordering::Relaxed) == addr
                    && class
                        .addr
                        .compare_exchange(addr, 0, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
            })
    }
}

/// [`Learnt::freed`] of the process's.
pub(crate) fn freed(addr: usize, capacity: usize) {
    LEARNT.freed(addr, capacity);
}

/// [`Learnt::forget`] of the process's.
pub(crate) fn forget(addr: usize) -> bool {
    LEARNT.forget(addr)
}

/// Whether every one of [`SAMPLES`] odd pages spread over the `pages` pages at `start` was
/// written (a page of its own: `move_pages`, or `mincore` where that is refused); `None` when
/// the kernel answered for none.
fn written_whole(start: usize, pages: usize, page: usize) -> Option<bool> {
    let samples = SAMPLES.min(pages);
    let first = start / page;
    let mut asked = 0;
    for i in 0..samples {
        // The middle of the `i`th of `samples` slices, moved to an odd page inside the span.
        let mut at = first + (2 * i + 1) * pages / (2 * samples);
        if at.is_multiple_of(2) && pages > 1 {
            at = if at + 1 < first + pages {
                at + 1
            } else {
                at - 1
            };
        }
        let ptr = NonNull::new((at * page) as *mut u8)?;
        let (written, sampled) = crate::sys::written_sample(ptr, page, 1)?;
        if written < sampled {
            return Some(false);
        }
        asked += sampled;
    }
    (asked > 0).then_some(true)
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;
    use crate::chunk::{Mapping, ANONYMOUS};

    const MIB: usize = 1 << 20;
    const HUGE: usize = crate::sys::HUGE_PAGE;

    /// A fresh mapping of `len` bytes in small pages (so that what is written is what is
    /// resident, whatever the machine's huge-page setting), 2 MiB aligned.
    fn mapping(len: usize) -> (Mapping, usize) {
        let mut mapping = Mapping::new(&ANONYMOUS, len, HUGE).expect("mmap");
        mapping.whole().advise_huge(false);
        let addr = mapping.ptr().as_ptr() as usize;
        (mapping, addr)
    }

    /// Writes one byte every `step` bytes of `addr..addr+len`.
    fn write(addr: usize, len: usize, step: usize) {
        for at in (0..len).step_by(step) {
            // SAFETY: inside a test's mapping of at least `len` bytes.
            unsafe { ((addr + at) as *mut u8).write_volatile(1) };
        }
    }

    /// Hands out a block of `len` bytes at `addr` as `learnt` plans it (a mapping's whole
    /// region), watched when the plan says so; the plan's head.
    fn hand_out(learnt: &Learnt, addr: usize, len: usize) -> (usize, bool) {
        let plan = learnt.plan(0, len, (addr, len), HUGE);
        let watched = plan.watch.is_some();
        if let Some(watch) = plan.watch {
            watch.set(addr, len, addr);
        }
        (plan.head, watched)
    }

    #[test]
    fn up_to_bulk_max_a_block_is_populated_whole_and_beyond_only_once_trusted() {
        let learnt = Learnt::new();
        let plan = learnt.plan(256 * MIB, 256 * MIB, (0, 256 * MIB), HUGE);
        assert_eq!((plan.head, plan.watch.is_none()), (256 * MIB, true));
        let plan = learnt.plan(256 * MIB, 256 * MIB + 1, (0, 257 * MIB), HUGE);
        assert_eq!(plan.head, 0, "nothing learnt: lazily");
        assert!(plan.watch.is_some(), "and watched");
        let other = learnt.plan(256 * MIB, 300 * MIB, (0, 300 * MIB), HUGE);
        assert_eq!(other.head, 0, "lazily too");
        assert!(other.watch.is_none(), "one watched block per class");
        drop(plan);
        assert!(
            learnt.plan(0, 8 * MIB, (0, 8 * MIB), HUGE).watch.is_some(),
            "another class has a slot of its own"
        );
        assert!(
            learnt
                .plan(256 * MIB, 300 * MIB, (0, 300 * MIB), HUGE)
                .watch
                .is_some(),
            "a plan dropped (its block not made) gives the slot back"
        );
    }

    /// The cycle of one class: lazily handed out and written whole, trusted; [`CREDIT`] blocks
    /// populated whole; one with its tail left to its user, written, still trusted; one whose
    /// tail is left untouched ends the trust.
    #[test]
    fn a_class_written_whole_is_trusted_until_a_watched_tail_is_left_untouched() {
        let learnt = Learnt::new();
        let len = 32 * MIB;
        let (_map, addr) = mapping(len);
        assert_eq!(hand_out(&learnt, addr, len), (0, true));
        write(addr, len, 4096);
        learnt.freed(addr + 4096, len);
        learnt.freed(addr, len / 2);
        assert_eq!(
            hand_out(&learnt, addr, len).0,
            0,
            "other blocks: nothing learnt"
        );
        learnt.freed(addr, len);
        for _ in 0..CREDIT {
            assert_eq!(hand_out(&learnt, addr, len), (len, false), "trusted: whole");
        }
        // The credit spent: populated but for a tail of 2 MiB (a sixteenth), watched.
        let (head, watched) = hand_out(&learnt, addr, len);
        assert_eq!((head, watched), (len - 2 * MIB, true));
        assert_eq!(
            hand_out(&learnt, addr, len),
            (len, false),
            "trusted while the look is under way"
        );
        write(addr + head, len - head, 4096);
        learnt.freed(addr, len);
        assert_eq!(hand_out(&learnt, addr, len), (len, false), "tail written");
        for _ in 1..CREDIT {
            hand_out(&learnt, addr, len);
        }
        let (_map, fresh) = mapping(len);
        assert_eq!(hand_out(&learnt, fresh, len), (len - 2 * MIB, true));
        write(fresh, len - 2 * MIB, 4096);
        learnt.freed(fresh, len);
        assert_eq!(
            hand_out(&learnt, fresh, len),
            (0, true),
            "tail untouched: lazily"
        );
        assert_eq!(hand_out(&learnt, fresh, len), (0, false));
    }

    /// A program touching the first page, or a byte per MiB, of blocks it does not write whole
    /// (a table sized for the worst case) is never trusted; nor is one that only reads.
    #[test]
    fn barely_touched_or_only_read_blocks_are_not_trusted() {
        let learnt = Learnt::new();
        let len = 128 * MIB;
        for step in [len, MIB, 2 * MIB] {
            let (_map, addr) = mapping(len);
            assert_eq!(hand_out(&learnt, addr, len), (0, true), "step {step}");
            write(addr, len, step);
            learnt.freed(addr, len);
            assert_eq!(
                learnt.classes[class_of(len)].trust.load(Ordering::Relaxed),
                0
            );
        }
        // Read whole, written nowhere: every page is the kernel's zero page, which `move_pages`
        // tells apart where it is allowed (`mincore` counts them resident).
        let (read, addr) = mapping(8 * MIB);
        let sum = (0..8 * MIB).step_by(4096).fold(0u8, |sum, at| {
            // SAFETY: inside this test's mapping.
            sum.wrapping_add(unsafe { std::ptr::read_volatile((addr + at) as *const u8) })
        });
        assert_eq!(sum, 0);
        let tells_zero_page = crate::sys::written_sample(read.ptr(), 8 * MIB, SAMPLES)
            != crate::sys::resident_sample(read.ptr(), 8 * MIB, SAMPLES);
        assert!(hand_out(&learnt, addr, 8 * MIB).1);
        learnt.freed(addr, 8 * MIB);
        if tells_zero_page {
            assert_eq!(hand_out(&learnt, addr, 8 * MIB).0, 0, "only read: lazily");
        }
    }

    #[test]
    fn a_moved_block_or_one_that_lives_on_is_no_longer_watched() {
        let learnt = Learnt::new();
        let len = 16 * MIB;
        let (_map, addr) = mapping(len);
        assert!(hand_out(&learnt, addr, len).1);
        write(addr, len, 4096);
        assert!(learnt.forget(addr), "realloc moves it");
        assert!(!learnt.forget(addr));
        learnt.freed(addr, len);
        assert_eq!(hand_out(&learnt, addr, len).0, 0, "nothing learnt");
        // Watched again just above; it lives on: after SKIPS_MAX other blocks, one replaces it.
        for _ in 1..SKIPS_MAX {
            assert!(!hand_out(&learnt, addr + len, len).1);
        }
        assert!(hand_out(&learnt, addr, len).1, "the slot taken over");
        learnt.freed(addr, len);
        assert_eq!(hand_out(&learnt, addr, len), (len, false), "learnt from it");
    }

    /// A region mostly resident already (a carved block over granules populated before) is not
    /// watched; a tail is whole units at the region's end, in the address space.
    #[test]
    fn the_tail_left_is_whole_units_and_a_small_region_is_not_watched() {
        let learnt = Learnt::new();
        let len = 64 * MIB;
        learnt.classes[class_of(len)]
            .trust
            .store(1, Ordering::Relaxed);
        let plan = learnt.plan(0, len, (HUGE + 4096, len / 2 - 4096), HUGE);
        assert_eq!((plan.head, plan.watch.is_none()), (len / 2 - 4096, true));
        // A region starting 4 KiB into a huge page: its tail starts on one.
        let start = HUGE + 4096;
        let plan = learnt.plan(0, len, (start, len - 8192), HUGE);
        let (tail_start, tail) = (start + plan.head, len - 8192 - plan.head);
        assert_eq!(tail_start % HUGE, 0);
        let least = (len - 8192) / 16;
        assert!(tail >= least && tail < least + HUGE, "{tail}");
        // A region of less than two units is left whole to its user.
        learnt.classes[class_of(HUGE + 4096)]
            .trust
            .store(1, Ordering::Relaxed);
        let small = learnt.plan(0, HUGE + 4096, (0, HUGE + 4096), HUGE);
        assert_eq!(small.head, 0);
    }
}
