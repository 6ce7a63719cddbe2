//! The only module that talks to the CUDA driver.
//!
//! libcuda is opened with libloading (`driver.rs`), whatever linking mode cudarc has: every driver
//! function this module calls is resolved once, in the driver probe, as a function pointer with
//! C types, and its `CUresult` is read as a plain `u32`. cudarc's own `sys::cu*` wrappers are not
//! called by the allocator: they return `CUresult` as a Rust enum, and a driver newer than
//! cudarc's bindings can return a code that enum lacks (CUDA 13 added several), which would be
//! undefined behaviour. The one exception is the cudarc-facing side (`event.rs`, `pinned.rs`):
//! cudarc's `SyncOnDrop::Record` needs cudarc's own `CudaEvent`, so events are created,
//! recorded, waited on by streams and destroyed through cudarc's safe API, as the user's own
//! copies are; querying and host waits still go through the table.
//!
//! Everything here is written for the allocator's large path: nothing panics, nothing calls into
//! libcuda before [`driver_present`] has confirmed that the library loads, that every required
//! driver function is exported, and that `cuInit` succeeds.
//!
//! Allocation: loading libcuda and resolving its symbols allocate, once, inside the probe; callers
//! inside the allocator run it under the allocator's re-entrancy flag, so those allocations go to
//! the inner allocator. Registering and unregistering call through the stored pointers and do
//! not allocate.
//!
//! Files: `driver.rs` loads libcuda and holds the entry-point table and the probe; `device.rs`
//! finds a device; `context.rs` retains its primary context and registers memory; `event.rs`
//! and `pinned.rs` order reuse after stream work; this file holds the public items and error
//! naming (the `CUresult` names themselves are in [`crate::error`]); `tests.rs` runs the code against a fake driver
//! table.
//!
//! Unsafe code here relies on the driver's function pointers, resolved once with C types, called
//! with live handles of this module.
#![allow(unsafe_code)]

mod context;
mod device;
mod driver;
mod event;
#[cfg(feature = "pinned-buffer")]
mod pinned;
#[cfg(test)]
mod tests;

pub(crate) use context::{Gpu, FORKED_REASON};
pub(crate) use device::{current_ordinal, Device};
pub(crate) use driver::driver_present;
#[cfg(feature = "pinned-buffer")]
pub use pinned::{PinnedBuf, PinnedSliceMut};

use crate::error::known_error_name;
use crate::Error;

/// Whether the CUDA driver is usable in this process: `libcuda` loads, exports the functions this
/// crate calls, and `cuInit` succeeds.
///
/// The answer is computed once and cached; the call never panics. Without a driver the allocator
/// still places large blocks on NUMA nodes but does not page-lock them. Programs that use cudarc
/// directly (whose raw calls panic when libcuda is missing) can check this first.
///
/// ```
/// if numa_gpu_alloc::cuda_driver_present() {
///     // safe to call cudarc's driver API here
/// } else {
///     println!("no CUDA driver; pinning is off");
/// }
/// ```
pub fn cuda_driver_present() -> bool {
    // The first call loads libcuda, which allocates: under `#[global_allocator]` those requests
    // must go straight to the inner allocator, as they do inside the allocator itself.
    let _inside = crate::guard::Inside::enter();
    driver_present()
}

/// Why the CUDA driver is not usable in this process, or `None` when it is (the answer of the
/// probe behind [`cuda_driver_present`], computed once).
///
/// [`Error::CudaUnavailable`] says that libcuda could not be loaded or lacks a function this crate
/// calls; [`Error::Cuda`] with `call: "cuInit"` carries the code `cuInit` returned, its name
/// (for instance 802, `CUDA_ERROR_SYSTEM_NOT_READY`: on NVSwitch systems, the fabric manager is
/// not running) and, in its `Display` text, a hint where one is known.
///
/// ```
/// match numa_gpu_alloc::cuda_unavailable_reason() {
///     None => println!("CUDA driver ready"),
///     Some(why) => println!("no pinning: {why}"),
/// }
/// ```
pub fn cuda_unavailable_reason() -> Option<Error> {
    // As in `cuda_driver_present`: the first call loads libcuda, which allocates.
    let _inside = crate::guard::Inside::enter();
    probe_error().cloned()
}

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

/// A cudarc call's error as [`Error::Cuda`] (cudarc already read the result as its enum).
pub(super) fn driver_error(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    cuda_error(call, e.0 as u32, |_| None)
}

/// The error a failed registration of `code` gives, for tests that inject one.
#[cfg(feature = "fault-injection")]
pub(crate) fn simulated_register_error(code: u32) -> Error {
    cuda_error("cuMemHostRegister_v2", code, |_| None)
}
