//! The CUDA driver simulator (`tests/sim/cuda_sim.c`): built once per test binary as
//! `libcuda.so` with the system C compiler, then found the way libcuda is found. A test body runs
//! in a child process whose `LD_LIBRARY_PATH` starts with the simulator's folder, so cudarc's
//! loader and the crate's driver probe both open the simulator.
//!
//! With `NUMA_GPU_ALLOC_REAL_DRIVER=1` (as `scripts/gpu-check.sh` sets on a GPU machine) nothing
//! is built and the bodies run in the test process against the real driver; checks that read
//! the simulator's clock are then skipped, said so.
// Each test binary that includes this module uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use numa_gpu_alloc::ENV_VAR;

/// A test whose body runs against the simulator (in a child process, with `env` added) or, under
/// `NUMA_GPU_ALLOC_REAL_DRIVER=1`, in place against the real driver.
macro_rules! sim_test {
    ($(#[$attr:meta])* $name:ident, env: [$(($k:expr, $v:expr)),* $(,)?], $body:block) => {
        $(#[$attr])*
        #[test]
        fn $name() {
            if $crate::common::sim::in_body() {
                $body
            } else {
                // The harness names a test by its path below the crate root.
                let name = match module_path!().split_once("::") {
                    Some((_, module)) => format!("{module}::{}", stringify!($name)),
                    None => stringify!($name).to_owned(),
                };
                let (passed, output) = $crate::common::sim::run_child(&name, &[$(($k, $v)),*]);
                assert!(passed, "the test failed against the simulator:\n{output}");
                eprintln!("{output}");
            }
        }
    };
}

/// Set in the child process that runs one test body against the simulator.
const CHILD_VAR: &str = "NUMA_GPU_ALLOC_SIM_CHILD";
/// Set (to 1) to run the bodies against the real driver instead.
pub const REAL_DRIVER_VAR: &str = "NUMA_GPU_ALLOC_REAL_DRIVER";

/// Whether the bodies run against the real driver.
pub fn real_driver() -> bool {
    std::env::var_os(REAL_DRIVER_VAR).is_some_and(|v| v == "1")
}

/// Whether this process is the child that runs a body (against the simulator or the driver).
pub fn in_body() -> bool {
    real_driver() || std::env::var_os(CHILD_VAR).is_some()
}

/// Compiles the simulator (once per process) and returns the folder holding `libcuda.so`.
pub fn library_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| compile("cuda-sim", &[]))
}

/// The folder of a simulator built without host-NUMA memory (`cuMemCreate`, pools), as a driver
/// before CUDA 10.2: `("LD_LIBRARY_PATH", sim::without_host_numa())` in a test's `env` uses it.
pub fn without_host_numa() -> &'static str {
    static DIR: OnceLock<String> = OnceLock::new();
    DIR.get_or_init(|| {
        compile(
            "cuda-sim-without-host-numa",
            &["-DCUDA_SIM_WITHOUT_HOST_NUMA"],
        )
        .display()
        .to_string()
    })
}

/// Compiles the simulator with `defines` into `folder` of the target's temporary folder.
fn compile(folder: &str, defines: &[&str]) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sim/cuda_sim.c");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(folder);
    std::fs::create_dir_all(&dir).expect("creating the simulator's folder");
    // Test binaries build it concurrently: compile to a private name, then rename.
    let tmp = dir.join(format!("libcuda.so.{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args([
            "-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror",
        ])
        .args(defines)
        .arg("-o")
        .arg(&tmp)
        .arg(&source)
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler `{cc}` for the simulator: {e}"));
    assert!(
        out.status.success(),
        "compiling {}: {}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&tmp, dir.join("libcuda.so")).expect("installing the simulator");
    dir
}

/// Runs the test `name` of this binary in a child process against the simulator, with `env`
/// added (e.g. `("NUMA_GPU_ALLOC", "pin=on")`, `("CUDA_SIM_DELAY_US", "5000")`), and returns
/// whether it passed and its output. Under [`real_driver`] it is not called: bodies run in place.
pub fn run_child(name: &str, env: &[(&str, &str)]) -> (bool, String) {
    let dir = library_dir();
    let path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => format!("{}:{}", dir.display(), old.to_string_lossy()),
        None => dir.display().to_string(),
    };
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .env("LD_LIBRARY_PATH", path)
        .env_remove(ENV_VAR)
        .env_remove("CUDA_VISIBLE_DEVICES");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("re-executing the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The harness exits 0 with "0 passed" when the filter matched nothing: not a pass.
    let ran = text.contains("1 passed");
    (out.status.success() && ran, text)
}

/// What the simulator's virtual clock saw (layout of `struct sim_stats` in the C source).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SimStats {
    /// Sum of simulated copy durations and modelled host work, µs.
    pub busy_us: f64,
    /// Clock reset to the end of the last copy or host work, µs.
    pub span_us: f64,
    /// Copies that ran asynchronously (page-locked host memory).
    pub async_copies: u64,
    /// Copies that completed before returning (pageable host memory).
    pub sync_copies: u64,
    /// Host ranges registered or allocated page-locked now.
    pub registered_ranges: u64,
    /// Successful `cuMemHostRegister_v2` calls since the process started.
    pub registrations: u64,
    /// The longest range one of them covered, in bytes.
    pub largest_registration: u64,
    /// The longest time one of them took, µs (real time, the global lock held).
    pub longest_registration_us: u64,
}

impl SimStats {
    /// Busy time over span: 1.0 when copies ran one after another, up to 2.0 when the two copy
    /// directions always overlapped.
    pub fn overlap(&self) -> f64 {
        if self.span_us > 0.0 {
            self.busy_us / self.span_us
        } else {
            0.0
        }
    }
}

/// What host-NUMA memory the simulator holds (layout of `struct sim_host_numa_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostNumaStats {
    /// `cuMemCreate` allocations not yet released and unmapped.
    pub allocations: u64,
    /// `cuMemAddressReserve` ranges not yet freed.
    pub reservations: u64,
    /// `cuMemMap` mappings not yet unmapped.
    pub mappings: u64,
    /// Pools not yet destroyed and emptied.
    pub pools: u64,
    /// Their blocks, allocated or kept for reuse.
    pub pool_blocks: u64,
    /// Pool blocks made since the process started (a reuse makes none).
    pub pool_blocks_made: u64,
}

/// The simulator's control functions, from the already loaded `libcuda.so` (the child only).
pub struct Sim {
    lib: libloading::Library,
}

impl Sim {
    /// Opens the simulator that cudarc loaded (same name, so the same handle).
    pub fn get() -> Sim {
        // SAFETY: loading the simulator runs no initialiser of its own.
        let lib = unsafe { libloading::Library::new("libcuda.so") }.expect("the simulator loads");
        Sim { lib }
    }

    /// Restarts the virtual clock after the work queued so far.
    pub fn reset_clock(&self) {
        // SAFETY: `void cuSimResetClock(void)` in the C source.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn()>(b"cuSimResetClock")
                .unwrap())()
        }
    }

    /// The virtual clock's figures since the last reset.
    pub fn stats(&self) -> SimStats {
        let mut stats = SimStats::default();
        // SAFETY: `void cuSimStats(struct sim_stats *)`, whose layout `SimStats` repeats.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn(*mut SimStats)>(b"cuSimStats")
                .unwrap())(&mut stats)
        };
        stats
    }

    /// What host-NUMA memory is live now.
    pub fn host_numa_stats(&self) -> HostNumaStats {
        let mut stats = HostNumaStats::default();
        type StatsFn = unsafe extern "C" fn(*mut HostNumaStats);
        // SAFETY: `void cuSimHostNumaStats(struct sim_host_numa_stats *)`, whose layout
        // `HostNumaStats` repeats.
        unsafe { (self.lib.get::<StatsFn>(b"cuSimHostNumaStats").unwrap())(&mut stats) };
        stats
    }

    /// The simulator's function `name`, for calls the crate does not make.
    ///
    /// # Safety
    ///
    /// `F` must be the function's C prototype as an `unsafe extern "C" fn` type.
    pub unsafe fn function<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller's; the library stays loaded while `self` lives, and the simulator
        // is never unloaded before the process exits.
        unsafe { *self.lib.get::<F>(name.as_bytes()).unwrap() }
    }

    /// While `on`, page-locked copies stay queued: the test decides when they complete.
    pub fn hold(&self, on: bool) {
        // SAFETY: `void cuSimHold(int)` in the C source.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn(i32)>(b"cuSimHold")
                .unwrap())(i32::from(on))
        }
    }

    /// `cuMemHostRegister_v2(ptr, len, PORTABLE)` on the simulator, with a context current on
    /// this thread; the `CUresult`.
    pub fn register(&self, ptr: *mut u8, len: usize) -> u32 {
        type RegisterFn = unsafe extern "C" fn(*mut std::ffi::c_void, usize, u32) -> u32;
        // SAFETY: `CUresult cuMemHostRegister_v2(void *, size_t, unsigned)`; the simulator only
        // records the range.
        unsafe {
            (self.lib.get::<RegisterFn>(b"cuMemHostRegister_v2").unwrap())(ptr.cast(), len, 1)
        }
    }

    /// Makes the call `name` fail with `code` after `skip` good calls, `count` times.
    pub fn fail(&self, name: &str, code: u32, skip: u32, count: u32) {
        let name = std::ffi::CString::new(name).unwrap();
        type FailFn = unsafe extern "C" fn(*const std::ffi::c_char, u32, u32, u32);
        // SAFETY: `void cuSimFail(const char *, CUresult, unsigned, unsigned)`.
        unsafe { (self.lib.get::<FailFn>(b"cuSimFail").unwrap())(name.as_ptr(), code, skip, count) }
    }
}
