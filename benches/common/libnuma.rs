//! The peers `benches/alloc.rs` reaches through the C ABI: libnuma, opened at run time, and
//! plain `mmap` with a touch of every page.

use std::ffi::{c_int, c_void};

type NumaAvailable = unsafe extern "C" fn() -> c_int;
type NumaAllocOnnode = unsafe extern "C" fn(usize, c_int) -> *mut c_void;
type NumaFree = unsafe extern "C" fn(*mut c_void, usize);

/// libnuma, opened at run time.
pub struct Libnuma {
    alloc_onnode: NumaAllocOnnode,
    free: NumaFree,
    /// Keeps the library mapped while the function pointers above are in use.
    _lib: libloading::Library,
}

impl Libnuma {
    pub fn open() -> Result<Self, String> {
        // SAFETY: libnuma's initialisers only read sysfs; loading it has no other side effects.
        let lib = unsafe { libloading::Library::new("libnuma.so.1") }.map_err(|e| e.to_string())?;
        // SAFETY: the symbols are looked up with libnuma's C signatures (numa.h).
        let (available, alloc_onnode, free) = unsafe {
            let available = *lib
                .get::<NumaAvailable>(b"numa_available\0")
                .map_err(|e| e.to_string())?;
            let alloc_onnode = *lib
                .get::<NumaAllocOnnode>(b"numa_alloc_onnode\0")
                .map_err(|e| e.to_string())?;
            let free = *lib
                .get::<NumaFree>(b"numa_free\0")
                .map_err(|e| e.to_string())?;
            (available, alloc_onnode, free)
        };
        // SAFETY: numa_available takes no arguments; numa.h requires calling it first.
        if unsafe { available() } < 0 {
            return Err("numa_available() < 0".to_owned());
        }
        Ok(Libnuma {
            alloc_onnode,
            free,
            _lib: lib,
        })
    }

    pub fn alloc(&self, len: usize, node: usize) -> *mut u8 {
        // SAFETY: plain C call; a null return is checked by the callers.
        unsafe { (self.alloc_onnode)(len, node as c_int) }.cast()
    }

    /// # Safety
    /// `ptr` came from [`Self::alloc`] with `len`.
    pub unsafe fn release(&self, ptr: *mut u8, len: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { (self.free)(ptr.cast(), len) }
    }
}

pub fn mmap_anon(len: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED, "mmap of {len} bytes failed");
    ptr.cast()
}

/// Writes one byte in every page of `[ptr, ptr + len)`, as a first use of a buffer would.
pub fn touch_pages(ptr: *mut u8, len: usize) {
    assert!(!ptr.is_null(), "allocation of {len} bytes failed");
    for offset in (0..len).step_by(4096) {
        // SAFETY: `ptr` is a live allocation of at least `len` bytes owned by the caller.
        unsafe { ptr.add(offset).write_volatile(1) };
    }
}
