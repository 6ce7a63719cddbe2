//! Child processes: a test re-executes its own binary with one test selected and a variable in
//! the environment, for checks that change process-wide state (resource limits, seccomp
//! filters) or that end the process.
//!
//! ```ignore
//! #[test]
//! fn the_test() {
//!     if child::mode(CHILD_VAR).is_some() {
//!         return in_the_child();
//!     }
//!     let (stdout, stderr) = child::run("the_test", CHILD_VAR, "1");
//!     // checks of what the child printed
//! }
//! ```

use std::process::Command;

use numa_gpu_alloc::ENV_VAR;

/// The value of `var` when this process is a child started by [`run`], `None` in the parent.
pub fn mode(var: &str) -> Option<String> {
    std::env::var_os(var).map(|m| m.to_string_lossy().into_owned())
}

/// Runs this test binary again with only `test` selected (one thread, output not captured),
/// `var=mode` set and `NUMA_GPU_ALLOC` removed, asserts that the child exited successfully, and
/// returns its stdout and stderr.
pub fn run(test: &str, var: &str, mode: &str) -> (String, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(var, mode)
        .env_remove(ENV_VAR)
        .output()
        .expect("re-executing the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "child {var}={mode} failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    (stdout, stderr)
}
