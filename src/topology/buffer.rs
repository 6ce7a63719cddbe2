//! Placement records of host buffers (the seed specification's API) and per-node accounting of
//! them.
//!
//! A [`NumaBuffer`] is not a buffer: it holds no memory and no pointer, only the node a buffer
//! lives on (or is planned for) and its size. Making one maps nothing and dropping one frees
//! nothing; the mapping, `mbind` and `cuMemHostRegister` happen elsewhere (the allocator's
//! chunks). A [`NumaAllocTracker`] sums the bytes of such records per node.

use std::fmt;

use super::{closest_node_to_gpu, NumaTopology};
use crate::{Error, Result};

/// Where a host buffer lives: its NUMA node and its size in bytes, a placement record.
///
/// It owns no memory and points to none, so it is `Copy` and can describe a buffer that does not
/// exist yet (a plan) as well as one the allocator handed out; [`is_local_to`](Self::is_local_to)
/// and [`access_distance`](Self::access_distance) say what an access from a given node would
/// cost. `node` is a real Linux node id of the topology it was planned against (see
/// [`NumaTopology`] on sparse ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NumaBuffer {
    node: usize,
    byte_size: usize,
}

impl NumaBuffer {
    /// Plans a host allocation of `byte_size` bytes bound to node `node`.
    ///
    /// # Errors
    ///
    /// * [`Error::ZeroSize`] if `byte_size` is zero;
    /// * [`Error::UnknownNode`] if `node` is not a node of `topology`.
    pub fn on_node(topology: &NumaTopology, node: usize, byte_size: usize) -> Result<Self> {
        if byte_size == 0 {
            return Err(Error::ZeroSize);
        }
        if !topology.contains(node) {
            return Err(topology.unknown(node));
        }
        Ok(Self { node, byte_size })
    }

    /// Plans a host allocation bound to the node closest to a GPU whose home node is
    /// `gpu_home_node` (see [`closest_node_to_gpu`]).
    ///
    /// # Errors
    ///
    /// Forwards errors from [`closest_node_to_gpu`] and [`on_node`](Self::on_node).
    pub fn closest_to_gpu(
        topology: &NumaTopology,
        gpu_home_node: usize,
        byte_size: usize,
    ) -> Result<Self> {
        let node = closest_node_to_gpu(topology, gpu_home_node)?;
        Self::on_node(topology, node, byte_size)
    }

    /// The NUMA node id this allocation is bound to.
    #[inline]
    #[must_use]
    pub fn node(&self) -> usize {
        self.node
    }

    /// The byte footprint of the allocation.
    #[inline]
    #[must_use]
    pub fn byte_size(&self) -> usize {
        self.byte_size
    }

    /// Returns `true` if the accessing node `access_node` is the bound node.
    #[inline]
    #[must_use]
    pub fn is_local_to(&self, access_node: usize) -> bool {
        self.node == access_node
    }

    /// The NUMA distance an access from `access_node` would incur according to `topology`, or
    /// `None` if `access_node` (or the buffer's node) is not a node of `topology`.
    #[must_use]
    pub fn access_distance(&self, topology: &NumaTopology, access_node: usize) -> Option<u8> {
        topology.distance(access_node, self.node)
    }
}

impl fmt::Display for NumaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NumaBuffer(node={}, {} bytes)",
            self.node, self.byte_size
        )
    }
}

/// Per-node accounting of NUMA-bound host allocations.
///
/// Tracks how many bytes are outstanding on each node so a scheduler can balance pinned-memory
/// pressure across sockets. Counters are keyed by the real node ids of the topology the tracker
/// was made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaAllocTracker {
    /// The topology's node ids, ascending.
    ids: Vec<usize>,
    /// Outstanding bytes, by position in `ids`.
    per_node_bytes: Vec<usize>,
}

impl NumaAllocTracker {
    /// Creates a tracker with one zeroed counter per node of `topology`.
    #[must_use]
    pub fn new(topology: &NumaTopology) -> Self {
        Self {
            ids: topology.node_ids().to_vec(),
            per_node_bytes: vec![0; topology.node_count()],
        }
    }

    /// Records that `buf` was allocated, adding its bytes to its node's total (saturating).
    ///
    /// # Errors
    ///
    /// [`Error::UnknownNode`] if the buffer's node is not one of the tracker's nodes.
    pub fn record(&mut self, buf: &NumaBuffer) -> Result<()> {
        let slot = self.slot_mut(buf.node())?;
        *slot = slot.saturating_add(buf.byte_size());
        Ok(())
    }

    /// Records that `buf` was freed, subtracting its bytes from its node's total (saturating at
    /// zero, so a release without a matching record cannot underflow).
    ///
    /// # Errors
    ///
    /// [`Error::UnknownNode`] if the buffer's node is not one of the tracker's nodes.
    pub fn release(&mut self, buf: &NumaBuffer) -> Result<()> {
        let slot = self.slot_mut(buf.node())?;
        *slot = slot.saturating_sub(buf.byte_size());
        Ok(())
    }

    /// The bytes outstanding on node `node`, or `None` if it is not one of the tracker's nodes.
    #[must_use]
    pub fn bytes_on_node(&self, node: usize) -> Option<usize> {
        let pos = self.ids.binary_search(&node).ok()?;
        self.per_node_bytes.get(pos).copied()
    }

    /// The bytes outstanding across all nodes (saturating).
    #[must_use]
    pub fn total_bytes(&self) -> usize {
        self.per_node_bytes
            .iter()
            .fold(0usize, |acc, &b| acc.saturating_add(b))
    }

    /// The id of the node with the fewest outstanding bytes; ties go to the lowest id.
    ///
    /// Returns `None` only for a tracker without nodes, which [`new`](Self::new) cannot make.
    #[must_use]
    pub fn least_loaded_node(&self) -> Option<usize> {
        // `min_by_key` keeps the first minimum, and ids are ascending.
        self.ids
            .iter()
            .zip(&self.per_node_bytes)
            .min_by_key(|&(_, &bytes)| bytes)
            .map(|(&id, _)| id)
    }

    fn slot_mut(&mut self, node: usize) -> Result<&mut usize> {
        let node_count = self.ids.len();
        self.ids
            .binary_search(&node)
            .ok()
            .and_then(|pos| self.per_node_bytes.get_mut(pos))
            .ok_or(Error::UnknownNode { node, node_count })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::NodeInfo;

    #[test]
    fn numa_buffer_on_node_valid() {
        let topo = NumaTopology::two_node(20);
        let buf = NumaBuffer::on_node(&topo, 1, 8192).expect("alloc");
        assert_eq!(buf.node(), 1);
        assert_eq!(buf.byte_size(), 8192);
    }

    #[test]
    fn numa_buffer_rejects_zero_bytes() {
        let topo = NumaTopology::two_node(20);
        assert_eq!(NumaBuffer::on_node(&topo, 0, 0), Err(Error::ZeroSize));
    }

    #[test]
    fn numa_buffer_rejects_bad_node() {
        let topo = NumaTopology::two_node(20);
        assert_eq!(
            NumaBuffer::on_node(&topo, 7, 4096),
            Err(Error::UnknownNode {
                node: 7,
                node_count: 2
            })
        );
    }

    #[test]
    fn numa_buffer_closest_to_gpu() {
        let topo = NumaTopology::two_node(20);
        let buf = NumaBuffer::closest_to_gpu(&topo, 1, 4096).expect("alloc");
        assert_eq!(buf.node(), 1);
    }

    #[test]
    fn numa_buffer_locality_and_distance() {
        let topo = NumaTopology::two_node(20);
        let buf = NumaBuffer::on_node(&topo, 1, 4096).expect("alloc");
        assert!(buf.is_local_to(1));
        assert!(!buf.is_local_to(0));
        // Access from node 1 (local) -> 10; from node 0 (remote) -> 20.
        assert_eq!(buf.access_distance(&topo, 1), Some(10));
        assert_eq!(buf.access_distance(&topo, 0), Some(20));
        assert_eq!(buf.access_distance(&topo, 9), None);
    }

    #[test]
    fn numa_buffer_display() {
        let topo = NumaTopology::two_node(20);
        let buf = NumaBuffer::on_node(&topo, 1, 4096).expect("alloc");
        let s = format!("{buf}");
        assert!(s.contains("node=1"));
        assert!(s.contains("4096"));
        assert_eq!(s, "NumaBuffer(node=1, 4096 bytes)");
    }

    #[test]
    fn tracker_records_and_releases() {
        let topo = NumaTopology::two_node(20);
        let mut tracker = NumaAllocTracker::new(&topo);
        let a = NumaBuffer::on_node(&topo, 0, 1000).expect("a");
        let b = NumaBuffer::on_node(&topo, 1, 2000).expect("b");
        let c = NumaBuffer::on_node(&topo, 0, 500).expect("c");

        tracker.record(&a).expect("rec a");
        tracker.record(&b).expect("rec b");
        tracker.record(&c).expect("rec c");

        assert_eq!(tracker.bytes_on_node(0), Some(1500));
        assert_eq!(tracker.bytes_on_node(1), Some(2000));
        assert_eq!(tracker.total_bytes(), 3500);

        tracker.release(&a).expect("rel a");
        assert_eq!(tracker.bytes_on_node(0), Some(500));
        assert_eq!(tracker.total_bytes(), 2500);
    }

    #[test]
    fn tracker_bytes_on_bad_node_is_none() {
        let topo = NumaTopology::two_node(20);
        let tracker = NumaAllocTracker::new(&topo);
        assert_eq!(tracker.bytes_on_node(9), None);
    }

    #[test]
    fn tracker_least_loaded_node() {
        let topo = NumaTopology::uniform(3, 20).expect("topo");
        let mut tracker = NumaAllocTracker::new(&topo);
        let a = NumaBuffer::on_node(&topo, 0, 5000).expect("a");
        let b = NumaBuffer::on_node(&topo, 1, 1000).expect("b");
        tracker.record(&a).expect("rec a");
        tracker.record(&b).expect("rec b");
        // Node 2 has 0 bytes -> least loaded.
        assert_eq!(tracker.least_loaded_node(), Some(2));
    }

    #[test]
    fn tracker_least_loaded_ties_pick_lowest_index() {
        let topo = NumaTopology::two_node(20);
        let tracker = NumaAllocTracker::new(&topo);
        // Both nodes at 0 -> lowest index 0.
        assert_eq!(tracker.least_loaded_node(), Some(0));
    }

    #[test]
    fn tracker_release_saturates_at_zero() {
        let topo = NumaTopology::single_node();
        let mut tracker = NumaAllocTracker::new(&topo);
        let buf = NumaBuffer::on_node(&topo, 0, 100).expect("buf");
        // Release without record should not underflow.
        tracker.release(&buf).expect("rel");
        assert_eq!(tracker.bytes_on_node(0), Some(0));
    }

    // ----- beyond the seed: sparse ids -----

    fn sparse() -> NumaTopology {
        NumaTopology::from_nodes(
            vec![NodeInfo::synthetic(0), NodeInfo::synthetic(2)],
            vec![10, 20, 20, 10],
        )
        .expect("topo")
    }

    #[test]
    fn buffers_and_tracker_use_real_ids() {
        let topo = sparse();
        assert_eq!(
            NumaBuffer::on_node(&topo, 1, 64),
            Err(Error::UnknownNode {
                node: 1,
                node_count: 2
            })
        );
        let buf = NumaBuffer::on_node(&topo, 2, 64).expect("buf");
        assert_eq!(buf.access_distance(&topo, 0), Some(20));
        let mut tracker = NumaAllocTracker::new(&topo);
        tracker.record(&buf).expect("rec");
        assert_eq!(tracker.bytes_on_node(2), Some(64));
        assert_eq!(tracker.bytes_on_node(1), None);
        assert_eq!(tracker.least_loaded_node(), Some(0));
        let other = NumaBuffer::on_node(&topo, 0, 128).expect("other");
        tracker.record(&other).expect("rec");
        assert_eq!(tracker.least_loaded_node(), Some(2));
        assert_eq!(tracker.total_bytes(), 192);
    }

    #[test]
    fn tracker_rejects_a_buffer_from_another_topology() {
        let big = NumaTopology::uniform(4, 20).expect("topo");
        let buf = NumaBuffer::on_node(&big, 3, 64).expect("buf");
        let mut tracker = NumaAllocTracker::new(&sparse());
        let err = Error::UnknownNode {
            node: 3,
            node_count: 2,
        };
        assert_eq!(tracker.record(&buf), Err(err.clone()));
        assert_eq!(tracker.release(&buf), Err(err));
        assert_eq!(tracker.total_bytes(), 0);
    }
}
