//! `NumaGpuAlloc` as the process's `#[global_allocator]`, under several threads.
//!
//! One test on purpose: the counters it checks at the end belong to the whole process.

use numa_gpu_alloc::NumaGpuAlloc;

mod common {
    pub mod pattern;
    pub mod workload;
}

const CACHE_LIMIT: usize = 256 << 20;

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().cache_limit(CACHE_LIMIT);

#[test]
fn threads_mixed_sizes_reallocs_and_contention() {
    common::workload::run_and_check(&ALLOC, CACHE_LIMIT);
}
