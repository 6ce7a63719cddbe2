//! The integration tests that need no process of their own, in one binary (one link). Tests that
//! change process-wide state do so in child processes (`common::child`, `sim_test!`), and the
//! in-process ones hold their module's lock around the process's arenas.
//!
//! Binaries of their own, and why: a `#[global_allocator]` (`exhaustion`, `fork`,
//! `global_allocator`, `inner_counting`, `inner_mimalloc`, `pinned_sim`, `seccomp`,
//! `sys_placement`, `teardown`); the environment read in the test process (`env_config`); the
//! process's resident memory (`trim_rss`) or its populate workers (`populate_workers`); a
//! feature (`faults`); the fuzz corpus, not packaged (`fuzz_corpus`); a real GPU or its
//! simulator, run by name on GPU machines (`gpu`, `host_numa_sim`, `driver_lifecycle`); shared
//! pools, whose children attach across processes, some as a second user (`shared_pool`,
//! `shared_pool_huge`, `shared_pool_locks`, `shared_pool_sim`, `shared_pool_trust`).

// The shared test modules live in tests/common/, beside this folder.
#[path = "../common/child.rs"]
pub mod child_support;
#[macro_use]
#[path = "../common/require.rs"]
pub mod require_support;
#[path = "../common/bytes.rs"]
pub mod bytes_support;
#[path = "../common/fill.rs"]
pub mod fill_support;
#[macro_use]
#[path = "../common/sim.rs"]
pub mod sim_support;
mod common {
    pub use super::bytes_support as bytes;
    pub use super::child_support as child;
    pub use super::fill_support as fill;
    pub use super::require_support as require;
    pub use super::sim_support as sim;
}

mod allocator_api;
mod decay_thread;
mod env_bad_input;
mod locked_memory;
mod many_blocks;
mod placement;
mod reserve_sim;
mod topology;
