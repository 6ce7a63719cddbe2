//! Idle memory in a program's small-object phase: large buffers are freed, then only small
//! objects are allocated for a few seconds. The small path never enters this crate, so only the
//! decay thread can give the large buffers' free space back meanwhile.
//!
//! `cargo bench --bench decay` (`-- --quick`: one run each) runs each allocator as the `#[global_allocator]` of a child
//! process (this binary again, `DECAY_BENCH_ALLOCATOR=...`): ours with the decay thread, ours
//! without it (`decay_thread=off`), mimalloc and glibc. Each child fills and frees 256 MiB of
//! 8 MiB buffers, then builds and drops maps of small strings, and prints its resident memory
//! (`VmRSS`) when the large buffers were freed and at fixed times into the small phase.

#[path = "common/machine.rs"]
mod machine;
#[path = "../examples/support/peers.rs"]
mod peers;

use std::alloc::System;
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use mimalloc::MiMalloc;
use numa_gpu_alloc::NumaGpuAlloc;
use peers::{median, ChosenAllocator};

const MIB: usize = 1 << 20;
const PEERS: [&str; 4] = ["ours", "ours-nothread", "mimalloc", "glibc"];
/// Times into the small phase at which resident memory is read.
const AT_MS: [u64; 4] = [100, 600, 1600, 3000];

static OURS: NumaGpuAlloc = NumaGpuAlloc::new();
static OURS_NO_THREAD: NumaGpuAlloc = NumaGpuAlloc::new().decay_thread(false);

#[global_allocator]
static GLOBAL: ChosenAllocator = ChosenAllocator::new(
    c"DECAY_BENCH_ALLOCATOR",
    &[
        ("ours", &OURS),
        ("ours-nothread", &OURS_NO_THREAD),
        ("mimalloc", &MiMalloc),
        ("glibc", &System),
    ],
);

/// Resident memory of this process, from `/proc/self/statm`, in MiB.
fn resident_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / MIB as f64
}

/// The child: the large phase, then the small one; prints the readings on one line.
fn child() {
    let buffers: Vec<Vec<u8>> = (0..32u8).map(|i| vec![i; 8 * MIB]).collect();
    let checksum: u64 = buffers.iter().map(|b| u64::from(b[4096])).sum();
    drop(buffers);
    let mut readings = vec![resident_mib()];
    let start = Instant::now();
    let mut kept = Vec::new();
    for &at in &AT_MS {
        while start.elapsed() < Duration::from_millis(at) {
            // Small objects only: strings of 16 to 100 bytes in a map, some kept.
            let map: BTreeMap<u32, String> = (0..20_000u32)
                .map(|k| (k, "x".repeat(16 + (k % 85) as usize)))
                .collect();
            kept.push(map.into_values().nth(7).unwrap_or_default());
        }
        readings.push(resident_mib());
    }
    let text: Vec<String> = readings.iter().map(|r| format!("{r:.1}")).collect();
    println!("{} {checksum} {}", text.join(" "), kept.len());
}

/// One child's readings (MiB): when freed, then at each of [`AT_MS`].
fn measure(peer: &str) -> Vec<f64> {
    let out = Command::new(std::env::current_exe().expect("this binary"))
        .env(GLOBAL.var(), peer)
        .env_remove("NUMA_GPU_ALLOC")
        .output()
        .expect("a child");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .take(AT_MS.len() + 1)
        .map(|v| v.parse().unwrap_or(f64::NAN))
        .collect()
}

/// What purging costs with `advice`: the `madvise` call over a populated 256 MiB range, the
/// resident memory it leaves, and writing every page again afterwards (ms, MiB, ms).
fn purge_with(advice: libc::c_int) -> (f64, f64, f64) {
    const LEN: usize = 256 * MIB;
    // SAFETY: a fresh private anonymous mapping, used only here and unmapped below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED, "mmap of 256 MiB");
    let touch = |byte: u8| {
        for offset in (0..LEN).step_by(4096) {
            // SAFETY: inside the mapping.
            unsafe { ptr.cast::<u8>().add(offset).write_volatile(byte) };
        }
    };
    touch(1);
    let before = resident_mib();
    let start = Instant::now();
    // SAFETY: the mapping is ours and its content no longer needed.
    assert_eq!(unsafe { libc::madvise(ptr, LEN, advice) }, 0, "madvise");
    let advised = start.elapsed().as_secs_f64() * 1e3;
    let dropped = before - resident_mib();
    let start = Instant::now();
    touch(2);
    let again = start.elapsed().as_secs_f64() * 1e3;
    // SAFETY: mapped above, unmapped once.
    unsafe { libc::munmap(ptr, LEN) };
    (advised, dropped, again)
}

fn main() {
    if std::env::var_os(GLOBAL.var()).is_some() {
        return child();
    }
    println!("purge advice on a populated 256 MiB range (4 KiB pages): madvise ms, resident MiB it frees at once, ms to write every page again");
    for (name, advice) in [
        ("MADV_DONTNEED", libc::MADV_DONTNEED),
        ("MADV_FREE", libc::MADV_FREE),
    ] {
        let (advised, dropped, again) = purge_with(advice);
        println!("{name:>14} {advised:8.2} ms {dropped:8.1} MiB {again:8.2} ms");
    }
    // `cargo test --benches` and `-- --quick` run it once.
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--quick");
    let runs = if full { 5 } else { 1 };
    println!(
        "decay: resident MiB after 256 MiB of 8 MiB buffers were freed, then into a phase of \
         small objects only (median of {runs}; {}, {})",
        machine::machine(),
        machine::utc_now()
    );
    print!("{:>14} {:>8}", "allocator", "freed");
    for at in AT_MS {
        print!(" {:>8}", format!("+{at}ms"));
    }
    println!();
    for peer in PEERS {
        let mut columns = vec![Vec::new(); AT_MS.len() + 1];
        for _ in 0..runs {
            for (column, value) in columns.iter_mut().zip(measure(peer)) {
                column.push(value);
            }
        }
        print!("{peer:>14}");
        for mut column in columns {
            print!(" {:>8.1}", median(&mut column));
        }
        println!();
    }
}
