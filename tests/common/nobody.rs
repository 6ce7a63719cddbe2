//! A second user on one machine: a test re-executes its own binary as `nobody` (uid and gid
//! 65534, no supplementary groups) through `setpriv`, which needs root. CI runs as root; a test
//! that needs a second user and is not root fails under `CI=true`, and says it skipped
//! otherwise.
#![allow(dead_code)] // Each test binary uses part of it.

use std::io::Write;
use std::process::{Child, Command, Stdio};

/// `nobody`'s user id.
pub const NOBODY: u32 = 65534;

/// Whether this process may run a second user's processes (it is root). Not root: fails the
/// test under `CI=true` (or `NUMA_GPU_ALLOC_TEST_STRICT=1`), else says on stderr that `what`
/// was ignored at run time, and the caller returns.
pub fn can_switch_users(what: &str) -> bool {
    // SAFETY: geteuid cannot fail and touches no memory.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let set = |var: &str, value: &str| std::env::var_os(var).is_some_and(|v| v == value);
    assert!(
        !set("CI", "true") && !set("NUMA_GPU_ALLOC_TEST_STRICT", "1"),
        "required here (CI=true), but missing: {what} needs root, to run a process as nobody"
    );
    // Straight to stderr: the harness captures `eprintln!` of a passing test.
    let _ = writeln!(
        std::io::stderr(),
        "ignored at run time: {what} needs root, to run a process as nobody"
    );
    false
}

/// Starts this test binary again as `nobody`, with only `test` selected and `var=mode` set;
/// its stdout piped, its stderr inherited.
pub fn spawn_as_nobody(test: &str, var: &str, mode: &str) -> Child {
    Command::new("/usr/bin/setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(var, mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("running the test binary as nobody (setpriv)")
}
