//! Unit tests, with a fake driver table made of Rust functions.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::ptr::NonNull;

use cudarc::driver::sys;

use super::context::*;
use super::device::*;
use super::driver::*;
use super::*;
use crate::config::GpuSelector;
use crate::pci::PciAddress;

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
    assert_eq!(present, crate::cuda_driver_present());
    assert_eq!(present, crate::cuda_unavailable_reason().is_none());
    assert_eq!(present, driver_present(), "decided once");
    if !present {
        // No library here (CudaUnavailable); on a GPU machine with CUDA_VISIBLE_DEVICES empty,
        // cuInit's own error (CUDA_ERROR_NO_DEVICE).
        for selector in [
            GpuSelector::Auto,
            GpuSelector::Ordinal(0),
            GpuSelector::Uuid([0; 16]),
        ] {
            match Device::find(selector) {
                Err(Error::CudaUnavailable { reason }) => assert!(!reason.is_empty()),
                Err(Error::Cuda { call: "cuInit", .. }) => {}
                other => panic!("expected the probe's error, got {other:?}"),
            }
        }
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
fn cuinit_failures_carry_number_name_and_hint() {
    for (code, name) in [
        (2, "CUDA_ERROR_OUT_OF_MEMORY"),
        (3, "CUDA_ERROR_NOT_INITIALIZED"),
        (35, "CUDA_ERROR_INSUFFICIENT_DRIVER"),
        (101, "CUDA_ERROR_INVALID_DEVICE"),
        (802, "CUDA_ERROR_SYSTEM_NOT_READY"),
        (805, "CUDA_ERROR_MPS_CONNECTION_FAILED"),
        (920, UNNAMED_ERROR),
    ] {
        let e = cuda_error("cuInit", code, |_| None);
        assert_eq!(
            e,
            Error::Cuda {
                call: "cuInit",
                code,
                name
            }
        );
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("cuInit failed: {name} ({code})")),
            "{text}"
        );
        assert_eq!(error_hint("cuInit", code).is_some(), code != 920, "{code}");
    }
    assert_eq!(
        cuda_error("cuInit", 802, |_| None).to_string(),
        "cuInit failed: CUDA_ERROR_SYSTEM_NOT_READY (802): the system is not ready: on NVSwitch \
         (HGX) systems start nvidia-fabricmanager"
    );
    // Hints are for start-up failures only.
    assert_eq!(error_hint("cuMemHostRegister_v2", 2), None);
    assert_eq!(
        crate::cuda_error_name(802),
        Some("CUDA_ERROR_SYSTEM_NOT_READY")
    );
    assert_eq!(crate::cuda_error_name(920), None);
}

#[test]
fn codes_newer_than_the_bindings_are_reported() {
    // Codes no binding of cudarc 0.19 has (a newer driver may return them): plain numbers here,
    // never an enum.
    for code in [47, 227, 918, 919, 920, u32::MAX] {
        assert_eq!(
            cuda_error("cuMemHostRegister_v2", code, |_| None),
            Error::Cuda {
                call: "cuMemHostRegister_v2",
                code,
                name: UNNAMED_ERROR,
            }
        );
    }
    let e = cuda_error("cuMemHostUnregister", 920, |code| {
        (code == 920).then_some("CUDA_ERROR_FROM_DRIVER")
    });
    assert!(matches!(
        e,
        Error::Cuda {
            code: 920,
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

#[cfg(feature = "pinned-buffer")]
#[test]
fn event_query_reads_done_running_and_errors() {
    // The fake event's handle is the code cuEventQuery answers.
    let api = fake::api(true, true);
    let query = |code: usize| super::event::outcome(api, code as *mut c_void);
    assert_eq!(query(0), Ok(true));
    assert_eq!(query(600), Ok(false), "CUDA_ERROR_NOT_READY: still running");
    assert_eq!(
        query(700),
        Err(Error::Cuda {
            call: "cuEventQuery",
            code: 700,
            name: "CUDA_ERROR_ILLEGAL_ADDRESS"
        }),
        "an error is not completion"
    );
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
        unregister_outcome(check, 920),
        Err(Error::Cuda { code: 920, .. })
    ));
}

#[test]
fn the_current_contexts_device_is_looked_up_once_per_context() {
    let api = fake::api(true, true);
    fake::CURRENT_CTX.with(|c| c.set(0));
    assert_eq!(current_ordinal_in(api), None, "no current context");
    for ctx in [0x1000, 0x1000, 0x2000, 0x2000] {
        fake::CURRENT_CTX.with(|c| c.set(ctx));
        assert_eq!(current_ordinal_in(api), Some(0));
    }
    let lookups = fake::take_log();
    assert_eq!(
        lookups,
        ["ctx_get_device", "ctx_get_device"],
        "one per context"
    );
}

/// A driver made of Rust functions, recording calls per thread, to exercise [`Gpu`] without
/// libcuda.
mod fake {
    use super::*;
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
    const fn make(uuid_v2_present: bool, uuid_v1_present: bool) -> Api {
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
            read_only_register: None,
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
    fake::REGISTER_RC.with(|c| c.set(920));
    assert_eq!(
        // SAFETY: the fake driver does not touch the memory.
        unsafe { gpu.register(ptr, 4096, false, false) },
        Err(Error::Cuda {
            call: "cuMemHostRegister_v2",
            code: 920,
            name: "CUDA_ERROR_FAKE_920",
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
    gpu.generation = gpu.generation.wrapping_sub(1);
    assert_eq!(
        // SAFETY: the fake driver does not touch the memory.
        unsafe { gpu.register(ptr, 4096, false, false) },
        Err(Error::CudaUnavailable {
            reason: FORKED_REASON
        })
    );
    // The range may not be this block's in the child: the caller must leave it mapped.
    assert_eq!(
        // SAFETY: as above.
        unsafe { gpu.unregister(ptr) },
        Err(Error::CudaUnavailable {
            reason: FORKED_REASON
        })
    );
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
