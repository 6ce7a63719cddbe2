//! Teardown: threads that exit holding live or cached blocks (freed by thread-local destructors,
//! during thread teardown), allocators dropped with blocks outstanding, and processes that exit
//! with blocks live, cached, or in the middle of being allocated. Nothing may crash, and with
//! `stats=exit`/`stats=json` every allocator in a static reports once, without hanging. And
//! processes that exit while their first pinned allocations are under way, on the CUDA driver
//! simulator, many times over: no registration may reach the driver after its teardown began.
//!
//! `NUMA_GPU_ALLOC_TEST_EXIT_RUNS` sets how many of those short processes run (default 24; CI
//! runs 1,000 in release).

use std::alloc::Layout;
use std::cell::RefCell;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, PoisonError};
use std::time::{Duration, Instant};

use allocator_api2::alloc::Allocator;
use numa_gpu_alloc::{NumaGpuAlloc, ENV_VAR};

mod common {
    pub mod child;
    // Only its builder of the simulator is used here, not its test macro.
    #[allow(unused_macros)]
    pub mod sim;
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

const RACE_CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_EXIT_RACE_CHILD";
/// What the simulator prints before it aborts on a registration after its teardown began.
const TORN_DOWN: &str = "after the driver was torn down at exit";

/// The racing child: four threads allocate and free pinned blocks from the first instant, so
/// the driver probe, the first context, the populate workers and the decay thread all start
/// together; one block in four is 64–100 MiB (populated by several threads). The main thread
/// exits `delay_us` in, while they are still at it.
fn exit_race_child(delay_us: u64) {
    eprintln!("exit race child: exiting {delay_us} us in");
    for t in 0..4usize {
        std::thread::spawn(move || {
            for i in 0usize.. {
                let mib = if i % 4 == 3 {
                    64 + (i * 11 + t * 5) % 37
                } else {
                    1 + (i * 13 + t * 7) % 64
                };
                std::hint::black_box(Vec::<u8>::with_capacity(mib * MIB));
            }
        });
    }
    std::thread::sleep(Duration::from_micros(delay_us));
    std::process::exit(0);
}

/// How one racing child ended.
enum RaceEnd {
    Clean,
    /// The simulator aborted: a registration reached it after its teardown began.
    Aborted(String),
    /// Anything else that is not a clean exit (a crash, a hang, a body that did not run).
    Failed(String),
}

/// Runs the racing child once, exiting `delay_us` in, with the simulator's teardown taking
/// 300 ms (other threads run meanwhile). A child still running after a minute is killed.
fn run_exit_race_child(delay_us: u64) -> RaceEnd {
    let dir = common::sim::library_dir();
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            &common::child::test_path(
                module_path!(),
                "exits_while_the_first_pinned_blocks_are_made_never_register_into_the_teardown",
            ),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(RACE_CHILD_VAR, delay_us.to_string())
        .env("LD_LIBRARY_PATH", dir)
        .env(ENV_VAR, "pin=on")
        .env("CUDA_SIM_TEARDOWN_US", "300000")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("re-executing the test binary");
    let stderr = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let deadline = Instant::now() + Duration::from_secs(60);
    let status: Option<ExitStatus> = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stderr = reader.join().unwrap_or_default();
    let text = format!("exit {delay_us} us in: {status:?}\n{stderr}");
    match status {
        _ if stderr.contains(TORN_DOWN) => RaceEnd::Aborted(text),
        Some(s) if s.success() && stderr.contains("exit race child: exiting") => RaceEnd::Clean,
        Some(s) if s.signal() == Some(libc::SIGABRT) => RaceEnd::Aborted(text),
        _ => RaceEnd::Failed(text),
    }
}

/// Many short processes on the simulator, each exiting 0–30 ms in (spread over the runs) while
/// four threads make their first pinned blocks: the exit must never let a registration reach
/// the driver after its teardown began. Runs eight children at a time: each mostly waits for
/// the simulator's 300 ms teardown.
#[test]
fn exits_while_the_first_pinned_blocks_are_made_never_register_into_the_teardown() {
    if let Some(delay) = common::child::mode(RACE_CHILD_VAR) {
        return exit_race_child(delay.parse().expect("a delay in microseconds"));
    }
    let runs: usize = std::env::var("NUMA_GPU_ALLOC_TEST_EXIT_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let next = AtomicUsize::new(0);
    let ends = Mutex::new(Vec::with_capacity(runs));
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| loop {
                let run = next.fetch_add(1, Ordering::Relaxed);
                if run >= runs {
                    break;
                }
                // 0–30 ms, spread over the runs in microseconds.
                let delay_us = (run as u64 * 7919) % 30_001;
                let end = run_exit_race_child(delay_us);
                ends.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(end);
            });
        }
    });
    let ends = ends.into_inner().unwrap_or_else(PoisonError::into_inner);
    let aborted: Vec<_> = ends
        .iter()
        .filter_map(|e| match e {
            RaceEnd::Aborted(text) => Some(text),
            _ => None,
        })
        .collect();
    let failed: Vec<_> = ends
        .iter()
        .filter_map(|e| match e {
            RaceEnd::Failed(text) => Some(text),
            _ => None,
        })
        .collect();
    let clean = ends.iter().filter(|e| matches!(e, RaceEnd::Clean)).count();
    eprintln!(
        "exit race: runs {runs}, aborts {}, other failures {}, clean {clean}, in {:.1} s",
        aborted.len(),
        failed.len(),
        start.elapsed().as_secs_f64()
    );
    let when: Vec<_> = aborted
        .iter()
        .filter_map(|t| t.strip_prefix("exit ")?.split(" us in").next())
        .collect();
    assert!(
        aborted.is_empty() && failed.is_empty(),
        "{} of {runs} processes aborted at exit (exiting at {} us), {} failed otherwise; the \
         first:\n{}",
        aborted.len(),
        when.join(", "),
        failed.len(),
        aborted
            .first()
            .or(failed.first())
            .map_or("", |t| t.as_str())
    );
}

const PRELOADED_VAR: &str = "NUMA_GPU_ALLOC_TEST_PRELOADED_CHILD";

/// The child: the program loads and initialises libcuda itself (as cudarc does when a program
/// makes a context first), exits, and a thread makes its first pinned block during the exit,
/// inside the driver's teardown.
fn preloaded_child() {
    // SAFETY: loads the simulator as libcuda and calls its cuInit(0), as a program would.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        assert!(!lib.is_null(), "the simulator loads");
        let entry = libc::dlsym(lib, c"cuInit".as_ptr());
        assert!(!entry.is_null(), "cuInit");
        let cu_init: extern "C" fn(u32) -> u32 = std::mem::transmute(entry);
        assert_eq!(cu_init(0), 0);
    }
    let go = Arc::new(Barrier::new(2));
    let late = Arc::clone(&go);
    std::thread::spawn(move || {
        late.wait();
        // Well inside the simulator's 300 ms teardown, which runs in the loader's exit handler.
        std::thread::sleep(Duration::from_millis(100));
        let v = std::hint::black_box(Vec::<u8>::with_capacity(8 << 20));
        drop(v);
        std::thread::sleep(Duration::from_secs(5));
    });
    go.wait();
    std::process::exit(0);
}

/// A program that loaded libcuda before the crate's first probe: the exit gate's handler was
/// registered at load time, so the first pinned block made during the exit never registers
/// into the driver's teardown.
#[test]
fn a_driver_the_program_loaded_first_is_not_called_in_its_teardown() {
    if common::child::mode(PRELOADED_VAR).is_some() {
        return preloaded_child();
    }
    let runs = 5;
    let aborted = (0..runs)
        .filter(|_| {
            let out = Command::new(std::env::current_exe().unwrap())
                .args([
                    "a_driver_the_program_loaded_first_is_not_called_in_its_teardown",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(PRELOADED_VAR, "1")
                .env("LD_LIBRARY_PATH", common::sim::library_dir())
                .env(ENV_VAR, "pin=on")
                .env("CUDA_SIM_TEARDOWN_US", "300000")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .output()
                .expect("running the child");
            String::from_utf8_lossy(&out.stderr).contains("torn down")
        })
        .count();
    assert_eq!(
        aborted, 0,
        "{aborted} of {runs} registered into the teardown"
    );
}
