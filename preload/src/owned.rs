//! Which pointers are this library's: a granule map that answers "certainly not ours" with no
//! lock and three loads, and behind it the exact record (address → size and alignment) of every
//! block the large path handed out.
//!
//! The map counts, for every 2 MiB granule of the address space, the live large blocks that
//! overlap it. A pointer in a granule with a count of zero is not ours (glibc's, or another
//! library's): `free` passes it on at once. A non-zero count sends the pointer to the record,
//! under the lock of one of [`SHARDS`] shards: a large block's neighbour in the same granule may
//! be glibc's. Counts are raised before `malloc` returns a block and lowered after its record is
//! gone, so a live block's granules never read zero.
//!
//! The map is two levels, as the address space is sparse: a top table in `.bss` (2 MiB of
//! zero pages, touched only where blocks lie) of pointers to leaves of 512 counters, one leaf per
//! GiB, mapped when a block first lands in its GiB and never unmapped. Addresses past 2^48 (five-
//! level page tables, only for mappings that ask for them) always go to the record.

use std::cell::{Cell, UnsafeCell};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};

const GRANULE_SHIFT: u32 = 21;
const LEAF_SHIFT: u32 = 30;
const ADDRESS_BITS: u32 = 48;
const LEAF_LEN: usize = 1 << (LEAF_SHIFT - GRANULE_SHIFT);
const TOP_LEN: usize = 1 << (ADDRESS_BITS - LEAF_SHIFT);
/// Record shards: concurrent large frees of different blocks rarely wait for each other.
pub(crate) const SHARDS: usize = 64;

/// One GiB's counters.
struct Leaf([AtomicU32; LEAF_LEN]);

static TOP: [AtomicPtr<Leaf>; TOP_LEN] = [const { AtomicPtr::new(ptr::null_mut()) }; TOP_LEN];

/// Whether `addr` may be a block of ours: false means certainly not. No lock, no allocation.
#[inline(always)]
pub(crate) fn maybe_ours(addr: usize) -> bool {
    let Some(slot) = TOP.get(addr >> LEAF_SHIFT) else {
        return true;
    };
    let leaf = slot.load(Ordering::Acquire);
    if leaf.is_null() {
        return false;
    }
    // SAFETY: leaves are mapped once, zero-initialised, and never unmapped.
    let counter = unsafe { &(*leaf).0[(addr >> GRANULE_SHIFT) & (LEAF_LEN - 1)] };
    counter.load(Ordering::Relaxed) != 0
}

/// The leaf of `top`, mapped now if needed; `None` when the mapping failed.
fn leaf(top: usize) -> Option<&'static Leaf> {
    let slot = &TOP[top];
    let mut leaf = slot.load(Ordering::Acquire);
    if leaf.is_null() {
        let fresh = crate::sys::map_zeroed(size_of::<Leaf>())?.cast::<Leaf>();
        leaf = match slot.compare_exchange(
            ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => fresh,
            Err(theirs) => {
                // SAFETY: `fresh` was mapped above and never published.
                unsafe { crate::sys::unmap(fresh.cast(), size_of::<Leaf>()) };
                theirs
            }
        };
    }
    // SAFETY: published leaves live for the rest of the process.
    Some(unsafe { &*leaf })
}

/// Adds `delta` (+1 or -1) to the counters of every granule `addr..addr+len` overlaps (below
/// 2^48). False when a leaf could not be mapped; the counters changed so far are undone.
fn count(addr: usize, len: usize, delta: i32) -> bool {
    let first = addr >> GRANULE_SHIFT;
    let last = (addr + len.max(1) - 1) >> GRANULE_SHIFT;
    match count_granules(first..=last, delta) {
        Ok(()) => true,
        Err(failed) => {
            // Granules first..failed were counted: undo them (their leaves exist, so this cannot
            // fail).
            let _ = count_granules(first..failed, -delta);
            false
        }
    }
}

/// Adds `delta` to the counters of `granules`; `Err(granule)` when that granule's leaf could not
/// be mapped (the granules before it were counted).
fn count_granules(granules: impl Iterator<Item = usize>, delta: i32) -> Result<(), usize> {
    for granule in granules {
        let top = granule >> (LEAF_SHIFT - GRANULE_SHIFT);
        if top >= TOP_LEN {
            break;
        }
        let leaf = leaf(top).ok_or(granule)?;
        let counter = &leaf.0[granule & (LEAF_LEN - 1)];
        if delta > 0 {
            counter.fetch_add(1, Ordering::Relaxed);
        } else {
            counter.fetch_sub(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// What `free` and `realloc` need to know of a block: the layout it was allocated with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) size: usize,
    pub(crate) align: usize,
}

/// Block addresses are page-aligned: Fibonacci hashing spreads them over buckets and shards.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only addresses (usize) are hashed")
    }
    fn write_usize(&mut self, addr: usize) {
        self.0 = (addr as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Table = HashMap<usize, Record, BuildHasherDefault<AddressHasher>>;

/// A shard of the record: a spin lock (fork handlers take and release it on both sides of a
/// fork, which a `Mutex` guard cannot span) over a table whose memory is glibc's.
struct Shard {
    locked: AtomicBool,
    table: UnsafeCell<Table>,
}

// SAFETY: `table` is only reached through `with`, which holds `locked`.
unsafe impl Sync for Shard {}

static RECORD: [Shard; SHARDS] = [const {
    Shard {
        locked: AtomicBool::new(false),
        table: UnsafeCell::new(HashMap::with_hasher(BuildHasherDefault::new())),
    }
}; SHARDS];

impl Shard {
    fn of(addr: usize) -> &'static Shard {
        &RECORD[(addr >> 12).wrapping_mul(0x9E37_79B9) % SHARDS]
    }

    fn acquire(&self) {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                crate::sys::yield_now();
            }
        }
    }

    fn release(&self) {
        self.locked.store(false, Ordering::Release);
    }

    fn with<T>(&self, f: impl FnOnce(&mut Table) -> T) -> T {
        // The forking thread holds every shard between the fork handlers; fork handlers that
        // libraries loaded earlier registered run in between and may allocate: it is alone in
        // the tables then, as glibc's forking thread is in its arenas.
        let forking = FORKING.with(Cell::get);
        if !forking {
            self.acquire();
        }
        // SAFETY: the lock is held (by this call, or by this thread for the fork), so this is
        // the only reference.
        let out = f(unsafe { &mut *self.table.get() });
        if !forking {
            self.release();
        }
        out
    }
}

/// Records a block handed out at `addr`. False when the granule map could not grow (the caller
/// frees the block and fails the request).
pub(crate) fn insert(addr: usize, record: Record) -> bool {
    if !count(addr, record.size, 1) {
        return false;
    }
    // The table's memory is glibc's: growing it cannot fail other than by aborting, as std's
    // collections do.
    Shard::of(addr).with(|table| table.insert(addr, record));
    true
}

/// The record of the block at `addr`, if it is one of ours.
pub(crate) fn get(addr: usize) -> Option<Record> {
    if !maybe_ours(addr) {
        return None;
    }
    Shard::of(addr).with(|table| table.get(&addr).copied())
}

/// Takes the block at `addr` out of the record (its owner is freeing or moving it), if it is
/// one of ours.
pub(crate) fn remove(addr: usize) -> Option<Record> {
    let record = Shard::of(addr).with(|table| table.remove(&addr))?;
    count(addr, record.size, -1);
    Some(record)
}

thread_local! {
    /// Whether this thread holds every shard for a fork (between the fork handlers).
    static FORKING: Cell<bool> = const { Cell::new(false) };
}

/// Fork handlers: the child inherits the shards unlocked and consistent.
pub(crate) extern "C" fn before_fork() {
    RECORD.iter().for_each(Shard::acquire);
    FORKING.with(|f| f.set(true));
}

/// Releases what [`before_fork`] took, in the parent and in the child.
pub(crate) extern "C" fn after_fork() {
    FORKING.with(|f| f.set(false));
    RECORD.iter().rev().for_each(Shard::release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_granule_is_ours_while_a_block_overlaps_it() {
        let base = 0x7f12_3400_0000usize;
        assert!(!maybe_ours(base));
        let a = Record {
            size: 3 << 20,
            align: 16,
        };
        assert!(insert(base + 4096, a));
        // The block's first and last granules; the next one is not.
        assert!(maybe_ours(base));
        assert!(maybe_ours(base + (3 << 20)));
        assert!(!maybe_ours(base + (4 << 20)));
        assert_eq!(get(base + 4096), Some(a));
        assert_eq!(get(base), None, "a neighbour in the granule is not ours");
        assert_eq!(remove(base + 4096), Some(a));
        assert!(!maybe_ours(base));
        assert_eq!(remove(base + 4096), None);
    }

    #[test]
    fn a_granule_shared_by_two_blocks_stays_ours_until_both_are_freed() {
        let base = 0x7f56_7800_0000usize;
        let small = Record {
            size: 64 << 10,
            align: 16,
        };
        assert!(insert(base, small));
        assert!(insert(base + (1 << 20), small));
        assert_eq!(remove(base), Some(small));
        assert!(
            maybe_ours(base),
            "the other block still lies in the granule"
        );
        assert_eq!(remove(base + (1 << 20)), Some(small));
        assert!(!maybe_ours(base));
    }

    #[test]
    fn high_addresses_go_to_the_record() {
        assert!(maybe_ours(1 << 50));
        assert_eq!(get(1 << 50), None);
    }
}
