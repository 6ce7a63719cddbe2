//! Criterion benchmarks of host↔device DMA and pinned-allocation cost: pageable memory,
//! `cuMemHostAlloc`, `numa-gpu-alloc` on the GPU's host node and on the farthest node.
//!
//! `cargo bench --bench dma`. Without a CUDA driver it prints why it skipped and exits 0.
//! `DMA_BENCH_SIZE` (default `256MiB`) sets the copy size.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allocator_api2::alloc::{Allocator, Layout};
use criterion::{BenchmarkId, Criterion, Throughput};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use numa_gpu_alloc::{GpuSelector, MemPolicy, NumaGpuAlloc, NumaTopology, PinMode};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn size_from_env() -> usize {
    let text = std::env::var("DMA_BENCH_SIZE").unwrap_or_default();
    let text = text.trim().to_ascii_lowercase();
    let (digits, shift) = if let Some(d) = text.strip_suffix("gib") {
        (d, 30)
    } else if let Some(d) = text.strip_suffix("mib") {
        (d, 20)
    } else {
        (text.as_str(), 0)
    };
    match digits.trim().parse::<usize>() {
        Ok(n) if n > 0 => n << shift,
        _ => 256 << 20,
    }
}

/// Host memory of one kind, freed on drop.
enum Host<'a> {
    Pageable(Vec<u8>),
    Pinned(NonNull<u8>, usize),
    Ours(&'a NumaGpuAlloc, NonNull<u8>, Layout, Option<NonNull<u8>>),
}

impl<'a> Host<'a> {
    fn pageable(len: usize) -> Host<'a> {
        Host::Pageable(vec![0x11; len])
    }

    /// Needs a current context.
    fn cuda_host(len: usize) -> Res<Host<'a>> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the driver is present (checked in main) and a context is current.
        let res = unsafe { sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE) };
        if res != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostAlloc failed: {res:?}").into());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or("cuMemHostAlloc returned null")?;
        // SAFETY: `len` writable bytes at `ptr`.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0x22, len) };
        Ok(Host::Pinned(ptr, len))
    }

    /// From `alloc`; registered here with `cuMemHostRegister` when `register` (for allocators
    /// that do not pin themselves).
    fn ours(alloc: &'a NumaGpuAlloc, len: usize, register: bool) -> Res<Host<'a>> {
        let layout = Layout::from_size_align(len, 4096)?;
        let ptr = alloc
            .allocate(layout)
            .map_err(|_| "numa-gpu-alloc allocation failed")?
            .cast::<u8>();
        // SAFETY: `len` writable bytes at `ptr`.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0x33, len) };
        let mut host = Host::Ours(alloc, ptr, layout, None);
        if register {
            // SAFETY: the block is live, owned here, and not registered yet; a context is
            // current.
            let res = unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.as_ptr().cast(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            if res != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuMemHostRegister_v2 failed: {res:?}").into());
            }
            if let Host::Ours(.., registered) = &mut host {
                *registered = Some(ptr);
            }
        }
        Ok(host)
    }

    fn slice(&mut self) -> &mut [u8] {
        match self {
            Host::Pageable(v) => v,
            // SAFETY: `len` initialised bytes owned by this value.
            Host::Pinned(p, len) => unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), *len) },
            // SAFETY: `layout.size()` initialised bytes owned by this value.
            Host::Ours(_, p, layout, _) => unsafe {
                std::slice::from_raw_parts_mut(p.as_ptr(), layout.size())
            },
        }
    }
}

impl Drop for Host<'_> {
    fn drop(&mut self) {
        match self {
            Host::Pageable(_) => {}
            // SAFETY: from cuMemHostAlloc, freed once.
            Host::Pinned(p, _) => unsafe {
                let _ = sys::cuMemFreeHost(p.as_ptr().cast());
            },
            Host::Ours(alloc, p, layout, registered) => {
                if let Some(r) = registered.take() {
                    // SAFETY: registered in `ours` with this base pointer; still mapped.
                    let _ = unsafe { sys::cuMemHostUnregister(r.as_ptr().cast()) };
                }
                // SAFETY: from `alloc.allocate(layout)`, freed once.
                unsafe { alloc.deallocate(*p, *layout) };
            }
        }
    }
}

/// Times `iters` copies with CUDA events.
fn timed_copies(
    stream: &Arc<CudaStream>,
    host: &mut [u8],
    dev: &mut CudaSlice<u8>,
    to_device: bool,
    iters: u64,
) -> Duration {
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut run = || -> Res<Duration> {
        let start = stream.record_event(timing)?;
        for _ in 0..iters {
            if to_device {
                stream.memcpy_htod(&*host, dev)?;
            } else {
                stream.memcpy_dtoh(&*dev, &mut *host)?;
            }
        }
        let end = stream.record_event(timing)?;
        Ok(Duration::from_secs_f64(
            f64::from(start.elapsed_ms(&end)?) / 1e3,
        ))
    };
    match run() {
        Ok(d) => d,
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
    let ctx = CudaContext::new(ordinal as usize)?;
    let stream = ctx.default_stream();
    let mut dev = stream.alloc_zeros::<u8>(size)?;

    let mut kinds: Vec<(String, Host)> = Vec::new();
    kinds.push(("pageable".into(), Host::pageable(size)));
    ctx.bind_to_thread()?;
    kinds.push(("cuMemHostAlloc".into(), Host::cuda_host(size)?));
    kinds.push((
        format!("ours-node{host_node}"),
        Host::ours(&ours, size, false)?,
    ));
    if let (Some(n), Some(a)) = (far, far_alloc.as_ref()) {
        ctx.bind_to_thread()?;
        kinds.push((format!("ours-far-node{n}"), Host::ours(a, size, true)?));
    }
    for (dir, to_device) in [("h2d", true), ("d2h", false)] {
        let mut g = c.benchmark_group(format!("dma_{dir}"));
        g.throughput(Throughput::Bytes(size as u64));
        g.sample_size(10);
        for (name, host) in &mut kinds {
            g.bench_function(BenchmarkId::from_parameter(&*name), |b| {
                b.iter_custom(|iters| {
                    timed_copies(&stream, host.slice(), &mut dev, to_device, iters)
                })
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
                if let Err(e) = ctx.bind_to_thread() {
                    panic!("bind: {e:?}");
                }
                let mut p: *mut c_void = std::ptr::null_mut();
                let start = Instant::now();
                // SAFETY: driver present, context current, valid out-pointer.
                let res =
                    unsafe { sys::cuMemHostAlloc(&mut p, size, sys::CU_MEMHOSTALLOC_PORTABLE) };
                total += start.elapsed();
                assert_eq!(res, sys::CUresult::CUDA_SUCCESS, "cuMemHostAlloc");
                // SAFETY: from cuMemHostAlloc, freed once.
                let _ = unsafe { sys::cuMemFreeHost(p) };
            }
            total
        })
    });
    g.finish();
    Ok(())
}

fn main() {
    if !numa_gpu_alloc::cuda_driver_present() {
        println!(
            "dma bench skipped: no CUDA driver (libcuda not found, or cuInit failed); \
             run `cargo run --release --example dma_bench` for the host-side measurements"
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
