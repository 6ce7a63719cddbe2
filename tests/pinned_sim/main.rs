//! Pinned memory is asynchronous: these tests copy through cudarc's safe API against the CUDA
//! driver simulator (`tests/sim/`), whose page-locked copies finish on a worker thread after a
//! delay, as DMA does; with `NUMA_GPU_ALLOC_REAL_DRIVER=1` they run against a real GPU.
//!
//! Its own binary: `NumaGpuAlloc` with its default configuration is the global allocator here,
//! and each test body runs in a child process that loads the simulator as libcuda.

// The shared test modules live in tests/common/, beside this folder.
#[macro_use]
#[path = "../common/require.rs"]
pub mod require_support;
#[macro_use]
#[path = "../common/sim.rs"]
pub mod sim_support;
mod common {
    pub use super::require_support as require;
    pub use super::sim_support as sim;
}

use std::sync::Arc;

use allocator_api2::alloc::Allocator;

use common::sim::{self, Sim};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use numa_gpu_alloc::{GpuSelector, NumaGpuAlloc, PinMode, PinnedBuf};

#[global_allocator]
static GLOBAL: NumaGpuAlloc = NumaGpuAlloc::new();

/// The explicit choice: a second allocator that pins, for `PinnedBuf`s.
static PINNING: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);

#[cfg(feature = "fault-injection")]
/// Set in a child to run [`freed_block_is_not_reused_before_its_copy_completed`] with the
/// pending list switched off (feature `fault-injection`), to show that the test catches it.
const IGNORE_IN_FLIGHT_VAR: &str = "NUMA_GPU_ALLOC_TEST_IGNORE_IN_FLIGHT";

const MIB: usize = 1 << 20;

mod exit;
mod registrations;

fn context() -> Arc<CudaContext> {
    assert!(numa_gpu_alloc::cuda_driver_present(), "no CUDA driver");
    CudaContext::new(0).expect("a context on device 0")
}

fn stream() -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = context();
    let stream = ctx.default_stream();
    (ctx, stream)
}

/// Distinct bytes for each seed and position (so a stale or foreign byte shows).
/// Byte `i` is `(i as u8) * 31 + seed ^ (i >> 12) as u8`: a period of 256 bytes, XORed with the
/// page's index. Built by copies of one 256-byte piece per page, not a loop turn per byte (the
/// test build is unoptimised).
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    let base: Vec<u8> = (0..=255u8)
        .map(|j| j.wrapping_mul(31).wrapping_add(seed))
        .collect();
    let mut out = Vec::with_capacity(len);
    for page in 0..len.div_ceil(4096) {
        let piece: Vec<u8> = base.iter().map(|b| b ^ page as u8).collect();
        for _ in 0..16 {
            let take = (len - out.len()).min(256);
            out.extend_from_slice(&piece[..take]);
        }
    }
    out
}

fn wrong_bytes(got: &[u8], expected: &[u8]) -> usize {
    assert_eq!(got.len(), expected.len());
    if got == expected {
        return 0; // one memcmp: the byte loop is slow unoptimised
    }
    got.iter().zip(expected).filter(|(a, b)| a != b).count()
}

/// A loader's loop: upload a batch, drop it, allocate another batch, download; with
/// implicit pinning the download read unfinished DMA and the dropped batch was reused while
/// its upload was still reading it. Returns the number of wrong bytes.
fn clone_loop(stream: &Arc<CudaStream>, rounds: u8, len: usize) -> usize {
    let mut wrong = 0;
    for round in 0..rounds {
        let batch = pattern(len, round);
        let dev = stream.clone_htod(&batch).expect("clone_htod");
        drop(batch);
        let other = pattern(len, round.wrapping_add(100));
        let back = stream.clone_dtoh(&dev).expect("clone_dtoh");
        let expected = pattern(len, round);
        wrong += back.iter().zip(&expected).filter(|(a, b)| a != b).count();
        drop(other);
    }
    stream.synchronize().expect("synchronize");
    wrong
}

sim_test!(
    /// (a) The default configuration (placement, no pinning) keeps safe code correct.
    default_configuration_keeps_clone_loops_correct,
    env: [("CUDA_SIM_DELAY_US", "2000")],
    {
        let (_ctx, stream) = stream();
        assert_eq!(clone_loop(&stream, 8, 4 * MIB), 0);
        let stats = GLOBAL.stats();
        assert!(!stats.pinning, "{stats}");
        assert!(stats.large_allocations >= 24, "{stats}");
    }
);

sim_test!(
    /// The simulator has teeth: with implicit pinning (`pin=on` for every `Vec`) the same loop
    /// reads unfinished copies and corrupts uploads, as the real driver does.
    implicit_pinning_breaks_safe_code,
    env: [("CUDA_SIM_DELAY_US", "2000"), ("NUMA_GPU_ALLOC", "pin=on")],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: needs NUMA_GPU_ALLOC=pin=on before start"
        );
        let (_ctx, stream) = stream();
        let wrong = clone_loop(&stream, 8, 4 * MIB);
        let stats = GLOBAL.stats();
        assert!(stats.pinning, "{stats}");
        eprintln!("implicit pinning: {wrong} of {} bytes wrong", 8 * 4 * MIB);
        assert!(wrong > 0, "the simulator missed the asynchronous-copy hazard");
    }
);

sim_test!(
    /// A reservation with pinning on makes page-locked cache entries: the first `PinnedBuf` of
    /// that size takes one (a cache hit, no registration of its own).
    reserved_blocks_are_pinned_and_serve_the_first_buffer,
    env: [],
    {
        let alloc = NumaGpuAlloc::new().pin(PinMode::On);
        // The arenas are the process's: on the real driver, earlier tests' blocks are cached.
        alloc.placement();
        alloc.trim();
        alloc.reserve(2, 4 * MIB).expect("reserve");
        let stats = alloc.stats();
        assert!(stats.pinning, "{stats}");
        assert_eq!(stats.registrations, 1, "one chunk for both blocks: {stats}");
        assert_eq!((stats.pinned_bytes(), stats.cached_bytes()), (8 * MIB, 8 * MIB));
        let (_ctx, stream) = stream();
        let buf = PinnedBuf::from_slice(&alloc, &pattern(4 * MIB, 7)).expect("PinnedBuf");
        let back = stream.clone_dtoh(&stream.clone_htod(&buf).expect("upload")).expect("download");
        assert_eq!(wrong_bytes(&back, &pattern(4 * MIB, 7)), 0);
        let stats = alloc.stats();
        assert_eq!((stats.cache_hits, stats.cache_misses), (1, 0), "{stats}");
        assert_eq!(stats.registrations, 1, "no registration beyond the reservation");
    }
);

/// Upload, drop, a second buffer at once, download into a third: what (b) checks on `stream`.
fn buffer_round(stream: &Arc<CudaStream>, round: u8) {
    let expected = pattern(4 * MIB, round);
    let src = PinnedBuf::from_slice(&PINNING, &expected).expect("PinnedBuf");
    let dev = stream.clone_htod(&src).expect("clone_htod");
    drop(src);
    let _other = PinnedBuf::from_slice(&PINNING, &pattern(4 * MIB, !round)).unwrap();
    let mut back = PinnedBuf::<u8>::zeroed(&PINNING, 4 * MIB).expect("PinnedBuf");
    stream.memcpy_dtoh(&dev, &mut back).expect("memcpy_dtoh");
    assert_eq!(wrong_bytes(&back, &expected), 0, "round {round}");
    // A part at an offset, through the tracked view.
    let mut part = PinnedBuf::<u8>::zeroed(&PINNING, 8 * MIB).expect("PinnedBuf");
    stream
        .memcpy_dtoh(&dev, &mut part.slice_mut(4 * MIB..8 * MIB))
        .expect("memcpy_dtoh into a part");
    assert_eq!(
        wrong_bytes(&part[4 * MIB..], &expected),
        0,
        "round {round}, part"
    );
    let mut dev2 = stream.alloc_zeros::<u8>(4 * MIB).expect("alloc_zeros");
    stream.memcpy_htod(&back, &mut dev2).expect("memcpy_htod");
    back.as_mut_slice().expect("host access").fill(0);
    let again = stream.clone_dtoh(&dev2).expect("clone_dtoh");
    assert_eq!(
        wrong_bytes(&again, &expected),
        0,
        "round {round}, second copy"
    );
}

sim_test!(
    /// (b) With pinning on and `PinnedBuf`, the same loops are correct without synchronising:
    /// first on the default stream alone (cudarc tracks no events: each copy synchronises),
    /// then once a stream of its own exists (events).
    pinned_buffer_keeps_copy_loops_correct,
    env: [("CUDA_SIM_DELAY_US", "2000")],
    {
        let ctx = context();
        let default = ctx.default_stream();
        for round in 0..3u8 {
            buffer_round(&default, round);
        }
        let own = ctx.new_stream().expect("a stream");
        for round in 3..6u8 {
            buffer_round(&own, round);
            buffer_round(&default, round);
        }
        let stats = PINNING.stats();
        assert!(stats.pinning, "{stats}");
        assert_eq!(stats.fallbacks.unpinned_blocks, 0, "{stats}");
    }
);

/// Uploads `count` buffers on one stream while downloading the previous one on another, and
/// returns the downloads.
fn two_stream_pipeline<B>(
    ctx: &Arc<CudaContext>,
    sources: &[B],
    mut destination: impl FnMut() -> B,
) -> Vec<B>
where
    B: cudarc::driver::HostSlice<u8> + std::ops::DerefMut<Target = [u8]>,
{
    let (up, down) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let devs: Vec<CudaSlice<u8>> = sources
        .iter()
        .map(|_| up.alloc_zeros::<u8>(sources[0].len()).unwrap())
        .collect();
    let mut devs = devs;
    let mut outs: Vec<B> = (0..sources.len()).map(|_| destination()).collect();
    for i in 0..=sources.len() {
        if i < sources.len() {
            up.memcpy_htod(&sources[i], &mut devs[i]).unwrap();
        }
        if i > 0 {
            down.memcpy_dtoh(&devs[i - 1], &mut outs[i - 1]).unwrap();
        }
    }
    outs
}

sim_test!(
    /// (b) Copies from `PinnedBuf`s overlap on two streams (the simulator's clock: busy time
    /// over span), where pageable `Vec`s copy one after another.
    pinned_copies_overlap_on_two_streams,
    env: [("CUDA_SIM_DELAY_US", "500")],
    {
        let ctx = context();
        let n = 8;
        let expected: Vec<Vec<u8>> = (0..n).map(|i| pattern(4 * MIB, i as u8)).collect();
        let pinned: Vec<PinnedBuf<u8>> =
            expected.iter().map(|e| PinnedBuf::from_slice(&PINNING, e).unwrap()).collect();
        let pageable: Vec<Vec<u8>> = expected.clone();

        let sim = (!sim::real_driver()).then(Sim::get);
        sim.as_ref().map(Sim::reset_clock);
        let outs = two_stream_pipeline(&ctx, &pinned, || {
            PinnedBuf::zeroed(&PINNING, 4 * MIB).unwrap()
        });
        for (out, e) in outs.iter().zip(&expected) {
            assert_eq!(wrong_bytes(out, e), 0);
        }
        let pinned_clock = sim.as_ref().map(Sim::stats);

        sim.as_ref().map(Sim::reset_clock);
        let outs = two_stream_pipeline(&ctx, &pageable, || vec![0u8; 4 * MIB]);
        ctx.synchronize().unwrap();
        for (out, e) in outs.iter().zip(&expected) {
            assert_eq!(wrong_bytes(out, e), 0);
        }
        let measured = pinned_clock.zip(sim.as_ref().map(Sim::stats));
        require!(
            measured.is_some(),
            "overlap, on the real driver: the simulator's clock measures it"
        );
        let (pinned_clock, pageable_clock) = measured.unwrap();
        eprintln!(
            "overlap (busy/span): PinnedBuf {:.2} ({} async copies), pageable Vec {:.2} ({} sync)",
            pinned_clock.overlap(),
            pinned_clock.async_copies,
            pageable_clock.overlap(),
            pageable_clock.sync_copies
        );
        assert_eq!(pinned_clock.async_copies, 2 * n as u64);
        assert!(pinned_clock.overlap() >= 1.7, "{pinned_clock:?}");
        assert!(pageable_clock.overlap() <= 1.05, "{pageable_clock:?}");
    }
);

/// Against the simulator: page-locked copies stay queued until [`release`] (the test decides
/// when the DMA completes). On the real driver: nothing (copies run at the GPU's pace).
fn hold() -> Option<Sim> {
    let sim = (!sim::real_driver()).then(Sim::get);
    if let Some(sim) = &sim {
        sim.hold(true);
    }
    sim
}

fn pending_blocks(stats: &numa_gpu_alloc::Stats) -> usize {
    stats.nodes.iter().map(|n| n.pending_blocks).sum()
}

fn release(sim: &Option<Sim>) {
    if let Some(sim) = sim {
        sim.hold(false);
    }
}

sim_test!(
    /// (c) A block freed while a copy still reads it is not reused before the copy completed.
    freed_block_is_not_reused_before_its_copy_completed,
    env: [],
    {
        #[cfg(feature = "fault-injection")]
        if std::env::var_os(IGNORE_IN_FLIGHT_VAR).is_some() {
            numa_gpu_alloc::unstable::sys::fault::ignore_in_flight(true);
        }
        let ctx = context();
        let stream = ctx.new_stream().expect("a stream");
        let (mut wrong, mut reused_early) = (0, 0);
        for round in 0..4u8 {
            let expected = pattern(4 * MIB, round);
            let upload = PinnedBuf::from_slice(&PINNING, &expected).expect("PinnedBuf");
            let mut dev = stream.alloc_zeros::<u8>(4 * MIB).expect("alloc_zeros");
            let sim = hold();
            stream.memcpy_htod(&upload, &mut dev).expect("memcpy_htod");
            let freed_at = upload.as_ptr();
            drop(upload);
            // The same size at once: the freed block must not be handed out while the copy reads.
            let next = PinnedBuf::from_slice(&PINNING, &pattern(4 * MIB, !round)).unwrap();
            // With the copy held, the freed block must still be pending.
            reused_early += usize::from(sim.is_some() && next.as_ptr() == freed_at);
            release(&sim);
            let back = stream.clone_dtoh(&dev).expect("clone_dtoh");
            wrong += wrong_bytes(&back, &expected);
            drop(next);
        }
        let stats = PINNING.stats();
        eprintln!(
            "{wrong} bytes reached the device wrong, freed block handed out again during its \
             copy in {reused_early} of 4 rounds; {stats}"
        );
        assert_eq!(
            (wrong, reused_early),
            (0, 0),
            "a freed block was reused while its copy was still running"
        );
    }
);

/// (d) The simulator catches the bug that section 3 prevents: with the pending list switched
/// off, test (c) fails.
#[cfg(feature = "fault-injection")]
#[test]
fn without_the_pending_list_test_c_fails() {
    if sim::in_body() {
        return;
    }
    let (passed, output) = sim::run_child(
        "freed_block_is_not_reused_before_its_copy_completed",
        &[(IGNORE_IN_FLIGHT_VAR, "1")],
    );
    assert!(
        !passed,
        "test (c) passed with the pending list off:\n{output}"
    );
    // Either symptom of the bug: the block handed out again, or (the node's arena being shared
    // with the global allocator, whose frees push the cached block out) released, i.e.
    // unregistered, while the copy still reads it.
    assert!(
        output.contains("was reused while its copy was still running")
            || output.contains("while a queued copy still uses the range"),
        "{output}"
    );
    eprintln!("{output}");
}

/// The simulator's other tooth: with the pending list off, `trim()` unregisters a block whose
/// copy is queued, and the simulator stops the process.
#[cfg(feature = "fault-injection")]
#[test]
fn without_the_pending_list_trim_unregisters_memory_in_use() {
    if sim::in_body() {
        return;
    }
    let (passed, output) = sim::run_child(
        "trim_skips_blocks_in_flight",
        &[(IGNORE_IN_FLIGHT_VAR, "1")],
    );
    assert!(!passed, "trim passed with the pending list off:\n{output}");
    assert!(
        output.contains("cuMemHostUnregister") && output.contains("queued copy"),
        "{output}"
    );
}

sim_test!(
    /// `record_stream` gives plain `Vec`s of a pinning allocator the same stream-ordered reuse.
    record_stream_defers_reuse_of_a_plain_vec,
    env: [],
    {
        let ctx = context();
        let stream = ctx.new_stream().expect("a stream");
        let recorded_before = PINNING.stats().in_flight_recorded;
        for round in 0..3u8 {
            let expected = pattern(4 * MIB, round);
            let mut upload = allocator_api2::vec::Vec::with_capacity_in(4 * MIB, &PINNING);
            upload.extend_from_slice(&expected);
            let mut dev = stream.alloc_zeros::<u8>(4 * MIB).expect("alloc_zeros");
            let sim = hold();
            stream.memcpy_htod(&upload[..], &mut dev).expect("memcpy_htod");
            assert!(PINNING.record_stream(upload.as_ptr(), &stream).expect("record_stream"));
            drop(upload);
            let mut next = allocator_api2::vec::Vec::with_capacity_in(4 * MIB, &PINNING);
            next.extend_from_slice(&pattern(4 * MIB, !round));
            release(&sim);
            let back = stream.clone_dtoh(&dev).expect("clone_dtoh");
            assert_eq!(wrong_bytes(&back, &expected), 0, "round {round}");
        }
        let small = [0u8; 64];
        assert!(!PINNING.record_stream(small.as_ptr(), &stream).unwrap());
        let stats = PINNING.stats();
        assert!(stats.in_flight_recorded >= recorded_before + 3, "{stats}");
    }
);

sim_test!(
    /// `trim()` leaves a block whose copy is queued alone (the simulator aborts the process if a
    /// range a queued copy uses is unregistered); it is released by a later trim.
    trim_skips_blocks_in_flight,
    env: [],
    {
        #[cfg(feature = "fault-injection")]
        if std::env::var_os(IGNORE_IN_FLIGHT_VAR).is_some() {
            numa_gpu_alloc::unstable::sys::fault::ignore_in_flight(true);
        }
        let alloc = NumaGpuAlloc::new().pin(PinMode::On);
        let ctx = context();
        let stream = ctx.new_stream().expect("a stream");
        let expected = pattern(4 * MIB, 9);
        let upload = PinnedBuf::from_slice(&alloc, &expected).expect("PinnedBuf");
        let mut dev = stream.alloc_zeros::<u8>(4 * MIB).expect("alloc_zeros");
        let sim = hold();
        stream.memcpy_htod(&upload, &mut dev).expect("memcpy_htod");
        drop(upload);
        alloc.trim();
        let during = alloc.stats();
        release(&sim);
        let back = stream.clone_dtoh(&dev).expect("clone_dtoh");
        assert_eq!(wrong_bytes(&back, &expected), 0);
        if sim.is_some() {
            assert_eq!(pending_blocks(&during), 1, "{during}");
        }
        alloc.trim();
        let after = alloc.stats();
        // Live vectors of the global allocator keep their (unpinned) chunk: only pinned ones go.
        assert_eq!((pending_blocks(&after), after.pinned_bytes()), (0, 0), "{after}");
        // Blocks of other values on the node are released too (the arenas are the process's).
        assert!(after.unregistrations >= after.registrations, "{after}");
        assert!(after.unpin_time.total > std::time::Duration::ZERO, "{after}");
    }
);
