//! A million live blocks: small blocks (8 KiB, aligned to 64 KiB, above a 4 KiB threshold) are
//! carved from a few chunks, so the process's mappings stay in the hundreds however many blocks
//! live (one mapping per block would stop at `vm.max_map_count`, 65,530 by default).

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::Allocator;
use numa_gpu_alloc::NumaGpuAlloc;

const BLOCKS: usize = 1_000_000;

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .lines()
        .count()
}

/// A million populate calls and 8 GiB resident take minutes in a debug build: CI runs it with
/// `cargo test --release --test integration many_blocks`.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "run in release: cargo test --release --test integration many_blocks"
)]
fn a_million_small_aligned_blocks_live_in_a_few_hundred_mappings() {
    let alloc = NumaGpuAlloc::new().threshold(4 << 10);
    let layout = Layout::from_size_align(8 << 10, 64 << 10).unwrap();
    let before = mappings();
    let mut blocks: Vec<NonNull<u8>> = Vec::with_capacity(BLOCKS);
    for i in 0..BLOCKS {
        let block = alloc
            .allocate(layout)
            .unwrap_or_else(|_| panic!("block {i} failed: {}", alloc.stats()))
            .cast::<u8>();
        assert_eq!(block.as_ptr() as usize % layout.align(), 0);
        // SAFETY: the block is ours and 8 KiB long.
        unsafe { block.as_ptr().add(i % 8192).write(i as u8) };
        blocks.push(block);
    }
    let during = mappings();
    let stats = alloc.stats();
    let chunks: usize = stats.nodes.iter().map(|n| n.chunks).sum();
    println!(
        "{BLOCKS} live blocks: {during} mappings ({before} before), {chunks} chunks, \
         {} failed allocations",
        stats.fallbacks.failed_allocations
    );
    assert_eq!(stats.fallbacks.failed_allocations, 0);
    assert!(
        during - before < 500,
        "{during} mappings for {BLOCKS} blocks"
    );
    for (i, block) in blocks.iter().enumerate() {
        // SAFETY: written above, still live.
        assert_eq!(unsafe { block.as_ptr().add(i % 8192).read() }, i as u8);
    }
    for block in blocks {
        // SAFETY: allocated above with this layout, freed once.
        unsafe { alloc.deallocate(block, layout) };
    }
    assert_eq!(alloc.stats().live_bytes(), 0);
    alloc.trim();
}
