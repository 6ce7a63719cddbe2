//! What a test needs from the machine it runs on. A test whose need is not met ends early, and
//! never passes silently:
//! - where the need is required — under `CI=true`, or `NUMA_GPU_ALLOC_TEST_STRICT=1` — it fails,
//!   naming what was missing;
//! - elsewhere it prints `ignored at run time: <why>` on stderr (past the harness's capture) and
//!   returns; `scripts/gpu-check.sh` counts those lines as skipped, not passed.
//!
//! Only what CI's plain `cargo test` step provides is checked this way: the CUDA driver simulator
//! (not a real driver), no loadable libcuda, `mlock`. What CI provides only in a step of its own
//! (reserved huge pages, a GPU) is `#[ignore = "…"]`d instead, so the harness itself reports it
//! ignored with its reason, and that step runs it with `--include-ignored`.
// Each test binary that includes this module uses part of it.
#![allow(dead_code)]

use std::io::Write;

/// Set to `1` to fail every test whose need is not met, as under `CI=true`.
pub const STRICT_VAR: &str = "NUMA_GPU_ALLOC_TEST_STRICT";

/// Whether a missing need fails the test (`CI=true` or [`STRICT_VAR`]`=1`).
pub fn strict() -> bool {
    let set = |var: &str, value: &str| std::env::var_os(var).is_some_and(|v| v == value);
    set("CI", "true") || set(STRICT_VAR, "1")
}

/// `true` when `met`; otherwise fails the test under [`strict`], or reports it ignored with `why`
/// and returns `false` (the caller returns).
pub fn met(met: bool, why: impl std::fmt::Display) -> bool {
    if met {
        return true;
    }
    assert!(
        !strict(),
        "required here (CI=true or {STRICT_VAR}=1), but missing: {why}"
    );
    // Straight to stderr: the harness captures `eprintln!` of a passing test.
    let _ = writeln!(std::io::stderr(), "ignored at run time: {why}");
    false
}

/// Returns from the test unless `$met`: see the module's doc.
#[allow(unused_macros)] // Binaries that only call `met` (through `nobody.rs`).
macro_rules! require {
    ($met:expr, $($why:tt)+) => {
        if !$crate::common::require::met($met, format_args!($($why)+)) {
            return;
        }
    };
}
