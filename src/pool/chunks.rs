//! A pool's chunks made ready one by one, each by [`prepare`]: placed on the pool's node
//! (`mbind`, before any page is touched), populated by the node's bound workers, checked page
//! by page (`move_pages`), and registered with CUDA. The creator runs the first three steps on
//! every chunk; each attached process that pins runs the last, in the background, counted in
//! the pool's own [`Progress`].
//!
//! A registration is this process's: the kernel counts the chunks it page-locks against it
//! (its locked memory, `RLIMIT_MEMLOCK` where it applies), and the driver keeps a page table of
//! its own for each (16 bytes per 4 KiB page). N processes that register one pool of S bytes
//! keep one copy of the memory, but pay N registrations. Each is one range of the pool's
//! [`Memory`](crate::chunk::Memory), unregistered before its mapping goes.
//!
//! Unsafe code here relies on the caller's promise, for placement, that the pool is new.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::Pool;
use crate::chunk::{PinFlags, Span};
use crate::cuda::Gpu;
use crate::process::workers;
use crate::sys::{lock::Lock, MbindFlags, MemPolicy, NodeMask};
use crate::Error;

/// Where a new pool's pages go, and who populates them.
#[derive(Debug)]
pub(crate) struct Placement {
    node: usize,
    /// The node's CPUs this process may run on (its populate workers' CPUs).
    cpus: Vec<usize>,
    threads: usize,
    /// Of huge pages (hugetlbfs): no transparent huge page advice.
    huge: bool,
}

impl Placement {
    /// Pages on `node`, populated by up to `threads` threads on `cpus`.
    ///
    /// # Safety
    /// The pool it is used on is new: no page of its blocks was touched, and no other process
    /// uses them yet.
    pub(crate) unsafe fn new(
        node: usize,
        cpus: Vec<usize>,
        threads: usize,
        huge: bool,
    ) -> Placement {
        Placement {
            node,
            cpus,
            threads,
            huge,
        }
    }
}

/// How chunks are registered: through which GPU, within which pinned limit, and how long to
/// wait for the pool's registration lock (until `cancel` is set, at most `wait`).
#[derive(Debug)]
pub(crate) struct Registering<'a> {
    pub(crate) gpu: &'static Gpu,
    pub(crate) flags: PinFlags,
    pub(crate) cancel: &'a AtomicBool,
    pub(crate) wait: Duration,
}

/// The steps [`prepare`] runs on a chunk.
#[derive(Debug)]
pub(crate) struct Steps<'a> {
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
        let flags = MbindFlags {
            strict: true,
            move_existing: false,
        };
        let nodes = NodeMask::single(placement.node)?;
        match part.bind(MemPolicy::Bind, &nodes, flags) {
            // No NUMA here (seccomp, a kernel without it): the pages go where the kernel puts
            // them, as for the allocator's own blocks; the page check says where.
            Ok(()) | Err(Error::NumaUnavailable { .. }) => {}
            Err(e) => return Err(e),
        }
        if !placement.huge {
            part.advise_huge(true);
        }
        let cpus = || placement.cpus.clone();
        workers::populate(
            Some(placement.node),
            cpus,
            &mut part,
            placement.threads,
            !placement.huge,
        )?;
        // Every page must be there: one not resident counts as elsewhere.
        pool.check_node(offset, len, placement.node, true)?;
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
    let took = pool
        .memory()
        .register_range(index, registering.gpu, registering.flags)?;
    drop(lock);
    if took.is_some() {
        pool.header().registrations.fetch_add(1, Ordering::AcqRel);
    }
    Ok(Prepared::Done(took))
}

/// A background registration's progress, the pool's own: bytes and chunks registered, the
/// longest driver call, when the first chunk was done, the cancel flag and the outcome.
pub(crate) struct Progress {
    /// Bytes of the pool's chunks.
    pub(crate) requested: usize,
    pub(crate) start: Instant,
    pub(crate) chunks: AtomicUsize,
    pub(crate) registered: AtomicUsize,
    /// Nanoseconds of the longest registration.
    pub(crate) longest_call_ns: AtomicU64,
    /// Nanoseconds from the start to the first chunk done (0: none yet).
    pub(crate) first_chunk_ns: AtomicU64,
    /// Set to stop after the chunk in progress (or the wait for the lock).
    pub(crate) cancel: AtomicBool,
    /// Set once it ended.
    pub(crate) finished: AtomicBool,
    /// Why it ended early.
    pub(crate) error: Lock<Option<Error>>,
}

impl Progress {
    pub(crate) fn new(requested: usize) -> Progress {
        Progress {
            requested,
            start: Instant::now(),
            chunks: AtomicUsize::new(0),
            registered: AtomicUsize::new(0),
            longest_call_ns: AtomicU64::new(0),
            first_chunk_ns: AtomicU64::new(0),
            cancel: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            error: Lock::new(None),
        }
    }

    /// Counts a chunk of `len` bytes registered (its driver call taking `took`, when this run
    /// made it).
    fn chunk_done(&self, len: usize, took: Option<Duration>) {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if let Some(took) = took {
            self.longest_call_ns.fetch_max(ns(took), Ordering::Relaxed);
        }
        self.registered.fetch_add(len, Ordering::Relaxed);
        self.chunks.fetch_add(1, Ordering::Release);
        let since = ns(self.start.elapsed()).max(1);
        let _ =
            self.first_chunk_ns
                .compare_exchange(0, since, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Records the outcome.
    pub(crate) fn finish(&self, outcome: Result<(), Error>) {
        if let Err(e) = outcome {
            *self.error.lock() = Some(e);
        }
        self.finished.store(true, Ordering::Release);
    }
}

/// Registers every chunk of `pool` not registered yet, in order, until all are, or
/// `progress` is cancelled, or one fails.
pub(crate) fn register_all(
    pool: &Pool,
    gpu: &'static Gpu,
    flags: PinFlags,
    wait: Duration,
    progress: &Progress,
) -> Result<(), Error> {
    let steps = Steps {
        place: None,
        register: Some(Registering {
            gpu,
            flags,
            cancel: &progress.cancel,
            wait,
        }),
    };
    for index in 0..pool.memory().ranges() {
        if progress.cancel.load(Ordering::Acquire) {
            break;
        }
        let len = pool.memory().range(index).map_or(0, |(_, len)| len);
        match prepare(pool, index, &steps)? {
            Prepared::Done(took) => progress.chunk_done(len, took),
            Prepared::Cancelled => break,
        }
    }
    Ok(())
}
