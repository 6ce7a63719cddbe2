//! What populating up front buys: a freshly handed-out block, populated when allocated
//! (`NUMA_GPU_ALLOC=populate=eager`) or faulted in where first touched (`populate=lazy`); and
//! what transparent huge pages buy a block faulted in (`populate=lazy,huge=off`: 4 KiB faults,
//! as a block of a peer allocator that does not advise `MADV_HUGEPAGE` gets them).
//!
//! `cargo bench --bench first_touch [-- --quick] [-- --runs N]`
//!
//! The driver runs this binary again, once per size, setting and run, with `NumaGpuAlloc` as the
//! global allocator and `NUMA_GPU_ALLOC` set to the one key (read once per process, so each child
//! measures one setting). A child allocates one fresh block of 4 MiB, 64 MiB, 256 MiB or 1 GiB and
//! times (i) the allocation, (ii) the first write of one byte on every 4 KiB page, (iii) their sum;
//! it prints them with the setting in force, so that a refused key is seen, not mistaken for a
//! measurement, and how much of the process was on transparent huge pages after the writes (a
//! fault of a huge page clears 2 MiB at once). One discarded child of each setting goes before a
//! size's runs; the runs alternate which setting goes first. Figures are medians of the runs, and
//! the eager/lazy ratio the median of each run's own, with their spread (`--quick`, also the
//! default without `--bench`: one run, for CI).

#[path = "common/machine.rs"]
mod machine;

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::process::{Command, ExitCode};
use std::time::Instant;

use numa_gpu_alloc::NumaGpuAlloc;

const MIB: usize = 1 << 20;
const PAGE: usize = 4096;
const SIZES: [usize; 4] = [4 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB];
const RUNS: usize = 5;
/// The child's block size in bytes; unset in the driver.
const CHILD: &str = "FIRST_TOUCH_BENCH_SIZE";
const SETTINGS: [&str; 3] = ["populate=eager", "populate=lazy", "populate=lazy,huge=off"];

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();

/// The process's memory on transparent huge pages, in MiB (`AnonHugePages`).
fn huge_mib() -> f64 {
    machine::kib_field("/proc/self/smaps_rollup", "AnonHugePages:") / 1024.0
}

/// Allocates and first-writes one block; prints `alloc_s touch_s huge_mib populate_eager
/// huge_pages`.
fn child(len: usize) {
    let layout = Layout::from_size_align(len, PAGE).expect("a valid layout");
    let start = Instant::now();
    // SAFETY: a non-zero layout; freed below with the same layout.
    let ptr = unsafe { ALLOC.alloc(layout) };
    let allocated = start.elapsed().as_secs_f64();
    assert!(!ptr.is_null(), "{len} bytes could not be allocated");
    let start = Instant::now();
    for offset in (0..len).step_by(PAGE) {
        // SAFETY: `offset < len`, inside the block allocated above.
        unsafe { ptr.add(offset).write_volatile(1) };
    }
    let touched = start.elapsed().as_secs_f64();
    let huge = huge_mib();
    black_box(ptr);
    // SAFETY: allocated above with this layout.
    unsafe { ALLOC.dealloc(ptr, layout) };
    println!(
        "{allocated:.6} {touched:.6} {huge:.1} {} {}",
        ALLOC.config().populate_eager,
        ALLOC.config().huge_pages
    );
}

/// One child's figures: allocation and first-touch seconds, MiB on huge pages.
fn measure(len: usize, setting: &str) -> Result<[f64; 3], String> {
    let out = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
        .env(CHILD, len.to_string())
        .env(numa_gpu_alloc::ENV_VAR, setting)
        .output()
        .map_err(|e| e.to_string())?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let what = format!("{} MiB, {setting}", len / MIB);
    if !out.status.success() {
        return Err(format!("{what}: {}\n{stdout}{stderr}", out.status));
    }
    let fields: Vec<&str> = stdout.split_whitespace().collect();
    let num = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    let switch = |i: usize| fields.get(i).and_then(|f| f.parse::<bool>().ok());
    let (Some(alloc), Some(touch), Some(huge), Some(eager), Some(huge_pages)) =
        (num(0), num(1), num(2), switch(3), switch(4))
    else {
        return Err(format!("{what}: unexpected output {stdout:?}{stderr}"));
    };
    if eager != setting.contains("eager") || huge_pages == setting.contains("huge=off") {
        return Err(format!(
            "{what}: the crate refused the setting (in force: populate_eager = {eager}, \
             huge_pages = {huge_pages}); it needs a numa-gpu-alloc with the `populate=` key\n{}",
            stderr.trim_end()
        ));
    }
    Ok([alloc, touch, huge])
}

/// The least and the greatest of `values`.
fn spread(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

/// The median of `values` (not empty).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn drive(runs: usize) -> Result<(), String> {
    println!(
        "first_touch: a fresh block from NumaGpuAlloc (the global allocator), populated when \
         handed out or on first touch (with huge pages, or 4 KiB pages)\nmachine: {}; started {}; median of {runs} run(s)\n",
        machine::machine(),
        machine::utc_now()
    );
    println!(
        "{:>8}  {:<22} {:>10} {:>12} {:>10} {:>19} {:>9}",
        "size", "setting", "alloc ms", "1st write ms", "sum ms", "(min-max)", "huge MiB"
    );
    for len in SIZES {
        // A discarded child of each setting first: this VM reports freed pages to its host, and
        // the first process to touch memory after a pause pays seconds for getting it back.
        for setting in SETTINGS {
            measure(len, setting)?;
        }
        let mut samples = [(); SETTINGS.len()].map(|()| Vec::new());
        for run in 0..runs {
            // Rotating which setting goes first, so that a noisy moment falls on all.
            for k in 0..SETTINGS.len() {
                let i = (run + k) % SETTINGS.len();
                samples[i].push(measure(len, SETTINGS[i])?);
            }
        }
        let total = |s: &[f64; 3]| s[0] + s[1];
        for (setting, samples) in SETTINGS.iter().zip(&samples) {
            let med = |f: &dyn Fn(&[f64; 3]) -> f64| median(samples.iter().map(f).collect());
            let (min, max) = spread(samples.iter().map(total));
            println!(
                "{:>4} MiB  {setting:<22} {:>10.2} {:>12.2} {:>10.2} {:>19} {:>9.0}",
                len / MIB,
                med(&|s| s[0]) * 1e3,
                med(&|s| s[1]) * 1e3,
                med(&total) * 1e3,
                format!("({:.2}-{:.2})", min * 1e3, max * 1e3),
                med(&|s| s[2])
            );
        }
        // Each run measured every setting: its own ratios, so that the spread is the runs'.
        for (name, over, under) in [("eager/lazy", 0, 1), ("lazy/lazy 4 KiB pages", 1, 2)] {
            let ratios: Vec<f64> = samples[over]
                .iter()
                .zip(&samples[under])
                .map(|(a, b)| total(a) / total(b))
                .collect();
            let (min, max) = spread(ratios.iter().copied());
            println!(
                "{:>4} MiB  {name}, sum: {:.3}x (per-run {min:.3}-{max:.3})",
                len / MIB,
                median(ratios)
            );
        }
        println!();
    }
    Ok(())
}

fn main() -> ExitCode {
    if let Some(len) = std::env::var_os(CHILD) {
        let Some(len) = len.to_str().and_then(|l| l.parse().ok()) else {
            eprintln!("first_touch: bad {CHILD}");
            return ExitCode::from(2);
        };
        child(len);
        return ExitCode::SUCCESS;
    }
    let args: Vec<String> = std::env::args().collect();
    let runs = match args.iter().position(|a| a == "--runs") {
        Some(i) => match args.get(i + 1).and_then(|n| n.parse().ok()) {
            Some(n) if n > 0 => n,
            _ => {
                eprintln!("usage: cargo bench --bench first_touch -- [--quick] [--runs N]");
                return ExitCode::from(2);
            }
        },
        // `cargo test --benches` passes no `--bench`: one quick run there too.
        None if args.iter().any(|a| a == "--quick") || !args.iter().any(|a| a == "--bench") => 1,
        None => RUNS,
    };
    match drive(runs) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("first_touch: {err}");
            ExitCode::FAILURE
        }
    }
}
