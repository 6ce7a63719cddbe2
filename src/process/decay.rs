//! The decay thread: gives idle memory back while the program allocates nothing large.
//!
//! Decay otherwise ticks on the large path (each large allocation and free looks at idle
//! memory), and a program in a phase of small objects never enters it: the free space its large
//! buffers left stays resident, and in a container whose cpuset confines it to one node, small
//! objects then run that node out of memory. So the first chunk made starts one thread for the
//! process (`decay_thread=off` turns it off). Every quarter decay time (at most 250 ms) it purges
//! the free ranges of every node's arena idle for the decay time and releases cached dedicated
//! blocks as idle, and does so with all idle memory of a node whose free memory
//! (`/sys/devices/system/node/nodeN/meminfo`) runs low. Chunks stay mapped (purged) until the
//! large path releases them.
//!
//! It holds one arena lock at a time, briefly (the fork handlers wait for it like for any arena
//! operation), and releases and purges outside it through the same routine as every request
//! ([`Released::finish`]), counted in the process's decay counters, which every value's stats
//! add in. It reads the sysfs root of the value that started it. A forked child has no such
//! thread until its own first chunk.
//!
//! Unsafe code here relies on the decay counters being leaked once and never freed.
#![allow(unsafe_code)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::time::Duration;

use super::NODES;
use crate::arena::Released;
use crate::guard::Inside;
use crate::stats::Counters;
use crate::sys::MAX_NODES;
use crate::topology::live::node_memory_low;

/// Whether the thread runs (or is being started) in this process.
static RUNNING: AtomicBool = AtomicBool::new(false);
/// The shortest decay time of the allocator values that started or found it (milliseconds).
static DECAY_MS: AtomicU64 = AtomicU64::new(u64::MAX);
/// What the thread released and purged, made by its first run and published with one store (no
/// state in between that a fork could catch); kept across a fork: the child's thread counts on.
static COUNTERS: AtomicPtr<Counters> = AtomicPtr::new(std::ptr::null_mut());

/// What the decay thread released and purged in this process, once it ran.
pub(crate) fn counters() -> Option<&'static Counters> {
    // SAFETY: non-null only once a leaked, never freed `Counters` was stored.
    unsafe { COUNTERS.load(Ordering::Acquire).as_ref() }
}

/// The decay thread reads sysfs and gives memory back: std's default stack is ample.
const DECAY_STACK: usize = 2 << 20;

/// Starts the thread unless it runs, for a value whose idle memory decays after `decay_ms` and
/// whose sysfs is at `sysfs_root`. Called inside the re-entrancy guard (starting a thread
/// allocates).
pub(crate) fn ensure_running(decay_ms: u64, sysfs_root: &'static str) {
    if decay_ms == u64::MAX {
        return;
    }
    DECAY_MS.fetch_min(decay_ms, Ordering::Relaxed);
    if RUNNING.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = super::spawn_started("numa-gpu-alloc-decay", DECAY_STACK, move || {
        run(Path::new(sysfs_root))
    });
    if spawned.is_err() {
        // No thread to be had now: the next chunk tries again.
        RUNNING.store(false, Ordering::Release);
    }
}

/// Called by the fork handler in the child, where the parent's thread does not exist.
pub(crate) fn forget_in_child() {
    RUNNING.store(false, Ordering::Relaxed);
}

fn run(root: &Path) {
    // Whatever this thread allocates goes to the inner allocator.
    let _inside = Inside::enter();
    let counters = counters().unwrap_or_else(|| {
        let made: &'static Counters = Box::leak(Box::default());
        COUNTERS.store(std::ptr::from_ref(made).cast_mut(), Ordering::Release);
        made
    });
    loop {
        let decay = DECAY_MS.load(Ordering::Relaxed);
        // Often enough to see a node run low before the small objects exhaust it.
        std::thread::sleep(Duration::from_millis((decay / 4).clamp(10, 250)));
        for node in 0..MAX_NODES {
            let Some(arena) = NODES.existing(node) else {
                continue;
            };
            // Read before locking: the arena's users do not wait for a file.
            let age = if node_memory_low(root, node) {
                0
            } else {
                decay
            };
            let mut out = Released::default();
            {
                let mut arena = arena.lock();
                arena.purge_idle_ranges(age, &mut out);
                arena.release_idle_dedicated(age, &mut out);
            }
            out.finish(Some(arena), counters);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ensure_running, DECAY_MS};
    use std::sync::atomic::Ordering;

    /// Values that disagree on `decay_ms` share one thread, which uses the shortest decay time
    /// of the values that made chunks: a later, longer one does not lengthen it. (Times of
    /// minutes: the thread this starts must not release what other tests cache.)
    #[test]
    fn the_decay_thread_uses_the_shortest_decay_time() {
        let _inside = crate::guard::Inside::enter();
        let root = crate::config::Config::DEFAULT.sysfs_root;
        ensure_running(600_000, root);
        ensure_running(300_000, root);
        ensure_running(900_000, root);
        assert!(DECAY_MS.load(Ordering::Relaxed) <= 300_000);
    }
}
