//! Unit tests of the topology model and of the host node choice.

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
