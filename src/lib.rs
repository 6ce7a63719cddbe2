#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(clippy::missing_safety_doc)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Modules by layer, bottom first: the map of ARCHITECTURE.md ("The layers"). A
// module imports only from its own layer and those below, never in a loop; `scripts/layers.py`
// checks it in CI.
// - layer 1, error and sys: the error type (and the local NUMA distance it cites); the only raw
//   system calls;
// - layer 2, topology, config, setup, stats, guard and fork: sysfs, PCI and cgroups; the settings;
//   the counters; the re-entrancy flag; the fork generation;
// - layer 3, cuda: the driver table, devices, contexts, registration, events; `cuda_driver`;
// - layer 4, chunk: a mapping and its registration;
// - layer 5, arena: the carving allocator over chunks;
// - layer 6, process: the initialisation lock, the node table, the fork handlers, the workers;
// - layer 7, blocks and pool: the large path's one owner: allocate, free, resize, trim, reserve;
//   what a shared pool keeps in its file (header, carving state) and its placement;
// - layer 8, runtime: one allocator value's state: settings, targets, routes; owns its blocks;
// - layer 9, stats_exit: the report at exit;
// - layer 10, alloc, pinned, reservation, shared and unstable: the front ends, and the
//   unstable tools.
// The numbered groups below gather the declarations by job; they are not the layers.

// 1. The error type (with its CUDA error names) and the only raw system calls.
mod error;
pub use error::{Error, Result};
mod sys;
pub use sys::MemPolicy;

// 2. The host's NUMA topology (sysfs, PCI, cgroups), the settings, the CUDA driver.
mod topology;
pub use topology::pci::PciAddress;
pub use topology::{closest_node_to_gpu, NodeInfo, NumaTopology, LOCAL_NUMA_DISTANCE};
pub use topology::{NumaAllocTracker, NumaBuffer};
mod config;
pub use config::{Config, GpuSelector, PinMode, Reserve, StatsAtExit, Target, ENV_VAR};
mod cuda;

// 3. Arenas, chunks and blocks: placed (and pinned) memory, carved and given back.
mod arena;
mod chunk;
mod fork;

// 4. Process-wide state, the re-entrancy guard, the large path's owner, the runtime and its routes.
mod blocks;
mod guard;
#[cfg(target_os = "linux")]
mod pool;
mod process;
mod runtime;
mod setup;
pub use runtime::Placement;
pub use runtime::{bind_thread, thread_route, with_route, Route, RouteGuard};

// 5. Statistics and the report at exit.
mod stats;
mod stats_exit;
pub use stats::{CudaErrorCount, Fallbacks, GpuStats, HeapStats, NodeStats, Stats, TimeStats};

// 6. The front ends: GlobalAlloc, allocator-api2, the const builder.
mod alloc;
mod reservation;
pub use alloc::NumaGpuAlloc;
pub use reservation::{Reservation, ReserveProgress};
#[cfg(target_os = "linux")]
mod shared;
#[cfg(target_os = "linux")]
pub use shared::{
    PoolAttach, PoolHandle, PoolRegistration, PoolStats, RegisterProgress, SharedBlock, SharedPool,
    SharedPoolBuilder,
};
mod pinned;
pub use pinned::{cuda_driver_present, cuda_unavailable_reason};
#[cfg(feature = "pinned-buffer")]
#[cfg_attr(docsrs, doc(cfg(feature = "pinned-buffer")))]
pub use pinned::{PinnedBuf, PinnedSliceMut};

// Tools for the crate's own benchmarks, examples and test programs, outside the stable surface.
pub mod unstable;
