//! Shared pools registered against the CUDA driver simulator (`tests/sim/`): two processes
//! attach one pool and each registers its own mapping chunk by chunk in the background, one
//! registration per chunk per process, each unregistered before the mapping goes at detach; a
//! process that exits with its pool attached ends cleanly, a registration under way included;
//! a copy over a whole block works (none straddles two registrations); the pool's stats do not
//! wait behind a registration waiting for the pool's registration lock; a lock file another
//! user holds does not stop a registration; a registration waiting for the pool's lock is
//! cancelled by dropping the pool, leaving no thread or descriptor, and gives up after the
//! pool's lock wait naming the holder.
#![cfg(target_os = "linux")]

#[macro_use]
mod common {
    pub mod nobody;
    #[macro_use]
    pub mod require;
    #[macro_use]
    pub mod sim;
}

use std::alloc::Layout;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::nobody::can_switch_users;
use common::sim::{self, Sim};
use numa_gpu_alloc::{Error, GpuSelector, SharedPool};

const MIB: usize = 1 << 20;
/// The pool's chunk, and its chunks: 8 of 2 MiB after the 2 MiB header.
const CHUNK: usize = 2 * MIB;
const CHUNKS: usize = 8;
/// The node-wide lock file earlier builds registered under, which any user could hold.
const NODE_LOCK_FILE: &str = "/dev/shm/numa-gpu-alloc.register.node0.lock";
/// Set in the second process, to the pool's inherited descriptor.
const ATTACH_VAR: &str = "NUMA_GPU_ALLOC_SIM_POOL_FD";

/// What the simulator saw about the lock file and unregistrations (`struct sim_lock_stats`).
#[repr(C)]
#[derive(Debug, Default)]
struct LockStats {
    unlocked_registrations: u64,
    unmapped_unregistrations: u64,
    unregistrations: u64,
}

fn lock_stats() -> LockStats {
    let mut stats = LockStats::default();
    // SAFETY: `void cuSimLockStats(struct sim_lock_stats *)`, whose layout `LockStats` repeats.
    unsafe {
        let f: unsafe extern "C" fn(*mut LockStats) = Sim::get().function("cuSimLockStats");
        f(&mut stats);
    }
    stats
}

/// Registers `pool` in the background, waits, checks this process's counts, detaches, and
/// returns the simulator's registrations and lock counts after the detach.
fn register_and_detach(pool: SharedPool) -> (u64, LockStats) {
    let before = Sim::get().stats().registrations;
    let reservation = pool
        .register_in_background(GpuSelector::Ordinal(0), usize::MAX)
        .expect("registering with the simulator");
    let done = reservation.wait().expect("every chunk registered");
    assert_eq!(done.chunks, CHUNKS, "{done}");
    let stats = pool.stats();
    assert_eq!(stats.registered_chunks, CHUNKS, "{stats:?}");
    assert_eq!(stats.registered_bytes, CHUNKS * CHUNK);
    let sim = Sim::get().stats();
    assert!(sim.largest_registration <= CHUNK as u64, "{sim:?}");
    assert_eq!(sim.registrations - before, CHUNKS as u64);
    // A host-to-device copy of a whole chunk-sized block: inside one registration.
    let block = pool
        .allocate_handle(Layout::from_size_align(CHUNK, 64).unwrap())
        .expect("a chunk-sized block");
    let ptr = pool.ptr(block).unwrap();
    copy_to_device(ptr.as_ptr(), CHUNK);
    // SAFETY: the copy completed (`copy_to_device` waits); not used afterwards.
    unsafe { pool.free(block) }.unwrap();
    drop(pool);
    assert_eq!(
        Sim::get().stats().registered_ranges,
        0,
        "all unregistered at detach"
    );
    (sim.registrations - before, lock_stats())
}

/// `cuMemcpyHtoDAsync_v2` of `len` bytes at `host` to a fresh device allocation on the null
/// stream, then its synchronisation: the simulator refuses a copy over two registrations, and
/// runs a copy from page-locked memory asynchronously (counted).
fn copy_to_device(host: *mut u8, len: usize) {
    type Retain = unsafe extern "C" fn(*mut *mut std::ffi::c_void, i32) -> u32;
    type SetCurrent = unsafe extern "C" fn(*mut std::ffi::c_void) -> u32;
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> u32;
    type Copy = unsafe extern "C" fn(u64, *const std::ffi::c_void, usize, usize) -> u32;
    type Sync = unsafe extern "C" fn(usize) -> u32;
    type Free = unsafe extern "C" fn(u64) -> u32;
    let sim = Sim::get();
    let before = sim.stats().async_copies;
    // SAFETY: the driver's prototypes (a stream as a pointer-sized handle, 0 the null stream);
    // the crate pushes its context only for its own calls, so this makes it current.
    unsafe {
        let retain: Retain = sim.function("cuDevicePrimaryCtxRetain");
        let set: SetCurrent = sim.function("cuCtxSetCurrent");
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(set(ctx), 0);
        let alloc: Alloc = sim.function("cuMemAlloc_v2");
        let copy: Copy = sim.function("cuMemcpyHtoDAsync_v2");
        let sync: Sync = sim.function("cuStreamSynchronize");
        let free: Free = sim.function("cuMemFree_v2");
        let mut dev = 0;
        assert_eq!(alloc(&mut dev, len), 0);
        assert_eq!(
            copy(dev, host.cast(), len, 0),
            0,
            "a block's copy is refused"
        );
        assert_eq!(sync(0), 0);
        assert_eq!(free(dev), 0);
    }
    assert_eq!(
        sim.stats().async_copies,
        before + 1,
        "copied from page-locked memory"
    );
}

/// A pool of `CHUNKS` chunks of `CHUNK` on node 0.
fn chunked_pool() -> SharedPool {
    SharedPool::builder(2 * MIB + CHUNKS * CHUNK)
        .node(0)
        .chunk(CHUNK)
        .inherit(true)
        .create()
        .unwrap()
}

sim_test!(
    /// Two processes, each registering its mapping: 2 × 8 chunk registrations, none
    /// unregistered after its range was unmapped.
    two_processes_register_their_mappings_chunk_by_chunk,
    env: [("CUDA_SIM_REGISTER_US_PER_GIB", "200000")],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: counts the simulator's registrations"
        );
        if let Ok(fd) = std::env::var(ATTACH_VAR) {
            // SAFETY: the descriptor the first process left open for us.
            let fd = unsafe { OwnedFd::from_raw_fd(fd.parse().unwrap()) };
            let pool = SharedPool::attach_fd(fd).expect("attaching by descriptor");
            let (registrations, locks) = register_and_detach(pool);
            println!(
                "second: registrations {registrations} unmapped-before-unregister {} \
                 unregistrations {}",
                locks.unmapped_unregistrations, locks.unregistrations
            );
            return;
        }
        let pool = chunked_pool();
        let second = Command::new(std::env::current_exe().unwrap())
            .args([
                "two_processes_register_their_mappings_chunk_by_chunk",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ATTACH_VAR, pool.fd().as_raw_fd().to_string())
            .stderr(std::process::Stdio::inherit())
            .spawn_and_wait_output();
        let (registrations, locks) = register_and_detach(pool);
        let out = second.join().unwrap();
        assert!(out.status.success(), "the second process failed");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().find_map(|l| l.find("second:").map(|at| &l[at..])).unwrap();
        println!("first: registrations {registrations} unmapped-before-unregister {} \
                  unregistrations {}\n{line}",
            locks.unmapped_unregistrations, locks.unregistrations);
        let field = |name: &str| -> u64 {
            let at = line.find(name).unwrap() + name.len() + 1;
            line[at..].split_whitespace().next().unwrap().parse().unwrap()
        };
        let total = registrations + field("registrations");
        println!("2 processes x {CHUNKS} chunks = {total} registrations");
        assert_eq!(total, 2 * CHUNKS as u64);
        assert_eq!(locks.unmapped_unregistrations + field("unmapped-before-unregister"), 0);
        assert_eq!(locks.unregistrations + field(" unregistrations"), 2 * CHUNKS as u64);
    }
);

sim_test!(
    /// The pinned limit counts what this process registered: three chunks fit, the fourth is
    /// refused with the limit's error, and the three stay registered until detach.
    the_pinned_limit_counts_this_processs_registrations,
    env: [],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: counts the simulator's registrations"
        );
        let pool = chunked_pool();
        let reservation = pool
            .register_in_background(GpuSelector::Ordinal(0), 3 * CHUNK)
            .unwrap();
        let e = reservation.wait().unwrap_err();
        assert!(matches!(e, numa_gpu_alloc::Error::PinLimit { .. }), "{e}");
        let stats = pool.stats();
        assert_eq!((stats.registered_chunks, stats.registrations), (3, 3), "{stats:?}");
        drop(pool);
        assert_eq!(Sim::get().stats().registered_ranges, 0);
    }
);

/// Set in the process that exits with its pool attached.
const EXIT_VAR: &str = "NUMA_GPU_ALLOC_SIM_POOL_EXIT";

sim_test!(
    /// A process that ends with `std::process::exit` while its pool is attached, registered in
    /// part, and a registration under way: nothing drops the pool, so the crate neither
    /// unregisters nor unmaps (the kernel unmaps at exit, the driver releases the
    /// registrations with the process), no registration reaches the driver after its teardown
    /// began (the simulator aborts on one), and nothing was unregistered after an unmap.
    a_process_exiting_with_its_pool_attached_ends_cleanly,
    env: [("CUDA_SIM_REGISTER_US_PER_GIB", "20000000"), ("CUDA_SIM_TEARDOWN_US", "200000")],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: reads the simulator's counts"
        );
        let test = "a_process_exiting_with_its_pool_attached_ends_cleanly";
        if std::env::var_os(EXIT_VAR).is_some() {
            let pool = chunked_pool();
            let reservation = pool
                .register_in_background(GpuSelector::Ordinal(0), usize::MAX)
                .unwrap();
            while reservation.progress().chunks == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (sim, locks) = (Sim::get().stats(), lock_stats());
            println!(
                "exiting: registered {} unmapped-before-unregister {}",
                sim.registered_ranges, locks.unmapped_unregistrations
            );
            std::process::exit(0);
        }
        let out = Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(EXIT_VAR, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the exiting process failed: {:?}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let line = text.lines().find(|l| l.contains("exiting:")).expect("the exit line");
        println!("{line}");
        let field = |name: &str| -> u64 {
            let at = line.find(name).unwrap() + name.len() + 1;
            line[at..].split_whitespace().next().unwrap().parse().unwrap()
        };
        assert!(field("registered") >= 1, "it exited with chunks registered");
        assert_eq!(field("unmapped-before-unregister"), 0);
    }
);

sim_test!(
    /// The pool's stats (and its `Debug`) answer while a registration waits for the pool's
    /// registration lock, which another thread holds meanwhile: they do not wait behind it.
    stats_answer_while_a_registration_waits_for_the_pools_lock,
    env: [],
    {
        let pool = chunked_pool();
        let (release, released) = mpsc::channel::<()>();
        let (held, holding) = mpsc::channel();
        let (sent, got) = mpsc::channel();
        std::thread::scope(|s| {
            let pool = &pool;
            s.spawn(move || {
                numa_gpu_alloc::unstable::hold_registration_lock(pool, || {
                    held.send(()).unwrap();
                    released.recv().unwrap();
                })
                .unwrap();
            });
            holding.recv().unwrap();
            let reservation = pool
                .register_in_background(GpuSelector::Ordinal(0), usize::MAX)
                .unwrap();
            std::thread::sleep(Duration::from_millis(100));
            s.spawn(move || sent.send((pool.stats(), format!("{pool:?}"))).unwrap());
            // Generous for a loaded 2-core machine: the stats take microseconds.
            let answer = got.recv_timeout(Duration::from_secs(5));
            assert_eq!(reservation.progress().chunks, 0, "it waits for the lock");
            release.send(()).unwrap();
            let (stats, debug) = answer.expect("the stats waited behind the registration");
            assert_eq!(stats.registered_chunks, 0, "{stats:?}");
            assert!(debug.contains("registered_chunks: 0"), "{debug}");
            assert_eq!(reservation.wait().unwrap().chunks, CHUNKS);
        });
    }
);

/// Threads and descriptors of this process now.
fn threads_and_descriptors() -> (usize, usize) {
    let count = |dir| std::fs::read_dir(dir).unwrap().count();
    (count("/proc/self/task"), count("/proc/self/fd"))
}

/// Waits (up to 5 s) for this process's threads and descriptors to be back at `before`.
fn back_to(before: (usize, usize)) -> (usize, usize) {
    let start = Instant::now();
    loop {
        let now = threads_and_descriptors();
        if now == before || start.elapsed() > Duration::from_secs(5) {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

sim_test!(
    /// Another user (nobody) holding the node-wide lock file earlier builds registered under,
    /// made first with mode 0600, stops no registration: a pool registers all its chunks, and
    /// 20 pools made, registered and dropped meanwhile leave no thread or descriptor behind.
    another_users_lock_file_holds_no_registration,
    env: [],
    {
        require!(
            !sim::real_driver(),
            "on the real driver: counts the simulator's registrations"
        );
        if !can_switch_users("another_users_lock_file_holds_no_registration") {
            return;
        }
        let _ = std::fs::remove_file(NODE_LOCK_FILE);
        let mut holder = Command::new("/usr/bin/setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .args(["/bin/sh", "-c", &format!("umask 077; exec flock -x -o {NODE_LOCK_FILE} sleep 30")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let held = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            let free = Command::new("flock").args(["-n", NODE_LOCK_FILE, "true"]).status();
            free.is_ok_and(|s| !s.success())
        });
        let outcome = std::panic::catch_unwind(|| {
            assert!(held, "nobody never held the lock file");
            // Counted once the first pool is made: the node's populate workers stay.
            let mut before = threads_and_descriptors();
            for round in 0..21 {
                let pool = chunked_pool();
                let reservation = pool
                    .register_in_background(GpuSelector::Ordinal(0), usize::MAX)
                    .unwrap();
                if round == 0 {
                    let (sent, got) = mpsc::channel();
                    std::thread::spawn(move || sent.send(reservation.wait().map(|p| p.chunks)));
                    let chunks = got
                        .recv_timeout(Duration::from_secs(10))
                        .expect("the registration did not end within 10 s");
                    assert_eq!(chunks.unwrap(), CHUNKS);
                    println!("registered {CHUNKS} of {CHUNKS} chunks while nobody held {NODE_LOCK_FILE}");
                } else {
                    drop(reservation);
                }
                drop(pool);
                if round == 0 {
                    std::thread::sleep(Duration::from_millis(100));
                    before = threads_and_descriptors();
                }
            }
            let after = back_to(before);
            println!("threads, descriptors: {before:?} before, {after:?} after 21 pools");
            assert_eq!(after, before, "threads or descriptors left behind");
        });
        let _ = holder.kill();
        let _ = holder.wait();
        let _ = std::fs::remove_file(NODE_LOCK_FILE);
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }
);

/// Set in the process that holds the pool's registration lock: the pool's descriptor.
const HOLDER_VAR: &str = "NUMA_GPU_ALLOC_SIM_REGISTRATION_HOLDER";

sim_test!(
    /// Another process of the pool holding its registration lock: a registration waiting for
    /// it gives up after the lock wait with an error naming that process, and 20 attachments
    /// whose registrations wait, dropped, leave no thread or descriptor behind.
    a_registration_waiting_for_the_pools_lock_names_the_holder_and_is_cancelled_by_drop,
    env: [],
    {
        if let Ok(fd) = std::env::var(HOLDER_VAR) {
            // SAFETY: the descriptor the first process left open for us.
            let fd = unsafe { OwnedFd::from_raw_fd(fd.parse().unwrap()) };
            let pool = SharedPool::attach_fd(fd).unwrap();
            numa_gpu_alloc::unstable::hold_registration_lock(&pool, || {
                println!("holding the registration lock");
                std::thread::sleep(Duration::from_secs(120));
            })
            .unwrap();
            return;
        }
        let pool = chunked_pool();
        let mut holder = Command::new(std::env::current_exe().unwrap())
            .args([
                "a_registration_waiting_for_the_pools_lock_names_the_holder_and_is_cancelled_by_drop",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HOLDER_VAR, pool.fd().as_raw_fd().to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(holder.stdout.take().unwrap()));
        assert!(lines.any(|l| l.is_ok_and(|l| l.contains("holding the registration lock"))));
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let before = threads_and_descriptors();
            for _ in 0..20 {
                let again = SharedPool::attach_fd(pool.fd().try_clone_to_owned().unwrap()).unwrap();
                let reservation = again
                    .register_in_background(GpuSelector::Ordinal(0), usize::MAX)
                    .unwrap();
                drop(reservation);
                drop(again);
            }
            let after = back_to(before);
            println!("threads, descriptors: {before:?} before, {after:?} after 20 dropped");
            assert_eq!(after, before, "threads or descriptors left behind");
            let short = SharedPool::attacher()
                .lock_wait(Duration::from_millis(300))
                .attach_fd(pool.fd().try_clone_to_owned().unwrap())
                .unwrap();
            let e = short
                .register_in_background(GpuSelector::Ordinal(0), usize::MAX)
                .unwrap()
                .wait()
                .unwrap_err();
            println!("{e}");
            assert!(
                matches!(e, Error::PoolLockHeld { lock: "registration", pid: Some(pid), .. } if pid == holder.id()),
                "{e}"
            );
        }));
        let _ = holder.kill();
        let _ = holder.wait();
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }
);

/// Spawns on a thread of its own, which waits for the child's output.
trait SpawnAndWait {
    fn spawn_and_wait_output(&mut self) -> std::thread::JoinHandle<std::process::Output>;
}

impl SpawnAndWait for Command {
    fn spawn_and_wait_output(&mut self) -> std::thread::JoinHandle<std::process::Output> {
        let child = self.stdout(std::process::Stdio::piped()).spawn().unwrap();
        std::thread::spawn(move || child.wait_with_output().unwrap())
    }
}
