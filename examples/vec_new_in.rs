//! A `NumaGpuAlloc` value passed to allocator-api2's `Vec::new_in` / `Box::new_in`: only the
//! collections that ask for it use the placed, pinned memory.
//!
//! Run: `cargo run --release --example vec_new_in`

#[path = "support/cli.rs"]
mod cli;

use allocator_api2::boxed::Box;
use allocator_api2::vec::Vec;
use numa_gpu_alloc::NumaGpuAlloc;

const USAGE: &str = "usage: vec_new_in
Fills allocator-api2 collections from a NumaGpuAlloc value and prints its stats (no arguments;
NUMA_GPU_ALLOC applies).";

fn main() {
    cli::positional(USAGE, 0);
    let staging = NumaGpuAlloc::new().verify(true);
    println!("placement: {:?}", staging.placement());

    let mut frames: Vec<f32, _> = Vec::new_in(&staging);
    frames.resize(16 << 20, 1.5); // 64 MiB of f32
    let sum: f64 = frames.iter().map(|&x| f64::from(x)).sum();

    let header = Box::new_in([0u8; 256], &staging); // small: system allocator
    for _ in 0..8 {
        // Reuse: the same 32 MiB block comes back from the arena, already placed and pinned.
        let mut scratch: Vec<u8, _> = Vec::with_capacity_in(32 << 20, &staging);
        scratch.resize(32 << 20, 7);
    }
    println!("sum {sum}, header {} bytes", header.len());
    drop(frames);
    println!("{}", staging.stats());
}
