//! Settings: the const builder's values and the `NUMA_GPU_ALLOC` environment override.
//!
//! Parsing is written by hand, like everything that runs inside the allocator (here: at its
//! initialisation, under the re-entrancy guard): no allocation through ourselves, no panic. Code
//! outside the allocator (examples, benches) uses libraries instead (lexopt, serde_json).
//!
//! Files: this one holds the settings' types ([`Config`] and its parts, [`ENV_VAR`]);
//! `parse.rs` parses `NUMA_GPU_ALLOC` and the values of each key ([`parse_size`]).

use crate::sys::MemPolicy;
use crate::topology::pci::PciAddress;
use crate::Error;

mod parse;
#[cfg(test)]
mod tests;

use parse::parse_setting;
pub use parse::parse_size;
pub(crate) use parse::{config_error, Setting, Settings};

/// Default size at and above which requests take the placed, pinned path.
pub const DEFAULT_THRESHOLD: usize = 2 << 20;
/// Default limit of freed bytes a node's arena keeps cached (placed and pinned) for reuse, as each
/// allocator value applies it.
pub const DEFAULT_CACHE_LIMIT: usize = 4 << 30;
/// Smallest accepted threshold: one page.
pub const MIN_THRESHOLD: usize = 4 << 10;
/// Largest accepted threshold.
pub const MAX_THRESHOLD: usize = 64 << 30;
/// Default registration bound (`register_max=`): the most bytes one `cuMemHostRegister` of a
/// chunk covers. The driver keeps 16 B of page table per 4 KiB page registered; from 512 MiB up
/// that table is a 2 MiB allocation, which the kernel may satisfy by direct compaction while the
/// driver's global lock is held (stalling every GPU process on the machine). 256 MiB keeps it at
/// 1 MiB.
pub const DEFAULT_REGISTER_MAX: usize = 256 << 20;
/// Largest accepted registration bound: the largest chunk.
pub const MAX_REGISTER_MAX: usize = 1 << 30;
/// Smallest accepted registration bound: the chunk alignment.
pub const MIN_REGISTER_MAX: usize = 2 << 20;
/// Default `bulk_max=`: requests not asked zeroed up to this size are populated in bulk when
/// handed out; larger ones only once the process was seen writing blocks of their size whole.
/// `sort -S 1G` asks for 1 GiB and writes a few MiB of it: populating it all made its peak
/// 1,155 MiB against glibc's 78 MiB.
pub const DEFAULT_BULK_MAX: usize = 256 << 20;
/// Default time after which idle free memory is given back (`decay=`).
pub const DEFAULT_DECAY_MS: u64 = 1000;
/// Name of the environment variable read once per process, by the first allocator value that
/// initialises; it applies to every value.
pub const ENV_VAR: &str = "NUMA_GPU_ALLOC";

/// Which GPU the allocator serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuSelector {
    /// The launcher's local rank (`LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `MPI_LOCALRANKID`, first one set wins) modulo the visible device count, else device 0.
    Auto,
    /// CUDA device ordinal.
    Ordinal(u32),
    /// PCI address of the device; works without the CUDA driver (placement without pinning).
    Pci(PciAddress),
    /// CUDA device UUID (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, or `MIG-…` for a MIG
    /// instance).
    Uuid([u8; 16]),
    /// The device of the allocating thread's current CUDA context (`gpu=current`), read at each
    /// large allocation (`cuCtxGetCurrent`; the device is looked up once per context). A thread
    /// without a current context gets what the default target gives.
    Current,
}

/// Where large blocks go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Target {
    /// `GpuSelector::Auto` when the CUDA driver is present, else the node of the thread that
    /// makes the first large allocation.
    Default,
    /// The host node nearest this GPU.
    Gpu(GpuSelector),
    /// This NUMA node id, no GPU.
    Node(usize),
    /// The node of the CPU the allocating thread runs on, at each allocation (`node=local`, as
    /// tcmalloc's NUMA mode), no GPU. Threads bound with [`bind_thread`](crate::bind_thread)
    /// follow their route instead.
    LocalNode,
}

/// What to do about page-locking (`cuMemHostRegister`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinMode {
    /// Pin; when registration fails keep the block unpinned and count it (`pin=on`).
    On,
    /// Every block handed out is page-locked, or the request fails: when its registration
    /// fails, and before anything is mapped when nothing can be page-locked for its target (no
    /// CUDA driver, no GPU for the target, a forked child; said once on stderr, counted in
    /// [`Fallbacks::strict_refused`](crate::Fallbacks::strict_refused)).
    Strict,
    /// Never pin (the default): copies from and to these blocks stay synchronous.
    Off,
}

/// Memory placed (and pinned, when pinning is on) at initialisation, so that the first requests
/// are served from it (`reserve=`): bytes of chunked room (`reserve=3GiB`), or room for blocks
/// of a size (`reserve=24x128MiB`). Either way in chunks of at most the registration bound, each
/// registered once; a block larger than the bound gets a mapping of its own, registered whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reserve {
    /// How many blocks (0: none, or bytes).
    pub blocks: usize,
    /// Bytes of each.
    pub block_size: usize,
    /// Bytes of room for requests of any size up to a chunk's (with `blocks` 0).
    pub bytes: usize,
}

impl Reserve {
    /// No reservation (the default).
    pub const NONE: Reserve = Reserve {
        blocks: 0,
        block_size: 0,
        bytes: 0,
    };

    /// Room for `blocks` blocks of `block_size` bytes.
    pub const fn blocks(blocks: usize, block_size: usize) -> Reserve {
        Reserve {
            blocks,
            block_size,
            bytes: 0,
        }
    }

    /// `bytes` of room, carved for requests of any size up to a chunk's.
    pub const fn bytes(bytes: usize) -> Reserve {
        Reserve {
            blocks: 0,
            block_size: 0,
            bytes,
        }
    }

    /// Whether nothing is reserved.
    pub const fn is_none(&self) -> bool {
        self.bytes == 0 && (self.blocks == 0 || self.block_size == 0)
    }
}

/// What an allocator prints about itself when the process exits (`stats=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StatsAtExit {
    /// Nothing (the default).
    Off,
    /// The [`Stats`](crate::Stats) table, to stderr (`stats=exit`).
    Table,
    /// [`Stats::json`](crate::Stats::json) on one line, to stderr (`stats=json`).
    Json,
}

/// All settings of a [`NumaGpuAlloc`](crate::NumaGpuAlloc).
///
/// Start from [`Config::DEFAULT`] (or `Config::default()`) and set fields: more may be added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Requests of at least this many bytes take the large path.
    pub threshold: usize,
    /// Where large blocks are placed.
    pub target: Target,
    /// NUMA policy of large blocks.
    pub policy: MemPolicy,
    /// Freed bytes a node's arena keeps cached before the oldest blocks are released (applied by
    /// this value when it frees or allocates on that node).
    pub cache_limit: usize,
    /// `MADV_HUGEPAGE` and 2 MiB alignment for blocks of at least 2 MiB.
    pub huge_pages: bool,
    /// Check every page's node with `move_pages` after populating.
    pub verify: bool,
    /// Page-locking mode.
    pub pin: PinMode,
    /// Register with `CU_MEMHOSTREGISTER_DEVICEMAP`.
    pub pin_devicemap: bool,
    /// Register with `CU_MEMHOSTREGISTER_READ_ONLY`.
    pub pin_read_only: bool,
    /// The most bytes the process keeps page-locked through the allocator (`usize::MAX`: no
    /// limit); past it `pin=on` serves blocks unpinned, `pin=strict` fails them.
    pub pin_limit: usize,
    /// Threads that populate one large block or chunk, the caller's among them (the others are
    /// the node's pooled workers); 0: the CPUs this process may use, at most 8 (more rarely
    /// help: the kernel's page clearing saturates a node's memory bandwidth).
    pub populate_threads: usize,
    /// Populate every large block when it is handed out (`populate=eager`), zeroed requests too,
    /// and clear reused memory for a zeroed request by writing zeros. Off (`lazy`, the default),
    /// each request decides: blocks that must be resident (pinned, checked page by page with
    /// `verify=on` or `policy=bind`) and requests not asked zeroed (written before they are read:
    /// written whole) are populated in bulk by the node's workers; a zeroed request's fresh pages
    /// are faulted in where its user touches them, on the node its policy names (pages never
    /// touched take no memory), and reused memory is cleared for it by writing zeros where its
    /// last user left it resident, else by giving its pages back.
    pub populate_eager: bool,
    /// Under `populate=lazy`, requests not asked zeroed up to this size are populated in bulk
    /// when handed out (`bulk_max=`); a larger one is populated in bulk only once the process
    /// was seen writing blocks of its power-of-two range of sizes whole, else it is handed out
    /// lazily, its untouched pages taking no memory. 0: learn from the threshold up (the preload
    /// library's default, which cannot tell a staging buffer from an oversized table).
    pub bulk_max: usize,
    /// Root of sysfs (`/sys`); tests point it at fixture trees.
    pub sysfs_root: &'static str,
    /// Whether the stats are printed at process exit, and how.
    pub stats_at_exit: StatsAtExit,
    /// Memory reserved at initialisation.
    pub reserve: Reserve,
    /// Whether that reservation is made on a thread of its own (for an allocator in a static),
    /// so that initialisation does not wait for it; one line says how it ended.
    pub reserve_background: bool,
    /// The most bytes one registration of a chunk covers (a multiple of 2 MiB, 2 MiB to 1 GiB);
    /// a block larger than that is registered whole, counted in `Stats::oversized_registrations`.
    pub register_max: usize,
    /// Milliseconds after which idle free memory is given back to the kernel (`u64::MAX`: never).
    pub decay_ms: u64,
    /// A thread that gives idle memory back while the program allocates nothing large.
    pub decay_thread: bool,
}

impl Config {
    /// The defaults: 2 MiB threshold, default target, `preferred` policy, 4 GiB cache, huge
    /// pages on, no verification, no pinning, automatic threads.
    pub const DEFAULT: Config = Config {
        threshold: DEFAULT_THRESHOLD,
        target: Target::Default,
        policy: MemPolicy::Preferred,
        cache_limit: DEFAULT_CACHE_LIMIT,
        huge_pages: true,
        verify: false,
        pin: PinMode::Off,
        pin_devicemap: false,
        pin_read_only: false,
        pin_limit: usize::MAX,
        populate_threads: 0,
        populate_eager: false,
        bulk_max: DEFAULT_BULK_MAX,
        sysfs_root: "/sys",
        stats_at_exit: StatsAtExit::Off,
        reserve: Reserve::NONE,
        reserve_background: false,
        register_max: DEFAULT_REGISTER_MAX,
        decay_ms: DEFAULT_DECAY_MS,
        decay_thread: true,
    };

    /// Applies a `NUMA_GPU_ALLOC`-style string (`key=value,key=value`). Entries that are
    /// rejected leave their setting unchanged and are returned; the rest apply, and those that
    /// switch something off are returned too ([`Error::SettingDisables`]). Each problem once.
    pub fn apply_settings(&mut self, settings: &str) -> Vec<Error> {
        let parsed = Settings::parse(settings);
        parsed.apply_to(self);
        parsed.errors
    }

    /// Applies one setting; on error the configuration is unchanged.
    pub fn apply(&mut self, key: &str, value: &str) -> Result<(), Error> {
        self.set(parse_setting(key, value)?);
        Ok(())
    }

    fn set(&mut self, setting: Setting) {
        match setting {
            Setting::Threshold(bytes) => self.threshold = bytes,
            Setting::Target(target) => self.target = target,
            Setting::Policy(policy) => self.policy = policy,
            Setting::CacheLimit(bytes) => self.cache_limit = bytes,
            Setting::HugePages(on) => self.huge_pages = on,
            Setting::Verify(on) => self.verify = on,
            Setting::Pin(mode) => self.pin = mode,
            Setting::PinDevicemap(on) => self.pin_devicemap = on,
            Setting::PinReadOnly(on) => self.pin_read_only = on,
            Setting::PinLimit(bytes) => self.pin_limit = bytes,
            Setting::PopulateThreads(threads) => self.populate_threads = threads,
            Setting::PopulateEager(on) => self.populate_eager = on,
            Setting::BulkMax(bytes) => self.bulk_max = bytes,
            Setting::StatsAtExit(format) => self.stats_at_exit = format,
            Setting::Reserve(reserve) => self.reserve = reserve,
            Setting::ReserveBackground(on) => self.reserve_background = on,
            Setting::RegisterMax(bytes) => self.register_max = bytes,
            Setting::DecayMs(ms) => self.decay_ms = ms,
            Setting::DecayThread(on) => self.decay_thread = on,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::DEFAULT
    }
}
