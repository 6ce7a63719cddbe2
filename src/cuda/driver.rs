//! Loading libcuda, the C-typed entry-point table [`Api`], and the one way to reach it:
//! [`DriverTable::enter`], which passes the exit gate (`teardown.rs`) first.
//!
//! Every driver call needs a live driver, and libcuda tears itself down at exit while other
//! threads still run. So the table is never handed out bare: the probe's answer is a
//! [`DriverTable`], whose only accessor is [`DriverTable::enter`]; it returns a [`Live`] that
//! holds the gate (the exit handler waits for it) and dereferences to the table for as long as
//! it is held. Anything that borrows the table (a pushed context, a relaxed capture mode) borrows
//! the `Live`, so it is undone before the gate is left. A new call site cannot reach the
//! driver any other way. cudarc's own calls (`event.rs`) are made while a `Live` is held.
//!
//! libcuda is opened here with libloading, not through cudarc's loader: `sys::culib` exists only
//! under cudarc's `dynamic-loading`, and a user's `dynamic-linking` or `static-linking` removes it
//! (when libcuda is linked, opening it again returns the copy already mapped). The library is held
//! in a static and never unloaded, so the resolved pointers and the driver's static strings live
//! for the rest of the process.
//!
//! To call another driver function: add one line to the `driver_table!` list below (its field,
//! C prototype and symbol); the field, its loading and the unit-test fake's default come from
//! there.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use super::cuda_error;
use super::teardown::{self, DriverCall};
use crate::sys::once::ForkOnce;
use crate::{fork, Error, Result};

/// `CUresult` as the raw number the driver returns (any value, known to cudarc's bindings or not).
pub(super) type CuResult = u32;
/// `CUdevice` (`typedef int CUdevice`).
pub(super) type CuDevice = c_int;
/// `CUdeviceptr` (`unsigned long long` on 64-bit hosts).
pub(super) type CuDevicePtr = u64;
/// `CUcontext` (an opaque pointer).
pub(super) type CuContext = *mut c_void;
/// `CUstream` (an opaque pointer).
pub(super) type CuStream = *mut c_void;
/// `CUevent` (an opaque pointer).
pub(super) type CuEvent = *mut c_void;

/// `CUuuid`: `struct { char bytes[16]; }`.
#[repr(C)]
pub(super) struct CuUuid {
    pub(super) bytes: [u8; 16],
}

/// `CUmemGenericAllocationHandle` (`unsigned long long`).
pub(super) type CuMemHandle = u64;
/// `CUmemoryPool` (an opaque pointer).
pub(super) type CuMemPool = *mut c_void;

/// `CUmemLocation`: `{ CUmemLocationType type; int id; }` (CUDA 13.2 makes `id` a union of the
/// same size).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct CuMemLocation {
    pub(super) kind: c_uint,
    pub(super) id: c_int,
}

/// `CUmemAllocationProp`: type, requested handle types, location, Windows metadata pointer, and
/// `allocFlags` (compression type, GPUDirect RDMA capable, usage, 4 reserved bytes), 32 bytes.
#[repr(C)]
pub(super) struct CuMemAllocationProp {
    pub(super) kind: c_uint,
    pub(super) requested_handle_types: c_uint,
    pub(super) location: CuMemLocation,
    pub(super) win32_handle_meta_data: *mut c_void,
    pub(super) alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`: `{ CUmemLocation location; CUmemAccess_flags flags; }`.
#[repr(C)]
pub(super) struct CuMemAccessDesc {
    pub(super) location: CuMemLocation,
    pub(super) flags: c_uint,
}

/// `CUmemPoolProps`: type, handle types, location, Windows security attributes, `maxSize`, then
/// bytes later versions give meaning to (`usage` from 12.6, `gpuDirectRDMACapable` from 13.4),
/// 88 bytes in every version; zero is the default for each.
#[repr(C)]
pub(super) struct CuMemPoolProps {
    pub(super) alloc_type: c_uint,
    pub(super) handle_types: c_uint,
    pub(super) location: CuMemLocation,
    pub(super) win32_security_attributes: *mut c_void,
    pub(super) max_size: usize,
    pub(super) reserved: [u8; 56],
}

/// Declares the entry points: for each, its field, whether the probe requires it (`required`:
/// a plain pointer, the driver counts as absent without it; `optional`: an `Option`), its C
/// prototype's argument types (every entry returns `CUresult`, read as a plain `u32`) and its
/// symbol names, tried in order. Generates [`Api`], [`load_api`] and, for unit tests,
/// `Api::UNSUPPORTED`: a table whose required entries answer `CUDA_ERROR_NOT_SUPPORTED` and whose
/// optional ones are missing, for fakes to start from.
macro_rules! driver_table {
    ($(
        $(#[doc = $doc:literal])*
        $(#[cfg($cfg:meta)])?
        $need:ident $field:ident: fn($($arg:ty),* $(,)?) = $($symbol:literal)|+;
    )*) => {
        /// The driver entry points this crate calls, resolved once by the probe: function
        /// pointers into libcuda, which is never unloaded.
        pub(super) struct Api {
            $(
                $(#[doc = $doc])*
                $(#[cfg($cfg)])?
                pub(super) $field: driver_table!(@type $need ($($arg),*)),
            )*
        }

        /// Resolves every entry point of [`Api`] in `lib`; `None` when a required one is
        /// missing.
        ///
        /// # Safety
        ///
        /// `lib` must be libcuda ([`open_libcuda`] returned it).
        unsafe fn load_api(lib: &'static libloading::Library) -> Option<Api> {
            Some(Api {
                $(
                    $(#[cfg($cfg)])?
                    $field: driver_table!(@load lib, $need $($symbol)|+),
                )*
            })
        }

        #[cfg(test)]
        impl Api {
            /// Every required entry answers `CUDA_ERROR_NOT_SUPPORTED`; optional ones are missing.
            pub(super) const UNSUPPORTED: Api = Api {
                $(
                    $(#[cfg($cfg)])?
                    $field: driver_table!(@fake $need ($($arg),*)),
                )*
            };
        }
    };
    (@type required ($($arg:ty),*)) => { unsafe extern "C" fn($($arg),*) -> CuResult };
    (@type optional ($($arg:ty),*)) => { Option<unsafe extern "C" fn($($arg),*) -> CuResult> };
    (@load $lib:ident, required $($symbol:literal)|+) => {
        driver_table!(@load $lib, optional $($symbol)|+)?
    };
    (@load $lib:ident, optional $first:literal $(| $other:literal)*) => {
        // SAFETY: `$lib` is libcuda (`load_api`'s caller); the pointer type `symbol` is asked
        // for is the field's, declared with the symbol's C prototype in the same entry (checked
        // against cudarc's bindings, with `CUresult` and enums read as plain integers).
        unsafe { symbol($lib, $first) }
        $(.or_else(|| {
            // SAFETY: as above, for the entry's other name.
            unsafe { symbol($lib, $other) }
        }))*
    };
    (@fake required ($($arg:ty),*)) => {{
        unsafe extern "C" fn unsupported($(_: $arg),*) -> CuResult {
            NOT_SUPPORTED
        }
        unsupported
    }};
    (@fake optional ($($arg:ty),*)) => { None };
}

driver_table! {
    /// `CUresult cuInit(unsigned int Flags)`: called once, by the probe.
    required init: fn(c_uint) = c"cuInit";
    /// `CUresult cuGetErrorName(CUresult error, const char **pStr)`.
    required get_error_name: fn(CuResult, *mut *const c_char) = c"cuGetErrorName";
    /// `CUresult cuDeviceGetCount(int *count)`.
    required device_get_count: fn(*mut c_int) = c"cuDeviceGetCount";
    /// `CUresult cuDeviceGet(CUdevice *device, int ordinal)`.
    required device_get: fn(*mut CuDevice, c_int) = c"cuDeviceGet";
    /// `CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`.
    required device_get_attribute: fn(*mut c_int, c_uint, CuDevice) = c"cuDeviceGetAttribute";
    /// `CUresult cuDeviceGetName(char *name, int len, CUdevice dev)`.
    required device_get_name: fn(*mut c_char, c_int, CuDevice) = c"cuDeviceGetName";
    /// `CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)`.
    required device_get_pci_bus_id: fn(*mut c_char, c_int, CuDevice) = c"cuDeviceGetPCIBusId";
    /// `CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)`: the MIG instance's UUID under
    /// MIG.
    optional device_get_uuid_v2: fn(*mut CuUuid, CuDevice) = c"cuDeviceGetUuid_v2";
    /// `CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)`: the physical GPU's UUID.
    optional device_get_uuid: fn(*mut CuUuid, CuDevice) = c"cuDeviceGetUuid";
    /// `CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`.
    required primary_ctx_retain: fn(*mut CuContext, CuDevice) = c"cuDevicePrimaryCtxRetain";
    /// `CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)`.
    required primary_ctx_release: fn(CuDevice) = c"cuDevicePrimaryCtxRelease_v2";
    /// `CUresult cuCtxPushCurrent_v2(CUcontext ctx)`.
    required ctx_push: fn(CuContext) = c"cuCtxPushCurrent_v2";
    /// `CUresult cuCtxPopCurrent_v2(CUcontext *pctx)`.
    required ctx_pop: fn(*mut CuContext) = c"cuCtxPopCurrent_v2";
    /// `CUresult cuCtxGetCurrent(CUcontext *pctx)`.
    required ctx_get_current: fn(*mut CuContext) = c"cuCtxGetCurrent";
    /// `CUresult cuCtxGetDevice(CUdevice *device)`.
    required ctx_get_device: fn(*mut CuDevice) = c"cuCtxGetDevice";
    /// `CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)`.
    required mem_host_register: fn(*mut c_void, usize, c_uint) = c"cuMemHostRegister_v2";
    /// `CUresult cuMemHostUnregister(void *p)`.
    required mem_host_unregister: fn(*mut c_void) = c"cuMemHostUnregister";
    /// `CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)` (the enum is a C
    /// `unsigned int`).
    required exchange_capture_mode: fn(*mut c_uint) = c"cuThreadExchangeStreamCaptureMode";
    /// `CUresult cuEventQuery(CUevent hEvent)`.
    #[cfg(feature = "pinned-buffer")]
    required event_query: fn(CuEvent) = c"cuEventQuery";
    /// `CUresult cuEventSynchronize(CUevent hEvent)`.
    required event_synchronize: fn(CuEvent) = c"cuEventSynchronize";

    // The benchmark tools' (`tools.rs`): optional, so the allocator's probe does not need them.
    /// `CUresult cuCtxSetCurrent(CUcontext ctx)`.
    optional ctx_set_current: fn(CuContext) = c"cuCtxSetCurrent";
    /// `CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`.
    optional mem_alloc: fn(*mut CuDevicePtr, usize) = c"cuMemAlloc_v2";
    /// `CUresult cuMemFree_v2(CUdeviceptr dptr)`.
    optional mem_free: fn(CuDevicePtr) = c"cuMemFree_v2";
    /// `CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)`.
    optional mem_host_alloc: fn(*mut *mut c_void, usize, c_uint) = c"cuMemHostAlloc";
    /// `CUresult cuMemFreeHost(void *p)`.
    optional mem_free_host: fn(*mut c_void) = c"cuMemFreeHost";
    /// `CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)`.
    optional stream_create: fn(*mut CuStream, c_uint) = c"cuStreamCreate";
    /// `CUresult cuStreamDestroy_v2(CUstream hStream)`.
    optional stream_destroy: fn(CuStream) = c"cuStreamDestroy_v2";
    /// `CUresult cuStreamSynchronize(CUstream hStream)`.
    optional stream_synchronize: fn(CuStream) = c"cuStreamSynchronize";
    /// `CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)`.
    optional memcpy_htod_async: fn(CuDevicePtr, *const c_void, usize, CuStream) =
        c"cuMemcpyHtoDAsync_v2";
    /// `CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)`.
    optional memcpy_dtoh_async: fn(*mut c_void, CuDevicePtr, usize, CuStream) =
        c"cuMemcpyDtoHAsync_v2";
    /// `CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)`.
    optional event_create: fn(*mut CuEvent, c_uint) = c"cuEventCreate";
    /// `CUresult cuEventRecord(CUevent hEvent, CUstream hStream)`.
    optional event_record: fn(CuEvent, CuStream) = c"cuEventRecord";
    /// `CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)` (CUDA
    /// 13's header maps the name to `_v2`; drivers export both).
    optional event_elapsed_time: fn(*mut f32, CuEvent, CuEvent) =
        c"cuEventElapsedTime" | c"cuEventElapsedTime_v2";
    /// `CUresult cuEventDestroy_v2(CUevent hEvent)`.
    optional event_destroy: fn(CuEvent) = c"cuEventDestroy_v2";

    // CUDA's own host-NUMA memory, a peer the benchmarks measure (`host_numa.rs`).
    /// `CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp
    /// *prop, CUmemAllocationGranularity_flags option)`.
    optional mem_get_allocation_granularity: fn(*mut usize, *const CuMemAllocationProp, c_uint) =
        c"cuMemGetAllocationGranularity";
    /// `CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const
    /// CUmemAllocationProp *prop, unsigned long long flags)`.
    optional mem_create: fn(*mut CuMemHandle, usize, *const CuMemAllocationProp, u64) =
        c"cuMemCreate";
    /// `CUresult cuMemRelease(CUmemGenericAllocationHandle handle)`.
    optional mem_release: fn(CuMemHandle) = c"cuMemRelease";
    /// `CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
    /// CUdeviceptr addr, unsigned long long flags)`.
    optional mem_address_reserve: fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, u64) =
        c"cuMemAddressReserve";
    /// `CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)`.
    optional mem_address_free: fn(CuDevicePtr, usize) = c"cuMemAddressFree";
    /// `CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
    /// CUmemGenericAllocationHandle handle, unsigned long long flags)`.
    optional mem_map: fn(CuDevicePtr, usize, usize, CuMemHandle, u64) = c"cuMemMap";
    /// `CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)`.
    optional mem_unmap: fn(CuDevicePtr, usize) = c"cuMemUnmap";
    /// `CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
    /// size_t count)`.
    optional mem_set_access: fn(CuDevicePtr, usize, *const CuMemAccessDesc, usize) =
        c"cuMemSetAccess";
    /// `CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)`.
    optional mem_pool_create: fn(*mut CuMemPool, *const CuMemPoolProps) = c"cuMemPoolCreate";
    /// `CUresult cuMemPoolDestroy(CUmemoryPool pool)`.
    optional mem_pool_destroy: fn(CuMemPool) = c"cuMemPoolDestroy";
    /// `CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void
    /// *value)`.
    optional mem_pool_set_attribute: fn(CuMemPool, c_uint, *mut c_void) =
        c"cuMemPoolSetAttribute";
    /// `CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t
    /// count)`: a host-NUMA pool is reachable from the host only until the device is given
    /// access.
    optional mem_pool_set_access: fn(CuMemPool, *const CuMemAccessDesc, usize) =
        c"cuMemPoolSetAccess";
    /// `CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
    /// CUstream hStream)`.
    optional mem_alloc_from_pool_async: fn(*mut CuDevicePtr, usize, CuMemPool, CuStream) =
        c"cuMemAllocFromPoolAsync";
    /// `CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)`.
    optional mem_free_async: fn(CuDevicePtr, CuStream) = c"cuMemFreeAsync";
}

/// `CUDA_SUCCESS`.
pub(super) const SUCCESS: CuResult = 0;
/// `CUDA_ERROR_NOT_READY`: `cuEventQuery`'s answer while the recorded work is still running.
#[cfg(feature = "pinned-buffer")]
pub(super) const NOT_READY: CuResult = 600;
/// `CUDA_ERROR_NOT_SUPPORTED`: what the unit tests' default entries answer.
#[cfg(test)]
const NOT_SUPPORTED: CuResult = 801;
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

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api")
            .field("uuid_v2", &self.device_get_uuid_v2.is_some())
            .field("uuid_v1", &self.device_get_uuid.is_some())
            .finish_non_exhaustive()
    }
}

/// The driver's entry points, reachable only through the exit gate ([`Self::enter`]).
#[derive(Debug)]
pub(super) struct DriverTable(Api);

impl DriverTable {
    /// The table for the unit tests' fake drivers.
    #[cfg(test)]
    pub(super) const fn new(api: Api) -> DriverTable {
        DriverTable(api)
    }

    /// Enters the exit gate and gives the table for as long as the result is held: the one way
    /// to call the driver. Once the process is exiting the answer is [`Error::CudaUnavailable`]
    /// with [`super::EXITING_REASON`], and the driver is not called.
    pub(super) fn enter(&self) -> Result<Live<'_>> {
        Ok(Live {
            api: &self.0,
            _call: DriverCall::enter()?,
            _not_send: std::marker::PhantomData,
        })
    }
}

/// The driver table while the exit gate is held: the exit handler waits for it to drop before
/// the driver's teardown may begin. Not `Send`: dropped on the thread that entered.
pub(super) struct Live<'a> {
    api: &'a Api,
    _call: DriverCall,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl std::ops::Deref for Live<'_> {
    type Target = Api;

    fn deref(&self) -> &Api {
        self.api
    }
}

/// What the one-time driver probe found: the entry points when libcuda loaded, exports what this
/// module needs, and `cuInit(0)` succeeded; else why not.
/// The error is [`Error::CudaUnavailable`] when libcuda is missing or too old, and
/// [`Error::Cuda`] with `cuInit`'s code when it failed.
pub(super) type DriverState = std::result::Result<DriverTable, Error>;

/// Why a child forked while its parent was probing the driver does not use it.
const FORKED_DURING_PROBE: &str = "the process forked while CUDA was being initialised";

/// What a child forked during the probe gets: the parent's probe never finishes there.
static ABANDONED: DriverState = Err(Error::CudaUnavailable {
    reason: FORKED_DURING_PROBE,
});

/// The probe's answer, computed on the first call. Not a `OnceLock`: a child forked while another
/// thread of the parent probes (loading libcuda takes hundreds of milliseconds) would wait for it
/// forever; it gets [`ABANDONED`] instead.
pub(super) fn driver_state() -> &'static DriverState {
    static STATE: ForkOnce<DriverState> = ForkOnce::new();
    STATE
        .get_or_init(fork::generation(), probe_driver)
        .unwrap_or(&ABANDONED)
}

/// Looks up `name` in `lib` as a function pointer of type `F`.
///
/// # Safety
///
/// `F` must be an `unsafe extern "C" fn` type matching the C prototype of the symbol `name`.
unsafe fn symbol<F: Copy>(lib: &'static libloading::Library, name: &CStr) -> Option<F> {
    // SAFETY: the caller guarantees that `F` is the symbol's function pointer type; the pointer
    // is copied out of the `Symbol` and stays valid because the library is never unloaded.
    unsafe { lib.get::<F>(name) }.ok().map(|sym| *sym)
}

/// Opens libcuda: `libcuda.so` first (as cudarc does, so `LD_LIBRARY_PATH` can point at the
/// simulator), then the driver's soname. The handle is leaked: never unloaded, so resolved
/// pointers and the driver's static strings live for the rest of the process.
fn open_libcuda() -> Option<&'static libloading::Library> {
    let lib = ["libcuda.so", "libcuda.so.1"]
        .into_iter()
        .find_map(|name| {
            // SAFETY: loading libcuda runs its initialisers, which take no arguments; the handle
            // is kept for the life of the process.
            unsafe { libloading::Library::new(name) }.ok()
        })?;
    Some(Box::leak(Box::new(lib)))
}

/// Registers the exit handler that closes the gate, loads libcuda, resolves the entry points,
/// calls `cuInit(0)` through the gate and registers the handler again; never panics.
///
/// The first registration comes before libcuda is loaded. Loaded, libcuda's teardown is due at
/// exit (its destructor runs in the loader's exit handler, which the C runtime registered before
/// `main`); a handler registered only after `cuInit` could come too late: a process that begins
/// to exit in between — the thread probing preempted, or the first allocations racing an early
/// `exit` — runs a handler registered during its exit only after the handler already running,
/// the loader's, which tears the driver down. Registered first, the handler runs before the
/// loader's and closes the gate, and `cuInit` is refused. The second registration, after
/// `cuInit`, runs before whatever teardown the driver registered there.
pub(super) fn probe_driver() -> DriverState {
    const TOO_OLD: Error = Error::CudaUnavailable {
        reason: "libcuda lacks a required driver function (the driver is too old)",
    };
    teardown::close_at_exit()?;
    let lib = open_libcuda().ok_or(Error::CudaUnavailable {
        reason: "libcuda.so could not be loaded (no NVIDIA driver on this machine)",
    })?;
    // SAFETY: `lib` is libcuda.
    let table = DriverTable(unsafe { load_api(lib) }.ok_or(TOO_OLD)?);
    {
        let api = table.enter()?;
        // SAFETY: cuInit is resolved from the loaded libcuda and takes flags 0.
        let res = unsafe { (api.init)(0) };
        api.check("cuInit", res)?;
    }
    teardown::close_at_exit()?;
    Ok(table)
}

/// Whether libcuda loads, exports what this crate needs, and `cuInit` succeeds. Decided once
/// (the first call probes; later calls read the answer); never panics.
pub(crate) fn driver_present() -> bool {
    driver_state().is_ok()
}

/// The driver's entry points (to [`DriverTable::enter`]) when it is usable, else the probe's
/// error.
pub(super) fn require_driver() -> Result<&'static DriverTable> {
    // Cloning the error does not allocate: its variants hold numbers and static strings.
    driver_state().as_ref().map_err(Error::clone)
}

/// An optional entry's pointer, or the error that libcuda does not export it.
pub(super) fn exported<F>(entry: Option<F>) -> Result<F> {
    entry.ok_or(Error::CudaUnavailable {
        reason: "libcuda lacks a driver function this call needs",
    })
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
        // inside libcuda; the library is never unloaded (`open_libcuda` leaks it), so the
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
