//! CUDA's host-NUMA memory (`host_numa.rs`) against a fake driver: the calls, their arguments and
//! their undoing in order, a failed step, a libcuda without the entries, and the C structs'
//! layout against cudarc's bindings.

use std::cell::RefCell;
use std::ffi::{c_uint, c_void};
use std::mem::{offset_of, size_of};

use cudarc::driver::sys;

use super::fake;
use crate::cuda::driver::*;
use crate::cuda::host_numa::*;
use crate::Error;

thread_local! {
    /// Calls made on this thread, in order.
    static LOG: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    /// The call that fails (with `CUDA_ERROR_OUT_OF_MEMORY`), if any.
    static FAIL: RefCell<&'static str> = const { RefCell::new("") };
}

const MIB: usize = 1 << 20;
const VA: CuDevicePtr = 0x7f00_0000_0000;

/// Logs `call` and answers what the test asked it to.
fn answer(call: String) -> u32 {
    let name = call.split(' ').next().unwrap_or_default().to_owned();
    LOG.with(|l| l.borrow_mut().push(call));
    if FAIL.with(|f| *f.borrow() == name) {
        2
    } else {
        0
    }
}

fn take_log() -> Vec<String> {
    LOG.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

fn location(l: &CuMemLocation) -> String {
    format!("{}:{}", l.kind, l.id)
}

/// The descriptors as `type:id=flags`.
///
/// # Safety
///
/// `desc` holds `count` descriptors.
unsafe fn descriptors(desc: *const CuMemAccessDesc, count: usize) -> String {
    // SAFETY: the caller's.
    let desc = unsafe { std::slice::from_raw_parts(desc, count) };
    let text: Vec<String> = desc
        .iter()
        .map(|d| format!("{}={}", location(&d.location), d.flags))
        .collect();
    text.join(",")
}

extern "C" fn granularity(g: *mut usize, prop: *const CuMemAllocationProp, option: c_uint) -> u32 {
    // SAFETY: the code under test passes valid pointers.
    let prop = unsafe { &*prop };
    // SAFETY: as above.
    unsafe { *g = 2 * MIB };
    answer(format!(
        "granularity type={} location={} option={option}",
        prop.kind,
        location(&prop.location)
    ))
}
extern "C" fn create(
    h: *mut CuMemHandle,
    len: usize,
    prop: *const CuMemAllocationProp,
    flags: u64,
) -> u32 {
    // SAFETY: as above.
    let prop = unsafe { &*prop };
    // SAFETY: as above.
    unsafe { *h = 7 };
    answer(format!(
        "create len={} type={} location={} handles={} flags={flags}",
        len / MIB,
        prop.kind,
        location(&prop.location),
        prop.requested_handle_types
    ))
}
extern "C" fn release(h: CuMemHandle) -> u32 {
    answer(format!("release {h}"))
}
extern "C" fn reserve(
    va: *mut CuDevicePtr,
    len: usize,
    align: usize,
    at: CuDevicePtr,
    flags: u64,
) -> u32 {
    // SAFETY: as above.
    unsafe { *va = VA };
    answer(format!(
        "reserve len={} align={} at={at} flags={flags}",
        len / MIB,
        align / MIB
    ))
}
extern "C" fn address_free(va: CuDevicePtr, len: usize) -> u32 {
    answer(format!("address_free {} len={}", va == VA, len / MIB))
}
extern "C" fn map(va: CuDevicePtr, len: usize, offset: usize, h: CuMemHandle, flags: u64) -> u32 {
    answer(format!(
        "map {} len={} offset={offset} handle={h} flags={flags}",
        va == VA,
        len / MIB
    ))
}
extern "C" fn unmap(va: CuDevicePtr, len: usize) -> u32 {
    answer(format!("unmap {} len={}", va == VA, len / MIB))
}
extern "C" fn set_access(
    va: CuDevicePtr,
    len: usize,
    desc: *const CuMemAccessDesc,
    count: usize,
) -> u32 {
    // SAFETY: the code under test passes `count` descriptors.
    let desc = unsafe { descriptors(desc, count) };
    answer(format!("set_access {} len={} {desc}", va == VA, len / MIB))
}

const POOL: usize = 0x900;
const POOL_STREAM: usize = 0x950;
const BLOCK: CuDevicePtr = 0x7e00_0000_0000;

extern "C" fn pool_create(pool: *mut CuMemPool, props: *const CuMemPoolProps) -> u32 {
    // SAFETY: as above.
    let props = unsafe { &*props };
    // SAFETY: as above.
    unsafe { *pool = POOL as CuMemPool };
    let reserved_zero = props.reserved.iter().all(|&b| b == 0);
    answer(format!(
        "pool_create type={} location={} handles={} max={} zeroed={reserved_zero}",
        props.alloc_type,
        location(&props.location),
        props.handle_types,
        props.max_size
    ))
}
extern "C" fn pool_destroy(pool: CuMemPool) -> u32 {
    answer(format!("pool_destroy {}", pool as usize == POOL))
}
extern "C" fn pool_set_attribute(pool: CuMemPool, attr: c_uint, value: *mut c_void) -> u32 {
    // SAFETY: the release threshold's value is a u64.
    let value = unsafe { *value.cast::<u64>() };
    answer(format!(
        "pool_set_attribute {} attr={attr} value={}",
        pool as usize == POOL,
        value == u64::MAX
    ))
}
extern "C" fn pool_set_access(pool: CuMemPool, desc: *const CuMemAccessDesc, count: usize) -> u32 {
    // SAFETY: the code under test passes `count` descriptors.
    let desc = unsafe { descriptors(desc, count) };
    answer(format!("pool_set_access {} {desc}", pool as usize == POOL))
}
extern "C" fn pool_alloc(p: *mut CuDevicePtr, len: usize, pool: CuMemPool, s: CuStream) -> u32 {
    // SAFETY: as above.
    unsafe { *p = BLOCK };
    answer(format!(
        "pool_alloc len={} {} {}",
        len / MIB,
        pool as usize == POOL,
        s as usize == POOL_STREAM
    ))
}
extern "C" fn free_async(p: CuDevicePtr, s: CuStream) -> u32 {
    answer(format!(
        "free_async {} {}",
        p == BLOCK,
        s as usize == POOL_STREAM
    ))
}
extern "C" fn stream_create(s: *mut CuStream, flags: c_uint) -> u32 {
    // SAFETY: as above.
    unsafe { *s = POOL_STREAM as CuStream };
    answer(format!("stream_create {flags}"))
}
extern "C" fn stream_destroy(s: CuStream) -> u32 {
    answer(format!("stream_destroy {}", s as usize == POOL_STREAM))
}
extern "C" fn stream_synchronize(s: CuStream) -> u32 {
    answer(format!("stream_synchronize {}", s as usize == POOL_STREAM))
}

/// The fake driver with every host-NUMA entry.
const HOST_NUMA_API: Api = Api {
    mem_get_allocation_granularity: Some(granularity),
    mem_create: Some(create),
    mem_release: Some(release),
    mem_address_reserve: Some(reserve),
    mem_address_free: Some(address_free),
    mem_map: Some(map),
    mem_unmap: Some(unmap),
    mem_set_access: Some(set_access),
    mem_pool_create: Some(pool_create),
    mem_pool_destroy: Some(pool_destroy),
    mem_pool_set_attribute: Some(pool_set_attribute),
    mem_pool_set_access: Some(pool_set_access),
    mem_alloc_from_pool_async: Some(pool_alloc),
    mem_free_async: Some(free_async),
    stream_create: Some(stream_create),
    stream_destroy: Some(stream_destroy),
    stream_synchronize: Some(stream_synchronize),
    ..fake::make(true, true)
};

static HOST_NUMA: DriverTable = DriverTable::new(HOST_NUMA_API);

/// The same without `cuMemCreate` and `cuMemPoolCreate`.
static WITHOUT_CREATE: DriverTable = DriverTable::new(Api {
    mem_create: None,
    mem_pool_create: None,
    ..HOST_NUMA_API
});

#[test]
fn maps_with_device_and_host_access_and_undoes_in_reverse() {
    let gpu = fake::gpu_on(&HOST_NUMA);
    take_log();
    let mem = HostNumaMemory::map(&gpu, 3, 3 * MIB).expect("the fake maps");
    assert_eq!(mem.len(), 4 * MIB, "rounded up to the 2 MiB granularity");
    assert_eq!(mem.as_ptr().as_ptr() as usize as CuDevicePtr, VA);
    assert_eq!(
        take_log(),
        [
            // pinned (1), host-NUMA (3) node 3, minimum granularity (0)
            "granularity type=1 location=3:3 option=0",
            "create len=4 type=1 location=3:3 handles=0 flags=0",
            "reserve len=4 align=2 at=0 flags=0",
            "map true len=4 offset=0 handle=7 flags=0",
            // device 0 and host-NUMA node 3, both read-write (3)
            "set_access true len=4 1:0=3,3:3=3",
        ]
    );
    drop(mem); // touches no byte: the fake's address is not memory
    assert_eq!(
        take_log(),
        ["unmap true len=4", "address_free true len=4", "release 7"]
    );
}

#[test]
fn a_failed_step_undoes_the_steps_before_it() {
    let gpu = fake::gpu_on(&HOST_NUMA);
    for (failing, undone) in [
        ("create", &[][..]),
        ("reserve", &["release 7"][..]),
        ("map", &["address_free true len=2", "release 7"][..]),
        (
            "set_access",
            &["unmap true len=2", "address_free true len=2", "release 7"][..],
        ),
    ] {
        take_log();
        FAIL.with(|f| *f.borrow_mut() = failing);
        let e = HostNumaMemory::map(&gpu, 0, MIB).expect_err(failing);
        FAIL.with(|f| *f.borrow_mut() = "");
        assert!(matches!(e, Error::Cuda { code: 2, .. }), "{failing}: {e:?}");
        let log = take_log();
        let at = log.iter().position(|c| c.starts_with(failing)).unwrap();
        assert_eq!(log[at + 1..], *undone, "{failing}: {log:?}");
    }
}

#[test]
fn pool_raises_the_threshold_gives_the_device_access_and_frees_on_its_stream() {
    let gpu = fake::gpu_on(&HOST_NUMA);
    take_log();
    let pool = HostNumaPool::create(&gpu, 1).expect("the fake creates");
    assert_eq!(
        take_log(),
        [
            "pool_create type=1 location=3:1 handles=0 max=0 zeroed=true",
            // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (4) = u64::MAX
            "pool_set_attribute true attr=4 value=true",
            "pool_set_access true 1:0=3",
            "stream_create 0",
        ]
    );
    let block = pool.alloc(8 * MIB).expect("the fake allocates");
    assert_eq!(block.len(), 8 * MIB);
    drop(block);
    drop(pool);
    assert_eq!(
        take_log(),
        [
            "pool_alloc len=8 true true",
            "stream_synchronize true",
            "free_async true true",
            "stream_synchronize true",
            "pool_destroy true",
            "stream_destroy true",
        ]
    );
}

#[test]
fn a_libcuda_without_the_entries_is_named() {
    let gpu = fake::gpu_on(&WITHOUT_CREATE);
    take_log();
    let e = HostNumaMemory::map(&gpu, 0, MIB).expect_err("no cuMemCreate");
    assert_eq!(
        e,
        Error::CudaUnavailable {
            reason: "libcuda lacks cuMemCreate"
        }
    );
    let e = HostNumaPool::create(&gpu, 0).expect_err("no cuMemPoolCreate");
    assert_eq!(
        e.to_string(),
        "CUDA unavailable: libcuda lacks cuMemPoolCreate"
    );
    assert!(
        take_log().is_empty(),
        "nothing is called without every entry"
    );
    let e = VmmCalls::get(&Api::UNSUPPORTED).expect_err("none");
    assert_eq!(
        e,
        Error::CudaUnavailable {
            reason: "libcuda lacks cuMemGetAllocationGranularity"
        }
    );
}

#[test]
fn structs_match_cudarcs_bindings() {
    assert_eq!(size_of::<CuMemLocation>(), size_of::<sys::CUmemLocation>());
    assert_eq!(
        size_of::<CuMemAllocationProp>(),
        size_of::<sys::CUmemAllocationProp>()
    );
    assert_eq!(
        offset_of!(CuMemAllocationProp, location),
        offset_of!(sys::CUmemAllocationProp, location)
    );
    assert_eq!(
        offset_of!(CuMemAllocationProp, win32_handle_meta_data),
        offset_of!(sys::CUmemAllocationProp, win32HandleMetaData)
    );
    assert_eq!(
        offset_of!(CuMemAllocationProp, alloc_flags),
        offset_of!(sys::CUmemAllocationProp, allocFlags)
    );
    assert_eq!(
        size_of::<CuMemAccessDesc>(),
        size_of::<sys::CUmemAccessDesc>()
    );
    assert_eq!(
        offset_of!(CuMemAccessDesc, flags),
        offset_of!(sys::CUmemAccessDesc, flags)
    );
    assert_eq!(
        size_of::<CuMemPoolProps>(),
        size_of::<sys::CUmemPoolProps>()
    );
    assert_eq!(
        offset_of!(CuMemPoolProps, location),
        offset_of!(sys::CUmemPoolProps, location)
    );
    assert_eq!(
        offset_of!(CuMemPoolProps, max_size),
        offset_of!(sys::CUmemPoolProps, maxSize)
    );
    // The enum values the wrapper passes, as cudarc names them.
    use sys::CUmemLocationType::*;
    assert_eq!(LOCATION_DEVICE, CU_MEM_LOCATION_TYPE_DEVICE as u32);
    assert_eq!(LOCATION_HOST_NUMA, CU_MEM_LOCATION_TYPE_HOST_NUMA as u32);
    assert_eq!(
        ALLOCATION_PINNED,
        sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED as u32
    );
    assert_eq!(
        ACCESS_READWRITE,
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u32
    );
    assert_eq!(
        POOL_ATTR_RELEASE_THRESHOLD,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD as u32
    );
    assert_eq!(
        GRANULARITY_MINIMUM,
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM as u32
    );
}
