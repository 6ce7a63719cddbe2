//! Choosing nodes from a topology: the nearest one, the host node for a GPU's home node (with
//! memory, preferably with CPUs, optionally among allowed nodes), the farthest one.

use super::NumaTopology;
use crate::{Error, Result};

impl NumaTopology {
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
}
