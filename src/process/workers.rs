//! The populate workers: one pool of threads per node, bound to that node's CPUs, made lazily and
//! kept for every later block and reservation.
//!
//! Faulting memory in is CPU work (the kernel clears each page) done on the node the pages land
//! on: a thread on another socket clears remote memory, at a fraction of the speed, and a thread
//! spawned per block pays its start-up each time. So each node's workers are bound
//! (`sched_setaffinity`) to the node's CPUs that this process may use (its cgroup's cpuset within
//! its main thread's affinity; never the affinity of whichever thread first needed them); the
//! workers of a node without such CPUs, and of ranges spread over several nodes, to all of them.
//!
//! A range is cut into pieces that the caller and the workers take in turn from one cursor; the
//! caller works too, so a range is populated even when no worker could be started, and it
//! returns once every piece is done. A job asks for at most its runtime's `populate_threads`
//! threads (the caller included); a pool grows to the most any job asked for.
//!
//! After a fork the child has none of the parent's threads: the first job in the child finds the
//! pool made in another process and makes its own (the old one is left as it is, its lock
//! perhaps held by a thread that no longer exists).
//!
//! Unsafe code here relies on each job's range being the caller's for the job's whole life,
//! which lasts until the caller has seen every piece done.
#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::chunk::Part;
use crate::guard::Inside;
use crate::sys;
use crate::sys::lock::Lock;
use crate::Error;

/// How many nodes get a pool of their own; ranges on nodes beyond, or on several nodes, share
/// one more.
const MAX_NODES: usize = 64;
/// The smallest piece a job is cut into: below this, handing a piece over costs more than it
/// saves. A multiple of the huge page, so that no two threads fault the same one.
const MIN_PIECE: usize = 8 << 20;
/// How many pieces per thread: enough that a slow thread (a remote CPU, a compaction stall)
/// does not hold up the rest.
const PIECES_PER_THREAD: usize = 4;
/// The slowest a piece of a huge-page range may populate, while the kernel counts direct
/// compaction stalls, before the rest of the range is advised `MADV_NOHUGEPAGE`: the kernel is
/// compacting memory for each huge page (seen at GB per minute on busy hosts), and small pages,
/// which need no compaction, go on at their speed (khugepaged may collapse them later). A piece
/// slow for another reason (the CPUs busy) keeps its huge pages.
const STALL_BYTES_PER_SEC: u64 = 128 << 20;
/// Workers do nothing but fault pages in; a small stack is plenty.
const WORKER_STACK: usize = 256 << 10;

/// The pools of nodes `0..MAX_NODES`, then the shared one.
static POOLS: [AtomicPtr<Pool>; MAX_NODES + 1] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_NODES + 1];

/// Populates `ptr..ptr+len` with up to `threads` threads (the caller among them): the workers
/// of `node` (or, for a range on no single node, the shared pool), bound to the CPUs `cpus`
/// gives when the pool is made (empty: left unbound). A range advised `MADV_HUGEPAGE` (`huge`) whose
/// pieces populate slower than [`STALL_BYTES_PER_SEC`] goes on in small pages; returns whether
/// that happened.
///
/// The part is never written yet (on kernels without `MADV_POPULATE_WRITE` populating writes
/// zeros); the caller holds it alone until this returns.
pub(crate) fn populate(
    node: Option<usize>,
    cpus: impl FnOnce() -> Vec<usize>,
    part: &mut Part<'_>,
    threads: usize,
    huge: bool,
) -> Result<bool, Error> {
    let (ptr, len) = (part.ptr(), part.len());
    let threads = threads.min(len / MIN_PIECE).max(1);
    if threads == 1 && !(huge && len >= 2 * MIN_PIECE) {
        // SAFETY: the part is the caller's alone, and all zeros (never written).
        return unsafe { sys::populate(ptr, len) }.map(|_| false);
    }
    let piece = (len / (threads * PIECES_PER_THREAD))
        .max(MIN_PIECE)
        .next_multiple_of(MIN_PIECE);
    let job = Arc::new(Job {
        base: ptr.as_ptr() as usize,
        len,
        piece,
        huge,
        small_pages: AtomicBool::new(false),
        compaction_stalls: if huge { compaction_stalls() } else { None },
        cursor: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        finished: AtomicU32::new(0),
        helpers: AtomicUsize::new(threads - 1),
        error: Lock::new(None),
    });
    let pool = (threads > 1).then(|| pool(node, cpus));
    if let Some(pool) = pool {
        pool.grow_to(threads - 1);
        pool.post(Arc::clone(&job));
    }
    job.work();
    while job.finished.load(Ordering::Acquire) == 0 {
        sys::futex_wait(&job.finished, 0);
    }
    if let Some(pool) = pool {
        pool.jobs.lock().retain(|j| !Arc::ptr_eq(j, &job));
    }
    let error = job.error.lock().take();
    error.map_or(Ok(job.small_pages.load(Ordering::Acquire)), Err)
}

/// The pool of `node` (or the shared one), made for this process if there is none (or only
/// the parent's, after a fork).
fn pool(node: Option<usize>, cpus: impl FnOnce() -> Vec<usize>) -> &'static Pool {
    let node = node.filter(|&n| n < MAX_NODES);
    let slot = &POOLS[node.unwrap_or(MAX_NODES)];
    let generation = crate::fork::generation();
    let current = slot.load(Ordering::Acquire);
    // SAFETY: pools are leaked boxes, never freed.
    if let Some(pool) = unsafe { current.as_ref() }.filter(|p| p.generation == generation) {
        return pool;
    }
    let made = Box::into_raw(Box::new(Pool {
        generation,
        cpus: cpus(),
        node,
        workers: AtomicUsize::new(0),
        grow: Lock::new(()),
        jobs: Lock::new(Vec::new()),
        posted: AtomicU32::new(0),
    }));
    match slot.compare_exchange(current, made, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: just leaked.
        Ok(_) => unsafe { &*made },
        Err(other) => {
            // SAFETY: `made` was never shared; `other` is another thread's pool, leaked and
            // never null (the exchange only ever stores pools).
            unsafe {
                drop(Box::from_raw(made));
                &*other
            }
        }
    }
}

/// A node's workers and the jobs they take pieces of.
struct Pool {
    /// The fork generation the pool was made in: its threads exist only there.
    generation: u32,
    /// `None` for the shared pool.
    node: Option<usize>,
    cpus: Vec<usize>,
    workers: AtomicUsize,
    /// Serialises growing, so that two jobs do not both start the missing workers.
    grow: Lock<()>,
    jobs: Lock<Vec<Arc<Job>>>,
    /// Bumped at each posted job; idle workers sleep on it.
    posted: AtomicU32,
}

impl Pool {
    /// Starts workers until there are `count` (fewer if threads cannot be had: the caller then
    /// does more of the work).
    fn grow_to(&'static self, count: usize) {
        if self.workers.load(Ordering::Acquire) >= count {
            return;
        }
        let _growing = self.grow.lock();
        while self.workers.load(Ordering::Acquire) < count {
            let name = match self.node {
                Some(node) => format!("numa-populate-{node}"),
                None => "numa-populate".into(),
            };
            let started = super::spawn_started(&name, WORKER_STACK, move || self.serve());
            if started.is_err() {
                return;
            }
            self.workers.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn post(&self, job: Arc<Job>) {
        self.jobs.lock().push(job);
        self.posted.fetch_add(1, Ordering::Release);
        for _ in 0..self.workers.load(Ordering::Acquire) {
            sys::futex_wake(&self.posted, 1);
        }
    }

    /// A worker's life: bound to the node's CPUs, it takes pieces of posted jobs, or sleeps.
    fn serve(&self) {
        // Allocations made here (none on the way, but the thread's own start) go to the inner
        // allocator, as inside the allocator.
        let _inside = Inside::enter();
        if !self.cpus.is_empty() {
            // Unbound if the kernel refuses: the pages still land where the policy says.
            let _ = sys::bind_thread_to_cpus(&self.cpus);
        }
        loop {
            let seen = self.posted.load(Ordering::Acquire);
            let job = self
                .jobs
                .lock()
                .iter()
                .find(|job| job.wants_helper())
                .cloned();
            match job {
                Some(job) => job.work(),
                None => sys::futex_wait(&self.posted, seen),
            }
        }
    }
}

/// One range being populated.
struct Job {
    base: usize,
    len: usize,
    piece: usize,
    /// Advised `MADV_HUGEPAGE`: watched for compaction stalls.
    huge: bool,
    /// Set once a stall sent the rest of the range to small pages.
    small_pages: AtomicBool,
    /// The kernel's compaction stalls when the job began.
    compaction_stalls: Option<u64>,
    /// The next piece's offset.
    cursor: AtomicUsize,
    /// Bytes populated (or failed) so far.
    done: AtomicUsize,
    /// Set, and the caller woken, when `done` reaches `len`.
    finished: AtomicU32,
    /// Workers the job may still take on.
    helpers: AtomicUsize,
    /// The first piece's failure.
    error: Lock<Option<Error>>,
}

impl Job {
    /// Whether the kernel stalled in direct compaction since the job began.
    fn compacting(&self) -> bool {
        match (self.compaction_stalls, compaction_stalls()) {
            (Some(before), Some(now)) => now > before,
            _ => false,
        }
    }

    /// Advises what no thread took yet `MADV_NOHUGEPAGE`, once.
    fn to_small_pages(&self) {
        if self.small_pages.swap(true, Ordering::AcqRel) {
            return;
        }
        let from = self.cursor.load(Ordering::Acquire).min(self.len);
        if let Some(rest) = NonNull::new((self.base + from) as *mut u8).filter(|_| from < self.len)
        {
            // SAFETY: part of the caller's range (see `work`); advice changes no contents, and
            // pieces being populated meanwhile only get small pages where not yet faulted.
            let _ = unsafe { sys::advise_nohugepage(rest, self.len - from) };
        }
    }

    /// Takes a helper's place, if one is left and there is work left.
    fn wants_helper(&self) -> bool {
        self.cursor.load(Ordering::Acquire) < self.len
            && self
                .helpers
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
    }

    /// Populates pieces until none is left.
    fn work(&self) {
        loop {
            let offset = self.cursor.fetch_add(self.piece, Ordering::AcqRel);
            if offset >= self.len {
                return;
            }
            let len = self.piece.min(self.len - offset);
            // Never null: `base` is a live mapping's address and `offset < len`.
            if let Some(start) = NonNull::new((self.base + offset) as *mut u8) {
                let began = Instant::now();
                // The made-up stall of the tests lasts while the range is in huge pages.
                #[cfg(test)]
                if !self.small_pages.load(Ordering::Acquire) {
                    tests::stall(self.base);
                }
                // SAFETY: the piece lies in the caller's range, which stays the caller's until it
                // has seen `finished`, set only after this piece counts in `done`; pieces are
                // disjoint.
                if let Err(e) = unsafe { sys::populate(start, len) } {
                    self.error.lock().get_or_insert(e);
                }
                if self.huge && stalled(len, began.elapsed()) && self.compacting() {
                    self.to_small_pages();
                }
            }
            if self.done.fetch_add(len, Ordering::AcqRel) + len == self.len {
                self.finished.store(1, Ordering::Release);
                sys::futex_wake(&self.finished, 1);
            }
        }
    }
}

#[cfg(not(test))]
use crate::topology::live::compaction_stalls;
#[cfg(test)]
use tests::compaction_stalls;

/// Whether `len` bytes taking `took` is slower than [`STALL_BYTES_PER_SEC`].
fn stalled(len: usize, took: std::time::Duration) -> bool {
    took.as_nanos() * u128::from(STALL_BYTES_PER_SEC) > len as u128 * 1_000_000_000
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::chunk::{Mapping, ANONYMOUS};

    /// Milliseconds each piece of the range at [`STALL_BASE`] waits before populating: a
    /// compaction stall, made up (other tests' ranges do not wait).
    static STALL_MS: AtomicU64 = AtomicU64::new(0);
    static STALL_BASE: AtomicUsize = AtomicUsize::new(0);

    /// Compaction stalls, as the kernel's counter would show the made-up ones.
    static STALLS: AtomicU64 = AtomicU64::new(0);

    pub(super) fn stall(base: usize) {
        let ms = STALL_MS.load(Ordering::Relaxed);
        if base == STALL_BASE.load(Ordering::Relaxed) && ms > 0 {
            STALLS.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(ms));
        }
    }

    /// The made-up compaction stalls; with `SLOW_BUSY` set, none (a piece slow for want of CPU).
    pub(super) fn compaction_stalls() -> Option<u64> {
        Some(STALLS.load(Ordering::Relaxed) * u64::from(!SLOW_BUSY.load(Ordering::Relaxed)))
    }

    /// Makes the made-up stall a busy machine rather than compaction.
    static SLOW_BUSY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Populates a fresh huge-page-advised mapping of `len` with `threads`; whether it went on
    /// in small pages.
    fn populate_fresh(len: usize, threads: usize) -> bool {
        let mut mapping = Mapping::new(&ANONYMOUS, len, 2 << 20).unwrap();
        STALL_BASE.store(mapping.ptr().as_ptr() as usize, Ordering::Relaxed);
        let mut whole = mapping.whole();
        whole.advise_huge(true);
        populate(None, Vec::new, &mut whole, threads, true).unwrap()
    }

    #[test]
    fn a_stalled_huge_page_range_goes_on_in_small_pages() {
        assert!(stalled(8 << 20, Duration::from_millis(100)));
        assert!(!stalled(8 << 20, Duration::from_millis(10)));
        STALL_MS.store(0, Ordering::Relaxed);
        assert!(
            !populate_fresh(64 << 20, 2),
            "8 MiB pieces in well under 62 ms each"
        );
        STALL_MS.store(200, Ordering::Relaxed);
        assert!(populate_fresh(64 << 20, 2), "pooled: the stall seen");
        assert!(
            populate_fresh(64 << 20, 1),
            "the caller alone: the stall seen"
        );
        SLOW_BUSY.store(true, Ordering::Relaxed);
        assert!(
            !populate_fresh(64 << 20, 2),
            "slow, but no compaction: huge pages kept"
        );
        SLOW_BUSY.store(false, Ordering::Relaxed);
        STALL_MS.store(0, Ordering::Relaxed);
    }
}
