//! The crate's thin driver table for benchmarks and tools (`examples/dma_bench/`,
//! `benches/dma.rs`): one device's primary context, page-locked host memory from
//! `cuMemHostAlloc` or `cuMemHostRegister`, CUDA's own host-NUMA memory (`cuMemCreate` and a
//! pool, [`HostNumaMemory`] and [`HostNumaPool`]: the peer the benchmarks weigh this crate
//! against), and timed copies on a stream of its own. Unstable: tools for this crate's
//! benchmarks, not an API.
//!
//! Every call goes through the crate's own C-typed pointers to libcuda (the table the allocator
//! uses, loaded at run time) and reads `CUresult` as a plain `u32`: a code newer than cudarc's
//! bindings is reported as [`Error::Cuda`] with its number, never misread as an enum (cudarc's
//! `sys::cu*` wrappers would be undefined behaviour there).
//!
//! What it does not promise: it is not a CUDA binding (only the calls those programs make, in
//! the shapes they need), nothing here is a stable interface beyond this crate's own benchmarks,
//! and none of it is used by the allocator. Without a driver, [`Driver::open`] returns the
//! probe's error; nothing panics.
//!
//! ```
//! use numa_gpu_alloc::unstable::cuda_driver::{Direction, Driver};
//!
//! match Driver::open(0) {
//!     Ok(driver) => {
//!         let copier = driver.copier(1 << 20)?;
//!         let mut host = driver.host_alloc(1 << 20)?;
//!         let seconds = copier.time(host.as_mut_slice(), Direction::HtoD, 4)?;
//!         println!("{:.1} GB/s", 4.0 * (1 << 20) as f64 / seconds / 1e9);
//!     }
//!     Err(e) => println!("no CUDA device: {e}"),
//! }
//! # Ok::<(), numa_gpu_alloc::Error>(())
//! ```

use std::ffi::c_void;
use std::ptr::NonNull;

use super::context::Gpu;
use super::device::Device;
use super::driver::{exported, CuDevicePtr, CuEvent, CuStream, Live, REGISTER_PORTABLE};
pub use super::host_numa::{HostNumaMemory, HostNumaPool, PoolBlock};
use crate::config::GpuSelector;
use crate::{Error, Result};

/// `CU_MEMHOSTALLOC_PORTABLE` (the same bit as `CU_MEMHOSTREGISTER_PORTABLE`).
const HOST_ALLOC_PORTABLE: u32 = REGISTER_PORTABLE;

/// A device's retained primary context, current on the thread that opened it (call
/// [`Driver::make_current`] on other threads). Releases the context when dropped.
#[derive(Debug)]
pub struct Driver {
    gpu: Gpu,
}

impl Driver {
    /// Loads libcuda (once per process, with the allocator's probe: `cuInit(0)`), retains device
    /// `ordinal`'s primary context and makes it current on this thread.
    pub fn open(ordinal: u32) -> Result<Driver> {
        let driver = Driver {
            gpu: Gpu::open(Device::find(GpuSelector::Ordinal(ordinal))?)?,
        };
        driver.make_current()?;
        Ok(driver)
    }

    /// Makes the primary context current on the calling thread (`cuCtxSetCurrent`).
    pub fn make_current(&self) -> Result<()> {
        self.gpu.set_current()
    }

    /// The driver's table, with the exit gate held while the result is.
    fn enter(&self) -> Result<Live<'static>> {
        self.gpu.enter()
    }

    /// `cuMemHostAlloc(PORTABLE)` of `len` bytes, freed when the result drops. Needs the context
    /// current on this thread.
    pub fn host_alloc(&self, len: usize) -> Result<HostAlloc<'_>> {
        let api = self.enter()?;
        let alloc = exported(api.mem_host_alloc)?;
        exported(api.mem_free_host)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a context is current (caller); `p` is a valid out-pointer.
        api.check("cuMemHostAlloc", unsafe {
            alloc(&mut p, len, HOST_ALLOC_PORTABLE)
        })?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(Error::CudaUnavailable {
            reason: "cuMemHostAlloc succeeded with a null pointer",
        })?;
        Ok(HostAlloc {
            driver: self,
            ptr,
            len,
            filled: false,
        })
    }

    /// Page-locks `ptr..ptr+len` (`cuMemHostRegister_v2`, PORTABLE, as the allocator does) until
    /// the result drops.
    ///
    /// # Safety
    ///
    /// The range must be mapped, not registered, and stay mapped until the result is dropped.
    pub unsafe fn register(&self, ptr: NonNull<u8>, len: usize) -> Result<Registered<'_>> {
        // SAFETY: the caller guarantees the range; it is unregistered by `Registered`'s Drop.
        unsafe { self.gpu.register(ptr, len, super::RegisterFlags::default()) }?;
        Ok(Registered { driver: self, ptr })
    }

    /// `len` bytes (rounded up to the allocation granularity) of page-locked memory on host
    /// node `node`, made and mapped by the driver (see [`HostNumaMemory`]). Needs the context
    /// current on this thread.
    ///
    /// Errors: [`Error::CudaUnavailable`] naming the entry point libcuda lacks (drivers before
    /// CUDA 10.2), [`Error::Cuda`] with the call and its code when the driver refuses (a
    /// driver before CUDA 12.2 does not know host-NUMA locations; placing on a node needs
    /// `CAP_SYS_NICE` and a node with CPUs).
    pub fn host_numa_memory(&self, node: usize, len: usize) -> Result<HostNumaMemory<'_>> {
        HostNumaMemory::map(&self.gpu, node, len)
    }

    /// A stream-ordered pool of page-locked memory on host node `node` (see [`HostNumaPool`]).
    /// Needs the context current on this thread. Errors as for [`Self::host_numa_memory`]
    /// (pools take host-NUMA locations from CUDA 12.6).
    pub fn host_numa_pool(&self, node: usize) -> Result<HostNumaPool<'_>> {
        HostNumaPool::create(&self.gpu, node)
    }

    /// A device buffer of `len` bytes and a stream with two timing events, for copies. Needs the
    /// context current on this thread.
    pub fn copier(&self, len: usize) -> Result<Copier<'_>> {
        let api = self.enter()?;
        // Every entry `Copier` calls, so that its Drop finds them.
        let (mem_alloc, stream_create, event_create) = (
            exported(api.mem_alloc)?,
            exported(api.stream_create)?,
            exported(api.event_create)?,
        );
        exported(api.mem_free)?;
        exported(api.stream_destroy)?;
        exported(api.stream_synchronize)?;
        exported(api.memcpy_htod_async)?;
        exported(api.memcpy_dtoh_async)?;
        exported(api.event_record)?;
        exported(api.event_elapsed_time)?;
        exported(api.event_destroy)?;
        let mut copier = Copier {
            driver: self,
            dev: 0,
            len,
            stream: std::ptr::null_mut(),
            events: [std::ptr::null_mut(); 2],
        };
        // SAFETY: (this call and the next two) the context is current; each out-pointer is
        // valid; what is created is destroyed by `Copier`'s Drop, which skips what is still null
        // or zero.
        api.check("cuMemAlloc_v2", unsafe { mem_alloc(&mut copier.dev, len) })?;
        // SAFETY: as above.
        api.check("cuStreamCreate", unsafe {
            stream_create(&mut copier.stream, 0)
        })?;
        for event in &mut copier.events {
            // SAFETY: as above; flags 0 = CU_EVENT_DEFAULT (timing enabled).
            api.check("cuEventCreate", unsafe { event_create(event, 0) })?;
        }
        Ok(copier)
    }
}

/// Page-locked memory from `cuMemHostAlloc`.
#[derive(Debug)]
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
        let Ok(api) = self.driver.enter() else { return };
        if let Some(free) = api.mem_free_host {
            // SAFETY: from cuMemHostAlloc, freed once.
            let _ = unsafe { free(self.ptr.as_ptr().cast()) };
        }
    }
}

/// A range registered by [`Driver::register`]; unregistered on drop.
#[derive(Debug)]
pub struct Registered<'d> {
    driver: &'d Driver,
    ptr: NonNull<u8>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        // SAFETY: registered with this base pointer and still mapped (`register`'s contract).
        let _ = unsafe { self.driver.gpu.unregister(self.ptr) };
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

/// A device buffer, a stream and two events, from [`Driver::copier`].
#[derive(Debug)]
pub struct Copier<'d> {
    driver: &'d Driver,
    dev: CuDevicePtr,
    len: usize,
    stream: CuStream,
    events: [CuEvent; 2],
}

impl Copier<'_> {
    /// Copies `host` `copies` times in `direction` between two events on the stream and
    /// returns the seconds between the events (the copies' time on the GPU's clock). The call
    /// waits for the copies, so `host` is not touched by the device after it returns.
    pub fn time(&self, host: &mut [u8], direction: Direction, copies: usize) -> Result<f64> {
        if host.len() > self.len {
            // What the driver would answer for a copy past the device buffer's end.
            return Err(super::cuda_error(
                "cuMemcpy (host buffer larger than the device buffer)",
                1,
                |_| None,
            ));
        }
        let timed = self.queue_and_time(host, direction, copies);
        if timed.is_err() {
            // A failure after some copies were queued: `host` must not be given back to the
            // caller (who may free or reuse it) while they still run.
            self.synchronize();
        }
        timed
    }

    /// Waits for the stream (errors cannot be reported from the paths that call it).
    fn synchronize(&self) {
        let Ok(api) = self.driver.enter() else { return };
        if let Some(sync) = api.stream_synchronize {
            // SAFETY: the stream is live (Drop destroys it) or null, the legacy default stream.
            let _ = unsafe { sync(self.stream) };
        }
    }

    /// [`Self::time`]'s body: queues the copies between the events and waits for the last one.
    fn queue_and_time(&self, host: &mut [u8], direction: Direction, copies: usize) -> Result<f64> {
        let api = self.driver.enter()?;
        let record = exported(api.event_record)?;
        let (htod, dtoh) = (
            exported(api.memcpy_htod_async)?,
            exported(api.memcpy_dtoh_async)?,
        );
        let elapsed = exported(api.event_elapsed_time)?;
        // SAFETY: (whole block) the stream, events and device buffer are live (Drop destroys
        // them); `host` is valid for its length, which fits the device buffer; the stream is
        // synchronised (event_synchronize on the last event, or by `time` on a failure) before
        // `host`'s borrow ends.
        unsafe {
            api.check("cuEventRecord", record(self.events[0], self.stream))?;
            for _ in 0..copies {
                match direction {
                    Direction::HtoD => api.check(
                        "cuMemcpyHtoDAsync_v2",
                        htod(self.dev, host.as_ptr().cast(), host.len(), self.stream),
                    )?,
                    Direction::DtoH => api.check(
                        "cuMemcpyDtoHAsync_v2",
                        dtoh(host.as_mut_ptr().cast(), self.dev, host.len(), self.stream),
                    )?,
                }
            }
            api.check("cuEventRecord", record(self.events[1], self.stream))?;
            api.check(
                "cuEventSynchronize",
                (api.event_synchronize)(self.events[1]),
            )?;
            let mut ms = 0f32;
            api.check(
                "cuEventElapsedTime",
                elapsed(&mut ms, self.events[0], self.events[1]),
            )?;
            Ok(f64::from(ms) / 1e3)
        }
    }
}

impl Drop for Copier<'_> {
    fn drop(&mut self) {
        // The stream first, so that no copy still uses `dev`.
        if !self.stream.is_null() {
            self.synchronize();
        }
        let Ok(api) = self.driver.enter() else { return };
        // `Driver::copier` made one only when every entry below is exported.
        let (Some(destroy_event), Some(destroy_stream), Some(free)) =
            (api.event_destroy, api.stream_destroy, api.mem_free)
        else {
            return;
        };
        // SAFETY: each handle was created by `copier` (null/zero ones were not and are skipped)
        // and is destroyed once, after the stream was synchronised.
        unsafe {
            for event in self.events.into_iter().filter(|e| !e.is_null()) {
                let _ = destroy_event(event);
            }
            if !self.stream.is_null() {
                let _ = destroy_stream(self.stream);
            }
            if self.dev != 0 {
                let _ = free(self.dev);
            }
        }
    }
}
