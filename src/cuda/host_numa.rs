//! CUDA's own host-NUMA memory, the peer the benchmarks weigh this crate against (re-exported by
//! [`cuda_driver`](super::tools)): page-locked host memory on one node from `cuMemCreate` with a
//! `CU_MEM_LOCATION_TYPE_HOST_NUMA` location, mapped at an address of the driver's, and a
//! stream-ordered pool (`cuMemPoolCreate`) with such a location.
//!
//! Host-NUMA locations need CUDA 12.2 or later (pools 12.6). Every entry point is optional in the
//! driver table: a libcuda without one gives [`Error::CudaUnavailable`] naming it, a driver that
//! refuses the node (no `CAP_SYS_NICE`, a node without CPUs, an older driver that does not know
//! the location type) gives [`Error::Cuda`] with the call and its code. Nothing panics.

use std::ffi::{c_int, c_uint, c_void};
use std::marker::PhantomData;
use std::ptr::NonNull;

use super::context::Gpu;
use super::cuda_error;
use super::driver::{
    Api, CuDevicePtr, CuMemAccessDesc, CuMemAllocationProp, CuMemHandle, CuMemLocation, CuMemPool,
    CuMemPoolProps, CuResult, CuStream, DriverTable,
};
use crate::{Error, Result};

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(super) const LOCATION_DEVICE: c_uint = 1;
/// `CU_MEM_LOCATION_TYPE_HOST_NUMA`.
pub(super) const LOCATION_HOST_NUMA: c_uint = 3;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub(super) const ALLOCATION_PINNED: c_uint = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub(super) const ACCESS_READWRITE: c_uint = 3;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
pub(super) const GRANULARITY_MINIMUM: c_uint = 0;
/// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` (a `cuuint64_t`).
pub(super) const POOL_ATTR_RELEASE_THRESHOLD: c_uint = 4;
/// `CUDA_ERROR_INVALID_VALUE`: what the driver answers for arguments it cannot take.
const INVALID_VALUE: CuResult = 1;

/// An optional entry's pointer, or the error naming the symbol libcuda lacks.
macro_rules! entry {
    ($api:expr, $field:ident, $symbol:literal) => {
        $api.$field.ok_or(Error::CudaUnavailable {
            reason: concat!("libcuda lacks ", $symbol),
        })?
    };
}

/// The entry points [`HostNumaMemory`] calls, all found before anything is created, so that
/// its Drop has what it needs. They borrow the table of a held exit gate, so they are never
/// kept past it: each use finds them again under a new one.
#[derive(Clone, Copy, Debug)]
pub(super) struct VmmCalls<'a> {
    _gate: PhantomData<&'a Api>,
    granularity: unsafe extern "C" fn(*mut usize, *const CuMemAllocationProp, c_uint) -> CuResult,
    create:
        unsafe extern "C" fn(*mut CuMemHandle, usize, *const CuMemAllocationProp, u64) -> CuResult,
    release: unsafe extern "C" fn(CuMemHandle) -> CuResult,
    reserve: unsafe extern "C" fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, u64) -> CuResult,
    address_free: unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult,
    map: unsafe extern "C" fn(CuDevicePtr, usize, usize, CuMemHandle, u64) -> CuResult,
    unmap: unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult,
    set_access: unsafe extern "C" fn(CuDevicePtr, usize, *const CuMemAccessDesc, usize) -> CuResult,
}

impl<'a> VmmCalls<'a> {
    /// Every entry, or [`Error::CudaUnavailable`] naming the first one libcuda lacks.
    pub(super) fn get(api: &'a Api) -> Result<VmmCalls<'a>> {
        Ok(VmmCalls {
            _gate: PhantomData,
            granularity: entry!(
                api,
                mem_get_allocation_granularity,
                "cuMemGetAllocationGranularity"
            ),
            create: entry!(api, mem_create, "cuMemCreate"),
            release: entry!(api, mem_release, "cuMemRelease"),
            reserve: entry!(api, mem_address_reserve, "cuMemAddressReserve"),
            address_free: entry!(api, mem_address_free, "cuMemAddressFree"),
            map: entry!(api, mem_map, "cuMemMap"),
            unmap: entry!(api, mem_unmap, "cuMemUnmap"),
            set_access: entry!(api, mem_set_access, "cuMemSetAccess"),
        })
    }
}

/// The entry points [`HostNumaPool`] and its blocks call, borrowing a held gate's table as
/// [`VmmCalls`] do.
#[derive(Clone, Copy, Debug)]
pub(super) struct PoolCalls<'a> {
    _gate: PhantomData<&'a Api>,
    create: unsafe extern "C" fn(*mut CuMemPool, *const CuMemPoolProps) -> CuResult,
    destroy: unsafe extern "C" fn(CuMemPool) -> CuResult,
    set_attribute: unsafe extern "C" fn(CuMemPool, c_uint, *mut c_void) -> CuResult,
    set_access: unsafe extern "C" fn(CuMemPool, *const CuMemAccessDesc, usize) -> CuResult,
    alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize, CuMemPool, CuStream) -> CuResult,
    free: unsafe extern "C" fn(CuDevicePtr, CuStream) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
}

impl<'a> PoolCalls<'a> {
    /// Every entry, or [`Error::CudaUnavailable`] naming the first one libcuda lacks.
    pub(super) fn get(api: &'a Api) -> Result<PoolCalls<'a>> {
        Ok(PoolCalls {
            _gate: PhantomData,
            create: entry!(api, mem_pool_create, "cuMemPoolCreate"),
            destroy: entry!(api, mem_pool_destroy, "cuMemPoolDestroy"),
            set_attribute: entry!(api, mem_pool_set_attribute, "cuMemPoolSetAttribute"),
            set_access: entry!(api, mem_pool_set_access, "cuMemPoolSetAccess"),
            alloc: entry!(api, mem_alloc_from_pool_async, "cuMemAllocFromPoolAsync"),
            free: entry!(api, mem_free_async, "cuMemFreeAsync"),
            stream_create: entry!(api, stream_create, "cuStreamCreate"),
            stream_destroy: entry!(api, stream_destroy, "cuStreamDestroy_v2"),
            stream_synchronize: entry!(api, stream_synchronize, "cuStreamSynchronize"),
        })
    }
}

/// `node` as the `id` of a host-NUMA location.
fn host_numa(call: &'static str, node: usize) -> Result<CuMemLocation> {
    let id = c_int::try_from(node).map_err(|_| cuda_error(call, INVALID_VALUE, |_| None))?;
    Ok(CuMemLocation {
        kind: LOCATION_HOST_NUMA,
        id,
    })
}

/// Read-write access for `location`.
fn read_write(location: CuMemLocation) -> CuMemAccessDesc {
    CuMemAccessDesc {
        location,
        flags: ACCESS_READWRITE,
    }
}

/// The bytes at `ptr`, zero-filled the first time (`*filled` records it): the driver leaves
/// new memory uninitialised.
///
/// # Safety
///
/// `ptr..ptr+len` must be writable by the host and owned by the caller for the slice's lifetime.
unsafe fn bytes<'a>(ptr: NonNull<u8>, len: usize, filled: &mut bool) -> &'a mut [u8] {
    if !*filled {
        // SAFETY: `len` writable bytes (caller).
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        *filled = true;
    }
    // SAFETY: `len` bytes owned by the caller, initialised above.
    unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) }
}

/// Page-locked host memory on one NUMA node, made by the driver: `cuMemCreate` (pinned,
/// location host-NUMA `node`), `cuMemAddressReserve`, `cuMemMap`, then `cuMemSetAccess` for the
/// device **and** the host (without the host entry the CPU cannot touch it). Copies from it are
/// asynchronous, as from registered memory. Dropping it unmaps, frees the address range and
/// releases the allocation, in that order.
#[derive(Debug)]
pub struct HostNumaMemory<'d> {
    /// The context of the `Driver` it came from, borrowed while this lives.
    _driver: PhantomData<&'d Gpu>,
    steps: Steps,
    ptr: NonNull<u8>,
    filled: bool,
}

/// What [`HostNumaMemory::map`] has done so far, undone on drop (so also when a later step
/// fails).
#[derive(Debug)]
struct Steps {
    /// Entered for each undoing call.
    driver: &'static DriverTable,
    handle: Option<CuMemHandle>,
    /// The reserved range's base; 0 until reserved.
    va: CuDevicePtr,
    /// The size asked for, rounded up to the allocation granularity.
    len: usize,
    mapped: bool,
}

impl Drop for Steps {
    fn drop(&mut self) {
        // Once the process is exiting the driver's teardown releases them. `map` found every
        // entry before the first step.
        let Ok(live) = self.driver.enter() else {
            return;
        };
        let Ok(calls) = VmmCalls::get(&live) else {
            return;
        };
        // SAFETY: each call undoes one step that succeeded (the fields say which), once, in
        // reverse order; no copy uses the range any more (`Copier::time` waits for its
        // copies). Errors cannot be reported from Drop.
        unsafe {
            if self.mapped {
                let _ = (calls.unmap)(self.va, self.len);
            }
            if self.va != 0 {
                let _ = (calls.address_free)(self.va, self.len);
            }
            if let Some(handle) = self.handle {
                let _ = (calls.release)(handle);
            }
        }
    }
}

impl<'d> HostNumaMemory<'d> {
    /// [`Driver::host_numa_memory`](super::tools::Driver::host_numa_memory)'s body. Needs `gpu`'s
    /// context current on this thread.
    pub(super) fn map(gpu: &'d Gpu, node: usize, len: usize) -> Result<Self> {
        let api = gpu.enter()?;
        let calls = VmmCalls::get(&api)?;
        let location = host_numa("cuMemCreate", node)?;
        let prop = CuMemAllocationProp {
            kind: ALLOCATION_PINNED,
            requested_handle_types: 0,
            location,
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        };
        let mut granularity = 0;
        // SAFETY: the entry is cuMemGetAllocationGranularity's; `granularity` is a valid
        // out-pointer and `prop` a valid property struct for the call.
        api.check("cuMemGetAllocationGranularity", unsafe {
            (calls.granularity)(&mut granularity, &prop, GRANULARITY_MINIMUM)
        })?;
        let len = Some(len)
            .filter(|&len| len > 0 && granularity > 0)
            .and_then(|len| len.checked_next_multiple_of(granularity))
            .ok_or_else(|| cuda_error("cuMemCreate (size)", INVALID_VALUE, |_| None))?;
        let mut steps = Steps {
            driver: gpu.driver(),
            handle: None,
            va: 0,
            len,
            mapped: false,
        };
        let mut handle = 0;
        // SAFETY: a context is current (caller); `handle` is a valid out-pointer, `len` a
        // multiple of the granularity the driver gave for `prop`; `steps` releases it.
        api.check("cuMemCreate", unsafe {
            (calls.create)(&mut handle, len, &prop, 0)
        })?;
        steps.handle = Some(handle);
        let mut va = 0;
        // SAFETY: `va` is a valid out-pointer; no fixed address is asked for; `steps` frees the
        // range.
        api.check("cuMemAddressReserve", unsafe {
            (calls.reserve)(&mut va, len, granularity, 0, 0)
        })?;
        steps.va = va;
        let ptr = NonNull::new(va as usize as *mut u8).ok_or(Error::CudaUnavailable {
            reason: "cuMemAddressReserve succeeded with address 0",
        })?;
        // SAFETY: `va..va+len` was just reserved and is unmapped; the allocation is `len` bytes;
        // `steps` unmaps it.
        api.check("cuMemMap", unsafe { (calls.map)(va, len, 0, handle, 0) })?;
        steps.mapped = true;
        let access = [
            read_write(CuMemLocation {
                kind: LOCATION_DEVICE,
                id: gpu.dev(),
            }),
            read_write(location),
        ];
        // SAFETY: `va..va+len` is mapped (above); `access` holds `access.len()` descriptors.
        api.check("cuMemSetAccess", unsafe {
            (calls.set_access)(va, len, access.as_ptr(), access.len())
        })?;
        Ok(HostNumaMemory {
            _driver: PhantomData,
            steps,
            ptr,
            filled: false,
        })
    }

    /// The mapped bytes' base address, the same for the host and the device.
    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The mapped size: the size asked for, rounded up to the allocation granularity (2 MiB on
    /// current drivers).
    pub fn len(&self) -> usize {
        self.steps.len
    }

    /// Whether the mapping is empty (never:
    /// [`Driver::host_numa_memory`](super::tools::Driver::host_numa_memory) refuses 0 bytes).
    pub fn is_empty(&self) -> bool {
        self.steps.len == 0
    }

    /// The bytes, zero-filled on the first call.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes mapped read-write for the host (`map`), owned by `self` and
        // borrowed mutably with it.
        unsafe { bytes(self.ptr, self.steps.len, &mut self.filled) }
    }
}

/// A stream-ordered pool of page-locked memory on one host node (`cuMemPoolCreate` with a
/// host-NUMA location), with its release threshold raised to `u64::MAX` so that freed memory
/// stays in the pool, the device given read-write access (the host has it by default), and a
/// stream of its own for allocating and freeing. Dropping it waits for the stream, then destroys
/// the pool and the stream.
#[derive(Debug)]
pub struct HostNumaPool<'d> {
    /// The context of the `Driver` it came from, borrowed while this lives.
    _driver: PhantomData<&'d Gpu>,
    driver: &'static DriverTable,
    pool: CuMemPool,
    stream: CuStream,
}

impl<'d> HostNumaPool<'d> {
    /// [`Driver::host_numa_pool`](super::tools::Driver::host_numa_pool)'s body. Needs `gpu`'s
    /// context current on this thread.
    pub(super) fn create(gpu: &'d Gpu, node: usize) -> Result<Self> {
        let api = gpu.enter()?;
        let calls = PoolCalls::get(&api)?;
        let props = CuMemPoolProps {
            alloc_type: ALLOCATION_PINNED,
            handle_types: 0,
            location: host_numa("cuMemPoolCreate", node)?,
            win32_security_attributes: std::ptr::null_mut(),
            max_size: 0,
            reserved: [0; 56],
        };
        let mut pool = HostNumaPool {
            _driver: PhantomData,
            driver: gpu.driver(),
            pool: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
        };
        // SAFETY: (this call and the next three) a context is current (caller); each pointer
        // is valid for the call; what is created is destroyed by Drop, which skips what is
        // still null.
        api.check("cuMemPoolCreate", unsafe {
            (calls.create)(&mut pool.pool, &props)
        })?;
        let mut threshold = u64::MAX;
        // SAFETY: as above; the attribute's value is a `cuuint64_t`.
        api.check("cuMemPoolSetAttribute(RELEASE_THRESHOLD)", unsafe {
            (calls.set_attribute)(
                pool.pool,
                POOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        })?;
        let device = [read_write(CuMemLocation {
            kind: LOCATION_DEVICE,
            id: gpu.dev(),
        })];
        // SAFETY: as above; `device` holds one descriptor.
        api.check("cuMemPoolSetAccess", unsafe {
            (calls.set_access)(pool.pool, device.as_ptr(), device.len())
        })?;
        // SAFETY: as above.
        api.check("cuStreamCreate", unsafe {
            (calls.stream_create)(&mut pool.stream, 0)
        })?;
        Ok(pool)
    }

    /// `len` bytes from the pool (`cuMemAllocFromPoolAsync` on the pool's stream), returned once
    /// the stream has reached the allocation, so that the host may use them at once. Freed
    /// (`cuMemFreeAsync`, back into the pool) when the block drops.
    pub fn alloc(&self, len: usize) -> Result<PoolBlock<'_>> {
        let api = self.driver.enter()?;
        let calls = PoolCalls::get(&api)?;
        let mut dptr = 0;
        // SAFETY: the pool and stream are live (Drop destroys them); `dptr` is a valid
        // out-pointer.
        api.check("cuMemAllocFromPoolAsync", unsafe {
            (calls.alloc)(&mut dptr, len, self.pool, self.stream)
        })?;
        let ptr = NonNull::new(dptr as usize as *mut u8).ok_or(Error::CudaUnavailable {
            reason: "cuMemAllocFromPoolAsync succeeded with a null pointer",
        })?;
        // Made before the wait, so that a failed wait still gives the memory back.
        let block = PoolBlock {
            pool: self,
            ptr,
            len,
            filled: false,
        };
        // SAFETY: the stream is live.
        api.check("cuStreamSynchronize", unsafe {
            (calls.stream_synchronize)(self.stream)
        })?;
        Ok(block)
    }
}

impl Drop for HostNumaPool<'_> {
    fn drop(&mut self) {
        // Once the process is exiting the driver's teardown releases them. `create` found
        // every entry before the first step.
        let Ok(live) = self.driver.enter() else {
            return;
        };
        let Ok(calls) = PoolCalls::get(&live) else {
            return;
        };
        // SAFETY: each handle was created by `create` (null ones were not and are skipped) and
        // is destroyed once; the stream is waited for first, so the blocks' frees (every block
        // borrows the pool, so all were dropped) have reached the pool. Errors cannot be
        // reported from Drop.
        unsafe {
            if !self.stream.is_null() {
                let _ = (calls.stream_synchronize)(self.stream);
            }
            if !self.pool.is_null() {
                let _ = (calls.destroy)(self.pool);
            }
            if !self.stream.is_null() {
                let _ = (calls.stream_destroy)(self.stream);
            }
        }
    }
}

/// Memory from a [`HostNumaPool`], freed back into it (stream-ordered) on drop.
#[derive(Debug)]
pub struct PoolBlock<'p> {
    pool: &'p HostNumaPool<'p>,
    ptr: NonNull<u8>,
    len: usize,
    filled: bool,
}

impl PoolBlock<'_> {
    /// The block's address, the same for the host and the device.
    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The size asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, zero-filled on the first call.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes from the pool, which the host may access (a host-NUMA pool's
        // default) once the allocation was reached (`alloc` waited), owned by the block and
        // borrowed mutably with it.
        unsafe { bytes(self.ptr, self.len, &mut self.filled) }
    }
}

impl Drop for PoolBlock<'_> {
    fn drop(&mut self) {
        let pool = self.pool;
        let Ok(live) = pool.driver.enter() else {
            return;
        };
        let Ok(calls) = PoolCalls::get(&live) else {
            return;
        };
        // SAFETY: the pointer came from cuMemAllocFromPoolAsync on this pool and is freed once,
        // on the pool's stream (live while the pool is borrowed). No copy uses it any more
        // (`Copier::time` waits for its copies).
        let _ = unsafe { (calls.free)(self.ptr.as_ptr() as usize as CuDevicePtr, pool.stream) };
    }
}
