//! Shared pools across processes: two and eight processes allocating, freeing, writing their
//! blocks and reading the others' at their handles with no overlap; a process killed while it
//! holds the pool's lock leaves the others working; attach by descriptor (inherited, and over a
//! Unix socket) and by path; each bad case (another layout, truncated, read-only, ...) refused
//! with its error, the pool others use intact.
#![cfg(target_os = "linux")]

#[path = "../examples/support/shared_workload.rs"]
mod shared_workload;
#[macro_use]
mod common {
    pub mod pools;
    #[macro_use]
    pub mod require;
}
use common::pools::{pool_path, small_pool_at};

use std::alloc::Layout;
use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;

use allocator_api2::vec::Vec as ApiVec;
use numa_gpu_alloc::{Error, PoolHandle, SharedPool};

const MIB: usize = 1 << 20;

/// Byte offsets of header fields the bad cases change (`src/pool/mod.rs`, `Header`).
const VERSION_AT: u64 = 12;
/// The layout tag's third entry: the size of the mutex.
const MUTEX_SIZE_AT: u64 = 24;
/// The layout tag's ninth entry: the C library.
const C_LIBRARY_AT: u64 = 48;
const NODE_AT: u64 = 64;
const CREATOR_AT: u64 = 80;
const READY_AT: u64 = 84;

fn children_of(test: &'static str) -> impl Fn() -> Command {
    move || {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command.args([test, "--exact", "--nocapture", "--test-threads=1"]);
        command
    }
}

#[test]
fn two_processes_share_one_pool() {
    if shared_workload::child() {
        return;
    }
    let s = shared_workload::run(2, 400, false, children_of("two_processes_share_one_pool"));
    println!("{s:?}");
    assert_eq!((s.finished, s.operations, s.overlaps), (2, 800, 0));
}

#[test]
fn eight_processes_share_one_pool() {
    if shared_workload::child() {
        return;
    }
    let s = shared_workload::run(8, 400, false, children_of("eight_processes_share_one_pool"));
    println!("{s:?}");
    assert_eq!((s.finished, s.operations, s.overlaps), (8, 3200, 0));
    assert!(s.cross_reads > 0, "the processes read each other's blocks");
}

#[test]
fn a_process_killed_holding_the_lock_leaves_the_others_working() {
    if shared_workload::child() {
        return;
    }
    let test = "a_process_killed_holding_the_lock_leaves_the_others_working";
    let s = shared_workload::run(4, 200, true, children_of(test));
    println!("{s:?}");
    assert_eq!((s.finished, s.operations, s.overlaps), (4, 800, 0));
    assert_eq!(
        s.rebuilds, 1,
        "the state was checked once, after the holder died"
    );
}

#[test]
fn a_process_without_a_driver_uses_the_pool_unpinned() {
    require!(
        !numa_gpu_alloc::cuda_driver_present(),
        "a CUDA driver is loadable here"
    );
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let e = pool
        .register_in_background(numa_gpu_alloc::GpuSelector::Auto, usize::MAX)
        .unwrap_err();
    assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
    let handle = pool.allocate_handle(Layout::from_size_align(4096, 4096).unwrap());
    assert!(handle.is_some());
    let stats = pool.stats();
    assert_eq!(
        (stats.registered_chunks, stats.registrations),
        (0, 0),
        "{stats:?}"
    );
}

#[test]
fn a_pool_is_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<SharedPool>();
    send_sync::<numa_gpu_alloc::PoolHandle>();
}

#[test]
fn processes_killed_at_random_moments_leave_the_others_working() {
    if shared_workload::child() {
        return;
    }
    let test = "processes_killed_at_random_moments_leave_the_others_working";
    let s = shared_workload::run_killing(8, 3000, 4, children_of(test));
    println!("{s:?}");
    assert_eq!((s.finished, s.overlaps), (4, 0));
}

#[test]
fn a_memory_file_pool_is_sealed_against_resizing() {
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    // Another holder of the file (as a process it was sent to or inherited it).
    let other = std::fs::File::from(pool.fd().try_clone_to_owned().unwrap());
    for len in [4 * MIB, 16 * MIB] {
        let e = other.set_len(len as u64).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "set_len({len}): {e}");
    }
    assert_eq!(other.metadata().unwrap().len(), 8 * MIB as u64);
    let handle = pool.allocate_handle(Layout::from_size_align(4096, 64).unwrap());
    assert!(handle.is_some(), "the pool works as before");
}

#[test]
fn the_creator_checks_every_page_on_the_node() {
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let stats = pool.stats();
    assert_eq!(
        stats.pages_checked,
        stats.usable_bytes as u64 / page,
        "every page of its blocks, through the placer: {stats:?}"
    );
    let attached = SharedPool::attach_fd(pool.fd().try_clone_to_owned().unwrap()).unwrap();
    assert_eq!(
        attached.stats().pages_checked,
        0,
        "attaching places nothing"
    );
}

#[test]
fn the_chunk_is_at_most_the_registration_bound() {
    const BOUND: &str = "register_max=4MiB";
    // The child runs with the bound in NUMA_GPU_ALLOC, which a process reads once.
    let child = std::env::var_os("NUMA_GPU_ALLOC").is_some_and(|v| v == BOUND);
    let pool = SharedPool::builder(16 * MIB)
        .node(0)
        .chunk(1 << 30)
        .create()
        .unwrap();
    let fits = |len| match pool.allocate_handle(Layout::from_size_align(len, 64).unwrap()) {
        // SAFETY: a block just carved, used by nothing.
        Some(handle) => unsafe { pool.free(handle) }.is_ok(),
        None => false,
    };
    if child {
        assert!(fits(4 * MIB), "a block of the bound");
        assert!(
            !fits(6 * MIB),
            "no block larger than the bound: the chunk is capped"
        );
        return;
    }
    assert!(
        fits(6 * MIB),
        "by default (256 MiB) the pool's 14 MiB of blocks are one chunk"
    );
    let test = "the_chunk_is_at_most_the_registration_bound";
    let out = children_of(test)()
        .env("NUMA_GPU_ALLOC", BOUND)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
}

#[test]
fn a_forked_child_dropping_its_inherited_pool_leaves_the_count() {
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    assert_eq!(pool.stats().attached, 1);
    // SAFETY: the child only reads the pool's stats, drops it and leaves with _exit.
    match unsafe { libc::fork() } {
        0 => {
            let seen = pool.stats();
            drop(pool);
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(i32::from(seen.attached != 1 || seen.registered_chunks != 0)) }
        }
        child => {
            assert!(child > 0, "fork failed");
            let mut status = 0;
            // SAFETY: waits for the child just forked.
            assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "{status}"
            );
        }
    }
    assert_eq!(pool.stats().attached, 1, "the child never counted itself");
}

/// Set in the child of the reclaim test, to the pool's inherited descriptor.
const RECLAIM_FD_VAR: &str = "NUMA_GPU_ALLOC_TEST_RECLAIM_FD";

#[test]
fn the_blocks_of_a_process_gone_are_reclaimed() {
    if let Ok(fd) = std::env::var(RECLAIM_FD_VAR) {
        // SAFETY: the descriptor the parent left open for this process.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd.parse().unwrap()) };
        let pool = SharedPool::attach_fd(fd).unwrap();
        for _ in 0..3 {
            pool.allocate_handle(Layout::from_size_align(4096, 64).unwrap())
                .unwrap();
        }
        // Ends without freeing them (and, returning, detaches).
        return;
    }
    let pool = SharedPool::builder(8 * MIB)
        .node(0)
        .inherit(true)
        .create()
        .unwrap();
    let mine = pool
        .allocate_handle(Layout::from_size_align(64, 8).unwrap())
        .unwrap();
    let test = "the_blocks_of_a_process_gone_are_reclaimed";
    let child = children_of(test)()
        .env(RECLAIM_FD_VAR, pool.fd().as_raw_fd().to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    assert!(child.wait_with_output().unwrap().status.success());
    assert_eq!(pool.stats().live_blocks, 4);
    // SAFETY: nothing uses the blocks of either process afterwards (refused here anyway).
    let e = unsafe { pool.reclaim(std::process::id()) }.unwrap_err();
    assert!(matches!(e, Error::PoolOwnerAlive { .. }), "{e}");
    // SAFETY: the child is gone, and its blocks were never handed to anyone.
    assert_eq!(unsafe { pool.reclaim(pid) }.unwrap(), (3, 3 * 4096));
    let stats = pool.stats();
    assert_eq!((stats.live_blocks, stats.frees), (1, 3), "{stats:?}");
    assert!(pool.is_live(mine).unwrap());
}

#[test]
fn attach_by_path_and_free_from_the_other_process() {
    let path = pool_path("path");
    let a = small_pool_at(&path);
    let b = SharedPool::attach(&path).expect("attaching by path");
    let handle = a
        .allocate_handle(Layout::from_size_align(4096, 64).unwrap())
        .unwrap();
    // SAFETY: a live block of the pool, used by this test alone.
    unsafe { a.ptr(handle).unwrap().as_ptr().write_bytes(0xa5, 4096) };
    // SAFETY: as above, through the other mapping.
    let seen = unsafe { *b.ptr(handle).unwrap().as_ptr().add(4095) };
    assert_eq!(seen, 0xa5);
    assert_eq!(b.stats().attached, 2);
    // SAFETY: the block is not used afterwards (the second free finds it freed).
    unsafe { b.free(handle) }.expect("freed by the other attachment");
    assert_eq!(a.stats().live_blocks, 0);
    // A smaller block carved where the freed one was is not freed by the stale handle.
    let kept = a
        .allocate_handle(Layout::from_size_align(64, 8).unwrap())
        .unwrap();
    assert_eq!(kept.offset, handle.offset);
    // SAFETY: as above.
    assert!(matches!(
        unsafe { a.free(handle) },
        Err(Error::PoolHandle { .. })
    ));
    assert!(a.is_live(kept).unwrap());
    // Creating again at the path is refused, and the pool is untouched.
    let again = SharedPool::builder(8 * MIB).node(0).path(&path).create();
    assert!(matches!(again, Err(Error::PoolExists { .. })), "{again:?}");
    assert!(b.is_live(kept).unwrap());
    drop(b);
    assert_eq!(a.stats().attached, 1);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_pool_at_a_path_outlives_its_creator() {
    let path = pool_path("outlives");
    let creator = small_pool_at(&path);
    let handle = creator
        .allocate_handle(Layout::from_size_align(4096, 64).unwrap())
        .unwrap();
    // SAFETY: a live block of the pool, used by this test alone.
    unsafe {
        creator
            .ptr(handle)
            .unwrap()
            .as_ptr()
            .write_bytes(0x3c, 4096)
    };
    drop(creator);
    let later = SharedPool::attach(&path).expect("the pool is still there");
    assert!(later.is_live(handle).unwrap());
    // SAFETY: as above.
    let kept = unsafe { *later.ptr(handle).unwrap().as_ptr().add(100) };
    assert_eq!(kept, 0x3c);
    assert_eq!(later.stats().attached, 1);
    // SAFETY: not used afterwards.
    unsafe { later.free(handle) }.unwrap();
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn attach_by_descriptor_over_a_unix_socket() {
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let (here, there) = UnixStream::pair().unwrap();
    pool.send(&here).unwrap();
    let other = SharedPool::receive(&there).expect("attaching by a received descriptor");
    let mut v = ApiVec::new_in(&other);
    v.extend(0..10_000u32);
    let handle = other
        .handle_of(std::ptr::NonNull::from(&v[0]).cast())
        .unwrap()
        .unwrap();
    // SAFETY: the vector's block, not written while read here.
    let first = unsafe { *pool.ptr(handle).unwrap().as_ptr().cast::<u32>().add(9_999) };
    assert_eq!(first, 9_999);
    assert_eq!(pool.stats().live_blocks, 1);
    drop(v);
    assert_eq!(pool.stats().live_blocks, 0);
    assert_eq!(pool.stats().attached, 2);
}

/// Sends `count` copies of `fd` in one `SCM_RIGHTS` message (none: a plain message), as a peer
/// other than `SharedPool::send` might.
fn send_fds(socket: &UnixStream, fd: std::os::fd::RawFd, count: usize) {
    let mut control = [0u64; 32];
    let mut byte = [b'p'];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: a zeroed msghdr pointing at live buffers: `control` (256 bytes, aligned for a
    // cmsghdr) holds one message of `count` (at most 32) descriptors, when there are any.
    unsafe {
        let data_len = (count * std::mem::size_of::<libc::c_int>()) as u32;
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if count > 0 {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(data_len) as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
            for i in 0..count {
                data.add(i).write_unaligned(fd);
            }
        }
        assert_eq!(libc::sendmsg(socket.as_raw_fd(), &msg, 0), 1);
    }
}

/// How many of this process's descriptors are of the memory file named `name`.
fn descriptors_of(name: &str) -> usize {
    let wanted = format!("/memfd:{name} (deleted)");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy() == wanted)
        .count()
}

#[test]
fn a_message_not_carrying_one_descriptor_is_refused_and_closed() {
    let name = format!("numa-gpu-alloc-recv-test-{}", std::process::id());
    let c_name = std::ffi::CString::new(name.as_str()).unwrap();
    // SAFETY: a valid C string; the new descriptor is owned by the file from here on.
    let file = unsafe {
        let fd = libc::memfd_create(c_name.as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        std::fs::File::from_raw_fd(fd)
    };
    // 20 descriptors overflow the receiver's control buffer (MSG_CTRUNC); two fit but are
    // not one; none is a plain message.
    for (count, said) in [
        (20, "MSG_CTRUNC"),
        (2, "more than one"),
        (0, "no descriptor"),
    ] {
        let (here, there) = UnixStream::pair().unwrap();
        send_fds(&here, file.as_raw_fd(), count);
        let e = SharedPool::receive(&there).unwrap_err();
        assert!(matches!(e, Error::FdNotReceived { .. }), "{count}: {e}");
        assert!(e.to_string().contains(said), "{count}: {e}");
        assert_eq!(
            descriptors_of(&name),
            1,
            "{count}: each that arrived was closed"
        );
    }
}

fn patch(path: &PathBuf, at: u64, bytes: &[u8]) {
    let file = OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(bytes, at).unwrap();
}

#[test]
fn bad_cases_are_refused_with_their_errors() {
    // Not a pool.
    let path = pool_path("foreign");
    std::fs::write(&path, vec![7u8; 4 * MIB]).unwrap();
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(matches!(e, Error::PoolForeign { .. }), "{e}");
    assert!(
        e.to_string().contains("not a numa-gpu-alloc shared pool"),
        "{e}"
    );
    std::fs::remove_file(&path).unwrap();

    // Another layout version; a damaged size; pages on another node; a stale half-made pool:
    // each refused, and the pool is as it was for the process using it.
    let path = pool_path("bad");
    let pool = small_pool_at(&path);
    let block = pool
        .allocate_handle(Layout::from_size_align(64, 8).unwrap())
        .unwrap();

    patch(&path, VERSION_AT, &99u32.to_le_bytes());
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(
        matches!(e, Error::PoolVersion { found: (1, 99), .. }),
        "{e}"
    );
    patch(&path, VERSION_AT, &6u32.to_le_bytes());

    // Made by a build of another layout: another libc's mutex, another byte order.
    let mut mutex_size = [0; 4];
    let file = OpenOptions::new().read(true).open(&path).unwrap();
    file.read_exact_at(&mut mutex_size, MUTEX_SIZE_AT).unwrap();
    let mutex_size = u32::from_ne_bytes(mutex_size);
    patch(&path, MUTEX_SIZE_AT, &(mutex_size + 8).to_ne_bytes());
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(
        matches!(e, Error::PoolLayout { field: "mutex size", found, expected, .. }
            if (found, expected) == (mutex_size + 8, mutex_size)),
        "{e}"
    );
    assert!(e.to_string().contains("same layout"), "{e}");
    patch(&path, MUTEX_SIZE_AT, &mutex_size.to_ne_bytes());
    // Of another C library: glibc's and musl's mutexes have one size but not one layout.
    let mut c_library = [0; 4];
    file.read_exact_at(&mut c_library, C_LIBRARY_AT).unwrap();
    patch(&path, C_LIBRARY_AT, &9u32.to_ne_bytes());
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(
        matches!(e, Error::PoolLayout { field, found: 9, .. } if field.starts_with("C library")),
        "{e}"
    );
    patch(&path, C_LIBRARY_AT, &c_library);
    let mut magic = [0; 8];
    file.read_exact_at(&mut magic, 0).unwrap();
    magic.reverse();
    patch(&path, 0, &magic);
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(
        matches!(
            e,
            Error::PoolLayout {
                field: "byte order mark",
                ..
            }
        ),
        "{e}"
    );
    magic.reverse();
    patch(&path, 0, &magic);

    patch(&path, NODE_AT, &7u32.to_le_bytes());
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(matches!(e, Error::PoolWrongNode { node: 7, .. }), "{e}");
    patch(&path, NODE_AT, &0u32.to_le_bytes());

    let gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait_with_output().unwrap();
    patch(&path, CREATOR_AT, &pid.to_le_bytes());
    patch(&path, READY_AT, &0u32.to_le_bytes());
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(
        matches!(e, Error::PoolStale { pid: p, .. } if p == pid),
        "{e}"
    );
    assert!(e.to_string().contains("remove the file"), "{e}");
    patch(&path, READY_AT, &1u32.to_le_bytes());

    let file = OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(10 * MIB as u64).unwrap();
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(matches!(e, Error::PoolCorrupt { .. }), "{e}");
    // Truncated, with its header (and carving state) kept, or shorter than a header and a
    // block: damaged, not foreign.
    for len in [6 * MIB, 3 * MIB] {
        file.set_len(len as u64).unwrap();
        let e = SharedPool::attach(&path).unwrap_err();
        assert!(matches!(e, Error::PoolCorrupt { .. }), "{len}: {e}");
        assert!(e.to_string().contains("truncated"), "{e}");
    }
    file.set_len(8 * MIB as u64).unwrap();
    // Its length back, its pages are not: sparse, damaged.
    let e = SharedPool::attach(&path).unwrap_err();
    assert!(matches!(e, Error::PoolSparse { .. }), "{e}");
    // SAFETY: fallocate on a descriptor of the test's file touches no memory of ours.
    let filled = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, 8 * MIB as i64) };
    assert_eq!(filled, 0, "{}", std::io::Error::last_os_error());

    // A descriptor opened read-only: refused, naming it, before anything is mapped.
    let read_only = std::fs::File::open(&path).unwrap();
    let e = SharedPool::attach_fd(read_only.into()).unwrap_err();
    assert!(
        matches!(&e, Error::PoolReadOnly { path } if path.to_string_lossy().starts_with("<fd ")),
        "{e}"
    );
    assert!(e.to_string().contains("read-write access"), "{e}");

    assert!(pool.is_live(block).unwrap());
    assert_eq!(pool.stats().attached, 1, "no refused attach counted");
    SharedPool::attach(&path).expect("the pool is whole again");
    std::fs::remove_file(&path).unwrap();

    // Larger than the node.
    let e = SharedPool::builder(1 << 50).node(0).create().unwrap_err();
    assert!(matches!(e, Error::PoolTooLarge { node: 0, .. }), "{e}");

    // Huge pages without free ones (this machine reserves none; skipped where some are).
    let free = std::fs::read_to_string(
        "/sys/devices/system/node/node0/hugepages/hugepages-2048kB/free_hugepages",
    )
    .map_or(0, |s| s.trim().parse::<usize>().unwrap_or(0));
    if free < 4 {
        let e = SharedPool::builder(8 * MIB)
            .node(0)
            .huge_pages(true)
            .create()
            .unwrap_err();
        assert!(matches!(e, Error::PoolHugePages { .. }), "{e}");
    }
}

#[test]
fn a_block_frees_itself_and_is_handed_over_by_its_handle() {
    let path = pool_path("owned");
    let a = small_pool_at(&path);
    let b = SharedPool::attach(&path).expect("attaching by path");
    let layout = Layout::from_size_align(4096, 64).unwrap();

    let block = a.allocate(layout).expect("room for a block");
    assert_eq!(block.len(), 4096);
    let handle = block.handle();
    // SAFETY: the block is this test's alone.
    unsafe { block.as_ptr().as_ptr().write_bytes(0x3c, block.len()) };
    assert!(b.is_live(handle).unwrap());
    drop(block);
    assert!(!b.is_live(handle).unwrap(), "dropping the block frees it");
    assert_eq!(a.stats().live_blocks, 0);

    // Handed over: the block outlives its first owner and is adopted through the other mapping.
    let handle = a.allocate(layout).expect("room").into_handle();
    assert!(a.is_live(handle).unwrap(), "into_handle does not free");
    // SAFETY: the adopted value is the block's only owner from here on.
    let adopted = unsafe { b.from_handle(handle) }.expect("adopting a live block");
    assert_eq!(adopted.as_ptr(), b.ptr(handle).unwrap());
    drop(adopted);
    assert!(!a.is_live(handle).unwrap(), "the adopter's drop frees it");

    // Adopting a freed block, or another pool's, is refused.
    // SAFETY: refused: nothing is adopted.
    let again = unsafe { b.from_handle(handle) };
    assert!(matches!(again, Err(Error::PoolHandle { .. })), "{again:?}");
    let other = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let theirs = other.allocate(layout).expect("room").into_handle();
    // SAFETY: as above.
    let foreign = unsafe { a.from_handle(theirs) };
    assert!(
        matches!(foreign, Err(Error::PoolHandle { .. })),
        "{foreign:?}"
    );
    assert!(
        other.is_live(theirs).unwrap(),
        "a refused adoption frees nothing"
    );
    std::fs::remove_file(&path).unwrap();
}

/// A forked child holds copies of its parent's values: dropping an inherited block there frees
/// nothing (the parent still owns it), while a block the child carved itself frees.
#[test]
fn a_forked_childs_copy_of_a_block_frees_nothing() {
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let layout = Layout::from_size_align(4096, 64).unwrap();
    let block = pool.allocate(layout).expect("room");
    let parents = block.handle();
    // SAFETY: the child only drops values and exits (no lock is held across the fork).
    match unsafe { libc::fork() } {
        0 => {
            drop(block);
            let own = pool.allocate(layout).map(|b| b.into_handle());
            let freed = own.is_some_and(|h| {
                // SAFETY: adopted back at once, the child's own block.
                drop(unsafe { pool.from_handle(h) });
                !pool.is_live(h).unwrap()
            });
            // SAFETY: ends the child without running the parent's destructors again.
            unsafe { libc::_exit(if freed { 0 } else { 3 }) }
        }
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        child => {
            let mut status = 0;
            // SAFETY: waits for the child just forked.
            assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
            assert_eq!(
                status, 0,
                "the child's own block did not free (status {status:#x})"
            );
        }
    }
    assert!(
        pool.is_live(parents).unwrap(),
        "the child's drop freed the parent's block"
    );
    let next = pool.allocate(layout).expect("room");
    assert_ne!(next.handle().offset, parents.offset);
    drop(block);
    assert!(
        !pool.is_live(parents).unwrap(),
        "the parent's drop frees it"
    );
}

/// A block handed over is the adopter's: reclaiming the blocks of the process that carved it,
/// once that process is gone, leaves it be.
#[test]
fn an_adopted_block_is_not_reclaimed_with_its_carver() {
    let pool = SharedPool::builder(8 * MIB).node(0).create().unwrap();
    let layout = Layout::from_size_align(4096, 64).unwrap();
    let mut fds = [0; 2];
    // SAFETY: a pipe for the child's handle.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child carves, writes the handle to the pipe and exits at once.
    let child = match unsafe { libc::fork() } {
        0 => {
            let handle = pool.allocate(layout).map(|b| b.into_handle().to_bytes());
            let bytes = handle.unwrap_or([0; 24]);
            // SAFETY: writes 24 bytes from a local array to the pipe, then ends the child.
            unsafe {
                libc::write(fds[1], bytes.as_ptr().cast(), bytes.len());
                libc::_exit(0)
            }
        }
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        child => child,
    };
    let mut bytes = [0u8; 24];
    // SAFETY: reads at most 24 bytes into a local array; waits for the child.
    unsafe {
        assert_eq!(libc::read(fds[0], bytes.as_mut_ptr().cast(), 24), 24);
        let mut status = 0;
        assert_eq!(libc::waitpid(child, &mut status, 0), child);
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    let handle = PoolHandle::from_bytes(bytes);
    // SAFETY: the carver is gone; this process owns the block from here on.
    let adopted = unsafe { pool.from_handle(handle) }.expect("adopting the child's block");
    // SAFETY: the child is gone, and the only block it carved is adopted.
    let reclaimed = unsafe { pool.reclaim(child as u32) }.unwrap();
    assert_eq!(
        reclaimed,
        (0, 0),
        "the adopted block was reclaimed with its carver"
    );
    assert!(pool.is_live(handle).unwrap());
    drop(adopted);
    assert!(!pool.is_live(handle).unwrap());
}
