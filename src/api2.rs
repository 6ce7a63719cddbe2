//! The `allocator_api2::alloc::Allocator` front end (for `Vec::new_in`, `Box::new_in`), for
//! allocator-api2 0.4 and — because hashbrown uses it — 0.2. The two traits have the same shape;
//! one macro implements both over the large/small dispatch in `alloc.rs`.
//!
//! Unsafe code here relies on allocator-api2's contract, forwarded to the large/small dispatch of
//! `alloc.rs`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::ptr::NonNull;

use crate::NumaGpuAlloc;

impl<A: GlobalAlloc> NumaGpuAlloc<A> {
    /// Allocates `layout`; zero-size requests get a dangling, aligned pointer.
    #[inline]
    fn allocate_slice(&self, layout: Layout, zeroed: bool) -> Option<NonNull<[u8]>> {
        let ptr = if layout.size() == 0 {
            dangling(layout)
        } else {
            NonNull::new(self.allocate(layout, zeroed))?
        };
        Some(NonNull::slice_from_raw_parts(ptr, layout.size()))
    }

    /// Moves or resizes an allocation to `new`, handling zero sizes.
    ///
    /// # Safety
    /// `ptr` is live in this allocator with layout `old`.
    #[inline]
    unsafe fn resize_slice(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Option<NonNull<[u8]>> {
        if old.size() == 0 {
            return self.allocate_slice(new, false);
        }
        if new.size() == 0 {
            // SAFETY: forwarded from the caller.
            unsafe { self.deallocate(ptr.as_ptr(), old) };
            return Some(NonNull::slice_from_raw_parts(dangling(new), 0));
        }
        // SAFETY: forwarded from the caller; both sizes are non-zero.
        let moved = NonNull::new(unsafe { self.reallocate(ptr.as_ptr(), old, new) })?;
        Some(NonNull::slice_from_raw_parts(moved, new.size()))
    }

    /// # Safety
    /// `ptr` is live in this allocator with `layout`.
    #[inline]
    unsafe fn deallocate_nonzero(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() != 0 {
            // SAFETY: forwarded from the caller.
            unsafe { self.deallocate(ptr.as_ptr(), layout) }
        }
    }
}

#[inline]
fn dangling(layout: Layout) -> NonNull<u8> {
    // An aligned, non-null address that is never dereferenced (as `Layout::dangling` does).
    NonNull::new(layout.align() as *mut u8).unwrap_or(NonNull::dangling())
}

macro_rules! impl_allocator {
    ($api:path) => {
        use $api as api;

        // SAFETY: blocks returned are valid for their layout until deallocated through this
        // allocator (or its references, or another value of the same threshold and inner
        // allocator: blocks live in the process's arenas), so
        // moving the value keeps them valid; resizing preserves contents; nothing unwinds.
        unsafe impl<A: GlobalAlloc> api::Allocator for NumaGpuAlloc<A> {
            #[inline]
            fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, api::AllocError> {
                self.allocate_slice(layout, false).ok_or(api::AllocError)
            }

            #[inline]
            fn allocate_zeroed(&self, layout: Layout) -> Result<NonNull<[u8]>, api::AllocError> {
                self.allocate_slice(layout, true).ok_or(api::AllocError)
            }

            #[inline]
            unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
                // SAFETY: the trait's contract: `ptr` is live here with `layout`.
                unsafe { self.deallocate_nonzero(ptr, layout) }
            }

            #[inline]
            unsafe fn grow(
                &self,
                ptr: NonNull<u8>,
                old: Layout,
                new: Layout,
            ) -> Result<NonNull<[u8]>, api::AllocError> {
                // SAFETY: the trait's contract: `ptr` is live here with `old`.
                unsafe { self.resize_slice(ptr, old, new) }.ok_or(api::AllocError)
            }

            #[inline]
            unsafe fn shrink(
                &self,
                ptr: NonNull<u8>,
                old: Layout,
                new: Layout,
            ) -> Result<NonNull<[u8]>, api::AllocError> {
                // SAFETY: the trait's contract: `ptr` is live here with `old`.
                unsafe { self.resize_slice(ptr, old, new) }.ok_or(api::AllocError)
            }
        }
    };
}

mod v04 {
    use super::*;
    impl_allocator!(allocator_api2::alloc);
}

#[cfg(feature = "allocator-api2-02")]
mod v02 {
    use super::*;
    impl_allocator!(allocator_api2_02::alloc);
}
