//! The only raw system calls of the crate (see the design notes), one file per job:
//!
//! - `mem.rs`: mappings — [`map_anonymous`] (`mmap`), [`move_mapping`] (`mremap`), [`unmap`],
//!   the `madvise` hints;
//! - `policy.rs`: where pages may go — [`NodeMask`], [`MemPolicy`], [`bind`] (`mbind`),
//!   [`allowed_memory_nodes`] (`get_mempolicy`), [`current_node`] (`getcpu`);
//! - `resident.rs`: making pages resident — [`populate`]
//!   (`madvise(MADV_POPULATE_WRITE)`);
//! - `faults.rs`: what faulting fresh memory in costs, in huge and in small pages
//!   ([`fault_costs`]);
//! - `pages.rs`: where pages are — [`page_nodes`] and [`census`] (`move_pages`);
//! - `affinity.rs`: which CPUs a thread runs on (`sched_setaffinity`, `sched_getaffinity`);
//! - `lock.rs`: the allocator's fork-safe lock (`futex`); `once.rs`: one-time state a fork cannot
//!   catch half-done;
//! - `process.rs`: fork handlers (`pthread_atfork`), the crate's threads, started with every
//!   signal blocked (`pthread_create`, `pthread_sigmask`); `exit.rs`: the exit handler, its stderr
//!   writes and the loaded-image check (`atexit`, `write`, `dladdr`);
//! - `shm.rs` (Linux): memory several processes map — memory files (`memfd_create`), shared
//!   file mappings, `fstatfs`, `flock`, descriptors over a Unix socket (`SCM_RIGHTS`);
//!   `pool_lock.rs` (Linux): a shared pool's locks, passed on from a holder once the kernel
//!   says it is gone (`fcntl(F_OFD_SETLK)` locks on the pool's file; plain numbers in the
//!   shared memory, no pointers);
//! - `counters.rs`: kernel counters an allocation reads, from descriptors opened at
//!   initialisation (`pread64`);
//! - `fault.rs`: fault injection for tests (feature `fault-injection`).
//!
//! Everything here runs inside a memory allocator, so nothing allocates on the heap, nothing
//! panics, and errno is read without building an [`std::io::Error`] payload (an `Os` error is
//! just an integer).
//!
//! The pipeline is [`map_anonymous`] → [`bind`] → [`populate`]. Never map with
//! `MAP_POPULATE`: pages faulted in before `mbind` sets the policy stay on whichever node the
//! faulting CPU chose. [`page_nodes`] and [`census`] check afterwards where the pages really are.
//!
//! Unsafe code here relies on `sysconf` having no memory-safety preconditions; each file below
//! states what its own raw calls rely on.
#![allow(unsafe_code)]
// Off Linux the raw calls are not compiled, so what they would have been given is unused.
#![cfg_attr(not(target_os = "linux"), allow(unused))]

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{Error, Result};

/// `Ok(call)` on Linux; elsewhere `Err(ENOSYS)` without compiling `call`, whose Linux-only names
/// do not exist there. Off Linux the allocator passes every request to its inner allocator, and
/// the few paths that still reach these calls get the error a kernel without NUMA gives.
macro_rules! linux_only {
    ($call:expr) => {{
        #[cfg(target_os = "linux")]
        let outcome = Ok($call);
        #[cfg(not(target_os = "linux"))]
        let outcome = Err(libc::ENOSYS);
        outcome
    }};
}

#[cfg(target_os = "linux")]
mod affinity;
#[cfg(not(target_os = "linux"))]
mod affinity {
    //! Thread affinity off Linux: unsupported, as the callers (populate workers) expect to hear.
    use crate::{Error, Result};

    pub(crate) fn bind_thread_to_cpus(_cpus: &[usize]) -> Result<()> {
        Err(Error::Syscall {
            call: "sched_setaffinity",
            errno: libc::ENOSYS,
        })
    }

    pub(crate) fn process_cpus() -> Result<Vec<usize>> {
        Err(Error::Syscall {
            call: "sched_getaffinity",
            errno: libc::ENOSYS,
        })
    }
}
pub(crate) mod counters;
mod exit;
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod fault;
#[cfg(not(feature = "fault-injection"))]
pub(crate) mod fault;
mod faults;
pub(crate) mod lock;
mod mem;
pub(crate) mod once;
mod pages;
mod policy;
#[cfg(target_os = "linux")]
mod pool_lock;
mod process;
mod resident;
#[cfg(target_os = "linux")]
mod shm;

pub(crate) use affinity::{bind_thread_to_cpus, process_cpus};
pub(crate) use exit::{at_exit, in_loaded_image, write_stderr};
pub use faults::{fault_costs, FaultCosts};
pub(crate) use lock::{futex_wait, futex_wake};
pub use mem::{
    advise_dontneed, advise_hugepage, advise_nohugepage, map_anonymous, move_mapping, unmap,
};
pub(crate) use mem::{move_and_grow, moves_several_mappings, truncate_mapping, HUGE_PAGE};
pub use pages::{census, page_nodes, PageCensus};
pub use policy::{
    allowed_memory_nodes, bind, current_node, MbindFlags, MemPolicy, NodeMask, MAX_NODES,
};
#[cfg(target_os = "linux")]
pub(crate) use pool_lock::{Gate, Held, LockKey, Locked, SharedMutex};
pub(crate) use process::{at_fork, find_thread_overhead, spawn_detached, with_signals_blocked};
pub use resident::{populate, PopulateMethod};
pub(crate) use resident::{resident_sample, written_sample};
#[cfg(target_os = "linux")]
pub(crate) use shm::{
    access_mode, effective_uid, file_owner, free_bytes, map_in, map_shared, memfd, on_hugetlbfs,
    process_alive, process_id, random_u32, recv_fd, remove_pages, seal_size, send_fd, set_cloexec,
    Access,
};

/// The system page size, from `sysconf(_SC_PAGESIZE)` on first use, then cached.
pub fn page_size() -> usize {
    static PAGE_SIZE: AtomicUsize = AtomicUsize::new(0);
    let cached = PAGE_SIZE.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    // sysconf cannot fail for _SC_PAGESIZE on Linux; 4 KiB keeps us going if it ever does.
    let size = if size > 0 { size as usize } else { 4096 };
    // Races are harmless: every thread stores the same value.
    PAGE_SIZE.store(size, Ordering::Relaxed);
    size
}

/// The calling thread's errno, without allocating (an `Os` io::Error holds just the number).
fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// EPERM (seccomp) and ENOSYS (kernel without NUMA) mean "no NUMA here"; callers fall back.
fn numa_error(call: &'static str, errno: i32) -> Error {
    if errno == libc::EPERM || errno == libc::ENOSYS {
        Error::NumaUnavailable { call, errno }
    } else {
        Error::Syscall { call, errno }
    }
}

/// Checks that `ptr..ptr+len` is non-empty, starts on a page boundary and does not wrap.
fn check_range(ptr: NonNull<u8>, len: usize) -> Result<usize> {
    let addr = ptr.as_ptr() as usize;
    let ps = page_size();
    if len == 0 || !addr.is_multiple_of(ps) || addr.checked_add(len).is_none() {
        return Err(Error::InvalidRange { addr, len });
    }
    // The kernel rounds a partial last page up, so do we.
    Ok(len.div_ceil(ps))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_size_is_cached_and_sane() {
        let ps = page_size();
        assert!(ps.is_power_of_two() && ps >= 4096);
        assert_eq!(page_size(), ps);
    }
}
