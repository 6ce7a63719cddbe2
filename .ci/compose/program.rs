//! A user's program: numa-gpu-alloc as the global allocator next to the program's own cudarc
//! dependency, whose features differ per member (see each member's Cargo.toml). Without a GPU it
//! takes the CPU-only path: a large block placed and cached; with one it also round-trips data
//! through cudarc's safe API.

use numa_gpu_alloc::NumaGpuAlloc;

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();

fn main() {
    let batch = vec![7u8; 8 << 20];
    let checksum: u64 = batch.iter().step_by(4096).map(|&b| u64::from(b)).sum();
    drop(batch);
    let stats = ALLOC.stats();
    assert!(stats.large_allocations >= 1 && stats.frees >= 1, "{stats}");
    assert!(stats.cached_bytes() >= 8 << 20, "{stats}");

    let path = if numa_gpu_alloc::cuda_driver_present() {
        let stream = cudarc::driver::CudaContext::new(0)
            .expect("a CUDA context on device 0")
            .default_stream();
        let on_gpu = stream.clone_htod(&[1u32, 2, 3]).expect("copy to the GPU");
        let back = stream.clone_dtoh(&on_gpu).expect("copy back");
        assert_eq!(back, [1, 2, 3]);
        "GPU round trip through cudarc"
    } else {
        "no CUDA driver: CPU-only path"
    };
    println!(
        "{}: large allocations {}, cached {} MiB, checksum {checksum}, {path}",
        env!("CARGO_PKG_NAME"),
        stats.large_allocations,
        stats.cached_bytes() >> 20
    );
}
