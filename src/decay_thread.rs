//! The decay thread: gives idle memory back while the program allocates nothing large.
//!
//! Decay otherwise ticks on the large path (each large allocation and free looks at idle
//! memory), and a program in a phase of small objects never enters it: the free space its large
//! buffers left stays resident, and in a container whose cpuset confines it to one node, small
//! objects then run that node out of memory. So the first chunk made starts one thread for the
//! process (`decay_thread=off` turns it off). Every half decay time it purges the free ranges of
//! every node's arena idle for the decay time, and all idle free ranges of a node whose free
//! memory (`/sys/devices/system/node/nodeN/meminfo`) runs low. It only purges: releasing chunks
//! and cached blocks stays with the large path, which counts them.
//!
//! It holds one arena lock at a time, briefly (the fork handlers wait for it like for any arena
//! operation), and `madvise`s outside it; a forked child has no such thread until its own first
//! chunk.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::arena::{Released, NODES};
use crate::guard::Inside;
use crate::sys::MAX_NODES;
use crate::sysfs::node_memory_low;

/// Whether the thread runs (or is being started) in this process.
static RUNNING: AtomicBool = AtomicBool::new(false);
/// The shortest decay time of the allocator values that started or found it (milliseconds).
static DECAY_MS: AtomicU64 = AtomicU64::new(u64::MAX);

/// Starts the thread unless it runs, for a value whose idle memory decays after `decay_ms`.
/// Called inside the re-entrancy guard (starting a thread allocates).
pub(crate) fn ensure_running(decay_ms: u64) {
    if decay_ms == u64::MAX {
        return;
    }
    DECAY_MS.fetch_min(decay_ms, Ordering::Relaxed);
    if RUNNING.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("numa-gpu-alloc-decay".to_owned())
        .spawn(run);
    if spawned.is_err() {
        // No thread to be had now: the next chunk tries again.
        RUNNING.store(false, Ordering::Release);
    }
}

/// Called by the fork handler in the child, where the parent's thread does not exist.
pub(crate) fn forget_in_child() {
    RUNNING.store(false, Ordering::Relaxed);
}

fn run() {
    // Whatever this thread allocates goes to the inner allocator.
    let _inside = Inside::enter();
    loop {
        let decay = DECAY_MS.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis((decay / 2).clamp(10, 1000)));
        for node in 0..MAX_NODES {
            let Some(arena) = NODES.existing(node) else {
                continue;
            };
            // Read before locking: the arena's users do not wait for a file.
            let age = if node_memory_low(Path::new("/sys"), node) {
                0
            } else {
                decay
            };
            let mut out = Released::default();
            arena.lock().purge_idle_ranges(age, &mut out);
            out.purge_into(arena);
        }
    }
}
