//! Shared pools of real 2 MiB huge pages: a memory file of `MFD_HUGETLB` pages made, attached by
//! a second process that carves and writes a block the first reads, and its pages given back to
//! the node's reserve when the last process lets go; and a pool at a path on a hugetlbfs mount.
//!
//! They need huge pages reserved on node 0 (as root: `echo 64 > /proc/sys/vm/nr_hugepages`) and,
//! for the path, a hugetlbfs mount named by `NUMA_GPU_ALLOC_TEST_HUGETLBFS`, so they are
//! `#[ignore]`d, reported as such with that reason; run with `-- --include-ignored` (as
//! `.ci/run` does, after reserving the pages and mounting a hugetlbfs), each fails when what it
//! needs is missing.
#![cfg(target_os = "linux")]

use std::alloc::Layout;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use numa_gpu_alloc::{PoolHandle, SharedPool};

const MIB: usize = 1 << 20;
const HUGE_PAGE: usize = 2 * MIB;
/// The pool's size: 16 huge pages, its header included.
const POOL: usize = 32 * MIB;
/// Set in the child process: the number of the pool's inherited descriptor.
const CHILD_FD: &str = "SHARED_POOL_HUGE_FD";
const PATTERN: u8 = 0x5b;
/// Held by each test: they count the node's free huge pages.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Free 2 MiB huge pages on node 0.
fn free_huge_pages() -> usize {
    std::fs::read_to_string(
        "/sys/devices/system/node/node0/hugepages/hugepages-2048kB/free_hugepages",
    )
    .map_or(0, |s| s.trim().parse().unwrap_or(0))
}

/// Fails the test when what it needs is missing: it runs only when asked for.
fn needs(what: &str, missing: Option<String>) {
    if let Some(missing) = missing {
        panic!("{what}: {missing}");
    }
}

/// The child: attaches by the inherited descriptor, fills a block and prints its handle.
fn child(fd: &str) {
    let fd: i32 = fd.parse().expect("a descriptor number");
    // SAFETY: the parent left this descriptor open across exec for this process alone.
    let pool = SharedPool::attach_fd(unsafe { OwnedFd::from_raw_fd(fd) }).expect("attaching");
    assert!(
        pool.stats().huge_pages,
        "the attached pool is of huge pages"
    );
    let handle = pool
        .allocate_handle(Layout::from_size_align(3 * HUGE_PAGE, 64).unwrap())
        .expect("a block of three huge pages");
    // SAFETY: a live block of the pool, this process's alone until the parent frees it.
    unsafe {
        pool.ptr(handle)
            .unwrap()
            .as_ptr()
            .write_bytes(PATTERN, handle.len as usize)
    };
    println!(
        "handle {} {} {} {}",
        handle.offset, handle.len, handle.pool, handle.serial
    );
}

#[test]
#[ignore = "needs 2 MiB huge pages reserved on node 0 (and a hugetlbfs mount in NUMA_GPU_ALLOC_TEST_HUGETLBFS): run with --include-ignored"]
fn a_pool_of_huge_pages_is_shared_by_two_processes_and_given_back() {
    if let Some(fd) = std::env::var_os(CHILD_FD) {
        return child(fd.to_str().unwrap());
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let before = free_huge_pages();
    let missing = (before < POOL / HUGE_PAGE).then(|| {
        format!(
            "node 0 has {before} free 2 MiB huge pages, {} needed",
            POOL / HUGE_PAGE
        )
    });
    needs("the huge-page memory file", missing);
    let pool = SharedPool::builder(POOL)
        .node(0)
        .huge_pages(true)
        .inherit(true)
        .create()
        .expect("making a pool of huge pages");
    let stats = pool.stats();
    assert!(stats.huge_pages);
    assert_eq!(stats.pool_bytes, POOL);
    assert_eq!(
        before - free_huge_pages(),
        POOL / HUGE_PAGE,
        "every page of the pool is a reserved huge page, populated when made"
    );
    pool.check_placement().expect("all on node 0");

    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_pool_of_huge_pages_is_shared_by_two_processes_and_given_back",
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_FD, pool.fd().as_raw_fd().to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let handle = stdout
        .lines()
        .find_map(|l| {
            // libtest may have begun the line with the test's name.
            let mut words = l.split("handle ").nth(1)?.split(' ');
            Some(PoolHandle {
                offset: words.next()?.parse().ok()?,
                len: words.next()?.parse().ok()?,
                pool: words.next()?.parse().ok()?,
                serial: words.next()?.parse().ok()?,
            })
        })
        .unwrap_or_else(|| panic!("no handle in the child's output: {stdout}"));
    assert!(
        pool.is_live(handle).unwrap(),
        "the child's block outlives the child"
    );
    // SAFETY: a live block; its writer has exited.
    let block = unsafe {
        std::slice::from_raw_parts(pool.ptr(handle).unwrap().as_ptr(), handle.len as usize)
    };
    assert!(
        block.iter().all(|&b| b == PATTERN),
        "the child's writes are seen here"
    );
    // SAFETY: not used afterwards.
    unsafe { pool.free(handle) }.expect("freed by the other process");
    assert_eq!(pool.stats().live_blocks, 0);
    assert_eq!(
        free_huge_pages(),
        before - POOL / HUGE_PAGE,
        "held while mapped"
    );
    drop(pool);
    assert_eq!(
        free_huge_pages(),
        before,
        "the pages go back when the last process lets go"
    );
}

#[test]
#[ignore = "needs 2 MiB huge pages reserved on node 0 (and a hugetlbfs mount in NUMA_GPU_ALLOC_TEST_HUGETLBFS): run with --include-ignored"]
fn a_pool_at_a_path_on_hugetlbfs_is_attached_by_path() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mount = std::env::var_os("NUMA_GPU_ALLOC_TEST_HUGETLBFS").map(PathBuf::from);
    let before = free_huge_pages();
    let missing = match &mount {
        None => Some("NUMA_GPU_ALLOC_TEST_HUGETLBFS names no hugetlbfs mount".to_string()),
        Some(_) if before < POOL / HUGE_PAGE => Some(format!(
            "node 0 has {before} free 2 MiB huge pages, {} needed",
            POOL / HUGE_PAGE
        )),
        Some(_) => None,
    };
    needs("the pool on hugetlbfs", missing);
    let path = mount
        .unwrap()
        .join(format!("numa-gpu-alloc-test-{}", std::process::id()));
    let pool = SharedPool::builder(POOL)
        .node(0)
        .huge_pages(true)
        .path(&path)
        .create()
        .expect("making a pool on hugetlbfs");
    assert!(pool.stats().huge_pages);
    let other = SharedPool::attach(&path).expect("attaching by path");
    let handle = pool
        .allocate_handle(Layout::from_size_align(HUGE_PAGE, 64).unwrap())
        .unwrap();
    // SAFETY: a live block, used by this test alone.
    unsafe {
        pool.ptr(handle)
            .unwrap()
            .as_ptr()
            .write_bytes(PATTERN, HUGE_PAGE)
    };
    // SAFETY: as above, through the other mapping.
    assert_eq!(
        unsafe { *other.ptr(handle).unwrap().as_ptr().add(HUGE_PAGE - 1) },
        PATTERN
    );
    assert_eq!(other.stats().attached, 2);
    drop((pool, other));
    assert_eq!(
        free_huge_pages(),
        before - POOL / HUGE_PAGE,
        "a pool at a path keeps its pages while the path exists"
    );
    std::fs::remove_file(&path).unwrap();
    assert_eq!(free_huge_pages(), before);
}
