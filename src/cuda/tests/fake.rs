//! A driver made of Rust functions, recording calls per thread, to exercise [`Gpu`] without
//! libcuda.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::cuda::context::*;
use crate::cuda::device::*;
use crate::cuda::driver::*;
use crate::topology::pci::PciAddress;

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
    /// This thread's current context (its address; 0: none).
    pub(super) static CURRENT_CTX: Cell<usize> = const { Cell::new(0) };
}

fn log(call: String) {
    LOG.with(|l| l.borrow_mut().push(call));
}

pub(super) fn take_log() -> Vec<String> {
    LOG.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

extern "C" fn get_error_name(code: u32, text: *mut *const c_char) -> u32 {
    if code != 920 {
        return 1;
    }
    // SAFETY: callers pass a valid out-pointer.
    unsafe { *text = c"CUDA_ERROR_FAKE_920".as_ptr() };
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
extern "C" fn ctx_get_current(c: *mut CuContext) -> u32 {
    // SAFETY: callers pass a valid out-pointer.
    unsafe { *c = CURRENT_CTX.with(Cell::get) as CuContext };
    0
}
/// The one fake device's handle.
extern "C" fn ctx_get_device(d: *mut CuDevice) -> u32 {
    log("ctx_get_device".into());
    // SAFETY: callers pass a valid out-pointer.
    unsafe { *d = 0 };
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
/// A fake event's handle is the `CUresult` that querying it answers.
#[cfg(feature = "pinned-buffer")]
extern "C" fn event_query(event: *mut c_void) -> u32 {
    event as usize as u32
}
extern "C" fn event_synchronize(_: *mut c_void) -> u32 {
    0
}

/// The fake driver, with or without each UUID entry point.
pub(super) const fn make(uuid_v2_present: bool, uuid_v1_present: bool) -> Api {
    Api {
        get_error_name,
        device_get_count: count,
        device_get: get,
        device_get_attribute: attribute,
        device_get_name: text,
        device_get_pci_bus_id: text,
        device_get_uuid_v2: if uuid_v2_present { Some(uuid_v2) } else { None },
        device_get_uuid: if uuid_v1_present { Some(uuid_v1) } else { None },
        primary_ctx_retain: retain,
        primary_ctx_release: release,
        ctx_push: push,
        ctx_pop: pop,
        ctx_get_current,
        ctx_get_device,
        mem_host_register: register,
        mem_host_unregister: unregister,
        exchange_capture_mode: exchange,
        #[cfg(feature = "pinned-buffer")]
        event_query,
        event_synchronize,
        ..Api::UNSUPPORTED
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

/// The fake driver with both UUID entry points, behind the exit gate as libcuda's table is.
static DRIVER: DriverTable = DriverTable::new(make(true, true));

pub(super) fn gpu() -> Gpu {
    gpu_on(&DRIVER)
}

/// The fake device's `Gpu`, calling through `driver`.
pub(super) fn gpu_on(driver: &'static DriverTable) -> Gpu {
    let device = Device {
        driver,
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
        read_only_register: None,
    };
    match Gpu::open(device) {
        Ok(gpu) => gpu,
        Err(e) => panic!("fake open failed: {e}"),
    }
}
