//! Large-buffer churn in whole programs: five allocators, each the `#[global_allocator]` of its own
//! child process, on four workloads of buffers at and above the 2 MiB threshold.
//!
//! `cargo bench --bench churn [-- --quick] [-- --runs N] [-- --workload a,c] [-- --json PATH]`
//!
//! The driver (this binary with `CHURN_BENCH_ALLOCATOR` unset) runs this binary again once per
//! workload, allocator and run, with `CHURN_BENCH_ALLOCATOR=<allocator> --child <workload>`; run 1
//! of every allocator, then run 2, and so on, so that a noisy minute falls on all of them. Each
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
//! Every buffer is written, so that its pages are really touched: every byte (`vec![byte; n]` is
//! a `memset`, `extend_from_slice` a `memcpy`), or in (c) one byte per 4 KiB page.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../examples/support/measure.rs"]
#[allow(dead_code)] // `cpu_time`: the children read `getrusage` instead.
mod measure;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::ffi::CStr;
use std::hint::black_box;
use std::mem::MaybeUninit;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::time::Instant;

use measure::splitmix64;
use mimalloc::MiMalloc;
use numa_gpu_alloc::{NumaGpuAlloc, Stats};
use tikv_jemallocator::Jemalloc;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PAGE: usize = 4 * KIB;
/// Names the child's allocator; unset in the driver.
const VAR: &CStr = c"CHURN_BENCH_ALLOCATOR";

// ---------------------------------------------------------------------------------------------
// The global allocator, chosen per process.

/// The allocators, in the table's order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Peer {
    OursMimalloc,
    Mimalloc,
    Jemalloc,
    Glibc,
    OursGlibc,
}

impl Peer {
    const ALL: [Peer; 5] = [
        Peer::OursMimalloc,
        Peer::Mimalloc,
        Peer::Jemalloc,
        Peer::Glibc,
        Peer::OursGlibc,
    ];

    fn name(self) -> &'static str {
        match self {
            Peer::OursMimalloc => "ours/mimalloc",
            Peer::Mimalloc => "mimalloc",
            Peer::Jemalloc => "jemalloc",
            Peer::Glibc => "glibc",
            Peer::OursGlibc => "ours/glibc",
        }
    }
}

/// Sends every request of the process to the allocator `CHURN_BENCH_ALLOCATOR` names (glibc when
/// it is unset: the driver), read on the first request and never changed, so that each pointer is
/// freed by the allocator that made it. Every allocator pays the same: one relaxed load and a
/// match per request.
struct Chosen {
    /// 0 until the first request, then 1 + the chosen allocator's index in [`Peer::ALL`].
    chosen: AtomicU8,
    ours_mimalloc: NumaGpuAlloc<MiMalloc>,
    ours_glibc: NumaGpuAlloc,
}

impl Chosen {
    #[inline]
    fn peer(&self) -> Peer {
        match self.chosen.load(Relaxed) {
            1 => Peer::OursMimalloc,
            2 => Peer::Mimalloc,
            3 => Peer::Jemalloc,
            4 => Peer::Glibc,
            5 => Peer::OursGlibc,
            _ => self.choose(),
        }
    }

    /// Reads the variable with `getenv`, which does not allocate (this runs inside the first
    /// request). Two threads racing here read the same value.
    #[cold]
    fn choose(&self) -> Peer {
        // SAFETY: a NUL-terminated name; nothing in this program changes its environment.
        let value = unsafe { libc::getenv(VAR.as_ptr()) };
        let index = if value.is_null() {
            None
        } else {
            // SAFETY: `getenv` returns a NUL-terminated string that lives as long as the
            // environment, which is never changed.
            let name = unsafe { CStr::from_ptr(value) }.to_bytes();
            Peer::ALL.iter().position(|p| p.name().as_bytes() == name)
        };
        let index = index.unwrap_or(3); // glibc
        self.chosen.store(index as u8 + 1, Relaxed);
        Peer::ALL[index]
    }

    /// Ours' statistics, when ours serves this process.
    fn stats(&self) -> Option<Stats> {
        match self.peer() {
            Peer::OursMimalloc => Some(self.ours_mimalloc.stats()),
            Peer::OursGlibc => Some(self.ours_glibc.stats()),
            _ => None,
        }
    }
}

/// `$call`, with `$a` bound to the chosen allocator.
macro_rules! dispatch {
    ($self:ident, $a:ident => $call:expr) => {
        match $self.peer() {
            Peer::OursMimalloc => {
                let $a = &$self.ours_mimalloc;
                $call
            }
            Peer::Mimalloc => {
                let $a = &MiMalloc;
                $call
            }
            Peer::Jemalloc => {
                let $a = &Jemalloc;
                $call
            }
            Peer::Glibc => {
                let $a = &System;
                $call
            }
            Peer::OursGlibc => {
                let $a = &$self.ours_glibc;
                $call
            }
        }
    };
}

// SAFETY: every request goes to the one allocator chosen on the first request, which never
// changes, so every pointer is freed and reallocated by the allocator that made it; each of them
// upholds `GlobalAlloc`'s contract.
unsafe impl GlobalAlloc for Chosen {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        dispatch!(self, a => unsafe { a.alloc(layout) })
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        dispatch!(self, a => unsafe { a.alloc_zeroed(layout) })
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded from the caller; `ptr` came from the same allocator (see above).
        dispatch!(self, a => unsafe { a.dealloc(ptr, layout) })
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded from the caller; `ptr` came from the same allocator (see above).
        dispatch!(self, a => unsafe { a.realloc(ptr, layout, new_size) })
    }
}

#[global_allocator]
static ALLOC: Chosen = Chosen {
    chosen: AtomicU8::new(0),
    ours_mimalloc: NumaGpuAlloc::with_inner(MiMalloc),
    ours_glibc: NumaGpuAlloc::new(),
};

// ---------------------------------------------------------------------------------------------
// Workloads.

/// How much each workload does.
struct Scale {
    /// (a): batches of 24 buffers per producer.
    batches: usize,
    /// (b): buffers allocated and filled.
    ring_steps: usize,
    /// (c): free-one/allocate-one rounds.
    pool_rounds: usize,
    /// (d): times the vector is grown to 256 MiB.
    growths: usize,
}

const FULL: Scale = Scale {
    batches: 6,
    ring_steps: 1200,
    pool_rounds: 20_000,
    growths: 6,
};
const QUICK: Scale = Scale {
    batches: 1,
    ring_steps: 150,
    pool_rounds: 2_000,
    growths: 2,
};

struct Workload {
    key: &'static str,
    /// What it does; `{n}` stands for [`Self::count`].
    title: &'static str,
    count: fn(&Scale) -> usize,
    run: fn(&Scale) -> u64,
    /// Ours/mimalloc wall time over mimalloc's (ours/glibc over glibc's is 0.8 on every one).
    wall_target: f64,
    /// Ours/mimalloc peak RSS over mimalloc's.
    rss_target: Option<f64>,
}

const WORKLOADS: [Workload; 4] = [
    Workload {
        key: "a",
        title:
            "(a) 3 producer threads -> bounded channel -> 1 consumer: {n} batches of 24 Vec<u8> \
                of 1-48 MiB per producer, filled, dropped by the consumer",
        count: |s| s.batches,
        run: producers_consumer,
        wall_target: 1.0,
        rss_target: Some(1.0),
    },
    Workload {
        key: "b",
        title: "(b) 1 thread, a ring of 8 live Vec<u8> cycling through 3, 4, ..., 15 MiB: {n} \
                allocated and filled",
        count: |s| s.ring_steps,
        run: ring,
        wall_target: 1.0,
        rss_target: Some(1.0),
    },
    Workload {
        key: "c",
        title: "(c) a pool of 512 x 2 MiB blocks, then {n} rounds of free one at random / \
                allocate one (one byte written per 4 KiB page)",
        count: |s| s.pool_rounds,
        run: pool,
        wall_target: 0.95,
        rss_target: None,
    },
    Workload {
        key: "d",
        title: "(d) a Vec<u8> grown to 256 MiB by extend_from_slice of 64 KiB chunks (realloc), \
                dropped; {n} times",
        count: |s| s.growths,
        run: growth,
        wall_target: 0.6,
        rss_target: None,
    },
];

/// (a) Three producers send filled buffers of random sizes to a consumer that drops them.
fn producers_consumer(scale: &Scale) -> u64 {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(4);
    let consumer = std::thread::spawn(move || rx.iter().map(|b| u64::from(b[b.len() - 1])).sum());
    let producers: Vec<_> = (0..3u64)
        .map(|thread| {
            let tx = tx.clone();
            let batches = scale.batches;
            std::thread::spawn(move || {
                let mut state = 0x5eed_0000 + thread;
                for batch in 0..batches {
                    for _ in 0..24 {
                        let len = MIB + (splitmix64(&mut state) % (47 * MIB as u64 + 1)) as usize;
                        let buf = vec![(batch as u8) | 1; len];
                        tx.send(black_box(buf)).expect("the consumer hung up");
                    }
                }
            })
        })
        .collect();
    drop(tx);
    producers
        .into_iter()
        .for_each(|p| p.join().expect("producer"));
    consumer.join().expect("consumer")
}

/// (b) Drops the oldest of 8 live buffers, then allocates and fills the next size.
fn ring(scale: &Scale) -> u64 {
    let mut live: VecDeque<Vec<u8>> = VecDeque::with_capacity(8);
    let mut sum = 0u64;
    for step in 0..scale.ring_steps {
        if live.len() == 8 {
            sum += live.pop_front().map_or(0, |b| u64::from(b[b.len() / 2]));
        }
        live.push_back(black_box(vec![(step as u8) | 1; (3 + step % 13) * MIB]));
    }
    sum
}

/// A block of `len` bytes with one byte written per page.
fn touched(len: usize, byte: u8) -> Box<[MaybeUninit<u8>]> {
    let mut block = Box::<[u8]>::new_uninit_slice(len);
    for page in (0..len).step_by(PAGE) {
        block[page].write(byte);
    }
    black_box(block.as_mut_ptr()); // the writes are kept
    block
}

/// (c) Frees a random block of the pool and allocates one in its place.
fn pool(scale: &Scale) -> u64 {
    let mut state = 0x9001;
    let mut pool: Vec<Option<Box<[MaybeUninit<u8>]>>> =
        (0..512).map(|_| Some(touched(2 * MIB, 1))).collect();
    for round in 0..scale.pool_rounds {
        let index = (splitmix64(&mut state) % 512) as usize;
        pool[index] = None;
        pool[index] = Some(touched(2 * MIB, (round as u8) | 1));
    }
    pool.iter().flatten().count() as u64
}

/// (d) Grows a vector by appending chunks (std's `extend_from_slice`: `memcpy`, growth by
/// doubling through `realloc`).
fn growth(scale: &Scale) -> u64 {
    let chunk = vec![7u8; 64 * KIB];
    let mut sum = 0u64;
    for _ in 0..scale.growths {
        let mut vec = Vec::new();
        while vec.len() < 256 * MIB {
            vec.extend_from_slice(black_box(&chunk));
        }
        sum += u64::from(black_box(&vec)[vec.len() - 1]);
    }
    sum
}

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
    black_box((workload.run)(scale));
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
    workloads: Vec<&'static Workload>,
    json: Option<String>,
    child: Option<&'static Workload>,
}

const USAGE: &str =
    "usage: cargo bench --bench churn -- [--quick] [--runs N] [--workload a,b,c,d] [--json PATH]";

fn workload(key: &str) -> Result<&'static Workload, String> {
    WORKLOADS
        .iter()
        .find(|w| w.key == key)
        .ok_or_else(|| format!("no workload {key:?} (a, b, c or d)"))
}

fn parse_args() -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut args = Args {
        runs: None,
        quick: false,
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
    println!("{}", table::header(runs, args.quick, &date));
    let mut results = Vec::new();
    for workload in &args.workloads {
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); Peer::ALL.len()];
        for run in 1..=runs {
            eprintln!("churn: ({}) run {run}/{runs}", workload.key);
            for (peer, samples) in Peer::ALL.iter().zip(&mut samples) {
                samples.push(measure(workload, *peer, args.quick)?);
            }
        }
        let block = table::Block::new(workload, scale, samples);
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
        let json = table::json(&results, runs, args.quick, &date);
        std::fs::write(path, format!("{json:#}\n")).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}

#[path = "common/machine.rs"]
mod machine;
#[path = "common/churn_table.rs"]
mod table;
