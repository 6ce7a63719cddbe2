//! The multi-process workload on one shared pool, for `examples/shared_pool.rs` and
//! `tests/shared_pool.rs`: processes re-executed from the running program, each attached by an
//! inherited descriptor, allocate and free at random, fill their blocks with a tag of their own,
//! and read the others' blocks at the handles the others publish in a directory block. A tag
//! found wrong in a block its owner still holds is an overlap (two live blocks sharing bytes).
//! One run also kills, with SIGKILL, a process holding the pool's lock. [`pair_cost`] times
//! allocate and free pairs, what the pool's lock costs each.
#![allow(dead_code)]

use std::alloc::Layout;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use numa_gpu_alloc::{PoolHandle, SharedPool};

/// The environment a child reads: `mode,index,processes,ops,fd,dir offset,dir len`.
pub const CHILD_ENV: &str = "NUMA_GPU_ALLOC_SHARED_CHILD";
/// Live blocks a process holds at most, each published in one directory slot.
const SLOTS: usize = 16;
/// Bytes of the pool the workload makes, and its chunk (small: blocks meet chunk boundaries).
pub const POOL_BYTES: usize = 64 << 20;
pub const CHUNK: usize = 2 << 20;

/// What a run of the workload found.
#[derive(Debug, Default)]
pub struct Summary {
    pub processes: usize,
    pub operations: u64,
    pub overlaps: u64,
    pub cross_reads: u64,
    pub finished: usize,
    pub rebuilds: u64,
    pub elapsed: Duration,
}

/// Makes a pool, runs `processes` children of `command` with `ops` steps each, and sums what
/// they printed; with `kill`, one more child first takes the pool's lock and is killed with
/// SIGKILL while the others wait for it.
pub fn run(processes: usize, ops: u64, kill: bool, command: impl Fn() -> Command) -> Summary {
    run_with(processes, ops, kill, 0, command)
}

/// As [`run`] without the holder, and the first `kills` workers killed with SIGKILL at
/// moments of their work (inside the pool's lock or outside it, wherever they are): the others
/// finish, and the pool attaches again afterwards (its state holds together). The killed ones'
/// blocks stay allocated, as a process's do when it dies.
pub fn run_killing(
    processes: usize,
    ops: u64,
    kills: usize,
    command: impl Fn() -> Command,
) -> Summary {
    run_with(processes, ops, false, kills, command)
}

fn run_with(
    processes: usize,
    ops: u64,
    kill: bool,
    kills: usize,
    command: impl Fn() -> Command,
) -> Summary {
    let start = Instant::now();
    let pool = inherited_pool();
    // The slots, then the start flag (the children start together, once all are attached).
    let dir_layout = Layout::from_size_align(processes * SLOTS * 16 + 8, 64).unwrap();
    let dir = pool
        .allocate_handle(dir_layout)
        .expect("the directory block");
    // SAFETY: the directory block is ours, just carved; zero means an empty slot.
    unsafe { std::ptr::write_bytes(pool.ptr(dir).unwrap().as_ptr(), 0, dir.len as usize) };
    let fd = pool.fd().as_raw_fd();
    let spawn = |mode: &str, index: usize| -> Child {
        command()
            .env(
                CHILD_ENV,
                format!(
                    "{mode},{index},{processes},{ops},{fd},{},{},{},{}",
                    dir.offset, dir.len, dir.pool, dir.serial
                ),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting a child")
    };
    let mut holder = kill.then(|| {
        let mut child = spawn("hold", processes);
        // A test harness prints its own lines first.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let held = lines.any(|l| l.is_ok_and(|l| l.contains("holding the pool's lock")));
        if !held {
            let _ = child.kill();
            panic!("the holder never said it holds the lock");
        }
        child
    });
    let mut children: Vec<Child> = (0..processes).map(|i| spawn("work", i)).collect();
    words(&pool, dir)[processes * SLOTS * 2].store(1, Ordering::Release);
    if let Some(holder) = &mut holder {
        // The others are blocked on the lock by now, or soon.
        std::thread::sleep(Duration::from_millis(200));
        holder.kill().unwrap();
        holder.wait().unwrap();
    }
    for (i, victim) in children.iter_mut().take(kills).enumerate() {
        std::thread::sleep(Duration::from_micros(1500 + 2300 * i as u64));
        let _ = victim.kill();
    }
    let mut summary = Summary {
        processes,
        ..Summary::default()
    };
    for child in children {
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        // A test harness prints its own words before the child's on the line.
        for line in text
            .lines()
            .filter_map(|l| l.find("child ").map(|at| &l[at..]))
        {
            let field = |name: &str| -> u64 {
                let at = line.find(name).unwrap() + name.len() + 1;
                line[at..]
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            summary.operations += field("ops");
            summary.overlaps += field("overlaps");
            summary.cross_reads += field("cross");
        }
        if out.status.success() {
            summary.finished += 1;
        } else {
            eprintln!("a child failed: {}\n{text}", out.status);
        }
    }
    summary.rebuilds = pool.stats().rebuilds;
    if kills > 0 {
        let again = SharedPool::attach_fd(pool.fd().try_clone_to_owned().unwrap());
        again.expect("the pool attaches again: its state holds together");
    } else {
        // SAFETY: every worker finished; nothing reads the directory any more.
        unsafe { pool.free(dir) }.expect("freeing the directory");
        assert_eq!(pool.stats().live_blocks, 0, "every block freed");
    }
    summary.elapsed = start.elapsed();
    summary
}

/// In a child started by [`run`]: does its part and returns true; false in any other process.
pub fn child() -> bool {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return false;
    };
    let f: Vec<&str> = spec.split(',').collect();
    let num = |i: usize| f[i].parse::<u64>().unwrap();
    let (index, processes, ops) = (num(1) as usize, num(2) as usize, num(3));
    // SAFETY: the descriptor the parent left open for us (inherited), ours alone here.
    let fd = unsafe { OwnedFd::from_raw_fd(num(4) as i32) };
    let pool = SharedPool::attach_fd(fd).expect("attaching by descriptor");
    let dir = PoolHandle {
        offset: num(5),
        len: num(6),
        pool: num(7) as u32,
        serial: num(8) as u32,
    };
    if f[0] == "pairs" {
        let ns = time_pairs(&pool, dir, ops);
        println!("child {index}: pairs {ops} ns {ns:.1}");
        return true;
    }
    if f[0] == "hold" {
        numa_gpu_alloc::unstable::hold_pool_lock(&pool, || {
            println!("holding the pool's lock");
            std::thread::sleep(Duration::from_secs(600));
        })
        .unwrap();
        return true;
    }
    let report = work(&pool, dir, index, processes, ops);
    println!(
        "child {index}: ops {} overlaps {} cross {}",
        report.0, report.1, report.2
    );
    true
}

/// Makes a pool, and times `pairs` allocate and free pairs (4 KiB blocks) in each of
/// `processes` children of `command` at once: nanoseconds per pair, averaged over them.
pub fn pair_cost(processes: usize, pairs: u64, command: impl Fn() -> Command) -> f64 {
    let pool = inherited_pool();
    let flag = pool
        .allocate_handle(Layout::from_size_align(64, 64).unwrap())
        .expect("the start flag's block");
    words(&pool, flag)[0].store(0, Ordering::Release);
    let spec = |index: usize| {
        format!(
            "pairs,{index},{processes},{pairs},{},{},{},{},{}",
            pool.fd().as_raw_fd(),
            flag.offset,
            flag.len,
            flag.pool,
            flag.serial
        )
    };
    let children: Vec<Child> = (0..processes)
        .map(|i| {
            command()
                .env(CHILD_ENV, spec(i))
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("starting a child")
        })
        .collect();
    // Attached by now, or soon: each waits for the flag, so that their loops overlap.
    std::thread::sleep(Duration::from_millis(100));
    words(&pool, flag)[0].store(1, Ordering::Release);
    let mut total = 0.0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "a timing child failed: {}",
            out.status
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let ns = text
            .split_whitespace()
            .skip_while(|w| *w != "ns")
            .nth(1)
            .and_then(|w| w.parse::<f64>().ok())
            .expect("a child's time");
        total += ns;
    }
    total / processes as f64
}

/// `pairs` allocate and free pairs once `flag`'s first word is set: nanoseconds per pair.
fn time_pairs(pool: &SharedPool, flag: PoolHandle, pairs: u64) -> f64 {
    while words(pool, flag)[0].load(Ordering::Acquire) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let layout = Layout::from_size_align(4096, 64).unwrap();
    let start = Instant::now();
    for _ in 0..pairs {
        let handle = pool.allocate_handle(layout).expect("a block");
        // SAFETY: the block just carved, never used.
        unsafe { pool.free(handle) }.expect("freeing it");
    }
    start.elapsed().as_nanos() as f64 / pairs.max(1) as f64
}

fn words(pool: &SharedPool, handle: PoolHandle) -> &[AtomicU64] {
    let ptr = pool.ptr(handle).unwrap();
    // SAFETY: a block of the pool, mapped while the pool lives; shared bytes are read and
    // written only as atomics.
    unsafe { std::slice::from_raw_parts(ptr.as_ptr().cast(), handle.len as usize / 8) }
}

/// `ops` random steps; (operations, overlaps, reads of others' blocks).
fn work(
    pool: &SharedPool,
    dir: PoolHandle,
    index: usize,
    processes: usize,
    ops: u64,
) -> (u64, u64, u64) {
    let slots = words(pool, dir);
    while slots[processes * SLOTS * 2].load(Ordering::Acquire) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut seed = 0x2545_f491_4f6c_dd1d ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9);
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut live: Vec<Option<(PoolHandle, u64)>> = vec![None; SLOTS];
    let (mut done, mut overlaps, mut cross) = (0, 0, 0);
    let mut tag = (index as u64 + 1) << 40;
    for _ in 0..ops {
        let slot = (rand() as usize) % SLOTS;
        match live[slot].take() {
            None => {
                let len = 8 << (rand() % 12);
                let align = 8 << (rand() % 10);
                let layout = Layout::from_size_align(len, align).unwrap();
                if let Some(handle) = pool.allocate_handle(layout) {
                    tag += 1;
                    for w in words(pool, handle) {
                        w.store(tag, Ordering::Relaxed);
                    }
                    let at = (index * SLOTS + slot) * 2;
                    slots[at].store(handle.offset, Ordering::Release);
                    slots[at + 1].store(tag, Ordering::Release);
                    live[slot] = Some((handle, tag));
                }
            }
            Some((handle, _)) => {
                let at = (index * SLOTS + slot) * 2;
                slots[at + 1].store(0, Ordering::Release);
                slots[at].store(0, Ordering::Release);
                // SAFETY: this worker's block, unpublished above: nobody reads it any more.
                unsafe { pool.free(handle) }.expect("freeing my block");
            }
        }
        done += 1;
        // Every block of mine still holds my tag: nobody else's block shares its bytes.
        for &(handle, tag) in live.iter().flatten() {
            if words(pool, handle)
                .iter()
                .any(|w| w.load(Ordering::Relaxed) != tag)
            {
                overlaps += 1;
            }
        }
        // A block another process holds, read at its handle, holds its tag.
        let other = (rand() as usize) % processes;
        let at = (other * SLOTS + (rand() as usize) % SLOTS) * 2;
        let (offset, want) = (
            slots[at].load(Ordering::Acquire),
            slots[at + 1].load(Ordering::Acquire),
        );
        if offset != 0 && want != 0 {
            // Only read through: the directory's pool id makes it this pool's.
            let handle = PoolHandle {
                offset,
                len: 8,
                ..dir
            };
            let seen = words(pool, handle)[0].load(Ordering::Relaxed);
            let still = slots[at + 1].load(Ordering::Acquire) == want
                && slots[at].load(Ordering::Acquire) == offset;
            if still {
                cross += 1;
                if seen != want {
                    overlaps += 1;
                }
            }
        }
    }
    // Unpublished before freed, as in the steps.
    for (slot, block) in live.into_iter().enumerate() {
        let at = (index * SLOTS + slot) * 2;
        slots[at + 1].store(0, Ordering::Release);
        slots[at].store(0, Ordering::Release);
        if let Some((handle, _)) = block {
            // SAFETY: this worker's block, unpublished above: nobody reads it any more.
            unsafe { pool.free(handle) }.expect("freeing my block");
        }
    }
    (done, overlaps, cross)
}

/// The workloads' pool on node 0, its descriptor inherited by the children.
fn inherited_pool() -> SharedPool {
    SharedPool::builder(POOL_BYTES)
        .node(0)
        .chunk(CHUNK)
        .inherit(true)
        .create()
        .expect("making the shared pool")
}
