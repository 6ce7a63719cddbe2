//! Teardown: threads that exit holding live or cached blocks (freed by thread-local destructors,
//! during thread teardown), allocators dropped with blocks outstanding, and processes that exit
//! with blocks live, cached, or in the middle of being allocated. Nothing may crash, and with
//! `stats=exit`/`stats=json` every allocator in a static reports once, without hanging.

use std::alloc::Layout;
use std::cell::RefCell;
use std::sync::{Arc, Barrier, Mutex, PoisonError};

use allocator_api2::alloc::Allocator;
use numa_gpu_alloc::{NumaGpuAlloc, ENV_VAR};

mod common {
    pub mod child;
}

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().cache_limit(64 << 20);

const MIB: usize = 1 << 20;

/// Held by the tests that read the process's node rows (shared by every allocator value).
static ROWS: Mutex<()> = Mutex::new(());
const CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_TEARDOWN_CHILD";

/// Frees its blocks when the thread's locals are destroyed, i.e. during thread exit.
struct FreedAtExit(Vec<Vec<u8>>);

impl Drop for FreedAtExit {
    fn drop(&mut self) {
        for (i, v) in self.0.iter().enumerate() {
            assert!(v.iter().step_by(4096).all(|&b| b == i as u8));
        }
        // Allocating during teardown works too (goes wherever the size says).
        let late = vec![0xeeu8; 3 * MIB];
        assert_eq!(late[3 * MIB - 1], 0xee);
    }
}

thread_local! {
    static HELD: RefCell<Option<FreedAtExit>> = const { RefCell::new(None) };
}

#[test]
fn threads_exit_holding_live_and_cached_blocks() {
    let _rows = ROWS.lock().unwrap_or_else(PoisonError::into_inner);
    // Another test frees a block of another value through ALLOC: count from here.
    let before = ALLOC.stats();
    let frees = before.frees.wrapping_sub(before.large_allocations);
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                // Blocks freed now go to the cache; the ones kept are freed at thread exit.
                for round in 0..4 {
                    let v = vec![round as u8; (2 + (t + round) % 5) * MIB];
                    drop(v);
                }
                let kept: Vec<Vec<u8>> = (0..3).map(|i| vec![i as u8; (3 + t) * MIB]).collect();
                HELD.with(|h| *h.borrow_mut() = Some(FreedAtExit(kept)));
                barrier.wait(); // every thread exits at once: contended frees in teardown
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a thread panicked in teardown");
    }
    let s = ALLOC.stats();
    assert_eq!(s.fallbacks.failed_allocations, 0, "{s}");
    assert_eq!(s.cache_hits + s.cache_misses, s.large_allocations, "{s}");
    assert_eq!(s.live_bytes(), 0, "{s}");
    assert_eq!(s.frees.wrapping_sub(s.large_allocations), frees, "{s}");
    ALLOC.trim();
    assert_eq!(ALLOC.stats().cached_bytes(), 0);
}

#[test]
fn dropping_an_allocator_with_blocks_outstanding() {
    let _rows = ROWS.lock().unwrap_or_else(PoisonError::into_inner);
    let layout = Layout::from_size_align(4 * MIB, 4096).unwrap();
    let live;
    {
        let alloc = NumaGpuAlloc::new().node(0);
        let cached = alloc.allocate(layout).unwrap();
        live = alloc.allocate(layout).unwrap().cast::<u8>();
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(cached.cast(), layout) };
        assert!(alloc.stats().cached_bytes() >= 4 * MIB);
        // Dropped here: its blocks stay in node 0's arena, shared by every value.
    }
    // The live block outlives its allocator: still writable, and freed through another value.
    // SAFETY: the block is live and this long.
    unsafe { std::ptr::write_bytes(live.as_ptr(), 1, layout.size()) };
    let frees = ALLOC.stats().frees;
    // SAFETY: live with this layout, freed once.
    unsafe { ALLOC.deallocate(live, layout) };
    assert_eq!(ALLOC.stats().frees, frees + 1);
}

/// What the child does before it exits.
fn child(mode: &str) {
    // Live blocks of the global allocator, and cached ones.
    let live: Vec<Vec<u8>> = (0..4).map(|i| vec![i as u8; 5 * MIB]).collect();
    drop(vec![9u8; 7 * MIB]);
    // A local allocator in a static, never dropped, with a live and a cached block.
    static LOCAL: NumaGpuAlloc = NumaGpuAlloc::new().verify(true);
    let layout = Layout::from_size_align(6 * MIB, 64).unwrap();
    let kept = LOCAL.allocate(layout).unwrap();
    let freed = LOCAL.allocate(layout).unwrap();
    // SAFETY: allocated above with this layout.
    unsafe { LOCAL.deallocate(freed.cast(), layout) };
    // Not in a static: with `stats=` set, it says that it will not report at exit.
    let _ = NumaGpuAlloc::new().placement();
    // Threads that are allocating, freeing or holding blocks when the process goes away.
    let barrier = Arc::new(Barrier::new(5));
    for t in 0..4 {
        let barrier = Arc::clone(&barrier);
        std::thread::spawn(move || {
            let mut held = vec![t as u8; 3 * MIB];
            std::hint::black_box(&held);
            barrier.wait();
            loop {
                let v = vec![t as u8; (2 + t) * MIB + 4096];
                held = v;
                std::hint::black_box(&held);
            }
        });
    }
    barrier.wait();
    std::thread::sleep(std::time::Duration::from_millis(50));
    println!("child {mode}: exiting with blocks outstanding");
    std::hint::black_box((&live, kept));
    match mode {
        "exit" => std::process::exit(0),
        "exit-from-thread" => {
            let exiter = std::thread::spawn(|| std::process::exit(0));
            let _ = exiter.join();
            unreachable!("process::exit returned");
        }
        // Return normally from the test: libtest ends the process with the threads running.
        _ => {
            std::mem::forget(live);
        }
    }
}

#[test]
fn processes_exit_with_blocks_outstanding() {
    if let Some(mode) = common::child::mode(CHILD_VAR) {
        return child(&mode);
    }
    for mode in ["exit", "exit-from-thread", "return"] {
        for stats in ["off", "exit", "json"] {
            let (stdout, stderr) = common::child::run(
                "processes_exit_with_blocks_outstanding",
                CHILD_VAR,
                mode,
                &[(ENV_VAR, &format!("stats={stats}"))],
            );
            assert!(
                stdout.contains(&format!("child {mode}: exiting")),
                "{stdout}\n{stderr}"
            );
            check_exit_reports(stats, &stderr);
        }
    }
}

/// The reports the child's two static allocators print at exit: none, two tables or two JSON
/// lines; `LOCAL`'s with its exact counts. Threads were allocating, so the global one's vary.
fn check_exit_reports(stats: &str, stderr: &str) {
    let tables = stderr.matches("numa-gpu-alloc: host node").count();
    let json: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let notes = stderr.matches("for allocators in a static only").count();
    // Carved from chunks the global allocator may have made already: hits and misses vary.
    let local =
        |line: &str| line.starts_with("large allocations 2 (") && line.contains("), frees 1,");
    match stats {
        "off" => assert_eq!((tables, json.len(), notes), (0, 0, 0), "{stderr}"),
        "exit" => {
            assert_eq!((tables, json.len(), notes), (2, 0, 1), "{stderr}");
            assert_eq!(stderr.lines().filter(|l| local(l)).count(), 1, "{stderr}");
        }
        _ => {
            assert_eq!((tables, json.len(), notes), (0, 2, 1), "{stderr}");
            let local = json.iter().find(|r| r["large_allocations"] == 2);
            let local = local.unwrap_or_else(|| panic!("LOCAL's report: {stderr}"));
            assert_eq!(local["frees"], 1);
            // The node rows are the process's: the global allocator's blocks are there too.
            assert!(
                local["nodes"][0]["live_blocks"].as_u64() >= Some(1),
                "{local}"
            );
            assert!(
                local["pages_checked"].as_u64() > Some(0),
                "verify on: {local}"
            );
        }
    }
    assert!(!stderr.contains("busy at exit"), "node rows read: {stderr}");
}
