//! GPU tests: blocks from `NumaGpuAlloc` are registered with CUDA, a pattern goes to the device
//! and back, blocks are unregistered, and the stats agree.
//!
//! The tests that need a GPU are `#[ignore]`d, so that `cargo test` on a machine without one
//! reports them as ignored rather than passed; `cargo test --test gpu -- --include-ignored` runs
//! them (as `scripts/gpu-check.sh` does where `nvidia-smi` sees a GPU), and then a missing driver
//! or device is a failure that says why.

use std::sync::Arc;

use allocator_api2::vec::Vec as AVec;
use cudarc::driver::{CudaContext, CudaStream};
use numa_gpu_alloc::{GpuSelector, NumaGpuAlloc, PinMode};

const MIB: usize = 1 << 20;

/// One test at a time: the node arenas are the process's, so one test's `trim()` releases (and
/// counts) the blocks another is looking at.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CUDA context and stream to copy with. Panics with the reason when there is no usable GPU:
/// the tests that call it run only when asked for (`--include-ignored`).
fn gpu(test: &str) -> (Arc<CudaContext>, Arc<CudaStream>) {
    if let Some(why) = numa_gpu_alloc::cuda_unavailable_reason() {
        panic!("{test} needs a CUDA GPU: {why}");
    }
    let placement = NumaGpuAlloc::new().gpu(GpuSelector::Auto).placement();
    let ordinal = placement.gpu_ordinal.unwrap_or(0) as usize;
    let ctx = CudaContext::new(ordinal)
        .unwrap_or_else(|e| panic!("{test}: cannot create a CUDA context on GPU {ordinal}: {e}"));
    let stream = ctx.default_stream();
    (ctx, stream)
}

fn pattern(len: usize, seed: u8) -> impl Iterator<Item = u8> {
    (0..len).map(move |i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
}

/// Copies `src` to the device and back into `dst`.
fn round_trip(stream: &Arc<CudaStream>, src: &[u8], dst: &mut [u8]) {
    let mut dev = stream
        .alloc_zeros::<u8>(src.len())
        .expect("device allocation");
    stream
        .memcpy_htod(src, &mut dev)
        .expect("host to device copy");
    stream.memcpy_dtoh(&dev, dst).expect("device to host copy");
    stream.synchronize().expect("synchronize");
}

/// An empty `Vec` in `alloc` with room for `len` bytes. A failed allocation fails the test with
/// the allocator's stats (the registration's CUDA error among them); `with_capacity_in` would
/// call `handle_alloc_error` and abort the whole binary without a word.
fn pinned_vec(alloc: &NumaGpuAlloc, len: usize) -> AVec<u8, &NumaGpuAlloc> {
    let mut v = AVec::new_in(alloc);
    if let Err(e) = v.try_reserve_exact(len) {
        panic!("allocating {len} bytes failed: {e:?}\n{}", alloc.stats());
    }
    v
}

/// A pinning allocator, with the process's node arenas emptied first, so that the test's
/// counts are its own (an earlier test's cached blocks would serve its requests).
fn strict_alloc() -> NumaGpuAlloc {
    let alloc = NumaGpuAlloc::new()
        .gpu(GpuSelector::Auto)
        .pin(PinMode::Strict);
    alloc.placement();
    alloc.trim();
    alloc
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --test gpu -- --include-ignored"]
fn register_copy_and_unregister() {
    let _serial = serial();
    let (_ctx, stream) = gpu("register_copy_and_unregister");
    let alloc = strict_alloc();
    let placement = alloc.placement();
    // What emptying the arenas released (an earlier test's blocks) is not this test's.
    let released_before = alloc.stats().unregistrations;
    assert!(
        placement.pinning,
        "pinning is off: {placement:?}\n{}",
        alloc.stats()
    );
    let len = 64 * MIB;
    {
        let mut src = pinned_vec(&alloc, len);
        src.extend(pattern(len, 7));
        let mut dst = pinned_vec(&alloc, len);
        dst.resize(len, 0);
        round_trip(&stream, &src, &mut dst);
        assert!(src[..] == dst[..], "bytes differ after the round trip");

        let stats = alloc.stats();
        assert!(stats.pinning);
        assert_eq!(stats.registrations, 2, "{stats}");
        assert_eq!(stats.fallbacks.pin_failures, 0, "{stats}");
        assert!(stats.pinned_bytes() >= 2 * len, "{stats}");
        assert!(stats.live_bytes() >= 2 * len, "{stats}");
        assert_eq!(stats.host_node, Some(placement.host_node));
    }
    alloc.trim();
    let stats = alloc.stats();
    assert_eq!(
        stats.unregistrations - released_before,
        stats.registrations,
        "{stats}"
    );
    assert_eq!(stats.pinned_bytes(), 0, "{stats}");
    assert_eq!(stats.live_bytes(), 0, "{stats}");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --test gpu -- --include-ignored"]
fn cached_block_stays_pinned() {
    let _serial = serial();
    let (_ctx, stream) = gpu("cached_block_stays_pinned");
    let alloc = strict_alloc();
    let released_before = alloc.stats().unregistrations;
    let len = 32 * MIB;
    let mut host: Vec<u8> = vec![0; len];
    {
        let v = pinned_vec(&alloc, len);
        drop(v);
    }
    let before = alloc.stats();
    assert_eq!(before.registrations, 1, "{before}");
    assert!(before.cached_bytes() >= len, "{before}");
    {
        let mut v = pinned_vec(&alloc, len);
        v.extend(pattern(len, 99));
        round_trip(&stream, &v, &mut host);
        assert!(v[..] == host[..], "bytes differ after the round trip");
        let during = alloc.stats();
        assert_eq!(during.cache_hits, before.cache_hits + 1, "{during}");
        assert_eq!(
            during.registrations, 1,
            "reuse must not register again: {during}"
        );
        assert!(during.pinned_bytes() >= len, "{during}");
    }
    alloc.trim(); // every block is unregistered before it is unmapped
    let after = alloc.stats();
    assert_eq!(after.unregistrations - released_before, 1, "{after}");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --test gpu -- --include-ignored"]
fn device_to_pinned_host_matches_pageable() {
    let _serial = serial();
    let (_ctx, stream) = gpu("device_to_pinned_host_matches_pageable");
    let alloc = strict_alloc();
    let len = 16 * MIB + 4096 + 123; // not a multiple of the huge page size
    let src: Vec<u8> = pattern(len, 3).collect();
    let mut dev = stream.alloc_zeros::<u8>(len).expect("device allocation");
    stream
        .memcpy_htod(&src, &mut dev)
        .expect("host to device copy");
    let mut pinned = pinned_vec(&alloc, len);
    pinned.resize(len, 0);
    stream
        .memcpy_dtoh(&dev, &mut pinned[..])
        .expect("device to host copy");
    stream.synchronize().expect("synchronize");
    assert!(pinned[..] == src[..], "bytes differ");
    let stats = alloc.stats();
    assert_eq!(stats.registrations, 1, "{stats}");
    assert_eq!(stats.pin_failures_by_code, Vec::new(), "{stats}");
}

#[test]
fn driver_probe_never_panics() {
    // Holds with or without a GPU: the probe is decided once and is stable.
    let first = numa_gpu_alloc::cuda_driver_present();
    assert_eq!(first, numa_gpu_alloc::cuda_driver_present());
    let placement = NumaGpuAlloc::new().placement();
    if !first {
        assert!(!placement.pinning, "{placement:?}");
        assert_eq!(placement.gpu_ordinal, None);
        eprintln!("gpu test driver_probe_never_panics: no CUDA driver; checked the fallback");
    }
}
