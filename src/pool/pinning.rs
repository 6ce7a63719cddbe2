//! This process's registrations of a shared pool: one `cuMemHostRegister` per chunk (a chunk
//! is at most the registration bound, and no block crosses one, so none straddles two), each
//! under the pool's registration lock so that two of its processes never register at the same
//! moment, and counted in the process's page-locked bytes and in the pool's header. Released
//! (unregistered) before the mapping goes: the pool's owner drops these first.
//!
//! Each process's registration is its own: the kernel counts the chunks it page-locks against
//! that process (its locked memory, `RLIMIT_MEMLOCK` where it applies), and the driver keeps a
//! page table of its own for each registration (16 bytes per 4 KiB page). N processes that
//! register one pool of S bytes keep one copy of the memory, but pay N registrations.
//!
//! Unsafe code here relies on every registered range lying inside the pool's mapping, which its
//! owner keeps mapped until [`Pinned::release`] ran.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{PoolMap, DATA_START};
use crate::chunk::{give_page_locked, take_page_locked, PinFlags};
use crate::cuda::Gpu;
use crate::sys::lock::Lock;
use crate::Error;

/// What [`Pinned::register`] did.
pub(crate) enum Registration {
    /// Registered, the driver call taking this long.
    Made(Duration),
    /// Registered before.
    Already,
    /// Cancelled while it waited for the pool's registration lock.
    Cancelled,
}

struct Registered {
    gpu: &'static Gpu,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a registration may be released from any thread (the context is pushed for the call).
unsafe impl Send for Registered {}

/// The chunks this process registered.
pub(crate) struct Pinned {
    /// Held through a whole registration (the wait for the pool's registration lock, which
    /// another process holds for as long as its driver call takes, and this process's call), so that
    /// two threads of this process never register one chunk twice.
    registering: Lock<()>,
    /// The registered chunks, locked only to read or change the list: the pool's stats read
    /// it, and must not wait behind a registration.
    chunks: Lock<Vec<Registered>>,
}

impl Pinned {
    pub(crate) const fn new() -> Pinned {
        Pinned {
            registering: Lock::new(()),
            chunks: Lock::new(Vec::new()),
        }
    }

    /// The chunks of `map` (from its blocks' start), by index: offset and length.
    pub(crate) fn chunk_range(map: &PoolMap, index: usize) -> Option<(usize, usize)> {
        let chunk = map.chunk() as usize;
        let start = DATA_START.checked_add(index.checked_mul(chunk)?)?;
        (start < map.len()).then(|| (start, chunk.min(map.len() - start)))
    }

    /// Registers chunk `index` of `map` through `gpu`, holding the pool's registration lock
    /// (waiting for it at most `wait`, and only until `cancel` is set), within `flags.limit`
    /// page-locked bytes.
    pub(crate) fn register(
        &self,
        map: &PoolMap,
        index: usize,
        gpu: &'static Gpu,
        flags: PinFlags,
        (cancel, wait): (&AtomicBool, Duration),
    ) -> Result<Registration, Error> {
        let (offset, len) = Pinned::chunk_range(map, index).ok_or(Error::InvalidRange {
            addr: index,
            len: 0,
        })?;
        let ptr = NonNull::new(map.ptr().as_ptr().wrapping_add(offset))
            .ok_or(Error::InvalidRange { addr: offset, len })?;
        let _one_at_a_time = self.registering.lock();
        if self.chunks.lock().iter().any(|r| r.ptr == ptr) {
            return Ok(Registration::Already);
        }
        let Some(lock) = map.lock_registration(cancel, wait)? else {
            return Ok(Registration::Cancelled);
        };
        take_page_locked(len, flags.limit)?;
        let start = Instant::now();
        // SAFETY: a chunk of the pool's mapping, not registered by this process yet (each
        // index once), mapped until `release` unregistered it.
        let registered = unsafe { gpu.register(ptr, len, flags.register) };
        let took = start.elapsed();
        drop(lock);
        if let Err(e) = registered {
            give_page_locked(len);
            return Err(e);
        }
        self.chunks.lock().push(Registered { gpu, ptr, len });
        map.header().registrations.fetch_add(1, Ordering::AcqRel);
        Ok(Registration::Made(took))
    }

    /// Chunks registered, and their bytes.
    pub(crate) fn count(&self) -> (usize, usize) {
        let chunks = self.chunks.lock();
        (chunks.len(), chunks.iter().map(|r| r.len).sum())
    }

    /// Unregisters every chunk; false when one could not be (a forked child, the process
    /// exiting, the driver refused): then the mapping must stay.
    pub(crate) fn release(&self, map: &PoolMap) -> bool {
        let mut all = true;
        let chunks = std::mem::take(&mut *self.chunks.lock());
        for r in chunks {
            // SAFETY: the base of a successful registration, still mapped (the owner unmaps
            // only after this), released once (taken out of the list).
            match unsafe { r.gpu.unregister(r.ptr) } {
                Ok(()) => {
                    give_page_locked(r.len);
                    map.header().registrations.fetch_sub(1, Ordering::AcqRel);
                }
                Err(_) => all = false,
            }
        }
        all
    }
}
