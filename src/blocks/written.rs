//! Whether a very large request not asked zeroed will be written whole, learnt from what the
//! process did with the last one it got lazily.
//!
//! A request not asked zeroed is usually written before it is read, so its pages are populated
//! in bulk by the node's workers ([`Blocks::populates_request`](super::Blocks)). Past
//! [`SURE_MAX`] that bet costs too much when it loses: `sort -S 1G` asks for 1 GiB and touches a
//! few MiB of it, and populating it all made its peak 1,155 MiB against glibc's 78 MiB. So a
//! block that large is handed out lazily first and watched: when it is freed, a few of its
//! pages spread over it are looked at (`mincore`, nothing touched); if every one is resident,
//! its user wrote it whole, and the next [`CREDIT`] such requests are populated in bulk, after
//! which one is handed out lazily again to look once more. Lazily handed out, a whole write
//! costs a fault per page (a huge page each where huge pages pay): the bulk populate is the
//! gain, not the correctness.
//!
//! Process-wide (the arenas are): one watched block at a time, by address. Atomics only: a
//! fork copies them whole, and nothing here allocates or locks.

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

/// Called with the address of a block about to be freed (still its caller's): when it is the
/// watched block, looks at how much of it its user wrote and sets the credit.
pub(crate) fn freeing(addr: usize) {
    // A plain load first: every free passes here, and a failed exchange would still take the
    // line from the other threads.
    if addr == 0
        || WATCHED_ADDR.load(Ordering::Relaxed) != addr
        || WATCHED_ADDR
            .compare_exchange(addr, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
    {
        return;
    }
    let len = WATCHED_LEN.load(Ordering::Relaxed);
    let Some(ptr) = NonNull::new(addr as *mut u8) else {
        return;
    };
    // A refused look (another block now at the address, of another length) teaches nothing.
    if let Some((resident, sampled)) = crate::sys::resident_sample(ptr, len, SAMPLES) {
        let whole = sampled > 0 && resident == sampled;
        CREDIT_LEFT.store(if whole { CREDIT } else { 0 }, Ordering::Relaxed);
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;
    use crate::chunk::{Mapping, ANONYMOUS};

    /// One test drives the process-wide state through both outcomes (tests run in parallel).
    #[test]
    fn a_large_block_written_whole_earns_bulk_populates_and_a_barely_touched_one_ends_them() {
        let len = 8 << 20;
        assert!(populate_in_bulk(SURE_MAX), "up to the bound: always");
        CREDIT_LEFT.store(0, Ordering::Relaxed);
        assert!(
            !populate_in_bulk(SURE_MAX + 1),
            "no credit: lazily, and watched"
        );

        let mapping = Mapping::new(&ANONYMOUS, len, crate::sys::page_size()).expect("mmap");
        let addr = mapping.ptr().as_ptr() as usize;
        // SAFETY: the mapping is this test's, `len` bytes long.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 1, len) };
        watch(addr, len);
        freeing(addr + 4096);
        assert_eq!(
            CREDIT_LEFT.load(Ordering::Relaxed),
            0,
            "another address: nothing"
        );
        freeing(addr);
        assert_eq!(CREDIT_LEFT.load(Ordering::Relaxed), CREDIT, "written whole");
        for _ in 0..CREDIT {
            assert!(populate_in_bulk(SURE_MAX + 1));
        }
        assert!(
            !populate_in_bulk(SURE_MAX + 1),
            "credit spent: watched again"
        );

        let barely = Mapping::new(&ANONYMOUS, len, crate::sys::page_size()).expect("mmap");
        let addr = barely.ptr().as_ptr() as usize;
        // SAFETY: the first byte of this test's mapping.
        unsafe { (addr as *mut u8).write(1) };
        CREDIT_LEFT.store(CREDIT, Ordering::Relaxed);
        watch(addr, len);
        freeing(addr);
        assert_eq!(
            CREDIT_LEFT.load(Ordering::Relaxed),
            0,
            "barely touched: lazily"
        );
    }
}
