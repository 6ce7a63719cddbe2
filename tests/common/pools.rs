//! Shared pools at a path under `/dev/shm`, named for the test and this process.
// Each test binary that includes this module uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use numa_gpu_alloc::SharedPool;

const MIB: usize = 1 << 20;

/// `/dev/shm/numa-gpu-alloc-test-NAME-PID`.
pub fn pool_path(name: &str) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/numa-gpu-alloc-test-{name}-{}",
        std::process::id()
    ))
}

/// An 8 MiB pool of 2 MiB chunks on node 0 at `path` (a file left there before is removed).
pub fn small_pool_at(path: &Path) -> SharedPool {
    let _ = std::fs::remove_file(path);
    SharedPool::builder(8 * MIB)
        .node(0)
        .chunk(2 * MIB)
        .path(path)
        .create()
        .expect("making a pool at a path")
}

/// Runs `body` while another thread of this process holds `pool`'s carving lock, and returns
/// what it returned once the lock is released.
pub fn with_pool_lock_held<R: Send>(pool: &SharedPool, body: impl FnOnce() -> R + Send) -> R {
    let (held, holding) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            numa_gpu_alloc::unstable::hold_pool_lock(pool, || {
                held.send(()).unwrap();
                released.recv().unwrap();
            })
            .unwrap();
        });
        holding.recv().unwrap();
        let out = body();
        release.send(()).unwrap();
        out
    })
}
