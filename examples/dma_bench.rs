//! Host↔device DMA bandwidth, the cold cost of page-locked memory, and populate scaling:
//! `numa-gpu-alloc` against pageable memory, `cuMemHostAlloc` and `malloc` + `cuMemHostRegister`.
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
//!    pageable, `cuMemHostAlloc`, ours, and ours on the farthest node when there is more than
//!    one. Without a driver: host memcpy bandwidth from each node, last.
//! 2. **Cold cost** for each `--cold-sizes` (1 GiB and 16 GiB): first, twice the size is touched
//!    and freed, so that no method pays the hypervisor's or kernel's first touch alone; then
//!    ours (place + populate + register), `cuMemHostAlloc`, and `vec![0; n]` + `cuMemHostRegister`
//!    (the naive path) are alternated `--reps` times (3) and the median reported, with the
//!    registration time alone. Without a driver: ours (place + populate) against `malloc` + touch.
//! 3. **Reuse**: a freed block of the first cold size taken back from the cache.
//! 4. **Populate scaling**: a cold `--scaling-size` block (4 GiB) placed and populated with each
//!    of `--threads` (1,2,4,8,16) populate threads, host-only, after touching as much memory;
//!    the thread counts take turns, `--reps` rounds, median reported.
//!
//! The driver is called through the crate's own C-typed table (`numa_gpu_alloc::cuda_driver`),
//! never through cudarc's `sys::cu*` wrappers.

use std::error::Error;
use std::fmt::Write as _;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Layout};
use numa_gpu_alloc::cuda_driver::{Direction, Driver};
use numa_gpu_alloc::{GpuSelector, MemPolicy, NumaGpuAlloc, NumaTopology, PinMode};

type Res<T> = Result<T, Box<dyn Error>>;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// Below this, one bandwidth sample is several copies (nvbandwidth does the same).
const MIN_SAMPLE_BYTES: usize = 64 * MIB;

const USAGE: &str = "usage: dma_bench [--cold-sizes S,..] [--reps N] [--scaling-size S] \
                     [--threads N,..] [--bw-sizes S,..] [--runs N] [--gpu auto|N] \
                     [--max-seconds N] [--json-out FILE]
  --cold-sizes    cold-cost block sizes (default 1GiB,16GiB; skipped when memory is short)
  --reps          cold-cost samples per method, alternated; the median is reported (default 3)
  --scaling-size  block for populate scaling (default 4GiB)
  --threads       populate thread counts (default 1,2,4,8,16)
  --bw-sizes      bandwidth sizes (default 4MiB,16MiB,64MiB,256MiB,1GiB)
  --runs          bandwidth samples per size and direction, median reported (default 5)
  --gpu           CUDA device ordinal, or auto (LOCAL_RANK etc.; default)
  --max-seconds   skip the sections that would start after this many seconds
  --json-out      also write every row as JSON to FILE";

struct Args {
    cold_sizes: Vec<usize>,
    reps: usize,
    scaling_size: usize,
    threads: Vec<usize>,
    bw_sizes: Vec<usize>,
    runs: usize,
    gpu: GpuSelector,
    max_seconds: Option<u64>,
    json_out: Option<String>,
}

fn parse_sizes(v: &str) -> Res<Vec<usize>> {
    v.split(',')
        .map(|s| {
            numa_gpu_alloc::parse_size(s)
                .filter(|&b| b > 0)
                .ok_or_else(|| format!("bad size {s:?}\n{USAGE}").into())
        })
        .collect()
}

fn parse_count(v: &str) -> Res<usize> {
    v.parse()
        .ok()
        .filter(|&n: &usize| n > 0)
        .ok_or_else(|| format!("bad count {v:?}\n{USAGE}").into())
}

fn parse_args() -> Res<Args> {
    use lexopt::prelude::*;
    let mut args = Args {
        cold_sizes: vec![GIB, 16 * GIB],
        reps: 3,
        scaling_size: 4 * GIB,
        threads: vec![1, 2, 4, 8, 16],
        bw_sizes: vec![4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB],
        runs: 5,
        gpu: GpuSelector::Auto,
        max_seconds: None,
        json_out: None,
    };
    let mut parser = lexopt::Parser::from_env();
    let usage = |e: lexopt::Error| -> Box<dyn std::error::Error> { format!("{e}\n{USAGE}").into() };
    let value = |parser: &mut lexopt::Parser| -> Res<String> {
        parser.value().map_err(usage)?.string().map_err(usage)
    };
    while let Some(arg) = parser.next().map_err(usage)? {
        match arg {
            Long("cold-sizes") => args.cold_sizes = parse_sizes(&value(&mut parser)?)?,
            Long("reps") => args.reps = parse_count(&value(&mut parser)?)?,
            Long("scaling-size") => args.scaling_size = parse_sizes(&value(&mut parser)?)?[0],
            Long("threads") => {
                args.threads = value(&mut parser)?
                    .split(',')
                    .map(parse_count)
                    .collect::<Res<_>>()?;
            }
            Long("bw-sizes") => args.bw_sizes = parse_sizes(&value(&mut parser)?)?,
            Long("runs") => args.runs = parse_count(&value(&mut parser)?)?,
            Long("gpu") => {
                let v = value(&mut parser)?;
                args.gpu = if v.eq_ignore_ascii_case("auto") {
                    GpuSelector::Auto
                } else {
                    GpuSelector::Ordinal(v.parse().map_err(|_| format!("bad GPU {v:?}"))?)
                };
            }
            Long("max-seconds") => {
                args.max_seconds = Some(parse_count(&value(&mut parser)?)? as u64)
            }
            Long("json-out") => args.json_out = Some(value(&mut parser)?),
            Short('h') | Long("help") => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            // `cargo bench`/`cargo test` style flags are ignored.
            Long("bench") | Long("nocapture") => {}
            _ => return Err(usage(arg.unexpected())),
        }
    }
    Ok(args)
}

/// One measured value (a row of the tables and of the JSON file).
#[derive(Default, serde::Serialize)]
struct Row {
    /// `cold`, `reuse`, `populate`, `bandwidth` or `host_copy`.
    test: &'static str,
    /// What memory: `ours`, `cuMemHostAlloc`, `malloc+register`, `malloc+touch`, `pageable`,
    /// `ours-far`.
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

/// Touches `bytes` of fresh memory and frees it, so that a cold measurement after it does not
/// pay the first touch of memory the hypervisor (or the kernel) has never backed.
fn pre_touch(bytes: usize) {
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

/// Everything the sections share.
struct Bench<'a> {
    args: &'a Args,
    topo: &'a NumaTopology,
    /// The driver and device ordinal, when CUDA is usable.
    driver: Option<&'a Driver>,
    /// Where blocks go: the GPU's host node, else this thread's node.
    host: usize,
    far: Option<usize>,
    started: Instant,
    rows: Vec<Row>,
    /// Sections that stopped on an error.
    failed_sections: usize,
    /// Ours, without a cache: every block is cold.
    ours: NumaGpuAlloc,
    /// Ours, caching freed blocks of the first cold size.
    cached: NumaGpuAlloc,
}

/// An allocator of ours for `host`: pinning explicitly on (strict) with a driver, off without.
fn ours_alloc(args: &Args, cuda: bool, host: usize, cache: usize) -> NumaGpuAlloc {
    let alloc = NumaGpuAlloc::new().cache_limit(cache);
    if cuda {
        alloc.gpu(args.gpu).pin(PinMode::Strict)
    } else {
        alloc.node(host).pin(PinMode::Off)
    }
}

impl Bench<'_> {
    /// Runs one section unless the time budget is spent, then prints its rows and duration.
    fn section(&mut self, title: &str, run: impl FnOnce(&mut Self) -> Res<()>) {
        let first = self.rows.len();
        let elapsed = self.started.elapsed().as_secs();
        println!("\n== {title}");
        if self.args.max_seconds.is_some_and(|max| elapsed >= max) {
            println!("skipped: --max-seconds reached after {elapsed} s");
            return;
        }
        let start = Instant::now();
        if let Err(e) = run(self) {
            self.failed_sections += 1;
            println!("failed: {e}");
        }
        print_rows(&self.rows[first..]);
        println!("[{title}: {:.1} s]", start.elapsed().as_secs_f64());
    }

    /// Cold cost of `size` bytes, methods alternated, median of `reps`.
    fn cold(&mut self, size: usize) -> Res<()> {
        if let Some(why) = short_of_memory(2 * size + GIB) {
            println!("{why}");
            return Ok(());
        }
        // Twice the size: the memory each method then gets back is equally warm.
        pre_touch(2 * size);
        let (mut ours, mut ours_pin) = (Vec::new(), Vec::new());
        let (mut host_alloc, mut naive, mut naive_reg) = (Vec::new(), Vec::new(), Vec::new());
        let mut populate = Vec::new();
        let alloc = &self.ours;
        let _ = alloc.placement(); // context and topology set up outside the timing
        for _ in 0..self.args.reps {
            let before = alloc.stats();
            let (block, took) = OurBlock::new(alloc, size)?;
            let after = alloc.stats();
            drop(block);
            alloc.trim();
            ours.push(ms(took));
            ours_pin.push(ms(after
                .pin_time
                .total
                .saturating_sub(before.pin_time.total)));
            populate.push(ms(after
                .populate_time
                .total
                .saturating_sub(before.populate_time.total)));
            let Some(driver) = self.driver else {
                // The system allocator, first touch included (no placement, no pinning).
                let start = Instant::now();
                let mut v: Vec<u8> = Vec::with_capacity(size);
                for page in v.spare_capacity_mut().iter_mut().step_by(4096) {
                    page.write(0);
                }
                naive.push(ms(start.elapsed()));
                drop(std::hint::black_box(v));
                continue;
            };
            let start = Instant::now();
            let block = driver.host_alloc(size)?;
            host_alloc.push(ms(start.elapsed()));
            drop(block);
            // The naive path: a zeroed Vec (untouched pages from calloc), then registered.
            let start = Instant::now();
            let mut v = vec![0u8; size];
            let ptr = NonNull::new(v.as_mut_ptr()).ok_or("null Vec")?;
            let reg_start = Instant::now();
            // SAFETY: the Vec's buffer is mapped, not registered, and outlives the guard
            // (dropped first, below); the context is current on this thread.
            let registered = unsafe { driver.register(ptr, size) }?;
            naive_reg.push(ms(reg_start.elapsed()));
            naive.push(ms(start.elapsed()));
            drop(registered);
            drop(v);
        }
        let node = Some(self.host);
        let (ours_note, ours_reg) = if self.driver.is_some() {
            (
                "mmap + mbind + populate + cuMemHostRegister",
                Some(median(ours_pin)),
            )
        } else {
            ("mmap + mbind + populate", None)
        };
        self.rows.push(Row {
            test: "cold",
            memory: "ours",
            node,
            bytes: size,
            ms: Some(median(ours.clone())),
            register_ms: ours_reg,
            note: format!(
                "{ours_note}; populate {:.1} ms; {}",
                median(populate),
                spread(&ours)
            ),
            ..Row::default()
        });
        if self.driver.is_some() {
            self.rows.push(Row {
                test: "cold",
                memory: "cuMemHostAlloc",
                bytes: size,
                ms: Some(median(host_alloc.clone())),
                note: format!(
                    "pages on the calling thread's node; {}",
                    spread(&host_alloc)
                ),
                ..Row::default()
            });
            self.rows.push(Row {
                test: "cold",
                memory: "malloc+register",
                bytes: size,
                ms: Some(median(naive.clone())),
                register_ms: Some(median(naive_reg)),
                note: format!(
                    "vec![0; n] + cuMemHostRegister, no placement; {}",
                    spread(&naive)
                ),
                ..Row::default()
            });
        } else {
            self.rows.push(Row {
                test: "cold",
                memory: "malloc+touch",
                bytes: size,
                ms: Some(median(naive.clone())),
                note: format!("malloc + first touch, no placement; {}", spread(&naive)),
                ..Row::default()
            });
        }
        Ok(())
    }

    /// A freed block taken back from the cache.
    fn reuse(&mut self, size: usize) -> Res<()> {
        if let Some(why) = short_of_memory(size + GIB) {
            println!("{why}");
            return Ok(());
        }
        drop(OurBlock::new(&self.cached, size)?);
        let (block, took) = OurBlock::new(&self.cached, size)?;
        drop(block);
        self.rows.push(Row {
            test: "reuse",
            memory: "ours",
            node: Some(self.host),
            bytes: size,
            ms: Some(ms(took)),
            note: if self.driver.is_some() {
                "freed block taken from the cache, still placed and pinned"
            } else {
                "freed block taken from the cache, still placed"
            }
            .into(),
            ..Row::default()
        });
        Ok(())
    }

    /// Cold place + populate of one block with each thread count (host-only: no pinning).
    fn scaling(&mut self) -> Res<()> {
        let size = self.args.scaling_size;
        if let Some(why) = short_of_memory(size + GIB) {
            println!("{why}");
            return Ok(());
        }
        pre_touch(size);
        let allocs: Vec<NumaGpuAlloc> = (self.args.threads.iter())
            .map(|&threads| {
                NumaGpuAlloc::new()
                    .node(self.host)
                    .pin(PinMode::Off)
                    .cache_limit(0)
                    .populate_threads(threads)
            })
            .collect();
        allocs.iter().for_each(|a| drop(a.placement()));
        // Thread counts take turns, so that a slow spell of the machine (a hypervisor backing
        // memory again) lands on one sample of each row rather than on one row.
        let mut samples = vec![Vec::new(); allocs.len()];
        for _ in 0..self.args.reps {
            for (alloc, samples) in allocs.iter().zip(&mut samples) {
                let (block, took) = OurBlock::new(alloc, size)?;
                drop(block);
                samples.push(ms(took));
            }
        }
        let base = median(samples[0].clone());
        for (&threads, samples) in self.args.threads.iter().zip(samples) {
            let m = median(samples.clone());
            self.rows.push(Row {
                test: "populate",
                memory: "ours",
                node: Some(self.host),
                bytes: size,
                threads: Some(threads),
                ms: Some(m),
                note: format!("{:.2}x the first row; {}", base / m, spread(&samples)),
                ..Row::default()
            });
        }
        Ok(())
    }

    /// Host→device and device→host bandwidth for every size and kind of host memory.
    fn bandwidth(&mut self, driver: &Driver) -> Res<()> {
        let max = self.args.bw_sizes.iter().copied().max().unwrap_or(0);
        let copier = driver.copier(max)?;
        let ours = &self.ours;
        // `bind`: every page really is on the far node, or the allocation fails.
        let far = self.far.map(|n| {
            let alloc = NumaGpuAlloc::new()
                .node(n)
                .policy(MemPolicy::Bind)
                .pin(PinMode::Off)
                .cache_limit(0);
            (n, alloc)
        });
        for &size in &self.args.bw_sizes {
            let copies = MIN_SAMPLE_BYTES.div_ceil(size).max(1);
            let measure = |memory: &'static str, node: Option<usize>, host: &mut [u8]| {
                let mut row = Row {
                    test: "bandwidth",
                    memory,
                    node,
                    bytes: size,
                    note: format!(
                        "{copies} cop{} per sample",
                        if copies == 1 { "y" } else { "ies" }
                    ),
                    ..Row::default()
                };
                let mut rate = |direction| -> Res<f64> {
                    copier.time(host, direction, 1)?; // warm-up
                    let samples = (0..self.args.runs)
                        .map(|_| copier.time(host, direction, copies))
                        .collect::<Result<Vec<f64>, _>>()?;
                    let gbps = samples.iter().map(|s| (size * copies) as f64 / s / 1e9);
                    Ok(median(gbps.collect()))
                };
                match (rate(Direction::HtoD), rate(Direction::DtoH)) {
                    (Ok(h2d), Ok(d2h)) => (row.h2d_gbps, row.d2h_gbps) = (Some(h2d), Some(d2h)),
                    (Err(e), _) | (_, Err(e)) => row.note = format!("failed: {e}"),
                }
                row
            };
            let mut rows = Vec::new();
            rows.push(measure("pageable", None, &mut vec![0x11u8; size]));
            let mut pinned = driver.host_alloc(size)?;
            rows.push(measure("cuMemHostAlloc", None, pinned.as_mut_slice()));
            drop(pinned);
            let (mut block, _) = OurBlock::new(ours, size)?;
            rows.push(measure("ours", Some(self.host), block.filled(0x22)));
            drop(block);
            if let Some((node, alloc)) = &far {
                let (mut block, _) = OurBlock::new(alloc, size)?;
                let slice = block.filled(0x33);
                let ptr = NonNull::new(slice.as_mut_ptr()).ok_or("null block")?;
                // SAFETY: the block is mapped, not registered (its allocator does not pin),
                // and outlives the guard, dropped at the end of this block.
                let _registered = unsafe { driver.register(ptr, size) }?;
                rows.push(measure("ours-far", Some(*node), slice));
            }
            self.rows.extend(rows);
        }
        Ok(())
    }

    /// Without a GPU: memcpy bandwidth from a buffer on each node to one on `host`.
    fn host_copies(&mut self, size: usize) -> Res<()> {
        let dst_alloc = NumaGpuAlloc::new().node(self.host).pin(PinMode::Off);
        let (mut dst, _) = OurBlock::new(&dst_alloc, size)?;
        let dst = dst.filled(0);
        for info in self.topo.nodes().iter().filter(|n| n.has_memory) {
            let src_alloc = NumaGpuAlloc::new().node(info.id).pin(PinMode::Off);
            let (mut src, _) = OurBlock::new(&src_alloc, size)?;
            let src = src.filled(0xa5);
            dst.copy_from_slice(src); // warm-up
            let rates = (0..self.args.runs)
                .map(|_| {
                    let start = Instant::now();
                    dst.copy_from_slice(src);
                    std::hint::black_box(&dst[..]);
                    size as f64 / start.elapsed().as_secs_f64() / 1e9
                })
                .collect();
            self.rows.push(Row {
                test: "host_copy",
                memory: "ours",
                node: Some(info.id),
                bytes: size,
                copy_gbps: Some(median(rates)),
                note: format!("node {} -> node {}", info.id, self.host),
                ..Row::default()
            });
        }
        Ok(())
    }
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

fn main() -> Res<()> {
    let args = parse_args()?;
    let started = Instant::now();
    let topo = NumaTopology::from_sysfs().unwrap_or_else(|e| {
        println!("cannot read the NUMA topology ({e}); assuming one node");
        NumaTopology::single_node()
    });
    println!("{}", describe_topology(&topo));
    let local = numa_gpu_alloc::sys::current_node()
        .ok()
        .filter(|&n| topo.contains(n))
        .or_else(|| topo.node_ids().first().copied())
        .unwrap_or(0);
    let unavailable = numa_gpu_alloc::cuda_unavailable_reason();
    let mut header = serde_json::Map::new();
    header.insert("cuda".into(), unavailable.is_none().into());
    let mut host = local;
    let mut driver = None;
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
        args: &args,
        topo: &topo,
        driver: driver.as_ref(),
        host,
        far,
        started,
        rows: Vec::new(),
        failed_sections: 0,
        ours: ours_alloc(&args, driver.is_some(), host, 0),
        cached: ours_alloc(
            &args,
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
        header.insert("rows".into(), serde_json::to_value(&bench.rows)?);
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
