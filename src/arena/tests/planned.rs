//! Where the arena's tests get memory for dedicated blocks at addresses they plan: a source of
//! ranges of one inaccessible region, which the arena only keeps books on.
#![allow(unsafe_code)]

use super::*;
use crate::chunk::{Mapping, Memory};

/// A dedicated block of `capacity` bytes at `offset` of the region [`Planned`] maps, made with
/// pinning or not (nothing registers it: the arena only reads its kind).
pub(in crate::arena) fn dedicated(offset: usize, capacity: usize, pinned: bool) -> Dedicated {
    let kind = Kind {
        pinned,
        ..Kind::default()
    };
    NEXT_OFFSET.set(offset);
    let mapping = Mapping::new(&PLANNED, capacity, PAGE).expect("inside the planned region");
    Dedicated::new(Memory::new(mapping), 0, kind, None)
}

/// The start of the region [`Planned`] hands out, plus `offset`.
pub(in crate::arena) fn planned(offset: usize) -> usize {
    planned_base() + offset
}

/// Bytes of the region [`Planned`] hands out ranges of.
const PLANNED_REGION: usize = 16 << 30;

thread_local! {
    /// Where in the region the next range [`Planned`] maps starts.
    static NEXT_OFFSET: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Ranges this thread's tests gave back to [`Planned`].
    static UNMAPPED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many ranges this thread's tests gave back to [`Planned`] so far.
pub(in crate::arena) fn unmapped() -> usize {
    UNMAPPED.get()
}

/// The region's start, 1 GiB aligned: mapped once, inaccessible (`PROT_NONE`: a touch faults),
/// never unmapped.
fn planned_base() -> usize {
    static BASE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BASE.get_or_init(|| {
        let len = PLANNED_REGION + (1 << 30);
        // SAFETY: a fresh anonymous mapping the kernel places; nothing else knows of it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mapping the planned region");
        (ptr as usize).next_multiple_of(1 << 30)
    })
}

/// Dedicated blocks at the places a test plans, so that it can name their addresses: ranges of
/// one region, at the offset [`dedicated`] asks for. The arena only keeps books on them, so the
/// region is inaccessible (a test that touched one would fault, rather than pass), ranges of
/// tests running at once may overlap, and giving one back only counts it ([`unmapped`]).
#[derive(Debug)]
struct Planned;

static PLANNED: Planned = Planned;

// SAFETY: not as the trait asks, on purpose: the ranges are of a region mapped `PROT_NONE`,
// never unmapped, that nothing reads or writes (a touch faults instead of using memory another
// test was given); none of the calls allocates.
unsafe impl crate::chunk::ChunkSource for Planned {
    fn map(&self, len: usize, _align: usize) -> Result<std::ptr::NonNull<u8>, crate::Error> {
        let offset = NEXT_OFFSET.get();
        assert!(offset + len <= PLANNED_REGION, "{offset:#x} + {len:#x}");
        Ok(std::ptr::NonNull::new(planned(offset) as *mut u8).expect("mapped"))
    }

    unsafe fn unmap(&self, _ptr: std::ptr::NonNull<u8>, _len: usize) -> Result<(), crate::Error> {
        UNMAPPED.set(UNMAPPED.get() + 1);
        Ok(())
    }

    unsafe fn purge(&self, _ptr: std::ptr::NonNull<u8>, _len: usize) -> Result<(), crate::Error> {
        Ok(())
    }
}
