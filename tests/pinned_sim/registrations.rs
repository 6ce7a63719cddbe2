//! Registrations that fail or cannot happen (an injected driver error, a forked child,
//! `pin=strict`), per-thread GPU routes, and pinned blocks carved from chunks registered once
//! each, never straddling two.

use super::*;

sim_test!(
    /// A failed registration (injected: CUDA_ERROR_OUT_OF_MEMORY) leaves the block unpinned and
    /// counted; copies with it are then synchronous, and still correct.
    failed_registration_keeps_buffers_correct,
    env: [("CUDA_SIM_DELAY_US", "2000")],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: the failure is injected by the simulator"
        );
        let (ctx, _) = stream();
        let stream = ctx.new_stream().unwrap();
        Sim::get().fail("cuMemHostRegister_v2", 2, 0, 1);
        let alloc = NumaGpuAlloc::new().pin(PinMode::On);
        let expected = pattern(4 * MIB, 7);
        let buf = PinnedBuf::from_slice(&alloc, &expected).expect("PinnedBuf");
        let dev = stream.clone_htod(&buf).unwrap();
        drop(buf);
        let back = stream.clone_dtoh(&dev).unwrap();
        assert_eq!(wrong_bytes(&back, &expected), 0);
        let stats = alloc.stats();
        assert_eq!(stats.fallbacks.pin_failures, 1, "{stats}");
        assert_eq!(stats.fallbacks.unpinned_blocks, 1, "{stats}");
    }
);

sim_test!(
    /// A child forked while a copy runs makes no CUDA call: host access reports the fork
    /// (the download lands in the parent's pages, not the child's) and drop returns at once
    /// (against the simulator, a driver call in the child would wait forever for a worker
    /// thread that was not forked).
    forked_child_makes_no_cuda_call,
    env: [],
    {
        let ctx = context();
        let stream = ctx.new_stream().expect("a stream");
        let expected = pattern(4 * MIB, 3);
        let dev = stream.clone_htod(&expected).expect("clone_htod");
        let mut buf = PinnedBuf::<u8>::zeroed(&PINNING, 4 * MIB).expect("PinnedBuf");
        let sim = hold();
        stream.memcpy_dtoh(&dev, &mut buf).expect("memcpy_dtoh");
        // SAFETY: the child only touches `buf` and then leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let refused = buf.as_slice().is_err();
            drop(buf);
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if refused { 0 } else { 1 }) };
        }
        release(&sim);
        assert!(
            child_succeeded(pid),
            "the child read its buffer although a download was queued at the fork"
        );
        assert_eq!(wrong_bytes(&buf, &expected), 0);
    }
);

/// Waits for the forked child `pid` (20 s at most: one still running then is hung, by a CUDA
/// call in the child, say) and tells whether it exited with 0.
fn child_succeeded(pid: libc::pid_t) -> bool {
    let mut status = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        // SAFETY: waits for our own child without blocking.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            return libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        }
        if std::time::Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the forked child hung (a CUDA call in the child?)");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

sim_test!(
    /// The arenas are the process's: after a `pin=on` value's registration failed (injected),
    /// its arena serves that value unpinned chunks for a while, but a `pin=strict` value
    /// carving there still gets page-locked memory, never the other value's unpinned chunk.
    another_values_failed_registration_never_unpins_a_strict_value,
    env: [],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: the failure is injected by the simulator"
        );
        let _ctx = context();
        let layout = std::alloc::Layout::from_size_align(4 * MIB, 4096).unwrap();
        let on = NumaGpuAlloc::new().pin(PinMode::On);
        Sim::get().fail("cuMemHostRegister_v2", 2, 0, 1);
        let unpinned = on.allocate(layout).expect("pin=on serves unpinned");
        let s = on.stats();
        assert_eq!((s.fallbacks.pin_failures, s.fallbacks.unpinned_blocks), (1, 1), "{s}");
        let strict = NumaGpuAlloc::new().pin(PinMode::Strict);
        let block = strict.allocate(layout).expect("pin=strict registers its own chunk");
        let s = strict.stats();
        assert_eq!((s.registrations, s.fallbacks.unpinned_blocks), (1, 0), "{s}");
        // SAFETY: live with this layout, freed once each.
        unsafe {
            strict.deallocate(block.cast(), layout);
            on.deallocate(unpinned.cast(), layout);
        }
    }
);

sim_test!(
    /// `pin=strict` with a GPU: a failed registration (injected: CUDA_ERROR_NOT_PERMITTED) fails
    /// the request and gives its mapping back; the next request is pinned.
    registration_failure_under_strict_fails_the_request,
    env: [],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: the failure is injected by the simulator"
        );
        let _ctx = context();
        Sim::get().fail("cuMemHostRegister_v2", 800, 0, 1);
        let alloc = NumaGpuAlloc::new().pin(PinMode::Strict);
        let layout = std::alloc::Layout::from_size_align(4 * MIB, 4096).unwrap();
        assert!(alloc.allocate(layout).is_err());
        let block = alloc.allocate(layout).expect("the next registration works");
        let s = alloc.stats();
        let codes: Vec<_> = s.pin_failures_by_code.iter().map(|c| (c.code, c.name)).collect();
        assert_eq!(codes, [(800, "CUDA_ERROR_NOT_PERMITTED")], "{s}");
        assert_eq!((s.fallbacks.failed_allocations, s.released_blocks), (1, 1), "{s}");
        assert_eq!((s.registrations, s.fallbacks.unpinned_blocks), (1, 0), "{s}");
        // SAFETY: live with this layout, freed once.
        unsafe { alloc.deallocate(block.cast(), layout) };
    }
);

sim_test!(
    /// `pin=strict` in a child forked after CUDA was initialised: nothing can be registered
    /// there, so a large request fails before anything is mapped, and the stats say why.
    strict_in_a_forked_child_fails_before_mapping,
    env: [],
    {
        let alloc = NumaGpuAlloc::new().pin(PinMode::Strict);
        let layout = std::alloc::Layout::from_size_align(4 * MIB, 4096).unwrap();
        let block = alloc.allocate(layout).expect("pinned in the parent");
        // SAFETY: the child only allocates through `alloc`, reads its stats and leaves with
        // `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let before = alloc.stats();
            let refused = alloc.allocate(layout).is_err();
            let s = alloc.stats();
            let why = s.last_pin_error.as_ref().map(ToString::to_string).unwrap_or_default();
            let ok = refused
                && (s.cache_misses, s.released_blocks) == (before.cache_misses, before.released_blocks)
                && s.fallbacks.strict_refused == 1
                && why.contains("forked");
            if !ok {
                eprintln!("in the child: refused {refused}, {why}\n{s}");
            }
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        assert!(child_succeeded(pid), "the child mapped memory for pin=strict");
        // SAFETY: live with this layout, freed once.
        unsafe { alloc.deallocate(block.cast(), layout) };
    }
);

/// `gpu=current` on the 4-node `amd-nps4` topology: blocks follow the device of the context
/// cudarc's `bind_to_thread` made current on each thread, with three devices whose host nodes are
/// 1, 2 and 3; each block is registered once (PORTABLE) and freed by the main thread back to its
/// node's arena, where the next request routed there reuses it.
static CURRENT: NumaGpuAlloc = NumaGpuAlloc::new()
    .gpu(GpuSelector::Current)
    .pin(PinMode::On)
    .sysfs_root(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/amd-nps4"
    ));

sim_test!(
    gpu_current_follows_each_threads_context,
    env: [("CUDA_SIM_DEVICES", "3"), ("CUDA_SIM_HOST_NUMA_ID", "1,2,3")],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: needs the simulator's three devices"
        );
        let layout = std::alloc::Layout::from_size_align(4 * MIB, 4096).unwrap();
        let on_device = |ordinal: usize| {
            let ctx = CudaContext::new(ordinal).expect("a context");
            ctx.bind_to_thread().expect("bind_to_thread");
            CURRENT.allocate(layout).expect("4 MiB").as_ptr().cast::<u8>() as usize
        };
        let blocks: Vec<usize> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..3).map(|d| s.spawn(move || on_device(d))).collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let stats = CURRENT.stats();
        let rows: Vec<_> = stats
            .gpus
            .iter()
            .map(|g| (g.ordinal, g.node, g.live_blocks, g.pinned_bytes))
            .collect();
        assert_eq!(
            rows,
            [(0, 1, 1, 4 * MIB), (1, 2, 1, 4 * MIB), (2, 3, 1, 4 * MIB)],
            "{stats}"
        );
        assert_eq!(stats.registrations, 3, "{stats}");
        for &block in &blocks {
            let ptr = std::ptr::NonNull::new(block as *mut u8).unwrap();
            // SAFETY: live blocks of CURRENT with this layout, freed once (on another thread).
            unsafe { CURRENT.deallocate(ptr, layout) };
        }
        let cached: Vec<_> = CURRENT.stats().nodes.iter().map(|n| n.cached_blocks).collect();
        assert_eq!(&cached[..4], [0, 1, 1, 1], "each back in its node's arena");
        // The same device again, on a new thread: its node's cached block, no new registration.
        let again = std::thread::scope(|s| s.spawn(|| on_device(1)).join().unwrap());
        assert_eq!(again, blocks[1]);
        assert_eq!(CURRENT.stats().registrations, 3);
        let ptr = std::ptr::NonNull::new(again as *mut u8).unwrap();
        // SAFETY: live with this layout.
        unsafe { CURRENT.deallocate(ptr, layout) };
    }
);

sim_test!(
    /// Pinned churn: one thread cycles through 13 sizes of 3 to 15 MiB, 8 buffers live at once,
    /// with pinning on. Blocks are carved from chunks registered once each: a few registrations
    /// in all, not one (and an unregistration) per buffer.
    pinned_churn_registers_chunks_not_blocks,
    env: [],
    {
        let alloc = NumaGpuAlloc::new().pin(PinMode::On);
        let _ = context();
        let before = Sim::get().stats().registrations;
        let mut ring = std::collections::VecDeque::new();
        const STEPS: usize = 400;
        for step in 0..STEPS {
            if ring.len() == 8 {
                let (p, layout) = ring.pop_front().unwrap();
                // SAFETY: allocated below with this layout, freed once.
                unsafe { alloc.deallocate(p, layout) };
            }
            let layout = std::alloc::Layout::from_size_align((3 + step % 13) * MIB, 64).unwrap();
            let p = alloc.allocate(layout).expect("a block").cast::<u8>();
            for offset in (0..layout.size()).step_by(4096) {
                // SAFETY: inside the block just allocated.
                unsafe { p.as_ptr().add(offset).write(step as u8) };
            }
            ring.push_back((p, layout));
        }
        for (p, layout) in ring {
            // SAFETY: allocated above with this layout, freed once.
            unsafe { alloc.deallocate(p, layout) };
        }
        let stats = alloc.stats();
        let sim = Sim::get().stats();
        let chunks: u64 = stats.heaps.iter().filter(|h| h.pinned).map(|h| h.chunks_made).sum();
        eprintln!(
            "pinned churn: {STEPS} buffers, {} registrations ({} seen by the simulator, the \
             largest {} MiB), {chunks} pinned chunks, {} unregistrations",
            stats.registrations,
            sim.registrations - before,
            sim.largest_registration >> 20,
            stats.unregistrations
        );
        assert_eq!(stats.registrations, sim.registrations - before, "{stats}");
        assert_eq!(stats.registrations, chunks, "one registration per chunk: {stats}");
        assert!(stats.registrations <= 64, "{stats}");
        assert!(sim.largest_registration <= 1 << 30, "no registration above 1 GiB");
        assert_eq!(stats.fallbacks.unpinned_blocks, 0, "{stats}");
    }
);

sim_test!(
    /// The simulator refuses, as the driver does, a copy whose host range spans two
    /// registrations: the double that shows the next test's blocks never do.
    the_simulator_refuses_a_copy_spanning_two_registrations,
    env: [],
    {
        let (ctx, stream) = stream();
        ctx.bind_to_thread().expect("a current context");
        let host: &'static mut [u8] = Box::leak(vec![7u8; 2 * MIB].into_boxed_slice());
        let half = MIB;
        let sim = Sim::get();
        assert_eq!(sim.register(host.as_mut_ptr(), half), 0);
        // SAFETY: inside the leaked buffer.
        assert_eq!(sim.register(unsafe { host.as_mut_ptr().add(half) }, half), 0);
        let mut dev = stream.alloc_zeros::<u8>(2 * MIB).expect("alloc_zeros");
        assert!(stream.memcpy_htod(&host[..half], &mut dev).is_ok(), "inside one");
        let spanning = stream.memcpy_htod(&host[half - 4096..half + 4096], &mut dev);
        assert!(spanning.is_err(), "a copy across two registrations must fail");
    }
);

sim_test!(
    /// Pinned blocks of many sizes, carved from several chunks: every block's copy lies inside
    /// one chunk's registration (the simulator fails one that spans two).
    pinned_blocks_never_straddle_registrations,
    env: [],
    {
        let alloc = NumaGpuAlloc::new().pin(PinMode::On);
        let (_ctx, stream) = stream();
        let mut dev = stream.alloc_zeros::<u8>(15 * MIB).expect("alloc_zeros");
        let mut live = Vec::new();
        for step in 0..60usize {
            let len = (1 + step % 15) * MIB - 4096 * (step % 7);
            let buf = PinnedBuf::from_slice(&alloc, &pattern(len, step as u8)).expect("PinnedBuf");
            stream
                .memcpy_htod(&buf, &mut dev.slice_mut(..len))
                .unwrap_or_else(|e| panic!("block {step} of {len} bytes: {e:?}"));
            live.push(buf);
            if step % 3 == 0 {
                live.swap_remove(step % live.len());
            }
        }
        let stats = alloc.stats();
        assert!(stats.registrations >= 2, "several chunks: {stats}");
        stream.synchronize().expect("synchronize");
    }
);
