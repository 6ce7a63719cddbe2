//! What a request's blocks are made with, and `pin=strict`'s promise: every block it hands out is
//! page-locked, or the request fails. When nothing can be page-locked for the request's target (no
//! driver, no GPU for it, a forked child, `pin_limit=0`) the request fails before its kind is even
//! looked up in the cache, so that no cached unpinned block serves it and nothing is mapped or populated.
//! ([`Blocks::kind`](super::Blocks::kind) asks.) Every registration goes through the placer
//! (`chunk/place.rs`): counted, timed, and held within the pinned limit.

use super::Settings;
use crate::chunk::PinPolicy;
use crate::cuda::{self, Gpu};
use crate::process;
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
    /// The pinned limit is 0: no registration can succeed, whatever the driver.
    NoPinRoom,
}

impl Unpinnable {
    /// Why `pin=strict` refuses a target resolved to `gpu` (`ordinal`: the device the driver
    /// found for it; `names_gpu`: the target is a GPU's, not a node's). `None` when its blocks
    /// can be page-locked, or pinning is not strict. A limit of 0 comes first: it fails every
    /// request with a driver or without.
    pub(crate) fn of(
        settings: &Settings,
        names_gpu: bool,
        gpu: Option<&Gpu>,
        ordinal: Option<u32>,
    ) -> Option<Unpinnable> {
        if !PinPolicy::of(settings.pin).strict() {
            return None;
        }
        if settings.pin_limit == 0 {
            return Some(Unpinnable::NoPinRoom);
        }
        if gpu.is_some_and(Gpu::usable) {
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
            Unpinnable::NoPinRoom => ("pin_limit=0 allows no page-locked byte", None),
        };
        Error::StrictPinning { reason, driver }
    }
}
