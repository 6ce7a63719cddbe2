//! The one placer: every chunk, dedicated block, reserved chunk and shared pool chunk is made
//! by the same steps, and page-locked (or not) by one rule.
//!
//! 1. map: a fresh range from a [`ChunkSource`] ([`Mapping`], unmapped by its guard on failure);
//! 2. place: `mbind` before any page is touched ([`Placer::place`]; `policy=bind` is first
//!    applied as `preferred`, so that a node too small shows up as misplaced pages);
//! 3. populate: with the node's bound workers ([`Seams::populate`]), when the memory must be
//!    resident or its pages checked;
//! 4. check: page by page under `verify=on` or `policy=bind` ([`Placer::check_placement`]);
//! 5. register: `cuMemHostRegister`, as [`PinPolicy`] decides, held within the pinned limit
//!    ([`Placer::register`] for a whole mapping, [`Placer::register_range`] for one of a
//!    shared pool's chunks), the registration owned by the [`Memory`] (unregistered before
//!    it is unmapped).
//!
//! The placer runs outside every arena lock, inside the re-entrancy guard, on memory the call
//! owns. What it needs of the layers above it (the node's populate workers, idle page-locked
//! memory given back) comes through [`Seams`]; it counts into the counters it is given (an
//! allocator value's, or a shared pool's).

use std::time::Instant;

mod numa;
mod pin;

pub(crate) use numa::Numa;
pub(crate) use pin::PinPolicy;

use super::{
    page_locked_bytes, Chunk, ChunkSource, Mapping, Memory, Part, PinFlags, Span, ANONYMOUS,
};
use crate::config::{MAX_REGISTER_MAX, MIN_REGISTER_MAX};
use crate::cuda::Gpu;
use crate::stats::Counters;
use crate::sys::{MbindFlags, MemPolicy, NodeMask, HUGE_PAGE};
use crate::topology::cgroup::MemoryLimits;
use crate::Error;

/// Blocks smaller than this are populated by one thread: thread start-up would cost more.
const PARALLEL_POPULATE_MIN: usize = 64 << 20;

/// What the placer needs from the layers above it.
pub(crate) trait Seams {
    /// The process's page size.
    fn page_size(&self) -> usize;
    /// The cgroup memory limits new memory is checked against.
    fn memory_limits(&self) -> &MemoryLimits;
    /// Populates a part never written, placed for `nodes`, with up to `threads` threads bound
    /// to the node's CPUs; returns whether a huge-page part went on in small pages.
    fn populate(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
        threads: usize,
        huge: bool,
    ) -> Result<bool, Error>;
    /// Gives back up to `bytes` of idle page-locked memory (before a registration that would
    /// pass the pinned limit).
    fn make_pinned_room(&self, bytes: usize);
    /// Advises a fresh lazy block (mapped, nothing faulted in) as the machine's faults pay
    /// best; memory that is always populated needs nothing.
    fn advise_lazy(&self, _part: &mut Part<'_>) {}
}

/// An allocator value's placement settings, as resolved at its initialisation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rules {
    /// The `mbind` policy asked for.
    pub(crate) policy: MemPolicy,
    /// Check every block's pages (`verify=on`).
    pub(crate) verify: bool,
    /// Huge pages for blocks of 2 MiB and more.
    pub(crate) huge_pages: bool,
    /// Threads that populate one big block.
    pub(crate) populate_threads: usize,
    /// The flags and limit registrations use.
    pub(crate) flags: PinFlags,
    /// The most one registration covers (`register_max=`, taken into 2 MiB to 1 GiB).
    pub(crate) register_max: usize,
}

impl Rules {
    /// The longest registration: `register_max=` taken into 2 MiB to 1 GiB, whole 2 MiB.
    pub(crate) fn registration_bound(&self) -> usize {
        self.register_max
            .clamp(MIN_REGISTER_MAX, MAX_REGISTER_MAX)
            .next_multiple_of(MIN_REGISTER_MAX)
    }
}

/// The step at which a dedicated block could not be made, counted once per failed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cause {
    /// The cgroup limit leaves no room.
    MemoryLimit,
    /// `mmap` failed.
    Mmap,
    /// Populating failed.
    Populate,
    /// `policy=bind` found pages off the node.
    BindExhausted,
    /// Counted where it happens (placement, registration), or not a memory failure.
    Other,
}

impl Cause {
    /// Counts a failed request under its cause in `counters`.
    pub(crate) fn count(self, counters: &Counters) {
        let counter = match self {
            Cause::MemoryLimit => &counters.memory_limited,
            Cause::Mmap => &counters.map_failures,
            Cause::Populate => &counters.populate_failures,
            Cause::BindExhausted => &counters.bind_exhausted,
            Cause::Other => return,
        };
        counter.incr();
    }
}

/// Where placed memory goes: the policy's nodes, and the GPU's context that pins it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place {
    /// Nodes the policy names.
    pub(crate) nodes: NodeMask,
    /// The context registrations go through (none: nothing to register with).
    pub(crate) gpu: Option<&'static Gpu>,
}

/// Reports the steps of a reserved chunk as they are done (a reservation's progress).
pub(crate) trait Progress {
    /// `len` bytes mapped and placed.
    fn placed(&self, len: usize);
    /// `len` bytes populated (and checked).
    fn populated(&self, len: usize);
    /// One registration's driver call took `took` (whether it worked or not).
    fn driver_call(&self, took: std::time::Duration);
    /// `len` bytes registered.
    fn registered(&self, len: usize);
}

/// No one to tell: a chunk made for a request.
impl Progress for () {
    fn placed(&self, _len: usize) {}
    fn populated(&self, _len: usize) {}
    fn driver_call(&self, _took: std::time::Duration) {}
    fn registered(&self, _len: usize) {}
}

/// The error of a `policy=bind` block with pages off the node.
fn bind_exhausted() -> Error {
    Error::Syscall {
        call: "mbind(MPOL_BIND)",
        errno: libc::ENOMEM,
    }
}

/// The placer of one allocator value (or of a shared pool in this process): its rules, its
/// placement state, its counters and the seams to the layers above. Made per call (it only
/// borrows).
pub(crate) struct Placer<'a> {
    pub(crate) rules: &'a Rules,
    pub(crate) numa: &'a Numa,
    pub(crate) counters: &'a Counters,
    pub(crate) seams: &'a dyn Seams,
}

impl Placer<'_> {
    /// A dedicated block of `capacity` bytes at a multiple of `align`, through every step:
    /// checked against the cgroup limit, mapped, placed, its first `populate` bytes populated
    /// and checked (none: a lazy block), registered as `pin` decides. Returns its memory and whether it is pinned. A failure
    /// unmaps what was mapped (its guard), counted as a released block, and says at which step.
    pub(crate) fn block(
        &self,
        capacity: usize,
        align: usize,
        place: &Place,
        populate: usize,
        pin: PinPolicy,
    ) -> Result<(Memory, bool), (Cause, Error)> {
        // Populating beyond a cgroup's limit would summon the OOM killer: fail before mapping.
        self.seams
            .memory_limits()
            .check(capacity)
            .map_err(|e| (Cause::MemoryLimit, e))?;
        let mut mapping = self.map(capacity, align).map_err(|e| (Cause::Mmap, e))?;
        if populate == 0 && self.rules.huge_pages && capacity >= HUGE_PAGE {
            self.seams.advise_lazy(&mut mapping.whole());
        }
        let placed = self.place_and_populate(&mut mapping.whole(), &place.nodes, populate);
        let made = placed.and_then(|()| {
            let mut memory = Memory::new(mapping);
            pin.settle(self.counters, || self.register(place.gpu, &mut memory))
                .map(|pinned| (memory, pinned))
                .map_err(|e| (Cause::Other, e))
        });
        if made.is_err() {
            // Unmapped by its guard: nothing registered it (registering is the last step).
            self.counters.released_blocks.incr();
        }
        made
    }

    /// A chunk of `len` bytes (2 MiB aligned, huge pages when `huge`) from `source`, placed;
    /// when `pin` registers, populated whole, checked and registered (a chunk registers whole
    /// or not at all, so that a block never straddles two registrations). A failure unmaps it,
    /// counted as a released block.
    pub(crate) fn chunk(
        &self,
        source: &'static dyn ChunkSource,
        len: usize,
        huge: bool,
        place: &Place,
        pin: PinPolicy,
    ) -> Result<Chunk, Error> {
        if pin.registers() {
            // A pinned chunk is populated whole.
            self.seams.memory_limits().check(len)?;
        }
        let mapping = Mapping::new(source, len, HUGE_PAGE)?;
        let made = self.make_chunk(mapping, huge, place, pin, pin.registers(), &());
        if made.is_err() {
            // The mapping went with the error (its guard unmapped it).
            self.counters.released_blocks.incr();
        }
        made
    }

    /// A reserved chunk of `len` bytes: mapped, placed, populated whole, registered as `pin`
    /// decides ([`PinPolicy::reserving`]: a reservation is what it promises), each step
    /// reported to `progress`.
    pub(crate) fn reserved_chunk(
        &self,
        source: &'static dyn ChunkSource,
        len: usize,
        huge: bool,
        place: &Place,
        pin: PinPolicy,
        progress: &dyn Progress,
    ) -> Result<Chunk, Error> {
        let mapping = Mapping::new(source, len, HUGE_PAGE)?;
        let mut chunk = self.make_chunk(mapping, huge, place, pin, true, progress)?;
        chunk.set_reserved();
        Ok(chunk)
    }

    /// The steps of a chunk over `mapping`: placed, populated whole and checked when
    /// `populate`, registered as `pin` decides, each step reported to `progress`.
    fn make_chunk(
        &self,
        mapping: Mapping,
        huge: bool,
        place: &Place,
        pin: PinPolicy,
        populate: bool,
        progress: &dyn Progress,
    ) -> Result<Chunk, Error> {
        let len = mapping.len();
        let mut chunk = self.placed_chunk(mapping, huge, &place.nodes)?;
        progress.placed(len);
        if populate {
            self.populate_chunk(&mut chunk, &place.nodes)?;
            progress.populated(len);
        }
        let pinned = pin.settle(self.counters, || {
            let start = Instant::now();
            let registered = chunk.register(|memory| self.register(place.gpu, memory));
            progress.driver_call(start.elapsed());
            registered
        })?;
        if pinned {
            progress.registered(len);
        }
        Ok(chunk)
    }

    /// A chunk of `mapping`: advised (huge pages or not) and placed, nothing populated.
    fn placed_chunk(
        &self,
        mut mapping: Mapping,
        huge: bool,
        nodes: &NodeMask,
    ) -> Result<Chunk, Error> {
        let mut whole = mapping.whole();
        whole.advise_huge(huge);
        self.place(&mut whole, nodes)?;
        let granule = if huge {
            HUGE_PAGE
        } else {
            self.seams.page_size()
        };
        Chunk::new(mapping, granule)
    }

    /// Populates and checks a whole chunk (before it is registered, or for a reservation).
    fn populate_chunk(&self, chunk: &mut Chunk, nodes: &NodeMask) -> Result<(), Error> {
        if let Some(mut part) = chunk.plan_populate_whole() {
            self.populate_part(&mut part, nodes, true)?;
        }
        Ok(())
    }

    /// A fresh anonymous mapping of `capacity` bytes at a multiple of `align`: 2 MiB aligned and
    /// advised `MADV_HUGEPAGE` for big blocks when huge pages are on.
    pub(crate) fn map(&self, capacity: usize, align: usize) -> Result<Mapping, Error> {
        let huge = self.rules.huge_pages && capacity >= HUGE_PAGE;
        let map_align = if huge { align.max(HUGE_PAGE) } else { align };
        // Anonymous: a dedicated block grows by `mremap` and is released as anonymous memory.
        let mut mapping =
            Mapping::new(&ANONYMOUS, capacity, map_align.max(self.seams.page_size()))?;
        if huge {
            mapping.whole().advise_huge(true);
        }
        Ok(mapping)
    }

    /// Places on `nodes` a part never written, then populates and checks its first `populate`
    /// bytes (steps 2–4; the whole part for its length or more); the rest (all of it for 0, a
    /// lazy kind) is faulted in where touched.
    pub(crate) fn place_and_populate(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
        populate: usize,
    ) -> Result<(), (Cause, Error)> {
        let placed = self.place(part, nodes).map_err(|e| (Cause::Other, e))?;
        let head = Span {
            addr: part.ptr().as_ptr() as usize,
            len: populate.min(part.len()),
        };
        let Some(mut head) = part.sub(head).filter(|_| head.len > 0) else {
            return Ok(());
        };
        self.populate(&mut head, nodes)
            .map_err(|e| (Cause::Populate, e))?;
        if placed {
            self.check_placement(&mut head, nodes).map_err(|e| {
                let cause = if e == bind_exhausted() {
                    Cause::BindExhausted
                } else {
                    Cause::Other
                };
                (cause, e)
            })?;
        }
        Ok(())
    }

    /// Populates a part of a chunk never populated (several threads for big parts) and checks
    /// its pages where the settings ask for it; without `populate` (a lazy kind) only checks
    /// that the cgroup's limit leaves room for it, as its pages are faulted in where touched.
    pub(crate) fn populate_part(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
        populate: bool,
    ) -> Result<(), Error> {
        self.seams.memory_limits().check(part.len())?;
        if !populate {
            return Ok(());
        }
        self.populate(part, nodes)?;
        if self.numa.placing() {
            self.check_placement(part, nodes)?;
        }
        Ok(())
    }

    /// Sets the part's NUMA policy. `Ok(false)` when placement is unavailable (counted).
    ///
    /// `policy=bind` is first applied as `preferred`, so that a node too small for the block
    /// shows up as misplaced pages (and a clean failure) instead of the OOM killer at populate
    /// time; the strict policy is set once every page is known to be on the node.
    pub(crate) fn place(&self, part: &mut Part<'_>, nodes: &NodeMask) -> Result<bool, Error> {
        if !self.numa.placing() {
            self.counters.unplaced_blocks.incr();
            return Ok(false);
        }
        let policy = match self.rules.policy {
            MemPolicy::Bind => MemPolicy::Preferred,
            other => other,
        };
        match part.bind(policy, nodes, MbindFlags::default()) {
            Ok(()) => Ok(true),
            Err(Error::NumaUnavailable { errno, .. }) => {
                self.numa.refuse(errno);
                self.counters.unplaced_blocks.incr();
                Ok(false)
            }
            // `preferred` and `interleave` are best effort: a refused policy (EINVAL: a node the
            // cpuset or the kernel does not allow) leaves the block unplaced, counted.
            Err(_) if self.rules.policy != MemPolicy::Bind => {
                self.counters.placement_failures.incr();
                self.counters.unplaced_blocks.incr();
                Ok(false)
            }
            Err(e) => {
                self.counters.placement_failures.incr();
                Err(e)
            }
        }
    }

    /// Counts pages off the policy's nodes (`verify=on` or `policy=bind`) of a populated part;
    /// under `bind` any misplaced page fails the block, otherwise the strict policy is set. When
    /// `move_pages` is refused (seccomp), `bind` sets the strict policy with `MPOL_MF_STRICT`,
    /// so that the kernel does the check (EIO for a misplaced page).
    pub(crate) fn check_placement(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
    ) -> Result<(), Error> {
        let bind = self.rules.policy == MemPolicy::Bind;
        if !(bind || self.rules.verify) {
            return Ok(());
        }
        let (mut checked, mut misplaced) = (0u64, 0u64);
        let counted = part.page_nodes(|_, node| {
            checked += 1;
            let on_policy_node = usize::try_from(node).is_ok_and(|n| nodes.contains(n));
            misplaced += u64::from(!on_policy_node);
        });
        // Whether the kernel must check instead (MPOL_MF_STRICT: EIO if a page is off the nodes).
        let mut strict = false;
        match counted {
            Ok(()) => {
                self.counters.pages_checked.add(checked);
                self.counters.pages_misplaced.add(misplaced);
            }
            // A kernel that refuses move_pages (seccomp) cannot check; placement itself worked.
            Err(Error::NumaUnavailable { .. }) if !bind => {
                self.counters.unverified_blocks.incr();
                return Ok(());
            }
            // Containers allowed mbind (CAP_SYS_NICE) still refuse move_pages: let mbind check.
            Err(Error::NumaUnavailable { .. }) => {
                self.counters.unverified_blocks.incr();
                strict = true;
            }
            Err(e) => {
                self.counters.placement_failures.incr();
                return Err(e);
            }
        }
        if bind {
            if misplaced > 0 {
                return Err(bind_exhausted());
            }
            let flags = MbindFlags {
                strict,
                move_existing: false,
            };
            match part.bind(MemPolicy::Bind, nodes, flags) {
                Err(Error::Syscall { errno, .. }) if strict && errno == libc::EIO => {
                    return Err(bind_exhausted());
                }
                other => other?,
            }
        }
        Ok(())
    }

    /// Populates a part never written for `nodes` (timed): big parts with the node's bound
    /// workers, up to `populate_threads` threads in all; a huge-page part that stalls in
    /// compaction goes on in small pages (counted).
    pub(crate) fn populate(&self, part: &mut Part<'_>, nodes: &NodeMask) -> Result<(), Error> {
        let len = part.len();
        let threads = if len >= PARALLEL_POPULATE_MIN {
            self.rules.populate_threads
        } else {
            1
        };
        let huge = self.rules.huge_pages && len >= HUGE_PAGE;
        let start = Instant::now();
        let populated = self.seams.populate(part, nodes, threads, huge);
        self.counters.populate.record(start.elapsed());
        if populated? {
            self.counters.huge_page_stalls.incr();
        }
        Ok(())
    }

    /// Registers `memory` (populated) whole through `gpu` (none: an error), through
    /// [`Self::registering`].
    pub(crate) fn register(
        &self,
        gpu: Option<&'static Gpu>,
        memory: &mut Memory,
    ) -> Result<(), Error> {
        let len = memory.len();
        self.registering(gpu, len, |gpu, flags| {
            memory.register(gpu, flags).map(|()| true)
        })
        .map(drop)
    }

    /// Registers range `index` of `memory` (a shared pool's chunk, populated) through `gpu`
    /// (none: an error), through [`Self::registering`]; the time it took, or `None` when the
    /// range is registered already (or another thread is registering it now).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    pub(crate) fn register_range(
        &self,
        gpu: Option<&'static Gpu>,
        memory: &Memory,
        index: usize,
    ) -> Result<Option<std::time::Duration>, Error> {
        let len = memory.range(index).map_or(0, |(_, len)| len);
        self.registering(gpu, len, |gpu, flags| {
            memory
                .register_range(index, gpu, flags)
                .map(|took| took.is_some())
        })
    }

    /// Runs `call`, which registers `len` bytes through `gpu` (none: an error) and says whether
    /// it made a driver call, timed and counted. Past the pinned limit, idle page-locked memory
    /// is given back first ([`Seams::make_pinned_room`]), then the limit refuses
    /// ([`Error::PinLimit`], counted in `pin_limited`). The time of a driver call made, or
    /// `None`.
    fn registering(
        &self,
        gpu: Option<&'static Gpu>,
        len: usize,
        call: impl FnOnce(&'static Gpu, PinFlags) -> Result<bool, Error>,
    ) -> Result<Option<std::time::Duration>, Error> {
        // Tests simulate a failed registration, GPU or not (never compiled without the feature).
        #[cfg(feature = "fault-injection")]
        if let Some(code) = crate::sys::fault::injected(crate::sys::fault::FaultPoint::Register) {
            let e = crate::cuda::simulated_register_error(code as u32);
            self.counters.record_pin_failure(&e);
            return Err(e);
        }
        let Some(gpu) = gpu else {
            // Strict means pinned or nothing. The value's kind refuses such a target before
            // anything is mapped; this keeps any other way here from handing one out.
            return Err(Error::CudaUnavailable {
                reason: "pin=strict, but there is no GPU to register blocks with",
            });
        };
        let flags = self.rules.flags;
        let over = page_locked_bytes()
            .saturating_add(len)
            .saturating_sub(flags.limit);
        if over > 0 {
            self.seams.make_pinned_room(over);
        }
        let start = Instant::now();
        let registered = call(gpu, flags);
        let took = start.elapsed();
        match &registered {
            Ok(false) => return Ok(None),
            Ok(true) => {
                self.counters.pin.record(took);
                self.counters.registrations.incr();
                if len > self.rules.registration_bound() {
                    self.counters.oversized_registrations.incr();
                }
            }
            Err(Error::PinLimit { .. }) => self.counters.pin_limited.incr(),
            Err(e) => {
                self.counters.pin.record(took);
                self.counters.record_pin_failure(e);
            }
        }
        registered.map(|_| Some(took))
    }
}
