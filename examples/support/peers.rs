//! Whole programs compared allocator by allocator (`benches/rss.rs`, `examples/mixed_workload.rs`):
//! each allocator is the `#[global_allocator]` of its own child process, chosen from the
//! environment; the parent takes the median of what the children measured.
//!
//! Included with `#[path]` by both.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// One choice: the name the environment variable gives it, and the allocator.
pub type Peer = (&'static str, &'static (dyn GlobalAlloc + Sync));

/// A global allocator that sends every call to the peer the environment variable `var` names
/// (the system allocator when it is unset or names none), chosen on the first request and never
/// changed, so each pointer is freed by the allocator that made it. Every peer pays the same: one
/// load and one indirect call per request.
pub struct ChosenAllocator {
    var: &'static CStr,
    peers: &'static [Peer],
    /// 1 + the index in `peers`; `NONE` for the system allocator; 0 until chosen.
    chosen: AtomicUsize,
}

const NONE: usize = usize::MAX;

impl ChosenAllocator {
    /// Chooses among `peers` by the value of `var`.
    pub const fn new(var: &'static CStr, peers: &'static [Peer]) -> Self {
        ChosenAllocator {
            var,
            peers,
            chosen: AtomicUsize::new(0),
        }
    }

    /// The environment variable's name.
    pub fn var(&self) -> &'static str {
        self.var.to_str().unwrap_or_default()
    }

    fn choice(&self) -> usize {
        match self.chosen.load(Relaxed) {
            0 => {
                let choice = self.read_choice();
                self.chosen.store(choice, Relaxed);
                choice
            }
            c => c,
        }
    }

    /// `getenv`, which does not allocate (this runs inside the first allocation).
    fn read_choice(&self) -> usize {
        // SAFETY: a NUL-terminated name; nothing in these programs changes the environment.
        let value = unsafe { libc::getenv(self.var.as_ptr()) };
        if value.is_null() {
            return NONE;
        }
        // SAFETY: `getenv` returns a NUL-terminated string that lives as long as the environment.
        let name = unsafe { CStr::from_ptr(value) }.to_bytes();
        self.peers
            .iter()
            .position(|(n, _)| n.as_bytes() == name)
            .map_or(NONE, |i| i + 1)
    }

    fn allocator(&self) -> &dyn GlobalAlloc {
        match self.choice() {
            NONE => &System,
            c => self.peers[c - 1].1,
        }
    }
}

// SAFETY: every call goes to the one allocator chosen on the first request, which never changes.
unsafe impl GlobalAlloc for ChosenAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        unsafe { self.allocator().alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        unsafe { self.allocator().alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded from the caller.
        unsafe { self.allocator().dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        unsafe { self.allocator().realloc(ptr, layout, new_size) }
    }
}

/// The median of `values` (sorted in place; not empty).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
