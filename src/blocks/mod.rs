//! The large path's one owner: [`Blocks`] allocates, frees, resizes, trims and reserves blocks
//! for the front ends, which never touch an arena. It alone decides whether a request is carved
//! from a chunk (`chunks.rs`), served from reserved room (`reserve.rs`) or given a dedicated
//! mapping (`block.rs`); it settles pending blocks and runs the release protocol (what an arena
//! operation hands out is released or purged outside its lock, and counted, in
//! [`Blocks::finish`]); pinning goes through its registration (`pinning.rs`).
//!
//! One value per allocator value, made from its settings when the large path initialises; the
//! arenas it drives are the process's (`process/nodes.rs`), shared by every value.

mod block;
mod chunks;
mod pinning;
mod requests;
pub(crate) mod reserve;
#[cfg(test)]
mod tests;

pub(crate) use pinning::Unpinnable;

use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, Ordering::Relaxed};

use crate::arena::{Arena, HeapKey, Kind, Shortage, CHUNK_MAX};
use crate::chunk::{ChunkSource, ANONYMOUS};
use crate::config::{Config, PinMode};
use crate::cuda::Gpu;
use crate::process::NODES;
use crate::stats::Counters;
use crate::sys::lock::Guard;
use crate::sys::{MemPolicy, NodeMask};
use crate::topology::cgroup::MemoryLimits;
use crate::{Error, NumaTopology};

/// Where one request's block goes: its node, the policy's nodes, and the context that pins it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Resolved {
    /// The node whose arena the block belongs to.
    pub(crate) host_node: usize,
    /// Nodes the policy names: the host node, or every node with memory for interleave.
    pub(crate) nodes: NodeMask,
    /// The process's retained context of the GPU, when blocks are pinned.
    pub(crate) gpu: Option<&'static Gpu>,
    /// CUDA ordinal of the GPU, when the driver knows it (pinning or not).
    pub(crate) ordinal: Option<u32>,
    /// Why `pin=strict` refuses the target's requests, when it does.
    pub(crate) unpinnable: Option<Unpinnable>,
}

/// What the large path reads of an allocator value's settings (builder and environment, as
/// resolved at initialisation): a small value of its own, so that nothing below the runtime
/// depends on the rest of [`Config`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// Requests of at least this size take the large path.
    pub(crate) threshold: usize,
    pub(crate) policy: MemPolicy,
    /// Check every block's pages (`verify=on`).
    pub(crate) verify: bool,
    pub(crate) huge_pages: bool,
    /// Populate unpinned, unchecked blocks too when handed out (`populate=eager`).
    pub(crate) populate_eager: bool,
    pub(crate) pin: PinMode,
    pub(crate) pin_limit: usize,
    pub(crate) pin_devicemap: bool,
    pub(crate) pin_read_only: bool,
    /// The most one registration covers (`register_max=`).
    pub(crate) register_max: usize,
    pub(crate) cache_limit: usize,
    pub(crate) decay_ms: u64,
    pub(crate) decay_thread: bool,
    pub(crate) sysfs_root: &'static str,
}

impl Settings {
    /// The large path's part of `config`.
    pub(crate) fn of(config: &Config) -> Settings {
        Settings {
            threshold: config.threshold,
            policy: config.policy,
            verify: config.verify,
            huge_pages: config.huge_pages,
            populate_eager: config.populate_eager,
            pin: config.pin,
            pin_limit: config.pin_limit,
            pin_devicemap: config.pin_devicemap,
            pin_read_only: config.pin_read_only,
            register_max: config.register_max,
            cache_limit: config.cache_limit,
            decay_ms: config.decay_ms,
            decay_thread: config.decay_thread,
            sysfs_root: config.sysfs_root,
        }
    }
}

/// The large path of one allocator value: its settings, what it knows of the machine, and its
/// counters.
pub(crate) struct Blocks {
    pub(crate) settings: Settings,
    pub(crate) page_size: usize,
    /// For the CPUs that populate a node's memory, and the nodes' sizes.
    topology: NumaTopology,
    /// Memory nodes this process's cpuset allows (`None`: all).
    allowed: Option<NodeMask>,
    /// Why the topology could not be read (then blocks go unplaced).
    topology_error: Option<Error>,
    /// The errno with which the kernel refused `mbind` (0: never); then blocks go unplaced. An
    /// atomic rather than a `OnceLock`, which a fork during its initialisation would leave
    /// blocking in the child.
    mbind_refused: AtomicI32,
    /// Threads that populate one big block.
    populate_threads: usize,
    /// The cgroup memory limits a new block is checked against.
    memory_limits: MemoryLimits,
    pub(crate) counters: Counters,
    /// Where its chunks' memory comes from.
    source: &'static dyn ChunkSource,
}

impl Blocks {
    /// The large path for `config` on `topology` (a stand-in when it could not be read:
    /// `topology_error`), with the nodes the cpuset allows.
    pub(crate) fn new(
        config: Config,
        topology: NumaTopology,
        topology_error: Option<Error>,
        allowed: Option<NodeMask>,
    ) -> Blocks {
        let populate_threads = match config.populate_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            n => n,
        };
        Blocks {
            settings: Settings::of(&config),
            page_size: crate::sys::page_size(),
            topology,
            allowed,
            topology_error,
            mbind_refused: AtomicI32::new(0),
            populate_threads,
            memory_limits: MemoryLimits::of_this_process(),
            counters: Counters::default(),
            source: &ANONYMOUS,
        }
    }

    /// The same large path with its chunks' memory from `source`.
    #[cfg(test)]
    pub(crate) fn with_source(self, source: &'static dyn ChunkSource) -> Blocks {
        Blocks { source, ..self }
    }

    /// Whether a block's pages are populated when it is handed out, not where its user first
    /// touches them: when it may be pinned (page-locked memory is resident), when its pages are
    /// checked (`verify=on`, `policy=bind`: only resident pages can be), when placement is off
    /// (populating is then what places a big block's pages: the node's bound workers touch them
    /// first, where the thread that first writes them might run elsewhere), or under
    /// `populate=eager`. Otherwise the kernel faults pages in where they are touched, on the nodes
    /// of the mapping's policy, and pages never touched take no memory.
    pub(crate) fn populates(&self) -> bool {
        let s = &self.settings;
        s.populate_eager
            || s.pin != PinMode::Off
            || s.verify
            || s.policy == MemPolicy::Bind
            || !self.numa_placement()
    }

    /// Whether a request's pages never handed out before are populated when it is served: always
    /// for a kind that populates ([`Self::populates`]); for a lazy kind, when the request is not
    /// zeroed. A request that does not ask for zeros is written before it is read, so it is
    /// written whole (a staging buffer, a growing `Vec`, a read target): populating its pages in
    /// bulk, with the node's workers, costs less than faulting them in one by one where its
    /// user writes (half as much on a 2-core VM, an eighth without huge pages). A zeroed
    /// request may be barely touched (`vec![0; n]` of which a few bytes are used): its fresh
    /// pages are already zero and are faulted in only where touched.
    pub(crate) fn populates_request(&self, kind: Kind, zeroed: bool) -> bool {
        !kind.lazy || !zeroed
    }

    /// Whether the part of a block of `kind` at `ptr..ptr+len` that held data is made zero by
    /// giving its pages back (they come back zero where touched), rather than by writing zeros:
    /// for a lazy kind, when its last user left fewer than half of [`CLEAR_SAMPLES`] pages spread
    /// over it resident. Pages its last user barely touched are then not faulted in by the
    /// clearing, and a zeroed buffer barely touched again stays cheap; pages it wrote whole are
    /// written over where they are, without a fault each, for a caller that writes it whole again
    /// (a buffer cleared before it is filled).
    pub(crate) fn clears_by_dropping(kind: Kind, ptr: NonNull<u8>, len: usize) -> bool {
        kind.lazy
            && crate::sys::resident_sample(ptr, len, CLEAR_SAMPLES)
                .is_none_or(|(resident, sampled)| resident < sampled)
    }

    /// Whether blocks are still placed with `mbind`.
    pub(crate) fn numa_placement(&self) -> bool {
        self.topology_error.is_none() && self.mbind_refused.load(Relaxed) == 0
    }

    /// Records that the kernel refused `mbind` with `errno`: later blocks go unplaced.
    fn refuse_mbind(&self, errno: i32) {
        // The first refusal is the one reported; a zero errno would read as "never".
        let _ = self
            .mbind_refused
            .compare_exchange(0, errno.max(1), Relaxed, Relaxed);
    }

    /// Why NUMA placement is off, if it is.
    pub(crate) fn numa_unavailable(&self) -> Option<Error> {
        self.topology_error.clone().or_else(|| self.mbind_refusal())
    }

    /// The kernel's refusal of `mbind` after initialisation, if any (no heap data: the exit
    /// report reads it).
    pub(crate) fn mbind_refusal(&self) -> Option<Error> {
        let errno = self.mbind_refused.load(Relaxed);
        (errno != 0).then_some(Error::NumaUnavailable {
            call: "mbind",
            errno,
        })
    }

    /// The arena of `node`, locked; `None` only for a node id no topology holds.
    fn arena(&self, node: usize) -> Option<Guard<'static, Arena>> {
        NODES.lock(node)
    }

    /// The nodes the policy names for blocks of `host_node`'s arena.
    fn policy_nodes_of(&self, host_node: usize) -> NodeMask {
        let allowed = |node: usize| self.allowed.is_none_or(|mask| mask.contains(node));
        policy_nodes(self.settings.policy, &self.topology, &allowed, host_node)
    }
}

/// Blocks of at least this size get 2 MiB alignment and `MADV_HUGEPAGE` (when enabled).
pub(crate) use crate::sys::HUGE_PAGE;
/// Pages looked at to tell whether a dirty part was touched whole by its last user
/// ([`Blocks::clears_by_dropping`]): one `mincore` each, a few microseconds in all.
const CLEAR_SAMPLES: usize = 8;
/// `CUresult` of a registration beyond what the driver can page-lock.
const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;

/// Whether a failure to create a block may go away when memory is given back: mmap, populate or
/// a full node (ENOMEM), a cgroup limit, or CUDA's page-locking limit.
pub(crate) fn shortage(error: &Error) -> bool {
    match error {
        Error::Syscall { errno, .. } => *errno == libc::ENOMEM,
        Error::MemoryLimit { .. } => true,
        Error::Cuda { code, .. } => *code == CUDA_ERROR_OUT_OF_MEMORY,
        _ => false,
    }
}

/// What a request short of memory by `error` needs given back.
pub(crate) fn shortage_kind(error: &Error) -> Shortage {
    match error {
        Error::Syscall { call: "mmap", .. } => Shortage::AddressSpace,
        _ => Shortage::Memory,
    }
}

/// Whether a request of `size` bytes at `align` is carved (else it gets a mapping of its own).
pub(crate) fn carved(size: usize, align: usize) -> bool {
    size < crate::arena::DEDICATED_MIN && size.saturating_add(align) <= CHUNK_MAX
}

/// The heap a reservation of bytes makes for `kind`: huge-page chunks when huge pages are on.
pub(crate) fn reserved_key(kind: Kind, huge_pages: bool) -> HeapKey {
    HeapKey {
        kind,
        huge: huge_pages,
        reserved: true,
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
