//! Where an allocator decides to place blocks, for machines described by sysfs fixture trees
//! (`tests/fixtures`). Only the decision is checked: this host has one node, so nothing is
//! allocated on the fixture's nodes.

use numa_gpu_alloc::unstable::pci::PciAddress;
use numa_gpu_alloc::{NumaGpuAlloc, PinMode};

macro_rules! fixture {
    ($name:literal) => {
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/", $name)
    };
}

fn placed(alloc: NumaGpuAlloc) -> (usize, Option<usize>) {
    let placement = alloc.placement();
    assert!(!placement.pinning, "no CUDA driver here");
    (placement.host_node, placement.home_node)
}

fn gpu(root: &'static str, address: &str) -> NumaGpuAlloc {
    let address: PciAddress = address.parse().unwrap();
    NumaGpuAlloc::new()
        .sysfs_root(root)
        .gpu_pci(address)
        .pin(PinMode::Off)
}

#[test]
fn gpu_by_pci_address_is_served_from_its_socket() {
    let root = fixture!("intel-2s");
    let gpus = numa_gpu_alloc::unstable::pci::nvidia_gpus(std::path::Path::new(root)).unwrap();
    let on_node_1 = gpus.iter().find(|g| g.home_node == Some(1)).unwrap();
    assert_eq!(
        placed(gpu(root, &on_node_1.address.to_string())),
        (1, Some(1))
    );
}

#[test]
fn memoryless_home_node_uses_the_nearest_node_with_memory() {
    let root = fixture!("memoryless-gpu");
    let gpus = numa_gpu_alloc::unstable::pci::nvidia_gpus(std::path::Path::new(root)).unwrap();
    let (host, home) = placed(gpu(root, &gpus[0].address.to_string()));
    assert_eq!(home, Some(1));
    assert_eq!(host, 2, "node 2 (distance 15) is nearer than node 0 (20)");
}

#[test]
fn gh200_never_picks_a_gpu_memory_node() {
    let root = fixture!("gh200");
    let gpus = numa_gpu_alloc::unstable::pci::nvidia_gpus(std::path::Path::new(root)).unwrap();
    assert_eq!(placed(gpu(root, &gpus[0].address.to_string())).0, 0);
}

#[test]
fn explicit_node_and_unknown_node() {
    let root = fixture!("sparse");
    assert_eq!(placed(NumaGpuAlloc::new().sysfs_root(root).node(2)).0, 2);
    let alloc = NumaGpuAlloc::new().sysfs_root(root).node(1);
    let (host, _) = placed(NumaGpuAlloc::new().sysfs_root(root).node(1));
    assert!(
        host == 0 || host == 2,
        "falls back to an online node, got {host}"
    );
    alloc.placement();
    let errors = alloc.stats().config_errors;
    assert!(
        errors
            .iter()
            .any(|e| matches!(e, numa_gpu_alloc::Error::UnknownNode { node: 1, .. })),
        "{errors:?}"
    );
}

#[test]
fn unknown_gpu_home_node_falls_back_to_the_calling_thread() {
    let root = fixture!("single");
    let gpus = numa_gpu_alloc::unstable::pci::nvidia_gpus(std::path::Path::new(root)).unwrap();
    assert_eq!(gpus[0].home_node, None);
    assert_eq!(placed(gpu(root, &gpus[0].address.to_string())), (0, None));
}

#[test]
fn explicit_memoryless_node_uses_its_nearest_node_with_memory() {
    let alloc = NumaGpuAlloc::new()
        .sysfs_root(fixture!("memoryless-gpu"))
        .node(1);
    assert_eq!(alloc.placement().host_node, 2);
    let errors = alloc.stats().config_errors;
    assert!(
        matches!(&errors[..], [numa_gpu_alloc::Error::Config { key, value, .. }] if key == "node" && value == "1"),
        "{errors:?}"
    );
}
