//! Large-buffer churn in whole programs: five allocators, each the `#[global_allocator]` of its own
//! child process, on eleven workloads of buffers at and above the 2 MiB threshold.
//!
//! `cargo bench --bench churn [-- --quick] [-- --runs N] [-- --warm-up] [-- --workload a,c]
//! [-- --json PATH]`
//!
//! The driver (this binary with `CHURN_BENCH_ALLOCATOR` unset) runs this binary again once per
//! workload, allocator and run, with `CHURN_BENCH_ALLOCATOR=<allocator> --child <workload>`; run 1
//! of every allocator, then run 2 (starting at the next allocator, in the reverse order), and so
//! on, so that a noisy minute falls on all of them. On a VM whose host takes freed memory back
//! (free page reporting), the first child of a workload that needs more memory than the one
//! before starts on pages the host must back again (cold), the next ones on the pages it just
//! freed (warm): the rotation spreads that over the allocators; `--warm-up` runs one untimed
//! mimalloc child before run 1, so that every measured child starts warm. Each
//! child prints one line: wall seconds of the workload alone, user and system CPU seconds and peak
//! RSS of the whole process (`getrusage`), and for ours its `stats()`. The driver prints, per
//! workload, the median of each figure and the ratios with their targets. `--quick` (also the
//! default without `--bench`, as under `cargo test --benches`) is one run of smaller workloads,
//! for CI. `NUMA_GPU_ALLOC` is removed from the children's environment: the defaults are measured.
//!
//! | allocator | what serves every request of the child |
//! | --- | --- |
//! | `ours/mimalloc` | `NumaGpuAlloc<MiMalloc>` (small requests to mimalloc) |
//! | `mimalloc`, `jemalloc`, `glibc` | `MiMalloc`, `tikv_jemallocator::Jemalloc`, `System` |
//! | `ours/glibc` | `NumaGpuAlloc<System>` |
//!
//! Files: this one is the driver and the child's measuring; `chosen.rs` the global allocator,
//! `workloads.rs` what the children run, `report.rs` the table, ratios and JSON.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../../examples/support/measure.rs"]
#[allow(dead_code)] // `cpu_time`: the children read `getrusage` instead.
mod measure;

#[path = "../common/machine.rs"]
mod machine;

mod chosen;
mod report;
mod workloads;

use std::mem::MaybeUninit;
use std::process::{Command, ExitCode};
use std::time::Instant;

use chosen::{Peer, ALLOC, VAR};
use workloads::{Scale, Workload, FULL, QUICK, WORKLOADS};

// ---------------------------------------------------------------------------------------------
// Child and driver.

/// What one child measured.
#[derive(Clone, Copy)]
struct Sample {
    wall: f64,
    user: f64,
    sys: f64,
    peak_mib: f64,
    /// Ours only: cache hits, large allocations, registrations.
    ours: Option<[u64; 3]>,
}

/// User and system CPU seconds and peak RSS in MiB of this process, from `getrusage(2)`.
fn rusage() -> (f64, f64, f64) {
    let mut usage = MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a writable `rusage`; RUSAGE_SELF is a valid `who`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage failed");
    // SAFETY: zeroed plain integers, then filled by `getrusage`.
    let usage = unsafe { usage.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    // `ru_maxrss` is in KiB; it also covers the driver's small RSS at the `exec`.
    (
        secs(usage.ru_utime),
        secs(usage.ru_stime),
        usage.ru_maxrss as f64 / 1024.0,
    )
}

/// Runs one workload and prints `wall user sys peak_mib hits large registrations` (`-` for the
/// last three when ours does not serve this process).
fn child(workload: &Workload, scale: &Scale) {
    let start = Instant::now();
    std::hint::black_box((workload.run)(scale));
    let wall = start.elapsed().as_secs_f64();
    let (user, sys, peak_mib) = rusage();
    let ours = ALLOC.stats().map_or_else(
        || "- - -".to_owned(),
        |s| {
            format!(
                "{} {} {}",
                s.cache_hits, s.large_allocations, s.registrations
            )
        },
    );
    println!("{wall:.6} {user:.6} {sys:.6} {peak_mib:.3} {ours}");
}

/// Runs this binary as the child for `workload` with `peer` as its global allocator.
fn measure(workload: &Workload, peer: Peer, quick: bool) -> Result<Sample, String> {
    let mut command = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
    command
        .env(VAR.to_str().unwrap_or_default(), peer.name())
        .env_remove(numa_gpu_alloc::ENV_VAR)
        .args(["--child", workload.key]);
    if quick {
        command.arg("--quick");
    }
    let out = command.output().map_err(|e| e.to_string())?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let what = format!("({}) {}", workload.key, peer.name());
    if !out.status.success() {
        return Err(format!("{what}: {}\n{stdout}{stderr}", out.status));
    }
    if !stderr.trim().is_empty() {
        eprintln!("{what}, stderr: {}", stderr.trim_end());
    }
    let fields: Vec<&str> = stdout.split_whitespace().collect();
    let bad = || format!("{what}: unexpected output {stdout:?}");
    let num = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    let (Some(wall), Some(user), Some(sys), Some(peak_mib)) = (num(0), num(1), num(2), num(3))
    else {
        return Err(bad());
    };
    let ours = match fields.get(4..7) {
        Some(["-", "-", "-"]) => None,
        Some(&[h, l, r]) => match (h.parse(), l.parse(), r.parse()) {
            (Ok(h), Ok(l), Ok(r)) => Some([h, l, r]),
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    Ok(Sample {
        wall,
        user,
        sys,
        peak_mib,
        ours,
    })
}

/// The median of `values` (not empty): the middle one, or the mean of the two middle ones.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// The median of one figure over the runs.
fn med(samples: &[Sample], figure: impl Fn(&Sample) -> f64) -> f64 {
    median(samples.iter().map(figure).collect())
}

struct Args {
    runs: Option<usize>,
    quick: bool,
    warm_up: bool,
    workloads: Vec<&'static Workload>,
    json: Option<String>,
    child: Option<&'static Workload>,
}

const USAGE: &str =
    "usage: cargo bench --bench churn -- [--quick] [--runs N] [--warm-up] [--workload a,e,f] \
     [--json PATH]";

fn workload(key: &str) -> Result<&'static Workload, String> {
    WORKLOADS
        .iter()
        .find(|w| w.key == key)
        .ok_or_else(|| format!("no workload {key:?} (a to k)"))
}

fn parse_args() -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut args = Args {
        runs: None,
        quick: false,
        warm_up: false,
        workloads: Vec::new(),
        json: None,
        child: None,
    };
    let mut parser = lexopt::Parser::from_env();
    let value = |parser: &mut lexopt::Parser| -> Result<String, String> {
        let v = parser.value().map_err(|e| e.to_string())?;
        v.string().map_err(|e| e.to_string())
    };
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("quick") => args.quick = true,
            Long("warm-up") => args.warm_up = true,
            Long("bench") => {}
            Long("runs") => {
                let v = value(&mut parser)?;
                let runs = v.parse().ok().filter(|&n| n > 0);
                args.runs = Some(runs.ok_or_else(|| format!("bad --runs {v:?}"))?);
            }
            Long("workload") => {
                for key in value(&mut parser)?.split(',') {
                    args.workloads.push(workload(key.trim())?);
                }
            }
            Long("json") => args.json = Some(value(&mut parser)?),
            Long("child") => args.child = Some(workload(&value(&mut parser)?)?),
            Short('h') | Long("help") => return Err(String::new()),
            other => return Err(other.unexpected().to_string()),
        }
    }
    if args.workloads.is_empty() {
        args.workloads = WORKLOADS.iter().collect();
    }
    // Cargo passes `--bench` under `cargo bench` only; elsewhere (`cargo test --benches`) the
    // driver is short. A child does what the driver's `--quick` says.
    if args.child.is_none() && !std::env::args().any(|a| a == "--bench") {
        args.quick = true;
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(err) => {
            eprintln!("{err}{}{USAGE}", if err.is_empty() { "" } else { "\n" });
            return ExitCode::from(2);
        }
    };
    let scale = if args.quick { &QUICK } else { &FULL };
    let is_child = std::env::var_os(VAR.to_str().unwrap_or_default()).is_some();
    match (is_child, args.child) {
        (true, Some(workload)) => {
            child(workload, scale);
            ExitCode::SUCCESS
        }
        (false, None) => match drive(&args, scale) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("churn: {err}");
                ExitCode::FAILURE
            }
        },
        _ => {
            eprintln!(
                "churn: --child and CHURN_BENCH_ALLOCATOR go together (the driver sets both)"
            );
            ExitCode::from(2)
        }
    }
}

fn drive(args: &Args, scale: &Scale) -> Result<(), String> {
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 5 });
    let started = Instant::now();
    let date = machine::utc_now();
    println!("{}", report::header(runs, args.quick, &date));
    // What the default's lazy blocks are decided by (each child probes once, for itself).
    match numa_gpu_alloc::unstable::sys::fault_costs(2) {
        Ok(c) => println!(
            "fresh 2 MiB faulted in here (the driver's probe): one huge page {:.0} us, 512 small \
             pages {:.0} us\n",
            c.huge.as_secs_f64() * 1e6,
            c.small.as_secs_f64() * 1e6
        ),
        Err(e) => println!("fault probe: {e}\n"),
    }
    let mut results = Vec::new();
    for workload in &args.workloads {
        if let Some(prepare) = workload.prepare {
            prepare(scale).map_err(|e| format!("({}) preparing: {e}", workload.key))?;
        }
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); Peer::ALL.len()];
        if args.warm_up {
            // An untimed child first, so that no measured child starts on memory the host took
            // back (see the module's docs). mimalloc's child touches the most.
            measure(workload, Peer::Mimalloc, args.quick)?;
        }
        for run in 1..=runs {
            eprintln!("churn: ({}) run {run}/{runs}", workload.key);
            // Each run starts at the next allocator, and every other run goes backwards: a child
            // pays for pages that this VM's host took back after the child before it freed them
            // (free page reporting), so no allocator always goes first or after the same one.
            let n = Peer::ALL.len();
            let step = if run % 2 == 1 { 1 } else { n - 1 };
            for k in 0..n {
                let i = (run - 1 + k * step) % n;
                samples[i].push(measure(workload, Peer::ALL[i], args.quick)?);
            }
        }
        let block = report::Block::new(workload, scale, samples);
        println!("{}", block.render());
        results.push(block);
    }
    println!(
        "churn: {} workloads x {} allocators x {runs} runs in {:.1} s",
        args.workloads.len(),
        Peer::ALL.len(),
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.json {
        let json = report::json(&results, runs, args.quick, &date);
        std::fs::write(path, format!("{json:#}\n")).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}
