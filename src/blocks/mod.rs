//! One allocator value's large path, split by job, each type in its own file:
//!
//! - [`Blocks`] (`mod.rs`, `requests.rs`): the value's settings, counters and placement state;
//!   what the front ends ask (allocate, free, resize, grow, trim, attach GPU work) and where a
//!   request goes; its kind and pin policy.
//! - [`CarvedPath`] (`chunks.rs`): blocks carved from chunks, and new chunks.
//! - [`DedicatedPath`] (`block.rs`): blocks with a mapping of their own, cached or new, grown
//!   by moving pages.
//! - [`Pressure`] (`pressure.rs`): idle memory given back when memory, address space or the
//!   pinned limit runs short.
//! - [`Reserver`] (`reserve.rs`): memory made ahead of the requests that will want it.
//! - [`Unpinnable`] (`pinning.rs`): why `pin=strict` refuses a target.
//! - [`ValueStats`] (`stats.rs`): the value's counters and the process's arenas in its stats.
//!
//! Memory itself is made by the placer (`chunk/place.rs`: map, place, populate, check,
//! register; the pin policy decided once). The arenas, the topology, the cpuset, the limits,
//! the page size and the chunk source are the process's (`process/`), shared by every value;
//! a value keeps its settings, its targets (in the runtime) and this small policy.

mod block;
mod chunks;
mod pinning;
mod pressure;
mod requests;
pub(crate) mod reserve;
mod stats;
#[cfg(test)]
mod tests;
mod written;

pub(crate) use pinning::Unpinnable;
pub(crate) use reserve::Reserver;
pub(crate) use stats::ValueStats;

use std::ptr::NonNull;

use block::DedicatedPath;
use chunks::CarvedPath;
use pressure::Pressure;
use written::Plan;

use crate::arena::{count_release, Arena, HeapKey, Kind, PurgeFailures, Released, CHUNK_MAX};
use crate::chunk::{Chunk, Numa, Part, PinFlags, PinPolicy, Place, Placer, Rules, Seams};
use crate::config::{Config, PinMode};
use crate::cuda::{Gpu, RegisterFlags};
use crate::process::{faults, LargePath, NODES};
use crate::stats::Counters;
use crate::sys::lock::Guard;
use crate::sys::{MemPolicy, NodeMask};
use crate::topology::cgroup::MemoryLimits;
use crate::Error;

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

impl Resolved {
    /// Where the placer puts the target's memory.
    pub(crate) fn place(&self) -> Place {
        Place {
            nodes: self.nodes,
            gpu: self.gpu,
        }
    }
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
    /// Requests not asked zeroed up to this size are populated in bulk (`bulk_max=`).
    pub(crate) bulk_max: usize,
    pub(crate) pin: PinMode,
    pub(crate) pin_limit: usize,
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
            bulk_max: config.bulk_max,
            pin: config.pin,
            pin_limit: config.pin_limit,
            cache_limit: config.cache_limit,
            decay_ms: config.decay_ms,
            decay_thread: config.decay_thread,
            sysfs_root: config.sysfs_root,
        }
    }
}

/// The large path of one allocator value: its settings and placement rules, whether it still
/// places with `mbind`, its counters, and the process's large path it shares with every value
/// (topology, cpuset, limits, page size, chunk source; the arenas are the node table's).
///
/// A request reads top to bottom: [`Blocks::allocate`] (`requests.rs`) dispatches to the
/// carving path ([`CarvedPath`], `chunks.rs`), reserved room, or the dedicated path
/// ([`DedicatedPath`], `block.rs`); memory is made by the placer ([`Placer`],
/// `chunk/place.rs`); what an arena hands out is finished outside its lock ([`Blocks::finish`]).
/// Memory pressure is [`Pressure`]'s (`pressure.rs`), reservations [`Reserver`]'s
/// (`reserve.rs`).
pub(crate) struct Blocks {
    pub(crate) settings: Settings,
    /// What the placer needs of the settings.
    rules: Rules,
    /// Whether blocks are still placed (this value's view: its topology, the kernel's refusals).
    numa: Numa,
    pub(crate) counters: Counters,
    /// What the process knows (made by its first initialisation, shared by every value).
    process: &'static LargePath,
}

impl Blocks {
    /// The large path for `config` over the process's large path `process` (`topology_error`:
    /// why the value's topology could not be read; then its blocks go unplaced).
    pub(crate) fn new(
        config: Config,
        topology_error: Option<Error>,
        process: &'static LargePath,
    ) -> Blocks {
        let populate_threads = match config.populate_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            n => n,
        };
        Blocks {
            rules: Rules {
                policy: config.policy,
                verify: config.verify,
                huge_pages: config.huge_pages,
                populate_threads,
                flags: PinFlags {
                    register: RegisterFlags {
                        devicemap: config.pin_devicemap,
                        read_only: config.pin_read_only,
                    },
                    limit: config.pin_limit,
                },
                register_max: config.register_max,
            },
            settings: Settings::of(&config),
            numa: Numa::new(topology_error),
            counters: Counters::default(),
            process,
        }
    }

    /// The process's large path this value shares.
    pub(crate) fn process(&self) -> &'static LargePath {
        self.process
    }

    /// This value's share of the stats.
    pub(crate) fn stats(&self) -> ValueStats<'_> {
        ValueStats {
            counters: &self.counters,
        }
    }

    /// The reservations this value makes.
    pub(crate) fn reserver(&self) -> Reserver<'_> {
        Reserver { blocks: self }
    }

    /// The page size.
    pub(crate) fn page_size(&self) -> usize {
        self.process.page_size()
    }

    /// The placer of this value's memory.
    pub(crate) fn placer(&self) -> Placer<'_> {
        Placer {
            rules: &self.rules,
            numa: &self.numa,
            counters: &self.counters,
            seams: self,
        }
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
            || PinPolicy::of(s.pin).asked()
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

    /// How much of a new block's never-populated region (`len` bytes at `start`, of a block of
    /// `capacity` bytes) is populated when handed out: as [`Self::populates_request`] says,
    /// except that a lazy kind's request larger than `bulk_max=` is populated in bulk only while
    /// the process was seen writing blocks of its size whole (see `written.rs`).
    pub(crate) fn populate_plan(
        &self,
        kind: Kind,
        zeroed: bool,
        capacity: usize,
        (start, len): (usize, usize),
    ) -> Plan<'static> {
        if !self.populates_request(kind, zeroed) {
            return Plan::lazy();
        }
        if !kind.lazy {
            return Plan::whole(len);
        }
        // Huge pages are advised for such blocks and chunks (`Placer::map`, `CarvedPath::carve`).
        let unit = if self.settings.huge_pages && capacity >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            self.page_size()
        };
        written::LEARNT.plan(self.settings.bulk_max, capacity, (start, len), unit)
    }

    /// Whether a new block of `capacity` bytes for a request of a lazy kind not asked zeroed is
    /// to be handed out lazily because blocks of its size were not seen written whole (see
    /// `written.rs`): its user may touch little of it.
    pub(crate) fn suspects_barely_touched(
        &self,
        kind: Kind,
        zeroed: bool,
        capacity: usize,
    ) -> bool {
        kind.lazy
            && self.populates_request(kind, zeroed)
            && !written::LEARNT.trusted(self.settings.bulk_max, capacity)
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
        self.numa.placing()
    }

    /// Why NUMA placement is off, if it is.
    pub(crate) fn numa_unavailable(&self) -> Option<Error> {
        self.numa.unavailable()
    }

    /// The kernel's refusal of `mbind` after initialisation, if any (no heap data: the exit
    /// report reads it).
    pub(crate) fn mbind_refusal(&self) -> Option<Error> {
        self.numa.refusal()
    }

    /// The longest chunk made of a kind: the registration bound (`register_max=`, taken into
    /// 2 MiB to 1 GiB) when pinned, so that one registration never covers more; else
    /// [`CHUNK_MAX`].
    pub(crate) fn chunk_max(&self, pinned: bool) -> usize {
        if !pinned {
            return CHUNK_MAX;
        }
        self.rules.registration_bound().min(CHUNK_MAX)
    }

    /// What the blocks made for `target` are made with (see [`Kind`]); under `pin=strict`, why
    /// none can be made when they could not be page-locked.
    pub(crate) fn kind(&self, target: &Resolved) -> Result<Kind, Error> {
        let usable = target.gpu.is_some_and(Gpu::usable);
        let pin = PinPolicy::decide(self.settings.pin, usable);
        if pin.strict() && (!usable || self.settings.pin_limit == 0) {
            // Resolved with a usable GPU, a target loses it only to a fork.
            return Err(target.unpinnable.unwrap_or(Unpinnable::Forked).error());
        }
        Ok(self.kind_of(pin.registers()))
    }

    /// What a block made under this value's policy is made with, pinned or not.
    pub(crate) fn kind_of(&self, pinned: bool) -> Kind {
        let flags = if pinned {
            self.rules.flags.register
        } else {
            RegisterFlags::default()
        };
        Kind {
            policy: self.settings.policy,
            pinned,
            flags,
            lazy: !pinned && !self.populates(),
            verified: self.settings.verify,
        }
    }

    /// The arena of `node`, locked; `None` only for a node id no topology holds.
    fn arena(&self, node: usize) -> Option<Guard<'static, Arena>> {
        NODES.lock(node)
    }

    /// The nodes the policy names for blocks of `host_node`'s arena.
    fn policy_nodes_of(&self, host_node: usize) -> NodeMask {
        self.process.policy_nodes(self.settings.policy, host_node)
    }

    /// Adds a chunk made for `key` to `node`'s arena (releasing it when that fails), and starts
    /// the process's decay thread when this value asks for it.
    fn add_chunk(&self, node: usize, key: HeapKey, chunk: Chunk) -> Option<()> {
        let added = self
            .arena(node)
            .map(|mut arena| arena.add_chunk(key, chunk));
        match added {
            Some(Ok(())) => {
                if self.settings.decay_thread {
                    crate::process::decay::ensure_running(
                        self.settings.decay_ms,
                        self.settings.sysfs_root,
                    );
                }
                Some(())
            }
            Some(Err(chunk)) => {
                count_release(&self.counters, chunk.release());
                None
            }
            None => None,
        }
    }

    /// Does what an arena operation on `node` left to do outside its lock (see
    /// [`Released::finish`]), counted in this value's counters. Returns the purges that failed.
    pub(crate) fn finish(&self, node: usize, out: &mut Released) -> PurgeFailures {
        out.finish(NODES.existing(node), &self.counters)
    }

    /// Runs `f` on `node`'s arena, then does what it left to do.
    pub(crate) fn with_arena<T>(
        &self,
        node: usize,
        f: impl FnOnce(&mut Guard<'_, Arena>, &mut Released) -> T,
    ) -> Option<T> {
        let mut out = Released::default();
        let result = {
            let mut arena = self.arena(node)?;
            f(&mut arena, &mut out)
        };
        self.finish(node, &mut out);
        Some(result)
    }
}

/// The placer's way to the process (its workers, limits, page size) and to this value's memory
/// pressure (idle page-locked memory given back).
impl Seams for Blocks {
    fn page_size(&self) -> usize {
        self.process.page_size()
    }

    fn memory_limits(&self) -> &MemoryLimits {
        self.process.memory_limits()
    }

    fn populate(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
        threads: usize,
        huge: bool,
    ) -> Result<bool, Error> {
        self.process.populate(part, nodes, threads, huge)
    }

    fn make_pinned_room(&self, bytes: usize) {
        Pressure { blocks: self }.give_back_page_locked(bytes);
    }

    fn advise_lazy(&self, part: &mut Part<'_>) {
        faults::advise_lazy(part);
    }
}

/// Blocks of at least this size get 2 MiB alignment and `MADV_HUGEPAGE` (when enabled).
pub(crate) use crate::sys::HUGE_PAGE;
/// Pages looked at to tell whether a dirty part was touched whole by its last user
/// ([`Blocks::clears_by_dropping`]): one `mincore` each, a few microseconds in all.
const CLEAR_SAMPLES: usize = 8;
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
