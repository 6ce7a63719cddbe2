//! The CUDA driver calls that `dma_bench` and `benches/dma.rs` make, through function pointers
//! with C types: every `CUresult` is read as a plain `u32`. cudarc's `sys::cu*` wrappers return it
//! as a Rust enum, and a driver newer than cudarc's bindings can return a code that enum lacks
//! (undefined behaviour); the crate itself avoids them the same way (`src/cuda/driver.rs`).
//!
//! Included with `#[path]` by `examples/dma_bench.rs` and `benches/dma.rs`.

use std::ffi::{c_int, c_uint, c_void};
use std::fmt;
use std::ptr::NonNull;

/// `CUresult`, any number.
type CuResult = u32;
/// `CUdeviceptr`.
type DevicePtr = u64;
/// `CUcontext`, `CUstream`, `CUevent`: opaque pointers.
type Handle = *mut c_void;

/// `CU_MEMHOSTALLOC_PORTABLE` and `CU_MEMHOSTREGISTER_PORTABLE` (both 1).
const PORTABLE: c_uint = 1;

/// A failed driver call: which, and the raw code (named when `numa_gpu_alloc` knows it).
#[derive(Clone, Copy, Debug)]
pub struct CuError {
    /// The driver function.
    pub call: &'static str,
    /// The `CUresult` number.
    pub code: u32,
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = numa_gpu_alloc::cuda_error_name(self.code).unwrap_or("unnamed CUresult");
        write!(f, "{} failed: {name} ({})", self.call, self.code)
    }
}

impl std::error::Error for CuError {}

fn check(call: &'static str, res: CuResult) -> Result<(), CuError> {
    if res == 0 {
        Ok(())
    } else {
        Err(CuError { call, code: res })
    }
}

/// The entry points, resolved from libcuda once.
struct Fns {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut Handle, c_int) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(c_int) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(Handle) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut DevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(DevicePtr) -> CuResult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(Handle) -> CuResult,
    memcpy_htod_async: unsafe extern "C" fn(DevicePtr, *const c_void, usize, Handle) -> CuResult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, DevicePtr, usize, Handle) -> CuResult,
    event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(Handle, Handle) -> CuResult,
    event_synchronize: unsafe extern "C" fn(Handle) -> CuResult,
    event_elapsed_time: unsafe extern "C" fn(*mut f32, Handle, Handle) -> CuResult,
    event_destroy: unsafe extern "C" fn(Handle) -> CuResult,
}

/// libcuda, initialised, with device `ordinal`'s primary context current on the thread that
/// opened it (call [`Driver::make_current`] on other threads).
pub struct Driver {
    fns: Fns,
    dev: c_int,
    ctx: Handle,
    /// Keeps the library (and so every pointer in `fns`) loaded.
    _lib: libloading::Library,
}

impl Driver {
    /// Loads libcuda, calls `cuInit(0)`, retains device `ordinal`'s primary context and makes it
    /// current on this thread.
    pub fn open(ordinal: u32) -> Result<Driver, Box<dyn std::error::Error>> {
        // SAFETY: loading libcuda runs its initialisers, which is what using the driver means;
        // the library stays loaded while `Driver` lives (it owns `_lib`).
        // The crate's own order (`libcuda.so` first, so `LD_LIBRARY_PATH` can name the
        // simulator): both loaders then open the same library.
        let lib = unsafe { libloading::Library::new("libcuda.so") }
            // SAFETY: as above.
            .or_else(|_| unsafe { libloading::Library::new("libcuda.so.1") })?;
        macro_rules! resolve {
            ($($name:literal),+) => {{
                let mut found = Err(libloading::Error::DlSymUnknown);
                $(
                    if found.is_err() {
                        // SAFETY: the field this initialises has the symbol's C prototype,
                        // spelt out on `Fns` (checked against cuda.h, `CUresult` as u32).
                        found = unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map(|s| *s);
                    }
                )+
                found.map_err(|e| format!("libcuda lacks {}: {e}", [$($name),+].join(" / ")))?
            }};
        }
        let fns = Fns {
            init: resolve!("cuInit"),
            device_get: resolve!("cuDeviceGet"),
            primary_ctx_retain: resolve!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: resolve!("cuDevicePrimaryCtxRelease_v2"),
            ctx_set_current: resolve!("cuCtxSetCurrent"),
            mem_alloc: resolve!("cuMemAlloc_v2"),
            mem_free: resolve!("cuMemFree_v2"),
            mem_host_alloc: resolve!("cuMemHostAlloc"),
            mem_free_host: resolve!("cuMemFreeHost"),
            mem_host_register: resolve!("cuMemHostRegister_v2"),
            mem_host_unregister: resolve!("cuMemHostUnregister"),
            stream_create: resolve!("cuStreamCreate"),
            stream_destroy: resolve!("cuStreamDestroy_v2"),
            stream_synchronize: resolve!("cuStreamSynchronize"),
            memcpy_htod_async: resolve!("cuMemcpyHtoDAsync_v2"),
            memcpy_dtoh_async: resolve!("cuMemcpyDtoHAsync_v2"),
            event_create: resolve!("cuEventCreate"),
            event_record: resolve!("cuEventRecord"),
            event_synchronize: resolve!("cuEventSynchronize"),
            // CUDA 13's header maps the name to _v2; drivers export both.
            event_elapsed_time: resolve!("cuEventElapsedTime", "cuEventElapsedTime_v2"),
            event_destroy: resolve!("cuEventDestroy_v2"),
        };
        // SAFETY: cuInit from the loaded library, flags 0.
        check("cuInit", unsafe { (fns.init)(0) })?;
        let ordinal = c_int::try_from(ordinal)?;
        let mut dev: c_int = 0;
        // SAFETY: initialised driver; `dev` is a valid out-pointer.
        check("cuDeviceGet", unsafe {
            (fns.device_get)(&mut dev, ordinal)
        })?;
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device; `ctx` a valid out-pointer; released in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            (fns.primary_ctx_retain)(&mut ctx, dev)
        })?;
        let driver = Driver {
            fns,
            dev,
            ctx,
            _lib: lib,
        };
        driver.make_current()?;
        Ok(driver)
    }

    /// Makes the primary context current on the calling thread.
    pub fn make_current(&self) -> Result<(), CuError> {
        // SAFETY: `ctx` is the retained primary context, valid until Drop.
        check("cuCtxSetCurrent", unsafe {
            (self.fns.ctx_set_current)(self.ctx)
        })
    }

    /// `cuMemHostAlloc(PORTABLE)` of `len` bytes, freed when the result drops. Needs the
    /// context current on this thread.
    pub fn host_alloc(&self, len: usize) -> Result<HostAlloc<'_>, CuError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a context is current (caller); `p` is a valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            (self.fns.mem_host_alloc)(&mut p, len, PORTABLE)
        })?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(CuError {
            call: "cuMemHostAlloc (null pointer)",
            code: 0,
        })?;
        Ok(HostAlloc {
            driver: self,
            ptr,
            len,
            filled: false,
        })
    }

    /// Registers `ptr..ptr+len` with `cuMemHostRegister_v2(PORTABLE)` until the result drops.
    ///
    /// # Safety
    ///
    /// The range must be mapped, not registered, and stay mapped until the result is dropped;
    /// the context must be current on this thread.
    pub unsafe fn register(&self, ptr: NonNull<u8>, len: usize) -> Result<Registered<'_>, CuError> {
        // SAFETY: the caller guarantees the range and the current context.
        check("cuMemHostRegister_v2", unsafe {
            (self.fns.mem_host_register)(ptr.as_ptr().cast(), len, PORTABLE)
        })?;
        Ok(Registered { driver: self, ptr })
    }

    /// A device buffer of `len` bytes and a stream with two timing events, for copies.
    pub fn copier(&self, len: usize) -> Result<Copier<'_>, CuError> {
        let mut copier = Copier {
            driver: self,
            dev: 0,
            len,
            stream: std::ptr::null_mut(),
            events: [std::ptr::null_mut(); 2],
        };
        // SAFETY: (all four calls) the context is current; each out-pointer is valid; what is
        // created is destroyed by `Copier`'s Drop, which skips what is still null or zero.
        check("cuMemAlloc_v2", unsafe {
            (self.fns.mem_alloc)(&mut copier.dev, len)
        })?;
        // SAFETY: as above.
        check("cuStreamCreate", unsafe {
            (self.fns.stream_create)(&mut copier.stream, 0)
        })?;
        for i in 0..2 {
            // SAFETY: as above; flags 0 = CU_EVENT_DEFAULT (timing enabled).
            check("cuEventCreate", unsafe {
                (self.fns.event_create)(&mut copier.events[i], 0)
            })?;
        }
        Ok(copier)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`.
        let _ = unsafe { (self.fns.primary_ctx_release)(self.dev) };
    }
}

/// Page-locked memory from `cuMemHostAlloc`.
pub struct HostAlloc<'d> {
    driver: &'d Driver,
    ptr: NonNull<u8>,
    len: usize,
    /// Whether the bytes were written (`cuMemHostAlloc` leaves them uninitialised).
    filled: bool,
}

impl HostAlloc<'_> {
    /// The bytes, zero-filled on the first call.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if !self.filled {
            // SAFETY: `len` writable bytes owned by this allocation.
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), 0, self.len) };
            self.filled = true;
        }
        // SAFETY: `len` bytes owned by this allocation, initialised above, borrowed mutably
        // with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostAlloc<'_> {
    fn drop(&mut self) {
        // SAFETY: from cuMemHostAlloc, freed once.
        let _ = unsafe { (self.driver.fns.mem_free_host)(self.ptr.as_ptr().cast()) };
    }
}

/// A range registered by [`Driver::register`]; unregistered on drop.
pub struct Registered<'d> {
    driver: &'d Driver,
    ptr: NonNull<u8>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        // SAFETY: registered with this base pointer and still mapped (`register`'s contract).
        let _ = unsafe { (self.driver.fns.mem_host_unregister)(self.ptr.as_ptr().cast()) };
    }
}

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Host to device.
    HtoD,
    /// Device to host.
    DtoH,
}

/// A device buffer, a stream and two events.
pub struct Copier<'d> {
    driver: &'d Driver,
    dev: DevicePtr,
    len: usize,
    stream: Handle,
    events: [Handle; 2],
}

impl Copier<'_> {
    /// Copies `host` `copies` times in `direction` between two events on the stream and
    /// returns the seconds between the events (the copies' time on the GPU's clock). The call
    /// waits for the copies, so `host` is not touched by the device after it returns.
    pub fn time(
        &self,
        host: &mut [u8],
        direction: Direction,
        copies: usize,
    ) -> Result<f64, CuError> {
        if host.len() > self.len {
            // What the driver would answer for a copy past the device buffer's end.
            return Err(CuError {
                call: "cuMemcpy (host buffer larger than the device buffer)",
                code: 1,
            });
        }
        let f = &self.driver.fns;
        let timed = self.queue_and_time(host, direction, copies);
        if timed.is_err() {
            // A failure after some copies were queued: `host` must not be given back to the
            // caller (who may free or reuse it) while they still run.
            // SAFETY: the stream is live (Drop destroys it).
            let _ = unsafe { (f.stream_synchronize)(self.stream) };
        }
        timed
    }

    /// [`Self::time`]'s body: queues the copies between the events and waits for the last one.
    fn queue_and_time(
        &self,
        host: &mut [u8],
        direction: Direction,
        copies: usize,
    ) -> Result<f64, CuError> {
        let f = &self.driver.fns;
        // SAFETY: (whole block) the stream, events and device buffer are live (Drop destroys
        // them); `host` is valid for its length, which fits the device buffer; the stream is
        // synchronised (event_synchronize on the last event, or by `time` on a failure) before
        // `host`'s borrow ends.
        unsafe {
            check(
                "cuEventRecord",
                (f.event_record)(self.events[0], self.stream),
            )?;
            for _ in 0..copies {
                match direction {
                    Direction::HtoD => check(
                        "cuMemcpyHtoDAsync_v2",
                        (f.memcpy_htod_async)(
                            self.dev,
                            host.as_ptr().cast(),
                            host.len(),
                            self.stream,
                        ),
                    )?,
                    Direction::DtoH => check(
                        "cuMemcpyDtoHAsync_v2",
                        (f.memcpy_dtoh_async)(
                            host.as_mut_ptr().cast(),
                            self.dev,
                            host.len(),
                            self.stream,
                        ),
                    )?,
                }
            }
            check(
                "cuEventRecord",
                (f.event_record)(self.events[1], self.stream),
            )?;
            check("cuEventSynchronize", (f.event_synchronize)(self.events[1]))?;
            let mut ms = 0f32;
            check(
                "cuEventElapsedTime",
                (f.event_elapsed_time)(&mut ms, self.events[0], self.events[1]),
            )?;
            Ok(f64::from(ms) / 1e3)
        }
    }
}

impl Drop for Copier<'_> {
    fn drop(&mut self) {
        let f = &self.driver.fns;
        // SAFETY: each handle was created by `copier` (null/zero ones were not and are skipped)
        // and is destroyed once; the stream is synchronised first so no copy still uses `dev`.
        unsafe {
            if !self.stream.is_null() {
                let _ = (f.stream_synchronize)(self.stream);
            }
            for event in self.events.into_iter().filter(|e| !e.is_null()) {
                let _ = (f.event_destroy)(event);
            }
            if !self.stream.is_null() {
                let _ = (f.stream_destroy)(self.stream);
            }
            if self.dev != 0 {
                let _ = (f.mem_free)(self.dev);
            }
        }
    }
}
