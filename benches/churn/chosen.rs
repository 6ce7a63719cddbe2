//! The global allocator of a churn process: the one `CHURN_BENCH_ALLOCATOR` names, chosen on the
//! first request.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::CStr;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

use mimalloc::MiMalloc;
use numa_gpu_alloc::{NumaGpuAlloc, Stats};
use tikv_jemallocator::Jemalloc;

/// Names the child's allocator; unset in the driver.
pub const VAR: &CStr = c"CHURN_BENCH_ALLOCATOR";

/// The allocators, in the table's order.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    OursMimalloc,
    Mimalloc,
    Jemalloc,
    Glibc,
    OursGlibc,
}

impl Peer {
    pub const ALL: [Peer; 5] = [
        Peer::OursMimalloc,
        Peer::Mimalloc,
        Peer::Jemalloc,
        Peer::Glibc,
        Peer::OursGlibc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Peer::OursMimalloc => "ours/mimalloc",
            Peer::Mimalloc => "mimalloc",
            Peer::Jemalloc => "jemalloc",
            Peer::Glibc => "glibc",
            Peer::OursGlibc => "ours/glibc",
        }
    }
}

/// Sends every request of the process to the allocator `CHURN_BENCH_ALLOCATOR` names (glibc when
/// it is unset: the driver), read on the first request and never changed, so that each pointer is
/// freed by the allocator that made it. Every allocator pays the same: one relaxed load and a
/// match per request.
pub struct Chosen {
    /// 0 until the first request, then 1 + the chosen allocator's index in [`Peer::ALL`].
    chosen: AtomicU8,
    ours_mimalloc: NumaGpuAlloc<MiMalloc>,
    ours_glibc: NumaGpuAlloc,
}

impl Chosen {
    #[inline]
    fn peer(&self) -> Peer {
        match self.chosen.load(Relaxed) {
            1 => Peer::OursMimalloc,
            2 => Peer::Mimalloc,
            3 => Peer::Jemalloc,
            4 => Peer::Glibc,
            5 => Peer::OursGlibc,
            _ => self.choose(),
        }
    }

    /// Reads the variable with `getenv`, which does not allocate (this runs inside the first
    /// request). Two threads racing here read the same value.
    #[cold]
    fn choose(&self) -> Peer {
        // SAFETY: a NUL-terminated name; nothing in this program changes its environment.
        let value = unsafe { libc::getenv(VAR.as_ptr()) };
        let index = if value.is_null() {
            None
        } else {
            // SAFETY: `getenv` returns a NUL-terminated string that lives as long as the
            // environment, which is never changed.
            let name = unsafe { CStr::from_ptr(value) }.to_bytes();
            Peer::ALL.iter().position(|p| p.name().as_bytes() == name)
        };
        let index = index.unwrap_or(3); // glibc
        self.chosen.store(index as u8 + 1, Relaxed);
        Peer::ALL[index]
    }

    /// Ours' statistics, when ours serves this process.
    pub fn stats(&self) -> Option<Stats> {
        match self.peer() {
            Peer::OursMimalloc => Some(self.ours_mimalloc.stats()),
            Peer::OursGlibc => Some(self.ours_glibc.stats()),
            _ => None,
        }
    }
}

/// `$call`, with `$a` bound to the chosen allocator.
macro_rules! dispatch {
    ($self:ident, $a:ident => $call:expr) => {
        match $self.peer() {
            Peer::OursMimalloc => {
                let $a = &$self.ours_mimalloc;
                $call
            }
            Peer::Mimalloc => {
                let $a = &MiMalloc;
                $call
            }
            Peer::Jemalloc => {
                let $a = &Jemalloc;
                $call
            }
            Peer::Glibc => {
                let $a = &System;
                $call
            }
            Peer::OursGlibc => {
                let $a = &$self.ours_glibc;
                $call
            }
        }
    };
}

// SAFETY: every request goes to the one allocator chosen on the first request, which never
// changes, so every pointer is freed and reallocated by the allocator that made it; each of them
// upholds `GlobalAlloc`'s contract.
unsafe impl GlobalAlloc for Chosen {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        dispatch!(self, a => unsafe { a.alloc(layout) })
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        dispatch!(self, a => unsafe { a.alloc_zeroed(layout) })
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded from the caller; `ptr` came from the same allocator (see above).
        dispatch!(self, a => unsafe { a.dealloc(ptr, layout) })
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded from the caller; `ptr` came from the same allocator (see above).
        dispatch!(self, a => unsafe { a.realloc(ptr, layout, new_size) })
    }
}

#[global_allocator]
pub static ALLOC: Chosen = Chosen {
    chosen: AtomicU8::new(0),
    ours_mimalloc: NumaGpuAlloc::with_inner(MiMalloc),
    ours_glibc: NumaGpuAlloc::new(),
};
