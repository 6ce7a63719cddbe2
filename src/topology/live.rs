//! The kernel's live counters that allocations read: a node's free memory (`nodeN/meminfo`)
//! and direct compaction stalls (`/proc/vmstat`), from descriptors [`open_counters`] opened at
//! the process's initialisation and read with `pread64` (`sys/counters.rs`): inside an
//! allocation no file is opened, no lock of glibc's taken, no cancellation point met.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use crate::sys::counters::CounterFile;

/// Whether node `node`'s free memory is below 1/8 of its total (`nodeN/meminfo` under
/// `root`, the kernel's per-node counters): then idle memory of the node is given back before
/// more is populated there, and by the decay thread. `false` when the file cannot be read.
///
/// Under the root [`open_counters`] opened, the file is read from the descriptor it opened: no
/// lock, no allocation, no cancellation point, as inside an allocation. Under another root (a
/// fixture tree's value) it is opened now; that allocates nothing either (the path and the text
/// are on the stack).
pub(crate) fn node_memory_low(root: &Path, node: usize) -> bool {
    let mut text = [0u8; 2048];
    let counted = COUNTED_ROOT.get().is_some_and(|counted| counted == root);
    let text = match MEMINFO.get(node).filter(|_| counted) {
        Some(file) => file.read(&mut text),
        None => read_node_meminfo(root, node, &mut text),
    };
    text.is_some_and(memory_low)
}

/// Opens the counters [`node_memory_low`] and [`compaction_stalls`] read inside allocations:
/// the meminfo files of `nodes` under `root`, and `/proc/vmstat`.
/// Called once, by the process's initialisation; later calls change nothing.
pub(crate) fn open_counters(root: &Path, nodes: &[usize]) {
    if COUNTED_ROOT.set(root.to_path_buf()).is_err() {
        return;
    }
    for &node in nodes {
        if let Some(file) = MEMINFO.get(node) {
            file.open(&root.join(format!("devices/system/node/node{node}/meminfo")));
        }
    }
    VMSTAT.open(Path::new("/proc/vmstat"));
}

/// The root [`open_counters`] opened the nodes' files under.
static COUNTED_ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
/// The nodes' meminfo files, by node id.
static MEMINFO: [CounterFile; crate::sys::MAX_NODES] =
    [const { CounterFile::new() }; crate::sys::MAX_NODES];
static VMSTAT: CounterFile = CounterFile::new();

/// Node `node`'s meminfo under `root`, read into `text` by path (allocates nothing).
fn read_node_meminfo<'a>(root: &Path, node: usize, text: &'a mut [u8]) -> Option<&'a [u8]> {
    use std::io::Write as _;
    use std::os::unix::ffi::OsStrExt as _;
    let mut path = [0u8; 512];
    let len = {
        let mut out = &mut path[..];
        let written = out.write_all(root.as_os_str().as_bytes()).is_ok()
            && write!(out, "/devices/system/node/node{node}/meminfo").is_ok();
        if !written {
            return None;
        }
        512 - out.len()
    };
    let path = Path::new(std::ffi::OsStr::from_bytes(&path[..len]));
    let mut file = std::fs::File::open(path).ok()?;
    // MemTotal and MemFree are the first lines; the rest may be cut off.
    let mut filled = 0;
    while filled < text.len() {
        match file.read(&mut text[filled..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => filled += n,
        }
    }
    Some(&text[..filled])
}

/// Whether a node's meminfo `text` says its free memory is below 1/8 of its total.
fn memory_low(text: &[u8]) -> bool {
    let kib = |key: &[u8]| {
        text.split(|&b| b == b'\n').find_map(|line| {
            let at = line.windows(key.len()).position(|w| w == key)?;
            let mut digits = line[at + key.len()..]
                .iter()
                .skip_while(|b| b.is_ascii_whitespace())
                .take_while(|b| b.is_ascii_digit());
            digits.try_fold(0u64, |n, &d| {
                n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
            })
        })
    };
    match (kib(b"MemFree:"), kib(b"MemTotal:")) {
        (Some(free), Some(total)) => free < total / 8,
        _ => false,
    }
}

/// The kernel's count of direct compaction stalls so far (`compact_stall` in `/proc/vmstat`):
/// allocations that waited for memory to be compacted. `None` when it cannot be read.
/// Read from the descriptor [`open_counters`] opened (`None` before): no lock, no allocation.
pub(crate) fn compaction_stalls() -> Option<u64> {
    // /proc/vmstat is about 6 KiB; `compact_stall` lies in its second half.
    let mut text = [0u8; 16 << 10];
    let text = VMSTAT.read(&mut text)?;
    text.split(|&b| b == b'\n').find_map(|line| {
        let count = line.strip_prefix(b"compact_stall ")?;
        std::str::from_utf8(count).ok()?.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_counts_compaction_stalls() {
        // Every kernel with compaction has the counter; it only grows.
        open_counters(Path::new("/sys"), &[0]);
        let first = compaction_stalls().expect("compact_stall in /proc/vmstat");
        assert!(compaction_stalls().unwrap() >= first);
    }

    #[test]
    fn a_node_is_low_on_memory_below_an_eighth_free() {
        let root = std::env::temp_dir().join(format!("numa-gpu-alloc-low-{}", std::process::id()));
        let dir = root.join("devices/system/node/node1");
        std::fs::create_dir_all(&dir).unwrap();
        let meminfo = |free: u64| {
            format!("Node 1 MemTotal:       307200 kB\nNode 1 MemFree:        {free} kB\n")
        };
        std::fs::write(dir.join("meminfo"), meminfo(38_399)).unwrap();
        assert!(node_memory_low(&root, 1));
        std::fs::write(dir.join("meminfo"), meminfo(38_400)).unwrap();
        assert!(!node_memory_low(&root, 1));
        assert!(!node_memory_low(&root, 2), "no such node: not low");
        std::fs::remove_dir_all(root).unwrap();
    }
}
