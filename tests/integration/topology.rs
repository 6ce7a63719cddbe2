//! Topology discovery, host-node choice and GPU lookup against the sysfs trees in
//! `tests/fixtures/` (see its README for the machine each one models).

use std::path::{Path, PathBuf};

use numa_gpu_alloc::unstable::pci::{self, GpuInfo, PciAddress};
use numa_gpu_alloc::{closest_node_to_gpu, Error, NumaAllocTracker, NumaBuffer, NumaTopology};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn topology(name: &str) -> NumaTopology {
    NumaTopology::from_sysfs_root(fixture(name)).expect(name)
}

fn addr(s: &str) -> PciAddress {
    s.parse().expect(s)
}

fn gpu(address: &str, device_id: u16, class: u32, home_node: Option<usize>) -> GpuInfo {
    GpuInfo {
        address: addr(address),
        device_id,
        class,
        home_node,
    }
}

/// The whole matrix, row by row, by node id.
fn matrix(topo: &NumaTopology) -> Vec<Vec<u8>> {
    let ids = topo.node_ids();
    ids.iter()
        .map(|&from| {
            ids.iter()
                .map(|&to| topo.distance(from, to).expect("distance"))
                .collect()
        })
        .collect()
}

#[test]
fn intel_two_socket() {
    let topo = topology("intel-2s");
    assert_eq!(topo.node_ids(), &[0, 1]);
    assert_eq!(matrix(&topo), vec![vec![10, 21], vec![21, 10]]);
    let n0 = topo.node(0).expect("node 0");
    assert_eq!(n0.cpus.len(), 32);
    assert_eq!(n0.cpus.first(), Some(&0));
    assert_eq!(n0.cpus.last(), Some(&47));
    assert_eq!(n0.memory_bytes, 196_608_000 * 1024);
    assert!(topo.nodes().iter().all(|n| n.has_cpu && n.has_memory));
    assert_eq!(topo.host_node_for(0), Ok(0));
    assert_eq!(topo.host_node_for(1), Ok(1));
    assert_eq!(topo.farthest_node_from(0), Some(1));

    let root = fixture("intel-2s");
    let gpus = pci::nvidia_gpus(&root).expect("gpus");
    // The NVIDIA audio function (class 0x0403) and the Intel controller are not GPUs.
    assert_eq!(
        gpus,
        vec![
            gpu("0000:17:00.0", 0x20b5, 0x030200, Some(0)),
            gpu("0000:b1:00.0", 0x20b5, 0x030200, Some(1)),
        ]
    );
    assert_eq!(
        pci::home_node(&root, &addr("00000000:B1:00.0")),
        Ok(Some(1))
    );
    assert_eq!(pci::home_node(&root, &addr("0000:00:17.0")), Ok(Some(0)));
    for g in &gpus {
        let home = g.home_node.expect("home");
        assert_eq!(topo.host_node_for(home), closest_node_to_gpu(&topo, home));
    }
}

#[test]
fn amd_epyc_nps4() {
    let topo = topology("amd-nps4");
    assert_eq!(topo.node_count(), 8);
    assert_eq!(topo.node_ids(), &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(topo.distance(0, 3), Some(12));
    assert_eq!(topo.distance(3, 4), Some(32));
    assert_eq!(topo.distance(6, 6), Some(10));
    assert_eq!(topo.node(5).expect("node 5").cpus.len(), 16);
    for id in 0..8 {
        assert_eq!(topo.host_node_for(id), Ok(id));
    }
    // First node of the other socket: largest distance, lowest id.
    assert_eq!(topo.farthest_node_from(2), Some(4));
    assert_eq!(topo.farthest_node_from(5), Some(0));

    let root = fixture("amd-nps4");
    let gpus = pci::nvidia_gpus(&root).expect("gpus");
    // Sorted by address; a VGA-class (0x0300) GPU counts too.
    assert_eq!(
        gpus,
        vec![
            gpu("0000:41:00.0", 0x2330, 0x030000, Some(6)),
            gpu("0000:c1:00.0", 0x2330, 0x030200, Some(2)),
        ]
    );
    // The AMD root complex does not know its node.
    assert_eq!(pci::home_node(&root, &addr("0000:00:00.0")), Ok(None));
}

#[test]
fn gh200_never_picks_gpu_memory_nodes() {
    let topo = topology("gh200");
    assert_eq!(topo.node_count(), 9);
    let n0 = topo.node(0).expect("node 0");
    assert!(n0.has_cpu && n0.has_memory);
    assert_eq!(n0.cpus, (0..72).collect::<Vec<_>>());
    for id in 1..9 {
        let n = topo.node(id).expect("gpu memory node");
        assert!(!n.has_cpu && n.has_memory && n.cpus.is_empty());
        assert_eq!(topo.host_node_for(id), Ok(0));
        // The seed selector ignores memory and CPUs; host_node_for is the one to use.
        assert_eq!(closest_node_to_gpu(&topo, id), Ok(id));
    }
    assert_eq!(topo.host_node_for(0), Ok(0));

    let root = fixture("gh200");
    let gpus = pci::nvidia_gpus(&root).expect("gpus");
    assert_eq!(gpus, vec![gpu("0009:01:00.0", 0x2342, 0x030200, Some(0))]);
    assert_eq!(pci::home_node(&root, &addr("0000:01:00.0")), Ok(Some(0)));
}

#[test]
fn memoryless_node_holding_the_gpu() {
    let topo = topology("memoryless-gpu");
    let n1 = topo.node(1).expect("node 1");
    assert!(n1.has_cpu && !n1.has_memory);
    assert_eq!(n1.memory_bytes, 0);
    let root = fixture("memoryless-gpu");
    let gpus = pci::nvidia_gpus(&root).expect("gpus");
    assert_eq!(gpus, vec![gpu("0000:80:00.0", 0x2236, 0x030200, Some(1))]);
    // Node 2 (distance 15) is nearer to node 1 than node 0 (distance 20).
    assert_eq!(topo.host_node_for(1), Ok(2));
    assert_eq!(topo.host_node_for(0), Ok(0));
    // The farthest node with memory from node 2 is node 0; node 1 has none.
    assert_eq!(topo.farthest_node_from(2), Some(0));
    assert_eq!(topo.farthest_node_from(1), Some(0));
}

#[test]
fn sparse_node_ids() {
    let topo = topology("sparse");
    assert_eq!(topo.node_count(), 2);
    assert_eq!(topo.node_ids(), &[0, 2]);
    assert_eq!(topo.distance(0, 2), Some(20));
    assert_eq!(topo.distance(0, 1), None);
    assert!(!topo.contains(1));
    let root = fixture("sparse");
    let gpus = pci::nvidia_gpus(&root).expect("gpus");
    assert_eq!(gpus, vec![gpu("0000:3b:00.0", 0x1eb8, 0x030200, Some(2))]);
    assert_eq!(topo.host_node_for(2), Ok(2));

    let buf = NumaBuffer::closest_to_gpu(&topo, 2, 1 << 20).expect("buffer");
    assert_eq!(buf.to_string(), "NumaBuffer(node=2, 1048576 bytes)");
    let mut tracker = NumaAllocTracker::new(&topo);
    tracker.record(&buf).expect("record");
    assert_eq!(tracker.bytes_on_node(2), Some(1 << 20));
    assert_eq!(tracker.least_loaded_node(), Some(0));
    assert_eq!(
        NumaBuffer::on_node(&topo, 1, 64),
        Err(Error::UnknownNode {
            node: 1,
            node_count: 2
        })
    );
}

#[test]
fn single_node_old_kernel_and_unknown_gpu_node() {
    // No has_cpu / has_memory files: every online node has both.
    let topo = topology("single");
    assert_eq!(topo.node_ids(), &[0]);
    let n0 = topo.node(0).expect("node 0");
    assert!(n0.has_cpu && n0.has_memory);
    assert_eq!(n0.cpus, vec![0, 1, 2, 3]);
    assert_eq!(topo.farthest_node_from(0), None);
    let root = fixture("single");
    let gpus = pci::nvidia_gpus(&root).expect("gpus");
    assert_eq!(gpus, vec![gpu("0000:00:04.0", 0x2330, 0x030200, None)]);
    assert_eq!(pci::home_node(&root, &addr("0000:00:04.0")), Ok(None));
    // A device that is not there.
    assert!(matches!(
        pci::home_node(&root, &addr("0000:00:05.0")),
        Err(Error::Io {
            kind: std::io::ErrorKind::NotFound,
            ..
        })
    ));
}

#[test]
fn kernel_without_numa_is_one_node() {
    let root = fixture("no-numa/sys");
    let topo = NumaTopology::from_sysfs_root(&root).expect("topology");
    assert_eq!(topo.node_ids(), &[0]);
    let n0 = topo.node(0).expect("node 0");
    assert_eq!(n0.cpus, (0..8).collect::<Vec<_>>());
    assert_eq!(n0.memory_bytes, 32_768_000 * 1024);
    assert_eq!(topo.host_node_for(0), Ok(0));
    // No bus/pci/devices: no GPU, not an error.
    assert_eq!(pci::nvidia_gpus(&root), Ok(vec![]));
}

#[test]
fn empty_has_memory_means_no_memory_node() {
    let topo = topology("no-memory");
    assert!(topo.nodes().iter().all(|n| !n.has_memory && n.has_cpu));
    assert_eq!(topo.host_node_for(0), Err(Error::NoMemoryNode));
    assert_eq!(topo.farthest_node_from(0), None);
}

/// Asserts a parse error about `file` (relative to the fixture root).
fn assert_parse_error(name: &str, file: &str) {
    match NumaTopology::from_sysfs_root(fixture(name)) {
        Err(Error::Parse { path, .. }) => {
            assert_eq!(path, fixture(name).join(file), "{name}")
        }
        other => panic!("{name}: expected a parse error, got {other:?}"),
    }
}

#[test]
fn malformed_trees_are_parse_errors() {
    assert_parse_error("bad-empty-distance", "devices/system/node/node1/distance");
    assert_parse_error("bad-garbage-distance", "devices/system/node/node1/distance");
    assert_parse_error("bad-truncated-row", "devices/system/node/node1/distance");
    assert_parse_error("bad-non-square", "devices/system/node/node0/distance");
    assert_parse_error(
        "bad-distance-overflow",
        "devices/system/node/node0/distance",
    );
    assert_parse_error("bad-garbage-online", "devices/system/node/online");
    assert_parse_error("bad-garbage-cpulist", "devices/system/node/node0/cpulist");
    assert_parse_error("bad-garbage-meminfo", "devices/system/node/node0/meminfo");
}

#[test]
fn malformed_trees_other_errors() {
    assert_eq!(
        NumaTopology::from_sysfs_root(fixture("bad-diagonal")),
        Err(Error::LocalDistance {
            node: 1,
            distance: 12
        })
    );
    assert_eq!(
        NumaTopology::from_sysfs_root(fixture("bad-empty-online")),
        Err(Error::ZeroNodes)
    );
    match NumaTopology::from_sysfs_root(fixture("bad-missing-distance")) {
        Err(Error::Io { path, kind, .. }) => {
            assert_eq!(kind, std::io::ErrorKind::NotFound);
            assert!(path.ends_with("node1/distance"), "{path:?}");
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
    // A mistyped root is an error, not a non-NUMA machine.
    assert!(matches!(
        NumaTopology::from_sysfs_root(fixture("does-not-exist")),
        Err(Error::Io {
            kind: std::io::ErrorKind::NotFound,
            ..
        })
    ));
}

#[test]
fn malformed_pci_numa_node() {
    let root = fixture("bad-pci");
    assert!(matches!(
        pci::nvidia_gpus(&root),
        Err(Error::Parse { path, .. }) if path.ends_with("numa_node")
    ));
    assert!(matches!(
        pci::home_node(&root, &addr("0000:01:00.0")),
        Err(Error::Parse { .. })
    ));
}

#[test]
fn this_machine() {
    // The CI/dev machines are single-node; a multi-node host still must parse.
    let topo = NumaTopology::from_sysfs().expect("this machine's topology");
    assert!(topo.node_count() >= 1);
    if Path::new("/sys/devices/system/node/node1").exists() {
        return;
    }
    assert_eq!(topo.node_ids(), &[0]);
    let n0 = topo.node(0).expect("node 0");
    assert!(n0.has_memory && n0.memory_bytes > 0);
    assert!(!n0.cpus.is_empty());
    assert_eq!(topo.host_node_for(0), Ok(0));
    // Listing GPUs must not fail on a real /sys either.
    pci::nvidia_gpus(Path::new("/sys")).expect("gpus");
}
