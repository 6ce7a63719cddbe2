//! What the large path knows of the process, made once and owned once: the machine's topology
//! (for the CPUs that populate a node's memory and the nodes' sizes), the memory nodes the
//! cpuset allows, the cgroup memory limits, the page size and where chunk memory comes from.
//! The arenas (`nodes.rs`), the decay thread's settings and counters (`decay.rs`) and the
//! populate workers (`workers.rs`) are the process's too.
//!
//! Made by the process's first initialisation, under the initialisation lock (so a fork never
//! copies a half-made one), from that value's sysfs root: a later value with another root (a
//! fixture tree) resolves its own targets from its own tree, and shares this one's large path.
//!
//! Unsafe code here relies on the large path being leaked once and never freed.
#![allow(unsafe_code)]

use std::borrow::Cow;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};

use super::workers;
use crate::chunk::{ChunkSource, Part, ANONYMOUS};
use crate::config::Config;
use crate::setup::Setup;
use crate::sys::{self, MemPolicy, NodeMask};
use crate::topology::cgroup::MemoryLimits;
use crate::{Error, NumaTopology};

/// The process's large path, once made.
static LARGE: AtomicPtr<LargePath> = AtomicPtr::new(std::ptr::null_mut());

/// The process's large path, made now (from `sysfs_root`) if this is the first initialisation.
/// Taking `setup` proves the caller holds the initialisation lock.
pub(crate) fn large_path(_setup: &mut Setup, sysfs_root: &'static str) -> &'static LargePath {
    // SAFETY: non-null only once a leaked, never freed `LargePath` was stored.
    if let Some(made) = unsafe { LARGE.load(Ordering::Acquire).as_ref() } {
        return made;
    }
    let made: &'static LargePath = Box::leak(Box::new(LargePath::of_this_process(sysfs_root)));
    LARGE.store(std::ptr::from_ref(made).cast_mut(), Ordering::Release);
    made
}

/// See the module's documentation.
#[derive(Debug)]
pub(crate) struct LargePath {
    topology: NumaTopology,
    /// The sysfs root the topology was read from, and why it could not be (then it is one node).
    sysfs_root: &'static str,
    topology_error: Option<Error>,
    /// Whether the topology is this kernel's (else a fixture tree's, which the cpuset does not
    /// describe).
    own_kernel: bool,
    /// Memory nodes this process's cpuset allows (`None`: all, or unknown).
    allowed: Option<NodeMask>,
    memory_limits: MemoryLimits,
    /// The CPUs this process may use (see [`process_allowed_cpus`]), read at initialisation: the
    /// cgroup's files are not opened inside an allocation.
    allowed_cpus: Vec<usize>,
    page_size: usize,
    source: &'static dyn ChunkSource,
}

impl LargePath {
    /// The large path over `topology` (`own_kernel`: read from this kernel's sysfs, not a
    /// fixture tree), with the nodes the cpuset allows, the process's cgroup limits and page
    /// size, and chunk memory from `source`.
    pub(crate) fn new(
        topology: NumaTopology,
        own_kernel: bool,
        source: &'static dyn ChunkSource,
    ) -> LargePath {
        LargePath {
            topology,
            sysfs_root: Config::DEFAULT.sysfs_root,
            topology_error: None,
            own_kernel,
            // EPERM under seccomp: then mbind is refused too, and every node is as good as
            // another.
            allowed: sys::allowed_memory_nodes().ok(),
            memory_limits: MemoryLimits::of_this_process(),
            allowed_cpus: process_allowed_cpus(),
            page_size: sys::page_size(),
            source,
        }
    }

    /// Read from `sysfs_root` (a single node when it cannot be read).
    fn of_this_process(sysfs_root: &'static str) -> LargePath {
        let (topology, topology_error) = read_topology(sysfs_root);
        // What allocations read of the kernel later, opened or read now: inside an allocation a
        // file's `open` could take a lock of glibc's and is a cancellation point.
        crate::topology::live::open_counters(Path::new(sysfs_root), topology.node_ids());
        super::faults::learn_host(Path::new(sysfs_root));
        sys::find_thread_overhead();
        let own_kernel = sysfs_root == Config::DEFAULT.sysfs_root;
        LargePath {
            sysfs_root,
            topology_error,
            ..LargePath::new(topology, own_kernel, &ANONYMOUS)
        }
    }

    /// The topology under `sysfs_root` and why it could not be read (then one node): the
    /// process's own when it was read from there, else read now (a value's fixture tree).
    pub(crate) fn topology_at(
        &'static self,
        sysfs_root: &'static str,
    ) -> (Cow<'static, NumaTopology>, Option<Error>) {
        if sysfs_root == self.sysfs_root {
            return (Cow::Borrowed(&self.topology), self.topology_error.clone());
        }
        let (topology, error) = read_topology(sysfs_root);
        (Cow::Owned(topology), error)
    }

    /// The memory nodes the cpuset allows (`None`: all).
    pub(crate) fn allowed(&self) -> Option<NodeMask> {
        self.allowed
    }

    pub(crate) fn page_size(&self) -> usize {
        self.page_size
    }

    pub(crate) fn memory_limits(&self) -> &MemoryLimits {
        &self.memory_limits
    }

    /// Where chunk memory comes from.
    pub(crate) fn source(&self) -> &'static dyn ChunkSource {
        self.source
    }

    /// How many nodes the topology has.
    pub(crate) fn node_count(&self) -> usize {
        self.topology.node_count()
    }

    /// The node's memory (where sysfs tells it; 0: unknown).
    pub(crate) fn node_bytes(&self, node: usize) -> usize {
        self.topology
            .node(node)
            .map_or(0, |n| usize::try_from(n.memory_bytes).unwrap_or(usize::MAX))
    }

    /// The nodes `policy` names for blocks of `host_node`'s arena (see [`policy_nodes`]).
    pub(crate) fn policy_nodes(&self, policy: MemPolicy, host_node: usize) -> NodeMask {
        let mask = self.allowed.filter(|_| self.own_kernel);
        let allowed = |node: usize| mask.is_none_or(|mask| mask.contains(node));
        policy_nodes(policy, &self.topology, &allowed, host_node)
    }

    /// Populates a part never written for `nodes` with up to `threads` threads: the pooled
    /// workers of the node (bound to its CPUs) when the nodes are one, else workers bound to
    /// none; returns whether a huge-page part went on in small pages.
    pub(crate) fn populate(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
        threads: usize,
        huge: bool,
    ) -> Result<bool, crate::Error> {
        let mut only = nodes.iter();
        // Pages spread over several nodes (interleave) get workers bound to none.
        let node = match (only.next(), only.next()) {
            (Some(node), None) => Some(node),
            _ => None,
        };
        // Workers for several nodes' pages run on any CPU the process may use.
        let cpus = || node.map_or_else(|| self.allowed_cpus.clone(), |node| self.node_cpus(node));
        workers::populate(node, cpus, part, threads, huge)
    }

    /// The CPUs of `node` that this process may run on (its cgroup's cpuset within its main
    /// thread's affinity: never the calling thread's, which may be pinned to one core); all it
    /// may run on when the node has none (a CPU-less memory node).
    fn node_cpus(&self, node: usize) -> Vec<usize> {
        let allowed = &self.allowed_cpus;
        let on_node: Vec<usize> = self
            .topology
            .node(node)
            .map(|n| {
                n.cpus
                    .iter()
                    .copied()
                    .filter(|c| allowed.contains(c))
                    .collect()
            })
            .unwrap_or_default();
        if on_node.is_empty() {
            allowed.clone()
        } else {
            on_node
        }
    }
}

/// The nodes `policy` names for blocks of `host_node`: every allowed node with memory for
/// interleave, else the host node.
pub(crate) fn policy_nodes(
    policy: MemPolicy,
    topology: &NumaTopology,
    allowed: &dyn Fn(usize) -> bool,
    host_node: usize,
) -> NodeMask {
    let mut mask = NodeMask::empty();
    if policy == MemPolicy::Interleave {
        for node in topology.nodes().iter() {
            if node.has_memory && allowed(node.id) {
                let _ = mask.insert(node.id);
            }
        }
    }
    if mask.is_empty() {
        let _ = mask.insert(host_node);
    }
    mask
}

/// The CPUs this process may use: its cgroup's cpuset within its main thread's affinity (what
/// `taskset` chose), see [`within_affinity`] (empty when neither can be read: workers are then
/// left unbound).
fn process_allowed_cpus() -> Vec<usize> {
    within_affinity(
        crate::topology::cgroup::allowed_cpus(),
        sys::process_cpus().ok(),
    )
}

/// The CPUs of `cgroup` that `affinity` has too; whichever of the two is known when the other
/// is not; `affinity` when they share none (the kernel keeps a thread's affinity inside its
/// cpuset: such a cgroup file describes another view of the CPUs, a namespace's say).
fn within_affinity(cgroup: Option<Vec<usize>>, affinity: Option<Vec<usize>>) -> Vec<usize> {
    match (cgroup, affinity) {
        (Some(cgroup), Some(affinity)) => {
            let both: Vec<usize> = cgroup
                .into_iter()
                .filter(|cpu| affinity.contains(cpu))
                .collect();
            if both.is_empty() {
                affinity
            } else {
                both
            }
        }
        (cgroup, affinity) => cgroup.or(affinity).unwrap_or_default(),
    }
}

/// The topology under `sysfs_root`, or one node and why.
fn read_topology(sysfs_root: &str) -> (NumaTopology, Option<Error>) {
    match NumaTopology::from_sysfs_root(Path::new(sysfs_root)) {
        Ok(topology) => (topology, None),
        Err(e) => (NumaTopology::single_node(), Some(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::within_affinity;

    #[test]
    fn workers_stay_within_the_affinity_the_user_chose() {
        let cgroup = Some((0..8).collect::<Vec<usize>>());
        // taskset -c 2,3,9 under a cgroup of CPUs 0-7.
        assert_eq!(within_affinity(cgroup.clone(), Some(vec![2, 3, 9])), [2, 3]);
        assert_eq!(
            within_affinity(cgroup.clone(), Some(vec![9])),
            [9],
            "none shared"
        );
        assert_eq!(within_affinity(cgroup, None), (0..8).collect::<Vec<_>>());
        assert_eq!(within_affinity(None, Some(vec![1])), [1]);
        assert!(within_affinity(None, None).is_empty());
    }
}
