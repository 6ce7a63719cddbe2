//! The host's NUMA topology: online nodes, what each holds, the distance matrix, and which node
//! host buffers for a GPU should live on.
//!
//! NUMA distances follow the ACPI SLIT convention: the distance from a node to itself is `10`,
//! and remote distances are larger (a one-hop remote node is typically `20`, about twice the
//! local latency).

use std::path::Path;

use crate::{Error, Result};

/// The ACPI SLIT distance from a node to itself.
pub const LOCAL_NUMA_DISTANCE: u8 = 10;

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
            return Err(crate::sysfs::parse_error(
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
        let (nodes, distances) = crate::sysfs::read_node_tree(root.as_ref())?;
        Self::from_nodes(nodes, distances)
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

    /// Returns the node with the smallest distance from `from`, or `None` if `from` is not a node.
    ///
    /// Ties go to `from` itself, then to the lowest id. With a valid SLIT (off-diagonal
    /// distances above 10, as the kernel enforces) this is always `from`.
    #[must_use]
    pub fn nearest_node(&self, from: usize) -> Option<usize> {
        let from_pos = self.position(from)?;
        let mut best = from;
        let mut best_dist = self.distance_at(from_pos, from_pos)?;
        for (pos, &id) in self.ids.iter().enumerate() {
            let d = self.distance_at(from_pos, pos)?;
            if d < best_dist {
                best_dist = d;
                best = id;
            }
        }
        Some(best)
    }

    /// The node that host buffers for a GPU whose home node is `home_node` should live on.
    ///
    /// That is the nearest node (by distance from `home_node`) that has memory, preferring nodes
    /// that also have CPUs: a CPU-less node is taken only if no node with memory has CPUs. Ties
    /// go to the lowest id. So a CPU-less GPU-memory node (GH200/GB200) is never chosen while a
    /// node with CPUs and memory exists, and a memoryless home node gets its nearest node with
    /// memory. When the home node has memory and CPUs, the answer is the home node itself.
    ///
    /// # Errors
    ///
    /// * [`Error::UnknownNode`] if `home_node` is not a node of this topology;
    /// * [`Error::NoMemoryNode`] if no node has memory.
    pub fn host_node_for(&self, home_node: usize) -> Result<usize> {
        self.host_node_among(home_node, |_| true)
    }

    /// [`host_node_for`](Self::host_node_for) restricted to the nodes `allowed` accepts, e.g. the
    /// memory nodes a cgroup cpuset lets this process use (`Mems_allowed`).
    ///
    /// # Errors
    ///
    /// [`Error::UnknownNode`] if `home_node` is not a node of this topology;
    /// [`Error::NoMemoryNode`] if no allowed node has memory.
    pub fn host_node_among(
        &self,
        home_node: usize,
        allowed: impl Fn(usize) -> bool,
    ) -> Result<usize> {
        let home = self
            .position(home_node)
            .ok_or_else(|| self.unknown(home_node))?;
        let candidates = || {
            self.nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.has_memory && allowed(n.id))
        };
        let any_cpu_memory = candidates().any(|(_, n)| n.has_cpu);
        let mut best: Option<(u8, usize)> = None;
        for (pos, node) in candidates() {
            if any_cpu_memory && !node.has_cpu {
                continue;
            }
            let Some(d) = self.distance_at(home, pos) else {
                continue;
            };
            // Ascending ids: a strict `<` keeps the lowest id on ties.
            if best.is_none_or(|(best_d, _)| d < best_d) {
                best = Some((d, node.id));
            }
        }
        best.map(|(_, id)| id).ok_or(Error::NoMemoryNode)
    }

    /// The host node farthest from node `id` (largest distance, ties to the lowest id), e.g. to
    /// place a deliberately remote buffer in a benchmark. Like [`host_node_for`](Self::host_node_for)
    /// it only considers nodes with memory, and with CPUs too when any node has both, so a
    /// GPU-memory node (GH200/GB200) is never taken for a remote socket.
    ///
    /// Returns `None` if `id` is not a node or no other such node exists.
    #[must_use]
    pub fn farthest_node_from(&self, id: usize) -> Option<usize> {
        let from = self.position(id)?;
        let any_cpu_memory = self.nodes.iter().any(|n| n.has_memory && n.has_cpu);
        let mut best: Option<(u8, usize)> = None;
        for (pos, node) in self.nodes.iter().enumerate() {
            if pos == from || !node.has_memory || (any_cpu_memory && !node.has_cpu) {
                continue;
            }
            let d = self.distance_at(from, pos)?;
            if best.is_none_or(|(best_d, _)| d > best_d) {
                best = Some((d, node.id));
            }
        }
        best.map(|(_, id)| id)
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
/// ([`pci::home_node`](crate::pci::home_node)). As in the seed API this is the home node itself,
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
mod tests {
    use super::*;

    #[test]
    fn topology_uniform_diagonal_is_local() {
        let topo = NumaTopology::uniform(4, 20).expect("topo");
        assert_eq!(topo.node_count(), 4);
        for node in 0..4 {
            assert_eq!(topo.distance(node, node), Some(LOCAL_NUMA_DISTANCE));
        }
    }

    #[test]
    fn topology_uniform_remote_distance() {
        let topo = NumaTopology::uniform(3, 32).expect("topo");
        assert_eq!(topo.distance(0, 1), Some(32));
        assert_eq!(topo.distance(2, 0), Some(32));
    }

    #[test]
    fn topology_uniform_clamps_remote_below_local() {
        // remote smaller than local should be clamped to local+1.
        let topo = NumaTopology::uniform(2, 5).expect("topo");
        assert_eq!(topo.distance(0, 1), Some(LOCAL_NUMA_DISTANCE + 1));
    }

    #[test]
    fn topology_two_node() {
        let topo = NumaTopology::two_node(20);
        assert_eq!(topo.node_count(), 2);
        assert_eq!(topo.distance(0, 0), Some(10));
        assert_eq!(topo.distance(0, 1), Some(20));
        assert_eq!(topo.distance(1, 0), Some(20));
    }

    #[test]
    fn topology_single_node() {
        let topo = NumaTopology::single_node();
        assert_eq!(topo.node_count(), 1);
        assert_eq!(topo.distance(0, 0), Some(10));
        assert_eq!(topo.distance(0, 1), None);
    }

    #[test]
    fn topology_new_rejects_zero_nodes() {
        assert_eq!(NumaTopology::new(0, vec![]), Err(Error::ZeroNodes));
    }

    #[test]
    fn topology_new_rejects_wrong_matrix_size() {
        // 2 nodes need 4 entries; give 3.
        assert_eq!(
            NumaTopology::new(2, vec![10, 20, 20]),
            Err(Error::DistanceMatrixSize {
                node_count: 2,
                entries: 3
            })
        );
    }

    #[test]
    fn topology_new_rejects_bad_diagonal() {
        // Diagonal entry (1,1) is 11, not 10.
        assert_eq!(
            NumaTopology::new(2, vec![10, 20, 20, 11]),
            Err(Error::LocalDistance {
                node: 1,
                distance: 11
            })
        );
    }

    #[test]
    fn topology_new_accepts_valid_matrix() {
        let topo = NumaTopology::new(2, vec![10, 21, 21, 10]).expect("topo");
        assert_eq!(topo.distance(0, 1), Some(21));
    }

    #[test]
    fn topology_distance_out_of_range_is_none() {
        let topo = NumaTopology::two_node(20);
        assert_eq!(topo.distance(0, 5), None);
        assert_eq!(topo.distance(5, 0), None);
    }

    #[test]
    fn nearest_node_is_self_for_local() {
        let topo = NumaTopology::uniform(4, 20).expect("topo");
        for node in 0..4 {
            assert_eq!(topo.nearest_node(node), Some(node));
        }
    }

    #[test]
    fn nearest_node_picks_closer_remote() {
        // 3 nodes; from node 0, node 2 is closer (15) than node 1 (40).
        // diag = 10. Row 0: [10, 40, 15].
        let distances = vec![
            10, 40, 15, // from 0
            40, 10, 25, // from 1
            15, 25, 10, // from 2
        ];
        let topo = NumaTopology::new(3, distances).expect("topo");
        // Local (10) is still the minimum, so nearest is self.
        assert_eq!(topo.nearest_node(0), Some(0));
    }

    #[test]
    fn nearest_node_out_of_range_is_none() {
        let topo = NumaTopology::two_node(20);
        assert_eq!(topo.nearest_node(2), None);
    }

    #[test]
    fn closest_node_to_gpu_returns_home_node() {
        let topo = NumaTopology::two_node(20);
        assert_eq!(closest_node_to_gpu(&topo, 0), Ok(0));
        assert_eq!(closest_node_to_gpu(&topo, 1), Ok(1));
    }

    #[test]
    fn closest_node_to_gpu_rejects_bad_node() {
        let topo = NumaTopology::two_node(20);
        assert_eq!(
            closest_node_to_gpu(&topo, 9),
            Err(Error::UnknownNode {
                node: 9,
                node_count: 2
            })
        );
    }

    // ----- beyond the seed: real ids, node facts, host-node choice -----

    fn node(id: usize, has_memory: bool, has_cpu: bool) -> NodeInfo {
        NodeInfo {
            has_memory,
            has_cpu,
            ..NodeInfo::synthetic(id)
        }
    }

    #[test]
    fn sparse_ids_are_real_ids() {
        let topo = NumaTopology::from_nodes(
            vec![NodeInfo::synthetic(0), NodeInfo::synthetic(2)],
            vec![10, 20, 20, 10],
        )
        .expect("topo");
        assert_eq!(topo.node_count(), 2);
        assert_eq!(topo.node_ids(), &[0, 2]);
        assert_eq!(topo.distance(0, 2), Some(20));
        assert_eq!(topo.distance(2, 2), Some(10));
        assert_eq!(topo.distance(1, 0), None);
        assert_eq!(topo.nearest_node(2), Some(2));
        assert_eq!(topo.nearest_node(1), None);
        assert!(topo.contains(2) && !topo.contains(1));
        assert_eq!(topo.node(2).map(|n| n.id), Some(2));
        assert_eq!(topo.node(1), None);
        assert_eq!(closest_node_to_gpu(&topo, 2), Ok(2));
        assert_eq!(topo.farthest_node_from(0), Some(2));
        assert_eq!(topo.host_node_for(2), Ok(2));
    }

    #[test]
    fn synthetic_nodes_have_memory_and_cpus() {
        let topo = NumaTopology::uniform(3, 20).expect("topo");
        assert_eq!(topo.node_ids(), &[0, 1, 2]);
        for n in topo.nodes() {
            assert!(n.has_memory && n.has_cpu && n.cpus.is_empty() && n.memory_bytes == 0);
        }
        assert_eq!(
            NumaTopology::new(2, vec![10, 20, 20, 10])
                .expect("t")
                .nodes()
                .len(),
            2
        );
    }

    #[test]
    fn from_nodes_validates() {
        assert_eq!(
            NumaTopology::from_nodes(vec![], vec![]),
            Err(Error::ZeroNodes)
        );
        let unordered = vec![NodeInfo::synthetic(2), NodeInfo::synthetic(0)];
        assert!(matches!(
            NumaTopology::from_nodes(unordered, vec![10, 20, 20, 10]),
            Err(Error::Parse { .. })
        ));
        let dup = vec![NodeInfo::synthetic(1), NodeInfo::synthetic(1)];
        assert!(matches!(
            NumaTopology::from_nodes(dup, vec![10, 20, 20, 10]),
            Err(Error::Parse { .. })
        ));
        let sparse = vec![NodeInfo::synthetic(0), NodeInfo::synthetic(4)];
        assert_eq!(
            NumaTopology::from_nodes(sparse.clone(), vec![10, 20, 20]),
            Err(Error::DistanceMatrixSize {
                node_count: 2,
                entries: 3
            })
        );
        // The LocalDistance error names the real id.
        assert_eq!(
            NumaTopology::from_nodes(sparse, vec![10, 20, 20, 12]),
            Err(Error::LocalDistance {
                node: 4,
                distance: 12
            })
        );
    }

    #[test]
    fn huge_node_count_is_an_error_not_an_abort() {
        assert!(matches!(
            NumaTopology::new(usize::MAX, vec![10]),
            Err(Error::DistanceMatrixSize { .. })
        ));
        assert!(matches!(
            NumaTopology::uniform(usize::MAX, 20),
            Err(Error::DistanceMatrixSize { .. })
        ));
    }

    #[test]
    fn host_node_skips_cpu_less_memory_nodes() {
        // GH200-like: node 0 CPUs+memory, nodes 1 and 2 GPU memory without CPUs.
        let nodes = vec![
            node(0, true, true),
            node(1, true, false),
            node(2, true, false),
        ];
        let d = vec![10, 80, 80, 80, 10, 80, 80, 80, 10];
        let topo = NumaTopology::from_nodes(nodes, d).expect("topo");
        for home in 0..3 {
            assert_eq!(topo.host_node_for(home), Ok(0));
        }
        assert_eq!(closest_node_to_gpu(&topo, 1), Ok(1));
        assert_eq!(
            topo.host_node_for(3),
            Err(Error::UnknownNode {
                node: 3,
                node_count: 3
            })
        );
        // Only CPU-less nodes have memory: take the nearest of them.
        let nodes = vec![
            node(0, false, true),
            node(1, true, false),
            node(2, true, false),
        ];
        let d = vec![10, 30, 20, 30, 10, 40, 20, 40, 10];
        let topo = NumaTopology::from_nodes(nodes, d).expect("topo");
        assert_eq!(topo.host_node_for(0), Ok(2));
    }

    #[test]
    fn host_node_for_memoryless_home_and_ties() {
        // Node 1 holds the GPU and CPUs but no memory; nodes 0 and 2 are equally near.
        let nodes = vec![
            node(0, true, true),
            node(1, false, true),
            node(2, true, true),
        ];
        let d = vec![10, 20, 30, 20, 10, 20, 30, 20, 10];
        let topo = NumaTopology::from_nodes(nodes, d).expect("topo");
        assert_eq!(topo.host_node_for(1), Ok(0));
        assert_eq!(topo.host_node_for(2), Ok(2));
        assert_eq!(topo.farthest_node_from(0), Some(2));
        // Node 1 has no memory, so it is never the farthest "memory" node.
        assert_eq!(topo.farthest_node_from(2), Some(0));
        assert_eq!(topo.farthest_node_from(7), None);
        assert_eq!(NumaTopology::single_node().farthest_node_from(0), None);
        // Ties for farthest go to the lowest id.
        assert_eq!(
            NumaTopology::uniform(3, 20)
                .expect("t")
                .farthest_node_from(1),
            Some(0)
        );
    }

    #[test]
    fn host_node_for_without_memory_is_an_error() {
        let nodes = vec![node(0, false, true), node(1, false, true)];
        let topo = NumaTopology::from_nodes(nodes, vec![10, 20, 20, 10]).expect("topo");
        assert_eq!(topo.host_node_for(0), Err(Error::NoMemoryNode));
    }

    #[test]
    fn host_node_among_respects_the_allowed_nodes() {
        let topo = NumaTopology::uniform(3, 20).expect("topo");
        assert_eq!(topo.host_node_among(1, |id| id != 1), Ok(0));
        assert_eq!(topo.host_node_among(1, |id| id == 2), Ok(2));
        assert_eq!(topo.host_node_among(1, |_| false), Err(Error::NoMemoryNode));
    }
}
