//! Loading libcuda and the C-typed entry-point table [`Api`].
//!
//! libcuda is opened here with libloading, not through cudarc's loader: `sys::culib` exists only
//! under cudarc's `dynamic-loading`, and a user's `dynamic-linking` or `static-linking` removes it
//! (when libcuda is linked, opening it again returns the copy already mapped). To call another
//! driver function: add its prototype as a type alias below, a field to [`Api`], its symbol to
//! [`load_api`] (and to [`REQUIRED_SYMBOLS`] unless it is optional), and an entry to the fake
//! driver in `tests.rs`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use super::cuda_error;
use crate::{Error, Result};

/// Driver functions that must be exported by libcuda for the driver to count as present.
/// `cuInit` is called once by the probe; the others are kept in [`Api`].
pub(super) const REQUIRED_SYMBOLS: &[&CStr] = &[
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
    c"cuEventQuery",
    c"cuEventSynchronize",
];

/// `CUresult` as the raw number the driver returns (any value, known to cudarc's bindings or not).
pub(super) type CuResult = u32;
/// `CUdevice` (`typedef int CUdevice`).
pub(super) type CuDevice = c_int;
/// `CUcontext` (an opaque pointer).
pub(super) type CuContext = *mut c_void;

/// `CUuuid`: `struct { char bytes[16]; }`.
#[repr(C)]
pub(super) struct CuUuid {
    pub(super) bytes: [u8; 16],
}

/// `CUresult cuInit(unsigned int Flags)`.
pub(super) type InitFn = unsafe extern "C" fn(c_uint) -> CuResult;
/// `CUresult cuGetErrorName(CUresult error, const char **pStr)`.
pub(super) type GetErrorNameFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
/// `CUresult cuDeviceGetCount(int *count)`.
pub(super) type DeviceGetCountFn = unsafe extern "C" fn(*mut c_int) -> CuResult;
/// `CUresult cuDeviceGet(CUdevice *device, int ordinal)`.
pub(super) type DeviceGetFn = unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult;
/// `CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`.
pub(super) type DeviceGetAttributeFn =
    unsafe extern "C" fn(*mut c_int, c_uint, CuDevice) -> CuResult;
/// `CUresult cuDeviceGetName(char *name, int len, CUdevice dev)`, and the same prototype for
/// `cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)`.
pub(super) type DeviceGetTextFn = unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult;
/// `CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)`, and `cuDeviceGetUuid_v2`.
pub(super) type DeviceGetUuidFn = unsafe extern "C" fn(*mut CuUuid, CuDevice) -> CuResult;
/// `CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`.
pub(super) type PrimaryCtxRetainFn = unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult;
/// `CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)`.
pub(super) type PrimaryCtxReleaseFn = unsafe extern "C" fn(CuDevice) -> CuResult;
/// `CUresult cuCtxPushCurrent_v2(CUcontext ctx)`.
pub(super) type CtxPushFn = unsafe extern "C" fn(CuContext) -> CuResult;
/// `CUresult cuCtxPopCurrent_v2(CUcontext *pctx)`.
pub(super) type CtxPopFn = unsafe extern "C" fn(*mut CuContext) -> CuResult;
/// `CUresult cuCtxGetCurrent(CUcontext *pctx)`.
pub(super) type CtxGetCurrentFn = unsafe extern "C" fn(*mut CuContext) -> CuResult;
/// `CUresult cuCtxGetDevice(CUdevice *device)`.
pub(super) type CtxGetDeviceFn = unsafe extern "C" fn(*mut CuDevice) -> CuResult;
/// `CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)`.
pub(super) type MemHostRegisterFn = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult;
/// `CUresult cuMemHostUnregister(void *p)`.
pub(super) type MemHostUnregisterFn = unsafe extern "C" fn(*mut c_void) -> CuResult;
/// `CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)` (the enum is a C
/// `unsigned int`).
pub(super) type ExchangeCaptureModeFn = unsafe extern "C" fn(*mut c_uint) -> CuResult;

/// `CUresult cuEventQuery(CUevent hEvent)`, and the same prototype for
/// `cuEventSynchronize(CUevent hEvent)` (`CUevent` is an opaque pointer).
pub(super) type EventFn = unsafe extern "C" fn(*mut c_void) -> CuResult;

/// `CUDA_SUCCESS`.
pub(super) const SUCCESS: CuResult = 0;
#[cfg(feature = "pinned-buffer")]
/// `CUDA_ERROR_NOT_READY`: `cuEventQuery`'s answer while the recorded work is still running.
pub(super) const NOT_READY: CuResult = 600;
/// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
pub(super) const HOST_MEMORY_NOT_REGISTERED: CuResult = 713;
/// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`.
pub(super) const ATTRIBUTE_HOST_NUMA_ID: c_uint = 134;
/// `CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED`.
pub(super) const ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: c_uint = 113;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`: this thread's driver calls do not invalidate a capture in
/// progress on another thread.
pub(super) const CAPTURE_MODE_RELAXED: c_uint = 2;
/// `CU_MEMHOSTREGISTER_PORTABLE`.
pub(super) const REGISTER_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTREGISTER_DEVICEMAP`.
pub(super) const REGISTER_DEVICEMAP: c_uint = 2;
/// `CU_MEMHOSTREGISTER_READ_ONLY`.
pub(super) const REGISTER_READ_ONLY: c_uint = 8;

/// The driver entry points this module calls, resolved once by the probe. Function pointers
/// into libcuda, which cudarc keeps loaded for the life of the process.
#[derive(Clone, Copy)]
pub(super) struct Api {
    /// `cuGetErrorName`.
    pub(super) get_error_name: GetErrorNameFn,
    /// `cuDeviceGetCount`.
    pub(super) device_get_count: DeviceGetCountFn,
    /// `cuDeviceGet`.
    pub(super) device_get: DeviceGetFn,
    /// `cuDeviceGetAttribute`.
    pub(super) device_get_attribute: DeviceGetAttributeFn,
    /// `cuDeviceGetName`.
    pub(super) device_get_name: DeviceGetTextFn,
    /// `cuDeviceGetPCIBusId`.
    pub(super) device_get_pci_bus_id: DeviceGetTextFn,
    /// `cuDeviceGetUuid_v2` (the MIG instance's UUID under MIG), when exported.
    pub(super) device_get_uuid_v2: Option<DeviceGetUuidFn>,
    /// `cuDeviceGetUuid` (the physical GPU's UUID), when exported.
    pub(super) device_get_uuid: Option<DeviceGetUuidFn>,
    /// `cuDevicePrimaryCtxRetain`.
    pub(super) primary_ctx_retain: PrimaryCtxRetainFn,
    /// `cuDevicePrimaryCtxRelease_v2`.
    pub(super) primary_ctx_release: PrimaryCtxReleaseFn,
    /// `cuCtxPushCurrent_v2`.
    pub(super) ctx_push: CtxPushFn,
    /// `cuCtxPopCurrent_v2`.
    pub(super) ctx_pop: CtxPopFn,
    /// `cuCtxGetCurrent`.
    pub(super) ctx_get_current: CtxGetCurrentFn,
    /// `cuCtxGetDevice`.
    pub(super) ctx_get_device: CtxGetDeviceFn,
    /// `cuMemHostRegister_v2`.
    pub(super) mem_host_register: MemHostRegisterFn,
    /// `cuMemHostUnregister`.
    pub(super) mem_host_unregister: MemHostUnregisterFn,
    /// `cuThreadExchangeStreamCaptureMode`.
    pub(super) exchange_capture_mode: ExchangeCaptureModeFn,
    /// `cuEventQuery`.
    pub(super) event_query: EventFn,
    /// `cuEventSynchronize`.
    pub(super) event_synchronize: EventFn,
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
/// The error is [`Error::CudaUnavailable`] when libcuda is missing or too old, and
/// [`Error::Cuda`] with `cuInit`'s code when it failed.
pub(super) type DriverState = std::result::Result<Api, Error>;

/// The probe's answer, computed on the first call.
pub(super) fn driver_state() -> &'static DriverState {
    static STATE: OnceLock<DriverState> = OnceLock::new();
    STATE.get_or_init(probe_driver)
}

/// Looks up `name` in libcuda as a function pointer of type `F`.
///
/// # Safety
///
/// `F` must be an `unsafe extern "C" fn` type matching the C prototype of the symbol `name`.
pub(super) unsafe fn symbol<F: Copy>(name: &CStr) -> Option<F> {
    // SAFETY: the caller guarantees that `F` is the symbol's function pointer type; the pointer
    // is copied out of the `Symbol` and stays valid because the library is held in a static and
    // never unloaded.
    unsafe { libcuda()?.get::<F>(name) }.ok().map(|sym| *sym)
}

/// libcuda, opened once: `libcuda.so` first (as cudarc does, so `LD_LIBRARY_PATH` can point at
/// the simulator), then the driver's soname.
fn libcuda() -> Option<&'static libloading::Library> {
    static LIB: OnceLock<Option<libloading::Library>> = OnceLock::new();
    LIB.get_or_init(|| {
        ["libcuda.so", "libcuda.so.1"].into_iter().find_map(|name| {
            // SAFETY: loading libcuda runs its initialisers, which take no arguments; the
            // handle is kept for the life of the process.
            unsafe { libloading::Library::new(name) }.ok()
        })
    })
    .as_ref()
}

/// Resolves every entry point of [`Api`]; `None` when a required one is missing.
///
/// # Safety
///
/// libcuda must be loaded ([`libcuda`] returned it).
pub(super) unsafe fn load_api() -> Option<Api> {
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
            ctx_get_current: symbol::<CtxGetCurrentFn>(c"cuCtxGetCurrent")?,
            ctx_get_device: symbol::<CtxGetDeviceFn>(c"cuCtxGetDevice")?,
            mem_host_register: symbol::<MemHostRegisterFn>(c"cuMemHostRegister_v2")?,
            mem_host_unregister: symbol::<MemHostUnregisterFn>(c"cuMemHostUnregister")?,
            exchange_capture_mode: symbol::<ExchangeCaptureModeFn>(
                c"cuThreadExchangeStreamCaptureMode",
            )?,
            event_query: symbol::<EventFn>(c"cuEventQuery")?,
            event_synchronize: symbol::<EventFn>(c"cuEventSynchronize")?,
        })
    }
}

/// Loads libcuda, resolves the entry points and calls `cuInit(0)`; never panics.
pub(super) fn probe_driver() -> DriverState {
    const TOO_OLD: Error = Error::CudaUnavailable {
        reason: "libcuda lacks a required driver function (the driver is too old)",
    };
    if libcuda().is_none() {
        return Err(Error::CudaUnavailable {
            reason: "libcuda.so could not be loaded (no NVIDIA driver on this machine)",
        });
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
    api.check("cuInit", res)?;
    Ok(api)
}

/// Whether libcuda loads, exports what this crate needs, and `cuInit` succeeds. Decided once
/// (the first call probes; later calls read the answer); never panics.
pub(crate) fn driver_present() -> bool {
    driver_state().is_ok()
}

/// The driver's entry points when it is usable, else the probe's error.
pub(super) fn require_driver() -> Result<&'static Api> {
    // Cloning the error does not allocate: its variants hold numbers and static strings.
    driver_state().as_ref().map_err(Error::clone)
}

impl Api {
    /// The driver's name for `code` (`cuGetErrorName`), when it has one. Its strings are static
    /// in libcuda, which is never unloaded.
    pub(super) fn error_name(&self, code: CuResult) -> Option<&'static str> {
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
    pub(super) fn check(&self, call: &'static str, res: CuResult) -> Result<()> {
        if res == SUCCESS {
            Ok(())
        } else {
            Err(cuda_error(call, res, |code| self.error_name(code)))
        }
    }
}
