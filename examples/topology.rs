//! Prints the NUMA topology like `numactl --hardware`, then the NVIDIA GPUs with their home node
//! and the host node this crate would place their buffers on.
//!
//! ```text
//! cargo run --example topology                          # this machine (/sys)
//! cargo run --example topology tests/fixtures/gh200     # a fixture tree
//! ```

#[path = "support/cli.rs"]
mod cli;

use std::path::PathBuf;

use numa_gpu_alloc::unstable::pci;
use numa_gpu_alloc::unstable::sysfs::format_list;
use numa_gpu_alloc::NumaTopology;

const USAGE: &str = "usage: topology [SYSFS_ROOT]
  SYSFS_ROOT  the sysfs tree to read (default /sys), e.g. tests/fixtures/gh200
Prints the NUMA nodes like numactl --hardware, then the NVIDIA GPUs with their home node and the
host node numa-gpu-alloc would place their buffers on.";

fn main() {
    let root = cli::positional(USAGE, 1)
        .pop()
        .map_or_else(|| PathBuf::from("/sys"), PathBuf::from);
    cli::exit_on_error(run(root));
}

fn run(root: PathBuf) -> Result<(), numa_gpu_alloc::Error> {
    let topo = NumaTopology::from_sysfs_root(&root)?;
    let ids = topo.node_ids();

    println!(
        "available: {} nodes ({})",
        topo.node_count(),
        format_list(ids)
    );
    for node in topo.nodes() {
        print!("node {} cpus:", node.id);
        for cpu in &node.cpus {
            print!(" {cpu}");
        }
        println!();
        println!("node {} size: {} MB", node.id, node.memory_bytes >> 20);
    }
    println!("node distances:");
    // numactl's column widths, without its trailing spaces.
    print!("node");
    for id in ids {
        print!(" {id:>3}");
    }
    println!();
    for &from in ids {
        print!("{from:>3}:");
        for &to in ids {
            match topo.distance(from, to) {
                Some(d) => print!(" {d:>3}"),
                None => print!(" {:>3}", "-"),
            }
        }
        println!();
    }

    let gpus = pci::nvidia_gpus(&root)?;
    if gpus.is_empty() {
        println!("no NVIDIA GPU found");
    }
    for gpu in gpus {
        let prefix = format!("GPU {} (device {:#06x})", gpu.address, gpu.device_id);
        match gpu.home_node {
            None => println!("{prefix}: home node unknown (numa_node -1), no host node chosen"),
            Some(home) => match topo.host_node_for(home) {
                Ok(host) => println!("{prefix}: home node {home}, host node {host}"),
                Err(e) => println!("{prefix}: home node {home}, no host node: {e}"),
            },
        }
    }
    Ok(())
}
