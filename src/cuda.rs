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

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr::NonNull;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::config::GpuSelector;
use crate::pci::PciAddress;
use crate::{Error, Result};

/// Driver functions that must be exported by libcuda for the driver to count as present.
/// `cuInit` is called once by the probe; the others are kept in [`Api`].
const REQUIRED_SYMBOLS: &[&CStr] = &[
    c"cuInit",
    c"cuGetErrorName",
    c"cuDeviceGetCount",
    c"cuDeviceGet",
    c"cuDeviceGetAttribute",
    c"cuDeviceGetName",
    c"cuDeviceGetPCIBusId",
    c"cuDevicePrimaryCtxRetain",
    c"cuDevicePrimaryCtxRelease_v2",
    c"cuCtxPushCurrent_v2",
    c"cuCtxPopCurrent_v2",
    c"cuMemHostRegister_v2",
    c"cuMemHostUnregister",
    c"cuThreadExchangeStreamCaptureMode",
];

/// Environment variables that launchers set to the process's rank on its node, in the order
/// they are consulted by [`GpuSelector::Auto`].
pub(crate) const LOCAL_RANK_VARS: [&str; 4] = [
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
];

/// `CUresult` as the raw number the driver returns (any value, known to cudarc's bindings or not).
type CuResult = u32;
/// `CUdevice` (`typedef int CUdevice`).
type CuDevice = c_int;
/// `CUcontext` (an opaque pointer).
type CuContext = *mut c_void;

/// `CUuuid`: `struct { char bytes[16]; }`.
#[repr(C)]
struct CuUuid {
    bytes: [u8; 16],
}

/// `CUresult cuInit(unsigned int Flags)`.
type InitFn = unsafe extern "C" fn(c_uint) -> CuResult;
/// `CUresult cuGetErrorName(CUresult error, const char **pStr)`.
type GetErrorNameFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
/// `CUresult cuDeviceGetCount(int *count)`.
type DeviceGetCountFn = unsafe extern "C" fn(*mut c_int) -> CuResult;
/// `CUresult cuDeviceGet(CUdevice *device, int ordinal)`.
type DeviceGetFn = unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult;
/// `CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`.
type DeviceGetAttributeFn = unsafe extern "C" fn(*mut c_int, c_uint, CuDevice) -> CuResult;
/// `CUresult cuDeviceGetName(char *name, int len, CUdevice dev)`, and the same prototype for
/// `cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)`.
type DeviceGetTextFn = unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult;
/// `CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)`, and `cuDeviceGetUuid_v2`.
type DeviceGetUuidFn = unsafe extern "C" fn(*mut CuUuid, CuDevice) -> CuResult;
/// `CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`.
type PrimaryCtxRetainFn = unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult;
/// `CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)`.
type PrimaryCtxReleaseFn = unsafe extern "C" fn(CuDevice) -> CuResult;
/// `CUresult cuCtxPushCurrent_v2(CUcontext ctx)`.
type CtxPushFn = unsafe extern "C" fn(CuContext) -> CuResult;
/// `CUresult cuCtxPopCurrent_v2(CUcontext *pctx)`.
type CtxPopFn = unsafe extern "C" fn(*mut CuContext) -> CuResult;
/// `CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)`.
type MemHostRegisterFn = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult;
/// `CUresult cuMemHostUnregister(void *p)`.
type MemHostUnregisterFn = unsafe extern "C" fn(*mut c_void) -> CuResult;
/// `CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)` (the enum is a C
/// `unsigned int`).
type ExchangeCaptureModeFn = unsafe extern "C" fn(*mut c_uint) -> CuResult;

/// `CUDA_SUCCESS`.
const SUCCESS: CuResult = 0;
/// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
const HOST_MEMORY_NOT_REGISTERED: CuResult = 713;
/// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`.
const ATTRIBUTE_HOST_NUMA_ID: c_uint = 134;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`: this thread's driver calls do not invalidate a capture in
/// progress on another thread.
const CAPTURE_MODE_RELAXED: c_uint = 2;
/// `CU_MEMHOSTREGISTER_PORTABLE`.
const REGISTER_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTREGISTER_DEVICEMAP`.
const REGISTER_DEVICEMAP: c_uint = 2;
/// `CU_MEMHOSTREGISTER_READ_ONLY`.
const REGISTER_READ_ONLY: c_uint = 8;

/// Why a forked child does not register memory.
const FORKED_REASON: &str = "the process forked after CUDA was initialised";

/// The driver entry points this module calls, resolved once by the probe. Function pointers
/// into libcuda, which cudarc keeps loaded for the life of the process.
#[derive(Clone, Copy)]
struct Api {
    /// `cuGetErrorName`.
    get_error_name: GetErrorNameFn,
    /// `cuDeviceGetCount`.
    device_get_count: DeviceGetCountFn,
    /// `cuDeviceGet`.
    device_get: DeviceGetFn,
    /// `cuDeviceGetAttribute`.
    device_get_attribute: DeviceGetAttributeFn,
    /// `cuDeviceGetName`.
    device_get_name: DeviceGetTextFn,
    /// `cuDeviceGetPCIBusId`.
    device_get_pci_bus_id: DeviceGetTextFn,
    /// `cuDeviceGetUuid_v2` (the MIG instance's UUID under MIG), when exported.
    device_get_uuid_v2: Option<DeviceGetUuidFn>,
    /// `cuDeviceGetUuid` (the physical GPU's UUID), when exported.
    device_get_uuid: Option<DeviceGetUuidFn>,
    /// `cuDevicePrimaryCtxRetain`.
    primary_ctx_retain: PrimaryCtxRetainFn,
    /// `cuDevicePrimaryCtxRelease_v2`.
    primary_ctx_release: PrimaryCtxReleaseFn,
    /// `cuCtxPushCurrent_v2`.
    ctx_push: CtxPushFn,
    /// `cuCtxPopCurrent_v2`.
    ctx_pop: CtxPopFn,
    /// `cuMemHostRegister_v2`.
    mem_host_register: MemHostRegisterFn,
    /// `cuMemHostUnregister`.
    mem_host_unregister: MemHostUnregisterFn,
    /// `cuThreadExchangeStreamCaptureMode`.
    exchange_capture_mode: ExchangeCaptureModeFn,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api")
            .field("uuid_v2", &self.device_get_uuid_v2.is_some())
            .field("uuid_v1", &self.device_get_uuid.is_some())
            .finish_non_exhaustive()
    }
}

/// What the one-time driver probe found: the entry points when libcuda loaded, exports what this
/// module needs, and `cuInit(0)` succeeded; else why not.
type DriverState = std::result::Result<Api, &'static str>;

/// The probe's answer, computed on the first call.
fn driver_state() -> &'static DriverState {
    static STATE: OnceLock<DriverState> = OnceLock::new();
    STATE.get_or_init(probe_driver)
}

/// Looks up `name` in libcuda as a function pointer of type `F`.
///
/// # Safety
///
/// libcuda must be loadable (`sys::is_culib_present()` returned `true`), and `F` must be an
/// `unsafe extern "C" fn` type matching the C prototype of the symbol `name`.
unsafe fn symbol<F: Copy>(name: &CStr) -> Option<F> {
    // SAFETY: libcuda loads (caller), so `culib` opens it without reaching its panic, and keeps
    // it loaded for the life of the process (in a static). The caller guarantees that `F` is the
    // symbol's function pointer type; the pointer is copied out of the `Symbol` and stays valid
    // because the library is never unloaded.
    unsafe { sys::culib().get::<F>(name) }.ok().map(|sym| *sym)
}

/// Resolves every entry point of [`Api`]; `None` when a required one is missing.
///
/// # Safety
///
/// libcuda must be loadable (`sys::is_culib_present()` returned `true`).
unsafe fn load_api() -> Option<Api> {
    // SAFETY: libcuda loads (caller); each type passed to `symbol` is the C prototype of the
    // symbol named, as spelt out on the type aliases above (checked against cudarc's bindings,
    // with `CUresult` and the enums read as plain integers).
    unsafe {
        Some(Api {
            get_error_name: symbol::<GetErrorNameFn>(c"cuGetErrorName")?,
            device_get_count: symbol::<DeviceGetCountFn>(c"cuDeviceGetCount")?,
            device_get: symbol::<DeviceGetFn>(c"cuDeviceGet")?,
            device_get_attribute: symbol::<DeviceGetAttributeFn>(c"cuDeviceGetAttribute")?,
            device_get_name: symbol::<DeviceGetTextFn>(c"cuDeviceGetName")?,
            device_get_pci_bus_id: symbol::<DeviceGetTextFn>(c"cuDeviceGetPCIBusId")?,
            device_get_uuid_v2: symbol::<DeviceGetUuidFn>(c"cuDeviceGetUuid_v2"),
            device_get_uuid: symbol::<DeviceGetUuidFn>(c"cuDeviceGetUuid"),
            primary_ctx_retain: symbol::<PrimaryCtxRetainFn>(c"cuDevicePrimaryCtxRetain")?,
            primary_ctx_release: symbol::<PrimaryCtxReleaseFn>(c"cuDevicePrimaryCtxRelease_v2")?,
            ctx_push: symbol::<CtxPushFn>(c"cuCtxPushCurrent_v2")?,
            ctx_pop: symbol::<CtxPopFn>(c"cuCtxPopCurrent_v2")?,
            mem_host_register: symbol::<MemHostRegisterFn>(c"cuMemHostRegister_v2")?,
            mem_host_unregister: symbol::<MemHostUnregisterFn>(c"cuMemHostUnregister")?,
            exchange_capture_mode: symbol::<ExchangeCaptureModeFn>(
                c"cuThreadExchangeStreamCaptureMode",
            )?,
        })
    }
}

/// Loads libcuda, resolves the entry points and calls `cuInit(0)`; never panics.
fn probe_driver() -> DriverState {
    const TOO_OLD: &str = "libcuda lacks a required driver function (the driver is too old)";
    // SAFETY: `is_culib_present` only tries to open the library by its candidate names with
    // libloading (running libcuda's initialisers, which is what loading it means); it does not
    // panic when none is found.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcuda.so could not be loaded (no NVIDIA driver on this machine)");
    }
    let has = |name: &CStr| {
        // SAFETY: libcuda loads (just checked); the symbol is only looked up, never called
        // through this type, and the function pointer type is irrelevant to `dlsym`.
        unsafe { symbol::<unsafe extern "C" fn()>(name) }.is_some()
    };
    if !REQUIRED_SYMBOLS.iter().all(|name| has(name)) {
        return Err(TOO_OLD);
    }
    // SAFETY: libcuda loads (checked above); `InitFn` is cuInit's C prototype.
    let init = unsafe { symbol::<InitFn>(c"cuInit") }.ok_or(TOO_OLD)?;
    // SAFETY: as above.
    let api = unsafe { load_api() }.ok_or(TOO_OLD)?;
    // SAFETY: cuInit is resolved from the loaded libcuda and takes flags 0.
    let res = unsafe { init(0) };
    if res != SUCCESS {
        return Err(cuinit_reason(res));
    }
    Ok(api)
}

/// Why `cuInit` failed, as a fixed sentence (the error's `reason` is `&'static str`).
fn cuinit_reason(code: u32) -> &'static str {
    match code {
        100 => "cuInit failed: CUDA_ERROR_NO_DEVICE (no visible GPU; check CUDA_VISIBLE_DEVICES)",
        34 => "cuInit failed: CUDA_ERROR_STUB_LIBRARY (libcuda.so is the toolkit's stub)",
        35 => "cuInit failed: CUDA_ERROR_INSUFFICIENT_DRIVER (the driver is too old)",
        46 => "cuInit failed: CUDA_ERROR_DEVICE_UNAVAILABLE (GPUs busy or exclusive-process)",
        803 => {
            "cuInit failed: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH (libcuda and the kernel module \
             differ)"
        }
        804 => "cuInit failed: CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        999 => "cuInit failed: CUDA_ERROR_UNKNOWN (is the nvidia kernel module loaded?)",
        304 => "cuInit failed: CUDA_ERROR_OPERATING_SYSTEM",
        _ => "cuInit failed",
    }
}

/// Whether libcuda loads, exports what this crate needs, and `cuInit` succeeds. Decided once
/// (the first call probes; later calls read the answer); never panics.
pub(crate) fn driver_present() -> bool {
    driver_state().is_ok()
}

/// The driver's entry points when it is usable, else `CudaUnavailable` with the reason.
fn require_driver() -> Result<&'static Api> {
    match driver_state() {
        Ok(api) => Ok(api),
        Err(reason) => Err(Error::CudaUnavailable { reason }),
    }
}

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
pub(crate) fn known_error_name(code: u32) -> Option<&'static str> {
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
const UNNAMED_ERROR: &str = "CUDA_ERROR_UNRECOGNIZED";

/// A raw `CUresult` → [`Error::Cuda`]. The name comes from the table above, else from
/// `driver_name` (the driver's `cuGetErrorName` in production), else [`UNNAMED_ERROR`]. Any
/// number is accepted: codes newer than this crate are reported, not misread.
pub(crate) fn cuda_error(
    call: &'static str,
    code: u32,
    driver_name: impl FnOnce(u32) -> Option<&'static str>,
) -> Error {
    let name = known_error_name(code)
        .or_else(|| driver_name(code))
        .unwrap_or(UNNAMED_ERROR);
    Error::Cuda { call, code, name }
}

/// The error a failed registration of `code` gives, for tests that inject one.
#[cfg(feature = "fault-injection")]
pub(crate) fn simulated_register_error(code: u32) -> Error {
    cuda_error("cuMemHostRegister_v2", code, |_| None)
}

impl Api {
    /// The driver's name for `code` (`cuGetErrorName`), when it has one. Its strings are static
    /// in libcuda, which is never unloaded.
    fn error_name(&self, code: CuResult) -> Option<&'static str> {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: `get_error_name` is cuGetErrorName from the loaded libcuda (the driver is
        // present: an `Api` exists only then); it accepts any number (unknown ones give
        // CUDA_ERROR_INVALID_VALUE) and `text` is a valid out-pointer.
        let res = unsafe { (self.get_error_name)(code, &mut text) };
        if res != SUCCESS || text.is_null() {
            return None;
        }
        // SAFETY: on success cuGetErrorName stores a pointer to a NUL-terminated string constant
        // inside libcuda; the library is held in a static by cudarc and never unloaded, so the
        // string lives for the rest of the process.
        let name: &'static CStr = unsafe { CStr::from_ptr(text) };
        name.to_str().ok()
    }

    /// `Ok(())` for `CUDA_SUCCESS`, else the mapped error.
    fn check(&self, call: &'static str, res: CuResult) -> Result<()> {
        if res == SUCCESS {
            Ok(())
        } else {
            Err(cuda_error(call, res, |code| self.error_name(code)))
        }
    }
}

/// The local rank from the first of [`LOCAL_RANK_VARS`] whose value parses as a number.
/// `lookup` reads one variable (it is `std::env::var` in production, a map in tests).
pub(crate) fn local_rank(lookup: impl Fn(&str) -> Option<String>) -> Option<usize> {
    LOCAL_RANK_VARS
        .iter()
        .find_map(|var| lookup(var).and_then(|v| v.trim().parse::<usize>().ok()))
}

/// The ordinal `GpuSelector::Auto` picks among `device_count` devices.
pub(crate) fn auto_ordinal(lookup: impl Fn(&str) -> Option<String>, device_count: usize) -> usize {
    match (local_rank(lookup), device_count) {
        (Some(rank), n) if n > 0 => rank % n,
        _ => 0,
    }
}

/// A selector as the user would write it, for [`Error::GpuNotFound`].
fn selector_text(selector: &GpuSelector) -> String {
    match selector {
        GpuSelector::Auto => "auto".to_owned(),
        GpuSelector::Ordinal(n) => n.to_string(),
        GpuSelector::Pci(addr) => format!("pci:{addr}"),
        GpuSelector::Uuid(bytes) => uuid_text(bytes),
    }
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub(crate) fn uuid_text(bytes: &[u8; 16]) -> String {
    let mut s = String::with_capacity(40);
    s.push_str("GPU-");
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Bytes of a NUL-terminated C string in `buf` (all of it when there is no NUL).
fn c_buf_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Safe wrappers for the per-device queries, through the resolved entry points.
mod raw {
    use super::*;

    pub(super) fn device_count(api: &Api) -> Result<usize> {
        let mut count: c_int = 0;
        // SAFETY: `api` holds cuDeviceGetCount from the loaded, initialised driver; `count` is a
        // valid out-pointer.
        let res = unsafe { (api.device_get_count)(&mut count) };
        api.check("cuDeviceGetCount", res)?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    pub(super) fn device(api: &Api, ordinal: usize) -> Result<CuDevice> {
        let ordinal = c_int::try_from(ordinal).map_err(|_| Error::Cuda {
            call: "cuDeviceGet",
            code: 101,
            name: "CUDA_ERROR_INVALID_DEVICE",
        })?;
        let mut dev: CuDevice = 0;
        // SAFETY: cuDeviceGet from the initialised driver; `dev` is a valid out-pointer.
        let res = unsafe { (api.device_get)(&mut dev, ordinal) };
        api.check("cuDeviceGet", res)?;
        Ok(dev)
    }

    pub(super) fn pci_bus_id(api: &Api, dev: CuDevice) -> Result<String> {
        let mut buf: [c_char; 64] = [0; 64];
        // SAFETY: cuDeviceGetPCIBusId from the initialised driver; the buffer is 64 bytes and its
        // length is passed, the driver writes at most that many bytes including the NUL.
        let res = unsafe { (api.device_get_pci_bus_id)(buf.as_mut_ptr(), 64, dev) };
        api.check("cuDeviceGetPCIBusId", res)?;
        Ok(c_buf_text(&buf))
    }

    pub(super) fn pci_address(api: &Api, dev: CuDevice) -> Result<PciAddress> {
        let text = pci_bus_id(api, dev)?;
        text.parse::<PciAddress>()
            .map_err(|_| Error::InvalidPciAddress { input: text })
    }

    pub(super) fn name(api: &Api, dev: CuDevice) -> Result<String> {
        let mut buf: [c_char; 256] = [0; 256];
        // SAFETY: cuDeviceGetName from the initialised driver; the buffer is 256 bytes and its
        // length is passed.
        let res = unsafe { (api.device_get_name)(buf.as_mut_ptr(), 256, dev) };
        api.check("cuDeviceGetName", res)?;
        Ok(c_buf_text(&buf))
    }

    /// Whether `want` is the device's UUID as either entry point reports it: under MIG,
    /// `cuDeviceGetUuid_v2` gives the MIG instance's UUID and `cuDeviceGetUuid` the physical
    /// GPU's, and users may name either.
    pub(super) fn uuid_matches(api: &Api, dev: CuDevice, want: &[u8; 16]) -> Result<bool> {
        let getters = [
            ("cuDeviceGetUuid_v2", api.device_get_uuid_v2),
            ("cuDeviceGetUuid", api.device_get_uuid),
        ];
        if getters.iter().all(|(_, getter)| getter.is_none()) {
            return Err(Error::CudaUnavailable {
                reason: "libcuda exports neither cuDeviceGetUuid_v2 nor cuDeviceGetUuid",
            });
        }
        for (call, getter) in getters {
            let Some(getter) = getter else { continue };
            let mut uuid = CuUuid { bytes: [0; 16] };
            // SAFETY: the entry point was resolved from the initialised driver with the
            // prototype `CUresult (CUuuid *, CUdevice)`; `uuid` is a valid out-pointer to a
            // 16-byte `#[repr(C)]` struct.
            let res = unsafe { getter(&mut uuid, dev) };
            api.check(call, res)?;
            if uuid.bytes == *want {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID` when it is reported and ≥ 0. Drivers before 12.2 do
    /// not know the attribute (INVALID_VALUE): that is `None`, not an error.
    pub(super) fn host_numa_id(api: &Api, dev: CuDevice) -> Option<usize> {
        let mut value: c_int = -1;
        // SAFETY: cuDeviceGetAttribute from the initialised driver; `value` is a valid
        // out-pointer; an attribute the driver does not know is refused, not misread.
        let res = unsafe { (api.device_get_attribute)(&mut value, ATTRIBUTE_HOST_NUMA_ID, dev) };
        if res == SUCCESS {
            usize::try_from(value).ok()
        } else {
            None
        }
    }
}

/// A CUDA device, found but not opened: what placement needs (no context is created).
#[derive(Clone, Debug)]
pub(crate) struct Device {
    api: &'static Api,
    ordinal: u32,
    dev: CuDevice,
    pci: PciAddress,
    name: String,
    host_numa_id: Option<usize>,
}

/// A CUDA device with its retained primary context, for page-locking.
///
/// Dropping it releases the primary context (the driver destroys the context when the last
/// retain is released) — except in a forked child, where the context is the parent's.
#[derive(Debug)]
pub(crate) struct Gpu {
    device: Device,
    ctx: CuContext,
    /// The process that retained the context: a child forked after [`Gpu::open`] must not use
    /// it (the CUDA driver does not support use across `fork`).
    pid: u32,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver API makes contexts current
// per thread with push/pop, which is all this type does with it); the other fields are plain
// data and function pointers. The handle is never freed while `Gpu` lives (released in Drop only).
unsafe impl Send for Gpu {}
// SAFETY: `&Gpu` only reads plain fields and pushes/pops the context on the calling thread's
// own context stack, which the driver supports from several threads at once.
unsafe impl Sync for Gpu {}

/// Pops the context pushed by [`Gpu::push`] when dropped, restoring the thread's previous one.
/// Not `Send`: it must drop on the thread that pushed.
struct CurrentGuard {
    pop: CtxPopFn,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for CurrentGuard {
    fn drop(&mut self) {
        let mut popped: CuContext = std::ptr::null_mut();
        // SAFETY: a guard exists only after a successful cuCtxPushCurrent_v2 on this thread
        // (the guard is not Send), so the stack has our context on top; `pop` is
        // cuCtxPopCurrent_v2 and `popped` a valid out-pointer. A failure cannot be reported from
        // Drop and leaves nothing to undo.
        let _ = unsafe { (self.pop)(&mut popped) };
    }
}

/// Puts back the thread's stream capture mode saved by [`relaxed_capture`] when dropped.
/// Not `Send`: the mode is per thread.
struct CaptureModeGuard {
    exchange: ExchangeCaptureModeFn,
    previous: c_uint,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for CaptureModeGuard {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: `exchange` is cuThreadExchangeStreamCaptureMode; `mode` holds the value the
        // driver itself handed out on this thread (the guard is not Send) and is a valid
        // in/out-pointer. A failure cannot be reported from Drop.
        let _ = unsafe { (self.exchange)(&mut mode) };
    }
}

/// Sets this thread's stream capture mode to relaxed until the guard drops, so that registering
/// or unregistering memory does not invalidate a CUDA graph another thread is capturing in
/// global mode.
fn relaxed_capture(api: &Api) -> Result<CaptureModeGuard> {
    let mut mode = CAPTURE_MODE_RELAXED;
    // SAFETY: `exchange_capture_mode` is cuThreadExchangeStreamCaptureMode from the initialised
    // driver; `mode` is a valid in/out-pointer (the driver stores the previous mode in it).
    let res = unsafe { (api.exchange_capture_mode)(&mut mode) };
    api.check("cuThreadExchangeStreamCaptureMode", res)?;
    Ok(CaptureModeGuard {
        exchange: api.exchange_capture_mode,
        previous: mode,
        _not_send: std::marker::PhantomData,
    })
}

/// What `cuMemHostUnregister` returning `res` means for the caller: 713
/// (`CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`, e.g. after the program reset the device) says that
/// the registration is already gone, so the range may be unmapped like a successful unregister.
/// `check` maps every other result.
fn unregister_outcome(check: impl FnOnce(CuResult) -> Result<()>, res: CuResult) -> Result<()> {
    if res == HOST_MEMORY_NOT_REGISTERED {
        return Ok(());
    }
    check(res)
}

impl Device {
    /// Finds the device the selector names, without creating a context.
    ///
    /// `Auto` takes the first of `LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `MPI_LOCALRANKID` that parses, modulo the device count, else device 0. `Pci` compares
    /// `cuDeviceGetPCIBusId` as a parsed address (so case and domain width do not matter). `Uuid`
    /// compares the 16 bytes with `cuDeviceGetUuid_v2` and with `cuDeviceGetUuid` (whichever the
    /// driver exports), so that under MIG both the instance's and the GPU's UUID match.
    ///
    /// Errors: [`Error::CudaUnavailable`] without a usable driver or with no visible device,
    /// [`Error::GpuNotFound`] when no device matches, [`Error::Cuda`] when a driver call fails.
    pub(crate) fn find(selector: GpuSelector) -> Result<Device> {
        let api = require_driver()?;
        let count = raw::device_count(api)?;
        if count == 0 {
            return Err(Error::CudaUnavailable {
                reason: "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)",
            });
        }
        let not_found = || Error::GpuNotFound {
            selector: selector_text(&selector),
            device_count: count,
        };
        let ordinal = match selector {
            GpuSelector::Auto => auto_ordinal(|v| std::env::var(v).ok(), count),
            GpuSelector::Ordinal(n) => match usize::try_from(n) {
                Ok(n) if n < count => n,
                _ => return Err(not_found()),
            },
            GpuSelector::Pci(want) => {
                let mut found = None;
                for i in 0..count {
                    let dev = raw::device(api, i)?;
                    if raw::pci_address(api, dev).ok() == Some(want) {
                        found = Some(i);
                        break;
                    }
                }
                found.ok_or_else(not_found)?
            }
            GpuSelector::Uuid(want) => {
                let mut found = None;
                for i in 0..count {
                    let dev = raw::device(api, i)?;
                    if raw::uuid_matches(api, dev, &want)? {
                        found = Some(i);
                        break;
                    }
                }
                found.ok_or_else(not_found)?
            }
        };
        let dev = raw::device(api, ordinal)?;
        let pci = raw::pci_address(api, dev)?;
        let name = raw::name(api, dev)?;
        let host_numa_id = raw::host_numa_id(api, dev);
        Ok(Device {
            api,
            ordinal: u32::try_from(ordinal).unwrap_or(u32::MAX),
            dev,
            pci,
            name,
            host_numa_id,
        })
    }

    /// The CUDA device ordinal (an index among the visible devices).
    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's PCI address.
    pub(crate) fn pci_address(&self) -> PciAddress {
        self.pci
    }

    /// The device's marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub(crate) fn name(&self) -> String {
        self.name.clone()
    }

    /// The GPU's home NUMA node: the driver's host NUMA id, else the `numa_node` of its PCI
    /// device under `sysfs_root`.
    pub(crate) fn home_node(&self, sysfs_root: &std::path::Path) -> Result<Option<usize>> {
        match self.host_numa_id {
            Some(node) => Ok(Some(node)),
            None => crate::pci::home_node(sysfs_root, &self.pci),
        }
    }
}

impl Gpu {
    /// Retains the device's primary context, for registering memory with it.
    pub(crate) fn open(device: Device) -> Result<Gpu> {
        let api = device.api;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: `api` is the initialised driver's (a `Device` exists only then), and
        // `device.dev` is a valid handle from cuDeviceGet; `ctx` is a valid out-pointer.
        // Balanced by the release in Drop.
        let res = unsafe { (api.primary_ctx_retain)(&mut ctx, device.dev) };
        api.check("cuDevicePrimaryCtxRetain", res)?;
        Ok(Gpu {
            device,
            ctx,
            pid: std::process::id(),
        })
    }

    /// Whether this is a child forked after [`Gpu::open`]: the context belongs to the parent.
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Makes the primary context current on this thread until the guard drops.
    fn push(&self) -> Result<CurrentGuard> {
        let api = self.device.api;
        // SAFETY: `api` is the initialised driver's (a Gpu exists only then) and `self.ctx` is a
        // retained primary context, valid until Drop.
        let res = unsafe { (api.ctx_push)(self.ctx) };
        api.check("cuCtxPushCurrent_v2", res)?;
        Ok(CurrentGuard {
            pop: api.ctx_pop,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Page-locks `ptr..ptr+len` with `cuMemHostRegister_v2` (PORTABLE, plus DEVICEMAP and
    /// READ_ONLY when asked). The primary context is pushed current on the calling thread and
    /// the thread's stream capture mode is set to relaxed for the call; both are restored
    /// afterwards, whatever happens.
    ///
    /// In a child forked after [`Gpu::open`] nothing is registered: the error is
    /// [`Error::CudaUnavailable`].
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must be a live mapping owned by the caller, not registered yet, and must
    /// stay mapped until [`Gpu::unregister`] is called with the same `ptr`.
    pub(crate) unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        devicemap: bool,
        read_only: bool,
    ) -> Result<()> {
        if self.forked() {
            return Err(Error::CudaUnavailable {
                reason: FORKED_REASON,
            });
        }
        let mut flags: c_uint = REGISTER_PORTABLE;
        if devicemap {
            flags |= REGISTER_DEVICEMAP;
        }
        if read_only {
            flags |= REGISTER_READ_ONLY;
        }
        let api = self.device.api;
        // Dropped in reverse order: the capture mode is restored, then the context popped.
        let _current = self.push()?;
        let _relaxed = relaxed_capture(api)?;
        // SAFETY: the caller guarantees the range is a live mapping it owns and that is not
        // registered; `mem_host_register` is cuMemHostRegister_v2 and a context is current
        // (pushed above).
        let res = unsafe { (api.mem_host_register)(ptr.as_ptr().cast::<c_void>(), len, flags) };
        api.check("cuMemHostRegister_v2", res)
    }

    /// Unregisters a range registered by [`Gpu::register`], with the primary context current
    /// and the thread's stream capture mode relaxed (both restored afterwards).
    ///
    /// `Ok(())` means the range may be unmapped: the driver released it, or reported
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED` (the registration is already gone, e.g. after the
    /// program reset the device), or this is a child forked after [`Gpu::open`] (the child's
    /// copy of the pages was never registered; the driver is not called).
    ///
    /// # Safety
    ///
    /// `ptr` must be the base pointer passed to a successful [`Gpu::register`] on a `Gpu` of the
    /// same device, not unregistered since, and the range must still be mapped.
    pub(crate) unsafe fn unregister(&self, ptr: NonNull<u8>) -> Result<()> {
        if self.forked() {
            return Ok(());
        }
        let api = self.device.api;
        // Dropped in reverse order: the capture mode is restored, then the context popped.
        let _current = self.push()?;
        let _relaxed = relaxed_capture(api)?;
        // SAFETY: the caller guarantees `ptr` is a registered, still-mapped base pointer;
        // `mem_host_unregister` is cuMemHostUnregister and a context is current.
        let res = unsafe { (api.mem_host_unregister)(ptr.as_ptr().cast::<c_void>()) };
        unregister_outcome(|res| api.check("cuMemHostUnregister", res), res)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.forked() {
            // The retain was the parent's; the child must not touch its context.
            return;
        }
        // SAFETY: `self.device.dev` had its primary context retained in `open` by this process;
        // `primary_ctx_release` is cuDevicePrimaryCtxRelease_v2, and this balances the retain.
        // Errors cannot be reported from Drop.
        let _ = unsafe { (self.device.api.primary_ctx_release)(self.device.dev) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn no_driver_here_and_no_panic() {
        // This machine has no libcuda; on a GPU machine the same calls must simply succeed.
        let present = driver_present();
        assert_eq!(present, cuda_driver_present());
        assert_eq!(present, driver_present(), "decided once");
        if !present {
            match Device::find(GpuSelector::Auto) {
                Err(Error::CudaUnavailable { reason }) => assert!(!reason.is_empty()),
                other => panic!("expected CudaUnavailable, got {other:?}"),
            }
            assert!(matches!(
                Device::find(GpuSelector::Ordinal(0)),
                Err(Error::CudaUnavailable { .. })
            ));
            assert!(matches!(
                Device::find(GpuSelector::Uuid([0; 16])),
                Err(Error::CudaUnavailable { .. })
            ));
        }
    }

    #[test]
    fn open_beyond_device_count_is_not_found() {
        if !driver_present() {
            return;
        }
        match Device::find(GpuSelector::Ordinal(u32::MAX)) {
            Err(Error::GpuNotFound { selector, .. }) => assert_eq!(selector, "4294967295"),
            other => panic!("expected GpuNotFound, got {other:?}"),
        }
    }

    #[test]
    fn error_table() {
        assert_eq!(known_error_name(201), Some("CUDA_ERROR_INVALID_CONTEXT"));
        assert_eq!(known_error_name(2), Some("CUDA_ERROR_OUT_OF_MEMORY"));
        assert_eq!(
            known_error_name(712),
            Some("CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED")
        );
        assert_eq!(known_error_name(800), Some("CUDA_ERROR_NOT_PERMITTED"));
        assert_eq!(known_error_name(12345), None);
        let e = cuda_error("cuMemHostRegister_v2", 712, |_| None);
        assert_eq!(
            e,
            Error::Cuda {
                call: "cuMemHostRegister_v2",
                code: 712,
                name: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            }
        );
        assert_eq!(
            e.to_string(),
            "cuMemHostRegister_v2 failed: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (712)"
        );
        let e = cuda_error("cuInit", 800, |_| Some("IGNORED"));
        assert!(matches!(
            e,
            Error::Cuda {
                code: 800,
                name: "CUDA_ERROR_NOT_PERMITTED",
                ..
            }
        ));
    }

    #[test]
    fn codes_newer_than_the_bindings_are_reported() {
        // CUDA 13 codes that cudarc's 12.8 enum lacks: plain numbers here, never an enum.
        for code in [47, 227, 917, 918, 919, u32::MAX] {
            assert_eq!(
                cuda_error("cuMemHostRegister_v2", code, |_| None),
                Error::Cuda {
                    call: "cuMemHostRegister_v2",
                    code,
                    name: UNNAMED_ERROR,
                }
            );
        }
        let e = cuda_error("cuMemHostUnregister", 917, |code| {
            (code == 917).then_some("CUDA_ERROR_FROM_DRIVER")
        });
        assert!(matches!(
            e,
            Error::Cuda {
                code: 917,
                name: "CUDA_ERROR_FROM_DRIVER",
                ..
            }
        ));
    }

    #[test]
    fn table_agrees_with_the_bindings() {
        use sys::CUresult as R;
        for r in [
            R::CUDA_ERROR_INVALID_VALUE,
            R::CUDA_ERROR_OUT_OF_MEMORY,
            R::CUDA_ERROR_NOT_INITIALIZED,
            R::CUDA_ERROR_NO_DEVICE,
            R::CUDA_ERROR_INVALID_CONTEXT,
            R::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            R::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
            R::CUDA_ERROR_NOT_PERMITTED,
            R::CUDA_ERROR_NOT_SUPPORTED,
            R::CUDA_ERROR_UNKNOWN,
        ] {
            assert_eq!(known_error_name(r as u32), Some(format!("{r:?}").as_str()));
        }
    }

    #[test]
    fn constants_agree_with_the_bindings() {
        // Enum → integer only: the safe direction.
        assert_eq!(SUCCESS, sys::CUresult::CUDA_SUCCESS as u32);
        assert_eq!(
            HOST_MEMORY_NOT_REGISTERED,
            sys::CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED as u32
        );
        assert_eq!(
            ATTRIBUTE_HOST_NUMA_ID,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID as c_uint
        );
        assert_eq!(
            CAPTURE_MODE_RELAXED,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED as c_uint
        );
        assert_eq!(REGISTER_PORTABLE, sys::CU_MEMHOSTREGISTER_PORTABLE);
        assert_eq!(REGISTER_DEVICEMAP, sys::CU_MEMHOSTREGISTER_DEVICEMAP);
        assert_eq!(REGISTER_READ_ONLY, sys::CU_MEMHOSTREGISTER_READ_ONLY);
        assert_eq!(std::mem::size_of::<CuUuid>(), 16);
        assert_eq!(
            std::mem::size_of::<CuUuid>(),
            std::mem::size_of::<sys::CUuuid>()
        );
    }

    #[test]
    fn required_symbols() {
        assert!(REQUIRED_SYMBOLS.contains(&c"cuThreadExchangeStreamCaptureMode"));
        assert!(REQUIRED_SYMBOLS.contains(&c"cuInit"));
        for (i, a) in REQUIRED_SYMBOLS.iter().enumerate() {
            assert!(!REQUIRED_SYMBOLS[i + 1..].contains(a), "{a:?} twice");
        }
        // Optional entry points are not required.
        assert!(!REQUIRED_SYMBOLS.contains(&c"cuDeviceGetUuid_v2"));
        assert!(!REQUIRED_SYMBOLS.contains(&c"cuDeviceGetUuid"));
    }

    #[test]
    fn unregister_713_means_already_gone() {
        let check = |res| {
            if res == SUCCESS {
                Ok(())
            } else {
                Err(cuda_error("cuMemHostUnregister", res, |_| None))
            }
        };
        assert_eq!(unregister_outcome(check, SUCCESS), Ok(()));
        assert_eq!(unregister_outcome(check, 713), Ok(()));
        assert!(matches!(
            unregister_outcome(check, 201),
            Err(Error::Cuda { code: 201, .. })
        ));
        assert!(matches!(
            unregister_outcome(check, 917),
            Err(Error::Cuda { code: 917, .. })
        ));
    }

    /// A driver made of Rust functions, recording calls per thread, to exercise [`Gpu`] without
    /// libcuda.
    mod fake {
        use super::super::*;
        use std::cell::{Cell, RefCell};

        thread_local! {
            /// Calls made on this thread, in order.
            pub(super) static LOG: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
            /// This thread's stream capture mode (GLOBAL = 0 by default).
            pub(super) static MODE: Cell<c_uint> = const { Cell::new(0) };
            /// Context stack depth on this thread.
            pub(super) static DEPTH: Cell<i32> = const { Cell::new(0) };
            /// What cuMemHostRegister_v2 / cuMemHostUnregister return.
            pub(super) static REGISTER_RC: Cell<u32> = const { Cell::new(0) };
            pub(super) static UNREGISTER_RC: Cell<u32> = const { Cell::new(0) };
            /// What cuThreadExchangeStreamCaptureMode returns.
            pub(super) static EXCHANGE_RC: Cell<u32> = const { Cell::new(0) };
        }

        fn log(call: String) {
            LOG.with(|l| l.borrow_mut().push(call));
        }

        pub(super) fn take_log() -> Vec<String> {
            LOG.with(|l| std::mem::take(&mut *l.borrow_mut()))
        }

        extern "C" fn get_error_name(code: u32, text: *mut *const c_char) -> u32 {
            if code != 917 {
                return 1;
            }
            // SAFETY: callers pass a valid out-pointer.
            unsafe { *text = c"CUDA_ERROR_FAKE_917".as_ptr() };
            0
        }
        extern "C" fn count(c: *mut c_int) -> u32 {
            // SAFETY: callers pass a valid out-pointer.
            unsafe { *c = 1 };
            0
        }
        extern "C" fn get(d: *mut CuDevice, ordinal: c_int) -> u32 {
            // SAFETY: callers pass a valid out-pointer.
            unsafe { *d = ordinal };
            0
        }
        extern "C" fn attribute(_: *mut c_int, _: c_uint, _: CuDevice) -> u32 {
            1
        }
        extern "C" fn text(_: *mut c_char, _: c_int, _: CuDevice) -> u32 {
            0
        }
        extern "C" fn uuid_v2(u: *mut CuUuid, _: CuDevice) -> u32 {
            // SAFETY: callers pass a valid out-pointer.
            unsafe { (*u).bytes = [0xab; 16] };
            0
        }
        extern "C" fn uuid_v1(u: *mut CuUuid, _: CuDevice) -> u32 {
            // SAFETY: callers pass a valid out-pointer.
            unsafe { (*u).bytes = [0xcd; 16] };
            0
        }
        extern "C" fn retain(c: *mut CuContext, _: CuDevice) -> u32 {
            log("retain".into());
            // SAFETY: callers pass a valid out-pointer.
            unsafe { *c = 0x1234 as CuContext };
            0
        }
        extern "C" fn release(_: CuDevice) -> u32 {
            log("release".into());
            0
        }
        extern "C" fn push(_: CuContext) -> u32 {
            DEPTH.with(|d| d.set(d.get() + 1));
            log("push".into());
            0
        }
        extern "C" fn pop(_: *mut CuContext) -> u32 {
            DEPTH.with(|d| d.set(d.get() - 1));
            log("pop".into());
            0
        }
        extern "C" fn register(_: *mut c_void, _: usize, flags: c_uint) -> u32 {
            let (depth, mode) = (DEPTH.with(Cell::get), MODE.with(Cell::get));
            log(format!("register flags={flags} depth={depth} mode={mode}"));
            REGISTER_RC.with(Cell::get)
        }
        extern "C" fn unregister(_: *mut c_void) -> u32 {
            let (depth, mode) = (DEPTH.with(Cell::get), MODE.with(Cell::get));
            log(format!("unregister depth={depth} mode={mode}"));
            UNREGISTER_RC.with(Cell::get)
        }
        extern "C" fn exchange(mode: *mut c_uint) -> u32 {
            let rc = EXCHANGE_RC.with(Cell::get);
            if rc != 0 {
                return rc;
            }
            // SAFETY: callers pass a valid in/out-pointer.
            let new = unsafe { *mode };
            let old = MODE.with(|m| m.replace(new));
            // SAFETY: as above.
            unsafe { *mode = old };
            log(format!("exchange {old}->{new}"));
            0
        }

        /// The fake driver, with or without each UUID entry point.
        const fn make(uuid_v2_present: bool, uuid_v1_present: bool) -> Api {
            Api {
                get_error_name,
                device_get_count: count,
                device_get: get,
                device_get_attribute: attribute,
                device_get_name: text,
                device_get_pci_bus_id: text,
                device_get_uuid_v2: if uuid_v2_present {
                    Some(uuid_v2 as DeviceGetUuidFn)
                } else {
                    None
                },
                device_get_uuid: if uuid_v1_present {
                    Some(uuid_v1 as DeviceGetUuidFn)
                } else {
                    None
                },
                primary_ctx_retain: retain,
                primary_ctx_release: release,
                ctx_push: push,
                ctx_pop: pop,
                mem_host_register: register,
                mem_host_unregister: unregister,
                exchange_capture_mode: exchange,
            }
        }

        static APIS: [Api; 4] = [
            make(false, false),
            make(false, true),
            make(true, false),
            make(true, true),
        ];

        pub(super) fn api(uuid_v2_present: bool, uuid_v1_present: bool) -> &'static Api {
            &APIS[usize::from(uuid_v2_present) * 2 + usize::from(uuid_v1_present)]
        }

        pub(super) fn gpu() -> Gpu {
            let device = Device {
                api: api(true, true),
                ordinal: 0,
                dev: 0,
                pci: PciAddress {
                    domain: 0,
                    bus: 0x1b,
                    device: 0,
                    function: 0,
                },
                name: "Fake".into(),
                host_numa_id: None,
            };
            match Gpu::open(device) {
                Ok(gpu) => gpu,
                Err(e) => panic!("fake open failed: {e}"),
            }
        }
    }

    fn block() -> (Vec<u8>, NonNull<u8>) {
        let mut buf = vec![0u8; 4096];
        let ptr = NonNull::new(buf.as_mut_ptr()).expect("vec pointer");
        (buf, ptr)
    }

    #[test]
    fn register_relaxes_capture_and_restores_everything() {
        fake::MODE.with(|m| m.set(1)); // the thread was in THREAD_LOCAL mode
        let gpu = fake::gpu();
        let (_buf, ptr) = block();
        // SAFETY: the fake driver does not touch the memory.
        assert_eq!(unsafe { gpu.register(ptr, 4096, true, true) }, Ok(()));
        // SAFETY: as above.
        assert_eq!(unsafe { gpu.unregister(ptr) }, Ok(()));
        drop(gpu);
        assert_eq!(
            fake::take_log(),
            [
                "retain",
                "push",
                "exchange 1->2",
                "register flags=11 depth=1 mode=2",
                "exchange 2->1",
                "pop",
                "push",
                "exchange 1->2",
                "unregister depth=1 mode=2",
                "exchange 2->1",
                "pop",
                "release",
            ]
        );
        assert_eq!(fake::MODE.with(std::cell::Cell::get), 1);
        assert_eq!(fake::DEPTH.with(std::cell::Cell::get), 0);
    }

    #[test]
    fn failures_restore_and_name_unknown_codes() {
        let gpu = fake::gpu();
        let (_buf, ptr) = block();
        fake::take_log();
        fake::REGISTER_RC.with(|c| c.set(917));
        assert_eq!(
            // SAFETY: the fake driver does not touch the memory.
            unsafe { gpu.register(ptr, 4096, false, false) },
            Err(Error::Cuda {
                call: "cuMemHostRegister_v2",
                code: 917,
                name: "CUDA_ERROR_FAKE_917",
            })
        );
        fake::REGISTER_RC.with(|c| c.set(919));
        assert_eq!(
            // SAFETY: as above.
            unsafe { gpu.register(ptr, 4096, false, false) },
            Err(Error::Cuda {
                call: "cuMemHostRegister_v2",
                code: 919,
                name: UNNAMED_ERROR,
            })
        );
        assert_eq!(fake::MODE.with(std::cell::Cell::get), 0);
        assert_eq!(fake::DEPTH.with(std::cell::Cell::get), 0);
        // 713: the registration is already gone; the block may be unmapped.
        fake::UNREGISTER_RC.with(|c| c.set(713));
        // SAFETY: as above.
        assert_eq!(unsafe { gpu.unregister(ptr) }, Ok(()));
        fake::UNREGISTER_RC.with(|c| c.set(201));
        assert!(matches!(
            // SAFETY: as above.
            unsafe { gpu.unregister(ptr) },
            Err(Error::Cuda { code: 201, .. })
        ));
        // The capture mode cannot be relaxed: nothing is registered, the context is popped.
        fake::EXCHANGE_RC.with(|c| c.set(3));
        fake::take_log();
        assert!(matches!(
            // SAFETY: as above.
            unsafe { gpu.register(ptr, 4096, false, false) },
            Err(Error::Cuda {
                call: "cuThreadExchangeStreamCaptureMode",
                code: 3,
                ..
            })
        ));
        assert_eq!(fake::take_log(), ["push", "pop"]);
        assert_eq!(fake::DEPTH.with(std::cell::Cell::get), 0);
    }

    #[test]
    fn forked_child_leaves_the_driver_alone() {
        let mut gpu = fake::gpu();
        let (_buf, ptr) = block();
        fake::take_log();
        // As if this process were a child forked after `open`.
        gpu.pid = gpu.pid.wrapping_add(1);
        assert_eq!(
            // SAFETY: the fake driver does not touch the memory.
            unsafe { gpu.register(ptr, 4096, false, false) },
            Err(Error::CudaUnavailable {
                reason: FORKED_REASON
            })
        );
        // SAFETY: as above.
        assert_eq!(unsafe { gpu.unregister(ptr) }, Ok(()));
        drop(gpu);
        assert!(fake::take_log().is_empty(), "no driver call in the child");
    }

    #[test]
    fn uuid_matches_either_entry_point() {
        let both = fake::api(true, true);
        assert_eq!(raw::uuid_matches(both, 0, &[0xab; 16]), Ok(true));
        assert_eq!(raw::uuid_matches(both, 0, &[0xcd; 16]), Ok(true));
        assert_eq!(raw::uuid_matches(both, 0, &[0x00; 16]), Ok(false));
        let v2 = fake::api(true, false);
        assert_eq!(raw::uuid_matches(v2, 0, &[0xab; 16]), Ok(true));
        assert_eq!(raw::uuid_matches(v2, 0, &[0xcd; 16]), Ok(false));
        let v1 = fake::api(false, true);
        assert_eq!(raw::uuid_matches(v1, 0, &[0xcd; 16]), Ok(true));
        assert_eq!(raw::uuid_matches(v1, 0, &[0xab; 16]), Ok(false));
        assert!(matches!(
            raw::uuid_matches(fake::api(false, false), 0, &[0xab; 16]),
            Err(Error::CudaUnavailable { .. })
        ));
    }

    #[test]
    fn local_rank_first_that_parses() {
        assert_eq!(local_rank(env(&[])), None);
        assert_eq!(local_rank(env(&[("SLURM_LOCALID", "3")])), Some(3));
        assert_eq!(
            local_rank(env(&[("LOCAL_RANK", "1"), ("SLURM_LOCALID", "3")])),
            Some(1)
        );
        assert_eq!(
            local_rank(env(&[("LOCAL_RANK", "x"), ("MPI_LOCALRANKID", " 5 ")])),
            Some(5)
        );
        assert_eq!(
            local_rank(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "-1")])),
            None
        );
        assert_eq!(auto_ordinal(env(&[("LOCAL_RANK", "5")]), 4), 1);
        assert_eq!(auto_ordinal(env(&[("LOCAL_RANK", "5")]), 0), 0);
        assert_eq!(auto_ordinal(env(&[]), 8), 0);
        assert_eq!(auto_ordinal(env(&[("SLURM_LOCALID", "7")]), 8), 7);
    }

    #[test]
    fn selector_texts() {
        assert_eq!(selector_text(&GpuSelector::Auto), "auto");
        assert_eq!(selector_text(&GpuSelector::Ordinal(3)), "3");
        let mut bytes = [0u8; 16];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8) * 0x11;
        }
        assert_eq!(
            selector_text(&GpuSelector::Uuid(bytes)),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
        assert_eq!(
            c_buf_text(&[b'a' as c_char, b'b' as c_char, 0, b'c' as c_char]),
            "ab"
        );
        assert_eq!(c_buf_text(&[b'a' as c_char]), "a");
    }
}
