//! The CUDA front end: whether the driver is there to page-lock ([`cuda_driver_present`],
//! [`cuda_unavailable_reason`]) and, with the feature `pinned-buffer`, pinned memory that cudarc's
//! copies use asynchronously and safely: [`PinnedBuf`] (`buf.rs`). It and
//! [`NumaGpuAlloc::record_stream`](crate::NumaGpuAlloc::record_stream) leave the arena a record
//! of a freed block's GPU work (`alloc/record.rs`, with the allocator value). The driver calls
//! themselves are `cuda/`'s.

#[cfg(feature = "pinned-buffer")]
mod buf;

#[cfg(feature = "pinned-buffer")]
pub use buf::{PinnedBuf, PinnedSliceMut};

use crate::cuda::{driver_present, probe_error};
use crate::guard::Inside;
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
    let _inside = Inside::enter();
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
    let _inside = Inside::enter();
    probe_error().cloned()
}
