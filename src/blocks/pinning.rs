//! What a request's blocks are made with, and `pin=strict`'s promise: every block it hands out is
//! page-locked, or the request fails. When nothing can be page-locked for the request's target (no
//! driver, no GPU for it, a forked child, `pin_limit=0`) the request fails before its kind is even
//! looked up in the cache, so that no cached unpinned block serves it and nothing is mapped or populated.
//!
//! Every registration the allocator makes goes through [`Blocks::register`]: counted, timed,
//! and held within the pinned limit.

use std::time::Instant;

use super::{Blocks, Resolved, Settings};
use crate::arena::{Kind, Shortage, CHUNK_MAX};
use crate::chunk::{page_locked_bytes, Memory, PinFlags};
use crate::config::{PinMode, MAX_REGISTER_MAX, MIN_REGISTER_MAX};
use crate::cuda::{self, Gpu, RegisterFlags};
use crate::process::{self, NODES};
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
        if settings.pin != PinMode::Strict {
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

impl Blocks {
    /// The longest chunk made of a kind: the registration bound (`register_max=`, taken into
    /// 2 MiB to 1 GiB) when pinned, so that one registration never covers more; else
    /// [`CHUNK_MAX`].
    pub(crate) fn chunk_max(&self, pinned: bool) -> usize {
        if !pinned {
            return CHUNK_MAX;
        }
        self.settings
            .register_max
            .clamp(MIN_REGISTER_MAX, MAX_REGISTER_MAX)
            .next_multiple_of(MIN_REGISTER_MAX)
            .min(CHUNK_MAX)
    }

    /// What the blocks made for `target` are made with (see [`Kind`]); under `pin=strict`, why
    /// none can be made when they could not be page-locked.
    pub(crate) fn kind(&self, target: &Resolved) -> Result<Kind, Error> {
        let pinned = self.settings.pin != PinMode::Off && target.gpu.is_some_and(Gpu::usable);
        let no_room = self.settings.pin_limit == 0;
        if self.settings.pin == PinMode::Strict && (!pinned || no_room) {
            // Resolved with a usable GPU, a target loses it only to a fork.
            return Err(target.unpinnable.unwrap_or(Unpinnable::Forked).error());
        }
        Ok(self.kind_of(pinned))
    }

    /// What a block made under this value's policy is made with, pinned or not.
    pub(crate) fn kind_of(&self, pinned: bool) -> Kind {
        let flags = if pinned {
            self.pin_flags().register
        } else {
            RegisterFlags::default()
        };
        Kind {
            policy: self.settings.policy,
            pinned,
            flags,
            lazy: !pinned && !self.populates(),
            verified: self.settings.verify,
        }
    }
}

impl Blocks {
    /// The flags and limit this value registers with.
    pub(crate) fn pin_flags(&self) -> PinFlags {
        PinFlags {
            register: RegisterFlags {
                devicemap: self.settings.pin_devicemap,
                read_only: self.settings.pin_read_only,
            },
            limit: self.settings.pin_limit,
        }
    }

    /// Registers `memory` (populated) whole through `gpu` (none: an error), timed and counted.
    /// Past the pinned limit, idle page-locked memory (wholly free pinned chunks not reserved,
    /// cached pinned blocks) is given back first, then the limit refuses ([`Error::PinLimit`],
    /// counted in `pin_limited`).
    pub(crate) fn register(
        &self,
        gpu: Option<&'static Gpu>,
        memory: &mut Memory,
    ) -> Result<(), Error> {
        let len = memory.len();
        // Tests simulate a failed registration, GPU or not (never compiled without the feature).
        #[cfg(feature = "fault-injection")]
        if let Some(code) = crate::sys::fault::injected(crate::sys::fault::FaultPoint::Register) {
            let e = cuda::simulated_register_error(code as u32);
            self.counters.record_pin_failure(&e);
            return Err(e);
        }
        let Some(gpu) = gpu else {
            // Strict means pinned or nothing. `Blocks::kind` refuses such a target before
            // anything is mapped; this keeps any other way here from handing one out.
            return Err(Error::CudaUnavailable {
                reason: "pin=strict, but there is no GPU to register blocks with",
            });
        };
        let flags = self.pin_flags();
        let mut over = page_locked_bytes()
            .saturating_add(len)
            .saturating_sub(flags.limit);
        // Idle page-locked memory may be spread over nodes: each gives back what it can.
        for node in self.topology.nodes().iter().map(|n| n.id) {
            if over == 0 {
                break;
            }
            // Only arenas there are: a node never used holds nothing page-locked.
            let idle = NODES
                .existing(node)
                .map_or(0, |arena| arena.lock().releasable(Shortage::PageLocked));
            let ask = over.min(idle);
            if ask > 0 && self.give_back_for(node, ask, Shortage::PageLocked) {
                over -= ask;
            }
        }
        let start = Instant::now();
        let registered = memory.register(gpu, flags);
        match &registered {
            Ok(_) => {
                self.counters.pin.record(start.elapsed());
                self.counters.registrations.incr();
                if len > self.chunk_max(true) {
                    self.counters.oversized_registrations.incr();
                }
            }
            Err(Error::PinLimit { .. }) => self.counters.pin_limited.incr(),
            Err(e) => {
                self.counters.pin.record(start.elapsed());
                self.counters.record_pin_failure(e);
            }
        }
        registered
    }
}
