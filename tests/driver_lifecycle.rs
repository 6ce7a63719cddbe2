//! The driver's start and end against the CUDA driver simulator: a child forked while another
//! thread probes a slow driver, and processes that exit while other threads pin or a reservation
//! registers its chunks (the simulator aborts on a registration after its teardown at exit, which
//! takes `CUDA_SIM_TEARDOWN_US` while other threads still run).
//!
//! The exit checks run many short processes: `NUMA_GPU_ALLOC_TEST_EXIT_RUNS` sets how many
//! (default 20 each; the long soak runs 300).

#[macro_use]
#[path = "common/require.rs"]
pub mod require_support;
#[macro_use]
#[path = "common/sim.rs"]
pub mod sim_support;
mod common {
    pub use super::require_support as require;
    pub use super::sim_support as sim;
}

use std::alloc::{GlobalAlloc, Layout};
use std::time::{Duration, Instant};

use common::sim;
use numa_gpu_alloc::{NumaGpuAlloc, PinMode};

const MIB: usize = 1 << 20;

sim_test!(
    /// The probe (the first `cuInit` takes 1 s here) runs on another thread when the process
    /// forks: neither the child's own question (`cuda_driver_present`) nor its first large
    /// allocation may wait for a probe that never ends there.
    a_child_forked_during_a_slow_driver_probe_allocates,
    env: [("CUDA_SIM_INIT_US", "1000000")],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: needs the simulator's slow cuInit"
        );
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();
        let prober = std::thread::spawn(numa_gpu_alloc::cuda_driver_present);
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: the child only allocates through the crate, writes and exits with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let present = numa_gpu_alloc::cuda_driver_present();
            let layout = Layout::from_size_align(8 * MIB, 64).unwrap();
            // SAFETY: a valid layout; the block is written within its size and freed with it.
            let ok = !present && unsafe {
                let p = ALLOC.alloc(layout);
                if !p.is_null() {
                    p.write_bytes(7, layout.size());
                    ALLOC.dealloc(p, layout);
                }
                !p.is_null()
            };
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let status = wait_for(pid, Duration::from_secs(20));
        assert_eq!(status, Some(0), "the child (None: hung, killed after 20 s)");
        assert!(prober.join().unwrap(), "the parent's probe finished");
    }
);

sim_test!(
    /// A child forked after the parent initialised CUDA, whose allocator does not pin, neither
    /// asks the driver nor reports that it cannot: it never wanted CUDA.
    a_child_that_does_not_pin_reports_nothing_about_cuda,
    env: [],
    {
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();
        assert!(numa_gpu_alloc::cuda_driver_present());
        // SAFETY: the child only allocates through the crate, reads its stats and exits with
        // `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let layout = Layout::from_size_align(8 * MIB, 64).unwrap();
            // SAFETY: a valid layout, freed with it.
            let ok = unsafe {
                let p = ALLOC.alloc(layout);
                let ok = !p.is_null();
                if ok {
                    ALLOC.dealloc(p, layout);
                }
                ok
            };
            let errors = ALLOC.stats().config_errors;
            for e in &errors {
                eprintln!("child reported: {e}");
            }
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok && errors.is_empty() { 0 } else { 1 }) };
        }
        assert_eq!(wait_for(pid, Duration::from_secs(20)), Some(0), "the child's verdict");
    }
);

/// Waits for `pid` at most `limit`; its exit status, or `None` (and killed) if still running.
fn wait_for(pid: libc::pid_t, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    loop {
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a valid out-pointer.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            return libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
        }
        if Instant::now() > deadline {
            // SAFETY: our child, still running.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs this binary's test `name` (its body) in `runs` simulator processes with `env`, each body
/// returning after 0–30 ms more when `vary_delay`, and asserts that none failed; prints the
/// counts.
fn soak(name: &str, vary_delay: bool, env: &[(&str, &str)]) {
    let runs: usize = std::env::var("NUMA_GPU_ALLOC_TEST_EXIT_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut failures = Vec::new();
    for run in 0..runs {
        let delay = format!("{}", if vary_delay { (run * 7919) % 31 } else { 0 });
        let mut env = env.to_vec();
        env.push(("NUMA_GPU_ALLOC_TEST_EXIT_DELAY_MS", &delay));
        let (passed, output) = sim::run_child(name, &env);
        if !passed {
            failures.push(output);
        }
    }
    eprintln!("{name}: {runs} processes, {} failed", failures.len());
    assert!(
        failures.is_empty(),
        "{} of {runs} processes failed; the first:\n{}",
        failures.len(),
        failures[0]
    );
}

/// The delay a soak run asks for before its body returns (0–30 ms, varied over the runs).
fn exit_delay() -> Duration {
    let ms = std::env::var("NUMA_GPU_ALLOC_TEST_EXIT_DELAY_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Duration::from_millis(ms)
}

/// Four threads allocate pinned blocks of 2–62 MiB (carved from chunks registered as they are
/// needed) while the body returns: the process exits with registrations under way.
#[test]
fn exits_while_threads_pin_never_register_into_the_teardown() {
    if !sim::in_body() {
        return soak(
            "exits_while_threads_pin_never_register_into_the_teardown",
            true,
            &[("CUDA_SIM_TEARDOWN_US", "300000")],
        );
    }
    static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);
    for t in 0..4 {
        std::thread::spawn(move || {
            for i in 0usize.. {
                let layout =
                    Layout::from_size_align((2 + (i * 13 + t * 7) % 61) * MIB, 64).unwrap();
                // SAFETY: a valid layout; the block is written within its size and freed with it.
                unsafe {
                    let p = ALLOC.alloc(layout);
                    if !p.is_null() {
                        p.write_bytes(1, 4096);
                        ALLOC.dealloc(p, layout);
                    }
                }
                if i % 8 == 7 {
                    ALLOC.trim();
                }
            }
        });
    }
    std::thread::sleep(Duration::from_millis(20) + exit_delay());
}

/// The body returns right after `reserve_in_background` does: the reservation's first chunk
/// registers while the process exits.
#[test]
fn an_exit_right_after_a_background_reservation_starts_never_registers_into_the_teardown() {
    if !sim::in_body() {
        return soak(
            "an_exit_right_after_a_background_reservation_starts_never_registers_into_the_teardown",
            false,
            &[
                ("CUDA_SIM_TEARDOWN_US", "300000"),
                ("CUDA_SIM_REGISTER_US_PER_GIB", "200000"),
            ],
        );
    }
    static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);
    let reservation = ALLOC.reserve_in_background(2 << 30).expect("start");
    std::thread::sleep(exit_delay());
    drop(reservation);
}

/// The JSON line of the report at exit in `output`.
fn exit_report(output: &str) -> serde_json::Value {
    let line = output
        .lines()
        .rfind(|l| l.starts_with('{') && l.contains("\"page_locked_bytes\""))
        .unwrap_or_else(|| panic!("no report at exit:\n{output}"));
    serde_json::from_str(line).expect("the report is JSON")
}

/// `stats=json` with a pinned limit: three pinned blocks stay live at exit, and the report's
/// page-locked bytes and heap rows are read at exit, as its node rows are (not when the report
/// was set up).
#[test]
fn the_report_at_exit_reads_page_locked_bytes_at_exit() {
    if sim::in_body() {
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();
        for size in [40, 60, 80] {
            let layout = Layout::from_size_align(size * MIB, 64).unwrap();
            // SAFETY: a valid layout; the blocks stay live until the process exits.
            assert!(!unsafe { ALLOC.alloc(layout) }.is_null());
        }
        return;
    }
    let (passed, output) = sim::run_child(
        "the_report_at_exit_reads_page_locked_bytes_at_exit",
        &[("NUMA_GPU_ALLOC", "pin=on,pin_limit=256MiB,stats=json")],
    );
    assert!(passed, "{output}");
    let report = exit_report(&output);
    let page_locked = report["page_locked_bytes"].as_u64().unwrap();
    let node_rows: u64 = report["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["pinned_bytes"].as_u64().unwrap())
        .sum();
    let heap_rows = report["heaps"].as_array().unwrap().len();
    eprintln!("at exit: page-locked {page_locked}, node rows {node_rows}, {heap_rows} heap rows");
    assert!(page_locked >= (180 * MIB) as u64, "{report}");
    assert_eq!(page_locked, node_rows, "{report}");
    // None existed when the report was set up, at the first request.
    assert!(heap_rows > 0, "heap rows read at exit: {report}");
}

/// `reserve_background=on`: the first request does not wait for the reservation (registration
/// takes 8 s per GiB here), which prints one line when it ends.
#[test]
fn a_background_reservation_from_the_environment_says_once_how_it_ended() {
    if sim::in_body() {
        static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();
        let layout = Layout::from_size_align(2 * MIB, 64).unwrap();
        // SAFETY: a valid layout, freed with it.
        unsafe {
            let p = ALLOC.alloc(layout);
            assert!(!p.is_null());
            assert!(
                ALLOC.stats().reserved_bytes < (256 * MIB) as u64,
                "not waited for"
            );
            ALLOC.dealloc(p, layout);
        }
        let start = Instant::now();
        while ALLOC.stats().reserved_bytes < (256 * MIB) as u64 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{}",
                ALLOC.stats()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // The line comes after the last chunk is added.
        std::thread::sleep(Duration::from_millis(200));
        return;
    }
    let (passed, output) = sim::run_child(
        "a_background_reservation_from_the_environment_says_once_how_it_ended",
        &[
            (
                "NUMA_GPU_ALLOC",
                "pin=on,reserve=256MiB,reserve_background=on",
            ),
            ("CUDA_SIM_REGISTER_US_PER_GIB", "8000000"),
        ],
    );
    assert!(passed, "{output}");
    let lines: Vec<_> = output
        .lines()
        .filter(|l| l.contains("reserve in the background"))
        .collect();
    assert_eq!(lines.len(), 1, "{output}");
    assert!(lines[0].contains("256 MiB usable in 4 chunks"), "{output}");
}
