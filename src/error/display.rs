//! The operator-facing text of every [`Error`]: what failed, with which values, and what to do.

use std::fmt;

use super::{error_hint, Error, LOCAL_NUMA_DISTANCE};

fn errno_text(errno: i32) -> String {
    std::io::Error::from_raw_os_error(errno).to_string()
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::ZeroNodes => write!(f, "a NUMA topology needs at least one node"),
            Error::DistanceMatrixSize {
                node_count,
                entries,
            } => write!(
                f,
                "distance matrix for {node_count} nodes needs {} entries, got {entries}",
                node_count.saturating_mul(*node_count)
            ),
            Error::LocalDistance { node, distance } => write!(
                f,
                "distance from node {node} to itself is {distance}, expected {}",
                LOCAL_NUMA_DISTANCE
            ),
            Error::UnknownNode { node, node_count } => write!(
                f,
                "node {node} is not one of the topology's {node_count} online nodes"
            ),
            Error::ZeroSize => write!(f, "a buffer of zero bytes was requested"),
            Error::NoMemoryNode => write!(f, "no NUMA node has memory; cannot choose a host node"),
            Error::NodeNotAllowed { node, chosen } => write!(
                f,
                "node {node} is not among this process's allowed memory nodes (cgroup cpuset); \
                 using node {chosen}"
            ),
            Error::Io { path, kind, errno } => match errno {
                Some(e) => write!(f, "cannot read {}: {}", path.display(), errno_text(*e)),
                None => write!(f, "cannot read {}: {kind}", path.display()),
            },
            Error::Parse {
                path,
                expected,
                found,
            } => write!(
                f,
                "{}: expected {expected}, found {found:?}",
                path.display()
            ),
            Error::InvalidPciAddress { input } => write!(
                f,
                "invalid PCI address {input:?}: expected DOMAIN:BUS:DEVICE.FUNCTION in hex, \
                 e.g. 0000:81:00.0"
            ),
            Error::NumaUnavailable { call, errno } => write!(
                f,
                "NUMA placement unavailable: {call} failed with {} (errno {errno}); \
                 a container seccomp profile or a kernel without NUMA support",
                errno_text(*errno)
            ),
            Error::BufferAllocation {
                len,
                element_size,
                reason,
            } => write!(
                f,
                "cannot allocate a buffer of {len} elements of {element_size} bytes: {reason}"
            ),
            Error::InvalidCpuList { cpu: None, .. } => {
                write!(f, "a thread cannot be bound to an empty list of CPUs")
            }
            Error::InvalidCpuList {
                cpu: Some(cpu),
                limit,
            } => write!(
                f,
                "CPU {cpu} cannot be bound: a cpu_set_t holds CPUs 0 to {}",
                limit.saturating_sub(1)
            ),
            Error::Syscall { call, errno } => {
                write!(f, "{call} failed: {} (errno {errno})", errno_text(*errno))
            }
            Error::PoolForeign { path, found } => write!(
                f,
                "{} is not a numa-gpu-alloc shared pool (magic {found:#x}); give the path of \
                 one, or remove the file if it is left over",
                path.display()
            ),
            Error::PoolVersion {
                path,
                found,
                expected,
            } => write!(
                f,
                "shared pool {} is of kind {} layout {}, this build reads kind {} layout {}: \
                 attach with the build that made it, or create a new pool",
                path.display(),
                found.0,
                found.1,
                expected.0,
                expected.1
            ),
            Error::PoolLayout {
                path,
                field,
                found,
                expected,
            } => write!(
                f,
                "shared pool {} was made by a build of another memory layout: its {field} is \
                 {found}, this build's is {expected}; attach with a build of the same layout or \
                 create a new pool",
                path.display()
            ),
            Error::PoolReadOnly { path } => write!(
                f,
                "shared pool {} cannot be mapped for writing: a pool needs read-write access \
                 (every process carves it); open the file read-write, or pass a descriptor \
                 opened so",
                path.display()
            ),
            Error::FdNotReceived { reason } => {
                write!(f, "no descriptor was received over the socket: {reason}")
            }
            Error::PoolCorrupt { path, reason } => write!(
                f,
                "shared pool {} is damaged: {reason}; create a new pool once no process uses \
                 this one",
                path.display()
            ),
            Error::PoolTooLarge {
                bytes,
                node,
                node_bytes,
            } => write!(
                f,
                "a shared pool of {bytes} bytes does not fit node {node}, which has \
                 {node_bytes} bytes of memory (and a pool needs room for its header and one \
                 block); ask for less, or for another node"
            ),
            Error::PoolWrongNode {
                path,
                node,
                elsewhere,
                pages,
                found,
            } => write!(
                f,
                "shared pool {} is meant for node {node}, but {elsewhere} of its {pages} pages \
                 are not there (one on {found}): placement was refused (mbind under seccomp), \
                 the node ran out, or the file's header names another node; remove the file \
                 and create the pool again on a node with room",
                path.display()
            ),
            Error::PoolHugePages {
                needed,
                free,
                place,
            } => write!(
                f,
                "a shared pool of huge pages at {} needs {needed} free huge pages, {free} are \
                 free; reserve more (vm.nr_hugepages, or the node's nr_hugepages) or make the \
                 pool without huge pages",
                place.display()
            ),
            Error::PoolStale { path, pid } => write!(
                f,
                "shared pool {} was left half made by process {pid}, which is gone (as this \
                 process's PID namespace sees it: a creator in another container is not seen); \
                 remove the file and create the pool again",
                path.display()
            ),
            Error::PoolOwnerAlive { pid } => write!(
                f,
                "process {pid} still runs: its shared pool blocks are not reclaimed; reclaim \
                 only a process that is gone"
            ),
            Error::PoolExists { path } => write!(
                f,
                "cannot create a shared pool at {}: the file exists; attach to it (attach \
                 checks who owns it), or, if you know no process uses it, remove it and create \
                 it again",
                path.display()
            ),
            Error::PoolUntrusted {
                path,
                owner,
                mode,
                uid,
                foreign_owner,
                open_mode,
            } => {
                let mut why = Vec::new();
                let mut opt_in = String::from("SharedPool::attacher()");
                if *foreign_owner {
                    why.push(format!(
                        "is owned by user {owner}, not by this process's user ({uid}) or root"
                    ));
                    opt_in += &format!(".allow_owner({owner})");
                }
                if *open_mode {
                    why.push(format!(
                        "may be written by users other than its owner (mode {mode:#o})"
                    ));
                    opt_in += &format!(".allow_mode({mode:#o})");
                }
                write!(
                    f,
                    "refusing to attach shared pool {}: it {} (owner {owner}, mode {mode:#o}), so \
                     another user may have made it or may change it; if you trust it, attach \
                     with {opt_in}; else find out who made it (it may squat the name your pool \
                     should have) and create yours at another path",
                    path.display(),
                    why.join(", and ")
                )
            }
            Error::PoolPermission {
                path,
                owner,
                mode,
                uid,
            } => {
                let found = match (owner, mode) {
                    (Some(owner), Some(mode)) => {
                        format!("owned by user {owner} with mode {mode:#o}")
                    }
                    _ => "not readable and writable by it".to_owned(),
                };
                write!(
                    f,
                    "permission denied opening shared pool {} for reading and writing: it is \
                     {found}, and this process runs as user {uid}; run as its owner, or have its \
                     creator give the users that share it access (SharedPoolBuilder::mode, and \
                     a group they share)",
                    path.display()
                )
            }
            Error::PoolDescriptor { path, access } => write!(
                f,
                "shared pool descriptor {} is open {access}: attaching maps the pool for \
                 reading and writing; pass a descriptor opened read-write (O_RDWR), such as \
                 SharedPool::fd or SharedPool::send gives",
                path.display()
            ),
            Error::PoolTooSmall { bytes, min } => write!(
                f,
                "a shared pool of {bytes} bytes is too small: a pool holds its header (its \
                 first 2 MiB) and at least one 2 MiB block, {min} bytes in all; ask for at \
                 least that"
            ),
            Error::PoolNoSpace { path, needed, free } => {
                let free = free.map_or_else(
                    || "ran out while its pages were made".to_owned(),
                    |free| format!("has {free} bytes free"),
                );
                write!(
                    f,
                    "no room for shared pool {}: it needs {needed} bytes, and its filesystem \
                     {free}; free space there (old pools under /dev/shm), make the mount larger \
                     (mount -o remount,size=...), or ask for a smaller pool",
                    path.display()
                )
            }
            Error::PoolSymlink { path } => write!(
                f,
                "refusing to attach shared pool {}: it is a symbolic link, which attach does \
                 not follow (another user may have planted it); attach the pool's own path",
                path.display()
            ),
            Error::PoolSparse {
                path,
                allocated,
                needed,
            } => write!(
                f,
                "shared pool {} is damaged: {allocated} bytes of its file are allocated, and \
                 its blocks alone are {needed} (a sparse file, or one whose pages were dropped: \
                 its creator allocates every page); create a new pool once no process uses \
                 this one",
                path.display()
            ),
            Error::PoolLockHeld {
                path,
                lock,
                pid,
                waited_ms,
            } => {
                let holder = pid.map_or_else(
                    || "a process that has not recorded its id".to_owned(),
                    |pid| format!("process {pid} (as its own PID namespace numbers it)"),
                );
                write!(
                    f,
                    "shared pool {}: its {lock} lock has been held for at least {waited_ms} ms \
                     by {holder}, which is alive: the kernel still holds its lock on the \
                     pool's file (a holder that dies passes the lock on at once); it is stopped \
                     or stuck (a debugger, SIGSTOP) or holds the lock long: let it go on or end \
                     it, or wait longer (lock_wait)",
                    path.display()
                )
            }
            Error::PoolHandle {
                path,
                offset,
                len,
                reason,
            } => write!(
                f,
                "handle {offset:#x}+{len:#x} names no live block of shared pool {}: {reason}; \
                 free each block once, through the pool that carved it",
                path.display()
            ),
            Error::InvalidRange { addr, len } => write!(
                f,
                "invalid address range {addr:#x}+{len:#x}: must be non-empty, page-aligned \
                 and mapped"
            ),
            Error::Config {
                key,
                value,
                expected,
            } => write!(f, "bad setting {key}={value:?}: expected {expected}"),
            Error::SettingDisables {
                key,
                value,
                disables,
            } => write!(f, "setting {key}={value:?} accepted: {disables}"),
            Error::CudaUnavailable { reason } => write!(f, "CUDA unavailable: {reason}"),
            Error::PinningOff => write!(
                f,
                "the allocator does not page-lock its blocks (pin=off, the default): build it \
                 with .pin(PinMode::On) or set NUMA_GPU_ALLOC=pin=on"
            ),
            Error::DriverUnusable { driver } => write!(
                f,
                "pinning is on, but no block can be page-locked: the CUDA driver is not usable \
                 ({driver})"
            ),
            Error::NodeTarget => write!(
                f,
                "pinning is on, but no block is page-locked: the allocator's target is a NUMA \
                 node (node= or node=local), not a GPU; target a GPU (gpu=) to pin"
            ),
            Error::StrictPinning { reason, driver } => {
                write!(f, "pin=strict, but blocks cannot be page-locked: {reason}")?;
                if let Some(e) = driver {
                    write!(f, ": {e}")?;
                }
                write!(
                    f,
                    "; large requests fail before anything is mapped (pin=on would hand out \
                     unpinned blocks)"
                )
            }
            Error::Cuda { call, code, name } => {
                write!(f, "{call} failed: {name} ({code})")?;
                match error_hint(call, *code) {
                    Some(hint) => write!(f, ": {hint}"),
                    None => Ok(()),
                }
            }
            Error::MemoryLimit {
                cgroup,
                limit,
                available,
                requested,
            } => write!(
                f,
                "a block of {requested} bytes exceeds the memory limit of cgroup {}: memory.max \
                 {limit}, {available} bytes available (reclaimable file pages included)",
                cgroup.display()
            ),
            Error::ReserveRejected {
                blocks,
                block_size,
                threshold,
            } => write!(
                f,
                "cannot reserve {blocks} blocks of {block_size} bytes: a block is below the \
                 threshold ({threshold} bytes), so no request of that size takes the large path; \
                 lower threshold= to at most {block_size}"
            ),
            Error::GpuNotFound {
                selector,
                device_count,
            } => write!(
                f,
                "no GPU matches {selector:?} ({device_count} visible CUDA devices)"
            ),
            Error::ReserveTooLarge {
                bytes,
                node,
                node_bytes,
            } => write!(
                f,
                "cannot reserve {bytes} bytes on node {node}: it has {node_bytes} bytes of \
                 memory; reserve less, or for another node (node=, gpu= or a route)"
            ),
            Error::ReservationLost { reason } => {
                write!(f, "a reservation made in the background is lost: {reason}")
            }
            Error::PinLimit {
                requested,
                pinned,
                limit,
            } => write!(
                f,
                "page-locking {requested} more bytes would pass the pinned limit: {pinned} of \
                 {limit} bytes are page-locked; raise pin_limit= or page-lock less"
            ),
        }
    }
}
