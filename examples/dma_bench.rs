//! Host↔device DMA bandwidth and allocation cost: the system allocator, `cuMemHostAlloc`, and
//! `numa-gpu-alloc` on the GPU's host node and on the farthest node.
//!
//! ```text
//! cargo run --release --example dma_bench                       # 256 MiB, 1 GiB cold block
//! cargo run --release --example dma_bench -- --size 64MiB,1GiB --runs 10
//! cargo run --release --example dma_bench -- --csv > dma.csv   # or --json
//! ```
//!
//! Without a CUDA driver it says so on one line and measures what the host can: the cold cost of
//! placing and populating a block, the cost of reusing a cached one, and copy bandwidth from a
//! buffer on each NUMA node to one on the local node.

use std::error::Error;
use std::fmt::Write as _;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Layout};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use numa_gpu_alloc::{GpuSelector, MemPolicy, NumaGpuAlloc, NumaTopology, PinMode};

type Res<T> = Result<T, Box<dyn Error>>;

const USAGE: &str = "usage: dma_bench [--size SIZE[,SIZE...]] [--runs N] [--cold-size SIZE] \
                     [--gpu auto|N] [--csv|--json]
  --size       buffer sizes for the bandwidth tables (default 256MiB; e.g. 64MiB,1GiB)
  --runs       timed copies per measurement, the median is reported (default 5)
  --cold-size  size of the block whose first allocation and cached reuse are timed (default 1GiB)
  --gpu        CUDA device ordinal, or auto (LOCAL_RANK etc.; default)
  --csv/--json machine-readable results on stdout (notes go to stderr)";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Text,
    Csv,
    Json,
}

struct Args {
    sizes: Vec<usize>,
    runs: usize,
    cold_size: usize,
    gpu: GpuSelector,
    format: Format,
}

/// A size as `NUMA_GPU_ALLOC` writes them (`256MiB`, `1GiB`), not zero.
fn parse_size(text: &str) -> Option<usize> {
    numa_gpu_alloc::parse_size(text).filter(|&bytes| bytes > 0)
}

fn parse_args() -> Res<Args> {
    let mut args = Args {
        sizes: vec![256 << 20],
        runs: 5,
        cold_size: 1 << 30,
        gpu: GpuSelector::Auto,
        format: Format::Text,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k.to_owned(), Some(v.to_owned())),
            None => (arg.clone(), None),
        };
        let mut value = || -> Res<String> {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{key} needs a value\n{USAGE}").into())
        };
        match key.as_str() {
            "--size" | "--sizes" => {
                let v = value()?;
                args.sizes = v
                    .split(',')
                    .map(|s| parse_size(s).ok_or_else(|| format!("bad size {s:?}\n{USAGE}")))
                    .collect::<Result<_, _>>()?;
            }
            "--runs" => {
                let v = value()?;
                args.runs = v
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("bad run count {v:?}"))?;
            }
            "--cold-size" => {
                let v = value()?;
                args.cold_size = parse_size(&v).ok_or_else(|| format!("bad size {v:?}"))?;
            }
            "--gpu" => {
                let v = value()?;
                args.gpu = if v.eq_ignore_ascii_case("auto") {
                    GpuSelector::Auto
                } else {
                    GpuSelector::Ordinal(v.parse().map_err(|_| format!("bad GPU {v:?}"))?)
                };
            }
            "--csv" => args.format = Format::Csv,
            "--json" => args.format = Format::Json,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            // `cargo bench`/`cargo test` style flags are ignored.
            "--bench" | "--nocapture" => {}
            _ => return Err(format!("unknown argument {arg:?}\n{USAGE}").into()),
        }
    }
    Ok(args)
}

/// One measured value.
struct Row {
    /// `bandwidth`, `cold`, `reuse` or `host_copy`.
    test: &'static str,
    /// What memory: `pageable`, `cuMemHostAlloc`, `ours`, `ours-far`, `system`.
    memory: &'static str,
    node: Option<usize>,
    bytes: usize,
    h2d_gbps: Option<f64>,
    d2h_gbps: Option<f64>,
    copy_gbps: Option<f64>,
    ms: Option<f64>,
    note: String,
}

impl Row {
    fn new(test: &'static str, memory: &'static str, node: Option<usize>, bytes: usize) -> Row {
        Row {
            test,
            memory,
            node,
            bytes,
            h2d_gbps: None,
            d2h_gbps: None,
            copy_gbps: None,
            ms: None,
            note: String::new(),
        }
    }
}

/// What the run found out about the machine.
struct Report {
    cuda: bool,
    cuda_note: String,
    topology: String,
    local_node: Option<usize>,
    host_node: Option<usize>,
    home_node: Option<usize>,
    far_node: Option<usize>,
    gpu: Option<String>,
    rows: Vec<Row>,
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mib(bytes: usize) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes as f64 / f64::from(1u32 << 20))
    }
}

/// A block from one of our allocators, freed on drop. Its bytes are uninitialised until
/// [`OurBlock::fill`] is called.
struct OurBlock<'a> {
    alloc: &'a NumaGpuAlloc,
    ptr: NonNull<u8>,
    layout: Layout,
    filled: bool,
}

impl<'a> OurBlock<'a> {
    fn new(alloc: &'a NumaGpuAlloc, len: usize) -> Res<(Self, Duration)> {
        let layout = Layout::from_size_align(len, 4096)?;
        let start = Instant::now();
        let ptr = alloc
            .allocate(layout)
            .map_err(|_| format!("numa-gpu-alloc could not allocate {}", mib(len)))?;
        let took = start.elapsed();
        let block = OurBlock {
            alloc,
            ptr: ptr.cast(),
            layout,
            filled: false,
        };
        Ok((block, took))
    }

    fn filled(alloc: &'a NumaGpuAlloc, len: usize, byte: u8) -> Res<Self> {
        let (mut block, _) = Self::new(alloc, len)?;
        block.fill(byte);
        Ok(block)
    }

    fn fill(&mut self, byte: u8) {
        // SAFETY: the block owns `layout.size()` writable bytes at `ptr`.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), byte, self.layout.size()) };
        self.filled = true;
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        if !self.filled {
            self.fill(0);
        }
        // SAFETY: the bytes are initialised (filled above) and owned by this block, which is
        // borrowed mutably for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for OurBlock<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc.allocate(layout)` and is freed once, here.
        unsafe { self.alloc.deallocate(self.ptr, self.layout) };
    }
}

/// `cuMemHostAlloc(PORTABLE)` memory, freed with `cuMemFreeHost` on drop.
struct CudaHostBlock {
    ptr: NonNull<u8>,
    len: usize,
}

impl CudaHostBlock {
    /// Needs a current context (`ctx.bind_to_thread()`).
    fn new(len: usize) -> Res<(Self, Duration)> {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let start = Instant::now();
        // SAFETY: the driver is present (checked by the caller) and a context is current;
        // `p` is a valid out-pointer.
        let res = unsafe { sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE) };
        let took = start.elapsed();
        if res != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostAlloc({}) failed: {res:?}", mib(len)).into());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or("cuMemHostAlloc returned null")?;
        // SAFETY: `len` writable bytes were just allocated at `ptr`.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0x3c, len) };
        Ok((CudaHostBlock { ptr, len }, took))
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` initialised bytes owned by this block.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for CudaHostBlock {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.as_ptr().cast()) };
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
    for &cpu in &info.cpus {
        if cpu < libc::CPU_SETSIZE as usize {
            // SAFETY: `cpu` is below CPU_SETSIZE and `set` is a valid cpu_set_t.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid, initialised cpu_set_t.
    let _ = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
}

fn describe_topology(topo: &NumaTopology) -> String {
    let mut s = String::new();
    let ids = topo.node_ids();
    let _ = write!(
        s,
        "NUMA topology: {} node(s)\n  node  cpus  memory  distances to",
        ids.len()
    );
    for id in ids {
        let _ = write!(s, " {id:>4}");
    }
    s.push('\n');
    for info in topo.nodes() {
        let _ = write!(
            s,
            "  {:>4}  {:>4}  {:>6}  {:12}",
            info.id,
            info.cpus.len(),
            if info.has_memory {
                format!("{}G", info.memory_bytes >> 30)
            } else {
                "none".to_owned()
            },
            ""
        );
        for &to in ids {
            let _ = write!(
                s,
                " {:>4}",
                topo.distance(info.id, to)
                    .map_or_else(|| "-".to_owned(), |d| d.to_string())
            );
        }
        s.push('\n');
    }
    s
}

/// Host-only: cold place+populate, cached reuse, and the system allocator's first-touch cost.
fn host_alloc_costs(report: &mut Report, node: usize, size: usize) -> Res<()> {
    let alloc = NumaGpuAlloc::new()
        .node(node)
        .pin(PinMode::Off)
        .cache_limit(size.saturating_mul(2));
    let _ = alloc.placement();
    let (block, cold) = OurBlock::new(&alloc, size)?;
    let mut row = Row::new("cold", "ours", Some(node), size);
    row.ms = Some(ms(cold));
    row.note = "mmap + mbind + populate".into();
    report.rows.push(row);
    drop(block);
    let (block, reuse) = OurBlock::new(&alloc, size)?;
    let mut row = Row::new("reuse", "ours", Some(node), size);
    row.ms = Some(ms(reuse));
    row.note = "freed block taken from the cache".into();
    report.rows.push(row);
    drop(block);

    let start = Instant::now();
    let mut v: Vec<u8> = Vec::with_capacity(size);
    // SAFETY: `size` bytes of capacity; touching one byte per 4 KiB page faults them in.
    unsafe {
        let p = v.as_mut_ptr();
        for off in (0..size).step_by(4096) {
            p.add(off).write_volatile(0);
        }
    }
    let took = start.elapsed();
    drop(v);
    let mut row = Row::new("cold", "system", None, size);
    row.ms = Some(ms(took));
    row.note = "malloc + first touch (no placement)".into();
    report.rows.push(row);
    Ok(())
}

/// Host-only: memcpy bandwidth from a buffer on each node to one on the local node.
fn host_copies(
    report: &mut Report,
    topo: &NumaTopology,
    local: usize,
    size: usize,
    runs: usize,
) -> Res<()> {
    let dst_alloc = NumaGpuAlloc::new().node(local).pin(PinMode::Off);
    let mut dst = OurBlock::filled(&dst_alloc, size, 0)?;
    for info in topo.nodes().iter().filter(|n| n.has_memory) {
        let src_alloc = NumaGpuAlloc::new().node(info.id).pin(PinMode::Off);
        let mut src = OurBlock::filled(&src_alloc, size, 0xa5)?;
        let src = src.as_mut_slice();
        let dst = dst.as_mut_slice();
        dst.copy_from_slice(src); // warm-up
        let mut rates = Vec::with_capacity(runs);
        for _ in 0..runs {
            let start = Instant::now();
            dst.copy_from_slice(src);
            std::hint::black_box(&dst[..]);
            rates.push(gbps(size, start.elapsed().as_secs_f64()));
        }
        let mut row = Row::new("host_copy", "ours", Some(info.id), size);
        row.copy_gbps = Some(median(rates));
        row.note = format!("node {} -> node {local}", info.id);
        report.rows.push(row);
    }
    Ok(())
}

/// Median host→device and device→host bandwidth for one host buffer.
fn dma(
    stream: &Arc<CudaStream>,
    host: &mut [u8],
    dev: &mut CudaSlice<u8>,
    runs: usize,
) -> Res<(f64, f64)> {
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let bytes = host.len();
    let mut dev = dev.slice_mut(0..bytes);
    // Warm-up in both directions.
    stream.memcpy_htod(&*host, &mut dev)?;
    stream.memcpy_dtoh(&dev, &mut *host)?;
    stream.synchronize()?;
    let (mut h2d, mut d2h) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let a = stream.record_event(timing)?;
        stream.memcpy_htod(&*host, &mut dev)?;
        let b = stream.record_event(timing)?;
        stream.memcpy_dtoh(&dev, &mut *host)?;
        let c = stream.record_event(timing)?;
        h2d.push(gbps(bytes, f64::from(a.elapsed_ms(&b)?) / 1e3));
        d2h.push(gbps(bytes, f64::from(b.elapsed_ms(&c)?) / 1e3));
    }
    Ok((median(h2d), median(d2h)))
}

/// Registers a range with cuMemHostRegister (PORTABLE) until dropped.
struct Registered(NonNull<u8>);

impl Registered {
    fn new(slice: &mut [u8]) -> Res<Registered> {
        let ptr = NonNull::new(slice.as_mut_ptr()).ok_or("null buffer")?;
        // SAFETY: the driver is present and a context is current; the slice is live, owned by
        // the caller, not registered, and outlives the returned guard.
        let res = unsafe {
            sys::cuMemHostRegister_v2(
                ptr.as_ptr().cast(),
                slice.len(),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if res != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostRegister_v2 failed: {res:?}").into());
        }
        Ok(Registered(ptr))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: registered in `new` with this base pointer; still mapped.
        let _ = unsafe { sys::cuMemHostUnregister(self.0.as_ptr().cast()) };
    }
}

/// The host memory one bandwidth row measures.
enum HostKind<'a> {
    /// A `Vec` from the system allocator.
    Pageable,
    /// `cuMemHostAlloc(PORTABLE)`.
    CudaHost,
    /// A block from an allocator that pins it itself.
    Ours(&'a NumaGpuAlloc),
    /// A block from an unpinned allocator, registered here.
    OursRegistered(&'a NumaGpuAlloc),
}

struct GpuSide<'a> {
    ctx: &'a Arc<CudaContext>,
    stream: &'a Arc<CudaStream>,
    runs: usize,
}

impl GpuSide<'_> {
    fn measure(&self, kind: HostKind, size: usize, dev: &mut CudaSlice<u8>) -> Res<(f64, f64)> {
        match kind {
            HostKind::Pageable => {
                let mut v = vec![0x11u8; size];
                dma(self.stream, &mut v, dev, self.runs)
            }
            HostKind::CudaHost => {
                self.ctx.bind_to_thread()?;
                let (mut b, _) = CudaHostBlock::new(size)?;
                dma(self.stream, b.as_mut_slice(), dev, self.runs)
            }
            HostKind::Ours(alloc) => {
                let mut b = OurBlock::filled(alloc, size, 0x22)?;
                dma(self.stream, b.as_mut_slice(), dev, self.runs)
            }
            HostKind::OursRegistered(alloc) => {
                let mut b = OurBlock::filled(alloc, size, 0x33)?;
                self.ctx.bind_to_thread()?;
                let slice = b.as_mut_slice();
                let _registered = Registered::new(slice)?;
                dma(self.stream, slice, dev, self.runs)
            }
        }
    }
}

fn bandwidth_row(
    memory: &'static str,
    node: Option<usize>,
    bytes: usize,
    result: Res<(f64, f64)>,
) -> Row {
    let mut row = Row::new("bandwidth", memory, node, bytes);
    match result {
        Ok((h2d, d2h)) => {
            row.h2d_gbps = Some(h2d);
            row.d2h_gbps = Some(d2h);
        }
        Err(e) => row.note = format!("failed: {e}"),
    }
    row
}

fn gpu_part(report: &mut Report, args: &Args, topo: &NumaTopology) -> Res<()> {
    let ours = NumaGpuAlloc::new()
        .gpu(args.gpu)
        .pin(PinMode::Strict)
        .cache_limit(args.cold_size.saturating_mul(2));
    let placement = ours.placement();
    report.host_node = Some(placement.host_node);
    report.home_node = placement.home_node;
    let ordinal = placement
        .gpu_ordinal
        .ok_or("numa-gpu-alloc found no GPU to pin for")?;
    report.gpu = Some(format!(
        "{ordinal} ({}) {}",
        placement
            .gpu_pci
            .map_or_else(|| "?".to_owned(), |p| p.to_string()),
        placement.gpu_name.clone().unwrap_or_default()
    ));
    if !placement.pinning {
        return Err("numa-gpu-alloc does not pin (see its stats)".into());
    }
    let host = placement.host_node;
    // The thread that populates and drives the copies sits on the GPU's socket, as a loader would.
    pin_thread_to(topo, host);
    report.far_node = topo.farthest_node_from(host).filter(|&n| n != host);
    let ctx = CudaContext::new(ordinal as usize)?;
    let stream = ctx.default_stream();
    let max = args.sizes.iter().copied().max().unwrap_or(0);
    let mut dev = stream.alloc_zeros::<u8>(max)?;
    let far_alloc = report
        .far_node
        // `bind`: the row is only reported if every page really is on the far node.
        .map(|n| {
            NumaGpuAlloc::new()
                .node(n)
                .policy(MemPolicy::Bind)
                .pin(PinMode::Off)
        });

    for &size in &args.sizes {
        let gpu = GpuSide {
            ctx: &ctx,
            stream: &stream,
            runs: args.runs,
        };
        let mut memories: Vec<(&'static str, Option<usize>, HostKind)> = vec![
            ("pageable", None, HostKind::Pageable),
            ("cuMemHostAlloc", None, HostKind::CudaHost),
            ("ours", Some(host), HostKind::Ours(&ours)),
        ];
        if let (Some(far), Some(alloc)) = (report.far_node, far_alloc.as_ref()) {
            memories.push(("ours-far", Some(far), HostKind::OursRegistered(alloc)));
        }
        for (memory, node, kind) in memories {
            let result = gpu.measure(kind, size, &mut dev);
            report.rows.push(bandwidth_row(memory, node, size, result));
        }
    }
    drop(dev);

    // Cold cost of one pinned block, and its cached reuse.
    let cold = args.cold_size;
    ours.trim();
    let before = ours.stats();
    let (block, took) = OurBlock::new(&ours, cold)?;
    let after = ours.stats();
    let mut row = Row::new("cold", "ours", Some(host), cold);
    row.ms = Some(ms(took));
    row.note = format!(
        "populate {:.1} ms + pin {:.1} ms",
        ms(after
            .populate_time
            .total
            .saturating_sub(before.populate_time.total)),
        ms(after.pin_time.total.saturating_sub(before.pin_time.total))
    );
    report.rows.push(row);
    drop(block);
    let (block, took) = OurBlock::new(&ours, cold)?;
    let mut row = Row::new("reuse", "ours", Some(host), cold);
    row.ms = Some(ms(took));
    row.note = "cached block, still placed and pinned".into();
    report.rows.push(row);
    drop(block);
    ours.trim();

    ctx.bind_to_thread()?;
    let (block, took) = CudaHostBlock::new(cold)?;
    let mut row = Row::new("cold", "cuMemHostAlloc", None, cold);
    row.ms = Some(ms(took));
    row.note = "pages on the calling thread's node".into();
    report.rows.push(row);
    drop(block);
    Ok(())
}

fn opt_f(v: Option<f64>, prec: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.prec$}"))
}

fn opt_u(v: Option<usize>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

fn print_text(r: &Report) {
    print!("{}", r.topology);
    if let Some(local) = r.local_node {
        println!("local node (this thread): {local}");
    }
    if r.cuda {
        println!(
            "GPU: {}\nGPU home node: {}   host node: {}   farthest node: {}",
            r.gpu.as_deref().unwrap_or("-"),
            opt_u(r.home_node),
            opt_u(r.host_node),
            opt_u(r.far_node)
        );
    }
    let bw: Vec<&Row> = r.rows.iter().filter(|x| x.test == "bandwidth").collect();
    if !bw.is_empty() {
        println!("\nDMA bandwidth (GB/s, median)");
        println!(
            "{:>10}  {:<16} {:>5}  {:>8}  {:>8}  note",
            "size", "memory", "node", "H2D", "D2H"
        );
        for x in bw {
            println!(
                "{:>10}  {:<16} {:>5}  {:>8}  {:>8}  {}",
                mib(x.bytes),
                x.memory,
                opt_u(x.node),
                opt_f(x.h2d_gbps, 2),
                opt_f(x.d2h_gbps, 2),
                x.note
            );
        }
    }
    let costs: Vec<&Row> = r
        .rows
        .iter()
        .filter(|x| x.test == "cold" || x.test == "reuse")
        .collect();
    if !costs.is_empty() {
        println!("\nAllocation cost (ms)");
        println!(
            "{:>10}  {:<6} {:<16} {:>5}  {:>10}  note",
            "size", "test", "memory", "node", "ms"
        );
        for x in costs {
            println!(
                "{:>10}  {:<6} {:<16} {:>5}  {:>10}  {}",
                mib(x.bytes),
                x.test,
                x.memory,
                opt_u(x.node),
                opt_f(x.ms, 3),
                x.note
            );
        }
    }
    let copies: Vec<&Row> = r.rows.iter().filter(|x| x.test == "host_copy").collect();
    if !copies.is_empty() {
        println!("\nHost copy bandwidth to the local node (GB/s, median)");
        println!("{:>10}  {:>9}  {:>8}  note", "size", "from node", "GB/s");
        for x in copies {
            println!(
                "{:>10}  {:>9}  {:>8}  {}",
                mib(x.bytes),
                opt_u(x.node),
                opt_f(x.copy_gbps, 2),
                x.note
            );
        }
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

fn print_csv(r: &Report) {
    println!("test,memory,node,bytes,h2d_gbps,d2h_gbps,copy_gbps,ms,note");
    for x in &r.rows {
        let f = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.4}"));
        println!(
            "{},{},{},{},{},{},{},{},{}",
            x.test,
            x.memory,
            x.node.map_or_else(String::new, |n| n.to_string()),
            x.bytes,
            f(x.h2d_gbps),
            f(x.d2h_gbps),
            f(x.copy_gbps),
            f(x.ms),
            csv_field(&x.note)
        );
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_num(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.4}"),
        _ => "null".to_owned(),
    }
}

fn json_usize(v: Option<usize>) -> String {
    v.map_or_else(|| "null".to_owned(), |v| v.to_string())
}

fn print_json(r: &Report) {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\"cuda\":{},\"cuda_note\":{},\"gpu\":{},\"local_node\":{},\"home_node\":{},\
         \"host_node\":{},\"far_node\":{},\"rows\":[",
        r.cuda,
        json_str(&r.cuda_note),
        r.gpu.as_deref().map_or_else(|| "null".to_owned(), json_str),
        json_usize(r.local_node),
        json_usize(r.home_node),
        json_usize(r.host_node),
        json_usize(r.far_node)
    );
    for (i, x) in r.rows.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(
            s,
            "{{\"test\":{},\"memory\":{},\"node\":{},\"bytes\":{},\"h2d_gbps\":{},\
             \"d2h_gbps\":{},\"copy_gbps\":{},\"ms\":{},\"note\":{}}}",
            json_str(x.test),
            json_str(x.memory),
            json_usize(x.node),
            x.bytes,
            json_num(x.h2d_gbps),
            json_num(x.d2h_gbps),
            json_num(x.copy_gbps),
            json_num(x.ms),
            json_str(&x.note)
        );
    }
    s.push_str("]}");
    println!("{s}");
}

fn main() -> Res<()> {
    let args = parse_args()?;
    let note = |line: &str| {
        if args.format == Format::Text {
            println!("{line}");
        } else {
            eprintln!("{line}");
        }
    };
    let topo = NumaTopology::from_sysfs().unwrap_or_else(|e| {
        note(&format!(
            "cannot read the NUMA topology ({e}); assuming one node"
        ));
        NumaTopology::single_node()
    });
    let local = numa_gpu_alloc::sys::current_node()
        .ok()
        .filter(|&n| topo.contains(n))
        .or_else(|| topo.node_ids().first().copied());
    if let Some(local) = local {
        pin_thread_to(&topo, local);
    }
    let cuda = numa_gpu_alloc::cuda_driver_present();
    let mut report = Report {
        cuda,
        cuda_note: String::new(),
        topology: describe_topology(&topo),
        local_node: local,
        host_node: None,
        home_node: None,
        far_node: None,
        gpu: None,
        rows: Vec::new(),
    };
    if cuda {
        if let Err(e) = gpu_part(&mut report, &args, &topo) {
            report.cuda_note = format!("GPU measurements stopped: {e}");
            note(&report.cuda_note);
        }
    } else {
        report.cuda_note =
            "no CUDA driver (libcuda not found or cuInit failed): measuring host-side \
                            costs only"
                .to_owned();
        note(&report.cuda_note);
        let node = local.unwrap_or(0);
        host_alloc_costs(&mut report, node, args.cold_size)?;
        for &size in &args.sizes {
            host_copies(&mut report, &topo, node, size, args.runs)?;
        }
    }
    match args.format {
        Format::Text => print_text(&report),
        Format::Csv => print_csv(&report),
        Format::Json => print_json(&report),
    }
    Ok(())
}
