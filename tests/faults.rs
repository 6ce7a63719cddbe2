//! Every placement step made to fail with `sys::fault`: each allocation either succeeds in its
//! documented degraded mode or fails cleanly (null / `AllocError`), nothing panics, the stats count
//! it by cause, and the accounting stays exact.
//!
//! Run with `cargo test --features fault-injection --test faults`. Injection is process-wide, so
//! every test holds `SERIAL` and clears the faults before and after.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::{Mutex, MutexGuard};

use allocator_api2::alloc::Allocator;
use numa_gpu_alloc::unstable::sys::fault::{self, FaultPoint};
use numa_gpu_alloc::{Error, MemPolicy, NumaGpuAlloc, PinMode, Stats};

const MIB: usize = 1 << 20;

static SERIAL: Mutex<()> = Mutex::new(());

/// Holds the lock and clears every fault on entry and exit (also when a test fails); on entry,
/// also empties the process's caches, which every allocator value shares, and starts the peaks
/// over.
struct Serial(#[allow(dead_code)] MutexGuard<'static, ()>);

impl Drop for Serial {
    fn drop(&mut self) {
        fault::clear();
    }
}

fn serial() -> Serial {
    let guard = SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    fault::clear();
    let alloc = local();
    let _ = alloc.placement();
    alloc.trim();
    alloc.reset_peaks();
    Serial(guard)
}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 8).unwrap()
}

/// An allocator on node 0 (every Linux machine has it), pinning off (the default), populating
/// every block when handed out: the faults are injected into that pipeline.
fn local() -> NumaGpuAlloc {
    NumaGpuAlloc::new().node(0).populate_eager(true)
}

/// Allocates `size` bytes, writes a pattern into every page, checks it, frees. Panics on failure.
fn round_trip(alloc: &NumaGpuAlloc, size: usize, seed: u8) {
    let l = layout(size);
    let p = alloc.allocate(l).expect("allocation succeeds").cast::<u8>();
    // SAFETY: the block is ours and `size` bytes long.
    let bytes = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), size) };
    for (i, b) in bytes.iter_mut().enumerate().step_by(4096) {
        *b = seed.wrapping_add((i / 4096) as u8);
    }
    bytes[size - 1] = seed ^ 0x5a;
    for (i, b) in bytes.iter().enumerate().step_by(4096) {
        assert_eq!(*b, seed.wrapping_add((i / 4096) as u8));
    }
    assert_eq!(bytes[size - 1], seed ^ 0x5a);
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(p, l) };
}

/// The invariants every test ends with: nothing live, hits + misses = large allocations.
fn assert_balanced(stats: &Stats) {
    assert_eq!(stats.live_bytes(), 0, "{stats}");
    assert!(stats.nodes.iter().all(|n| n.live_blocks == 0), "{stats}");
    assert_eq!(
        stats.cache_hits + stats.cache_misses,
        stats.large_allocations,
        "{stats}"
    );
    let fb = &stats.fallbacks;
    assert!(
        fb.bind_exhausted + fb.map_failures + fb.populate_failures <= fb.failed_allocations,
        "{stats}"
    );
}

#[test]
fn mmap_enomem_fails_cleanly_then_recovers() {
    let _serial = serial();
    let alloc = local();
    // The chunk, then one only as large as the request: nothing cached to give back.
    fault::inject(FaultPoint::Mmap, libc::ENOMEM, 2);
    assert!(alloc.allocate(layout(4 * MIB)).is_err());
    assert_eq!(fault::remaining(FaultPoint::Mmap), 0);
    let s = alloc.stats();
    assert_eq!(s.fallbacks.failed_allocations, 1);
    assert_eq!(s.fallbacks.map_failures, 1);
    assert_eq!(
        (s.large_allocations, s.cache_misses),
        (1, 1),
        "a failed request is a miss"
    );
    assert_eq!(s.released_blocks, 0, "nothing was mapped");

    // One failure: the smaller chunk fits.
    fault::inject(FaultPoint::Mmap, libc::ENOMEM, 1);
    round_trip(&alloc, 4 * MIB, 0);
    let mapped: usize = alloc.stats().nodes.iter().map(|n| n.mapped_bytes).sum();
    assert_eq!(mapped, 4 * MIB, "a chunk of the request's size");
    alloc.trim();

    // The GlobalAlloc front end answers null.
    fault::inject(FaultPoint::Mmap, libc::ENOMEM, 2);
    // SAFETY: non-zero size.
    let p = unsafe { GlobalAlloc::alloc(&alloc, layout(4 * MIB)) };
    assert!(p.is_null());
    // SAFETY: as above.
    let p = unsafe { GlobalAlloc::alloc_zeroed(&alloc, layout(4 * MIB)) };
    assert!(!p.is_null(), "the fault was consumed: the next one works");
    // SAFETY: allocated above with this layout.
    unsafe { GlobalAlloc::dealloc(&alloc, p, layout(4 * MIB)) };

    round_trip(&alloc, 4 * MIB, 1);
    let s = alloc.stats();
    assert_eq!(s.fallbacks.failed_allocations, 2);
    assert_eq!(s.fallbacks.map_failures, 2);
    assert_eq!(s.frees, 3);
    assert_balanced(&s);
}

/// Leaves a wholly free chunk of another kind (policy) on node 0, 16 MiB of it resident: idle
/// memory to give back.
fn idle_chunk_of_another_kind() {
    round_trip(&local().policy(MemPolicy::Interleave), 16 * MIB, 1);
}

fn mapped(s: &Stats) -> usize {
    s.nodes.iter().map(|n| n.mapped_bytes).sum()
}

#[test]
fn a_failed_mapping_gives_back_idle_chunks_and_retries() {
    let _serial = serial();
    let alloc = local();
    idle_chunk_of_another_kind();
    // The planned chunk, then one of the request's size fail: the idle chunk goes, a retry fits.
    fault::inject(FaultPoint::Mmap, libc::ENOMEM, 2);
    let p = alloc
        .allocate(layout(10 * MIB))
        .expect("retried after giving back");
    let s = alloc.stats();
    assert_eq!(
        (s.pressure_retries, s.pressure_released_blocks),
        (1, 1),
        "{s}"
    );
    assert_eq!(mapped(&s), 10 * MIB, "only the retried chunk: {s}");
    assert_eq!(
        (s.fallbacks.failed_allocations, s.fallbacks.map_failures),
        (0, 0)
    );
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(p.cast(), layout(10 * MIB)) };
    assert_balanced(&alloc.stats());
}

#[test]
fn a_failed_populate_gives_back_idle_memory_then_fails_cleanly() {
    let _serial = serial();
    let alloc = local();
    idle_chunk_of_another_kind();
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 1);
    let p = alloc.allocate(layout(10 * MIB)).expect("second attempt");
    let s = alloc.stats();
    assert_eq!(
        (s.pressure_retries, s.pressure_released_blocks),
        (1, 1),
        "{s}"
    );
    assert_eq!(s.fallbacks.populate_failures, 0, "the request did not fail");
    // SAFETY: allocated above with this layout.
    unsafe { alloc.deallocate(p.cast(), layout(10 * MIB)) };
    // With nothing resident left to give back, a failure is final and counted once.
    alloc.trim();
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 2);
    assert!(alloc.allocate(layout(40 * MIB)).is_err());
    let s = alloc.stats();
    assert_eq!(s.pressure_retries, 1, "nothing to give back: no retry");
    assert_eq!(
        (
            s.fallbacks.failed_allocations,
            s.fallbacks.populate_failures
        ),
        (1, 1)
    );
    assert_balanced(&s);
}

/// A 3 MiB block of `alloc` filled with `byte`, and its layout.
fn filled_3mib(alloc: &NumaGpuAlloc, byte: u8) -> (std::ptr::NonNull<u8>, Layout) {
    let old = layout(3 * MIB);
    let p = alloc.allocate(old).unwrap().cast::<u8>();
    // SAFETY: ours, 3 MiB long.
    unsafe { std::ptr::write_bytes(p.as_ptr(), byte, old.size()) };
    (p, old)
}

#[test]
fn a_growth_whose_tail_cannot_be_populated_moves_by_copying() {
    let _serial = serial();
    let alloc = local();
    let (p, old) = filled_3mib(&alloc, 0x5c);
    // The tail of the larger mapping fails to populate; the copy's fresh block then works.
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 1);
    let new = layout(12 * MIB);
    // SAFETY: p is live with `old`; new.size() >= old.size().
    let q = unsafe { alloc.grow(p, old, new) }
        .expect("moved by copying")
        .cast::<u8>();
    // SAFETY: the grown allocation is 12 MiB long, its head the old contents.
    let bytes = unsafe { std::slice::from_raw_parts(q.as_ptr(), old.size()) };
    assert!(bytes.iter().all(|&b| b == 0x5c));
    let s = alloc.stats();
    assert_eq!(
        (s.grown_without_copy, s.fallbacks.failed_allocations),
        (0, 0),
        "{s}"
    );
    // SAFETY: allocated above with `new`.
    unsafe { alloc.deallocate(q, new) };
    assert_balanced(&alloc.stats());
}

#[test]
fn mmap_failure_during_realloc_keeps_the_old_block() {
    let _serial = serial();
    let alloc = local();
    let (p, old) = filled_3mib(&alloc, 0xc3);
    // Carved right after it: no growth in place; 40 MiB is more than the first chunk has left.
    let (neighbour, _) = filled_3mib(&alloc, 0);
    // Every mapping fails: the growing block's own (a mapping of its own whatever its size).
    fault::inject(FaultPoint::Mmap, libc::ENOMEM, u32::MAX);
    let new = layout(40 * MIB);
    // SAFETY: p is live with `old`; new.size() >= old.size().
    let grown = unsafe { alloc.grow(p, old, new) };
    fault::clear();
    assert!(grown.is_err());
    // SAFETY: still ours and intact.
    let bytes = unsafe { std::slice::from_raw_parts(p.as_ptr(), old.size()) };
    assert!(bytes.iter().all(|&b| b == 0xc3));
    // SAFETY: as above.
    unsafe {
        alloc.deallocate(p, old);
        alloc.deallocate(neighbour, old);
    }
    let s = alloc.stats();
    assert_eq!(
        (s.fallbacks.map_failures, s.fallbacks.failed_allocations),
        (1, 1)
    );
    assert_balanced(&s);
}

fn mbind_refused(errno: i32) {
    let _serial = serial();
    let alloc = local().verify(true);
    fault::inject(FaultPoint::Mbind, errno, 1);
    round_trip(&alloc, 4 * MIB, 2);
    let s = alloc.stats();
    assert_eq!(
        s.numa_unavailable,
        Some(Error::NumaUnavailable {
            call: "mbind",
            errno
        })
    );
    assert_eq!(s.fallbacks.unplaced_blocks, 1);
    assert_eq!(s.fallbacks.failed_allocations, 0);
    assert_eq!(s.pages_checked, 0, "unplaced blocks are not checked");
    assert!(!alloc.placement().numa_placement);
    // Sticky: later chunks go unplaced without asking the kernel again (the fault is gone).
    alloc.trim();
    round_trip(&alloc, 8 * MIB, 3);
    let s = alloc.stats();
    assert_eq!(s.fallbacks.unplaced_blocks, 2);
    assert_eq!(s.frees, 2);
    assert_balanced(&s);
    let text = s.to_string();
    assert!(text.contains("NUMA unavailable: "), "{text}");
    assert!(text.contains("mbind"), "{text}");
}

#[test]
fn mbind_eperm_falls_back_to_unplaced_blocks() {
    mbind_refused(libc::EPERM);
}

#[test]
fn mbind_enosys_falls_back_to_unplaced_blocks() {
    mbind_refused(libc::ENOSYS);
}

#[test]
fn mbind_einval_leaves_best_effort_blocks_unplaced_and_fails_bind() {
    let _serial = serial();
    for policy in [MemPolicy::Preferred, MemPolicy::Bind, MemPolicy::Interleave] {
        let alloc = local().policy(policy);
        fault::inject(FaultPoint::Mbind, libc::EINVAL, 1);
        let served = alloc.allocate(layout(4 * MIB));
        let s = alloc.stats();
        assert_eq!(s.numa_unavailable, None, "EINVAL is not 'NUMA unavailable'");
        assert_eq!(s.fallbacks.placement_failures, 1, "counted by cause");
        if policy == MemPolicy::Bind {
            assert!(served.is_err(), "bind is strict");
            assert_eq!(s.fallbacks.failed_allocations, 1);
            assert_eq!(s.fallbacks.unplaced_blocks, 0);
            assert_eq!(s.released_blocks, 1, "the mapping was given back");
        } else {
            let block = served.expect("preferred/interleave are best effort");
            assert_eq!(s.fallbacks.failed_allocations, 0, "{policy:?}");
            assert_eq!(s.fallbacks.unplaced_blocks, 1, "{policy:?}");
            // SAFETY: allocated above with this layout.
            unsafe { alloc.deallocate(block.cast(), layout(4 * MIB)) };
        }
        assert!(
            alloc.placement().numa_placement,
            "later blocks are placed again"
        );
        round_trip(&alloc, 4 * MIB, 4);
        assert_balanced(&alloc.stats());
    }
}

#[test]
fn populate_enomem_fails_cleanly() {
    let _serial = serial();
    let alloc = local();
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 1);
    assert!(alloc.allocate_zeroed(layout(4 * MIB)).is_err());
    let s = alloc.stats();
    assert_eq!(s.fallbacks.populate_failures, 1);
    assert_eq!(s.fallbacks.failed_allocations, 1);
    assert_eq!(s.released_blocks, 0, "the chunk stays for the next request");
    round_trip(&alloc, 4 * MIB, 5);
    assert_balanced(&alloc.stats());
}

#[test]
fn populate_enomem_in_one_of_several_threads_fails_the_block() {
    let _serial = serial();
    // 64 MiB and more are populated by several threads; one failing chunk fails the block.
    let alloc = local().populate_threads(4);
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 1);
    assert!(alloc.allocate(layout(64 * MIB)).is_err());
    assert_eq!(fault::remaining(FaultPoint::Populate), 0);
    fault::inject(FaultPoint::Populate, libc::ENOMEM, u32::MAX);
    assert!(alloc.allocate(layout(96 * MIB)).is_err());
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 0);
    let s = alloc.stats();
    assert_eq!(s.fallbacks.populate_failures, 2, "{s}");
    assert_eq!(s.fallbacks.failed_allocations, 2);
    assert_eq!(
        s.released_blocks, 2,
        "each failed mapping of its own unmapped"
    );
    round_trip(&alloc, 64 * MIB, 6);
    assert_balanced(&alloc.stats());
}

#[test]
fn move_pages_eperm_with_verify_skips_the_check() {
    let _serial = serial();
    let alloc = local().verify(true);
    round_trip(&alloc, 4 * MIB, 7);
    let checked = alloc.stats().pages_checked;
    assert!(checked > 0, "verify=on checks pages when move_pages works");
    alloc.trim();
    fault::inject(FaultPoint::MovePages, libc::EPERM, u32::MAX);
    round_trip(&alloc, 4 * MIB, 8);
    let s = alloc.stats();
    assert_eq!(s.pages_checked, checked, "nothing more could be checked");
    assert_eq!(
        s.fallbacks.unverified_blocks, 1,
        "the skipped check is counted"
    );
    assert_eq!(s.fallbacks.failed_allocations, 0);
    assert_eq!(s.numa_unavailable, None, "placement itself still works");
    assert!(alloc.placement().numa_placement);
    assert_balanced(&s);
}

#[test]
fn move_pages_eperm_with_policy_bind() {
    let _serial = serial();
    let alloc = local().policy(MemPolicy::Bind);
    round_trip(&alloc, 4 * MIB, 9);
    assert!(alloc.stats().pages_checked > 0);
    alloc.trim();
    fault::inject(FaultPoint::MovePages, libc::EPERM, u32::MAX);
    // Docker with CAP_SYS_NICE: mbind works, move_pages is refused. The kernel checks instead
    // (mbind MPOL_BIND with MPOL_MF_STRICT); every page is on node 0, so the block is served.
    round_trip(&alloc, 4 * MIB, 10);
    let s = alloc.stats();
    assert_eq!(s.fallbacks.failed_allocations, 0, "{s}");
    assert_eq!(s.fallbacks.bind_exhausted, 0, "{s}");
    assert_eq!(s.fallbacks.unverified_blocks, 1, "{s}");
    assert_eq!(s.numa_unavailable, None);
    assert_balanced(&alloc.stats());
}

#[test]
fn move_pages_einval_with_verify_fails_cleanly() {
    let _serial = serial();
    let alloc = local().verify(true);
    fault::inject(FaultPoint::MovePages, libc::EINVAL, 1);
    assert!(alloc.allocate(layout(4 * MIB)).is_err());
    let s = alloc.stats();
    assert_eq!(s.fallbacks.failed_allocations, 1);
    assert_eq!(s.fallbacks.placement_failures, 1);
    assert_eq!(s.released_blocks, 0, "the chunk stays for the next request");
    round_trip(&alloc, 4 * MIB, 10);
    assert_balanced(&alloc.stats());
}

#[test]
fn pin_strict_without_a_gpu_fails_before_mapping() {
    let _serial = serial();
    // A node target has no GPU to register blocks with (registration failures under strict,
    // with a GPU, are tested against the driver simulator: `pinned_sim.rs`).
    let alloc = local().pin(PinMode::Strict);
    // Armed, so that reaching a step shows: none may run for a request that cannot be pinned.
    for point in [FaultPoint::Mmap, FaultPoint::Populate, FaultPoint::Register] {
        fault::inject(point, libc::ENOMEM, 1);
    }
    assert!(alloc.allocate(layout(4 * MIB)).is_err());
    // SAFETY: non-zero size.
    assert!(unsafe { GlobalAlloc::alloc(&alloc, layout(64 * MIB)) }.is_null());
    for point in [FaultPoint::Mmap, FaultPoint::Populate, FaultPoint::Register] {
        assert_eq!(fault::remaining(point), 1, "{point:?} was reached");
    }
    let s = alloc.stats();
    assert_eq!(s.fallbacks.failed_allocations, 2, "{s}");
    assert_eq!(s.fallbacks.strict_refused, 2, "{s}");
    assert_eq!(s.large_allocations, 0, "refused before the cache: {s}");
    assert_eq!((s.cache_misses, s.released_blocks), (0, 0), "{s}");
    assert_eq!(s.populate_time.total, std::time::Duration::ZERO, "{s}");
    assert_eq!(s.fallbacks.unpinned_blocks, 0, "{s}");
    let why = s.last_pin_error.as_ref().map(ToString::to_string);
    assert!(
        why.is_some_and(|w| w.contains("the target is a NUMA node")),
        "{s}"
    );
    assert!(
        matches!(&s.config_errors[..], [Error::StrictPinning { .. }]),
        "{s}"
    );
    assert_balanced(&s);
}

#[test]
fn registration_fault_is_ignored_with_pinning_off() {
    let _serial = serial();
    let alloc = local().pin(PinMode::Off);
    fault::inject(FaultPoint::Register, 2, 1);
    round_trip(&alloc, 4 * MIB, 13);
    assert_eq!(
        fault::remaining(FaultPoint::Register),
        1,
        "never registered"
    );
    let s = alloc.stats();
    assert_eq!(s.fallbacks.pin_failures, 0);
    assert_balanced(&s);
}

#[test]
fn cached_blocks_skip_the_failing_steps() {
    let _serial = serial();
    let alloc = local();
    round_trip(&alloc, 4 * MIB, 14);
    // A cached block is reused without mmap, mbind, populate or registration.
    for point in [
        FaultPoint::Mmap,
        FaultPoint::Mbind,
        FaultPoint::Populate,
        FaultPoint::MovePages,
        FaultPoint::Register,
    ] {
        fault::inject(point, libc::ENOMEM, u32::MAX);
    }
    round_trip(&alloc, 4 * MIB, 15);
    let s = alloc.stats();
    assert_eq!((s.cache_hits, s.cache_misses), (1, 1));
    assert_eq!(s.fallbacks.failed_allocations, 0);
    // A size the cache cannot serve now fails, cleanly.
    assert!(alloc.allocate(layout(32 * MIB)).is_err());
    assert_balanced(&alloc.stats());
}

#[test]
fn every_fault_in_turn_under_load_keeps_exact_accounting() {
    let _serial = serial();
    let alloc = local().verify(true).cache_limit(16 * MIB).pin(PinMode::On);
    let faults = [
        (FaultPoint::Mmap, libc::ENOMEM),
        (FaultPoint::Mbind, libc::EINVAL),
        (FaultPoint::Populate, libc::ENOMEM),
        (FaultPoint::MovePages, libc::EINVAL),
        (FaultPoint::MovePages, libc::EPERM),
        (FaultPoint::Register, 2),
        (FaultPoint::Mbind, libc::EPERM), // last: placement stays off afterwards
    ];
    let mut held = Vec::new();
    let (mut ok, mut failed) = (0u64, 0u64);
    for (round, &(point, errno)) in faults.iter().enumerate() {
        fault::inject(point, errno, 1);
        for i in 0..6 {
            let size = (2 + (round + i) % 7) * MIB + i * 4096;
            match alloc.allocate(layout(size)) {
                Ok(p) => {
                    ok += 1;
                    held.push((p.cast::<u8>(), size));
                }
                Err(_) => failed += 1,
            }
        }
        // Free every other block: the cache fills, evicts and serves later rounds.
        let mut keep = Vec::new();
        for (i, (p, size)) in held.drain(..).enumerate() {
            if i % 2 == 0 {
                // SAFETY: allocated above with this layout.
                unsafe { alloc.deallocate(p, layout(size)) };
            } else {
                keep.push((p, size));
            }
        }
        held = keep;
    }
    let s = alloc.stats();
    assert_eq!(s.large_allocations, ok + failed, "{s}");
    assert_eq!(s.fallbacks.failed_allocations, failed, "{s}");
    let live: usize = s.nodes.iter().map(|n| n.live_blocks).sum();
    assert_eq!(live, held.len(), "{s}");
    for (p, size) in held.drain(..) {
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(p, layout(size)) };
    }
    let s = alloc.stats();
    assert_eq!(s.frees, ok);
    assert_balanced(&s);
    alloc.trim();
    let s = alloc.stats();
    assert_eq!(s.cached_bytes(), 0);
    // The last fault meets the next chunk's mbind, if the rounds made none after it.
    round_trip(&alloc, 4 * MIB, 16);
    assert!(alloc.stats().numa_unavailable.is_some());
}

#[test]
fn failing_purges_are_tried_once_and_give_nothing_back() {
    let _serial = serial();
    let alloc = local().threshold(64 << 10);
    let small = layout(256 << 10);
    let blocks: Vec<_> = (0..41)
        .map(|_| alloc.allocate(small).unwrap().cast::<u8>())
        .collect();
    // 20 free ranges between live blocks: more than one round of purges.
    let mut kept = Vec::new();
    for (i, p) in blocks.into_iter().enumerate() {
        // SAFETY: ours, 256 KiB.
        unsafe { std::ptr::write_bytes(p.as_ptr(), 7, small.size()) };
        if i % 2 == 0 {
            kept.push(p);
        } else {
            // SAFETY: allocated above with this layout.
            unsafe { alloc.deallocate(p, small) };
        }
    }
    // Purges fail as on locked memory. A populate short of memory tries each range once,
    // finds it gave nothing back, and fails cleanly without a retry.
    fault::inject(FaultPoint::Purge, libc::EINVAL, 1000);
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 1);
    assert!(alloc.allocate(layout(MIB)).is_err());
    let s = alloc.stats();
    assert_eq!(s.pressure_retries, 0, "{s}");
    assert_eq!(s.fallbacks.populate_failures, 1, "{s}");
    assert_eq!(s.fallbacks.purge_failures, 20, "{s}");
    assert_eq!(1000 - fault::remaining(FaultPoint::Purge), 20);
    // trim() finishes, tries none of them again, only the range the failed block left (the
    // populate may have faulted some of it in), once.
    alloc.trim();
    assert_eq!(1000 - fault::remaining(FaultPoint::Purge), 21);
    alloc.trim();
    assert_eq!(1000 - fault::remaining(FaultPoint::Purge), 21);
    // Whole chunks still go back: unmapping needs no purge.
    for p in kept {
        // SAFETY: allocated above with this layout.
        unsafe { alloc.deallocate(p, small) };
    }
    alloc.trim();
    let s = alloc.stats();
    assert_eq!(s.cached_bytes(), 0, "{s}");
    assert_balanced(&s);
}
