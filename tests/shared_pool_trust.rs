//! Shared pools among users who do not trust each other, and errors that send the user the
//! right way: a pool another user made at the path is refused, not joined, and its lock does
//! not hold the attacher; an attach while a pool is made finds no file or the whole pool; bytes
//! past a table in the carving state are repaired, not a panic; a handle of another pool, or
//! freed twice, frees nothing; a memory file's descriptor does not survive `exec`; and each
//! misuse (a write-only or `O_PATH` descriptor, permission denied, a 0-byte pool, an odd file
//! length, a double free, a full tmpfs) gets an error saying what happened and what to do.
//!
//! The second user is `nobody`, run through `setpriv` (root only: see `common/nobody.rs`).
#![cfg(target_os = "linux")]

mod common {
    pub mod nobody;
    pub mod pools;
    pub mod require;
}

use std::alloc::Layout;
use std::fs::{OpenOptions, Permissions};
use std::io::{BufRead, BufReader, ErrorKind};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use common::nobody::{can_switch_users, spawn_as_nobody, NOBODY};
use common::pools::{pool_path, small_pool_at, with_pool_lock_held};
use numa_gpu_alloc::{Error, SharedPool};

const MIB: usize = 1 << 20;
/// Set in a child run as nobody: what it does.
const NOBODY_VAR: &str = "NUMA_GPU_ALLOC_TRUST_CHILD";

fn block(pool: &SharedPool) -> numa_gpu_alloc::PoolHandle {
    pool.allocate_handle(Layout::from_size_align(4096, 64).unwrap())
        .expect("a block")
}

/// The first line of `child`'s stdout that contains `word` (libtest may begin it with its own);
/// the rest is read to its end on a thread of its own, so the child never writes to a closed
/// pipe.
fn line_with(child: &mut std::process::Child, word: &str) -> String {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.contains(word))
        .unwrap_or_else(|| panic!("the child never said {word:?}"));
    std::thread::spawn(move || lines.for_each(drop));
    line
}

/// Runs `f` on a thread of its own and waits at most 10 s for it: what waits for ever on a
/// broken build fails the test instead.
fn within_10s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (sent, got) = mpsc::channel();
    std::thread::spawn(move || sent.send(f()));
    got.recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("{what} did not return within 10 s"))
}

#[test]
fn a_pool_another_user_made_at_the_path_is_refused_not_joined() {
    if let Some(path) = std::env::var_os(NOBODY_VAR) {
        // As nobody: a pool at the path a server is about to use, writable by every user, its
        // lock held.
        let pool = small_pool_at(Path::new(&path));
        std::fs::set_permissions(&path, Permissions::from_mode(0o666)).unwrap();
        numa_gpu_alloc::unstable::hold_pool_lock(&pool, || {
            println!("squatting");
            std::thread::sleep(Duration::from_secs(120));
        })
        .unwrap();
        return;
    }
    if !can_switch_users("a_pool_another_user_made_at_the_path_is_refused_not_joined") {
        return;
    }
    let path = pool_path("squat");
    let _ = std::fs::remove_file(&path);
    let mut squatter = spawn_as_nobody(
        "a_pool_another_user_made_at_the_path_is_refused_not_joined",
        NOBODY_VAR,
        path.to_str().unwrap(),
    );
    line_with(&mut squatter, "squatting");
    let made = SharedPool::builder(8 * MIB).node(0).path(&path).create();
    let attach_path = path.clone();
    let attached = within_10s("attaching to the squatter's pool", move || {
        SharedPool::attach(&attach_path)
            .map(drop)
            .map_err(|e| e.to_string())
    });
    let _ = squatter.kill();
    let _ = squatter.wait();
    std::fs::remove_file(&path).unwrap();
    let e = made.unwrap_err();
    assert!(matches!(e, Error::PoolExists { .. }), "{e}");
    let e = attached.expect_err("attached to another user's pool");
    println!("{e}");
    for said in [
        "owned by user 65534",
        "mode 0o666",
        "allow_owner(65534).allow_mode(0o666)",
    ] {
        assert!(e.contains(said), "{said:?} in {e}");
    }
}

#[test]
fn an_attach_while_the_pool_is_made_finds_no_file_or_the_whole_pool() {
    let mut told = Vec::new();
    for round in 0..100 {
        let path = pool_path(&format!("making{round}"));
        let _ = std::fs::remove_file(&path);
        let made_at = path.clone();
        let creator = std::thread::spawn(move || {
            SharedPool::builder(8 * MIB)
                .node(0)
                .path(&made_at)
                .create()
                .unwrap()
        });
        let mut missing = 0;
        // Until the pool attaches; any other error is what an attacher was told mid-create.
        let attached = loop {
            match SharedPool::attach(&path) {
                Ok(pool) => break Some(pool),
                Err(Error::Io {
                    kind: ErrorKind::NotFound,
                    ..
                }) => missing += 1,
                Err(e) => {
                    told.push(format!("round {round}: {e}"));
                    break None;
                }
            }
        };
        let made = creator.join().unwrap();
        if attached.is_some() {
            assert_eq!(made.stats().attached, 2, "round {round}");
        }
        drop((made, attached));
        std::fs::remove_file(&path).unwrap();
        if round == 0 {
            println!("round 0: {missing} attaches found no file, then the whole pool");
        }
    }
    assert!(
        told.is_empty(),
        "attaches while the pool was made were told:\n{}",
        told.join("\n")
    );
    let prefix = "numa-gpu-alloc-trust-making";
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains(prefix) && n.contains(&std::process::id().to_string()))
        .collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
}

/// Where the carving state starts in a pool's file: at the bounds and chunk it records (the
/// blocks' start, the pool's size, the chunk), which follow the header's fields.
fn carve_at(file: &std::fs::File, size: u64, chunk: u64) -> u64 {
    let mut header = vec![0u8; 4096];
    file.read_exact_at(&mut header, 0).unwrap();
    let word = |at: usize| u64::from_ne_bytes(header[at..at + 8].try_into().unwrap());
    (0..header.len() - 24)
        .step_by(8)
        .find(|&at| word(at) == 2 * MIB as u64 && word(at + 8) == size && word(at + 16) == chunk)
        .expect("the carving state's bounds") as u64
}

#[test]
fn a_free_range_count_past_its_table_is_repaired_not_a_panic() {
    let path = pool_path("count");
    let pool = small_pool_at(&path);
    // 64 bytes: the free range after it starts off a 4 KiB boundary.
    let first = pool
        .allocate_handle(Layout::from_size_align(64, 64).unwrap())
        .unwrap();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    // The free-range count follows the bounds, chunk (3 × 8 bytes) and intent record (24).
    let free_count_at = carve_at(&file, 8 * MIB as u64, 2 * MIB as u64) + 48;
    file.write_all_at(&4097u32.to_ne_bytes(), free_count_at)
        .unwrap();
    // A splitting allocate (aligned past the free range's start) inserts into the free table.
    let split = pool
        .allocate_handle(Layout::from_size_align(64, 4096).unwrap())
        .expect("a block after the repair");
    assert!(split.offset > first.offset);
    let stats = pool.stats();
    println!("{stats:?}");
    assert_eq!(stats.rebuilds, 1);
    assert!(pool.is_live(first).unwrap(), "the live block kept");
    let other = SharedPool::attach(&path).expect("new attaches find it whole");
    let big = other
        .allocate_handle(Layout::from_size_align(2 * MIB, 64).unwrap())
        .expect("the free chunks are all there");
    // SAFETY: the test's blocks, not used afterwards.
    unsafe {
        other.free(big).unwrap();
        pool.free(split).unwrap();
        pool.free(first).unwrap();
    }
    assert_eq!(pool.stats().live_bytes, 0);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_handle_of_another_pool_frees_nothing() {
    let a = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let b = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let of_a = block(&a);
    let of_b = block(&b);
    assert_eq!(
        of_a.offset, of_b.offset,
        "both first blocks at the same offset"
    );
    // SAFETY: a handle of another pool must free nothing here.
    let e = unsafe { b.free(of_a) }.expect_err("another pool's handle is refused");
    println!("{e}");
    assert!(e.to_string().contains("another pool"), "{e}");
    assert!(b.is_live(of_b).unwrap(), "b's own block is still live");
    assert!(!b.is_live(of_a).unwrap());
}

#[test]
fn a_double_free_frees_nothing_and_says_so() {
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let first = block(&pool);
    // SAFETY: the test's block, not used afterwards.
    unsafe { pool.free(first) }.unwrap();
    let again = block(&pool);
    assert_eq!((again.offset, again.len), (first.offset, first.len));
    // SAFETY: a handle freed already must free nothing.
    let e = unsafe { pool.free(first) }.expect_err("a double free is refused");
    println!("{e}");
    assert!(e.to_string().contains("freed already"), "{e}");
    assert!(!e.to_string().contains("page-aligned"), "{e}");
    assert!(
        pool.is_live(again).unwrap(),
        "the block carved since is still live"
    );
}

#[test]
fn a_memory_file_pools_descriptor_does_not_survive_exec() {
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let fd = pool.fd().as_raw_fd();
    let out = Command::new("/bin/ls")
        .args(["-l", "/proc/self/fd/"])
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(
        !listing.contains("numa-gpu-alloc pool"),
        "an exec'd program holds the pool (fd {fd}):\n{listing}"
    );
}

#[test]
fn a_write_only_descriptor_is_not_called_foreign() {
    let path = pool_path("wronly");
    let _pool = small_pool_at(&path);
    let file = OpenOptions::new().write(true).open(&path).unwrap();
    let e = SharedPool::attach_fd(file.into()).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    println!("{e}");
    assert!(!e.to_string().contains("not a numa-gpu-alloc"), "{e}");
    assert!(e.to_string().contains("write-only"), "{e}");
}

#[test]
fn an_o_path_descriptor_is_not_called_foreign() {
    let path = pool_path("opath");
    let _pool = small_pool_at(&path);
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(&path)
        .unwrap();
    let e = SharedPool::attach_fd(file.into()).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    println!("{e}");
    assert!(!e.to_string().contains("not a numa-gpu-alloc"), "{e}");
    assert!(e.to_string().contains("O_PATH"), "{e}");
}

#[test]
fn permission_denied_is_not_called_read_only() {
    if let Some(path) = std::env::var_os(NOBODY_VAR) {
        let e = SharedPool::attach(&path).unwrap_err();
        println!("nobody was told: {e}");
        return;
    }
    if !can_switch_users("permission_denied_is_not_called_read_only") {
        return;
    }
    let path = pool_path("denied");
    let _pool = small_pool_at(&path);
    let mut child = spawn_as_nobody(
        "permission_denied_is_not_called_read_only",
        NOBODY_VAR,
        path.to_str().unwrap(),
    );
    let said = line_with(&mut child, "nobody was told:");
    assert!(child.wait().unwrap().success());
    std::fs::remove_file(&path).unwrap();
    println!("{said}");
    assert!(!said.contains("cannot be mapped for writing"), "{said}");
    assert!(said.contains("permission denied"), "{said}");
    assert!(said.contains(&format!("user {NOBODY}")), "{said}");
}

#[test]
fn a_zero_byte_pool_is_too_small_not_too_large() {
    let e = SharedPool::builder(0).node(0).create().unwrap_err();
    println!("{e}");
    assert!(!e.to_string().contains("does not fit"), "{e}");
    assert!(e.to_string().contains("too small"), "{e}");
}

#[test]
fn an_odd_file_length_is_called_damaged() {
    let path = pool_path("odd");
    let pool = small_pool_at(&path);
    let file = OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(8 * MIB as u64 + 100).unwrap();
    let e = SharedPool::attach(&path).unwrap_err();
    file.set_len(8 * MIB as u64).unwrap();
    drop(pool);
    std::fs::remove_file(&path).unwrap();
    println!("{e}");
    assert!(!e.to_string().contains("page-aligned"), "{e}");
    assert!(e.to_string().contains("damaged"), "{e}");
}

#[test]
fn a_full_tmpfs_is_called_full() {
    if !can_switch_users("a_full_tmpfs_is_called_full (mounts a small tmpfs)") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("numa-gpu-alloc-full-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=6m", "tmpfs"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(mounted.success(), "mounting a 6 MiB tmpfs");
    let made = SharedPool::builder(16 * MIB)
        .node(0)
        .path(dir.join("pool"))
        .create();
    let left = std::fs::read_dir(&dir).unwrap().count();
    assert!(Command::new("umount").arg(&dir).status().unwrap().success());
    std::fs::remove_dir(&dir).unwrap();
    let e = made.unwrap_err();
    println!("{e}");
    assert!(!e.to_string().contains("Bad address"), "{e}");
    assert!(e.to_string().contains("no room"), "{e}");
    assert_eq!(left, 0, "nothing left on the full tmpfs");
}

#[test]
fn another_owners_pool_attaches_once_its_owner_and_mode_are_allowed_by_name() {
    if let Some(path) = std::env::var_os(NOBODY_VAR) {
        let _ = std::fs::remove_file(&path);
        let _pool = SharedPool::builder(8 * MIB)
            .node(0)
            .mode(0o666)
            .path(&path)
            .create()
            .unwrap();
        println!("made");
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    if !can_switch_users("another_owners_pool_attaches_once_its_owner_and_mode_are_allowed_by_name")
    {
        return;
    }
    let path = pool_path("allowed");
    let _ = std::fs::remove_file(&path);
    let mut maker = spawn_as_nobody(
        "another_owners_pool_attaches_once_its_owner_and_mode_are_allowed_by_name",
        NOBODY_VAR,
        path.to_str().unwrap(),
    );
    line_with(&mut maker, "made");
    let refused = SharedPool::attach(&path).map(drop);
    let owner_only = SharedPool::attacher()
        .allow_owner(NOBODY)
        .attach(&path)
        .map(drop);
    let both = SharedPool::attacher()
        .allow_owner(NOBODY)
        .allow_mode(0o666)
        .attach(&path)
        .map(|pool| pool.stats().attached);
    let _ = maker.kill();
    let _ = maker.wait();
    std::fs::remove_file(&path).unwrap();
    assert!(
        matches!(
            refused,
            Err(Error::PoolUntrusted {
                owner: NOBODY,
                mode: 0o666,
                ..
            })
        ),
        "{refused:?}"
    );
    let e = owner_only.unwrap_err();
    println!("{e}");
    assert!(e.to_string().contains("allow_mode(0o666)"), "{e}");
    assert_eq!(both.unwrap(), 2);
}

#[test]
fn a_pool_is_made_with_mode_0600_or_the_mode_asked_for() {
    let path = pool_path("mode");
    let pool = small_pool_at(&path);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&path), 0o600);
    drop(pool);
    std::fs::remove_file(&path).unwrap();
    let pool = SharedPool::builder(8 * MIB)
        .node(0)
        .mode(0o640)
        .path(&path)
        .create()
        .unwrap();
    assert_eq!(mode(&path), 0o640);
    drop(pool);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_pool_made_to_be_inherited_survives_exec() {
    for path in [None, Some(pool_path("inherit"))] {
        let mut builder = SharedPool::builder(8 * MIB).node(0).inherit(true);
        if let Some(path) = &path {
            builder = builder.path(path);
        }
        let pool = builder.create().unwrap();
        // SAFETY: F_GETFD on the pool's descriptor touches no memory.
        let flags = unsafe { libc::fcntl(pool.fd().as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, 0, "{path:?}");
        if let Some(path) = &path {
            std::fs::remove_file(path).unwrap();
        }
    }
}

#[test]
fn an_attach_waits_for_the_pools_lock_no_longer_than_asked_and_names_the_holder() {
    let path = pool_path("held");
    let pool = small_pool_at(&path);
    let (e, took) = with_pool_lock_held(&pool, || {
        let start = std::time::Instant::now();
        let e = SharedPool::attacher()
            .lock_wait(Duration::from_millis(200))
            .attach(&path)
            .unwrap_err();
        (e, start.elapsed())
    });
    println!("{e} ({took:?})");
    assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(5));
    assert!(
        matches!(e, Error::PoolLockHeld { lock: "carving", pid: Some(pid), .. } if pid == std::process::id()),
        "{e}"
    );
    assert_eq!(
        pool.stats().attached,
        1,
        "the refused attach was not counted"
    );
    SharedPool::attach(&path).expect("attaches once the lock is free");
    std::fs::remove_file(&path).unwrap();
}

/// Another process that writes the carving state while this one holds the pool's lock (here: a
/// thread writing the chunk size 0 through the file, over and over) makes allocations fail or
/// succeed, never panic.
#[test]
fn a_carving_state_written_during_an_allocation_is_no_panic() {
    let path = pool_path("race");
    let pool = small_pool_at(&path);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    // The carving state's start, end and chunk: 2 MiB, 8 MiB, 2 MiB, in a row.
    let geometry = [2 * MIB as u64, 8 * MIB as u64, 2 * MIB as u64];
    let chunk_at = (0..4096u64)
        .step_by(8)
        .find(|&at| {
            let mut words = [0u8; 24];
            file.read_exact_at(&mut words, at).unwrap();
            let word = |i: usize| u64::from_ne_bytes(words[i * 8..i * 8 + 8].try_into().unwrap());
            [word(0), word(1), word(2)] == geometry
        })
        .expect("the carving state's geometry in the header")
        + 16;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                file.write_all_at(&0u64.to_ne_bytes(), chunk_at).unwrap();
            }
        })
    };
    let layout = Layout::from_size_align(4096, 64).unwrap();
    let carved = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (0..20_000)
            .filter(|_| pool.allocate(layout).is_some())
            .count()
    }));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    let _ = std::fs::remove_file(&path);
    let carved = carved.expect("an allocation panicked on bytes another process wrote");
    println!("{carved} of 20000 allocations carved while the chunk size was written 0");
}

static KEPT_A: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x1111);
static KEPT_B: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x2222);

/// Whatever a process that may write the pool stores into its header, locks included (here:
/// addresses of this process's statics, in every word, while this process holds the lock),
/// this process writes nowhere but the pool: the locks keep no pointers in the file.
#[test]
fn addresses_written_into_the_pools_locks_are_never_written_through() {
    let path = pool_path("words");
    let pool = small_pool_at(&path);
    let file = OpenOptions::new().write(true).open(&path).unwrap();
    let (a, b) = (KEPT_A.as_ptr() as u64, KEPT_B.as_ptr() as u64);
    let flood = |from: u64, to: u64| {
        for (i, at) in (from..to).step_by(8).enumerate() {
            let word = if i % 2 == 0 { b } else { a + 8 };
            file.write_all_at(&word.to_ne_bytes(), at).unwrap();
        }
    };
    // While the lock is held: the two words where a `pthread_mutex_t` keeps its robust-list
    // links (the pool lock of layout version 4 sat at 160; its unlock wrote through them).
    numa_gpu_alloc::unstable::hold_pool_lock(&pool, || {
        file.write_all_at(&b.to_ne_bytes(), 160 + 24).unwrap();
        file.write_all_at(&(a + 8).to_ne_bytes(), 160 + 32).unwrap();
    })
    .unwrap();
    // Every lock word again, outside the lock, then a lock and unlock of each kind.
    flood(64, 512);
    let _ = pool.allocate(Layout::from_size_align(4096, 64).unwrap());
    let _ = numa_gpu_alloc::unstable::hold_registration_lock(&pool, || ());
    let _ = std::fs::remove_file(&path);
    assert_eq!(
        (
            KEPT_A.load(std::sync::atomic::Ordering::Relaxed),
            KEPT_B.load(std::sync::atomic::Ordering::Relaxed)
        ),
        (0x1111, 0x2222),
        "bytes in the pool's file chose a write into this process"
    );
}
