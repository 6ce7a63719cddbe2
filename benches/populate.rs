//! Populate scaling: faulting in a 4 GiB block with 1, 2, 4, 8 and 16 threads, two ways.
//!
//! - **pooled**: the allocator's way, a 4 GiB allocation with `populate_threads(n)`: the caller
//!   and the node's pooled workers (bound to the node's CPUs, started by the first run, reused
//!   by the next) take 8 MiB or larger pieces from one cursor.
//! - **spawned**: the way before the pool, `n` threads spawned for the block, unbound, each
//!   populating one `1/n` slice of the same advised 4 GiB mapping.
//!
//! After one discarded run of each, each figure is the median of 5 runs (`-- --quick`: 1), interleaved, alternating which goes first; each run maps fresh
//! memory, so every page is cleared by the kernel (the cost being measured). Prints a table
//! naming the machine and the date.

#[path = "common/machine.rs"]
mod machine;

use std::alloc::{GlobalAlloc, Layout};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use numa_gpu_alloc::unstable::sys;
use numa_gpu_alloc::NumaGpuAlloc;

const GIB: usize = 1 << 30;
const LEN: usize = 4 * GIB;
const THREADS: [usize; 5] = [1, 2, 4, 8, 16];

/// One allocator per thread count: a value's settings are its own.
static POOLED: [NumaGpuAlloc; 5] = [
    NumaGpuAlloc::new().populate_threads(1),
    NumaGpuAlloc::new().populate_threads(2),
    NumaGpuAlloc::new().populate_threads(4),
    NumaGpuAlloc::new().populate_threads(8),
    NumaGpuAlloc::new().populate_threads(16),
];

fn pooled(alloc: &NumaGpuAlloc) -> Duration {
    let layout = Layout::from_size_align(LEN, 4096).unwrap();
    let start = Instant::now();
    // SAFETY: a non-zero layout, freed below.
    let ptr = unsafe { alloc.alloc(layout) };
    let took = start.elapsed();
    assert!(!ptr.is_null(), "4 GiB could not be allocated");
    // SAFETY: allocated above with this layout.
    unsafe { alloc.dealloc(ptr, layout) };
    alloc.trim();
    took
}

fn spawned(threads: usize) -> Duration {
    let base = sys::map_anonymous(LEN, 2 << 20).expect("mmap 4 GiB");
    // SAFETY: a fresh mapping of ours.
    let _ = unsafe { sys::advise_hugepage(base, LEN) };
    let slice = LEN.div_ceil(threads).next_multiple_of(2 << 20);
    let addr = base.as_ptr() as usize;
    let start = Instant::now();
    std::thread::scope(|scope| {
        for offset in (0..LEN).step_by(slice) {
            scope.spawn(move || {
                let ptr = NonNull::new((addr + offset) as *mut u8).unwrap();
                // SAFETY: a slice of the fresh mapping, disjoint from the other threads'.
                unsafe { sys::populate(ptr, slice.min(LEN - offset)) }.expect("populate");
            });
        }
    });
    let took = start.elapsed();
    // SAFETY: the mapping made above, used by nobody now.
    unsafe { sys::unmap(base, LEN) }.expect("munmap");
    took
}

fn median(mut runs: Vec<Duration>) -> Duration {
    runs.sort();
    runs[runs.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let runs = if quick { 1 } else { 5 };
    // Discarded: the first runs after start pay for what the machine did before (page cache,
    // fragmentation), which would land on the 1-thread row.
    pooled(&POOLED[0]);
    spawned(1);
    let mut table = Vec::new();
    for (i, &threads) in THREADS.iter().enumerate() {
        let (mut pool, mut spawn) = (Vec::new(), Vec::new());
        for run in 0..runs {
            // Alternate which goes first: the machine's state drifts between runs.
            if run % 2 == 0 {
                pool.push(pooled(&POOLED[i]));
                spawn.push(spawned(threads));
            } else {
                spawn.push(spawned(threads));
                pool.push(pooled(&POOLED[i]));
            }
        }
        table.push((threads, median(pool), median(spawn)));
    }
    println!(
        "populate 4 GiB (huge pages), median of {runs}; {}; {}",
        machine::machine(),
        machine::utc_now()
    );
    println!(
        "| threads | pooled, bound | GiB/s | vs 1 thread | spawned per block | GiB/s | vs 1 thread |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let rate = |d: Duration| LEN as f64 / GIB as f64 / d.as_secs_f64();
    let (_, pool_one, spawn_one) = table[0];
    for (threads, pool, spawn) in table {
        println!(
            "| {threads} | {:.0} ms | {:.2} | {:.2}× | {:.0} ms | {:.2} | {:.2}× |",
            pool.as_secs_f64() * 1e3,
            rate(pool),
            pool_one.as_secs_f64() / pool.as_secs_f64(),
            spawn.as_secs_f64() * 1e3,
            rate(spawn),
            spawn_one.as_secs_f64() / spawn.as_secs_f64()
        );
    }
}
