//! The crate's error type.
//!
//! Every variant carries the values that made the operation fail, so that the `Display` text alone
//! tells an operator what to fix. Allocation paths never return these to the caller of
//! `GlobalAlloc`/`Allocator` (they return null / `AllocError`); they are counted in the stats instead.
//!
//! `cuda_codes.rs` names `CUresult` codes and holds the hints of [`Error::Cuda`]'s text, so that
//! this layer imports nothing above it; `display.rs` holds every variant's text.

use std::path::PathBuf;

mod cuda_codes;

pub use cuda_codes::cuda_error_name;
pub(crate) use cuda_codes::{error_hint, known_error_name};

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

// Here, beside the error that cites it, so that this layer imports nothing above it; the
// topology re-exports it, and so does the crate root.
/// The ACPI SLIT distance from a node to itself.
pub const LOCAL_NUMA_DISTANCE: u8 = 10;

/// Everything that can go wrong in this crate.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A topology was asked for with zero nodes.
    ZeroNodes,
    /// A distance matrix does not have `node_count²` entries.
    DistanceMatrixSize {
        /// Number of nodes the matrix was meant for.
        node_count: usize,
        /// Number of entries supplied.
        entries: usize,
    },
    /// A node's distance to itself is not [`LOCAL_NUMA_DISTANCE`].
    LocalDistance {
        /// The node whose diagonal entry is wrong.
        node: usize,
        /// The distance found.
        distance: u8,
    },
    /// A node id that the topology (or tracker) does not contain.
    UnknownNode {
        /// The node asked for.
        node: usize,
        /// How many nodes the topology has.
        node_count: usize,
    },
    /// A buffer of zero bytes was requested.
    ZeroSize,
    /// No node of the topology has memory, so no host node can be chosen.
    NoMemoryNode,
    /// The node blocks should go to is outside this process's allowed memory nodes (a cgroup
    /// cpuset); the nearest allowed node is used instead.
    NodeNotAllowed {
        /// The node that would have been chosen.
        node: usize,
        /// The allowed node used instead.
        chosen: usize,
    },
    /// A file (usually under sysfs) could not be read.
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error's kind.
        kind: std::io::ErrorKind,
        /// The OS error number, when there is one.
        errno: Option<i32>,
    },
    /// A file's content could not be parsed.
    Parse {
        /// The file (or `"<input>"` for strings that did not come from a file).
        path: PathBuf,
        /// What the parser expected, e.g. `"a list of node distances"`.
        expected: &'static str,
        /// The offending content (truncated to a readable length).
        found: String,
    },
    /// A PCI bus id that is not of the form `DDDD:BB:DD.F`.
    InvalidPciAddress {
        /// The text given.
        input: String,
    },
    /// The kernel refused a NUMA system call (EPERM from a container's seccomp profile, ENOSYS
    /// on a kernel built without NUMA). Callers fall back to unplaced memory.
    NumaUnavailable {
        /// The system call, e.g. `"mbind"`.
        call: &'static str,
        /// The errno it returned.
        errno: i32,
    },
    /// A CPU list for a thread's affinity that is empty, or that names a CPU a `cpu_set_t`
    /// cannot hold.
    InvalidCpuList {
        /// The first CPU at or above `limit`; `None` when the list is empty.
        cpu: Option<usize>,
        /// How many CPUs a `cpu_set_t` holds (`CPU_SETSIZE`).
        limit: usize,
    },
    /// A system call failed for another reason.
    Syscall {
        /// The system call, e.g. `"mmap"`.
        call: &'static str,
        /// The errno it returned.
        errno: i32,
    },
    /// A shared pool's file is not a pool of this crate (its first bytes are not the pool's
    /// magic number).
    PoolForeign {
        /// The file (`<fd N>` for one attached by descriptor).
        path: PathBuf,
        /// The number found where the magic is.
        found: u64,
    },
    /// A shared pool made by a build of this crate with another layout.
    PoolVersion {
        /// The file.
        path: PathBuf,
        /// The pool's kind and layout version.
        found: (u32, u32),
        /// The kind and layout version this build reads.
        expected: (u32, u32),
    },
    /// A shared pool made by a build of another memory layout (another libc's mutex, a 32-bit
    /// process, another byte order): its header would be misread.
    PoolLayout {
        /// The file.
        path: PathBuf,
        /// What differs, e.g. `"mutex size"`.
        field: &'static str,
        /// The pool's value.
        found: u32,
        /// This build's.
        expected: u32,
    },
    /// A shared pool that this process may not map shared and writable (a descriptor opened
    /// read-only, a file it may not write, a read-only mount).
    PoolReadOnly {
        /// The file.
        path: PathBuf,
    },
    /// A descriptor to be received over a Unix socket (`SCM_RIGHTS`) did not arrive as one.
    FdNotReceived {
        /// What came instead, and what to do.
        reason: &'static str,
    },
    /// A shared pool whose header or carving state does not hold together.
    PoolCorrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong, e.g. `"the file is shorter than the pool's size"`.
        reason: &'static str,
    },
    /// A shared pool larger than its node's memory, or too small to hold its header and one
    /// block.
    PoolTooLarge {
        /// The size asked for.
        bytes: usize,
        /// The node.
        node: usize,
        /// The node's memory.
        node_bytes: u64,
    },
    /// A shared pool whose pages are not on the node it was made for.
    PoolWrongNode {
        /// The file.
        path: PathBuf,
        /// The node it was made for.
        node: usize,
        /// How many of its pages are elsewhere (or not resident), of how many.
        elsewhere: usize,
        /// Of how many pages.
        pages: usize,
        /// A node one of them is on (negative: not resident, the `move_pages` status).
        found: i32,
    },
    /// A shared pool of huge pages without enough free huge pages for it.
    PoolHugePages {
        /// Huge pages needed.
        needed: usize,
        /// Huge pages free (`free_hugepages`).
        free: usize,
        /// Where they were asked from (the mount, or `memfd`).
        place: PathBuf,
    },
    /// A shared pool left half made by a creator that is gone.
    PoolStale {
        /// The file.
        path: PathBuf,
        /// The creator's process id.
        pid: u32,
    },
    /// A shared pool's blocks were to be reclaimed from a process that still runs.
    PoolOwnerAlive {
        /// The process.
        pid: u32,
    },
    /// A shared pool was to be created at a path that exists.
    PoolExists {
        /// The path.
        path: PathBuf,
    },
    /// A shared pool's file that this process does not trust: owned by another user than its own
    /// and root, or writable by others, and not allowed by name
    /// ([`PoolAttach::allow_owner`](crate::PoolAttach::allow_owner),
    /// [`PoolAttach::allow_mode`](crate::PoolAttach::allow_mode)).
    PoolUntrusted {
        /// The file.
        path: PathBuf,
        /// The file's owner (user id).
        owner: u32,
        /// The file's permission bits.
        mode: u32,
        /// This process's effective user id.
        uid: u32,
        /// Whether the owner is what is not trusted.
        foreign_owner: bool,
        /// Whether the mode is what is not trusted (others may write it).
        open_mode: bool,
    },
    /// A shared pool's file that this process may not open for reading and writing.
    PoolPermission {
        /// The file.
        path: PathBuf,
        /// The file's owner (user id), when it could be read.
        owner: Option<u32>,
        /// The file's permission bits, when they could be read.
        mode: Option<u32>,
        /// This process's effective user id.
        uid: u32,
    },
    /// A descriptor to attach a shared pool by that is not open for reading and writing.
    PoolDescriptor {
        /// `<fd N>`.
        path: PathBuf,
        /// How it is open: `"write-only (O_WRONLY)"` or `"as a path only (O_PATH)"`.
        access: &'static str,
    },
    /// A shared pool too small to hold its header and one block.
    PoolTooSmall {
        /// The size asked for.
        bytes: usize,
        /// The smallest pool.
        min: usize,
    },
    /// A shared pool's filesystem (a tmpfs such as `/dev/shm`, a hugetlbfs mount) has no room
    /// for its pages.
    PoolNoSpace {
        /// The pool's file.
        path: PathBuf,
        /// Bytes the pool needs.
        needed: u64,
        /// Bytes free there (`None`: unknown, the filesystem ran out while the pages were made).
        free: Option<u64>,
    },
    /// A shared pool's path that is a symbolic link: attaching does not follow one
    /// (`O_NOFOLLOW`).
    PoolSymlink {
        /// The path.
        path: PathBuf,
    },
    /// A shared pool's file whose pages are not all there (a sparse file): a pool's creator
    /// allocates every page before anyone attaches, and attaching would allocate the rest.
    PoolSparse {
        /// The file.
        path: PathBuf,
        /// Bytes of the file allocated (`st_blocks`).
        allocated: u64,
        /// Bytes of its pool's blocks, which a whole pool has allocated.
        needed: u64,
    },
    /// A shared pool's lock held by a live process for longer than this process waits (the
    /// kernel still holds the lock it took on the pool's file: a holder that is gone, in any
    /// PID namespace, passes its lock on at once).
    PoolLockHeld {
        /// The file.
        path: PathBuf,
        /// Which lock: `"carving"` (allocate, free, attach) or `"registration"`.
        lock: &'static str,
        /// The process that holds it, as its own PID namespace numbers it, when it recorded
        /// itself.
        pid: Option<u32>,
        /// Milliseconds waited.
        waited_ms: u64,
    },
    /// A handle that names no live block of this shared pool.
    PoolHandle {
        /// The pool's file.
        path: PathBuf,
        /// The handle's offset.
        offset: u64,
        /// The handle's length.
        len: u64,
        /// Why: another pool's, freed already, ...
        reason: &'static str,
    },
    /// An address range that is not page-aligned, empty, or overflows the address space.
    InvalidRange {
        /// Start of the range.
        addr: usize,
        /// Length of the range in bytes.
        len: usize,
    },
    /// A `NUMA_GPU_ALLOC` entry or builder value was rejected.
    Config {
        /// The key, e.g. `"threshold"`.
        key: String,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A `NUMA_GPU_ALLOC` entry was accepted, and switches something off (said at set-up, in
    /// case it was not meant).
    SettingDisables {
        /// The key, e.g. `"cache"`.
        key: String,
        /// The value given.
        value: String,
        /// What it switches off, and what to set instead.
        disables: &'static str,
    },
    /// The CUDA driver (libcuda) could not be loaded, or no device is visible.
    CudaUnavailable {
        /// Why, e.g. `"libcuda.so could not be loaded"`.
        reason: &'static str,
    },
    /// The allocator does not page-lock its blocks: its pin mode is `pin=off` (the default). What
    /// needs page-locked memory (a `PinnedBuf`) cannot be made from it.
    PinningOff,
    /// Pinning was asked for (`pin=on` or `pin=strict`), but the CUDA driver is not usable in
    /// this process, so no block is page-locked.
    DriverUnusable {
        /// The driver probe's error, as
        /// [`cuda_unavailable_reason`](crate::cuda_unavailable_reason) returns it.
        driver: &'static Error,
    },
    /// Pinning was asked for, but the allocator's target is a NUMA node (`node=`, `node=local`),
    /// not a GPU: blocks are page-locked only for a GPU.
    NodeTarget,
    /// `pin=strict`, but blocks for the request's target cannot be page-locked (no CUDA driver,
    /// no GPU for the target, a forked child): its large requests fail before any memory is
    /// mapped (counted in [`Fallbacks::strict_refused`](crate::Fallbacks::strict_refused)).
    StrictPinning {
        /// Why, e.g. `"no usable CUDA driver"`.
        reason: &'static str,
        /// The driver's own error, when it is the reason (see
        /// [`cuda_unavailable_reason`](crate::cuda_unavailable_reason)).
        driver: Option<&'static Error>,
    },
    /// A CUDA driver call failed.
    Cuda {
        /// The driver function, e.g. `"cuMemHostRegister_v2"`.
        call: &'static str,
        /// The `CUresult` number.
        code: u32,
        /// The `CUresult` name, e.g. `"CUDA_ERROR_OUT_OF_MEMORY"`.
        name: &'static str,
    },
    /// A new block would exceed a cgroup's `memory.max` (a container's memory limit), where
    /// populating it would summon the OOM killer instead of failing.
    MemoryLimit {
        /// The cgroup's directory, e.g. `/sys/fs/cgroup/app`.
        cgroup: PathBuf,
        /// Its `memory.max` in bytes.
        limit: usize,
        /// Bytes it could still charge, reclaimable file pages included.
        available: usize,
        /// Bytes the block needs.
        requested: usize,
    },
    /// A GPU selector matched no visible device.
    GpuNotFound {
        /// The selector as written, e.g. `"3"` or `"GPU-1234…"`.
        selector: String,
        /// How many devices are visible.
        device_count: usize,
    },
    /// A buffer of this crate could not be allocated.
    BufferAllocation {
        /// Elements requested.
        len: usize,
        /// Bytes per element.
        element_size: usize,
        /// Why: `"size overflows usize"` or `"the allocator returned null"`.
        reason: &'static str,
    },
    /// A reservation ([`NumaGpuAlloc::reserve`](crate::NumaGpuAlloc::reserve), `reserve=`) whose
    /// blocks would be below the threshold: no request of that size takes the large path.
    ReserveRejected {
        /// Blocks asked for.
        blocks: usize,
        /// Bytes of each.
        block_size: usize,
        /// The allocator's threshold.
        threshold: usize,
    },
    /// A reservation of more bytes than its node has.
    ReserveTooLarge {
        /// Bytes asked for.
        bytes: usize,
        /// The node.
        node: usize,
        /// Its memory (`MemTotal`).
        node_bytes: usize,
    },
    /// A reservation made in the background can no longer tell how it ended.
    ReservationLost {
        /// Why: its thread panicked, or this is a child forked since (the thread is the
        /// parent's).
        reason: &'static str,
    },
    /// Page-locking `requested` more bytes would pass the pinned limit (`pin_limit=`).
    PinLimit {
        /// Bytes that were to be page-locked.
        requested: usize,
        /// Bytes the process held page-locked through the allocator then.
        pinned: usize,
        /// The limit.
        limit: usize,
    },
}

mod display;

impl std::error::Error for Error {}

#[cfg(test)]
mod tests;
