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
//!     let (stdout, stderr) = child::run("the_test", CHILD_VAR, "1", &[]);
//!     // checks of what the child printed
//! }
//! ```
// Each test binary that includes this module uses part of it.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use numa_gpu_alloc::ENV_VAR;

/// How long a child may run: one that hangs (a deadlock at exit, say) fails the test instead.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The harness's name of the test `name` in the module `module` (its `module_path!()`): the path
/// below the crate root, which [`run`] selects.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, below)) => format!("{below}::{name}"),
        None => name.to_owned(),
    }
}

/// [`run`] for the test `name` of the module `module` (its `module_path!()`), with `var=1`.
pub fn run_test(module: &str, name: &str, var: &str) -> (String, String) {
    run(&test_path(module, name), var, "1", &[])
}

/// The value of `var` when this process is a child started by [`run`], `None` in the parent.
pub fn mode(var: &str) -> Option<String> {
    std::env::var_os(var).map(|m| m.to_string_lossy().into_owned())
}

/// Runs this test binary again with only `test` selected (one thread, output not captured),
/// `var=mode` set, `NUMA_GPU_ALLOC` removed and then `env` set (so `env` may set it again),
/// asserts that the child exited successfully, and returns its stdout and stderr. A child still
/// running after two minutes is killed and the test fails.
pub fn run(test: &str, var: &str, mode: &str, env: &[(&str, &str)]) -> (String, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(var, mode)
        .env_remove(ENV_VAR)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("re-executing the test binary");
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child {var}={mode} {env:?} still running after {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = stdout.join().unwrap();
    let stderr = stderr.join().unwrap();
    assert!(
        status.success(),
        "child {var}={mode} {env:?} failed: {status}\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

/// Reads a child's pipe to its end on a thread of its own, so the child never blocks on it.
fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}
