//! Tools for this crate's own benchmarks, examples and test programs, kept out of the stable
//! surface. **Unstable:** no semver promise; any release may change or remove them, and an
//! allocator user needs none of them.
//!
//! - [`sys`]: the raw placement calls the allocator is built on (`mmap`, `mbind`, populate,
//!   `move_pages`), for programs that check where pages landed;
//! - [`cuda_driver`]: the crate's thin CUDA driver table (page-locked host memory, CUDA's own
//!   host-NUMA memory, timed copies), the peer `dma_bench` weighs the allocator against;
//! - [`pci`] and [`sysfs`]: the parsers behind [`NumaTopology::from_sysfs`](crate::NumaTopology::from_sysfs),
//!   public so that they can be fuzzed;
//! - [`parse_size`] (the size syntax of the settings) and [`cuda_error_name`];
//! - [`hold_pool_lock`]: a shared pool's lock held while a closure runs, for the programs that
//!   kill a process holding it; [`hold_registration_lock`] its registration lock.
//!
//! They live in the crate rather than in a crate of their own because the examples a user runs
//! (`dma_bench`, `topology`) need them, and a feature would have to be switched on for
//! `cargo run --example`.

pub use crate::config::parse_size;
pub use crate::cuda::tools as cuda_driver;
pub use crate::error::cuda_error_name;
pub use crate::topology::{pci, sysfs};

/// Runs `f` holding `pool`'s lock (every other process's allocate and free wait meanwhile).
///
/// # Errors
/// The lock's, when its state cannot be recovered.
#[cfg(target_os = "linux")]
pub fn hold_pool_lock<T>(pool: &crate::SharedPool, f: impl FnOnce() -> T) -> crate::Result<T> {
    pool.with_lock_held(f)
}

/// Runs `f` holding `pool`'s registration lock (every other process's chunk registrations of
/// the pool wait meanwhile), for the programs that check those waits.
///
/// # Errors
/// [`Error::PoolLockHeld`](crate::Error::PoolLockHeld) when another process holds it for all
/// of the pool's lock wait.
#[cfg(target_os = "linux")]
pub fn hold_registration_lock<T>(
    pool: &crate::SharedPool,
    f: impl FnOnce() -> T,
) -> crate::Result<T> {
    pool.with_registration_lock_held(f)
}

/// The crate's raw placement calls: mappings, placement policy, populate and the page census
/// (the shared pool's memory files, descriptors and locks stay inside the crate). Everything
/// here runs inside a memory allocator: nothing allocates or panics.
///
/// The pipeline is [`map_anonymous`](sys::map_anonymous) → [`bind`](sys::bind) →
/// [`populate`](sys::populate); never map with `MAP_POPULATE` (pages faulted in before `mbind`
/// stay where the faulting CPU put them). [`census`](sys::census) checks afterwards where the
/// pages are.
pub mod sys {
    #[cfg(feature = "fault-injection")]
    pub use crate::sys::fault;
    pub use crate::sys::{
        advise_dontneed, advise_hugepage, advise_nohugepage, allowed_memory_nodes, bind, census,
        current_node, fault_costs, map_anonymous, move_mapping, page_nodes, page_size, populate,
        unmap, FaultCosts, MbindFlags, MemPolicy, NodeMask, PageCensus, PopulateMethod, MAX_NODES,
    };
}
