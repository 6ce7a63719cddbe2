//! A pool's chunks made ready one by one, each by [`prepare`], through the one placer
//! ([`Placer`]): placed on the pool's node, populated by the node's bound workers, checked page
//! by page, and registered with CUDA. The creator runs the first three steps on every chunk;
//! each attached process that pins runs the last, in the background ([`register_all`]),
//! counted in its [`Job`].
//!
//! The placer's way is the allocator's: `bind` is first applied as `preferred`, the pages are
//! populated and checked, then the strict policy is set; a node too small shows as pages off
//! the node ([`Error::PoolWrongNode`]) rather than the OOM killer at populate time.
//!
//! A registration is this process's: the kernel counts the chunks it page-locks against it
//! (its locked memory, `RLIMIT_MEMLOCK` where it applies), and the driver keeps a page table of
//! its own for each (16 bytes per 4 KiB page). N processes that register one pool of S bytes
//! keep one copy of the memory, but pay N registrations. Each is one range of the pool's
//! [`Memory`](crate::chunk::Memory), unregistered before its mapping goes.
//!
//! Unsafe code here relies on the caller's promise, for placement, that the pool is new.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::Pool;
use crate::chunk::{Cause, Part, PinFlags, PinPolicy, Placer, Rules, Seams, Span};
use crate::cuda::Gpu;
use crate::process::job::Job;
use crate::process::LargePath;
use crate::sys::{MemPolicy, NodeMask};
use crate::topology::cgroup::MemoryLimits;
use crate::Error;

/// The placer's rules for a pool's chunks: strict placement on its node with every page
/// checked, transparent huge pages unless the pool is of huge pages (`hugetlb`), populated by
/// up to `threads` threads, registered with `flags` in chunks of at most `register_max`.
pub(crate) fn rules(hugetlb: bool, threads: usize, flags: PinFlags, register_max: usize) -> Rules {
    Rules {
        policy: MemPolicy::Bind,
        verify: true,
        huge_pages: !hugetlb,
        populate_threads: threads,
        flags,
        register_max,
    }
}

/// The placer's way to the process for a pool: the process's page size, memory limits and
/// populate workers (its large path). A pool has no idle page-locked memory to give back.
pub(crate) struct PoolSeams(pub(crate) &'static LargePath);

impl Seams for PoolSeams {
    fn page_size(&self) -> usize {
        self.0.page_size()
    }

    fn memory_limits(&self) -> &MemoryLimits {
        self.0.memory_limits()
    }

    fn populate(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
        threads: usize,
        huge: bool,
    ) -> Result<bool, Error> {
        self.0.populate(part, nodes, threads, huge)
    }

    fn make_pinned_room(&self, _bytes: usize) {}
}

/// Where a new pool's pages go.
#[derive(Debug)]
pub(crate) struct Placement {
    node: usize,
}

impl Placement {
    /// Pages on `node`.
    ///
    /// # Safety
    /// The pool it is used on is new: no page of its blocks was touched, and no other process
    /// uses them yet.
    pub(crate) unsafe fn new(node: usize) -> Placement {
        Placement { node }
    }
}

/// How chunks are registered: through which GPU, as which pin policy says, and how long to
/// wait for the pool's registration lock (until `cancel` is set, at most `wait`).
#[derive(Debug)]
pub(crate) struct Registering<'a> {
    pub(crate) gpu: &'static Gpu,
    pub(crate) pin: PinPolicy,
    pub(crate) cancel: &'a AtomicBool,
    pub(crate) wait: Duration,
}

/// The steps [`prepare`] runs on a chunk, and the placer that runs them.
pub(crate) struct Steps<'a> {
    pub(crate) placer: Placer<'a>,
    /// Place, populate and check (the creator's steps).
    pub(crate) place: Option<Placement>,
    /// Register (each pinning process's step).
    pub(crate) register: Option<Registering<'a>>,
}

/// What [`prepare`] did to a chunk.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Prepared {
    /// Its steps ran; the registration's driver call took this long (`None`: not asked, or
    /// registered before).
    Done(Option<Duration>),
    /// Cancelled while it waited for the pool's registration lock.
    Cancelled,
}

/// Runs `steps` on chunk `index` of `pool`: place → populate → check → register.
///
/// # Errors
/// [`Error::InvalidRange`] for an index past the pool's chunks; [`Error::PoolWrongNode`] when
/// the chunk's pages are not all on the node; [`Error::PoolLockHeld`] when another process
/// holds the registration lock past the wait; the populate's or the registration's error
/// ([`Error::PinLimit`] at the pinned limit).
pub(crate) fn prepare(pool: &Pool, index: usize, steps: &Steps<'_>) -> Result<Prepared, Error> {
    let (offset, len) = pool.memory().range(index).ok_or(Error::InvalidRange {
        addr: pool.base(),
        len: index,
    })?;
    let placer = &steps.placer;
    if let Some(placement) = &steps.place {
        let span = Span {
            addr: pool.base() + offset,
            len,
        };
        // SAFETY: a chunk of the pool's mapping, which the placement's maker said is new and
        // nobody else's yet; the part is dropped before this returns.
        let mut part = unsafe { span.claim(None) }.ok_or(Error::InvalidRange {
            addr: span.addr,
            len,
        })?;
        if placer.rules.huge_pages {
            part.advise_huge(true);
        }
        let nodes = NodeMask::single(placement.node)?;
        let whole = part.len();
        placer
            .place_and_populate(&mut part, &nodes, whole)
            .map_err(|(cause, e)| {
                cause.count(placer.counters);
                if cause != Cause::BindExhausted {
                    return e;
                }
                // Pages off the node (one not resident counts as elsewhere): say where.
                pool.check_node(offset, len, placement.node, true)
                    .err()
                    .unwrap_or(e)
            })?;
    }
    let Some(registering) = &steps.register else {
        return Ok(Prepared::Done(None));
    };
    if pool.memory().range_registered(index) {
        return Ok(Prepared::Done(None));
    }
    let Some(lock) = pool.lock_registration(registering.cancel, registering.wait)? else {
        return Ok(Prepared::Cancelled);
    };
    // Under the pool's registration lock, which every thread of every process takes for this.
    let mut took = None;
    registering.pin.settle(placer.counters, || {
        took = placer.register_range(Some(registering.gpu), pool.memory(), index)?;
        Ok(())
    })?;
    drop(lock);
    if took.is_some() {
        pool.header().registrations.fetch_add(1, Ordering::AcqRel);
    }
    Ok(Prepared::Done(took))
}

/// Registers every chunk of `pool` not registered yet, in order, through `placer`, until all
/// are, or `job` is cancelled, or one fails; each chunk registered counted in `job`.
pub(crate) fn register_all(
    pool: &Pool,
    placer: Placer<'_>,
    gpu: &'static Gpu,
    wait: Duration,
    job: &Job,
) -> Result<(), Error> {
    let steps = Steps {
        placer,
        place: None,
        register: Some(Registering {
            gpu,
            // Asked for (`register_in_background`): each chunk registers, or the registration
            // stops with its error, as a reservation's chunks do.
            pin: PinPolicy::reserving(true),
            cancel: job.cancel_flag(),
            wait,
        }),
    };
    for index in 0..pool.memory().ranges() {
        if job.cancelled() {
            break;
        }
        let len = pool.memory().range(index).map_or(0, |(_, len)| len);
        match prepare(pool, index, &steps)? {
            Prepared::Done(took) => {
                if let Some(took) = took {
                    job.driver_call(took);
                }
                job.chunk_done(len);
            }
            Prepared::Cancelled => break,
        }
    }
    Ok(())
}
