//! A counting inner allocator under `NumaGpuAlloc` (its own binary: one instance is the process's
//! `#[global_allocator]`): every small alloc, free and realloc reaches the inner allocator and no
//! other request does; the inner allocator is never asked to free a pointer it did not hand out.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

use allocator_api2::vec::Vec as Vec2;
use numa_gpu_alloc::NumaGpuAlloc;

mod common {
    pub mod pattern;
    pub mod workload;
}

/// Held by each test: both allocator values share the process's node arenas, whose live bytes
/// each test checks.
static SERIAL: Mutex<()> = Mutex::new(());

/// Addresses handed out by every [`Counting`] instance and not freed yet: an open-addressing set
/// that allocates nothing (it runs inside the global allocator).
struct LiveSet {
    slots: [AtomicUsize; LIVE_SLOTS],
}

const LIVE_SLOTS: usize = 1 << 20;
const EMPTY: usize = 0;
const REMOVED: usize = 1;

static LIVE: LiveSet = LiveSet {
    slots: [const { AtomicUsize::new(EMPTY) }; LIVE_SLOTS],
};

impl LiveSet {
    fn probe(addr: usize) -> impl Iterator<Item = usize> {
        let start = (addr >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) % LIVE_SLOTS;
        (0..LIVE_SLOTS).map(move |i| (start + i) % LIVE_SLOTS)
    }

    /// Adds `addr`; false when the set is full.
    fn insert(&self, addr: usize) -> bool {
        Self::probe(addr).any(|i| {
            let slot = &self.slots[i];
            let current = slot.load(Relaxed);
            (current == EMPTY || current == REMOVED)
                && slot
                    .compare_exchange(current, addr, Relaxed, Relaxed)
                    .is_ok()
        })
    }

    /// Removes `addr`; false when it is not in the set.
    fn remove(&self, addr: usize) -> bool {
        for i in Self::probe(addr) {
            let slot = &self.slots[i];
            match slot.load(Relaxed) {
                EMPTY => return false,
                a if a == addr => {
                    return slot
                        .compare_exchange(addr, REMOVED, Relaxed, Relaxed)
                        .is_ok()
                }
                _ => {}
            }
        }
        false
    }

    fn contains(&self, addr: usize) -> bool {
        Self::probe(addr)
            .map(|i| self.slots[i].load(Relaxed))
            .take_while(|&a| a != EMPTY)
            .any(|a| a == addr)
    }
}

/// `System`, counting its calls and recording the addresses it hands out in [`LIVE`].
struct Counting {
    allocs: AtomicU64,
    zeroed_allocs: AtomicU64,
    deallocs: AtomicU64,
    reallocs: AtomicU64,
    /// Frees (or reallocs) of addresses this allocator did not hand out, or the set was full.
    errors: AtomicU64,
}

/// The calls a [`Counting`] received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Calls {
    allocs: u64,
    zeroed_allocs: u64,
    deallocs: u64,
    reallocs: u64,
    errors: u64,
}

impl Counting {
    const fn new() -> Self {
        Counting {
            allocs: AtomicU64::new(0),
            zeroed_allocs: AtomicU64::new(0),
            deallocs: AtomicU64::new(0),
            reallocs: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        }
    }

    fn calls(&self) -> Calls {
        Calls {
            allocs: self.allocs.load(Relaxed),
            zeroed_allocs: self.zeroed_allocs.load(Relaxed),
            deallocs: self.deallocs.load(Relaxed),
            reallocs: self.reallocs.load(Relaxed),
            errors: self.errors.load(Relaxed),
        }
    }

    fn record(&self, ok: bool) {
        if !ok {
            self.errors.fetch_add(1, Relaxed);
        }
    }

    fn handed_out(&self, ptr: *mut u8) -> *mut u8 {
        if !ptr.is_null() {
            self.record(LIVE.insert(ptr as usize));
        }
        ptr
    }
}

// SAFETY: forwards every call to `System`; the bookkeeping neither allocates nor unwinds.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocs.fetch_add(1, Relaxed);
        // SAFETY: forwarded from the caller.
        self.handed_out(unsafe { System.alloc(layout) })
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.zeroed_allocs.fetch_add(1, Relaxed);
        // SAFETY: forwarded from the caller.
        self.handed_out(unsafe { System.alloc_zeroed(layout) })
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        self.deallocs.fetch_add(1, Relaxed);
        let mine = LIVE.remove(ptr as usize);
        self.record(mine);
        if mine {
            // SAFETY: forwarded from the caller; `System` handed out `ptr` (it was in `LIVE`).
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.reallocs.fetch_add(1, Relaxed);
        if !LIVE.remove(ptr as usize) {
            self.record(false);
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded from the caller; `System` handed out `ptr`.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if moved.is_null() {
            self.record(LIVE.insert(ptr as usize));
            return moved;
        }
        self.handed_out(moved)
    }
}

const CACHE_LIMIT: usize = 256 << 20;

#[global_allocator]
static GLOBAL: NumaGpuAlloc<Counting> =
    NumaGpuAlloc::with_inner(Counting::new()).cache_limit(CACHE_LIMIT);

const THRESHOLD: usize = 64 << 10;

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

/// A request above the threshold reaches the inner allocator only when it is a small one's
/// realloc, and then only for the small side.
#[test]
fn every_small_call_reaches_the_inner_allocator_and_nothing_else() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    // Not the global allocator: its own re-entrant requests go to the global one, so its
    // `Counting` sees exactly the calls below.
    let ours = NumaGpuAlloc::with_inner(Counting::new()).threshold(THRESHOLD);
    let sizes = [1, 8, 100, 4096, 4097, THRESHOLD - 1];
    let aligns = [1, 16, 4096];
    let mut expected = Calls::default();
    // SAFETY (whole block): every pointer is freed once, with the layout it was allocated with.
    unsafe {
        for (i, &size) in sizes.iter().enumerate() {
            for &align in &aligns {
                let small = layout(size, align);
                let p = ours.alloc(small);
                let z = ours.alloc_zeroed(small);
                assert!(!p.is_null() && !z.is_null());
                assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                let grown = ours.realloc(p, small, size + i + 1);
                assert!(!grown.is_null());
                ours.dealloc(grown, layout(size + i + 1, align));
                ours.dealloc(z, small);
                expected.allocs += 1;
                expected.zeroed_allocs += 1;
                expected.reallocs += u64::from(size + i + 1 < THRESHOLD);
                // Two frees either way: a realloc across the threshold frees `p` here, and the
                // large block it moved to goes back to the arena.
                expected.deallocs += 2;
            }
        }
        assert_eq!(ours.inner().calls(), expected, "small calls");
        let crossed = ours.stats().large_allocations;
        assert_eq!(
            crossed,
            aligns.len() as u64,
            "reallocs of THRESHOLD - 1 crossed it"
        );

        // Large requests, frees, in-place and moving reallocs: none reaches the inner allocator.
        let large = layout(THRESHOLD, 8);
        let a = ours.alloc(large);
        let b = ours.alloc_zeroed(layout(3 * THRESHOLD, 4096));
        let a = ours.realloc(a, large, THRESHOLD + 100);
        let a = ours.realloc(a, layout(THRESHOLD + 100, 8), 8 * THRESHOLD);
        ours.dealloc(a, layout(8 * THRESHOLD, 8));
        ours.dealloc(b, layout(3 * THRESHOLD, 4096));
        let stats = ours.stats();
        assert_eq!(stats.large_allocations, crossed + 3);
        assert_eq!((stats.in_place_reallocs, stats.live_bytes()), (1, 0));
        assert_eq!(
            ours.inner().calls(),
            expected,
            "large calls reach the arena only"
        );

        // Across the threshold: small → large frees the small block in the inner allocator,
        // large → small allocates the small one there; the large side stays in the arena.
        let p = ours.alloc(layout(1000, 8));
        let big = ours.realloc(p, layout(1000, 8), 2 * THRESHOLD);
        let back = ours.realloc(big, layout(2 * THRESHOLD, 8), 500);
        ours.dealloc(back, layout(500, 8));
        expected.allocs += 2;
        expected.deallocs += 2;
        assert_eq!(ours.inner().calls(), expected, "across the threshold");
        assert_eq!(ours.stats().large_allocations, crossed + 4);
    }

    // allocator-api2: a vector grown from small to large and dropped.
    let large_before = ours.stats().large_allocations;
    let mut v: Vec2<u64, _> = Vec2::new_in(&ours);
    for i in 0..THRESHOLD as u64 {
        v.push(i);
    }
    assert_eq!(
        v.iter().sum::<u64>(),
        (THRESHOLD as u64) * (THRESHOLD as u64 - 1) / 2
    );
    drop(v);
    let calls = ours.inner().calls();
    // The first capacity is allocated, the small ones after it reallocated, in the inner
    // allocator; the last small one is freed there when the vector crosses the threshold.
    assert_eq!(calls.allocs, expected.allocs + 1);
    assert!(calls.reallocs > expected.reallocs);
    assert_eq!(
        calls.allocs + calls.zeroed_allocs,
        calls.deallocs,
        "all freed there"
    );
    assert_eq!(calls.errors, 0);
    assert!(
        ours.stats().large_allocations > large_before,
        "the large capacities to the arena"
    );
}

/// As the global allocator, under threads: the allocator's own requests (initialisation, the
/// arena's maps, populate threads) go to the inner allocator too, so it frees only what it handed
/// out, and large blocks never reach it.
#[test]
fn the_global_inner_allocator_frees_only_what_it_handed_out() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    common::workload::run_and_check(&GLOBAL, CACHE_LIMIT);
    let small = vec![1u8; 1000];
    let large = vec![1u8; 4 << 20];
    assert!(LIVE.contains(small.as_ptr() as usize));
    assert!(!LIVE.contains(large.as_ptr() as usize));
    let calls = GLOBAL.inner().calls();
    assert!(calls.allocs > 0 && calls.deallocs > 0);
    assert_eq!(
        calls.errors, 0,
        "frees of pointers the inner allocator did not hand out"
    );
}
