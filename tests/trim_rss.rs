//! After `trim()`, the process's resident memory is back to where it was before the large
//! allocations. Its own test binary (one test), so that nothing else moves the RSS meanwhile.

use std::alloc::Layout;

use allocator_api2::alloc::Allocator;
use numa_gpu_alloc::NumaGpuAlloc;

const MIB: usize = 1 << 20;

/// Resident bytes, from the second field of `/proc/self/statm` (in pages).
fn resident() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * numa_gpu_alloc::unstable::sys::page_size()
}

#[test]
fn trim_returns_resident_memory() {
    let alloc = NumaGpuAlloc::new().cache_limit(1 << 30).populate_threads(2);
    let sizes = [
        4 * MIB,
        6 * MIB + 4096,
        16 * MIB,
        32 * MIB,
        72 * MIB,
        128 * MIB,
    ];
    let total: usize = sizes.iter().sum();
    let mut blocks = Vec::with_capacity(sizes.len());
    // Warm up what the first large allocation sets up (topology, thread spawn) so it is not
    // counted in the baseline.
    let warm = Layout::from_size_align(2 * MIB, 4096).unwrap();
    let p = alloc.allocate(warm).unwrap();
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(p.cast(), warm) };
    alloc.trim();

    let before = resident();
    for (i, &size) in sizes.iter().enumerate() {
        let layout = Layout::from_size_align(size, 4096).unwrap();
        let p = alloc.allocate(layout).unwrap().cast::<u8>();
        // SAFETY: ours, `size` bytes.
        unsafe { std::ptr::write_bytes(p.as_ptr(), i as u8 + 1, size) };
        blocks.push((p, layout));
    }
    let full = resident();
    assert!(
        full >= before + total * 9 / 10,
        "blocks are populated: {} MiB -> {} MiB for {} MiB",
        before / MIB,
        full / MIB,
        total / MIB
    );
    for (p, layout) in blocks.drain(..) {
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(p, layout) };
    }
    let cached = resident();
    assert!(
        alloc.stats().cached_bytes() >= total,
        "every block is cached"
    );
    assert!(
        cached >= before + total * 9 / 10,
        "freed blocks stay cached and resident: {} MiB",
        cached / MIB
    );
    alloc.trim();
    let after = resident();
    let s = alloc.stats();
    assert_eq!(s.cached_bytes(), 0);
    assert_eq!(s.live_bytes(), 0);
    eprintln!(
        "resident: before {} KiB, allocated {} KiB, cached {} KiB, trimmed {} KiB",
        before >> 10,
        full >> 10,
        cached >> 10,
        after >> 10
    );
    assert!(
        after <= before + 4 * MIB,
        "after trim() {} KiB resident, before the allocations {} KiB",
        after >> 10,
        before >> 10
    );
}
