//! The only module that talks to the CUDA driver (through cudarc's raw `sys` bindings).
//!
//! Everything here is written for the allocator's large path: nothing panics, nothing calls into
//! libcuda before [`driver_present`] has confirmed that the library loads, that every driver
//! function this module uses is exported, and that `cuInit` succeeds. cudarc's `sys` functions
//! panic when libcuda or one of their symbols is missing, which is why that check comes first and
//! is made once.
//!
//! Allocation: cudarc allocates when it loads libcuda and on the first call of each function, and
//! the checks below allocate too. Callers inside the allocator run this code under the allocator's
//! re-entrancy flag, so those allocations go to the system allocator.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr::NonNull;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::config::GpuSelector;
use crate::pci::PciAddress;
use crate::{Error, Result};

/// Driver functions that must be exported by libcuda before any of them is called. cudarc's
/// `sys` wrappers panic on a missing symbol, so their presence is checked up front.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceGetPCIBusId",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
];

/// Environment variables that launchers set to the process's rank on its node, in the order
/// they are consulted by [`GpuSelector::Auto`].
pub(crate) const LOCAL_RANK_VARS: [&str; 4] = [
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
];

/// What the one-time driver probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DriverState {
    /// `Ok` when libcuda loaded, exports what this module needs, and `cuInit(0)` succeeded.
    status: std::result::Result<(), &'static str>,
    /// Whether `cuDeviceGetUuid_v2` is exported (else `cuDeviceGetUuid` is, or UUIDs are unknown).
    uuid_v2: bool,
    /// Whether `cuDeviceGetUuid` is exported.
    uuid_v1: bool,
}

fn driver_state() -> &'static DriverState {
    static STATE: OnceLock<DriverState> = OnceLock::new();
    STATE.get_or_init(probe_driver)
}

fn probe_driver() -> DriverState {
    let absent = |reason| DriverState {
        status: Err(reason),
        uuid_v2: false,
        uuid_v1: false,
    };
    // SAFETY: `is_culib_present` only tries to open the library by its candidate names with
    // libloading (running libcuda's initialisers, which is what loading it means); it does not
    // panic when none is found.
    if !unsafe { sys::is_culib_present() } {
        return absent("libcuda.so could not be loaded (no NVIDIA driver on this machine)");
    }
    // SAFETY: `is_culib_present` just opened one of the candidate names, and `culib` opens the
    // first candidate that loads, so it does not reach its panic. The returned library stays
    // loaded for the life of the process (it lives in a static).
    let lib = unsafe { sys::culib() };
    let has = |name: &str| {
        // SAFETY: the symbol is only looked up, never called through this type; the function
        // pointer type is irrelevant to `dlsym`.
        unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok()
    };
    if !REQUIRED_SYMBOLS.iter().all(|name| has(name)) {
        return absent("libcuda lacks a required driver function (the driver is too old)");
    }
    let uuid_v2 = has("cuDeviceGetUuid_v2");
    let uuid_v1 = has("cuDeviceGetUuid");
    // SAFETY: libcuda is loaded and exports cuInit (checked above); cuInit takes flags 0.
    let res = unsafe { sys::cuInit(0) };
    if res != sys::CUresult::CUDA_SUCCESS {
        return absent(cuinit_reason(res as u32));
    }
    DriverState {
        status: Ok(()),
        uuid_v2,
        uuid_v1,
    }
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
    driver_state().status.is_ok()
}

/// `Ok` when the driver is usable, else `CudaUnavailable` with the reason.
fn require_driver() -> Result<&'static DriverState> {
    let state = driver_state();
    match state.status {
        Ok(()) => Ok(state),
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

/// `CUresult` → [`Error::Cuda`]. The name comes from the table above, else from
/// `cuGetErrorName` (its strings are static in libcuda, which is never unloaded).
pub(crate) fn cuda_error(call: &'static str, res: sys::CUresult) -> Error {
    let code = res as u32;
    let name = known_error_name(code)
        .or_else(|| driver_error_name(res))
        .unwrap_or(UNNAMED_ERROR);
    Error::Cuda { call, code, name }
}

/// The error a failed registration of `code` gives, for tests that inject one.
#[cfg(feature = "fault-injection")]
pub(crate) fn simulated_register_error(code: u32) -> Error {
    Error::Cuda {
        call: "cuMemHostRegister_v2",
        code,
        name: known_error_name(code).unwrap_or(UNNAMED_ERROR),
    }
}

fn driver_error_name(res: sys::CUresult) -> Option<&'static str> {
    if !driver_present() {
        return None;
    }
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: the driver is present and exports cuGetErrorName (checked by `driver_present`);
    // `text` is a valid out-pointer.
    let ok = unsafe { sys::cuGetErrorName(res, &mut text) } == sys::CUresult::CUDA_SUCCESS;
    if !ok || text.is_null() {
        return None;
    }
    // SAFETY: on success cuGetErrorName stores a pointer to a NUL-terminated string constant
    // inside libcuda; the library is held in a static by cudarc and never unloaded, so the
    // string lives for the rest of the process.
    let name: &'static CStr = unsafe { CStr::from_ptr(text) };
    name.to_str().ok()
}

/// `Ok(())` for `CUDA_SUCCESS`, else the mapped error.
fn check(call: &'static str, res: sys::CUresult) -> Result<()> {
    if res == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_error(call, res))
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

/// Safe wrappers for the per-device queries. Each requires `driver_present()`.
mod raw {
    use super::*;

    pub(super) fn device_count() -> Result<usize> {
        let mut count: c_int = 0;
        // SAFETY: callers checked `driver_present()`; `count` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    pub(super) fn device(ordinal: usize) -> Result<sys::CUdevice> {
        let ordinal = c_int::try_from(ordinal).map_err(|_| Error::Cuda {
            call: "cuDeviceGet",
            code: 101,
            name: "CUDA_ERROR_INVALID_DEVICE",
        })?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: driver present; `dev` is a valid out-pointer.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        Ok(dev)
    }

    pub(super) fn pci_bus_id(dev: sys::CUdevice) -> Result<String> {
        let mut buf: [c_char; 64] = [0; 64];
        // SAFETY: driver present; the buffer is 64 bytes and its length is passed, the driver
        // writes at most that many bytes including the NUL.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), 64, dev)
        })?;
        Ok(c_buf_text(&buf))
    }

    pub(super) fn pci_address(dev: sys::CUdevice) -> Result<PciAddress> {
        let text = pci_bus_id(dev)?;
        text.parse::<PciAddress>()
            .map_err(|_| Error::InvalidPciAddress { input: text })
    }

    pub(super) fn name(dev: sys::CUdevice) -> Result<String> {
        let mut buf: [c_char; 256] = [0; 256];
        // SAFETY: driver present; the buffer is 256 bytes and its length is passed.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), 256, dev)
        })?;
        Ok(c_buf_text(&buf))
    }

    pub(super) fn uuid(state: &DriverState, dev: sys::CUdevice) -> Result<[u8; 16]> {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        let (call, res) = if state.uuid_v2 {
            // SAFETY: driver present and the symbol is exported (probed); valid out-pointer.
            ("cuDeviceGetUuid_v2", unsafe {
                sys::cuDeviceGetUuid_v2(&mut uuid, dev)
            })
        } else if state.uuid_v1 {
            // SAFETY: as above, for the older entry point.
            ("cuDeviceGetUuid", unsafe {
                sys::cuDeviceGetUuid(&mut uuid, dev)
            })
        } else {
            return Err(Error::CudaUnavailable {
                reason: "libcuda exports neither cuDeviceGetUuid_v2 nor cuDeviceGetUuid",
            });
        };
        check(call, res)?;
        Ok(uuid.bytes.map(|c| c as u8))
    }

    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID` when it is reported and ≥ 0. Drivers before 12.2 do
    /// not know the attribute (INVALID_VALUE): that is `None`, not an error.
    pub(super) fn host_numa_id(dev: sys::CUdevice) -> Option<usize> {
        let mut value: c_int = -1;
        // SAFETY: driver present; `value` is a valid out-pointer.
        let res = unsafe {
            sys::cuDeviceGetAttribute(
                &mut value,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
                dev,
            )
        };
        if res == sys::CUresult::CUDA_SUCCESS {
            usize::try_from(value).ok()
        } else {
            None
        }
    }
}

/// A CUDA device, found but not opened: what placement needs (no context is created).
#[derive(Clone, Debug)]
pub(crate) struct Device {
    ordinal: u32,
    dev: sys::CUdevice,
    pci: PciAddress,
    name: String,
    host_numa_id: Option<usize>,
}

/// A CUDA device with its retained primary context, for page-locking.
///
/// Dropping it releases the primary context (the driver destroys the context when the last
/// retain is released).
#[derive(Debug)]
pub(crate) struct Gpu {
    device: Device,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver API makes contexts current
// per thread with push/pop, which is all this type does with it); the other fields are plain
// data. The handle is never freed while `Gpu` lives (released in Drop only).
unsafe impl Send for Gpu {}
// SAFETY: `&Gpu` only reads plain fields and pushes/pops the context on the calling thread's
// own context stack, which the driver supports from several threads at once.
unsafe impl Sync for Gpu {}

/// Pops the context pushed by [`Gpu::push`] when dropped, restoring the thread's previous one.
/// Not `Send`: it must drop on the thread that pushed.
struct CurrentGuard(std::marker::PhantomData<*const ()>);

impl Drop for CurrentGuard {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a guard exists only after a successful cuCtxPushCurrent_v2 on this thread
        // (the guard is not Send), so the stack has our context on top; `popped` is a valid
        // out-pointer. A failure cannot be reported from Drop and leaves nothing to undo.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

impl Device {
    /// Finds the device the selector names, without creating a context.
    ///
    /// `Auto` takes the first of `LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `MPI_LOCALRANKID` that parses, modulo the device count, else device 0. `Pci` compares
    /// `cuDeviceGetPCIBusId` as a parsed address (so case and domain width do not matter). `Uuid`
    /// compares the 16 bytes.
    ///
    /// Errors: [`Error::CudaUnavailable`] without a usable driver or with no visible device,
    /// [`Error::GpuNotFound`] when no device matches, [`Error::Cuda`] when a driver call fails.
    pub(crate) fn find(selector: GpuSelector) -> Result<Device> {
        let state = require_driver()?;
        let count = raw::device_count()?;
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
                    let dev = raw::device(i)?;
                    if raw::pci_address(dev).ok() == Some(want) {
                        found = Some(i);
                        break;
                    }
                }
                found.ok_or_else(not_found)?
            }
            GpuSelector::Uuid(want) => {
                let mut found = None;
                for i in 0..count {
                    let dev = raw::device(i)?;
                    if raw::uuid(state, dev)? == want {
                        found = Some(i);
                        break;
                    }
                }
                found.ok_or_else(not_found)?
            }
        };
        let dev = raw::device(ordinal)?;
        let pci = raw::pci_address(dev)?;
        let name = raw::name(dev)?;
        let host_numa_id = raw::host_numa_id(dev);
        Ok(Device {
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
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a `Device` exists only with the driver present, and `device.dev` is a valid
        // handle from cuDeviceGet; `ctx` is a valid out-pointer. Balanced by the release in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device.dev)
        })?;
        Ok(Gpu { device, ctx })
    }

    /// Makes the primary context current on this thread until the guard drops.
    fn push(&self) -> Result<CurrentGuard> {
        // SAFETY: the driver is present (a Gpu exists only then) and `self.ctx` is a retained
        // primary context, valid until Drop.
        check("cuCtxPushCurrent_v2", unsafe {
            sys::cuCtxPushCurrent_v2(self.ctx)
        })?;
        Ok(CurrentGuard(std::marker::PhantomData))
    }

    /// Page-locks `ptr..ptr+len` with `cuMemHostRegister_v2` (PORTABLE, plus DEVICEMAP and
    /// READ_ONLY when asked). The primary context is pushed current on the calling thread for
    /// the call and the thread's previous context is restored afterwards, whatever happens.
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
        let mut flags: c_uint = sys::CU_MEMHOSTREGISTER_PORTABLE;
        if devicemap {
            flags |= sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        }
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        let _current = self.push()?;
        // SAFETY: the caller guarantees the range is a live mapping it owns and that is not
        // registered; a context is current (pushed above).
        let res = unsafe { sys::cuMemHostRegister_v2(ptr.as_ptr().cast::<c_void>(), len, flags) };
        check("cuMemHostRegister_v2", res)
    }

    /// Unregisters a range registered by [`Gpu::register`], with the primary context current.
    ///
    /// # Safety
    ///
    /// `ptr` must be the base pointer passed to a successful [`Gpu::register`] on a `Gpu` of the
    /// same device, not unregistered since, and the range must still be mapped.
    pub(crate) unsafe fn unregister(&self, ptr: NonNull<u8>) -> Result<()> {
        let _current = self.push()?;
        // SAFETY: the caller guarantees `ptr` is a registered, still-mapped base pointer; a
        // context is current.
        let res = unsafe { sys::cuMemHostUnregister(ptr.as_ptr().cast::<c_void>()) };
        check("cuMemHostUnregister", res)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: `self.device.dev` had its primary context retained in `open`; this balances
        // it. Errors cannot be reported from Drop.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device.dev) };
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
        let e = cuda_error(
            "cuMemHostRegister_v2",
            sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
        );
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
        let e = cuda_error("cuInit", sys::CUresult::CUDA_ERROR_NOT_PERMITTED);
        assert!(matches!(e, Error::Cuda { code: 800, .. }));
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
