//! A second user on one machine: a test re-executes its own binary as `nobody` (uid and gid
//! 65534, no supplementary groups) through `setpriv`, which needs root. CI runs as root; a test
//! that needs a second user and is not root ends as `require.rs` says.
#![allow(dead_code)] // Each test binary uses part of it.

use std::process::{Child, Command, Stdio};

/// `nobody`'s user id.
pub const NOBODY: u32 = 65534;

/// Whether this process may run a second user's processes (it is root); if not, `what` ends
/// as `require.rs` says (fails under `CI=true`, else ignored at run time).
pub fn can_switch_users(what: &str) -> bool {
    // SAFETY: geteuid cannot fail and touches no memory.
    let root = unsafe { libc::geteuid() } == 0;
    super::require::met(
        root,
        format_args!("{what} needs root, to run a process as nobody"),
    )
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
