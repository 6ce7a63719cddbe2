//! CUDA's own host-NUMA memory through the benchmark tools (`cuda_driver::HostNumaMemory` and
//! `HostNumaPool`), against the CUDA driver simulator (`tests/sim/`): usable by the host once
//! access is set, copied both ways, its pages on the node, everything given back when the
//! guards drop; a refused node is an error naming the call and code, a libcuda without the
//! entries one naming the entry; misuse of the address-range calls is refused. Under `NUMA_GPU_ALLOC_REAL_DRIVER=1` the bodies run against the real driver,
//! without the simulator's bookkeeping checks, and a driver that refuses host-NUMA memory is
//! reported ignored at run time (`tests/common/require.rs`).
//!
//! Its own binary: each body runs in a child process that loads the simulator as libcuda.

#[macro_use]
mod common {
    #[macro_use]
    pub mod require;
    #[macro_use]
    pub mod sim;
}

use std::ptr::NonNull;

use common::sim::{self, HostNumaStats, Sim};
use numa_gpu_alloc::unstable::cuda_driver::{Direction, Driver};
use numa_gpu_alloc::{Error, GpuSelector, NumaGpuAlloc};

const MIB: usize = 1 << 20;

/// The node CUDA's memory goes to: the GPU's host node, as `dma_bench` takes it.
fn host_node() -> usize {
    NumaGpuAlloc::new()
        .gpu(GpuSelector::Ordinal(0))
        .placement()
        .host_node
}

/// The simulator's bookkeeping, or `None` against the real driver.
fn sim_state() -> Option<(u64, HostNumaStats)> {
    (!sim::real_driver()).then(|| {
        let sim = Sim::get();
        (sim.stats().registered_ranges, sim.host_numa_stats())
    })
}

/// Against the real driver, whether `e` is the driver declining host-NUMA memory (libcuda
/// lacks an entry, `CUDA_ERROR_NOT_PERMITTED`, `CUDA_ERROR_NOT_SUPPORTED`): the test then ends
/// as [`require!`] says.
fn declined(e: &Error) -> bool {
    let declines = sim::real_driver()
        && matches!(
            e,
            Error::CudaUnavailable { .. }
                | Error::Cuda {
                    code: 800 | 801,
                    ..
                }
        );
    !common::require::met(
        !declines,
        format_args!("the driver declines host-NUMA memory: {e}"),
    )
}

/// Writes a pattern, copies it to the device and back over zeros, and checks it came back.
fn round_trip(driver: &Driver, bytes: &mut [u8]) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let copier = driver.copier(bytes.len()).expect("copier");
    copier
        .time(bytes, Direction::HtoD, 1)
        .expect("host to device");
    bytes.fill(0);
    copier
        .time(bytes, Direction::DtoH, 1)
        .expect("device to host");
    let wrong = bytes
        .iter()
        .enumerate()
        .position(|(i, &b)| b != (i % 251) as u8);
    assert_eq!(wrong, None, "the bytes came back");
}

sim_test!(
    /// 3 MiB asked for: 4 MiB (the 2 MiB granularity) mapped on the host node, written by the
    /// host (which faults unless `cuMemSetAccess` named the host), copied asynchronously both
    /// ways, every page on the node; then unmapped, freed and released.
    host_numa_memory_is_usable_and_given_back,
    env: [("CUDA_SIM_DELAY_US", "200")],
    {
        let node = host_node();
        let driver = Driver::open(0).expect("the device");
        let before = sim_state();
        if let Some(sim) = (!sim::real_driver()).then(Sim::get) {
            sim.reset_clock();
        }
        let mut mem = match driver.host_numa_memory(node, 3 * MIB) {
            Err(e) if declined(&e) => return,
            other => other.expect("host-NUMA memory"),
        };
        assert_eq!(mem.len(), 4 * MIB);
        round_trip(&driver, mem.as_mut_slice());
        // SAFETY: the mapping is this process's and stays mapped while `mem` lives.
        let census = unsafe { numa_gpu_alloc::unstable::sys::census(mem.as_ptr(), mem.len(), node) };
        eprintln!("placement on node {node}: {census:?}");
        if let Some((ranges, stats)) = before {
            let sim = Sim::get();
            assert_eq!(
                sim.host_numa_stats(),
                HostNumaStats {
                    allocations: stats.allocations + 1,
                    reservations: stats.reservations + 1,
                    mappings: stats.mappings + 1,
                    ..stats
                }
            );
            let now = sim.stats();
            assert_eq!(now.registered_ranges, ranges + 1, "page-locked");
            assert_eq!((now.async_copies, now.sync_copies), (2, 0), "{now:?}");
            let census = census.expect("move_pages");
            assert_eq!(census.on_node, census.pages, "{census:?}");
        }
        drop(mem);
        if let Some((ranges, stats)) = before {
            let sim = Sim::get();
            assert_eq!(sim.host_numa_stats(), stats, "everything given back");
            assert_eq!(sim.stats().registered_ranges, ranges);
        }
    }
);

sim_test!(
    /// A host-NUMA pool with its release threshold raised: a block is usable by the host at once
    /// and copied both ways; freed, it stays in the pool past the next synchronisation (an
    /// allocation of another size waits for the stream), and the next allocation of its size
    /// gets it back without a new one; the pool's memory goes when the pool does.
    host_numa_pool_keeps_freed_blocks_and_gives_all_back,
    env: [("CUDA_SIM_DELAY_US", "200")],
    {
        let node = host_node();
        let driver = Driver::open(0).expect("the device");
        let before = sim_state();
        let pool = match driver.host_numa_pool(node) {
            Err(e) if declined(&e) => return,
            other => other.expect("a host-NUMA pool"),
        };
        let mut block = pool.alloc(8 * MIB).expect("a block");
        round_trip(&driver, block.as_mut_slice());
        let first: NonNull<u8> = block.as_ptr();
        drop(block);
        let other = pool.alloc(16 * MIB).expect("a larger block");
        let made = (!sim::real_driver()).then(|| Sim::get().host_numa_stats().pool_blocks_made);
        let again = pool.alloc(8 * MIB).expect("a block again");
        eprintln!("reused: {}", again.as_ptr() == first);
        if let (Some((ranges, stats)), Some(made)) = (before, made) {
            let sim = Sim::get();
            let now = sim.host_numa_stats();
            assert_eq!(now.pool_blocks_made, made, "the freed block was kept: none made");
            assert_eq!(again.as_ptr(), first);
            assert_eq!(
                now,
                HostNumaStats {
                    pools: stats.pools + 1,
                    pool_blocks: stats.pool_blocks + 2,
                    pool_blocks_made: stats.pool_blocks_made + 2,
                    ..stats
                }
            );
            assert_eq!(sim.stats().registered_ranges, ranges + 2, "page-locked");
        }
        drop((again, other));
        drop(pool);
        if let Some((ranges, stats)) = before {
            let sim = Sim::get();
            let now = sim.host_numa_stats();
            assert_eq!(
                (now.pools, now.pool_blocks),
                (stats.pools, stats.pool_blocks),
                "everything given back: {now:?}"
            );
            assert_eq!(sim.stats().registered_ranges, ranges);
        }
    }
);

sim_test!(
    /// A driver that refuses the node (no `CAP_SYS_NICE`: `CUDA_ERROR_NOT_PERMITTED`) is an
    /// error naming the call and the code, and leaves nothing behind.
    a_refused_node_is_reported,
    env: [("CUDA_SIM_FAIL", "cuMemCreate:800")],
    {
        require!(!sim::real_driver(), "the refusal is the simulator's");
        let driver = Driver::open(0).expect("the device");
        let e = driver.host_numa_memory(host_node(), MIB).expect_err("refused");
        assert_eq!(
            e,
            Error::Cuda {
                call: "cuMemCreate",
                code: 800,
                name: "CUDA_ERROR_NOT_PERMITTED"
            }
        );
        assert_eq!(Sim::get().host_numa_stats(), HostNumaStats::default());
    }
);

sim_test!(
    /// A libcuda without host-NUMA memory (before CUDA 10.2) is reported as lacking the entry,
    /// not a crash, and the rest of the driver still works.
    a_driver_without_the_entries_reports_them,
    env: [("LD_LIBRARY_PATH", sim::without_host_numa())],
    {
        require!(
            !sim::real_driver(),
            "needs the simulator built without host-NUMA memory"
        );
        let driver = Driver::open(0).expect("the device");
        let e = driver.host_numa_memory(host_node(), MIB).expect_err("no entries");
        assert_eq!(
            e,
            Error::CudaUnavailable {
                reason: "libcuda lacks cuMemGetAllocationGranularity"
            }
        );
        let e = driver.host_numa_pool(host_node()).expect_err("no entries");
        assert_eq!(e.to_string(), "CUDA unavailable: libcuda lacks cuMemPoolCreate");
        let mut bytes = vec![7u8; MIB];
        round_trip(&driver, &mut bytes);
    }
);

/// `CUmemAllocationProp`, for the calls `misuse_is_refused` makes itself.
#[repr(C)]
struct Prop {
    kind: u32,
    handle_types: u32,
    location: [i32; 2],
    win32: *mut std::ffi::c_void,
    flags: [u8; 8],
}

/// The simulator's prototypes of those calls.
type CreateFn = unsafe extern "C" fn(*mut u64, usize, *const Prop, u64) -> u32;
type MapFn = unsafe extern "C" fn(u64, usize, usize, u64, u64) -> u32;
type RangeFn = unsafe extern "C" fn(u64, usize) -> u32;
type ReserveFn = unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> u32;
type ReleaseFn = unsafe extern "C" fn(u64) -> u32;

sim_test!(
    /// The simulator refuses what the driver refuses: mapping outside a reservation, over a
    /// mapping or with a released handle, freeing a range still mapped or of another size,
    /// unmapping part of a mapping, releasing twice (CUDA_ERROR_INVALID_VALUE = 1,
    /// CUDA_ERROR_INVALID_HANDLE = 400).
    misuse_is_refused,
    env: [],
    {
        require!(!sim::real_driver(), "checks the simulator");
        let _driver = Driver::open(0).expect("the device"); // its context is current
        let sim = Sim::get();
        // SAFETY: each type is the simulator's C prototype of the function.
        let (create, map, unmap, address_free, reserve, release) = unsafe {
            (
                sim.function::<CreateFn>("cuMemCreate"),
                sim.function::<MapFn>("cuMemMap"),
                sim.function::<RangeFn>("cuMemUnmap"),
                sim.function::<RangeFn>("cuMemAddressFree"),
                sim.function::<ReserveFn>("cuMemAddressReserve"),
                sim.function::<ReleaseFn>("cuMemRelease"),
            )
        };
        let prop = Prop {
            kind: 1,                                  // pinned
            handle_types: 0,
            location: [3, host_node() as i32],        // host-NUMA
            win32: std::ptr::null_mut(),
            flags: [0; 8],
        };
        let (mut handle, mut va) = (0u64, 0u64);
        // SAFETY: (whole block) valid out-pointers and a valid property struct; the ranges
        // named are the simulator's own or refused before it touches them, and every step
        // that succeeds is undone below.
        unsafe {
            assert_eq!(create(&mut handle, 2 * MIB, &prop, 0), 0);
            assert_eq!(reserve(&mut va, 4 * MIB, 0, 0, 0), 0);
            assert_eq!(map(va + (64 << 30), 2 * MIB, 0, handle, 0), 1, "not reserved");
            assert_eq!(map(va, 2 * MIB, 0, handle, 0), 0);
            assert_eq!(map(va, 2 * MIB, 0, handle, 0), 1, "already mapped");
            assert_eq!(address_free(va, 4 * MIB), 1, "still mapped");
            assert_eq!(unmap(va, MIB), 1, "part of a mapping");
            assert_eq!(release(handle), 0, "released while mapped: kept until unmapped");
            assert_eq!(sim.host_numa_stats().allocations, 1);
            assert_eq!(release(handle), 1, "released twice");
            assert_eq!(unmap(va, 2 * MIB), 0);
            assert_eq!(map(va, 2 * MIB, 0, handle, 0), 400, "a released handle");
            assert_eq!(address_free(va, 2 * MIB), 1, "not the reserved size");
            assert_eq!(address_free(va, 4 * MIB), 0);
        }
        assert_eq!(sim.host_numa_stats(), HostNumaStats::default());
    }
);
