//! Populating with and without transparent huge pages on a fragmented machine.
//!
//! `cargo bench --bench thp` fills all but 2 GiB of the available memory with small pages and
//! gives every other page back (`MADV_DONTNEED`): most free memory is then in single pages, and a
//! huge page needs compaction. It then populates 4 GiB advised `MADV_HUGEPAGE` and 4 GiB advised
//! `MADV_NOHUGEPAGE`, one after the other (each unmapped before the next, three times each: the
//! median), first with the memory unfragmented, then fragmented, and prints the time, the share
//! of huge pages obtained and the kernel's compaction stalls (`/proc/vmstat`) for each; then the
//! same with memory full of a file's page cache (written to the temporary folder, left dirty). All
//! of memory is touched once first: a virtual machine's host backs guest memory on first touch. Heavy: it uses most of the
//! machine's memory for a few seconds; not run by CI.

#[path = "common/machine.rs"]
mod machine;

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use numa_gpu_alloc::unstable::sys;

const GIB: usize = 1 << 30;
const HUGE: usize = 2 << 20;
const LEN: usize = 4 * GIB;

fn meminfo_kib(key: &str) -> usize {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn vmstat(key: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

/// Maps `len` bytes advised `huge` or not, populates them; the time, the fraction of them in huge
/// pages, and the compaction stalls meanwhile.
fn populate(huge: bool) -> (Duration, f64, u64) {
    let base = sys::map_anonymous(LEN, HUGE).expect("mmap");
    // SAFETY: a fresh mapping of ours.
    let _ = unsafe {
        if huge {
            sys::advise_hugepage(base, LEN)
        } else {
            sys::advise_nohugepage(base, LEN)
        }
    };
    let (stalls, huge_before) = (vmstat("compact_stall"), meminfo_kib("AnonHugePages:"));
    let start = Instant::now();
    // SAFETY: the fresh mapping, ours alone.
    unsafe { sys::populate(base, LEN) }.expect("populate");
    let took = start.elapsed();
    let huge_share =
        meminfo_kib("AnonHugePages:").saturating_sub(huge_before) as f64 * 1024.0 / LEN as f64;
    let stalls = vmstat("compact_stall") - stalls;
    // SAFETY: the mapping made above, used by nobody now.
    unsafe { sys::unmap(base, LEN) }.expect("munmap");
    (took, huge_share, stalls)
}

/// Fills all available memory but `spare` with small pages, then gives every other page back:
/// the mapping, to unmap when done. With `every_other` false, only fills it (and gives it all
/// back on unmap).
fn fill(spare: usize, every_other: bool) -> (NonNull<u8>, usize) {
    let available = meminfo_kib("MemAvailable:") * 1024;
    let len = available.saturating_sub(spare) / HUGE * HUGE;
    let base = sys::map_anonymous(len, HUGE).expect("mmap");
    // SAFETY: a fresh mapping of ours.
    let _ = unsafe { sys::advise_nohugepage(base, len) };
    // SAFETY: as above.
    unsafe { sys::populate(base, len) }.expect("populate the filler");
    let page = sys::page_size();
    for offset in (0..len).step_by(2 * page).filter(|_| every_other) {
        // SAFETY: a page of our own mapping, whose contents nobody needs.
        unsafe { libc::madvise(base.as_ptr().add(offset).cast(), page, libc::MADV_DONTNEED) };
    }
    (base, len)
}

/// Three runs of [`populate`]: the median time, with the huge-page share and stalls of that run.
fn row(state: &str, huge: bool) {
    let mut runs: Vec<_> = (0..3).map(|_| populate(huge)).collect();
    runs.sort_by_key(|run| run.0);
    let (took, share, stalls) = runs[1];
    println!(
        "| {state} | {} | {:.0} ms | {:.2} GiB/s | {:.0}% | {stalls} |",
        if huge {
            "MADV_HUGEPAGE"
        } else {
            "MADV_NOHUGEPAGE"
        },
        took.as_secs_f64() * 1e3,
        LEN as f64 / GIB as f64 / took.as_secs_f64(),
        share * 100.0
    );
}

fn main() {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/defrag").unwrap_or_default();
    println!(
        "populate 4 GiB; {}; {}; THP defrag: {}",
        machine::machine(),
        machine::utc_now(),
        thp.trim()
    );
    println!("| memory | advice | time | rate | in huge pages | compaction stalls |");
    println!("|---|---|---:|---:|---:|---:|");
    // A virtual machine's host backs guest memory on first touch: touch it all once, so that no
    // row pays for that.
    let (warm, len) = fill(2 * GIB, false);
    // SAFETY: the mapping made by `fill`, used by nobody now.
    unsafe { sys::unmap(warm, len) }.expect("munmap");
    row("unfragmented", true);
    row("unfragmented", false);
    let (filler, len) = fill(2 * GIB, true);
    let free_gib = meminfo_kib("MemFree:") as f64 / (1 << 20) as f64;
    row(&format!("fragmented ({free_gib:.1} GiB free)"), true);
    row(&format!("fragmented ({free_gib:.1} GiB free)"), false);
    // SAFETY: the filler mapped by `fill`, used by nobody now.
    unsafe { sys::unmap(filler, len) }.expect("munmap");
    let cache = page_cache(2 * GIB);
    let cached_gib = meminfo_kib("Cached:") as f64 / (1 << 20) as f64;
    row(&format!("page cache ({cached_gib:.1} GiB cached)"), true);
    row(&format!("page cache ({cached_gib:.1} GiB cached)"), false);
    let _ = std::fs::remove_file(cache);
}

/// Fills all available memory but `spare` with the page cache of a file written in the temporary
/// folder (left dirty, as a checkpoint being written leaves it); the file, to remove when done.
fn page_cache(spare: usize) -> std::path::PathBuf {
    use std::io::Write as _;
    let path = std::env::temp_dir().join(format!("numa-gpu-alloc-thp-{}", std::process::id()));
    let len = (meminfo_kib("MemAvailable:") * 1024).saturating_sub(spare);
    let mut file = std::fs::File::create(&path).expect("creating the page-cache file");
    let block = vec![0x5a_u8; 64 << 20];
    for _ in 0..len / block.len() {
        file.write_all(&block).expect("writing the page-cache file");
    }
    path
}
