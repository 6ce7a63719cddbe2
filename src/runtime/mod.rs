//! One allocator value's state, built once on the first large request: its settings (builder +
//! environment), the topology, the target GPU and its host node, and the targets of threads'
//! routes. Its large path is [`Blocks`]'s (its placement rules, pin policy and counters), over
//! what the process's first initialisation made for every value (`process/large.rs`).

mod pinning;
mod reserve;
pub(crate) mod route;

pub use route::{bind_thread, thread_route, with_route, Route, RouteGuard};

use std::borrow::Cow;
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;

pub(crate) use crate::blocks::Resolved;
use crate::blocks::{Blocks, Settings, Unpinnable};
use crate::chunk::PinPolicy;
use crate::config::{config_error, Config, GpuSelector, Reserve, Setting, Target};
use crate::cuda::{self, Device, Gpu};
use crate::process::{self, policy_nodes, LargePath};
use crate::setup::{Problems, Setup};
use crate::stats::{NodeStats, Stats};
use crate::sys::lock::Lock;
use crate::sys::{self, NodeMask};
use crate::topology::pci::{self, PciAddress};
use crate::{Error, NumaTopology};
use pinning::{cuda_unusable, pinning_off};

/// Where an allocator places its blocks, as resolved at initialisation.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Placement {
    /// The node blocks are placed on (for `policy=interleave`: the node they are accounted to).
    pub host_node: usize,
    /// The GPU's own node, when a GPU is targeted and its node is known.
    pub home_node: Option<usize>,
    /// CUDA ordinal of the GPU blocks are registered with.
    pub gpu_ordinal: Option<u32>,
    /// PCI address of the targeted GPU (from CUDA, or from the `gpu=pci:` setting).
    pub gpu_pci: Option<PciAddress>,
    /// Device name reported by CUDA.
    pub gpu_name: Option<String>,
    /// Whether blocks are page-locked with CUDA.
    pub pinning: bool,
    /// Why they are not, when `pinning` is false: [`Error::PinningOff`] (`pin=off`),
    /// [`Error::DriverUnusable`], [`Error::NodeTarget`], the GPU lookup's error
    /// ([`Error::GpuNotFound`], [`Error::CudaUnavailable`] when no device is visible or in a
    /// forked child, [`Error::Cuda`] when its context could not be retained).
    pub pinning_off: Option<Error>,
    /// Whether blocks are placed with `mbind` (false once the kernel refused it).
    pub numa_placement: bool,
}

// `NumaGpuAlloc` shares its runtime between threads through a pointer (see `process/mod.rs`).
const _: () = {
    const fn shared_between_threads<T: Send + Sync>() {}
    shared_between_threads::<Runtime>()
};

/// Setup problems printed one per line; the rest are counted in one line.
const PRINTED_PROBLEMS: usize = 8;

pub(crate) struct Runtime {
    /// Tells runtimes apart in threads' caches of resolved routes (an address may be reused).
    pub(crate) id: u64,
    pub(crate) config: Config,
    /// The process's topology, or the value's own where it names another sysfs root.
    pub(crate) topology: Cow<'static, NumaTopology>,
    /// Where blocks go for threads without a route (and for every thread when the allocator
    /// names its own target).
    pub(crate) default: Resolved,
    pub(crate) home_node: Option<usize>,
    /// The targeted GPU, when CUDA found it.
    device: Option<Device>,
    /// Why the default target's blocks are not page-locked, found at initialisation (a fork
    /// since is looked at when asked: see [`Self::pinning_off`]).
    pinning_off: Option<Error>,
    gpu_pci: Option<PciAddress>,
    /// Routes resolved so far, and the problems met resolving them. Taken only under the
    /// initialisation lock (`process::INIT`), which a fork handler holds: never held at a fork.
    routes: Lock<Routes>,
    /// The large path: blocks, the arenas they live in, the counters.
    pub(crate) blocks: Blocks,
    setup_errors: Vec<Error>,
    /// Those this value prints once initialised (see [`Problems::sort_out`]).
    unprinted: Vec<Error>,
}

/// Routes a runtime resolved, with the errors met (reported in the stats).
#[derive(Default)]
struct Routes {
    resolved: Vec<(Route, Resolved)>,
    errors: Vec<Error>,
}

impl Runtime {
    /// Builds the runtime from the builder's settings and the environment's (`setup`). Never
    /// fails: every problem is recorded and a degraded mode chosen.
    pub(crate) fn new(builder: Config, setup: &mut Setup) -> Runtime {
        // The process's large path: made by its first initialisation, shared afterwards (the
        // environment names no sysfs root: the builder's is the value's).
        let process = process::large_path(setup, builder.sysfs_root);
        let env = setup.env();
        let mut config = builder;
        env.apply_to(&mut config);
        // A problem is the environment's when it comes from a setting the environment gave.
        let mut problems = Problems::default();
        problems.add(env.errors.iter().cloned(), true);
        let (topology, topology_error) = process.topology_at(config.sysfs_root);
        let allowed_mask = allowed_for(&config, process);
        let allowed = |node: usize| allowed_mask.is_none_or(|mask| mask.contains(node));
        let mut errors = Vec::new();
        let (host_node, mut target) = resolve_target(&config, &topology, &allowed, &mut errors);
        problems.add(
            errors,
            env.sets(|s| matches!(s, Setting::Target(_) | Setting::Pin(_))),
        );
        if config.pin_read_only
            && target.device.as_ref().and_then(Device::read_only_register) == Some(false)
        {
            // Registering with READ_ONLY would fail for every block: register without it.
            let error = Error::Config {
                key: "readonly".to_owned(),
                value: "on".to_owned(),
                expected: "off on this GPU: it reports \
                           CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED (113) = 0; blocks \
                           are registered without CU_MEMHOSTREGISTER_READ_ONLY",
            };
            problems.add(
                Some(error),
                env.sets(|s| matches!(s, Setting::PinReadOnly(_))),
            );
            config.pin_read_only = false;
        }
        let Reserve {
            blocks, block_size, ..
        } = config.reserve;
        if blocks > 0 {
            // Said now, with the other setup problems (the reservation itself comes later).
            problems.add(
                crate::blocks::reserve::check(config.threshold, blocks, block_size).err(),
                env.sets(|s| matches!(s, Setting::Reserve(_))),
            );
        }
        let ordinal = target.device.as_ref().map(Device::ordinal);
        let names_gpu = !matches!(config.target, Target::Node(_) | Target::LocalNode);
        let pinning_off = pinning_off(&config, names_gpu, &mut target);
        let unpinnable = Unpinnable::of(&Settings::of(&config), names_gpu, target.gpu, ordinal);
        // Said once per process, whoever asked for pin=strict: every refused request has it too.
        problems.add(unpinnable.map(Unpinnable::error), true);
        let (setup_errors, unprinted) = problems.sort_out(setup);
        let nodes = policy_nodes(config.policy, &topology, &allowed, host_node);
        let gpu_pci = target
            .device
            .as_ref()
            .map(Device::pci_address)
            .or(target.gpu_pci);
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Runtime {
            id: IDS.fetch_add(1, Relaxed),
            blocks: Blocks::new(config, topology_error, process),
            default: Resolved {
                host_node,
                nodes,
                gpu: target.gpu,
                ordinal,
                unpinnable,
            },
            home_node: target.home_node,
            device: target.device,
            pinning_off,
            gpu_pci,
            routes: Lock::new(Routes::default()),
            topology,
            setup_errors,
            unprinted,
            config,
        }
    }

    /// Setup problems, printed once by the allocator after initialisation (not during it:
    /// stderr's lock may be held by a thread waiting for this initialisation): the first
    /// [`PRINTED_PROBLEMS`], then a line that counts the rest (a value of thousands of bad keys
    /// prints a screenful, not thousands of lines; the stats list them all).
    pub(crate) fn report_setup_errors(&self) {
        for e in self.unprinted.iter().take(PRINTED_PROBLEMS) {
            // One line each (a key may hold a newline), marked as the crate's as every line it
            // prints.
            let _ = writeln!(
                std::io::stderr(),
                "numa-gpu-alloc: {}",
                one_line(&e.to_string())
            );
        }
        if let Some(more) = self.unprinted.len().checked_sub(PRINTED_PROBLEMS) {
            if more > 0 {
                let _ = writeln!(
                    std::io::stderr(),
                    "numa-gpu-alloc: and {more} more setup problems (the stats list them all: \
                     `stats=exit`, `stats().config_errors`)"
                );
            }
        }
    }

    /// Whether the default target's blocks are page-locked (not in a child forked since).
    pub(crate) fn pinning(&self) -> bool {
        self.default.gpu.is_some_and(Gpu::usable)
    }

    /// Why the default target's blocks are not page-locked; `None` when they are.
    pub(crate) fn pinning_off(&self) -> Option<Error> {
        match self.default.gpu {
            Some(gpu) if !gpu.usable() => Some(Error::CudaUnavailable {
                reason: cuda::FORKED_REASON,
            }),
            _ => self.pinning_off.clone(),
        }
    }

    pub(crate) fn placement(&self) -> Placement {
        Placement {
            host_node: self.default.host_node,
            home_node: self.home_node,
            gpu_ordinal: self.device.as_ref().map(Device::ordinal),
            gpu_pci: self.gpu_pci,
            gpu_name: self.device.as_ref().map(Device::name),
            pinning: self.pinning(),
            pinning_off: self.pinning_off(),
            numa_placement: self.blocks.numa_placement(),
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        let mut stats = Stats {
            initialized: true,
            threshold: self.config.threshold,
            host_node: Some(self.default.host_node),
            home_node: self.home_node,
            gpu: self
                .device
                .as_ref()
                .map(|d| format!("{} ({}) {}", d.ordinal(), d.pci_address(), d.name())),
            pinning: self.pinning(),
            pinning_off: self.pinning_off(),
            page_locked_bytes: crate::chunk::page_locked_bytes(),
            pin_limit: (self.config.pin_limit != usize::MAX).then_some(self.config.pin_limit),
            nodes: self
                .topology
                .node_ids()
                .iter()
                .map(|&node| NodeStats {
                    node,
                    ..NodeStats::default()
                })
                .collect(),
            numa_unavailable: self.blocks.numa_unavailable(),
            config_errors: self.setup_errors.clone(),
            ..Stats::default()
        };
        {
            // The routes lock is only taken under the initialisation lock (see `routes`).
            let _init = crate::process::INIT.lock();
            let routes = self.routes.lock();
            stats.config_errors.extend(routes.errors.iter().cloned());
        }
        self.blocks.stats().fill(&mut stats);
        stats
    }

    /// Where a thread bound to `route` places blocks; resolved once per route and runtime (under
    /// the initialisation lock: GPU lookups may be slow, and a fork must not copy a half-done one). Never fails: problems are
    /// recorded (see [`Stats::config_errors`]) and the same fallbacks as at initialisation
    /// taken.
    pub(crate) fn resolve(&self, route: Route) -> Resolved {
        let _init = crate::process::INIT.lock();
        let mut routes = self.routes.lock();
        if let Some((_, resolved)) = routes.resolved.iter().find(|(r, _)| *r == route) {
            return *resolved;
        }
        let allowed_mask = allowed_for(&self.config, self.blocks.process());
        let allowed = |node: usize| allowed_mask.is_none_or(|mask| mask.contains(node));
        let mut errors = Vec::new();
        let (host_node, gpu, ordinal) = match route {
            Route::Node(node) => (
                explicit_node(&self.topology, node, &allowed, &mut errors),
                None,
                None,
            ),
            Route::LocalNode => (calling_thread_node(&self.topology, &allowed), None, None),
            Route::Gpu(selector) => {
                let pinning = PinPolicy::of(self.config.pin).asked();
                let target = find_gpu(&self.config, selector, pinning, &mut errors);
                let host = target
                    .home_node
                    .and_then(|home| host_node(&self.topology, home, &allowed, &mut errors))
                    .unwrap_or(self.default.host_node);
                (
                    host,
                    target.gpu,
                    target.device.as_ref().map(Device::ordinal),
                )
            }
        };
        let names_gpu = matches!(route, Route::Gpu(_));
        let unpinnable = Unpinnable::of(&self.blocks.settings, names_gpu, gpu, ordinal);
        errors.extend(unpinnable.map(Unpinnable::error));
        let resolved = Resolved {
            host_node,
            nodes: policy_nodes(self.config.policy, &self.topology, &allowed, host_node),
            gpu,
            ordinal,
            unpinnable,
        };
        routes.resolved.push((route, resolved));
        routes.errors.extend(errors);
        resolved
    }
}

/// The memory nodes the process's cpuset allows, as they apply to targets read from `config`'s
/// sysfs tree: the cpuset describes this kernel's nodes, not a fixture tree's (`None`: all).
fn allowed_for(config: &Config, process: &LargePath) -> Option<NodeMask> {
    (config.sysfs_root == Config::DEFAULT.sysfs_root)
        .then(|| process.allowed())
        .flatten()
}

/// What the GPU selector led to.
#[derive(Default)]
struct GpuTarget {
    home_node: Option<usize>,
    device: Option<Device>,
    gpu: Option<&'static Gpu>,
    gpu_pci: Option<PciAddress>,
    /// Why `gpu` is `None` although pinning was asked for, when the lookup said.
    unpinned: Option<Error>,
}

/// Chooses the host node, and the GPU to pin for. Never fails: each problem is recorded in
/// `errors` and a fallback taken, down to the calling thread's node.
fn resolve_target(
    config: &Config,
    topology: &NumaTopology,
    allowed: &dyn Fn(usize) -> bool,
    errors: &mut Vec<Error>,
) -> (usize, GpuTarget) {
    let pinning = PinPolicy::of(config.pin).asked();
    let selector = match config.target {
        Target::Node(_) | Target::LocalNode => None,
        // The driver (cuInit, no context unless pinning) tells which GPU and so which node; so
        // for `gpu=current`, on threads without a current context. A forked child never asks
        // it (nor waits for a probe its parent had under way): only one that wants pinning is
        // told why it gets none.
        Target::Default | Target::Gpu(GpuSelector::Current) => {
            if process::in_child() {
                pinning.then_some(GpuSelector::Auto)
            } else {
                cuda::driver_present().then_some(GpuSelector::Auto)
            }
        }
        Target::Gpu(selector) => Some(selector),
    };
    let target = selector.map_or_else(GpuTarget::default, |selector| {
        find_gpu(config, selector, pinning, errors)
    });
    let host_node = match config.target {
        Target::Node(node) => explicit_node(topology, node, allowed, errors),
        _ => target
            .home_node
            .and_then(|home| host_node(topology, home, allowed, errors))
            .unwrap_or_else(|| calling_thread_node(topology, allowed)),
    };
    (host_node, target)
}

/// The GPU the selector names, its home node, and its context when pinning.
fn find_gpu(
    config: &Config,
    selector: GpuSelector,
    pinning: bool,
    errors: &mut Vec<Error>,
) -> GpuTarget {
    let root = Path::new(config.sysfs_root);
    let mut target = GpuTarget {
        gpu_pci: match selector {
            GpuSelector::Pci(addr) => Some(addr),
            _ => None,
        },
        ..GpuTarget::default()
    };
    // A forked child never calls CUDA (the parent's driver state is not usable there).
    let found = if process::in_child() {
        Err(Error::CudaUnavailable {
            reason: cuda::FORKED_REASON,
        })
    } else {
        Device::find(selector)
    };
    match found {
        Ok(device) => {
            target.home_node = device.home_node(root).unwrap_or_else(|e| {
                errors.push(e);
                None
            });
            if pinning {
                target.gpu = Gpu::shared(device.clone())
                    .map_err(|e| {
                        target.unpinned = Some(e.clone());
                        errors.push(e);
                    })
                    .ok();
            }
            target.device = Some(device);
        }
        Err(e) => {
            if pinning {
                target.unpinned = Some(match cuda_unusable() {
                    Some(driver) => Error::DriverUnusable { driver },
                    None => e.clone(),
                });
            }
            // Without the driver a PCI selector still gives the home node: placement, no pinning.
            if pinning || target.gpu_pci.is_none() {
                errors.push(e);
            }
            if let Some(addr) = target.gpu_pci {
                target.home_node = pci::home_node(root, &addr).unwrap_or_else(|e| {
                    errors.push(e);
                    None
                });
            }
        }
    }
    target
}

/// `node=N`: that node when it has memory and is allowed, else the nearest that is (reported).
fn explicit_node(
    topology: &NumaTopology,
    node: usize,
    allowed: &dyn Fn(usize) -> bool,
    errors: &mut Vec<Error>,
) -> usize {
    let Some(info) = topology.node(node) else {
        errors.push(Error::UnknownNode {
            node,
            node_count: topology.node_count(),
        });
        return calling_thread_node(topology, allowed);
    };
    if info.has_memory && allowed(node) {
        return node;
    }
    if !info.has_memory {
        errors.push(config_error(
            "node",
            &node.to_string(),
            "a node with memory (using the nearest node with memory)",
        ));
    }
    host_node(topology, node, allowed, errors)
        .unwrap_or_else(|| calling_thread_node(topology, allowed))
}

/// The allowed node with memory nearest `home`; reports when the cpuset changed the choice.
fn host_node(
    topology: &NumaTopology,
    home: usize,
    allowed: &dyn Fn(usize) -> bool,
    errors: &mut Vec<Error>,
) -> Option<usize> {
    match topology.host_node_among(home, allowed) {
        Ok(host) => {
            let unrestricted = topology.host_node_for(home).unwrap_or(host);
            if unrestricted != host {
                errors.push(Error::NodeNotAllowed {
                    node: unrestricted,
                    chosen: host,
                });
            }
            Some(host)
        }
        Err(e) => {
            errors.push(e);
            None
        }
    }
}

/// The node of the calling thread, or the first node with memory when that is unknown.
fn calling_thread_node(topology: &NumaTopology, allowed: &dyn Fn(usize) -> bool) -> usize {
    let first = topology.node_ids().first().copied().unwrap_or(0);
    sys::current_node()
        .ok()
        .and_then(|node| topology.host_node_among(node, allowed).ok())
        .or_else(|| topology.host_node_among(first, allowed).ok())
        .unwrap_or(first)
}

/// `text` with control characters escaped (`\n`, `\t`, `\u{1b}`): it prints as one line.
fn one_line(text: &str) -> String {
    let mut line = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            line.extend(c.escape_default());
        } else {
            line.push(c);
        }
    }
    line
}
