//! The public methods of [`NumaGpuAlloc`]: its constructors and const builder (each setting of
//! [`Config`], usable in a `static`), its settings, placement and stats, `trim`, reservations
//! (their work in `reserving.rs`) and, with `pinned-buffer`, `record_stream` (its record in
//! `record.rs`).

use std::alloc::{GlobalAlloc, System};
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::Relaxed};

#[cfg(feature = "pinned-buffer")]
use cudarc::driver::CudaStream;

#[cfg(feature = "pinned-buffer")]
use super::record::RecordedEvent;
use super::{clamp_threshold, reserving, Threshold};
use crate::blocks::reserve::Tally;
use crate::config::{Config, GpuSelector, PinMode, Reserve, Target};
#[cfg(feature = "pinned-buffer")]
use crate::cuda::event;
use crate::guard::Inside;
use crate::reservation::{Reservation, ReserveProgress};
use crate::runtime::{route, Placement};
use crate::stats::Stats;
use crate::sys::MemPolicy;
use crate::topology::pci::PciAddress;
use crate::{Error, NumaGpuAlloc};

impl NumaGpuAlloc {
    /// An allocator with the default [`Config`] over the system allocator.
    pub const fn new() -> Self {
        Self::with_config(Config::DEFAULT)
    }

    /// An allocator with the given settings over the system allocator (a threshold outside
    /// 4 KiB..=64 GiB is clamped).
    pub const fn with_config(config: Config) -> Self {
        Self::with_inner_config(System, config)
    }
}

impl<A> NumaGpuAlloc<A> {
    /// An allocator with the default [`Config`] whose small requests go to `inner`.
    pub const fn with_inner(inner: A) -> Self {
        Self::with_inner_config(inner, Config::DEFAULT)
    }

    /// An allocator with the given settings whose small requests go to `inner` (a threshold
    /// outside 4 KiB..=64 GiB is clamped).
    pub const fn with_inner_config(inner: A, mut config: Config) -> Self {
        config.threshold = clamp_threshold(config.threshold);
        NumaGpuAlloc {
            threshold: Threshold(AtomicUsize::new(config.threshold)),
            config,
            runtime: AtomicPtr::new(ptr::null_mut()),
            inner,
        }
    }

    /// The allocator that serves everything but the large path's blocks.
    pub const fn inner(&self) -> &A {
        &self.inner
    }

    /// The builder's settings (before the `NUMA_GPU_ALLOC` override).
    pub const fn builder_config(&self) -> &Config {
        &self.config
    }

    /// The settings in force: after initialisation, the builder's with `NUMA_GPU_ALLOC` applied.
    pub fn config(&self) -> Config {
        self.initialised().map_or(self.config, |rt| rt.config)
    }

    /// Initialises the large path now (it otherwise happens on the first large request) and
    /// tells where blocks go.
    pub fn placement(&self) -> Placement {
        let _inside = Inside::enter();
        self.runtime().placement()
    }

    /// A snapshot of this value's counters, and of the process's per-node arenas (shared by every
    /// value: their rows count every value's blocks). Before initialisation only `threshold` is
    /// filled in.
    pub fn stats(&self) -> Stats {
        let _inside = Inside::enter();
        match self.initialised() {
            Some(rt) => rt.stats(),
            None => Stats {
                threshold: self.threshold.0.load(Relaxed),
                ..Stats::default()
            },
        }
    }

    /// Starts the peaks over, as PyTorch's `reset_peak_host_memory_stats` does: each node's (and
    /// each GPU's row of each node; the arenas are the process's)
    /// [`peak_live_bytes`](crate::NodeStats::peak_live_bytes) becomes its live bytes now, and the
    /// longest populate and pin times become zero. Totals and counts are kept.
    pub fn reset_peaks(&self) {
        let _inside = Inside::enter();
        if let Some(rt) = self.initialised() {
            rt.blocks.stats().reset_peaks();
        }
    }

    /// Releases every cached block of every node's arena, whichever value cached it
    /// (unregistering and unmapping it). Live blocks are untouched,
    /// and so are freed blocks that GPU work recorded against them may still use: those stay
    /// pending (`trim` never waits, and never unmaps memory a DMA may still read).
    pub fn trim(&self) {
        let _inside = Inside::enter();
        if let Some(rt) = self.initialised() {
            rt.blocks.trim();
        }
    }

    /// Attaches `work` to the live large block containing `ptr` (anywhere inside it): when the
    /// block is freed before `work` completed, it waits in the pending list instead of the cache.
    /// Gives `work` back when no live large block contains `ptr`, so that the caller can wait on
    /// it itself.
    // Only the pinned front end records work. Without it this is allowed, not compiled out: the
    // arena's seam behind it (the pending list's bookkeeping) is built the same in every
    // configuration, and compiling this out would leave that dead instead.
    #[cfg_attr(not(feature = "pinned-buffer"), allow(dead_code))]
    pub(crate) fn record_in_flight(
        &self,
        ptr: *const u8,
        work: Box<dyn crate::arena::InFlight>,
    ) -> Result<(), Box<dyn crate::arena::InFlight>> {
        let (Some(rt), Some(_inside)) = (self.initialised(), Inside::enter()) else {
            return Err(work);
        };
        rt.blocks
            .record_in_flight(ptr as usize, work, route::likely_node(rt))
    }
}

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
    /// back, `pin=strict` fails them with [`Error::PinLimit`], and a
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

impl<A: GlobalAlloc> NumaGpuAlloc<A> {
    /// Makes room for `blocks` blocks of `block_size` bytes, populated and (when pinning)
    /// page-locked, for the node where the calling thread's blocks go (its
    /// [route](crate::bind_thread), or this value's target) now, initialising the large path if
    /// needed: the next requests of about that size are served from it instead of paying for
    /// placement and pinning. The room is reserved chunks of whole blocks, each at most the
    /// registration bound ([`register_max`](Self::register_max)) and registered once, carved
    /// for requests of any size up to a chunk's (as [`reserve_bytes`](Self::reserve_bytes));
    /// a block larger than the bound is a cached block of its own, registered whole. Bounded by
    /// the node's memory and the pinned limit, not the cache limit; [`trim`](Self::trim)
    /// releases it.
    ///
    /// Takes as long as allocating the blocks; call it at start-up, or on a thread of its own.
    /// `NUMA_GPU_ALLOC=reserve=COUNTxSIZE` (or [`reserve_at_init`](Self::reserve_at_init)) does
    /// the same at initialisation.
    ///
    /// # Errors
    /// [`Error::ReserveRejected`] when a block would be below the threshold;
    /// [`Error::ReserveTooLarge`] beyond the node's memory; [`Error::PinLimit`] beyond the
    /// pinned limit; [`Error::StrictPinning`] when `pin=strict` and nothing can be page-locked
    /// for the target; the placement or pinning error of a chunk that could not be made (what
    /// was made before it stays).
    pub fn reserve(&self, blocks: usize, block_size: usize) -> Result<(), Error> {
        let _inside = Inside::enter();
        self.runtime().reserve(blocks, block_size)
    }

    /// Reserves `bytes` (rounded up to 2 MiB) for the node where the calling thread's blocks go
    /// (its [route](crate::bind_thread), or this value's target; pinned when this value pins),
    /// and waits for it: chunks of at most the registration bound
    /// ([`register_max`](Self::register_max), 256 MiB by default), each mapped, placed, populated by the node's
    /// populate workers and registered with a single driver call, added to the arena as it is
    /// made. Requests of any size up to a chunk's are carved from them first; they are kept
    /// when idle (decay leaves them) until [`trim`](Self::trim) or memory pressure. Reserved
    /// bytes do not count against the cache limit; pinned ones count against the pinned limit.
    ///
    /// # Errors
    /// [`Error::StrictPinning`] when `pin=strict` and nothing can be page-locked for the target;
    /// [`Error::ReserveTooLarge`] beyond the node's memory; [`Error::PinLimit`] beyond the
    /// pinned limit, before anything is made; else the error of the chunk that
    /// failed (a CUDA error with its code, [`Error::PinLimit`] at the pinned limit,
    /// [`Error::MemoryLimit`]...): the reservation stops there, and the chunks made before it
    /// stay usable.
    pub fn reserve_bytes(&self, bytes: usize) -> Result<ReserveProgress, Error> {
        let _inside = Inside::enter();
        // Its clock runs from the call, initialisation included.
        let tally = Tally::new(bytes);
        reserving::wait_for(self.runtime(), bytes, tally)
    }

    /// [`reserve_bytes`](Self::reserve_bytes) on a thread of its own: returns at once with a
    /// handle to watch it ([`Reservation::progress`]), wait for it or cancel it. The target is
    /// the calling thread's, resolved now. Each chunk is usable as soon as it is registered;
    /// requests that find no room in the chunks made so far are served as without a
    /// reservation (as the pin mode says), not held back. When the process exits meanwhile, the
    /// chunk in progress ends and no other is made (before the driver tears down).
    ///
    /// For another GPU or node than the calling thread's, reserve under a route:
    ///
    /// ```
    /// use numa_gpu_alloc::{with_route, NumaGpuAlloc, PinMode, Route};
    ///
    /// static KV_POOL: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);
    ///
    /// // Node 0's memory (a GPU: `Route::Gpu(GpuSelector::Ordinal(1))`), 64 MiB in chunks.
    /// let reservation = with_route(Route::Node(0), || KV_POOL.reserve_in_background(64 << 20))?;
    /// println!("{}", reservation.progress()); // reserve 0.0/0.1 GiB: placed ...
    /// let done = reservation.wait()?;
    /// assert_eq!(done.usable, 64 << 20);
    /// # KV_POOL.trim();
    /// # Ok::<(), numa_gpu_alloc::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::StrictPinning`] as for `reserve_bytes`; a failure to start the thread
    /// ([`Error::Syscall`], `call: "reservation thread"`). Later errors come from the handle.
    pub fn reserve_in_background(&'static self, bytes: usize) -> Result<Reservation, Error>
    where
        A: Sync,
    {
        reserving::in_background(self, bytes)
    }
}

#[cfg(feature = "pinned-buffer")]
impl<A> NumaGpuAlloc<A> {
    /// Marks the large block that holds `ptr` as used by the work queued on `stream` so far (a
    /// copy from or to a plain `Vec` or slice of this allocator, with pinning on): once freed,
    /// the block is reused only after that work has completed. `Ok(false)` when `ptr` is not in
    /// a large block of this allocator (small allocations are pageable: copies with them are
    /// synchronous).
    ///
    /// This protects reuse only: reading a device-to-host destination still needs the stream
    /// synchronised first. [`PinnedBuf`](crate::PinnedBuf) does both by itself.
    #[cfg_attr(docsrs, doc(cfg(feature = "pinned-buffer")))]
    pub fn record_stream<T>(&self, ptr: *const T, stream: &CudaStream) -> crate::Result<bool> {
        let recorded = RecordedEvent::new(event::record(stream)?);
        // Not ours: dropping the record destroys its event, which CUDA allows while it runs.
        Ok(self
            .record_in_flight(ptr.cast(), Box::new(recorded))
            .is_ok())
    }
}
