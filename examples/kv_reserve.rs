//! A KV-cache offload pool: reserve page-locked host memory in the background while the GPU keeps
//! working, and watch what it costs the work.
//!
//! Run: `cargo run --release --example kv_reserve -- 64` (GiB; default 8).
//!
//! The reservation is made in chunks of at most `register_max` (256 MiB by default; set
//! `NUMA_GPU_ALLOC=register_max=1GiB` to compare), each registered with one driver call, on
//! a thread of its own; a progress line is printed every quarter second. Meanwhile small
//! host-to-device copies run on a stream of their own, as a serving engine's would: their
//! latency during the reservation against idle is the stall the reservation causes. Without a
//! CUDA driver the reservation is made unpinned and no copy is timed.

#[path = "support/cli.rs"]
mod cli;

use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use numa_gpu_alloc::{cuda_driver_present, NumaGpuAlloc, PinMode};

const USAGE: &str = "usage: kv_reserve [GIB]
  GIB  page-locked host memory to reserve in the background, in GiB (default 8)
Times small host-to-device copies while the reservation is made and prints its progress.";

const GIB: usize = 1 << 30;
/// Bytes of each timed copy.
const COPY: usize = 64 << 10;

static POOL: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);

/// A stream of its own, a device buffer and a pageable source for the timed copies.
struct Copier {
    stream: std::sync::Arc<CudaStream>,
    source: Vec<u8>,
    device: CudaSlice<u8>,
}

impl Copier {
    fn new() -> Option<Copier> {
        if !cuda_driver_present() {
            return None;
        }
        let stream = CudaContext::new(0).ok()?.new_stream().ok()?;
        let device = stream.alloc_zeros::<u8>(COPY).ok()?;
        Some(Copier {
            stream,
            source: vec![7; COPY],
            device,
        })
    }

    /// One copy, waited for.
    fn time(&mut self) -> Result<Duration, String> {
        let start = Instant::now();
        self.stream
            .memcpy_htod(&self.source, &mut self.device)
            .map_err(|e| format!("a timed copy (memcpy_htod) failed: {e}"))?;
        self.stream
            .synchronize()
            .map_err(|e| format!("waiting for a timed copy failed: {e}"))?;
        Ok(start.elapsed())
    }
}

/// Median and maximum, in milliseconds.
fn summary(mut times: Vec<Duration>) -> String {
    if times.is_empty() {
        return "none".into();
    }
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!(
        "median {:.3} ms, max {:.3} ms ({} copies)",
        ms(times[times.len() / 2]),
        ms(times[times.len() - 1]),
        times.len()
    )
}

fn main() {
    let gib = match cli::positional(USAGE, 1).pop() {
        None => 8,
        Some(arg) => match arg.to_str().and_then(|a| a.parse::<usize>().ok()) {
            Some(gib) if gib > 0 => gib,
            _ => cli::usage_error(
                format_args!("bad size {arg:?}: expected GiB, e.g. 64"),
                USAGE,
            ),
        },
    };
    cli::exit_on_error(run(gib));
}

fn run(gib: usize) -> Result<(), String> {
    let bytes = gib
        .checked_mul(GIB)
        .ok_or_else(|| format!("{gib} GiB does not fit in usize"))?;
    let mut copier = Copier::new();
    let idle: Vec<Duration> = match &mut copier {
        Some(c) => (0..200).map(|_| c.time()).collect::<Result<_, _>>()?,
        None => {
            println!("no CUDA driver: the reservation is made unpinned, no copy is timed");
            Vec::new()
        }
    };
    let reservation = POOL
        .reserve_in_background(bytes)
        .map_err(|e| format!("cannot reserve {gib} GiB: {e}"))?;
    let mut during = Vec::new();
    let mut next_line = Instant::now();
    while !reservation.is_finished() {
        match &mut copier {
            Some(c) => during.push(c.time()?),
            None => std::thread::sleep(Duration::from_millis(5)),
        }
        if Instant::now() >= next_line {
            println!("{}", reservation.progress());
            next_line += Duration::from_millis(250);
        }
    }
    match reservation.wait() {
        Ok(done) => println!("{done}"),
        Err(e) => println!("stopped early: {e}"),
    }
    println!("small copy, idle:   {}", summary(idle));
    println!("small copy, during: {}", summary(during));
    println!("{}", POOL.stats());
    Ok(())
}
