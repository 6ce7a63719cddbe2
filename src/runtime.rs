//! The large path's state, built once on the first large request: settings (builder + environment),
//! topology, the target GPU and its host node, the arena and the counters.

use std::io::Write as _;
use std::path::Path;
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::arena::Arena;
use crate::config::{Config, GpuSelector, Target, ENV_VAR};
use crate::cuda::{self, Gpu};
use crate::pci::{self, PciAddress};
use crate::stats::{Counters, NodeStats, Stats};
use crate::sys::{self, MemPolicy, NodeMask};
use crate::{Error, NumaTopology};

/// Where an allocator places its blocks, as resolved at initialisation.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// Whether blocks are placed with `mbind` (false once the kernel refused it).
    pub numa_placement: bool,
}

pub(crate) struct Runtime {
    pub(crate) config: Config,
    pub(crate) page_size: usize,
    pub(crate) topology: NumaTopology,
    pub(crate) host_node: usize,
    pub(crate) home_node: Option<usize>,
    pub(crate) gpu: Option<Gpu>,
    gpu_pci: Option<PciAddress>,
    /// Nodes the policy names: the host node, or every node with memory for interleave.
    pub(crate) nodes: NodeMask,
    /// Set when placement is impossible (kernel refusal, unreadable topology): blocks go unplaced.
    pub(crate) numa_unavailable: OnceLock<Error>,
    pub(crate) populate_threads: usize,
    pub(crate) arena: Mutex<Arena>,
    pub(crate) counters: Counters,
    setup_errors: Vec<Error>,
}

impl Runtime {
    /// Builds the runtime. Never fails: every problem is recorded and a degraded mode chosen.
    pub(crate) fn new(builder: Config) -> Runtime {
        let mut config = builder;
        let mut setup_errors = Vec::new();
        if let Some(settings) = std::env::var_os(ENV_VAR) {
            setup_errors.extend(config.apply_settings(&settings.to_string_lossy()));
        }
        let numa_unavailable = OnceLock::new();
        let root = Path::new(config.sysfs_root);
        let topology = NumaTopology::from_sysfs_root(root).unwrap_or_else(|e| {
            let _ = numa_unavailable.set(e);
            NumaTopology::single_node()
        });
        let target = resolve_target(&config, &topology, &mut setup_errors);
        // Every setup problem once, each on one line (a key may hold a newline).
        for e in &setup_errors {
            let _ = writeln!(std::io::stderr(), "{}", one_line(&e.to_string()));
        }
        let nodes = policy_nodes(&config, &topology, target.host_node);
        let populate_threads = match config.populate_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            n => n,
        };
        let pinning = target.gpu.is_some() && config.pin != crate::PinMode::Off;
        let gpu_pci = target.gpu.as_ref().map(Gpu::pci_address).or(target.gpu_pci);
        let gpu = if pinning { target.gpu } else { None };
        Runtime {
            page_size: sys::page_size(),
            arena: Mutex::new(Arena::new(&topology, target.host_node)),
            host_node: target.host_node,
            home_node: target.home_node,
            gpu_pci,
            gpu,
            nodes,
            numa_unavailable,
            populate_threads,
            counters: Counters::default(),
            topology,
            setup_errors,
            config,
        }
    }

    /// Whether blocks are still placed with `mbind`.
    pub(crate) fn numa_placement(&self) -> bool {
        self.numa_unavailable.get().is_none()
    }

    pub(crate) fn placement(&self) -> Placement {
        Placement {
            host_node: self.host_node,
            home_node: self.home_node,
            gpu_ordinal: self.gpu.as_ref().map(Gpu::ordinal),
            gpu_pci: self.gpu_pci,
            gpu_name: self.gpu.as_ref().map(Gpu::name),
            pinning: self.gpu.is_some(),
            numa_placement: self.numa_placement(),
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        let mut stats = Stats {
            initialized: true,
            threshold: self.config.threshold,
            host_node: Some(self.host_node),
            home_node: self.home_node,
            gpu: self
                .gpu
                .as_ref()
                .map(|g| format!("{} ({}) {}", g.ordinal(), g.pci_address(), g.name())),
            pinning: self.gpu.is_some(),
            nodes: self
                .topology
                .node_ids()
                .iter()
                .map(|&node| NodeStats {
                    node,
                    ..NodeStats::default()
                })
                .collect(),
            numa_unavailable: self.numa_unavailable.get().cloned(),
            config_errors: self.setup_errors.clone(),
            ..Stats::default()
        };
        self.arena.lock().fill(&mut stats.nodes);
        self.counters.fill(&mut stats);
        stats
    }
}

struct ResolvedTarget {
    host_node: usize,
    home_node: Option<usize>,
    gpu: Option<Gpu>,
    gpu_pci: Option<PciAddress>,
}

fn resolve_target(
    config: &Config,
    topology: &NumaTopology,
    errors: &mut Vec<Error>,
) -> ResolvedTarget {
    let mut resolved = ResolvedTarget {
        host_node: usize::MAX,
        home_node: None,
        gpu: None,
        gpu_pci: None,
    };
    let selector = match config.target {
        Target::Node(node) if topology.contains(node) => {
            // A node without memory cannot hold blocks: use its nearest node with memory.
            let has_memory = topology.node(node).is_some_and(|n| n.has_memory);
            resolved.host_node = if has_memory {
                node
            } else {
                match topology.host_node_for(node) {
                    Ok(host) => {
                        errors.push(Error::Config {
                            key: "node".to_owned(),
                            value: node.to_string(),
                            expected: "a node with memory (using the nearest node with memory)",
                        });
                        host
                    }
                    Err(e) => {
                        errors.push(e);
                        calling_thread_node(topology)
                    }
                }
            };
            return resolved;
        }
        Target::Node(node) => {
            errors.push(Error::UnknownNode {
                node,
                node_count: topology.node_count(),
            });
            None
        }
        Target::Gpu(selector) => Some(selector),
        Target::Default => cuda::driver_present().then_some(GpuSelector::Auto),
    };
    if let Some(selector) = selector {
        let root = Path::new(config.sysfs_root);
        if let GpuSelector::Pci(addr) = selector {
            resolved.gpu_pci = Some(addr);
        }
        match Gpu::open(selector) {
            Ok(gpu) => {
                resolved.home_node = gpu.home_node(root).unwrap_or_else(|e| {
                    errors.push(e);
                    None
                });
                resolved.gpu = Some(gpu);
            }
            Err(e) => {
                // Without the driver a PCI selector still gives the home node: placement, no pinning.
                if config.pin != crate::PinMode::Off {
                    errors.push(e);
                }
                if let Some(addr) = resolved.gpu_pci {
                    resolved.home_node = pci::home_node(root, &addr).unwrap_or_else(|e| {
                        errors.push(e);
                        None
                    });
                }
            }
        }
        if let Some(home) = resolved.home_node {
            match topology.host_node_for(home) {
                Ok(node) => resolved.host_node = node,
                Err(e) => errors.push(e),
            }
        }
    }
    if resolved.host_node == usize::MAX {
        resolved.host_node = calling_thread_node(topology);
    }
    resolved
}

/// The node of the calling thread, or the first node with memory when that is unknown.
fn calling_thread_node(topology: &NumaTopology) -> usize {
    let first = topology.node_ids().first().copied().unwrap_or(0);
    sys::current_node()
        .ok()
        .and_then(|node| topology.host_node_for(node).ok())
        .or_else(|| topology.host_node_for(first).ok())
        .unwrap_or(first)
}

fn policy_nodes(config: &Config, topology: &NumaTopology, host_node: usize) -> NodeMask {
    let mut mask = NodeMask::empty();
    if config.policy == MemPolicy::Interleave {
        for node in topology.nodes().iter().filter(|n| n.has_memory) {
            let _ = mask.insert(node.id);
        }
    }
    if mask.is_empty() {
        let _ = mask.insert(host_node);
    }
    mask
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
