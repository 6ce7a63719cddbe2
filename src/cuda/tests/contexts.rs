//! The primary context: registering with it pushed and capture relaxed, failures, a forked child.

use std::ptr::NonNull;

use super::fake;
use crate::cuda::context::*;
use crate::cuda::driver::*;
use crate::cuda::*;

fn block() -> (Vec<u8>, NonNull<u8>) {
    let mut buf = vec![0u8; 4096];
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("vec pointer");
    (buf, ptr)
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
fn register_relaxes_capture_and_restores_everything() {
    fake::MODE.with(|m| m.set(1)); // the thread was in THREAD_LOCAL mode
    let gpu = fake::gpu();
    let (_buf, ptr) = block();
    let flags = RegisterFlags {
        devicemap: true,
        read_only: true,
    };
    // SAFETY: the fake driver does not touch the memory.
    assert_eq!(unsafe { gpu.register(ptr, 4096, flags) }, Ok(()));
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
        unsafe { gpu.register(ptr, 4096, RegisterFlags::default()) },
        Err(Error::Cuda {
            call: "cuMemHostRegister_v2",
            code: 920,
            name: "CUDA_ERROR_FAKE_920",
        })
    );
    fake::REGISTER_RC.with(|c| c.set(919));
    assert_eq!(
        // SAFETY: as above.
        unsafe { gpu.register(ptr, 4096, RegisterFlags::default()) },
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
        unsafe { gpu.register(ptr, 4096, RegisterFlags::default()) },
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
        unsafe { gpu.register(ptr, 4096, RegisterFlags::default()) },
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
