//! Host↔device DMA bandwidth, the cold cost of page-locked memory, and populate scaling:
//! `numa-gpu-alloc` against pageable memory, `cuMemHostAlloc`, `malloc` + `cuMemHostRegister`,
//! and CUDA's own host-NUMA memory (`cuMemCreate` with a host-NUMA location, and a pool with one:
//! CUDA 12.2+; a driver without it, or one that refuses the node, is reported as such).
//!
//! ```text
//! cargo run --release --example dma_bench                  # defaults; 16 GiB needs 33 GiB free
//! cargo run --release --example dma_bench -- --cold-sizes 64MiB --scaling-size 256MiB \
//!     --bw-sizes 4MiB,64MiB --json-out dma.json            # small, for a laptop or CI
//! ```
//!
//! Sections, each printed when it ends with the seconds it took:
//!
//! 1. **Bandwidth** in the style of nvbandwidth (first: a run cut short by `--max-seconds` keeps
//!    it): for each `--bw-sizes` (4 MiB … 1 GiB), both directions, timed with CUDA events, each
//!    sample at least 64 MiB of copies (several copies below that), median of `--runs` (5);
//!    pageable, `cuMemHostAlloc`, ours, ours on the farthest node when there is more than
//!    one, and CUDA's host-NUMA memory on ours' node (`cuMemCreate/numa`, `cuMemPool/numa`).
//!    Without a driver: host memcpy bandwidth from each node, last.
//! 2. **Cold cost** for each `--cold-sizes` (1 GiB and 16 GiB): first, twice the size is touched
//!    and freed, so that no method pays the hypervisor's or kernel's first touch alone; then
//!    ours (place + populate + register), `cuMemHostAlloc`, and `vec![0; n]` + `cuMemHostRegister`
//!    (the naive path) are alternated `--reps` times (3) and the median reported, with the
//!    registration time alone; then CUDA's host-NUMA memory: `cuMemCreate` + reserve + map +
//!    access, and a fresh pool's first block, each until usable by the host. The first sample of
//!    ours and of each peer has its pages touched and counted by node (`move_pages`). Without a
//!    driver: ours (place + populate) against `malloc` + touch, the peers not measured.
//! 3. **Reuse**: a freed block of the first cold size taken back from the cache, and from a
//!    host-NUMA pool whose release threshold is raised (a pool hit, until usable by the host).
//! 4. **Populate scaling**: a cold `--scaling-size` block (4 GiB) placed and populated with each
//!    of `--threads` (1,2,4,8,16) populate threads, host-only, after touching as much memory;
//!    the thread counts take turns, `--reps` rounds, median reported.
//! 5. **CUDA's host-NUMA memory at larger sizes**: for each `--numa-sizes` (64 GiB), ours and the
//!    two peers, cold, alternated (one sample above 16 GiB, else `--reps`), after touching as much
//!    memory when it fits, placement counted as in 2. Skipped, said so, when the size and 2 GiB
//!    do not fit in `MemAvailable`.
//!
//! On the CUDA driver simulator (`tests/sim/`, its device named `cuda-sim`) every DMA and
//! host-NUMA figure is the simulator's model, and its rows say `simulated`.
//!
//! The driver is called through the crate's own C-typed table (`numa_gpu_alloc::unstable::cuda_driver`),
//! never through cudarc's `sys::cu*` wrappers.

use std::error::Error;
use std::fmt::Write as _;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Layout};
use numa_gpu_alloc::unstable::cuda_driver::{Direction, Driver};
use numa_gpu_alloc::{MemPolicy, NumaGpuAlloc, NumaTopology, PinMode};

type Res<T> = Result<T, Box<dyn Error>>;

#[path = "../support/cli.rs"]
mod cli;

mod args;
mod bench;
mod host_numa;
use args::{parse_args, Args, USAGE};
use bench::{ours_alloc, Bench};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// Below this, one bandwidth sample is several copies (nvbandwidth does the same).
const MIN_SAMPLE_BYTES: usize = 64 * MIB;

/// One measured value (a row of the tables and of the JSON file).
#[derive(Default)]
struct Row {
    /// `cold`, `reuse`, `populate`, `bandwidth` or `host_copy`.
    test: &'static str,
    /// What memory: `ours`, `cuMemHostAlloc`, `malloc+register`, `malloc+touch`, `pageable`,
    /// `ours-far`, `cuMemCreate/numa`, `cuMemPool/numa`.
    memory: &'static str,
    node: Option<usize>,
    bytes: usize,
    /// Populate threads (`populate` rows).
    threads: Option<usize>,
    /// Median milliseconds (cost rows).
    ms: Option<f64>,
    /// Median milliseconds of `cuMemHostRegister` alone, where it is a separate step.
    register_ms: Option<f64>,
    h2d_gbps: Option<f64>,
    d2h_gbps: Option<f64>,
    copy_gbps: Option<f64>,
    note: String,
}

impl Row {
    /// The row as JSON, each field under its name. Written out rather than derived: serde's derive
    /// would build its proc-macro stack for every example and test, for this one struct.
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "test": self.test,
            "memory": self.memory,
            "node": self.node,
            "bytes": self.bytes,
            "threads": self.threads,
            "ms": self.ms,
            "register_ms": self.register_ms,
            "h2d_gbps": self.h2d_gbps,
            "d2h_gbps": self.d2h_gbps,
            "copy_gbps": self.copy_gbps,
            "note": self.note,
        })
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `median (min…max of N)` of millisecond samples.
fn spread(v: &[f64]) -> String {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{} samples, {min:.1}…{max:.1} ms", v.len())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn size_text(bytes: usize) -> String {
    if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{} GiB", bytes / GIB)
    } else {
        format!("{} MiB", bytes as f64 / MIB as f64)
    }
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.prec$}"))
}

fn opt_u(v: Option<usize>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// Bytes the kernel could give without swapping (`MemAvailable`), when known.
fn mem_available() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Why a section needing `need` bytes is skipped, if memory is short.
fn short_of_memory(need: usize) -> Option<String> {
    let avail = mem_available()?;
    (avail < need).then(|| {
        format!(
            "skipped: needs {} and MemAvailable is {}",
            size_text(need.next_multiple_of(GIB)),
            size_text(avail / GIB * GIB)
        )
    })
}

/// Says on stderr what a step that may take long is doing: stdout keeps the tables that scripts
/// parse.
fn progress(what: std::fmt::Arguments) {
    eprintln!("... {what}");
}

/// Touches `bytes` of fresh memory and frees it, so that a cold measurement after it does not
/// pay the first touch of memory the hypervisor (or the kernel) has never backed.
fn pre_touch(bytes: usize) {
    progress(format_args!(
        "touching {} of fresh memory first",
        size_text(bytes)
    ));
    let start = Instant::now();
    let mut warm: Vec<u8> = Vec::with_capacity(bytes);
    for page in warm.spare_capacity_mut().iter_mut().step_by(4096) {
        page.write(1);
    }
    drop(std::hint::black_box(warm));
    println!(
        "pre-touched and freed {} in {:.0} ms",
        size_text(bytes),
        ms(start.elapsed())
    );
}

/// A block from one of our allocators, freed on drop.
struct OurBlock<'a> {
    alloc: &'a NumaGpuAlloc,
    ptr: NonNull<u8>,
    layout: Layout,
}

impl<'a> OurBlock<'a> {
    /// Allocates `len` bytes and returns the block with the time the allocation took.
    fn new(alloc: &'a NumaGpuAlloc, len: usize) -> Res<(Self, Duration)> {
        let layout = Layout::from_size_align(len, 4096)?;
        let start = Instant::now();
        let ptr = alloc.allocate(layout).map_err(|_| {
            format!(
                "numa-gpu-alloc could not allocate {}: {}",
                size_text(len),
                alloc.stats().last_pin_error.map_or_else(
                    || "see its stats".to_owned(),
                    |e| format!("last pin failure: {e}")
                )
            )
        })?;
        let took = start.elapsed();
        Ok((
            OurBlock {
                alloc,
                ptr: ptr.cast(),
                layout,
            },
            took,
        ))
    }

    /// The bytes, filled with `byte`.
    fn filled(&mut self, byte: u8) -> &mut [u8] {
        // SAFETY: the block owns `layout.size()` writable bytes at `ptr`; `write_bytes`
        // initialises all of them before the slice is made, and `&mut self` is borrowed for
        // the slice's lifetime.
        unsafe {
            std::ptr::write_bytes(self.ptr.as_ptr(), byte, self.layout.size());
            std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size())
        }
    }
}

impl Drop for OurBlock<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc.allocate(layout)` and is freed once, here.
        unsafe { self.alloc.deallocate(self.ptr, self.layout) };
    }
}

/// Pins the calling thread to the CPUs of `node` so that "local" stays local.
fn pin_thread_to(topo: &NumaTopology, node: usize) {
    let Some(info) = topo.node(node) else { return };
    if info.cpus.is_empty() {
        return;
    }
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in info
        .cpus
        .iter()
        .filter(|&&c| c < libc::CPU_SETSIZE as usize)
    {
        // SAFETY: `cpu` is below CPU_SETSIZE and `set` is a valid cpu_set_t.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid, initialised cpu_set_t.
    let _ = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
}

fn describe_topology(topo: &NumaTopology) -> String {
    let ids = topo.node_ids();
    let mut s = format!(
        "NUMA topology: {} node(s)\n  node  cpus  memory  distances to",
        ids.len()
    );
    for id in ids {
        let _ = write!(s, " {id:>4}");
    }
    for info in topo.nodes() {
        let memory = if info.has_memory {
            format!("{}G", info.memory_bytes >> 30)
        } else {
            "none".to_owned()
        };
        let _ = write!(
            s,
            "\n  {:>4}  {:>4}  {memory:>6}  {:12}",
            info.id,
            info.cpus.len(),
            ""
        );
        for &to in ids {
            let d = topo.distance(info.id, to);
            let _ = write!(
                s,
                " {:>4}",
                d.map_or_else(|| "-".to_owned(), |d| d.to_string())
            );
        }
    }
    s
}

fn print_rows(rows: &[Row]) {
    let Some(first) = rows.first() else { return };
    match first.test {
        "bandwidth" | "host_copy" => {
            let (a, b) = match first.test {
                "bandwidth" => ("H2D GB/s", "D2H GB/s"),
                _ => ("GB/s", ""),
            };
            println!(
                "{:>10}  {:<16} {:>5}  {a:>8}  {b:>8}  note",
                "size", "memory", "node"
            );
            for r in rows {
                let (a, b) = match r.copy_gbps {
                    Some(copy) => (Some(copy), None),
                    None => (r.h2d_gbps, r.d2h_gbps),
                };
                println!(
                    "{:>10}  {:<16} {:>5}  {:>8}  {:>8}  {}",
                    size_text(r.bytes),
                    r.memory,
                    opt_u(r.node),
                    opt(a, 2),
                    opt(b, 2),
                    r.note
                );
            }
        }
        _ => {
            println!(
                "{:>10}  {:<16} {:>5}  {:>7}  {:>10}  {:>11}  note",
                "size", "memory", "node", "threads", "median ms", "register ms"
            );
            for r in rows {
                println!(
                    "{:>10}  {:<16} {:>5}  {:>7}  {:>10}  {:>11}  {}",
                    size_text(r.bytes),
                    r.memory,
                    opt_u(r.node),
                    opt_u(r.threads),
                    opt(r.ms, 1),
                    opt(r.register_ms, 1),
                    r.note
                );
            }
        }
    }
}

fn main() {
    let args = parse_args().unwrap_or_else(|problem| cli::usage_error(problem, USAGE));
    cli::exit_on_error(run(&args));
}

fn run(args: &Args) -> Res<()> {
    let started = Instant::now();
    let topo = NumaTopology::from_sysfs().unwrap_or_else(|e| {
        println!("cannot read the NUMA topology ({e}); assuming one node");
        NumaTopology::single_node()
    });
    println!("{}", describe_topology(&topo));
    let local = numa_gpu_alloc::unstable::sys::current_node()
        .ok()
        .filter(|&n| topo.contains(n))
        .or_else(|| topo.node_ids().first().copied())
        .unwrap_or(0);
    let unavailable = numa_gpu_alloc::cuda_unavailable_reason();
    let mut header = serde_json::Map::new();
    header.insert("cuda".into(), unavailable.is_none().into());
    let mut host = local;
    let mut driver = None;
    let mut simulated = false;
    match &unavailable {
        Some(why) => {
            println!("no CUDA driver: {why}");
            println!("measuring host-side costs only (no pinning, no DMA)");
            header.insert("cuda_unavailable".into(), why.to_string().into());
        }
        None => {
            let placement = NumaGpuAlloc::new()
                .gpu(args.gpu)
                .pin(PinMode::Strict)
                .placement();
            let ordinal = placement
                .gpu_ordinal
                .ok_or("the CUDA driver is usable but numa-gpu-alloc found no GPU")?;
            let gpu = format!(
                "{ordinal} ({}) {}",
                placement
                    .gpu_pci
                    .map_or_else(|| "?".to_owned(), |p| p.to_string()),
                placement.gpu_name.clone().unwrap_or_default()
            );
            host = placement.host_node;
            println!(
                "GPU {gpu}; home node {}, host node {host}",
                opt_u(placement.home_node)
            );
            // The simulator's device name (`tests/sim/cuda_sim.c`).
            simulated = placement
                .gpu_name
                .as_deref()
                .is_some_and(|n| n.starts_with("cuda-sim"));
            if simulated {
                println!("the CUDA driver simulator: DMA and host-NUMA figures are its model's");
            }
            header.insert("simulated".into(), simulated.into());
            header.insert("gpu".into(), gpu.into());
            header.insert("home_node".into(), placement.home_node.into());
            driver = Some(Driver::open(ordinal)?);
        }
    }
    // The thread that allocates and drives the copies sits on the host node, as a loader would.
    pin_thread_to(&topo, host);
    let far = topo.farthest_node_from(host).filter(|&n| n != host);
    header.insert("host_node".into(), host.into());
    header.insert("far_node".into(), far.into());
    let mut bench = Bench {
        args,
        topo: &topo,
        driver: driver.as_ref(),
        no_cuda: unavailable.as_ref().map(ToString::to_string),
        simulated,
        host,
        far,
        started,
        rows: Vec::new(),
        failed_sections: 0,
        ours: ours_alloc(args, driver.is_some(), host, 0),
        cached: ours_alloc(
            args,
            driver.is_some(),
            host,
            args.cold_sizes.first().map_or(0, |&s| s.saturating_mul(2)),
        ),
    };
    // The DMA table first: it is what a short run must not lose to the time budget.
    if let Some(d) = driver.as_ref() {
        bench.section("DMA bandwidth (CUDA events, median)", |b| b.bandwidth(d));
    }
    for &size in &args.cold_sizes {
        bench.section(&format!("cold cost, {}", size_text(size)), |b| b.cold(size));
    }
    if let Some(&size) = args.cold_sizes.first() {
        bench.section("reuse from the cache", |b| b.reuse(size));
    }
    bench.section(
        &format!("populate scaling, {}", size_text(args.scaling_size)),
        Bench::scaling,
    );
    // Last: the longest, so that a short budget loses only these.
    for &size in &args.numa_sizes {
        bench.section(
            &format!("ours vs CUDA's host-NUMA memory, cold, {}", size_text(size)),
            |b| b.numa_cold(size),
        );
    }
    if driver.is_none() {
        let size = args.bw_sizes.iter().copied().max().unwrap_or(64 * MIB);
        bench.section("host copy bandwidth to the host node (GB/s, median)", |b| {
            b.host_copies(size)
        });
    }
    let last_pin_error = [&bench.ours, &bench.cached]
        .iter()
        .find_map(|alloc| alloc.stats().last_pin_error)
        .map_or_else(|| "none".to_owned(), |e| e.to_string());
    match &unavailable {
        Some(why) => println!("\nmeasured host-side costs only: {why}"),
        None => println!("\nlast registration error: {last_pin_error}"),
    }
    header.insert("last_pin_error".into(), last_pin_error.into());
    println!("total {:.1} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json_out {
        header.insert("seconds".into(), started.elapsed().as_secs_f64().into());
        header.insert("rows".into(), bench.rows.iter().map(Row::json).collect());
        let json = serde_json::to_string(&header)? + "\n";
        std::fs::write(path, json).map_err(|e| format!("cannot write {path}: {e}"))?;
    }
    let failed_rows = bench.rows.iter().filter(|r| r.note.starts_with("failed:"));
    let failures = bench.failed_sections + failed_rows.count();
    if failures > 0 {
        return Err(format!(
            "{failures} section(s) or row(s) failed (lines starting with failed:)"
        )
        .into());
    }
    Ok(())
}
