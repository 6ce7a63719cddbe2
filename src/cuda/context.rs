//! [`Gpu`]: the primary context (retain, push/pop guards, capture-mode guard) and
//! `cuMemHostRegister`/`cuMemHostUnregister`.

use std::ffi::{c_uint, c_void};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use super::device::Device;
use super::driver::{
    exported, Api, CuContext, CuDevice, CuResult, DriverTable, Live, CAPTURE_MODE_RELAXED,
    HOST_MEMORY_NOT_REGISTERED, REGISTER_DEVICEMAP, REGISTER_PORTABLE, REGISTER_READ_ONLY,
};
use super::teardown::close_at_exit;
use crate::{fork, Error, Result};

/// Why a forked child does not register memory. Also said by a child whose allocator was first
/// used after the fork, whether or not the parent had initialised CUDA: the child never calls it.
pub(crate) const FORKED_REASON: &str =
    "this process is a forked child, and the CUDA driver is not usable after fork (its state is \
     the parent's)";

/// The `cuMemHostRegister` flags beyond PORTABLE (always set: every GPU's context may use a
/// block). Part of a block's kind: blocks registered differently never serve each other's
/// requests. A new flag is a field here and its bit in [`Self::bits`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct RegisterFlags {
    /// `CU_MEMHOSTREGISTER_DEVICEMAP`.
    pub(crate) devicemap: bool,
    /// `CU_MEMHOSTREGISTER_READ_ONLY`.
    pub(crate) read_only: bool,
}

impl RegisterFlags {
    fn bits(self) -> c_uint {
        let mut bits = REGISTER_PORTABLE;
        if self.devicemap {
            bits |= REGISTER_DEVICEMAP;
        }
        if self.read_only {
            bits |= REGISTER_READ_ONLY;
        }
        bits
    }
}

/// A CUDA device with its retained primary context, for page-locking.
///
/// Dropping it releases the primary context (the driver destroys the context when the last
/// retain is released) — except in a forked child, where the context is the parent's.
#[derive(Debug)]
pub(crate) struct Gpu {
    device: Device,
    ctx: CuContext,
    /// The fork generation that retained the context: a child forked after [`Gpu::open`] must
    /// not use it (the CUDA driver does not support use across `fork`).
    pub(super) generation: u32,
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
pub(super) struct CurrentGuard<'a> {
    api: &'a Api,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for CurrentGuard<'_> {
    fn drop(&mut self) {
        let mut popped: CuContext = std::ptr::null_mut();
        // SAFETY: a guard exists only after a successful cuCtxPushCurrent_v2 on this thread
        // (the guard is not Send), so the stack has our context on top; `ctx_pop` is
        // cuCtxPopCurrent_v2 and `popped` a valid out-pointer. A failure cannot be reported from
        // Drop and leaves nothing to undo.
        let _ = unsafe { (self.api.ctx_pop)(&mut popped) };
    }
}

/// Makes `ctx` current on this thread until the guard drops (which restores the previous one).
/// The guard borrows `api`, the table of a held gate ([`Live`]): the context is popped before
/// the gate is left.
///
/// # Safety
/// `ctx` is a live context of the driver whose table `api` is.
pub(super) unsafe fn push_current(api: &Api, ctx: CuContext) -> Result<CurrentGuard<'_>> {
    // SAFETY: `api` is the initialised driver's and `ctx` a live context (caller).
    let res = unsafe { (api.ctx_push)(ctx) };
    api.check("cuCtxPushCurrent_v2", res)?;
    Ok(CurrentGuard {
        api,
        _not_send: std::marker::PhantomData,
    })
}

/// Puts back the thread's stream capture mode saved by [`relaxed_capture`] when dropped.
/// Not `Send`: the mode is per thread.
pub(super) struct CaptureModeGuard<'a> {
    api: &'a Api,
    previous: c_uint,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for CaptureModeGuard<'_> {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: `exchange_capture_mode` is cuThreadExchangeStreamCaptureMode; `mode` holds the value the
        // driver itself handed out on this thread (the guard is not Send) and is a valid
        // in/out-pointer. A failure cannot be reported from Drop.
        let _ = unsafe { (self.api.exchange_capture_mode)(&mut mode) };
    }
}

/// Sets this thread's stream capture mode to relaxed until the guard drops, so that registering
/// or unregistering memory does not invalidate a CUDA graph another thread is capturing in
/// global mode.
pub(super) fn relaxed_capture(api: &Api) -> Result<CaptureModeGuard<'_>> {
    let mut mode = CAPTURE_MODE_RELAXED;
    // SAFETY: `exchange_capture_mode` is cuThreadExchangeStreamCaptureMode from the initialised
    // driver; `mode` is a valid in/out-pointer (the driver stores the previous mode in it).
    let res = unsafe { (api.exchange_capture_mode)(&mut mode) };
    api.check("cuThreadExchangeStreamCaptureMode", res)?;
    Ok(CaptureModeGuard {
        api,
        previous: mode,
        _not_send: std::marker::PhantomData,
    })
}

/// What `cuMemHostUnregister` returning `res` means for the caller: 713
/// (`CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`, e.g. after the program reset the device) says that
/// the registration is already gone, so the range may be unmapped like a successful unregister.
/// `check` maps every other result.
pub(super) fn unregister_outcome(
    check: impl FnOnce(CuResult) -> Result<()>,
    res: CuResult,
) -> Result<()> {
    if res == HOST_MEMORY_NOT_REGISTERED {
        return Ok(());
    }
    check(res)
}

/// Devices with an ordinal below this share one [`Gpu`] per process ([`Gpu::shared`]).
const SHARED_GPUS: usize = 256;

/// One retained primary context per device, kept for the life of the process: blocks registered
/// through it sit in the process-wide arenas and may be released by any allocator value, after
/// the one that registered them is gone (each registration holds its `&'static Gpu`). A slot
/// array, not a locked list: a forked child finds its devices without a lock another thread may
/// have held at the fork.
static SHARED: [AtomicPtr<Gpu>; SHARED_GPUS] =
    [const { AtomicPtr::new(ptr::null_mut()) }; SHARED_GPUS];

impl Gpu {
    /// The process's `Gpu` for `device`, opened now if it is the first use (see [`SHARED`]).
    pub(crate) fn shared(device: Device) -> Result<&'static Gpu> {
        let slot = usize::try_from(device.ordinal())
            .ok()
            .and_then(|i| SHARED.get(i))
            .ok_or(Error::CudaUnavailable {
                reason: "a CUDA device ordinal beyond the 256 this crate registers memory with",
            })?;
        if let Some(gpu) = Gpu::in_slot(slot) {
            return Ok(gpu);
        }
        let opened = Box::into_raw(Box::new(Gpu::open(device)?));
        if let Err(winner) =
            slot.compare_exchange(ptr::null_mut(), opened, Ordering::AcqRel, Ordering::Acquire)
        {
            // Another thread opened it first: balance this retain, use theirs.
            // SAFETY: boxed just above, never shared.
            drop(unsafe { Box::from_raw(opened) });
            // SAFETY: slots hold leaked boxes, never freed.
            return unsafe { winner.as_ref() }.ok_or(Error::CudaUnavailable {
                reason: "a shared CUDA context slot was emptied",
            });
        }
        // SAFETY: leaked into the slot above, never freed.
        Ok(unsafe { &*opened })
    }

    fn in_slot(slot: &AtomicPtr<Gpu>) -> Option<&'static Gpu> {
        // SAFETY: slots hold null or a leaked box, never freed.
        unsafe { slot.load(Ordering::Acquire).as_ref() }
    }

    /// Whether blocks can be registered through it: not in a child forked after it was opened.
    pub(crate) fn usable(&self) -> bool {
        !self.forked()
    }

    /// Retains the device's primary context, for registering memory with it.
    pub(crate) fn open(device: Device) -> Result<Gpu> {
        let api = device.driver.enter()?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: `api` is the initialised driver's (a `Device` exists only then), and
        // `device.dev` is a valid handle from cuDeviceGet; `ctx` is a valid out-pointer.
        // Balanced by the release in Drop.
        let res = unsafe { (api.primary_ctx_retain)(&mut ctx, device.dev) };
        api.check("cuDevicePrimaryCtxRetain", res)?;
        drop(api);
        static AFTER_FIRST_RETAIN: AtomicBool = AtomicBool::new(false);
        if !AFTER_FIRST_RETAIN.swap(true, Ordering::AcqRel) {
            // Probed already: atexit worked once, and a second failure only loses the hardening.
            let _ = close_at_exit();
        }
        Ok(Gpu {
            device,
            ctx,
            generation: fork::generation(),
        })
    }

    /// Whether this is a child forked after [`Gpu::open`]: the context belongs to the parent.
    fn forked(&self) -> bool {
        fork::generation() != self.generation
    }

    /// The driver it calls, to enter later (objects that outlive one call keep it).
    pub(super) fn driver(&self) -> &'static DriverTable {
        self.device.driver
    }

    /// Enters the exit gate: the driver table it calls through, while the result is held.
    pub(super) fn enter(&self) -> Result<Live<'static>> {
        self.device.driver.enter()
    }

    /// The device's driver handle (`CUdevice`), which access descriptors name.
    pub(super) fn dev(&self) -> CuDevice {
        self.device.dev
    }

    /// Makes the primary context the calling thread's current one (`cuCtxSetCurrent`): the
    /// benchmark tools' way, which keep it current, where the allocator pushes and pops it.
    pub(super) fn set_current(&self) -> Result<()> {
        if self.forked() {
            return Err(Error::CudaUnavailable {
                reason: FORKED_REASON,
            });
        }
        let api = self.enter()?;
        let set = exported(api.ctx_set_current)?;
        // SAFETY: `set` is cuCtxSetCurrent from the initialised driver; `self.ctx` is a retained
        // primary context, valid until Drop.
        api.check("cuCtxSetCurrent", unsafe { set(self.ctx) })
    }

    /// Makes the primary context current on this thread until the guard drops.
    fn push<'a>(&self, api: &'a Api) -> Result<CurrentGuard<'a>> {
        // SAFETY: `self.ctx` is a retained primary context of the driver whose table `api` is,
        // valid until Drop.
        unsafe { push_current(api, self.ctx) }
    }

    /// Page-locks `ptr..ptr+len` with `cuMemHostRegister_v2` (PORTABLE, plus DEVICEMAP and
    /// READ_ONLY when asked). The primary context is pushed current on the calling thread and
    /// the thread's stream capture mode is set to relaxed for the call; both are restored
    /// afterwards, whatever happens.
    ///
    /// In a child forked after [`Gpu::open`], or once the process is exiting, nothing is
    /// registered: the error is [`Error::CudaUnavailable`].
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must be a live mapping owned by the caller, not registered yet, and must
    /// stay mapped until [`Gpu::unregister`] is called with the same `ptr`.
    pub(crate) unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        flags: RegisterFlags,
    ) -> Result<()> {
        if self.forked() {
            return Err(Error::CudaUnavailable {
                reason: FORKED_REASON,
            });
        }
        let flags = flags.bits();
        // Dropped in reverse order: the capture mode is restored, the context popped, then the
        // exit handler may go on (both guards borrow `api`).
        let api = self.enter()?;
        let _current = self.push(&api)?;
        let _relaxed = relaxed_capture(&api)?;
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
    /// program reset the device). In a child forked after [`Gpu::open`] the driver is not called
    /// and the answer is [`Error::CudaUnavailable`]: the driver may have kept the parent's
    /// registered range out of the child (`MADV_DONTFORK`), so something else may be mapped
    /// there now, and the caller must leave the range alone. Once the process is exiting the
    /// answer is the same (the driver may be tearing down): the range stays mapped.
    ///
    /// # Safety
    ///
    /// `ptr` must be the base pointer passed to a successful [`Gpu::register`] on a `Gpu` of the
    /// same device, not unregistered since, and the range must still be mapped.
    pub(crate) unsafe fn unregister(&self, ptr: NonNull<u8>) -> Result<()> {
        if self.forked() {
            return Err(Error::CudaUnavailable {
                reason: FORKED_REASON,
            });
        }
        // Dropped in reverse order, as in `register`.
        let api = self.enter()?;
        let _current = self.push(&api)?;
        let _relaxed = relaxed_capture(&api)?;
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
        // Once the process is exiting the context is left to the driver's teardown.
        let Ok(api) = self.enter() else { return };
        // SAFETY: `self.device.dev` had its primary context retained in `open` by this process;
        // `primary_ctx_release` is cuDevicePrimaryCtxRelease_v2, and this balances the retain.
        // Errors cannot be reported from Drop.
        let _ = unsafe { (api.primary_ctx_release)(self.device.dev) };
    }
}
