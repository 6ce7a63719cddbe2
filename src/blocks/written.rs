//! Whether a very large request not asked zeroed will be written whole, learnt from what the
//! process did with the last one it got lazily.
//!
//! A request not asked zeroed is usually written before it is read, so its pages are populated
//! in bulk by the node's workers ([`Blocks::populates_request`](super::Blocks)). Past
//! [`SURE_MAX`] that bet costs too much when it loses: `sort -S 1G` asks for 1 GiB and touches a
//! few MiB of it, and populating it all made its peak 1,155 MiB against glibc's 78 MiB. So a
//! block that large is handed out lazily first and watched: when it is freed, a few of its
//! pages spread over it are looked at (`move_pages`, nothing touched; a page only read is the
//! kernel's shared zero page and does not count); if every one was written, its user wrote it
//! whole, and the next [`CREDIT`] such requests are populated in bulk, after which one is
//! handed out lazily again to look once more. A watched block that `realloc` moves or copies
//! (reading it whole) is no longer watched. Lazily handed out, a whole write
//! costs a fault per page (a huge page each where huge pages pay): the bulk populate is the
//! gain, not the correctness.
//!
//! Process-wide (the arenas are): one watched block at a time, by address and length (a block
//! freed with another length is not it). Atomics only: a fork copies them whole, and nothing
//! here allocates or locks.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// Requests not asked zeroed up to this size are always populated in bulk.
pub(crate) const SURE_MAX: usize = 256 << 20;
/// Larger requests populated in bulk after one was seen written whole, before looking again.
const CREDIT: u32 = 8;
/// Pages looked at when the watched block is freed.
const SAMPLES: usize = 8;

/// Bulk populates left before the next larger request is handed out lazily and watched.
static CREDIT_LEFT: AtomicU32 = AtomicU32::new(0);
/// The watched block's address (0: none) and length.
static WATCHED_ADDR: AtomicUsize = AtomicUsize::new(0);
static WATCHED_LEN: AtomicUsize = AtomicUsize::new(0);

/// Whether a new block of `capacity` bytes for a request not asked zeroed is populated in bulk:
/// always up to [`SURE_MAX`]; beyond, while the last watched block was written whole (one
/// credit spent each).
pub(crate) fn populate_in_bulk(capacity: usize) -> bool {
    capacity <= SURE_MAX
        || CREDIT_LEFT
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                left.checked_sub(1)
            })
            .is_ok()
}

/// Watches a block of `len` bytes at `addr` just handed out lazily for a request not asked
/// zeroed and larger than [`SURE_MAX`].
pub(crate) fn watch(addr: usize, len: usize) {
    WATCHED_LEN.store(len, Ordering::Relaxed);
    WATCHED_ADDR.store(addr, Ordering::Release);
}

/// Called with a dedicated block just freed (its address and capacity; still mapped, held in
/// its arena's cache or about to be released by the caller): when it is the watched block,
/// looks at how much of it its user wrote and sets the credit. A watch whose length is not the
/// block's (a watch torn by two threads, an address reused) teaches nothing.
pub(crate) fn freed(addr: usize, capacity: usize) {
    // Plain loads first: every free passes here, and a failed exchange would still take the
    // line from the other threads.
    if addr == 0
        || WATCHED_ADDR.load(Ordering::Relaxed) != addr
        || WATCHED_LEN.load(Ordering::Relaxed) != capacity
        || !forget(addr)
    {
        return;
    }
    let Some(ptr) = NonNull::new(addr as *mut u8) else {
        return;
    };
    // Written, not only read: a page only read is the kernel's shared zero page.
    if let Some((written, sampled)) = crate::sys::written_sample(ptr, capacity, SAMPLES) {
        let whole = sampled > 0 && written == sampled;
        CREDIT_LEFT.store(if whole { CREDIT } else { 0 }, Ordering::Relaxed);
    }
}

/// Stops watching the block at `addr` (it moves: a `realloc` copies it, reading it whole, or
/// grows it by moving its pages); whether it was watched.
pub(crate) fn forget(addr: usize) -> bool {
    WATCHED_ADDR.load(Ordering::Relaxed) == addr
        && WATCHED_ADDR
            .compare_exchange(addr, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;
    use crate::chunk::{Mapping, ANONYMOUS};

    /// One test drives the process-wide state through every outcome (tests run in parallel).
    #[test]
    fn a_large_block_written_whole_earns_bulk_populates_and_one_barely_touched_or_read_ends_them() {
        let len = 8 << 20;
        let page = crate::sys::page_size();
        assert!(populate_in_bulk(SURE_MAX), "up to the bound: always");
        CREDIT_LEFT.store(0, Ordering::Relaxed);
        assert!(
            !populate_in_bulk(SURE_MAX + 1),
            "no credit: lazily, and watched"
        );

        let whole = Mapping::new(&ANONYMOUS, len, page).expect("mmap");
        let addr = whole.ptr().as_ptr() as usize;
        // SAFETY: the mapping is this test's, `len` bytes long.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 1, len) };
        watch(addr, len);
        freed(addr + page, len);
        freed(addr, len / 2);
        assert_eq!(
            CREDIT_LEFT.load(Ordering::Relaxed),
            0,
            "another block: nothing"
        );
        freed(addr, len);
        assert_eq!(CREDIT_LEFT.load(Ordering::Relaxed), CREDIT, "written whole");
        for _ in 0..CREDIT {
            assert!(populate_in_bulk(SURE_MAX + 1));
        }
        assert!(
            !populate_in_bulk(SURE_MAX + 1),
            "credit spent: watched again"
        );

        let barely = Mapping::new(&ANONYMOUS, len, page).expect("mmap");
        let addr = barely.ptr().as_ptr() as usize;
        // SAFETY: the first byte of this test's mapping.
        unsafe { (addr as *mut u8).write(1) };
        CREDIT_LEFT.store(CREDIT, Ordering::Relaxed);
        watch(addr, len);
        freed(addr, len);
        assert_eq!(
            CREDIT_LEFT.load(Ordering::Relaxed),
            0,
            "barely touched: lazily"
        );

        // Read whole, written nowhere: every page is the kernel's zero page, which `move_pages`
        // tells apart where it is allowed (`mincore` counts them resident).
        let read = Mapping::new(&ANONYMOUS, len, page).expect("mmap");
        let addr = read.ptr().as_ptr() as usize;
        let sum = (0..len).step_by(page).fold(0u8, |sum, at| {
            // SAFETY: inside this test's mapping.
            sum.wrapping_add(unsafe { std::ptr::read_volatile((addr + at) as *const u8) })
        });
        assert_eq!(sum, 0);
        let tells_zero_page = crate::sys::written_sample(read.ptr(), len, SAMPLES)
            != crate::sys::resident_sample(read.ptr(), len, SAMPLES);
        CREDIT_LEFT.store(0, Ordering::Relaxed);
        watch(addr, len);
        assert!(forget(addr), "a moving block is no longer watched");
        freed(addr, len);
        watch(addr, len);
        CREDIT_LEFT.store(CREDIT, Ordering::Relaxed);
        freed(addr, len);
        if tells_zero_page {
            assert_eq!(CREDIT_LEFT.load(Ordering::Relaxed), 0, "only read: lazily");
        }
    }
}
