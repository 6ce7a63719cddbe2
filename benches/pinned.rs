//! A pipelined loop of 64 host→device copies of 16 MiB, alternating two streams, from a ring of
//! four host buffers that the host refills before each copy: `PinnedBuf` vs cudarc's
//! `PinnedHostSlice` vs a pageable `Vec`.
//!
//! - On a GPU: criterion's GB/s (`cargo bench --bench pinned`). Target: `PinnedBuf` ≥ 0.97×
//!   `PinnedHostSlice`, ≥ 2× pageable.
//! - On the CUDA driver simulator (built by `cargo test --test pinned_sim`):
//!   `LD_LIBRARY_PATH=$PWD/target/tmp/cuda-sim cargo bench --bench pinned` prints the overlap on
//!   the simulator's clock: (copy time + host fill time) / span, where 1.0 means the host waited
//!   for every copy and 2.0 that refills hid entirely behind copies. Wall times mean nothing there.
//! - Without a driver it says so and exits 0.
//!
//! `PINNED_BENCH_SIZE` (bytes, default 16 MiB) sets the copy size.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError, HostSlice, PinnedHostSlice};
use numa_gpu_alloc::{NumaGpuAlloc, PinMode, PinnedBuf};

const COPIES: usize = 64;
const RING: usize = 4;
/// Host refill speed the simulator is told about (bytes per µs: 10 GB/s).
const FILL_BYTES_PER_US: f64 = 10_000.0;

static PINNING: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// A ring buffer the host refills: it writes one byte per 4 KiB page (after waiting for the
/// buffer's previous copy, where the type does).
trait Staging: HostSlice<u8> {
    fn refill(&mut self, value: u8) -> Result<(), DriverError>;
}

impl Staging for PinnedBuf<'_, u8> {
    fn refill(&mut self, value: u8) -> Result<(), DriverError> {
        let bytes = self
            .as_mut_slice()
            .map_err(|_| DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_UNKNOWN))?;
        bytes.iter_mut().step_by(4096).for_each(|b| *b = value);
        Ok(())
    }
}

impl Staging for PinnedHostSlice<u8> {
    fn refill(&mut self, value: u8) -> Result<(), DriverError> {
        self.as_mut_slice()?
            .iter_mut()
            .step_by(4096)
            .for_each(|b| *b = value);
        Ok(())
    }
}

impl Staging for Vec<u8> {
    fn refill(&mut self, value: u8) -> Result<(), DriverError> {
        self.iter_mut().step_by(4096).for_each(|b| *b = value);
        Ok(())
    }
}

/// The simulator's clock, when the loaded libcuda is the simulator.
struct SimClock {
    lib: libloading::Library,
}

#[repr(C)]
#[derive(Default)]
struct SimStats {
    busy_us: f64,
    span_us: f64,
    async_copies: u64,
    sync_copies: u64,
    registered_ranges: u64,
}

impl SimClock {
    fn find() -> Option<SimClock> {
        // SAFETY: cudarc loaded this library already; opening it again runs no initialiser.
        let lib = unsafe { libloading::Library::new("libcuda.so") }.ok()?;
        // SAFETY: only checks that the symbol exists.
        unsafe { lib.get::<unsafe extern "C" fn()>(b"cuSimStats") }.ok()?;
        Some(SimClock { lib })
    }

    fn call<F: Copy>(&self, name: &[u8]) -> F {
        // SAFETY: each caller names a simulator function with the prototype `F`.
        *unsafe { self.lib.get::<F>(name) }.expect("a simulator function")
    }

    fn reset(&self) {
        // SAFETY: `void cuSimResetClock(void)`.
        unsafe { self.call::<unsafe extern "C" fn()>(b"cuSimResetClock")() }
    }

    fn host_work(&self, us: f64) {
        // SAFETY: `void cuSimHostWork(double)`.
        unsafe { self.call::<unsafe extern "C" fn(f64)>(b"cuSimHostWork")(us) }
    }

    fn stats(&self) -> SimStats {
        let mut s = SimStats::default();
        // SAFETY: `void cuSimStats(struct sim_stats *)`, laid out as `SimStats`.
        unsafe { self.call::<unsafe extern "C" fn(*mut SimStats)>(b"cuSimStats")(&mut s) };
        s
    }
}

struct Rig {
    streams: [Arc<CudaStream>; 2],
    devs: Vec<CudaSlice<u8>>,
    len: usize,
}

impl Rig {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Res<Rig> {
        let streams = [ctx.new_stream()?, ctx.new_stream()?];
        let devs = (0..RING)
            .map(|k| streams[k % 2].alloc_zeros::<u8>(len))
            .collect::<Result<_, _>>()?;
        Ok(Rig { streams, devs, len })
    }

    /// The loop: refill ring buffer `i % RING`, copy it on stream `i % 2`; then wait for both.
    fn pipeline<B: Staging>(&mut self, ring: &mut [B], sim: Option<&SimClock>) -> Res<Duration> {
        let start = Instant::now();
        for i in 0..COPIES {
            let k = i % RING;
            ring[k].refill(i as u8)?;
            if let Some(sim) = sim {
                sim.host_work(self.len as f64 / FILL_BYTES_PER_US);
            }
            self.streams[i % 2].memcpy_htod(&ring[k], &mut self.devs[k])?;
        }
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(start.elapsed())
    }
}

fn size_from_env() -> usize {
    std::env::var("PINNED_BENCH_SIZE")
        .ok()
        .and_then(|v| numa_gpu_alloc::unstable::parse_size(&v))
        .unwrap_or(16 << 20)
}

fn rings(ctx: &Arc<CudaContext>, len: usize) -> Res<Rings> {
    let ours = (0..RING)
        .map(|_| PinnedBuf::zeroed(&PINNING, len))
        .collect::<Result<_, _>>()?;
    let cudarc = (0..RING)
        .map(|_| {
            // SAFETY: the contents are written (zeroed) right below, before any read.
            let mut slice = unsafe { ctx.alloc_pinned::<u8>(len) }?;
            slice.as_mut_slice()?.fill(0);
            Ok::<_, DriverError>(slice)
        })
        .collect::<Result<_, _>>()?;
    let pageable = (0..RING).map(|_| vec![0u8; len]).collect();
    Ok(Rings {
        ours,
        cudarc,
        pageable,
    })
}

struct Rings {
    ours: Vec<PinnedBuf<'static, u8>>,
    cudarc: Vec<PinnedHostSlice<u8>>,
    pageable: Vec<Vec<u8>>,
}

fn simulator_table(rig: &mut Rig, rings: &mut Rings, sim: &SimClock) -> Res<()> {
    println!("pinned pipeline on the CUDA driver simulator: {COPIES} x {} MiB host->device, 2 streams, ring of {RING}", rig.len >> 20);
    println!(
        "{:<26} {:>8} {:>8} {:>12}",
        "host memory", "overlap", "async", "sync copies"
    );
    let mut row = |name: &str, run: &mut dyn FnMut(&mut Rig) -> Res<Duration>| -> Res<()> {
        sim.reset();
        run(rig)?;
        let s = sim.stats();
        println!(
            "{name:<26} {:>8.2} {:>8} {:>12}",
            s.busy_us / s.span_us,
            s.async_copies,
            s.sync_copies
        );
        Ok(())
    };
    row("PinnedBuf (ours)", &mut |r| {
        r.pipeline(&mut rings.ours, Some(sim))
    })?;
    row("cudarc PinnedHostSlice", &mut |r| {
        r.pipeline(&mut rings.cudarc, Some(sim))
    })?;
    row("pageable Vec", &mut |r| {
        r.pipeline(&mut rings.pageable, Some(sim))
    })?;
    Ok(())
}

fn main() -> Res<()> {
    if !numa_gpu_alloc::cuda_driver_present() {
        println!("pinned bench: skipped: no CUDA driver (libcuda not found, or cuInit failed)");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let len = size_from_env();
    let mut rig = Rig::new(&ctx, len)?;
    let mut rings = rings(&ctx, len)?;
    if let Some(sim) = SimClock::find() {
        return simulator_table(&mut rig, &mut rings, &sim);
    }
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
        .configure_from_args();
    let mut group = c.benchmark_group("pinned_pipeline");
    group.throughput(Throughput::Bytes((COPIES * len) as u64));
    let mut bench = |name: &str, run: &mut dyn FnMut(&mut Rig) -> Res<Duration>| {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| run(&mut rig).expect("the pipeline runs"))
                    .sum()
            })
        });
    };
    bench("PinnedBuf", &mut |r| r.pipeline(&mut rings.ours, None));
    bench("PinnedHostSlice", &mut |r| {
        r.pipeline(&mut rings.cudarc, None)
    });
    bench("pageable_Vec", &mut |r| {
        r.pipeline(&mut rings.pageable, None)
    });
    group.finish();
    c.final_summary();
    Ok(())
}
