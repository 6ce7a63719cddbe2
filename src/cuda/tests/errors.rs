//! Naming `CUresult` codes: the table, the driver's names, unknown numbers, `cuInit` hints.

use std::ffi::c_uint;

use cudarc::driver::sys;

use crate::cuda::driver::*;
use crate::cuda::*;
use crate::error::{error_hint, known_error_name};

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
        crate::error::cuda_error_name(802),
        Some("CUDA_ERROR_SYSTEM_NOT_READY")
    );
    assert_eq!(crate::error::cuda_error_name(920), None);
}

#[test]
fn codes_newer_than_the_bindings_are_reported() {
    // Codes newer than the name table (CUDA 13.3 and 13.4 added 47, 227, 918 and 919; a newer
    // driver may return any number): plain numbers here, never an enum.
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

#[test]
fn the_tables_defaults_answer_not_supported() {
    let api = Api::UNSUPPORTED;
    // SAFETY: the default entry ignores its arguments.
    let res = unsafe { (api.mem_host_unregister)(std::ptr::null_mut()) };
    assert!(matches!(
        api.check("cuMemHostUnregister", res),
        Err(Error::Cuda {
            code: 801,
            name: "CUDA_ERROR_NOT_SUPPORTED",
            ..
        })
    ));
    assert!(api.device_get_uuid_v2.is_none() && api.mem_alloc.is_none());
    assert_eq!(
        exported(api.ctx_set_current),
        Err(Error::CudaUnavailable {
            reason: "libcuda lacks a driver function this call needs"
        })
    );
}
