//! The const builder of [`NumaGpuAlloc`]: each setting of [`Config`](crate::Config), usable
//! in a `static`.

use std::sync::atomic::AtomicUsize;

use super::{clamp_threshold, Threshold};
use crate::config::{GpuSelector, PinMode, Reserve, Target};
use crate::sys::MemPolicy;
use crate::topology::pci::PciAddress;
use crate::NumaGpuAlloc;

impl<A> NumaGpuAlloc<A> {
    /// Requests of at least `bytes` take the large path (default 2 MiB). Values outside
    /// 4 KiB..=64 GiB are clamped; [`Config::apply`](crate::Config::apply) with `"threshold"` reports them instead.
    pub const fn threshold(mut self, bytes: usize) -> Self {
        self.config.threshold = clamp_threshold(bytes);
        self.threshold = Threshold(AtomicUsize::new(self.config.threshold));
        self
    }

    /// Places blocks on NUMA node `node` (no GPU, no pinning).
    pub const fn node(mut self, node: usize) -> Self {
        self.config.target = Target::Node(node);
        self
    }

    /// Serves the GPU the selector names.
    pub const fn gpu(mut self, selector: GpuSelector) -> Self {
        self.config.target = Target::Gpu(selector);
        self
    }

    /// Serves the GPU with this CUDA ordinal.
    pub const fn gpu_ordinal(self, ordinal: u32) -> Self {
        self.gpu(GpuSelector::Ordinal(ordinal))
    }

    /// Serves the GPU at this PCI address; placement works without the CUDA driver.
    pub const fn gpu_pci(self, address: PciAddress) -> Self {
        self.gpu(GpuSelector::Pci(address))
    }

    /// NUMA policy of large blocks (default [`MemPolicy::Preferred`]).
    pub const fn policy(mut self, policy: MemPolicy) -> Self {
        self.config.policy = policy;
        self
    }

    /// Idle memory given back to the kernel after this many milliseconds (default 1000;
    /// `u64::MAX`: never): free space of chunks is purged, wholly free chunks unmapped (pinned
    /// ones after ten times as long). Per value, on its own requests; the process's one decay
    /// thread uses the shortest of the values that made chunks.
    pub const fn decay_ms(mut self, ms: u64) -> Self {
        self.config.decay_ms = ms;
        self
    }

    /// Populate every large block when it is handed out (default off: only pinned blocks and
    /// blocks checked page by page are; the others' pages are faulted in, on their node, where
    /// they are first touched). See [`Config::populate_eager`](crate::Config::populate_eager).
    pub const fn populate_eager(mut self, on: bool) -> Self {
        self.config.populate_eager = on;
        self
    }

    /// Whether a thread gives idle memory back while the program allocates nothing large
    /// (default on; see the README on decay).
    pub const fn decay_thread(mut self, on: bool) -> Self {
        self.config.decay_thread = on;
        self
    }

    /// Idle bytes (free space of chunks that may be resident, cached dedicated blocks) a node's
    /// arena keeps before the oldest are given back at once (default 4 GiB). Per value: the
    /// arenas are the process's, and each value's requests hold them to its own limit.
    pub const fn cache_limit(mut self, bytes: usize) -> Self {
        self.config.cache_limit = bytes;
        self
    }

    /// `MADV_HUGEPAGE` and 2 MiB alignment for blocks of at least 2 MiB (default on).
    pub const fn huge_pages(mut self, on: bool) -> Self {
        self.config.huge_pages = on;
        self
    }

    /// Checks every page's node after populating and counts misplaced pages (default off).
    pub const fn verify(mut self, on: bool) -> Self {
        self.config.verify = on;
        self
    }

    /// Page-locking mode (default [`PinMode::Off`]; see the README on what pinning changes).
    pub const fn pin(mut self, mode: PinMode) -> Self {
        self.config.pin = mode;
        self
    }

    /// Registers with `CU_MEMHOSTREGISTER_DEVICEMAP` (default off).
    pub const fn pin_devicemap(mut self, on: bool) -> Self {
        self.config.pin_devicemap = on;
        self
    }

    /// Registers with `CU_MEMHOSTREGISTER_READ_ONLY` (default off).
    pub const fn pin_read_only(mut self, on: bool) -> Self {
        self.config.pin_read_only = on;
        self
    }

    /// The most bytes the process keeps page-locked through the allocator (`pin_limit=`):
    /// past it `pin=on` serves blocks unpinned (counted) after giving idle page-locked memory
    /// back, `pin=strict` fails them with [`Error::PinLimit`](crate::Error::PinLimit), and a
    /// reservation stops there.
    pub const fn pin_limit(mut self, bytes: usize) -> Self {
        self.config.pin_limit = bytes;
        self
    }

    /// Threads that populate one big block; 0 (default) picks from the available cores.
    pub const fn populate_threads(mut self, threads: usize) -> Self {
        self.config.populate_threads = threads;
        self
    }

    /// Reserves room for `blocks` blocks of `block_size` bytes at initialisation (see
    /// [`reserve`](Self::reserve); `reserve=COUNTxSIZE`; default none).
    pub const fn reserve_at_init(mut self, blocks: usize, block_size: usize) -> Self {
        self.config.reserve = Reserve::blocks(blocks, block_size);
        self
    }

    /// Reserves `bytes` of room at initialisation (see [`reserve_bytes`](Self::reserve_bytes);
    /// `reserve=SIZE`; default none).
    pub const fn reserve_bytes_at_init(mut self, bytes: usize) -> Self {
        self.config.reserve = Reserve::bytes(bytes);
        self
    }

    /// Makes the reservation at initialisation on a thread of its own, for an allocator in a
    /// static (`reserve_background=on`; default off: initialisation waits for it). One line on
    /// stderr says how it ended; [`Stats::reserved_bytes`](crate::Stats::reserved_bytes) shows its
    /// progress.
    pub const fn reserve_background(mut self, on: bool) -> Self {
        self.config.reserve_background = on;
        self
    }

    /// The most bytes one chunk's `cuMemHostRegister` covers (`register_max=`; taken into 2 MiB
    /// to 1 GiB and rounded up to 2 MiB). The default, 256 MiB, keeps the driver's page table
    /// of one registration at 1 MiB: from 512 MiB up it is a 2 MiB allocation, which the kernel
    /// may satisfy by compacting memory while the driver's global lock is held, stalling every
    /// GPU process on the machine. Pinned chunks and reservations are made no larger; a block
    /// larger than it gets a mapping of its own, registered whole.
    pub const fn register_max(mut self, bytes: usize) -> Self {
        self.config.register_max = bytes;
        self
    }

    /// Root of sysfs (default `/sys`), for tests against fixture trees. Another root describes
    /// another machine, so this process's cpuset (allowed memory nodes) is then not applied.
    /// The value's target is resolved from its own root; the large path the process shares
    /// (the topology behind the populate workers, the decay thread's node files) reads the root
    /// of the process's first initialisation.
    pub const fn sysfs_root(mut self, root: &'static str) -> Self {
        self.config.sysfs_root = root;
        self
    }
}
