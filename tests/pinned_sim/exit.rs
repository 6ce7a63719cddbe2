//! A thread that still queues copies with a `PinnedBuf` while the process exits: the crate's own
//! driver calls for those copies (the stream's wait for the buffer's earlier copies) never reach
//! the driver after its teardown began. The simulator's teardown takes 300 ms while the thread
//! runs on, and it aborts on a `cuStreamWaitEvent` made meanwhile.

use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::HostSlice;
use numa_gpu_alloc::{PinnedBuf, ENV_VAR};

use super::{context, pattern, sim, MIB, PINNING};

const CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_COPYING_AT_EXIT";

/// The child: a thread prepares copies from a buffer in a loop (the crate's part of each: the
/// wait for the buffer's event), and `main` exits 20 ms in.
fn copying_child() {
    let ctx = context();
    let stream = ctx.new_stream().expect("a stream");
    let buf = PinnedBuf::from_slice(&PINNING, &pattern(4 * MIB, 1)).expect("PinnedBuf");
    let go = Arc::new(Barrier::new(2));
    let started = Arc::clone(&go);
    std::thread::spawn(move || {
        started.wait();
        loop {
            // Only the crate's part of a copy: cudarc's own calls (the copy, the event record
            // that dropping `sync` makes) would reach the teardown as well, outside the crate.
            // SAFETY: the slice is not used; nothing is queued that could use it.
            let (_, sync) = unsafe { buf.stream_synced_slice(&stream) };
            std::mem::forget(sync);
            std::thread::sleep(Duration::from_micros(200));
        }
    });
    go.wait();
    std::thread::sleep(Duration::from_millis(20));
    eprintln!("copying child: exiting");
    std::process::exit(0);
}

#[test]
fn copies_queued_while_the_process_exits_never_wait_in_the_teardown() {
    if std::env::var_os(CHILD_VAR).is_some() {
        return copying_child();
    }
    require!(
        !sim::real_driver(),
        "on the real driver: needs the simulator's slow teardown"
    );
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "exit::copies_queued_while_the_process_exits_never_wait_in_the_teardown",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "1")
        .env("LD_LIBRARY_PATH", sim::library_dir())
        .env_remove(ENV_VAR)
        .env("CUDA_SIM_TEARDOWN_US", "300000")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("running the child");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("copying child: exiting"),
        "the child ({}) called the driver in its teardown or failed:\n{stderr}",
        out.status
    );
}
