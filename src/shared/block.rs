//! Blocks of a pool: the handle that names one in every attached process, and the block that
//! frees itself.

use std::alloc::Layout;
use std::ptr::NonNull;

use super::SharedPool;

/// A block of a [`SharedPool`], named so that any process attached to the pool finds it:
/// [`SharedPool::ptr`] turns it into that process's pointer. Plain data: send it to another
/// process however you like ([`PoolHandle::to_bytes`]).
///
/// It carries its pool's id and the block's serial: a handle of another pool, or of a block
/// freed already (even if a block of the same length was carved at its offset since), is
/// refused with [`Error::PoolHandle`](crate::Error::PoolHandle).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolHandle {
    /// Bytes from the start of the pool's file.
    pub offset: u64,
    /// The block's length (rounded up to 64 bytes).
    pub len: u64,
    /// The id of the pool that carved it (random, chosen when the pool was made).
    pub pool: u32,
    /// Which carving at this offset it names.
    pub serial: u32,
}

impl PoolHandle {
    /// The handle as 24 bytes (offset, length, pool id, serial; little-endian).
    pub fn to_bytes(self) -> [u8; 24] {
        let mut bytes = [0; 24];
        bytes[..8].copy_from_slice(&self.offset.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.len.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.pool.to_le_bytes());
        bytes[20..].copy_from_slice(&self.serial.to_le_bytes());
        bytes
    }

    /// A handle from [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(bytes: [u8; 24]) -> PoolHandle {
        let u64_at = |at: usize| {
            let mut word = [0; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(word)
        };
        let u32_at = |at: usize| {
            let mut word = [0; 4];
            word.copy_from_slice(&bytes[at..at + 4]);
            u32::from_le_bytes(word)
        };
        PoolHandle {
            offset: u64_at(0),
            len: u64_at(8),
            pool: u32_at(16),
            serial: u32_at(20),
        }
    }
}

/// A block carved from a [`SharedPool`] ([`SharedPool::allocate`]), freed back to the pool when
/// dropped. [`into_handle`](Self::into_handle) hands it over instead: the block stays live for
/// another process (or this one) to adopt with [`SharedPool::from_handle`].
///
/// Its bytes are shared with every attached process and reached through a raw pointer
/// ([`as_ptr`](Self::as_ptr)): writing them while another process reads or writes them is a
/// data race, and a registered pool's GPU copies must have completed before the block drops.
#[must_use = "dropping the block frees it"]
#[derive(Debug)]
pub struct SharedBlock<'pool> {
    pool: &'pool SharedPool,
    handle: PoolHandle,
}

impl<'pool> SharedBlock<'pool> {
    pub(super) fn new(pool: &'pool SharedPool, handle: PoolHandle) -> Self {
        SharedBlock { pool, handle }
    }

    /// The handle naming the block in every attached process; the block stays owned by this
    /// value.
    pub fn handle(&self) -> PoolHandle {
        self.handle
    }

    /// This process's pointer to the block's first byte.
    pub fn as_ptr(&self) -> NonNull<u8> {
        let addr = self.pool.inner.pool.base() + self.handle.offset as usize;
        // SAFETY: a block carved from the pool (or adopted after `is_live` said so) lies inside
        // this process's mapping of the pool (never at 0), which outlives the borrow `'pool`.
        unsafe { NonNull::new_unchecked(addr as *mut u8) }
    }

    /// The block's length in bytes (its request, rounded up to 64).
    pub fn len(&self) -> usize {
        self.handle.len as usize
    }

    /// Whether the block is empty (never: blocks are at least 64 bytes).
    pub fn is_empty(&self) -> bool {
        self.handle.len == 0
    }

    /// Gives the block up without freeing it: it stays live in the pool, named by the returned
    /// handle, until a process adopts it ([`SharedPool::from_handle`]) or frees it
    /// ([`SharedPool::free`]).
    pub fn into_handle(self) -> PoolHandle {
        let handle = self.handle;
        std::mem::forget(self);
        handle
    }
}

impl Drop for SharedBlock<'_> {
    fn drop(&mut self) {
        // A free that fails (the pool's lock held past its wait, a damaged pool) leaves the
        // block live in the pool: `reclaim` finds it once this process is gone.
        self.pool.free_owned(
            self.handle.offset,
            Some((self.handle.len, self.handle.serial)),
        );
    }
}

/// allocator-api2's `Allocator` over a pool, for 0.4 and (feature `allocator-api2-02`) 0.2.
macro_rules! shared_allocator {
    ($api:ident) => {
        // SAFETY: a block is live, and lies in the pool's mapping, from `allocate` until
        // `deallocate`; the pool outlives every borrow `&SharedPool` gives out; blocks never
        // overlap (the extent table's tables).
        unsafe impl $api::alloc::Allocator for &SharedPool {
            fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, $api::alloc::AllocError> {
                if layout.size() == 0 {
                    let dangling =
                        NonNull::new(layout.align() as *mut u8).ok_or($api::alloc::AllocError)?;
                    return Ok(NonNull::slice_from_raw_parts(dangling, 0));
                }
                let handle =
                    SharedPool::allocate_handle(self, layout).ok_or($api::alloc::AllocError)?;
                let ptr = self.ptr(handle).ok_or($api::alloc::AllocError)?;
                Ok(NonNull::slice_from_raw_parts(ptr, handle.len as usize))
            }

            unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
                if layout.size() == 0 {
                    return;
                }
                let offset = ptr.as_ptr() as usize - self.inner.pool.base();
                // The caller of `deallocate` gives the block up; it was carved for it (by
                // `allocate`, whose returned length it need not pass back: any length).
                self.free_owned(offset as u64, None);
            }
        }
    };
}

shared_allocator!(allocator_api2);
#[cfg(feature = "allocator-api2-02")]
shared_allocator!(allocator_api2_02);
