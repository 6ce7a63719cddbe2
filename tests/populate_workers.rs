//! The populate workers run on the CPUs the process may use, whichever thread first needed them:
//! a loader thread pinned to one core must not confine every later populate to that core.
//!
//! Its own binary: the workers are the process's, made by the first large block populated.

use std::alloc::{GlobalAlloc, Layout};

use numa_gpu_alloc::NumaGpuAlloc;

// Eager: unpinned blocks are otherwise faulted in where touched, with no workers.
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().populate_threads(2).populate_eager(true);

/// `Cpus_allowed_list` of the task `/proc/self/task/<tid>` (or of the process for `None`).
fn cpus_allowed(task: Option<&str>) -> String {
    let path = match task {
        Some(tid) => format!("/proc/self/task/{tid}/status"),
        None => "/proc/self/status".into(),
    };
    let status = std::fs::read_to_string(path).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|cpus| cpus.trim().to_owned())
        .unwrap_or_default()
}

/// The allowed CPUs of every populate worker of this process.
fn workers() -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    tasks
        .flatten()
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|comm| comm.starts_with("numa-populate"))
        })
        .map(|task| cpus_allowed(task.file_name().to_str()))
        .collect()
}

#[test]
fn workers_do_not_inherit_the_first_callers_pinning() {
    let process = cpus_allowed(None);
    let first_cpu = process.split([',', '-']).next().unwrap().to_owned();
    std::thread::spawn(move || {
        let cpu: usize = first_cpu.parse().unwrap();
        // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET stays inside it (cpu < 1024, the
        // set's size, on any machine this runs on); the call reads only `set`.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            let rc = libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
            assert_eq!(rc, 0, "pinning the thread to CPU {cpu}");
        }
        let layout = Layout::from_size_align(96 << 20, 4096).unwrap();
        // SAFETY: a non-zero layout, freed below with it.
        unsafe {
            let block = ALLOC.alloc(layout);
            assert!(!block.is_null());
            ALLOC.dealloc(block, layout);
        }
    })
    .join()
    .unwrap();
    let workers = workers();
    assert!(
        !workers.is_empty(),
        "a 96 MiB block is populated by the pool"
    );
    assert!(
        workers.iter().all(|cpus| *cpus == process),
        "workers {workers:?}, the process may use {process}"
    );
}
