//! A client program's allocations — hash maps, strings, JSON trees (built, serialised, parsed
//! back), a few large buffers, on two threads — timed with each allocator as the process's
//! `#[global_allocator]`: glibc (`System`), mimalloc, ours over `System`, ours over mimalloc.
//!
//! Run: `cargo run --release --example mixed_workload` (about a minute on 2 cores).
//! `MIXED_RUNS=N` processes per allocator (default 5), taken in turns so that a slow spell of the
//! machine lands on every allocator alike; each process times 5 rounds after a warm-up round.
//!
//! Each run is a child process of this one, with `MIXED_ALLOCATOR` naming its allocator. The
//! global allocator dispatches on that choice (one load and an indirect call per request, the same
//! for every allocator), since a program has one global allocator, fixed before `main`. Times are the
//! process's CPU time over a round (both threads, user and system: page faults included; time
//! other processes on a shared machine hold the CPUs is not), wall time beside it.

#[path = "support/cli.rs"]
mod cli;
#[path = "support/measure.rs"]
mod measure;
#[path = "support/peers.rs"]
mod peers;

use std::alloc::System;
use std::collections::HashMap;
use std::process::Command;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use measure::{cpu_time, splitmix64};
use mimalloc::MiMalloc;
use numa_gpu_alloc::NumaGpuAlloc;
use peers::{median, ChosenAllocator};
use serde_json::{json, Value};

/// The allocators compared, by the name `MIXED_ALLOCATOR` gives them (the order of `GLOBAL`'s
/// peers), and their labels.
const ALLOCATORS: [(&str, &str); 4] = [
    ("system", "glibc (System)"),
    ("mimalloc", "mimalloc"),
    ("ours", "ours over System"),
    ("ours-mimalloc", "ours over mimalloc"),
];
const ROUNDS: usize = 5;
const THREADS: usize = 2;

// ---------------------------------------------------------------------------------------------
// The global allocator, chosen once per process.

static OURS: NumaGpuAlloc = NumaGpuAlloc::new();
static OURS_MIMALLOC: NumaGpuAlloc<MiMalloc> = NumaGpuAlloc::with_inner(MiMalloc);

#[global_allocator]
static GLOBAL: ChosenAllocator = ChosenAllocator::new(
    c"MIXED_ALLOCATOR",
    &[
        ("system", &System),
        ("mimalloc", &MiMalloc),
        ("ours", &OURS),
        ("ours-mimalloc", &OURS_MIMALLOC),
    ],
);

// ---------------------------------------------------------------------------------------------
// The workload.

const WORDS: [&str; 12] = [
    "alpha", "beta", "gamma", "delta", "tensor", "batch", "stream", "node", "cuda", "numa", "page",
    "block",
];

/// One JSON record: nested objects, arrays and strings of assorted sizes.
fn record(id: u64, rng: &mut u64) -> Value {
    let tags: Vec<String> = (0..splitmix64(rng) % 6)
        .map(|_| WORDS[(splitmix64(rng) % 12) as usize].repeat(1 + (splitmix64(rng) % 3) as usize))
        .collect();
    let samples: Vec<f64> = (0..8 + splitmix64(rng) % 24)
        .map(|_| (splitmix64(rng) % 10_000) as f64 / 7.0)
        .collect();
    json!({
        "id": id,
        "name": format!("item-{id}-{}", WORDS[(id % 12) as usize]),
        "tags": tags,
        "owner": { "user": format!("user{}", splitmix64(rng) % 1000), "group": WORDS[(id % 5) as usize] },
        "samples": samples,
        "note": "x".repeat((splitmix64(rng) % 200) as usize),
    })
}

/// One thread's share of a round; returns a checksum so that nothing is optimised away.
fn workload(thread: usize, round: usize) -> u64 {
    let mut rng = (thread as u64) << 32 | round as u64;
    let mut checksum = 0u64;
    // JSON trees, an index over them, tag counts.
    let records: Vec<Value> = (0..6_000).map(|id| record(id, &mut rng)).collect();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    let mut tag_counts: HashMap<String, u32> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        by_name.insert(r["name"].as_str().unwrap_or_default().to_owned(), i);
        for tag in r["tags"].as_array().into_iter().flatten() {
            *tag_counts
                .entry(tag.as_str().unwrap_or_default().to_owned())
                .or_default() += 1;
        }
    }
    for id in (0..6_000u64).step_by(7) {
        let key = format!("item-{id}-{}", WORDS[(id % 12) as usize]);
        checksum += by_name.get(&key).copied().unwrap_or_default() as u64;
    }
    checksum += tag_counts.values().map(|&c| u64::from(c)).sum::<u64>();
    // Serialised (a string growing past the 2 MiB threshold) and parsed back.
    let text = serde_json::to_string(&records).unwrap_or_default();
    let parsed: Value = serde_json::from_str(&text).unwrap_or_default();
    checksum += text.len() as u64 + parsed.as_array().map_or(0, Vec::len) as u64;
    drop((records, parsed, text));
    // A few large buffers, as a loader's batches: filled, summed, dropped.
    for mib in [4usize, 8, 16, 8] {
        let batch = vec![round as u32 + 1; (mib << 20) / 4];
        checksum += batch
            .iter()
            .step_by(1024)
            .map(|&v| u64::from(v))
            .sum::<u64>();
    }
    checksum
}

fn process_cpu_time() -> Duration {
    cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// One round on [`THREADS`] threads started together: (CPU time, wall time, checksum).
fn timed_round(round: usize) -> (Duration, Duration, u64) {
    let barrier = Barrier::new(THREADS + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    workload(t, round)
                })
            })
            .collect();
        let (cpu, wall) = (process_cpu_time(), Instant::now());
        barrier.wait();
        let checksum = handles.into_iter().map(|h| h.join().unwrap()).sum();
        (process_cpu_time() - cpu, wall.elapsed(), checksum)
    })
}

/// In a child: a warm-up round, then one line per timed round, and ours's large-path counters.
fn child() {
    let _ = timed_round(0);
    for round in 1..=ROUNDS {
        let (cpu, wall, checksum) = timed_round(round);
        println!("round {} {} {checksum}", cpu.as_nanos(), wall.as_nanos());
    }
    let stats = match std::env::var(GLOBAL.var()).as_deref() {
        Ok("ours") => Some(OURS.stats()),
        Ok("ours-mimalloc") => Some(OURS_MIMALLOC.stats()),
        _ => None,
    };
    if let Some(s) = stats {
        println!(
            "large {} hits {} in-place {}",
            s.large_allocations, s.cache_hits, s.in_place_reallocs
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The parent: runs the children in turns and prints the table.

#[derive(Default)]
struct Samples {
    cpu: Vec<f64>,
    wall: Vec<f64>,
    large: String,
}

fn run_child(name: &str, samples: &mut Samples) -> Result<(), String> {
    let out = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
        .env(GLOBAL.var(), name)
        .output()
        .map_err(|e| format!("starting the {name} child: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the {name} child failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["round", cpu, wall, _] => {
                let ms = |v: &str| {
                    v.parse::<f64>()
                        .map(|ns| ns / 1e6)
                        .map_err(|e| e.to_string())
                };
                samples.cpu.push(ms(cpu)?);
                samples.wall.push(ms(wall)?);
            }
            ["large", ..] => samples.large = line.to_owned(),
            _ => return Err(format!("unexpected line from the {name} child: {line:?}")),
        }
    }
    Ok(())
}

const USAGE: &str = "usage: mixed_workload
Times a client program's allocations with each allocator as the global allocator (no arguments).
  MIXED_RUNS  processes per allocator (default 5)";

fn main() {
    if std::env::var_os(GLOBAL.var()).is_some() {
        child();
        return;
    }
    cli::positional(USAGE, 0);
    cli::exit_on_error(run());
}

fn run() -> Result<(), String> {
    let runs: usize = match std::env::var("MIXED_RUNS") {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("MIXED_RUNS={v:?}: expected a count"))?,
        Err(_) => 5,
    };
    let mut samples: Vec<Samples> = ALLOCATORS.iter().map(|_| Samples::default()).collect();
    for _ in 0..runs {
        for ((name, _), s) in ALLOCATORS.iter().zip(&mut samples) {
            run_child(name, s)?;
        }
    }
    let medians: Vec<(f64, f64)> = samples
        .iter_mut()
        .map(|s| (median(&mut s.cpu), median(&mut s.wall)))
        .collect();
    println!(
        "{runs} processes x {ROUNDS} rounds per allocator, {THREADS} threads; medians of rounds"
    );
    println!(
        "{:<20} {:>10} {:>18} {:>10}  large path",
        "global allocator", "CPU ms", "CPU min..max", "wall ms"
    );
    for (((_, label), s), (cpu, wall)) in ALLOCATORS.iter().zip(&samples).zip(&medians) {
        let (lo, hi) = (s.cpu[0], s.cpu[s.cpu.len() - 1]);
        println!(
            "{label:<20} {cpu:>10.1} {:>18} {wall:>10.1}  {}",
            format!("{lo:.1}..{hi:.1}"),
            s.large
        );
    }
    let ratio = |ours: usize, peer: usize| medians[ours].0 / medians[peer].0;
    println!(
        "ours over System / glibc:      {:.3} (target <= 1.05)",
        ratio(2, 0)
    );
    println!(
        "ours over mimalloc / mimalloc: {:.3} (target <= 1.05)",
        ratio(3, 1)
    );
    println!("ours over System / mimalloc:   {:.3}", ratio(2, 1));
    Ok(())
}
