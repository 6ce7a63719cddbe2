//! Criterion benchmarks of host↔device DMA and pinned-allocation cost: pageable memory,
//! `cuMemHostAlloc`, `numa-gpu-alloc` on the GPU's host node and on the farthest node.
//!
//! `cargo bench --bench dma`. Without a CUDA driver it prints why it skipped and exits 0 (1 when
//! `NUMA_GPU_ALLOC_REQUIRE_GPU=1`, as `scripts/gpu-check.sh` sets on a machine with a GPU). The
//! driver is called through the crate's own C-typed table (`numa_gpu_alloc::unstable::cuda_driver`).
//! `DMA_BENCH_SIZE` (default `256MiB`) sets the copy size.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Layout};
use criterion::{BenchmarkId, Criterion, Throughput};
use numa_gpu_alloc::unstable::cuda_driver::{Copier, Direction, Driver, HostAlloc, Registered};
use numa_gpu_alloc::{GpuSelector, MemPolicy, NumaGpuAlloc, NumaTopology, PinMode};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn size_from_env() -> usize {
    std::env::var("DMA_BENCH_SIZE")
        .ok()
        .and_then(|text| numa_gpu_alloc::unstable::parse_size(&text))
        .filter(|&n| n > 0)
        .unwrap_or(256 << 20)
}

/// A block from one of our allocators, freed on drop.
struct OurBlock<'a> {
    alloc: &'a NumaGpuAlloc,
    ptr: NonNull<u8>,
    layout: Layout,
}

impl<'a> OurBlock<'a> {
    fn new(alloc: &'a NumaGpuAlloc, len: usize) -> Res<Self> {
        let layout = Layout::from_size_align(len, 4096)?;
        let ptr = alloc
            .allocate(layout)
            .map_err(|_| "numa-gpu-alloc allocation failed")?
            .cast::<u8>();
        // SAFETY: `len` writable bytes at `ptr`, initialised here before any slice is made.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0x33, len) };
        Ok(OurBlock { alloc, ptr, layout })
    }

    fn slice(&mut self) -> &mut [u8] {
        // SAFETY: `layout.size()` initialised bytes owned by this block.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for OurBlock<'_> {
    fn drop(&mut self) {
        // SAFETY: from `alloc.allocate(layout)`, freed once.
        unsafe { self.alloc.deallocate(self.ptr, self.layout) };
    }
}

/// Host memory of one kind, freed on drop.
enum Host<'a> {
    Pageable(Vec<u8>),
    Pinned(HostAlloc<'a>),
    Ours(OurBlock<'a>),
    /// Registered here; the registration is declared first, so it ends before the block is
    /// freed.
    OursRegistered {
        _registration: Registered<'a>,
        block: OurBlock<'a>,
    },
}

impl Host<'_> {
    fn slice(&mut self) -> &mut [u8] {
        match self {
            Host::Pageable(v) => v,
            Host::Pinned(h) => h.as_mut_slice(),
            Host::Ours(block) | Host::OursRegistered { block, .. } => block.slice(),
        }
    }
}

/// Times `iters` copies with CUDA events.
fn timed_copies(copier: &Copier, host: &mut [u8], direction: Direction, iters: u64) -> Duration {
    let copies = usize::try_from(iters).unwrap_or(usize::MAX);
    match copier.time(host, direction, copies) {
        Ok(seconds) => Duration::from_secs_f64(seconds),
        Err(e) => panic!("copy failed: {e}"),
    }
}

fn bench(c: &mut Criterion) -> Res<()> {
    let size = size_from_env();
    let topo = NumaTopology::from_sysfs().unwrap_or_else(|_| NumaTopology::single_node());
    let ours = NumaGpuAlloc::new()
        .gpu(GpuSelector::Auto)
        .pin(PinMode::Strict)
        .cache_limit(size.saturating_mul(4));
    let placement = ours.placement();
    let ordinal = placement.gpu_ordinal.ok_or("numa-gpu-alloc found no GPU")?;
    let host_node = placement.host_node;
    let far = topo
        .farthest_node_from(host_node)
        .filter(|&n| n != host_node);
    // `bind`: measured only if every page really is on the far node.
    let far_alloc = far.map(|n| {
        NumaGpuAlloc::new()
            .node(n)
            .policy(MemPolicy::Bind)
            .pin(PinMode::Off)
    });
    println!(
        "dma bench: GPU {ordinal} {} (home node {:?}), host node {host_node}, farthest node {far:?}, \
         {} MiB copies",
        placement.gpu_name.as_deref().unwrap_or(""),
        placement.home_node,
        size >> 20
    );
    let driver = Driver::open(ordinal)?;
    let copier = driver.copier(size)?;

    let mut kinds: Vec<(String, Host)> = vec![
        ("pageable".into(), Host::Pageable(vec![0x11; size])),
        (
            "cuMemHostAlloc".into(),
            Host::Pinned(driver.host_alloc(size)?),
        ),
        (
            format!("ours-node{host_node}"),
            Host::Ours(OurBlock::new(&ours, size)?),
        ),
    ];
    if let (Some(n), Some(a)) = (far, far_alloc.as_ref()) {
        let mut block = OurBlock::new(a, size)?;
        let ptr = NonNull::new(block.slice().as_mut_ptr()).ok_or("null block")?;
        // SAFETY: the block is mapped and not registered (its allocator does not pin); the
        // variant ends the registration before it frees the block.
        let registered = unsafe { driver.register(ptr, size) }?;
        kinds.push((
            format!("ours-far-node{n}"),
            Host::OursRegistered {
                _registration: registered,
                block,
            },
        ));
    }
    for (dir, direction) in [("h2d", Direction::HtoD), ("d2h", Direction::DtoH)] {
        let mut g = c.benchmark_group(format!("dma_{dir}"));
        g.throughput(Throughput::Bytes(size as u64));
        g.sample_size(10);
        for (name, host) in &mut kinds {
            g.bench_function(BenchmarkId::from_parameter(&*name), |b| {
                b.iter_custom(|iters| timed_copies(&copier, host.slice(), direction, iters))
            });
        }
        g.finish();
    }
    drop(kinds);

    // Pinned allocation cost: a new block every time (cache off) vs cuMemHostAlloc, and reuse.
    let uncached = NumaGpuAlloc::new()
        .gpu(GpuSelector::Auto)
        .pin(PinMode::Strict)
        .cache_limit(0);
    let _ = uncached.placement();
    let layout = Layout::from_size_align(size, 4096)?;
    let mut g = c.benchmark_group("pinned_alloc");
    g.throughput(Throughput::Bytes(size as u64));
    g.sample_size(10);
    let time_alloc = |alloc: &NumaGpuAlloc, iters: u64| {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let start = Instant::now();
            let Ok(p) = alloc.allocate(layout) else {
                panic!("numa-gpu-alloc allocation failed");
            };
            total += start.elapsed();
            // SAFETY: from `allocate(layout)`, freed once.
            unsafe { alloc.deallocate(p.cast(), layout) };
        }
        total
    };
    g.bench_function("ours_cold", |b| {
        b.iter_custom(|iters| time_alloc(&uncached, iters))
    });
    g.bench_function("ours_cached_reuse", |b| {
        b.iter_custom(|iters| time_alloc(&ours, iters))
    });
    g.bench_function("cuMemHostAlloc", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let block = driver.host_alloc(size);
                total += start.elapsed();
                if let Err(e) = block {
                    panic!("{e}");
                }
            }
            total
        })
    });
    g.finish();
    Ok(())
}

fn main() {
    if let Some(why) = numa_gpu_alloc::cuda_unavailable_reason() {
        // On a machine with a GPU (scripts/gpu-check.sh sets this), not starting is a failure.
        if std::env::var_os("NUMA_GPU_ALLOC_REQUIRE_GPU").is_some_and(|v| v != "0") {
            eprintln!("dma bench failed: NUMA_GPU_ALLOC_REQUIRE_GPU is set but {why}");
            std::process::exit(1);
        }
        println!(
            "dma bench skipped: {why}; run `cargo run --release --example dma_bench` for the \
             host-side measurements"
        );
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    if let Err(e) = bench(&mut c) {
        // A driver is there, so this is a failure, not a reason to skip.
        eprintln!("dma bench failed: {e}");
        std::process::exit(1);
    }
    c.final_summary();
}
