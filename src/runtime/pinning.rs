//! Why an allocator value's blocks are not page-locked, found when its target is resolved (where
//! CUDA may be called): one reason per cause, for its placement, its stats and `PinnedBuf`.

use super::GpuTarget;
use crate::chunk::PinPolicy;
use crate::config::Config;
use crate::cuda;
use crate::process;
use crate::Error;

/// The driver probe's error, when the driver is not usable; never probes in a forked child (it
/// would call CUDA there).
pub(super) fn cuda_unusable() -> Option<&'static Error> {
    if process::in_child() {
        None
    } else {
        cuda::probe_error()
    }
}

/// Why blocks for the allocator's own target are not page-locked (`None`: they are), from what
/// resolving it found.
pub(super) fn pinning_off(
    config: &Config,
    names_gpu: bool,
    target: &mut GpuTarget,
) -> Option<Error> {
    if !PinPolicy::of(config.pin).asked() {
        return Some(Error::PinningOff);
    }
    if target.gpu.is_some() {
        return None;
    }
    if !names_gpu {
        return Some(Error::NodeTarget);
    }
    if let Some(e) = target.unpinned.take() {
        return Some(e);
    }
    // The GPU was not looked up: a forked child never asks the driver, nor does a process
    // without one.
    Some(if process::in_child() {
        Error::CudaUnavailable {
            reason: cuda::FORKED_REASON,
        }
    } else if let Some(driver) = cuda::probe_error() {
        Error::DriverUnusable { driver }
    } else {
        Error::CudaUnavailable {
            reason: "no CUDA device was found for the allocator's target",
        }
    })
}
