//! The only module that talks to the CUDA driver: devices, primary contexts, host registration,
//! events and the event pool, below the allocator (it imports nothing above `error`, `config`,
//! the topology's `pci`, `lock` and `fork`).
//!
//! libcuda is opened with libloading (`driver.rs`), whatever linking mode cudarc has: every driver
//! function this module calls is resolved once, in the driver probe, as a function pointer with
//! C types, and its `CUresult` is read as a plain `u32`. cudarc's own `sys::cu*` wrappers are not
//! called: they return `CUresult` as a Rust enum, and a driver newer than cudarc's bindings can
//! return a code that enum lacks (CUDA 13 added several), which would be undefined behaviour.
//! The one exception is the cudarc-facing side (`event.rs`): cudarc's `SyncOnDrop::Record` needs
//! cudarc's own `CudaEvent`, so events are created, recorded, waited on by streams and destroyed
//! through cudarc's safe API, as the user's own copies are; querying and host waits still go
//! through the table.
//!
//! CUDA versions: the crate builds with every CUDA version cudarc 0.19 has bindings for (11.4 to
//! 13.4 in cudarc 0.19.10), whichever the program's cudarc features, nvcc or cudarc's latest pick;
//! CI builds 12.6, 12.8, 13.0 and the latest (`.ci/compose/`). Every required entry point exists
//! since CUDA 11.4. Error names cover every code of `cuda.h` 11.4 to 13.2
//! (`error/cuda_codes.rs`); newer codes are named by the driver (`cuGetErrorName`), else reported
//! as numbers.
//!
//! Everything here is written for the allocator's large path: nothing panics, nothing calls into
//! libcuda before [`driver_present`] has confirmed that the library loads, that every required
//! driver function is exported, and that `cuInit` succeeds. A forked child never calls the
//! driver through state made before the fork: each cache keeps the fork generation it was made
//! in (`crate::fork`).
//!
//! Allocation: loading libcuda and resolving its symbols allocate, once, inside the probe; callers
//! inside the allocator run it under the allocator's re-entrancy flag, so those allocations go to
//! the inner allocator. Registering and unregistering call through the stored pointers and do
//! not allocate.
//!
//! Files: `driver.rs` loads libcuda and holds the entry-point table (one macro list), the probe,
//! and `DriverTable::enter`, the only way to the table's entries, which passes the exit gate;
//! `teardown.rs` keeps every driver call out of the driver's teardown at exit; `device.rs` finds
//! a device; `context.rs` retains its primary context and registers memory; `event.rs` (feature
//! `pinned-buffer`) pools, records and queries events for the pinned front end (`pinned/`);
//! `tools.rs` is the public `cuda_driver` module for benchmarks, with CUDA's own host-NUMA memory
//! in `host_numa.rs`; this file holds error naming (the `CUresult` names themselves are in
//! [`crate::error`]); `tests/` runs the code against a fake driver table.
//!
//! Unsafe code here relies on the driver's function pointers, resolved once with C types, called
//! with live handles of this module.
#![allow(unsafe_code)]

mod context;
mod device;
mod driver;
#[cfg(feature = "pinned-buffer")]
pub(crate) mod event;
mod host_numa;
mod teardown;
#[cfg(test)]
mod tests;
pub mod tools;

pub(crate) use context::{Gpu, RegisterFlags, FORKED_REASON};
pub(crate) use device::{current_ordinal, Device};
pub(crate) use driver::driver_present;
pub(crate) use teardown::{close_at_exit, exiting, forget_calls_in_child, EXITING_REASON};

use crate::error::known_error_name;
use crate::Error;

/// The driver probe's error, kept for the life of the process (probing first if needed).
pub(crate) fn probe_error() -> Option<&'static Error> {
    driver::driver_state().as_ref().err()
}

/// Name used when neither the table nor the driver knows a code.
pub(super) const UNNAMED_ERROR: &str = "CUDA_ERROR_UNRECOGNIZED";

/// A raw `CUresult` → [`Error::Cuda`]. The name comes from the table above, else from
/// `driver_name` (the driver's `cuGetErrorName` in production), else [`UNNAMED_ERROR`]. Any
/// number is accepted: codes newer than this crate are reported, not misread.
pub(super) fn cuda_error(
    call: &'static str,
    code: u32,
    driver_name: impl FnOnce(u32) -> Option<&'static str>,
) -> Error {
    let name = known_error_name(code)
        .or_else(|| driver_name(code))
        .unwrap_or(UNNAMED_ERROR);
    Error::Cuda { call, code, name }
}

#[cfg(feature = "pinned-buffer")]
/// A cudarc call's error as [`Error::Cuda`] (cudarc already read the result as its enum).
pub(super) fn driver_error(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    cuda_error(call, e.0 as u32, |_| None)
}

/// The error a failed registration of `code` gives, for tests that inject one.
#[cfg(feature = "fault-injection")]
pub(crate) fn simulated_register_error(code: u32) -> Error {
    cuda_error("cuMemHostRegister_v2", code, |_| None)
}
