#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(clippy::missing_safety_doc)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Pipeline order: topology → GPU lookup → placement syscalls → CUDA registration → arenas →
// stats/config → front ends.
mod error;
pub use error::{Error, Result};

pub use topology::{closest_node_to_gpu, NodeInfo, NumaTopology, LOCAL_NUMA_DISTANCE};
mod topology;
pub mod sysfs;
pub use buffer::{NumaAllocTracker, NumaBuffer};
mod buffer;
pub mod pci;

pub mod sys;
mod cuda;
pub use cuda::cuda_driver_present;
