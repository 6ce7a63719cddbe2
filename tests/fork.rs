//! fork() while other threads use the allocator: every child must allocate and exit; none may hang
//! on a lock that a thread of the parent held at the fork. Own binary: the global allocator is
//! ours and the tests fork.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use allocator_api2::vec::Vec as VecIn;
use numa_gpu_alloc::NumaGpuAlloc;

mod common {
    pub mod fill;
    pub mod pattern;
}

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();

const MIB: usize = 1 << 20;
const FORKS: usize = 200;
/// A child allocates a few MiB and exits in milliseconds; one still running after this is hung.
const CHILD_TIMEOUT: Duration = Duration::from_secs(20);

/// How the forked children ended.
#[derive(Debug, Default, PartialEq, Eq)]
struct Children {
    succeeded: usize,
    failed: usize,
    hung: usize,
}

impl Children {
    /// Forks; the child runs `work` and exits with 0 when it returns true. Waits for the child
    /// up to [`CHILD_TIMEOUT`], then kills it and counts it as hung.
    fn fork(&mut self, work: impl FnOnce() -> bool) {
        // SAFETY: the child only runs `work` and leaves with `_exit`, never returning into the
        // test harness (whose other threads do not exist in it).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = std::panic::catch_unwind(AssertUnwindSafe(work)).unwrap_or(false);
            // SAFETY: ends the child at once, without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let deadline = Instant::now() + CHILD_TIMEOUT;
        let mut status = 0;
        loop {
            // SAFETY: `pid` is our child; `status` is a valid out-pointer.
            let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if done == pid {
                let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
                *if ok {
                    &mut self.succeeded
                } else {
                    &mut self.failed
                } += 1;
                return;
            }
            if Instant::now() > deadline {
                // SAFETY: signals and reaps our own child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                self.hung += 1;
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn assert_all_succeeded(&self, scenario: &str) {
        println!("{scenario}: {self:?}");
        assert_eq!(
            *self,
            Children {
                succeeded: FORKS,
                ..Children::default()
            },
            "{scenario}"
        );
    }
}

/// What every child does: 5 MiB through the global allocator, written and checked.
fn allocate_in_child() -> bool {
    let mut v = vec![0u8; 5 * MIB];
    common::pattern::fill(&mut v, 7);
    common::pattern::check(&v, 7);
    true
}

#[test]
fn fork_while_another_thread_allocates_large_blocks() {
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let worker = {
        let (stop, rounds) = (Arc::clone(&stop), Arc::clone(&rounds));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let v: Vec<u8> = Vec::with_capacity(3 * MIB);
                std::hint::black_box(&v);
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut children = Children::default();
    for _ in 0..FORKS {
        children.fork(allocate_in_child);
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    println!(
        "worker rounds: {}, {}",
        rounds.load(Ordering::Relaxed),
        ALLOC.stats()
    );
    children.assert_all_succeeded("fork during large allocations");
}

#[test]
fn fork_while_another_thread_initialises_an_allocator() {
    let mut children = Children::default();
    let mut during_initialisation = 0;
    for round in 0..FORKS {
        let alloc = Arc::new(NumaGpuAlloc::new());
        let started = Instant::now();
        let initialiser = {
            let alloc = Arc::clone(&alloc);
            std::thread::spawn(move || {
                let begin = started.elapsed();
                let v: VecIn<u8, _> = VecIn::with_capacity_in(3 * MIB, &*alloc);
                std::hint::black_box(&v);
                (begin, started.elapsed())
            })
        };
        // 0–1 ms after the thread starts: before, during and after its initialisation.
        std::thread::sleep(Duration::from_micros((round as u64 * 37) % 1000));
        let fork_at = started.elapsed();
        children.fork(|| {
            let mut v: VecIn<u8, _> = VecIn::with_capacity_in(5 * MIB, &*alloc);
            common::fill::resize(&mut v, 5 * MIB, 0);
            common::pattern::fill(&mut v, 3);
            common::pattern::check(&v, 3);
            allocate_in_child()
        });
        let (begin, end) = initialiser.join().unwrap();
        during_initialisation += usize::from(begin < fork_at && fork_at < end);
    }
    println!("forks requested while the allocator initialised: {during_initialisation}");
    assert!(during_initialisation > 0, "no fork hit an initialisation");
    children.assert_all_succeeded("fork during initialisation");
}

#[test]
fn fork_while_populate_threads_run() {
    // No cache: every 128 MiB block is mapped and populated by several threads again.
    let alloc = Arc::new(NumaGpuAlloc::new().cache_limit(0).populate_threads(4));
    let stop = Arc::new(AtomicBool::new(false));
    let populating = Arc::new(AtomicBool::new(false));
    let worker = {
        let (alloc, stop, populating) = (
            Arc::clone(&alloc),
            Arc::clone(&stop),
            Arc::clone(&populating),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                populating.store(true, Ordering::SeqCst);
                let v: VecIn<u8, _> = VecIn::with_capacity_in(128 * MIB, &*alloc);
                populating.store(false, Ordering::SeqCst);
                std::hint::black_box(&v);
            }
        })
    };
    let mut children = Children::default();
    let mut during_populate = 0;
    for _ in 0..FORKS {
        during_populate += usize::from(populating.load(Ordering::SeqCst));
        children.fork(|| {
            let v: VecIn<u8, _> = VecIn::with_capacity_in(5 * MIB, &*alloc);
            std::hint::black_box(&v);
            allocate_in_child()
        });
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    println!("forks while a block was being populated: {during_populate}");
    assert!(during_populate > 0, "no fork hit a populate");
    children.assert_all_succeeded("fork during populate");
}

/// A reservation under way when the process forks: in the child its thread does not exist, so
/// waiting for it reports that at once instead of blocking or panicking.
#[test]
fn a_background_reservation_is_lost_in_a_forked_child() {
    static RESERVING: NumaGpuAlloc = NumaGpuAlloc::new();
    let reservation = RESERVING
        .reserve_in_background(512 * MIB)
        .expect("a reservation thread");
    let mut children = Children::default();
    children.fork(move || {
        let finished = reservation.is_finished();
        let lost = matches!(
            reservation.wait(),
            Err(numa_gpu_alloc::Error::ReservationLost { .. })
        );
        finished && lost
    });
    assert_eq!(
        children,
        Children {
            succeeded: 1,
            ..Children::default()
        }
    );
    RESERVING.trim();
}
