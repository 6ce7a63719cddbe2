//! Peak memory of a whole program with each allocator as `#[global_allocator]`.
//!
//! `cargo bench --bench rss [-- --runs N]` runs the same client workload in fresh child processes
//! (this binary again, `RSS_BENCH_ALLOCATOR=ours/mimalloc|mimalloc|jemalloc|glibc|ours/glibc`),
//! interleaved, 9 times each, and reports the median peak RSS (`VmHWM`) and wall time of each.
//! The headline ratio is ours over mimalloc against mimalloc alone: run k of `ours/mimalloc` is
//! paired with run k of `mimalloc`, and the ratios are the medians over the pairs with their
//! spread (min-max); they go to `target/criterion/rss_client/rows.json` for
//! `scripts/bench-table.py`.
//!
//! The client, modelled on a data-loading program: two threads, each of which reuses a large
//! buffer (a 24 MiB batch filled and summed 16 times), grows a `Vec` of 24-byte records by `push`
//! to 64 MiB, builds a hash map of every 8th record and serialises it to JSON text, and keeps the
//! results of one phase alive while the next runs, as a program holding its data would.
//!
//! The global allocator is chosen once, before the first allocation, from the environment
//! (`examples/support/peers.rs`); every allocation pays the same dispatch whichever allocator it
//! goes to.

#[path = "../examples/support/peers.rs"]
mod peers;

use std::alloc::System;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::process::Command;
use std::time::Instant;

use mimalloc::MiMalloc;
use numa_gpu_alloc::NumaGpuAlloc;
use peers::{median, ChosenAllocator};
use tikv_jemallocator::Jemalloc;

const MIB: usize = 1 << 20;
const RUNS: usize = 9;
const PEERS: [&str; 5] = [
    "ours/mimalloc",
    "mimalloc",
    "jemalloc",
    "glibc",
    "ours/glibc",
];
/// Ours/mimalloc over mimalloc, peak RSS and wall time.
const TARGET: f64 = 1.0;

static OURS_MIMALLOC: NumaGpuAlloc<MiMalloc> = NumaGpuAlloc::with_inner(MiMalloc);
static OURS_GLIBC: NumaGpuAlloc = NumaGpuAlloc::new();

/// The peers of [`PEERS`], in its order (glibc also when the variable is unset).
#[global_allocator]
static GLOBAL: ChosenAllocator = ChosenAllocator::new(
    c"RSS_BENCH_ALLOCATOR",
    &[
        ("ours/mimalloc", &OURS_MIMALLOC),
        ("mimalloc", &MiMalloc),
        ("jemalloc", &Jemalloc),
        ("glibc", &System),
        ("ours/glibc", &OURS_GLIBC),
    ],
);

/// A record of the client's data: 24 bytes.
#[derive(Clone, Copy)]
struct Record {
    id: u64,
    value: u64,
    flags: u64,
}

/// What one client thread does; returns a checksum so that nothing is optimised away.
fn client(seed: u64) -> u64 {
    let mut sum = 0u64;
    // A large buffer, reused: one batch filled and summed again and again.
    for round in 0..16u64 {
        let batch = vec![(seed + round) as u8; 24 * MIB];
        sum += batch
            .iter()
            .step_by(4096)
            .map(|&b| u64::from(b))
            .sum::<u64>();
    }
    // A Vec of records grown by push to 64 MiB.
    let mut records = Vec::new();
    for i in 0..(64 * MIB / 24) as u64 {
        records.push(Record {
            id: i,
            value: i ^ seed,
            flags: i & 7,
        });
    }
    // A hash map, then its JSON text, while the records are still held.
    let map: HashMap<u64, Record> = records.iter().step_by(8).map(|r| (r.id, *r)).collect();
    let mut json = String::from("[");
    for (id, r) in &map {
        let _ = write!(
            json,
            "{{\"id\": {id}, \"value\": {}, \"flags\": {}}},",
            r.value, r.flags
        );
    }
    json.push(']');
    sum + records[records.len() / 2].value + map.len() as u64 + json.len() as u64
}

/// Peak resident set of this process in KiB (`VmHWM`).
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The child: runs two clients and prints `peak_kib elapsed_ms checksum`.
fn child() {
    let start = Instant::now();
    let threads: Vec<_> = (1..=2)
        .map(|seed| std::thread::spawn(move || client(seed)))
        .collect();
    let sum: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let elapsed = start.elapsed().as_secs_f64() * 1e3;
    println!("{} {elapsed:.1} {sum}", peak_rss_kib());
}

/// Runs one child with `peer` as its global allocator: (peak RSS in MiB, wall time in ms).
fn measure(peer: &str) -> (f64, f64) {
    let out = Command::new(std::env::current_exe().expect("own path"))
        .env(GLOBAL.var(), peer)
        .env_remove(numa_gpu_alloc::ENV_VAR)
        .output()
        .expect("running the client");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{peer}: {}\n{text}", out.status);
    let mut fields = text.split_whitespace();
    let mut next = || -> f64 {
        fields
            .next()
            .and_then(|f| f.parse().ok())
            .unwrap_or(f64::NAN)
    };
    (next() / 1024.0, next())
}

/// One ratio's median over the pairs of runs, and its spread.
struct Paired {
    median: f64,
    min: f64,
    max: f64,
}

impl Paired {
    fn new(ours: &[f64], peer: &[f64]) -> Paired {
        let mut ratios: Vec<f64> = ours.iter().zip(peer).map(|(o, p)| o / p).collect();
        let median = median(&mut ratios);
        Paired {
            median,
            min: ratios[0],
            max: ratios[ratios.len() - 1],
        }
    }

    fn verdict(&self, target: Option<f64>) -> String {
        let spread = format!("{:.3}x ({:.3}-{:.3})", self.median, self.min, self.max);
        match target {
            Some(t) if self.median <= t => format!("{spread}, target <= {t:.2}x: PASS"),
            Some(t) => format!("{spread}, target <= {t:.2}x: MISS"),
            None => spread,
        }
    }
}

/// `--runs N` (9 under `cargo bench`; `cargo test --benches` runs it once).
fn runs() -> usize {
    let args: Vec<String> = std::env::args().collect();
    let given = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1)?.parse().ok());
    match given {
        Some(n) if n > 0 => n,
        _ if args.iter().any(|a| a == "--bench") => RUNS,
        _ => 1,
    }
}

fn main() {
    if std::env::var_os(GLOBAL.var()).is_some() {
        return child();
    }
    let runs = runs();
    println!(
        "rss_client: {}; started {}; {runs} run(s) per allocator, alternated",
        machine::machine(),
        machine::utc_now()
    );
    let mut results = [(); PEERS.len()].map(|()| (Vec::new(), Vec::new()));
    for run in 0..runs {
        // Each run starts at the next allocator, so that none always pays for being the first
        // to touch memory after a pause (this VM's host takes freed pages back).
        for k in 0..PEERS.len() {
            let i = (k + run) % PEERS.len();
            let (r, t) = measure(PEERS[i]);
            results[i].0.push(r);
            results[i].1.push(t);
        }
    }
    for (peer, (rss, ms)) in PEERS.iter().zip(&results) {
        let (rss, ms) = (median(&mut rss.clone()), median(&mut ms.clone()));
        println!("rss_client {peer:>13}: peak RSS {rss:7.1} MiB, {ms:7.1} ms (median of {runs})");
    }
    // (ours, peer, target) as indices into PEERS.
    let pairs = [(0, 1, Some(TARGET)), (0, 2, None), (4, 3, None)];
    let workload = "client program (2 threads: 24 MiB buffer reused, Vec pushed to 64 MiB, \
                    hash map + JSON)";
    let mut rows = Vec::new();
    for (ours, peer, target) in pairs {
        let ((ours_rss, ours_ms), (peer_rss, peer_ms)) = (&results[ours], &results[peer]);
        println!(
            "rss_client {} vs {}, per-pair medians (min-max): peak RSS {}; wall {}",
            PEERS[ours],
            PEERS[peer],
            Paired::new(ours_rss, peer_rss).verdict(target),
            Paired::new(ours_ms, peer_ms).verdict(target)
        );
        let medians = |v: &[f64]| median(&mut v.to_vec());
        for (what, o, p, unit) in [
            ("peak RSS", ours_rss, peer_rss, "MiB"),
            ("wall time", ours_ms, peer_ms, "ms"),
        ] {
            rows.push(rows::row(
                &format!("{workload}, {what}, {}", PEERS[ours]),
                medians(o),
                PEERS[peer],
                medians(p),
                unit,
                target,
            ));
        }
    }
    rows::write("rss_client", &rows);
}

#[path = "common/machine.rs"]
mod machine;
#[path = "common/rows.rs"]
mod rows;
