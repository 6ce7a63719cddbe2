//! `NumaGpuAlloc` as the global allocator: every large `Vec` lands on the GPU's host node (or,
//! without a GPU, the node of the first thread that allocates large), here with pinning turned
//! on, so that it is page-locked too when CUDA is there.
//!
//! Pinning is opt-in because it makes CUDA copies asynchronous: a program that copies these
//! `Vec`s with cudarc must call `ALLOC.record_stream(v.as_ptr(), &stream)` after queueing a copy
//! and synchronise the stream before reading a download — or copy through `PinnedBuf`, which
//! does both. Without pinning (`NumaGpuAlloc::new()`), copies stay synchronous.
//!
//! Run: `cargo run --release --example global_allocator`
//! Try: `NUMA_GPU_ALLOC=threshold=4MiB,verify=on,stats=exit cargo run --release --example global_allocator`

#[path = "support/cli.rs"]
mod cli;

use numa_gpu_alloc::{NumaGpuAlloc, PinMode};

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);

const USAGE: &str = "usage: global_allocator
Runs a loader-style loop with NumaGpuAlloc as the global allocator (pinning on) and prints its
stats (no arguments; NUMA_GPU_ALLOC applies, e.g. NUMA_GPU_ALLOC=stats=exit).";

fn main() {
    cli::positional(USAGE, 0);
    let placement = ALLOC.placement();
    println!("placement: {placement:?}");
    if let Some(why) = &placement.pinning_off {
        println!("not page-locked: {why}");
    }

    // A loader-style loop: batches of 64 MiB, refilled and dropped each step.
    let mut checksum = 0u64;
    for step in 0..16u8 {
        let mut batch = vec![0u8; 64 << 20];
        batch.iter_mut().step_by(4096).for_each(|b| *b = step);
        checksum += batch
            .iter()
            .step_by(4096)
            .map(|&b| u64::from(b))
            .sum::<u64>();
    }
    // Growth through the threshold, and small allocations that never touch the arena.
    let mut grown = Vec::new();
    for i in 0..(8u32 << 20) {
        grown.push(i);
    }
    let small: Vec<String> = (0..10_000).map(|i| i.to_string()).collect();
    println!(
        "checksum {checksum}, grown {} MiB, {} small strings",
        (grown.len() * 4) >> 20,
        small.len()
    );
    drop(grown);
    println!("{}", ALLOC.stats());
}
