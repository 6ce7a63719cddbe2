//! The carving state against a model: random allocations and frees keep the tables whole, no two
//! live blocks overlap or cross a chunk, and a rebuild keeps every live block; a pool whose lock
//! is unrecoverable is refused as corrupt; a memory file of huge pages takes the size seals; the
//! node lock file is made for every user whatever the umask, and opened read-only once it exists.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

use super::carve::{Carve, Extent, Live, GRANULE};
use super::pinning::open_lock_at;
use super::{Locked, PoolMap, DATA_START};
use crate::{sys, Error};

fn empty(start: u64, end: u64, chunk: u64) -> Box<Carve> {
    let layout = std::alloc::Layout::new::<Carve>();
    // SAFETY: the carving state is integers only, for which zero is a value (as in a new file);
    // the allocation is of its layout, and owned by the box from here on.
    let mut carve = unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<Carve>();
        assert!(!ptr.is_null());
        Box::from_raw(ptr)
    };
    carve.init(start, end, chunk);
    carve
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
    let mut carve = empty(2 << 20, (2 << 20) + 4 * chunk, chunk);
    let mut live: Vec<Extent> = Vec::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15;
    for step in 0..5_000 {
        if live.is_empty() || !next(&mut seed).is_multiple_of(3) {
            let len = 1 + next(&mut seed) % (1 << (next(&mut seed) % 21));
            let align = 1 << (next(&mut seed) % 13);
            if let Some(block) = carve.allocate(len, align, 1) {
                assert!(block.len >= len && block.len.is_multiple_of(GRANULE));
                assert!(block.offset.is_multiple_of(align.max(GRANULE)));
                let first = (block.offset - (2 << 20)) / chunk;
                assert_eq!(first, (block.offset + block.len - 1 - (2 << 20)) / chunk);
                for other in &live {
                    let apart = block.offset + block.len <= other.offset
                        || other.offset + other.len <= block.offset;
                    assert!(apart, "step {step}: {block:?} overlaps {other:?}");
                }
                live.push(block);
            }
        } else {
            let i = (next(&mut seed) as usize) % live.len();
            let block = live.swap_remove(i);
            assert_eq!(carve.free(block.offset, Some(block.len), 1), Ok(block.len));
            assert!(
                carve.free(block.offset, Some(block.len), 1).is_err(),
                "a second free is refused"
            );
        }
        assert!(carve.consistent(), "step {step}");
        assert_eq!(carve.live().len(), live.len());
    }
    let before: Vec<Live> = carve.live().to_vec();
    assert_eq!(carve.rebuild(), 0);
    assert!(carve.consistent());
    assert_eq!(carve.live(), &before[..]);
    for block in live {
        carve.free(block.offset, Some(block.len), 1).unwrap();
    }
    assert_eq!(carve.free_ranges().len(), 1);
    assert_eq!(carve.live_bytes, 0);
}

#[test]
fn no_block_larger_than_a_chunk_or_aligned_past_2_mib() {
    let mut carve = empty(2 << 20, 10 << 20, 2 << 20);
    assert!(carve.allocate((2 << 20) + 1, 64, 1).is_none());
    assert!(carve.allocate(64, 4 << 20, 1).is_none());
    let whole = carve.allocate(2 << 20, 2 << 20, 1).unwrap();
    assert_eq!(whole.len, 2 << 20);
    // A block that would cross into the next chunk starts at the chunk instead.
    let a = carve.allocate(1 << 20, 64, 1).unwrap();
    let b = carve.allocate(1536 << 10, 64, 1).unwrap();
    assert_eq!(b.offset, a.offset + (2 << 20));
    assert!(carve.consistent());
}

/// A new pool of `len` bytes in a memory file, its header written as its creator writes it.
fn new_pool(len: usize) -> (OwnedFd, PoolMap) {
    let fd = sys::memfd(c"numa-gpu-alloc test pool", false).unwrap();
    let file = File::from(fd);
    file.set_len(len as u64).unwrap();
    let fd = OwnedFd::from(file);
    let mut map = PoolMap::map(fd.as_fd(), len, "<test pool>".into()).unwrap();
    // SAFETY: the file was just made (all zeros), and nothing else has it.
    unsafe { map.init(0, false, 2 << 20) }.unwrap();
    (fd, map)
}

#[test]
fn an_unrecoverable_lock_is_a_corrupt_pool() {
    let (_fd, map) = new_pool(4 << 20);
    // A holder whose thread ends holding the lock: the robust mutex's owner died.
    std::thread::scope(|s| {
        s.spawn(|| std::mem::forget(map.lock().unwrap()));
    });
    let mutex = &map.header().mutex;
    assert_eq!(mutex.lock().unwrap(), Locked::OwnerDied);
    // Released without repairing the state (`mark_consistent`): unrecoverable from now on.
    // SAFETY: this thread holds the lock.
    unsafe { mutex.unlock() };
    let e = map.lock().err().expect("an unrecoverable lock is refused");
    assert!(matches!(e, Error::PoolCorrupt { .. }), "{e}");
    assert!(e.to_string().contains("create a new pool"), "{e}");
}

#[test]
fn a_carving_state_changed_under_the_pool_is_refused_at_the_next_lock() {
    let (_fd, map) = new_pool(8 << 20);
    let (start, end) = (DATA_START as u64, map.len() as u64);
    assert!(map.lock().is_ok());
    // Another process's stray write: a chunk other than the one each process registers by.
    map.lock().unwrap().carve().init(start, end, 4 << 20);
    let e = map.lock().err().expect("a changed chunk is refused");
    assert!(matches!(e, Error::PoolCorrupt { .. }), "{e}");
    assert!(e.to_string().contains("after it was attached"), "{e}");
    // The geometry back, the pool is usable again: the check refused, it changed nothing.
    // SAFETY: nobody else has the test's pool, so taking the state without the lock is ours.
    unsafe { &mut *map.header().carve.get() }.init(start, end, map.chunk());
    assert!(map.lock().unwrap().carve().allocate(64, 64, 1).is_some());
}

/// What `seal_size`'s comment says of this kernel: a memory file of huge pages takes the size
/// seals and then refuses a shrink. Sizing it needs no free huge pages; skipped where the
/// kernel makes no such file (no hugetlbfs).
#[test]
fn a_huge_page_memory_file_takes_the_size_seals() {
    let Ok(fd) = sys::memfd(c"numa-gpu-alloc test huge", true) else {
        eprintln!("SKIPPED: no memory files of huge pages here");
        return;
    };
    let file = File::from(fd);
    file.set_len(4 << 20).unwrap();
    sys::seal_size(file.as_fd()).expect("hugetlbfs memory files take seals");
    let e = file.set_len(2 << 20).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
}

#[test]
fn the_node_lock_file_is_made_for_every_user_and_opened_read_only() {
    use std::os::unix::fs::PermissionsExt;
    let path = std::path::PathBuf::from(format!(
        "/dev/shm/numa-gpu-alloc-test-lock-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&path);
    // A restrictive umask, for as short a time as possible (it is the process's).
    // SAFETY: umask only sets the process's file mode mask.
    let before = unsafe { libc::umask(0o077) };
    let made = open_lock_at(&path);
    // SAFETY: as above.
    unsafe { libc::umask(before) };
    drop(made.unwrap());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o666, "{mode:o}");
    let again = open_lock_at(&path).unwrap();
    assert!(!sys::read_write(again.as_fd()).unwrap(), "opened read-only");
    assert!(
        sys::lock_file(again.as_fd(), true, false).unwrap(),
        "flock works read-only"
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_lock_file_that_is_a_fifo_or_a_link_is_refused_without_waiting() {
    let dir = std::env::temp_dir().join(format!("numa-gpu-alloc-lock-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("fifo");
    let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path the call only reads.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o666) }, 0);
    let e = open_lock_at(&fifo).unwrap_err();
    assert!(matches!(e, Error::Parse { .. }), "{e}");
    let target = dir.join("target");
    std::fs::write(&target, b"").unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = open_lock_at(&link).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Io {
                errno: Some(libc::ELOOP),
                ..
            }
        ),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
