//! Peak memory of a whole program with each allocator as `#[global_allocator]`.
//!
//! `cargo bench --bench rss` runs the same client workload in fresh child processes (this binary
//! again, `RSS_BENCH_ALLOCATOR=ours|mimalloc|glibc`), interleaved, 9 times each, and reports the
//! median peak RSS (`VmHWM`) and wall time of each; the ratios go to
//! `target/criterion/rss_client/rows.json` for `scripts/bench-table.py`.
//!
//! The client, modelled on the program of the issue: two threads, each of which reuses a large
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

const MIB: usize = 1 << 20;
const RUNS: usize = 9;
const PEERS: [&str; 3] = ["ours", "mimalloc", "glibc"];

static OURS: NumaGpuAlloc = NumaGpuAlloc::new();

/// The peers of [`PEERS`], in its order (glibc also when the variable is unset).
#[global_allocator]
static GLOBAL: ChosenAllocator = ChosenAllocator::new(
    c"RSS_BENCH_ALLOCATOR",
    &[("ours", &OURS), ("mimalloc", &MiMalloc), ("glibc", &System)],
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

fn main() {
    if std::env::var_os(GLOBAL.var()).is_some() {
        return child();
    }
    // `cargo bench --no-run` builds it; `cargo test --benches` runs it once, quickly.
    let runs = if std::env::args().any(|a| a == "--bench") {
        RUNS
    } else {
        1
    };
    let mut results = [(); 3].map(|()| (Vec::new(), Vec::new()));
    for _ in 0..runs {
        for (peer, (rss, ms)) in PEERS.iter().zip(results.iter_mut()) {
            let (r, t) = measure(peer);
            rss.push(r);
            ms.push(t);
        }
    }
    let medians = results.map(|(mut rss, mut ms)| (median(&mut rss), median(&mut ms)));
    for (peer, (rss, ms)) in PEERS.iter().zip(medians) {
        println!("rss_client {peer:>8}: peak RSS {rss:7.1} MiB, {ms:7.1} ms (median of {runs})");
    }
    let [(ours_rss, ours_ms), (mi_rss, mi_ms), (glibc_rss, glibc_ms)] = medians;
    println!(
        "rss_client: peak RSS ours/mimalloc {:.3} (target <= 1.3), ours/glibc {:.3}; time \
         ours/mimalloc {:.3}, ours/glibc {:.3}",
        ours_rss / mi_rss,
        ours_rss / glibc_rss,
        ours_ms / mi_ms,
        ours_ms / glibc_ms
    );
    let workload = "client program (2 threads: 24 MiB buffer reused, Vec pushed to 64 MiB, \
                    hash map + JSON), peak RSS";
    let rows = [
        rows::row(workload, ours_rss, "mimalloc", mi_rss, "MiB", Some(1.3)),
        rows::row(workload, ours_rss, "glibc", glibc_rss, "MiB", None),
        rows::row(
            "same client, wall time",
            ours_ms,
            "mimalloc",
            mi_ms,
            "ms",
            None,
        ),
        rows::row(
            "same client, wall time",
            ours_ms,
            "glibc",
            glibc_ms,
            "ms",
            None,
        ),
    ];
    rows::write("rss_client", &rows);
}

#[path = "common/rows.rs"]
mod rows;
