//! The extent table against a model: random allocations and frees keep the tables whole, no two
//! live blocks overlap or cross a chunk, and a rebuild keeps every live block; a lock left by a
//! holder that is gone passes on, its state rebuilt once; whatever a writer stores into any field of the
//! extent table between operations, the locker's admission repairs it and nothing panics; a
//! memory file of huge pages takes the size seals; the registration lock's wait is cancellable
//! and ends after its deadline naming the holder.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::extents::{Admit, ExtentTable, Live, EXTENTS, GRANULE};
use super::{Pool, DATA_START};

/// The tests' lock wait: nothing else holds their pools' locks.
const WAIT: Duration = Duration::from_secs(5);
use crate::{sys, Error};

fn empty(start: u64, end: u64, chunk: u64) -> Box<ExtentTable> {
    let layout = std::alloc::Layout::new::<ExtentTable>();
    // SAFETY: the extent table is integers only, for which zero is a value (as in a new file);
    // the allocation is of its layout, and owned by the box from here on.
    let mut table = unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<ExtentTable>();
        assert!(!ptr.is_null());
        Box::from_raw(ptr)
    };
    table.init(start, end, chunk);
    table
}

/// A small deterministic generator (xorshift).
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn random_allocations_and_frees_keep_the_tables_whole() {
    let chunk = 4 << 20;
    let mut table = empty(2 << 20, (2 << 20) + 4 * chunk, chunk);
    let mut live: Vec<Live> = Vec::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15;
    for step in 0..5_000 {
        if live.is_empty() || !next(&mut seed).is_multiple_of(3) {
            let len = 1 + next(&mut seed) % (1 << (next(&mut seed) % 21));
            let align = 1 << (next(&mut seed) % 13);
            if let Some(block) = table.allocate(len, align, 1) {
                let entry = table.find(block.offset).unwrap();
                assert!(block.len >= len && block.len.is_multiple_of(GRANULE));
                assert!(block.offset.is_multiple_of(align.max(GRANULE)));
                let first = (block.offset - (2 << 20)) / chunk;
                assert_eq!(first, (block.offset + block.len - 1 - (2 << 20)) / chunk);
                for other in live.iter().map(|e| e.block) {
                    let apart = block.offset + block.len <= other.offset
                        || other.offset + other.len <= block.offset;
                    assert!(apart, "step {step}: {block:?} overlaps {other:?}");
                }
                live.push(entry);
            }
        } else {
            let i = (next(&mut seed) as usize) % live.len();
            let Live { block, serial, .. } = live.swap_remove(i);
            let expect = Some((block.len, serial));
            assert_eq!(table.free(block.offset, expect, 1), Ok(block.len));
            assert!(
                table.free(block.offset, expect, 1).is_err(),
                "a second free is refused"
            );
        }
        assert!(table.consistent(), "step {step}");
        assert_eq!(table.live().len(), live.len());
    }
    let before: Vec<Live> = table.live().to_vec();
    assert_eq!(table.rebuild(), 0);
    assert!(table.consistent());
    assert_eq!(table.live(), &before[..]);
    for e in live {
        table
            .free(e.block.offset, Some((e.block.len, e.serial)), 1)
            .unwrap();
    }
    assert_eq!(table.free_ranges().len(), 1);
    assert_eq!(table.live_bytes, 0);
}

#[test]
fn no_block_larger_than_a_chunk_or_aligned_past_2_mib() {
    let mut table = empty(2 << 20, 10 << 20, 2 << 20);
    assert!(table.allocate((2 << 20) + 1, 64, 1).is_none());
    assert!(table.allocate(64, 4 << 20, 1).is_none());
    let whole = table.allocate(2 << 20, 2 << 20, 1).unwrap();
    assert_eq!(whole.len, 2 << 20);
    // A block that would cross into the next chunk starts at the chunk instead.
    let a = table.allocate(1 << 20, 64, 1).unwrap();
    let b = table.allocate(1536 << 10, 64, 1).unwrap();
    assert_eq!(b.offset, a.offset + (2 << 20));
    assert!(table.consistent());
}

/// A new pool of `len` bytes in a memory file, its header written as its creator writes it.
fn new_pool(len: usize) -> Pool {
    let fd = sys::memfd(c"numa-gpu-alloc test pool", false, false).unwrap();
    let file = File::from(fd);
    file.set_len(len as u64).unwrap();
    let name = std::path::Path::new("<test pool>");
    let (mapping, file) = super::map(OwnedFd::from(file), len, name).unwrap();
    // SAFETY: the file was just made (all zeros), and nothing else has it.
    unsafe { Pool::init(mapping, file, name.into(), (0, false, 2 << 20)) }.unwrap()
}

#[test]
fn a_lock_left_by_a_holder_that_is_gone_passes_on_and_is_rebuilt_once() {
    let map = new_pool(4 << 20);
    let me = std::process::id();
    // What a holder that died leaves: its token (of no live attachment) and the held flag.
    // SAFETY: nobody else has the test's pool; the lock's words are plain u32s.
    unsafe {
        let words = std::ptr::addr_of!(map.header().mutex).cast::<AtomicU32>();
        (*words).store(0x5eed, Ordering::Release);
        (*words.add(1)).store(1, Ordering::Release);
    }
    let start = Instant::now();
    assert_eq!(map.lock(WAIT, me).unwrap().extents().rebuilds, 1);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(map.lock(WAIT, me).unwrap().extents().rebuilds, 1, "once");
}

#[test]
fn a_carving_state_changed_under_the_pool_is_repaired_at_the_next_lock() {
    let map = new_pool(8 << 20);
    let (start, end) = (DATA_START as u64, map.len() as u64);
    let kept = map
        .lock(WAIT, std::process::id())
        .unwrap()
        .extents()
        .allocate(4096, 64, 1)
        .unwrap();
    // Another process's stray write: a chunk other than the one each process registers by.
    // SAFETY: nobody else has the test's pool, so taking the state without the lock is ours.
    unsafe { &mut *map.header().extents.get() }.init(start, end, 4 << 20);
    let mut guard = map.lock(WAIT, std::process::id()).unwrap();
    let table = guard.extents();
    assert_eq!(table.rebuilds, 1, "rebuilt from its live table");
    assert!(table.consistent());
    // `init` uncounted the live block, but left its entry, where the rebuild looks (one slot
    // past the count); the chunk is the attached one again.
    assert_eq!(table.find(kept.offset).map(|e| e.block), Some(kept));
    let whole = table.allocate(2 << 20, 2 << 20, 1).unwrap();
    assert_eq!((whole.offset - start) % (2 << 20), 0);
}

/// A writer that stores random values into every field of the extent table between
/// operations (as any attached process could): each locker's admission finds it, rebuilds it,
/// and the operations that follow neither panic nor table overlapping blocks.
#[test]
fn random_values_in_every_field_of_the_carving_state_never_panic() {
    let (start, chunk) = (2u64 << 20, 2u64 << 20);
    let end = start + 8 * chunk;
    let mut table = empty(start, end, chunk);
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let (mut repaired, mut ops) = (0, 0);
    for step in 0..20_000 {
        let r = next(&mut seed);
        // Values a writer would pick: anything, near a table's end, near the pool's bounds.
        let value = match r % 6 {
            0 => next(&mut seed),
            1 => EXTENTS as u64 + (next(&mut seed) % 3),
            2 => start + next(&mut seed) % (end - start + 1),
            3 => u64::MAX - next(&mut seed) % 4,
            4 => next(&mut seed) % 8,
            _ => next(&mut seed) % 64 * GRANULE,
        };
        if r.is_multiple_of(4) {
            table.scribble(
                (next(&mut seed) % 9) as usize,
                next(&mut seed) as usize,
                value,
            );
        }
        match table.admit(start, end, chunk, r.is_multiple_of(97)) {
            Admit::Whole => {}
            Admit::Repaired => repaired += 1,
            Admit::Broken => panic!("step {step}: a rebuild always makes it whole"),
        }
        assert!(table.consistent(), "step {step}");
        let len = 1 + next(&mut seed) % (1 << 20);
        if next(&mut seed).is_multiple_of(2) {
            if let Some(block) = table.allocate(len, 64, 1) {
                let overlaps = table.live().iter().filter(|e| {
                    e.block.offset < block.offset + block.len
                        && block.offset < e.block.offset + e.block.len
                });
                assert_eq!(overlaps.count(), 1, "step {step}: only itself");
                ops += 1;
            }
        } else if let Some(e) = table.live().first().copied() {
            table
                .free(e.block.offset, Some((e.block.len, e.serial)), 1)
                .unwrap();
            ops += 1;
        }
        if let Some(e) = table.live().last().copied() {
            let _ = table.reclaim(e.pid, 1);
        }
    }
    println!("20000 steps: {repaired} repaired, {ops} operations");
    assert!(repaired > 1000 && ops > 5000, "{repaired} {ops}");
}

#[test]
fn a_free_range_count_past_its_table_is_repaired_not_a_panic() {
    let map = new_pool(8 << 20);
    let first = map
        .lock(WAIT, std::process::id())
        .unwrap()
        .extents()
        .allocate(64, 64, 1)
        .unwrap();
    // SAFETY: nobody else has the test's pool; the writer of this test is the stray one.
    unsafe { &mut *map.header().extents.get() }.scribble(5, 0, EXTENTS as u64 + 1);
    let mut guard = map.lock(WAIT, std::process::id()).unwrap();
    // A splitting allocate (aligned past the free range's start): an insert into the free table.
    let split = guard.extents().allocate(64, 4096, 1).unwrap();
    assert!(split.offset > first.offset);
    assert_eq!(guard.extents().rebuilds, 1);
    let free: u64 = guard.extents().free_ranges().iter().map(|e| e.len).sum();
    assert_eq!(
        free + guard.extents().live_bytes,
        (8 << 20) - DATA_START as u64,
        "no byte lost"
    );
}

#[test]
fn a_registration_waits_for_the_holder_cancellably_and_names_it_after_its_deadline() {
    let map = new_pool(4 << 20);
    let never = AtomicBool::new(false);
    let held = map
        .lock_registration(&never, Duration::from_secs(1))
        .unwrap()
        .unwrap();
    let cancel = AtomicBool::new(false);
    std::thread::scope(|s| {
        let waited = s.spawn(|| {
            let start = Instant::now();
            let e = map
                .lock_registration(&never, Duration::from_millis(300))
                .err()
                .expect("the lock is held");
            (start.elapsed(), e)
        });
        let (took, e) = waited.join().unwrap();
        assert!(took >= Duration::from_millis(300), "{took:?}");
        assert!(
            matches!(e, Error::PoolLockHeld { lock: "registration", pid: Some(pid), .. } if pid == std::process::id()),
            "{e}"
        );
        assert!(e.to_string().contains("by process"), "{e}");
        let cancelled = s.spawn(|| {
            let start = Instant::now();
            let got = map
                .lock_registration(&cancel, Duration::from_secs(60))
                .unwrap();
            (start.elapsed(), got.is_none())
        });
        std::thread::sleep(Duration::from_millis(100));
        cancel.store(true, std::sync::atomic::Ordering::Release);
        let (took, none) = cancelled.join().unwrap();
        assert!(none && took < Duration::from_secs(5), "{took:?}");
    });
    drop(held);
    assert!(map
        .lock_registration(&never, Duration::ZERO)
        .unwrap()
        .is_some());
}

/// What `seal_size`'s comment says of this kernel: a memory file of huge pages takes the size
/// seals and then refuses a shrink. Sizing it needs no free huge pages, but a kernel with
/// hugetlbfs: `.ci/run`'s huge-page step runs it.
#[test]
#[ignore = "needs a kernel with hugetlbfs: run with --include-ignored"]
fn a_huge_page_memory_file_takes_the_size_seals() {
    let fd = sys::memfd(c"numa-gpu-alloc test huge", true, false)
        .expect("a memory file of huge pages (a kernel with hugetlbfs)");
    let file = File::from(fd);
    file.set_len(4 << 20).unwrap();
    sys::seal_size(file.as_fd()).expect("hugetlbfs memory files take seals");
    let e = file.set_len(2 << 20).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
}
