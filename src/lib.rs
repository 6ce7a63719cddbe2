#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(clippy::missing_safety_doc)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Pipeline order: topology → GPU lookup → placement syscalls → CUDA registration → arenas →
// stats/config → front ends.
mod error;
pub use error::{Error, Result};

pub use topology::{closest_node_to_gpu, NodeInfo, NumaTopology, LOCAL_NUMA_DISTANCE};
pub mod sysfs;
mod topology;
pub use buffer::{NumaAllocTracker, NumaBuffer};
mod buffer;
pub mod pci;

mod cuda;
pub mod sys;
pub use cuda::cuda_error_name;
pub use cuda::tools as cuda_driver;

mod arena;
mod block;
mod carved;
mod cgroup;
mod chunk;
mod config;
mod decay_thread;
mod fork;
mod guard;
mod lock;
mod pinning;
mod process;
mod reserve;
mod runtime;
mod setup;
mod stats;
mod stats_exit;
mod stats_json;
pub use config::{parse_size, Config, GpuSelector, PinMode, Reserve, StatsAtExit, Target, ENV_VAR};
pub use runtime::Placement;
pub use stats::{CudaErrorCount, Fallbacks, GpuStats, HeapStats, NodeStats, Stats, TimeStats};
pub use sys::MemPolicy;

mod alloc;
mod api2;
mod global;
mod pinned;
mod route;
pub use alloc::NumaGpuAlloc;
pub use pinned::{cuda_driver_present, cuda_unavailable_reason};
#[cfg(feature = "pinned-buffer")]
#[cfg_attr(docsrs, doc(cfg(feature = "pinned-buffer")))]
pub use pinned::{PinnedBuf, PinnedSliceMut};
pub use route::{bind_thread, thread_route, with_route, Route, RouteGuard};
