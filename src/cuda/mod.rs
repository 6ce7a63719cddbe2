//! The only module that talks to the CUDA driver.
//!
//! cudarc is used as the loader only (`sys::is_culib_present`, `sys::culib`): every driver
//! function this module calls is resolved once, in the driver probe, as a function pointer with
//! C types, and its `CUresult` is read as a plain `u32`. cudarc's own `sys::cu*` wrappers are not
//! called: they return `CUresult` as a Rust enum, and a driver newer than cudarc's bindings can
//! return a code that enum lacks (CUDA 13 added several), which would be undefined behaviour.
//!
//! Everything here is written for the allocator's large path: nothing panics, nothing calls into
//! libcuda before [`driver_present`] has confirmed that the library loads, that every required
//! driver function is exported, and that `cuInit` succeeds.
//!
//! Allocation: loading libcuda and resolving its symbols allocate, once, inside the probe; callers
//! inside the allocator run it under the allocator's re-entrancy flag, so those allocations go to
//! the system allocator. Registering and unregistering call through the stored pointers and do
//! not allocate.
//!
//! Files: `driver.rs` loads libcuda and holds the entry-point table and the probe; `device.rs`
//! finds a device; `context.rs` retains its primary context and registers memory; this file
//! names errors and holds the public items; `tests.rs` runs the code against a fake driver table.

mod context;
mod device;
mod driver;
mod event;
#[cfg(feature = "pinned-buffer")]
mod pinned;
#[cfg(test)]
mod tests;

pub(crate) use context::Gpu;
pub(crate) use device::Device;
pub(crate) use driver::driver_present;
#[cfg(feature = "pinned-buffer")]
pub use pinned::PinnedBuf;

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
    // must go straight to the system allocator, as they do inside the allocator itself.
    let _inside = crate::guard::Inside::enter();
    driver_present()
}

/// The name of a `CUresult` number this crate knows without asking the driver.
pub(super) fn known_error_name(code: u32) -> Option<&'static str> {
    Some(match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        36 => "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        202 => "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        205 => "CUDA_ERROR_MAP_FAILED",
        206 => "CUDA_ERROR_UNMAP_FAILED",
        216 => "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        805 => "CUDA_ERROR_MPS_CONNECTION_FAILED",
        909 => "CUDA_ERROR_TIMEOUT",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
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
