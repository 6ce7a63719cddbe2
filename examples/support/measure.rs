//! What `benches/alloc.rs` and `examples/mixed_workload.rs` both need to measure: CPU-time clocks
//! (on a shared machine, time other processes hold the CPUs is not the work's cost) and a fixed
//! pseudo-random sequence.
//!
//! Included with `#[path]` by both.

use std::time::Duration;

/// The CPU time `clock` reads: `libc::CLOCK_THREAD_CPUTIME_ID` (this thread) or
/// `libc::CLOCK_PROCESS_CPUTIME_ID` (every thread of the process).
pub fn cpu_time(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime({clock}) failed");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// splitmix64: a fixed, dependency-free sequence.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
