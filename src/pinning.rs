//! What a request's blocks are made with, and `pin=strict`'s promise: every block it hands out is
//! page-locked, or the request fails. When nothing can be page-locked for the request's target (no
//! driver, no GPU for it, a forked child) the request fails before its kind is even looked up in
//! the cache, so that no cached unpinned block serves it and nothing is mapped or populated.

use crate::arena::Kind;
use crate::config::{Config, PinMode};
use crate::cuda::{self, Gpu};
use crate::process;
use crate::runtime::{Resolved, Runtime};
use crate::Error;

/// Why blocks for a target cannot be page-locked, found when the target is resolved (where CUDA
/// may be called) and kept with it for its requests (which may not call CUDA).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Unpinnable {
    /// A child forked after CUDA was initialised: the GPU's context is the parent's.
    Forked,
    /// The target is a node's, not a GPU's.
    NodeTarget,
    /// The driver probe failed with this.
    NoDriver(&'static Error),
    /// The driver knows no device the selector names.
    NoDevice,
    /// The device was found, its primary context could not be retained.
    NoContext,
}

impl Unpinnable {
    /// Why `pin=strict` refuses a target resolved to `gpu` (`ordinal`: the device the driver
    /// found for it; `names_gpu`: the target is a GPU's, not a node's). `None` when its blocks
    /// can be page-locked, or pinning is not strict.
    pub(crate) fn of(
        config: &Config,
        names_gpu: bool,
        gpu: Option<&Gpu>,
        ordinal: Option<u32>,
    ) -> Option<Unpinnable> {
        if config.pin != PinMode::Strict || gpu.is_some_and(Gpu::usable) {
            return None;
        }
        Some(if !names_gpu {
            Unpinnable::NodeTarget
        } else if process::in_child() || gpu.is_some() {
            Unpinnable::Forked
        } else if ordinal.is_some() {
            Unpinnable::NoContext
        } else if let Some(e) = cuda::probe_error() {
            // Probed already: resolving a GPU target asked the driver first.
            Unpinnable::NoDriver(e)
        } else {
            Unpinnable::NoDevice
        })
    }

    /// The error a refused request reports (no heap data: built on the allocation path).
    pub(crate) fn error(self) -> Error {
        let (reason, driver) = match self {
            Unpinnable::Forked => (cuda::FORKED_REASON, None),
            Unpinnable::NodeTarget => (
                "the target is a NUMA node (node=, node=local or a node route), not a GPU",
                None,
            ),
            Unpinnable::NoDriver(e) => ("no usable CUDA driver", Some(e)),
            Unpinnable::NoDevice => ("no CUDA device matches the GPU selector", None),
            Unpinnable::NoContext => ("the GPU's primary context could not be retained", None),
        };
        Error::StrictPinning { reason, driver }
    }
}

impl Runtime {
    /// What the blocks made for `target` are made with (see [`Kind`]); under `pin=strict`, why
    /// none can be made when they could not be page-locked.
    pub(crate) fn kind(&self, target: &Resolved) -> Result<Kind, Error> {
        let pinned = self.config.pin != PinMode::Off && target.gpu.is_some_and(Gpu::usable);
        if self.config.pin == PinMode::Strict && !pinned {
            // Resolved with a usable GPU, a target loses it only to a fork.
            return Err(target.unpinnable.unwrap_or(Unpinnable::Forked).error());
        }
        Ok(Kind {
            policy: self.config.policy,
            pinned,
            devicemap: pinned && self.config.pin_devicemap,
            read_only: pinned && self.config.pin_read_only,
        })
    }
}
