//! Purges that fail: `MADV_DONTNEED` refuses locked memory (`mlockall`, or blocks the program
//! `mlock`ed before freeing them). `trim()` must still finish, with more fragmented free ranges
//! than one round of purges takes, within a watchdog's bound; each failing range is tried once.
//!
//! With the `fault-injection` feature, purges made to fail show that the decay thread too tries
//! each range once.
//!
//! Every check runs in a child process (this binary, re-executed): `mlockall` is process-wide,
//! and so are the arenas (and the decay thread). A child that cannot lock memory (`RLIMIT_MEMLOCK` without
//! `CAP_IPC_LOCK`) says so, and the test ends as `tests/common/require.rs` says.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;
use numa_gpu_alloc::NumaGpuAlloc;

use crate::common;

const CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_LOCKED_CHILD";
const CHILD_OK: &str = "locked child: all checks passed";
const SKIPPED: &str = "locked child: skipped:";
/// How long `trim()` may take before the child gives up on it.
const BOUND: Duration = Duration::from_secs(10);
const BLOCK: usize = 256 << 10;
/// Free ranges between live blocks: 16 purges fit in one round.
const RANGES: usize = 20;

/// Ends the process with a message if it is not dropped within [`BOUND`].
struct Watchdog(#[allow(dead_code)] mpsc::Sender<()>);

impl Watchdog {
    fn new(what: &'static str) -> Watchdog {
        let (done, wait) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if wait.recv_timeout(BOUND) == Err(mpsc::RecvTimeoutError::Timeout) {
                eprintln!("{what} still running after {BOUND:?}");
                std::process::exit(3);
            }
        });
        Watchdog(done)
    }
}

/// A value whose own decay stays out of the way: only `trim()` purges.
fn alloc() -> NumaGpuAlloc {
    NumaGpuAlloc::new()
        .node(0)
        .threshold(64 << 10)
        .decay_ms(u64::MAX)
        .decay_thread(false)
}

fn layout() -> Layout {
    Layout::from_size_align(BLOCK, 4096).unwrap()
}

/// `2 * RANGES + 1` blocks, written; then every other one freed (`mlock`ed first when `lock`),
/// so that [`RANGES`] free ranges lie between the live ones, which are returned. `Err` when
/// `mlock` is refused.
fn fragment(alloc: &NumaGpuAlloc, lock: bool) -> Result<Vec<NonNull<u8>>, std::io::Error> {
    let blocks: Vec<NonNull<u8>> = (0..2 * RANGES + 1)
        .map(|_| alloc.allocate(layout()).expect("a block").cast::<u8>())
        .collect();
    let mut kept = Vec::new();
    for (i, p) in blocks.into_iter().enumerate() {
        // SAFETY: ours, BLOCK bytes.
        unsafe { std::ptr::write_bytes(p.as_ptr(), 0x5a, BLOCK) };
        if i % 2 == 0 {
            kept.push(p);
            continue;
        }
        // SAFETY: locks pages of our own block; nothing is read or written.
        if lock && unsafe { libc::mlock(p.as_ptr().cast(), BLOCK) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(p, layout()) };
    }
    Ok(kept)
}

/// `trim()` under the watchdog; the time it took.
fn timed_trim(alloc: &NumaGpuAlloc, what: &'static str) -> Duration {
    let _watchdog = Watchdog::new(what);
    let start = Instant::now();
    alloc.trim();
    start.elapsed()
}

/// Frees `kept`, then checks that `trim()` releases everything: whole chunks unmap, locked or
/// not.
fn free_all_and_trim(alloc: &NumaGpuAlloc, kept: Vec<NonNull<u8>>) {
    for p in kept {
        // SAFETY: allocated by `fragment` with this layout.
        unsafe { alloc.deallocate(p, layout()) };
    }
    timed_trim(alloc, "the last trim()");
    let s = alloc.stats();
    assert_eq!(s.cached_bytes(), 0, "{s}");
    assert!(s.nodes.iter().all(|n| n.chunks == 0), "{s}");
}

fn mlockall_child() {
    let alloc = alloc();
    // SAFETY: no pointers; locks this process's memory.
    if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) } != 0 {
        let e = std::io::Error::last_os_error();
        println!("{SKIPPED} mlockall(MCL_CURRENT | MCL_FUTURE) refused: {e}");
        return;
    }
    let kept = fragment(&alloc, false).unwrap();
    let took = timed_trim(&alloc, "trim() under mlockall");
    let s = alloc.stats();
    println!(
        "trim() under mlockall: {took:?}, {} purges failed",
        s.fallbacks.purge_failures
    );
    assert_eq!(s.fallbacks.purge_failures, RANGES as u64, "each once: {s}");
    assert_eq!(
        s.nodes.iter().map(|n| n.purged_bytes).sum::<u64>(),
        0,
        "{s}"
    );
    // A second trim() tries none of them again.
    timed_trim(&alloc, "the second trim() under mlockall");
    assert_eq!(alloc.stats().fallbacks.purge_failures, RANGES as u64);
    // The free ranges kept their data (no purge zeroed them): zeroed requests still get zeros.
    let again: Vec<NonNull<u8>> = (0..RANGES)
        .map(|_| alloc.allocate_zeroed(layout()).unwrap().cast::<u8>())
        .collect();
    for p in again {
        // SAFETY: ours, BLOCK bytes, zeroed.
        let bytes = unsafe { std::slice::from_raw_parts(p.as_ptr(), BLOCK) };
        assert!(
            bytes.iter().all(|&b| b == 0),
            "a zeroed block holds old data"
        );
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(p, layout()) };
    }
    free_all_and_trim(&alloc, kept);
    println!("{CHILD_OK}");
}

fn mlocked_blocks_child() {
    let alloc = alloc();
    let kept = match fragment(&alloc, true) {
        Ok(kept) => kept,
        Err(e) => {
            println!("{SKIPPED} mlock of a {BLOCK}-byte block refused: {e}");
            return;
        }
    };
    let took = timed_trim(&alloc, "trim() with mlocked free blocks");
    let s = alloc.stats();
    println!(
        "trim() with mlocked free blocks: {took:?}, {} purges failed",
        s.fallbacks.purge_failures
    );
    assert_eq!(s.fallbacks.purge_failures, RANGES as u64, "each once: {s}");
    free_all_and_trim(&alloc, kept);
    println!("{CHILD_OK}");
}

/// Runs `test` in a child; a child that could not lock memory ends the test as [`require!`] says.
fn in_child(test: &str) {
    let (stdout, stderr) = common::child::run_test(module_path!(), test, CHILD_VAR);
    // The child's test harness may print its own words first on a line.
    let after = |l: &'static str| move |line: &str| line.find(l).map(|at| line[at..].to_owned());
    // The measurements, for the log.
    let measured = stdout.lines().filter_map(after("trim()"));
    for line in measured.chain(stdout.lines().filter_map(after("purges tried"))) {
        println!("{line}");
    }
    let refused = stdout.lines().find_map(after(SKIPPED));
    require!(refused.is_none(), "{test}: {}", refused.unwrap_or_default());
    assert!(stdout.contains(CHILD_OK), "{stdout}\n{stderr}");
}

#[test]
fn trim_finishes_under_mlockall() {
    if common::child::mode(CHILD_VAR).is_some() {
        return mlockall_child();
    }
    in_child("trim_finishes_under_mlockall");
}

#[test]
fn trim_finishes_when_freed_blocks_were_mlocked() {
    if common::child::mode(CHILD_VAR).is_some() {
        return mlocked_blocks_child();
    }
    in_child("trim_finishes_when_freed_blocks_were_mlocked");
}

/// The decay thread (every 10 ms here) with every purge failing: each range is tried once,
/// however many ticks pass.
#[cfg(feature = "fault-injection")]
fn decay_thread_child() {
    use numa_gpu_alloc::unstable::sys::fault::{self, FaultPoint};
    let alloc = NumaGpuAlloc::new().node(0).threshold(64 << 10).decay_ms(10);
    // Before any range is freed: whoever purges first (a free, an allocation, the thread) fails.
    fault::inject(FaultPoint::Purge, libc::EINVAL, 100_000);
    let kept = fragment(&alloc, false).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let tried = 100_000 - fault::remaining(FaultPoint::Purge);
    println!("purges tried by decay in 500 ms: {tried}");
    assert_eq!(tried, RANGES as u32, "each range once");
    fault::clear();
    free_all_and_trim(&alloc, kept);
    println!("{CHILD_OK}");
}

#[cfg(feature = "fault-injection")]
#[test]
fn the_decay_thread_tries_a_failing_purge_once() {
    if common::child::mode(CHILD_VAR).is_some() {
        return decay_thread_child();
    }
    in_child("the_decay_thread_tries_a_failing_purge_once");
}
