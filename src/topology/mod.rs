//! The host's NUMA topology: online nodes, what each holds, the distance matrix, and which node
//! host buffers for a GPU should live on.
//!
//! NUMA distances follow the ACPI SLIT convention: the distance from a node to itself is `10`,
//! and remote distances are larger (a one-hop remote node is typically `20`, about twice the
//! local latency).
//!
//! Files: this one holds the seed types ([`NodeInfo`], [`NumaTopology`], [`closest_node_to_gpu`],
//! [`LOCAL_NUMA_DISTANCE`]); `choice.rs` picks nodes from a topology (nearest, host node for a
//! GPU, farthest); `buffer.rs` holds the placement records and their per-node accounting
//! ([`NumaBuffer`], [`NumaAllocTracker`]); `sysfs.rs` reads and parses the kernel's files,
//! `pci.rs` a PCI device's, `cgroup.rs` a cgroup's memory limits, `live.rs` the counters
//! allocations read (a node's free memory, compaction stalls). `sysfs.rs` knows nothing of
//! the types here: it returns what the files say, and this file builds a topology from it.

use std::path::Path;

use crate::{Error, Result};

mod buffer;
pub(crate) mod cgroup;
mod choice;
pub(crate) mod host;
pub(crate) mod live;
pub mod pci;
pub mod sysfs;

pub use buffer::{NumaAllocTracker, NumaBuffer};
use sysfs::{NodeFiles, NodeTree};

// Defined with the error type that cites it (the layer below).
pub use crate::error::LOCAL_NUMA_DISTANCE;

/// What one NUMA node holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node's Linux id (`nodeN` in sysfs).
    pub id: usize,
    /// The CPUs of the node (`nodeN/cpulist`), ascending.
    pub cpus: Vec<usize>,
    /// The node's memory in bytes (`MemTotal` of `nodeN/meminfo`).
    pub memory_bytes: u64,
    /// Whether the node has memory (listed in `has_memory`).
    pub has_memory: bool,
    /// Whether the node has CPUs (listed in `has_cpu`).
    pub has_cpu: bool,
}

impl NodeInfo {
    /// A node as the synthetic constructors make it: it has memory and CPUs, but lists no CPU and
    /// 0 bytes.
    #[must_use]
    pub fn synthetic(id: usize) -> Self {
        Self {
            id,
            cpus: Vec::new(),
            memory_bytes: 0,
            has_memory: true,
            has_cpu: true,
        }
    }

    /// A node as sysfs describes it.
    fn from_files(files: NodeFiles) -> Self {
        let NodeFiles {
            id,
            cpus,
            memory_bytes,
            has_memory,
            has_cpu,
        } = files;
        Self {
            id,
            cpus,
            memory_bytes,
            has_memory,
            has_cpu,
        }
    }
}

/// A model of the host NUMA topology: its online nodes and their distance matrix.
///
/// **Node ids.** Every `node` argument and return value is a real Linux node id, and ids can be
/// sparse (a machine may have only nodes 0 and 2 online). [`node_count`](Self::node_count) counts
/// online nodes; [`node_ids`](Self::node_ids) lists them. The synthetic constructors
/// ([`new`](Self::new), [`uniform`](Self::uniform), [`two_node`](Self::two_node),
/// [`single_node`](Self::single_node)) number their nodes `0..n`, so for them an id is also a
/// position. Discovery ([`from_sysfs`](Self::from_sysfs)) and [`from_nodes`](Self::from_nodes)
/// keep the real ids.
///
/// The matrix is only required to be square with [`LOCAL_NUMA_DISTANCE`] on its diagonal; it
/// need not be symmetric.
///
/// # Example
///
/// ```rust
/// use numa_gpu_alloc::{closest_node_to_gpu, NumaBuffer, NumaTopology};
/// // Two-socket box: node 0 and node 1, remote distance 20.
/// let topo = NumaTopology::two_node(20);
/// // A GPU attached to node 1's root complex should bind host memory to node 1.
/// let node = closest_node_to_gpu(&topo, 1)?;
/// assert_eq!(node, 1);
///
/// let buf = NumaBuffer::on_node(&topo, node, 4096)?;
/// assert_eq!(buf.node(), 1);
/// assert_eq!(buf.byte_size(), 4096);
/// # Ok::<(), numa_gpu_alloc::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaTopology {
    /// Node facts, ascending by id.
    nodes: Vec<NodeInfo>,
    /// The ids of `nodes`, kept apart so [`node_ids`](Self::node_ids) can lend a slice.
    ids: Vec<usize>,
    /// Row-major `node_count × node_count` matrix, indexed by position in `nodes`.
    distances: Vec<u8>,
}

impl NumaTopology {
    /// Builds a topology of nodes `0..node_count` from a row-major distance matrix.
    ///
    /// # Errors
    ///
    /// * [`Error::ZeroNodes`] if `node_count` is zero;
    /// * [`Error::DistanceMatrixSize`] if `distances` does not have `node_count²` entries;
    /// * [`Error::LocalDistance`] if a diagonal entry is not [`LOCAL_NUMA_DISTANCE`].
    pub fn new(node_count: usize, distances: Vec<u8>) -> Result<Self> {
        if node_count == 0 {
            return Err(Error::ZeroNodes);
        }
        // Checked before building the nodes, so a huge count cannot allocate.
        check_matrix_size(node_count, distances.len())?;
        Self::from_nodes(
            (0..node_count).map(NodeInfo::synthetic).collect(),
            distances,
        )
    }

    /// Builds a topology from explicit node facts (ids strictly ascending) and a row-major
    /// distance matrix whose rows and columns follow the order of `nodes`.
    ///
    /// # Errors
    ///
    /// * [`Error::ZeroNodes`] if `nodes` is empty;
    /// * [`Error::Parse`] (path `"<input>"`) if the ids are not strictly ascending;
    /// * [`Error::DistanceMatrixSize`] if `distances` does not have `nodes.len()²` entries;
    /// * [`Error::LocalDistance`] if a diagonal entry is not [`LOCAL_NUMA_DISTANCE`].
    pub fn from_nodes(nodes: Vec<NodeInfo>, distances: Vec<u8>) -> Result<Self> {
        let n = nodes.len();
        if n == 0 {
            return Err(Error::ZeroNodes);
        }
        let ids: Vec<usize> = nodes.iter().map(|node| node.id).collect();
        if ids.windows(2).any(|w| w.first() >= w.get(1)) {
            return Err(sysfs::parse_error(
                "node ids in strictly ascending order",
                &format!("{ids:?}"),
            ));
        }
        check_matrix_size(n, distances.len())?;
        for (pos, &id) in ids.iter().enumerate() {
            let distance = distances.get(pos * n + pos).copied().unwrap_or(0);
            if distance != LOCAL_NUMA_DISTANCE {
                return Err(Error::LocalDistance { node: id, distance });
            }
        }
        Ok(Self {
            nodes,
            ids,
            distances,
        })
    }

    /// Builds a uniform topology of nodes `0..node_count` where every distinct pair has distance
    /// `remote`.
    ///
    /// `remote` is clamped to at least `LOCAL_NUMA_DISTANCE + 1` so remote access is always
    /// modelled as strictly slower than local.
    ///
    /// # Errors
    ///
    /// * [`Error::ZeroNodes`] if `node_count` is zero;
    /// * [`Error::DistanceMatrixSize`] if `node_count²` overflows `usize`.
    pub fn uniform(node_count: usize, remote: u8) -> Result<Self> {
        if node_count == 0 {
            return Err(Error::ZeroNodes);
        }
        let entries = node_count
            .checked_mul(node_count)
            .ok_or(Error::DistanceMatrixSize {
                node_count,
                entries: 0,
            })?;
        let remote = remote.max(LOCAL_NUMA_DISTANCE.saturating_add(1));
        let mut distances = vec![remote; entries];
        for node in 0..node_count {
            if let Some(d) = distances.get_mut(node * node_count + node) {
                *d = LOCAL_NUMA_DISTANCE;
            }
        }
        Ok(Self {
            nodes: (0..node_count).map(NodeInfo::synthetic).collect(),
            ids: (0..node_count).collect(),
            distances,
        })
    }

    /// Convenience constructor for the common two-socket layout (nodes 0 and 1).
    ///
    /// `remote` is the cross-socket distance (typically `20`), clamped as in
    /// [`uniform`](Self::uniform).
    #[must_use]
    pub fn two_node(remote: u8) -> Self {
        let remote = remote.max(LOCAL_NUMA_DISTANCE.saturating_add(1));
        Self {
            nodes: vec![NodeInfo::synthetic(0), NodeInfo::synthetic(1)],
            ids: vec![0, 1],
            distances: vec![LOCAL_NUMA_DISTANCE, remote, remote, LOCAL_NUMA_DISTANCE],
        }
    }

    /// A single-node topology (node 0: a UMA / non-NUMA host).
    #[must_use]
    pub fn single_node() -> Self {
        Self {
            nodes: vec![NodeInfo::synthetic(0)],
            ids: vec![0],
            distances: vec![LOCAL_NUMA_DISTANCE],
        }
    }

    /// Reads this machine's topology from `/sys`; see [`from_sysfs_root`](Self::from_sysfs_root).
    ///
    /// # Errors
    ///
    /// As [`from_sysfs_root`](Self::from_sysfs_root).
    pub fn from_sysfs() -> Result<Self> {
        Self::from_sysfs_root("/sys")
    }

    /// Reads a topology from a sysfs tree rooted at `root` (`/sys`, or a test fixture).
    ///
    /// Reads `<root>/devices/system/node/{online,has_memory,has_cpu}` and, for each online node
    /// N, `nodeN/{distance,cpulist,meminfo}`. A missing `has_memory`/`has_cpu` (old kernels)
    /// means every online node has memory/CPUs; an empty one means none has. Each `distance` row
    /// must list exactly one distance per online node, in id order.
    ///
    /// If `root` exists but `<root>/devices/system/node` does not (a kernel built without NUMA),
    /// the result is a single node 0 with every CPU of `<root>/devices/system/cpu/online` and the
    /// `MemTotal` of `<root>/../proc/meminfo` (`/proc/meminfo` for `/sys`; 0 bytes if that file
    /// is missing).
    ///
    /// # Errors
    ///
    /// * [`Error::Io`] if `root` or a required file cannot be read;
    /// * [`Error::Parse`] if a file is malformed (empty, garbage, a row of the wrong length, a
    ///   distance above 255);
    /// * [`Error::ZeroNodes`] / [`Error::LocalDistance`] for an empty `online` list or a
    ///   diagonal entry other than 10.
    pub fn from_sysfs_root(root: impl AsRef<Path>) -> Result<Self> {
        match sysfs::read_node_tree(root.as_ref())? {
            NodeTree::Nodes { nodes, distances } => {
                let nodes = nodes.into_iter().map(NodeInfo::from_files).collect();
                Self::from_nodes(nodes, distances)
            }
            // A kernel without NUMA: one node 0 with everything.
            NodeTree::NoNuma { cpus, memory_bytes } => Self::from_nodes(
                vec![NodeInfo {
                    cpus,
                    memory_bytes,
                    ..NodeInfo::synthetic(0)
                }],
                vec![LOCAL_NUMA_DISTANCE],
            ),
        }
    }

    /// The number of online NUMA nodes.
    #[inline]
    #[must_use]
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The node ids, ascending.
    #[must_use]
    pub fn node_ids(&self) -> &[usize] {
        &self.ids
    }

    /// The facts of every node, ascending by id.
    #[must_use]
    pub fn nodes(&self) -> &[NodeInfo] {
        &self.nodes
    }

    /// The facts of node `id`, or `None` if it is not a node of this topology.
    #[must_use]
    pub fn node(&self, id: usize) -> Option<&NodeInfo> {
        self.position(id).and_then(|pos| self.nodes.get(pos))
    }

    /// Whether `id` is a node of this topology.
    #[must_use]
    pub fn contains(&self, id: usize) -> bool {
        self.position(id).is_some()
    }

    /// Returns the distance from node `from` to node `to`, or `None` if either is not a node.
    #[must_use]
    pub fn distance(&self, from: usize, to: usize) -> Option<u8> {
        let (from, to) = (self.position(from)?, self.position(to)?);
        self.distance_at(from, to)
    }

    /// The position of node `id` in `nodes`/`ids`.
    fn position(&self, id: usize) -> Option<usize> {
        self.ids.binary_search(&id).ok()
    }

    /// Matrix entry by positions; `None` only if a position is out of range.
    fn distance_at(&self, from: usize, to: usize) -> Option<u8> {
        let n = self.nodes.len();
        if from >= n || to >= n {
            return None;
        }
        self.distances.get(from * n + to).copied()
    }

    pub(crate) fn unknown(&self, node: usize) -> Error {
        Error::UnknownNode {
            node,
            node_count: self.node_count(),
        }
    }
}

fn check_matrix_size(node_count: usize, entries: usize) -> Result<()> {
    if node_count.checked_mul(node_count) != Some(entries) {
        return Err(Error::DistanceMatrixSize {
            node_count,
            entries,
        });
    }
    Ok(())
}

/// Returns the NUMA node closest to a GPU whose PCIe root complex is attached to
/// `gpu_home_node`.
///
/// `gpu_home_node` comes from CUDA's host NUMA id or the device's sysfs `numa_node`
/// ([`pci::home_node`]). As in the seed API this is the home node itself,
/// validated against the topology ([`NumaTopology::nearest_node`] of it). It does not look at
/// memory or CPUs: use [`NumaTopology::host_node_for`] to choose where buffers go. The two agree
/// whenever the home node has memory and CPUs; they differ for a memoryless home node or a
/// CPU-less GPU-memory node, which `host_node_for` skips.
///
/// # Errors
///
/// [`Error::UnknownNode`] if `gpu_home_node` is not a node of `topology`.
pub fn closest_node_to_gpu(topology: &NumaTopology, gpu_home_node: usize) -> Result<usize> {
    topology
        .nearest_node(gpu_home_node)
        .ok_or_else(|| topology.unknown(gpu_home_node))
}

#[cfg(test)]
mod tests;
