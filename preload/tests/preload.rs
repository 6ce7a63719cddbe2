//! The preload library under `LD_PRELOAD`, seen from outside as a program's users would see it:
//! C programs of the frameworks' call shapes (`tests/c/`), Python buffers (`tests/python/`), real
//! programs whose outputs must not change. On a one-node machine every page is on node 0 anyway:
//! the mapping's policy in `/proc/self/numa_maps` (`prefer:0`, where glibc's memory says
//! `default`) tells the library's blocks from glibc's, and each test that relies on it also
//! shows it failing without the library.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The library cargo built for these tests: in `deps/`, beside this test binary (`cargo test`
/// builds the library target, an rlib and the cdylib, without copying it up a folder).
fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let lib = exe.with_file_name("libnuma_gpu_alloc_preload.so");
    assert!(lib.is_file(), "{} not built", lib.display());
    lib
}

/// The launcher, told where this build's library is.
fn launcher() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_numa-gpu-alloc"));
    cmd.env("NUMA_GPU_ALLOC_LIBRARY", library());
    cmd
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Compiles `source` (relative to the package) with the system C compiler into `out`.
fn cc(source: &Path, out: &Path, extra: &[&str]) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    // Tests compile concurrently: each to a private name, then renamed into place.
    static COMPILED: AtomicUsize = AtomicUsize::new(0);
    let n = COMPILED.fetch_add(1, Ordering::Relaxed);
    let tmp = out.with_extension(format!("tmp{}-{n}", std::process::id()));
    let result = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-pthread"])
        .args(extra)
        .arg("-o")
        .arg(&tmp)
        .arg(source)
        .arg("-ldl")
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler `{cc}`: {e}"));
    assert!(
        result.status.success(),
        "compiling {}: {}",
        source.display(),
        String::from_utf8_lossy(&result.stderr)
    );
    std::fs::rename(&tmp, out).expect("installing the compiled file");
}

/// A test program of `tests/c/`, compiled once per test process.
fn program(name: &str, extra: &[&str]) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("preload-{name}"));
    cc(
        &manifest_dir().join(format!("tests/c/{name}.c")),
        &out,
        extra,
    );
    out
}

/// The folder holding the CUDA driver simulator built as `libcuda.so`.
fn simulator() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("preload-cuda-sim");
        std::fs::create_dir_all(&dir).expect("the simulator's folder");
        cc(
            &manifest_dir().join("../tests/sim/cuda_sim.c"),
            &dir.join("libcuda.so"),
            &["-shared", "-fPIC"],
        );
        dir
    })
}

/// Runs `cmd` with the library preloaded (or not) and `env` set; `NUMA_GPU_ALLOC` is the
/// test's alone.
fn run(cmd: &mut Command, preload: bool, env: &[(&str, &str)]) -> Output {
    run_within(cmd, preload, env, 600)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The pinned-memory shape (a power-of-two size touched per 4 KiB by 4 unbound threads, then
/// registered through the driver) for each call path: malloc (PyTorch's pinned memory), calloc,
/// posix_memalign (CPU tensors, nixlbench), aligned_alloc (Mooncake), realloc across the
/// threshold. `pin` is the library's setting; returns each run's output.
fn shapes(preload: bool, pin: &str) -> Vec<String> {
    let exe = program("pinned_shape", &[]);
    let settings = format!("gpu=0,pin={pin}");
    [
        "malloc",
        "calloc",
        "posix_memalign",
        "aligned_alloc",
        "realloc",
    ]
    .iter()
    .map(|api| {
        let out = run(
            Command::new(&exe).args([api, "26", "4", "0"]),
            preload,
            &[
                ("LD_LIBRARY_PATH", simulator().to_str().unwrap()),
                ("NUMA_GPU_ALLOC", &settings),
            ],
        );
        let text = text(&out);
        assert!(out.status.success(), "{api}: {text}");
        eprint!("{text}");
        text
    })
    .collect()
}

#[test]
fn every_call_path_is_placed_and_the_framework_registers_it_itself() {
    for text in shapes(true, "off") {
        assert!(text.contains("policy prefer:0"), "{text}");
        assert!(text.contains("elsewhere: 0"), "{text}");
        assert!(text.contains("register: 0"), "{text}");
    }
}

/// The checks above can fail: glibc's memory says `default`.
#[test]
fn without_the_library_the_memory_is_glibcs() {
    for text in shapes(false, "off") {
        assert!(text.contains("policy default"), "{text}");
    }
}

/// Why preload mode does not page-lock: a library that registers makes the framework's own
/// registration fail with 712, as with PyTorch and SGLang on a real driver.
#[test]
fn page_locking_in_the_library_would_make_the_frameworks_registration_fail() {
    for text in shapes(true, "on") {
        assert!(text.contains("register: 712"), "{text}");
    }
}

/// A calloc before main, free keeping errno, memalign's rounding, realloc across the threshold
/// both ways, fork, and 4 threads allocating and freeing each other's blocks of 64 B to 24 MiB
/// with every 512th byte checked: the same output as with glibc alone.
#[test]
fn lifecycle_and_threads_stress_match_glibc() {
    let exe = program("lifecycle", &[]);
    let with = run(Command::new(&exe).args(["4", "150"]), true, &[]);
    let without = run(Command::new(&exe).args(["4", "150"]), false, &[]);
    assert!(with.status.success(), "{}: {}", with.status, text(&with));
    assert!(
        without.status.success(),
        "{}: {}",
        without.status,
        text(&without)
    );
    assert_eq!(text(&with), text(&without));
    eprint!("{}", text(&with));
}

/// A freed block is given back (MADV_DONTNEED or munmap, which UCX's memory hooks watch) before
/// `free` returns, for carved blocks (8 MiB) and blocks with a mapping of their own (128 MiB).
/// With the cache on (`cache=4G`), a carved block is not: the check can fail.
#[test]
fn a_freed_block_is_given_back_before_its_addresses_serve_again() {
    let exe = program("reuse", &["-rdynamic"]);
    for mib in ["8", "128"] {
        let out = run(Command::new(&exe).arg(mib), true, &[]);
        let text = text(&out);
        eprint!("{mib} MiB: {text}");
        assert!(text.contains("given back: yes"), "{mib} MiB: {text}");
        assert!(text.contains("fresh: yes"), "{mib} MiB: {text}");
    }
    let cached = text(&run(
        Command::new(&exe).arg("8"),
        true,
        &[("NUMA_GPU_ALLOC", "cache=4G")],
    ));
    eprint!("8 MiB with cache=4G: {cached}");
    assert!(cached.contains("given back: no"), "{cached}");
}

/// `dlopen`ed rather than preloaded (global-dynamic TLS: an initial-exec library fails to load
/// or faults here), its own malloc serves a placed block on a fresh thread and the main one.
#[test]
fn the_library_can_be_dlopened() {
    let exe = program("dlopened", &[]);
    let out = run(Command::new(&exe).arg(library()), false, &[]);
    let text = text(&out);
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches("policy prefer:0").count(), 2, "{text}");
}

/// Python's bytearrays (and numpy's arrays where numpy is installed) of 64 MiB and more, run
/// through the launcher, are on node 0 page by page in mappings of the library's.
#[test]
fn python_buffers_are_placed_page_by_page() {
    let script = manifest_dir().join("tests/python/placed.py");
    let out = run(
        launcher()
            .args(["run", "--", "python3"])
            .arg(&script)
            .arg("0"),
        false,
        &[],
    );
    let text = text(&out);
    eprint!("{text}");
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("bytearray 256 MiB: policy prefer:0"),
        "{text}"
    );
    // Without the library the script itself fails: its check can.
    let plain = run(Command::new("python3").arg(&script).arg("0"), false, &[]);
    assert!(!plain.status.success(), "{}", self::text(&plain));
}

/// The launcher's environment reaches the program: the library first in LD_PRELOAD, the GPU in
/// the settings after the caller's, PyTorch's register flag merged into the caller's value.
#[test]
fn the_launcher_sets_the_environment() {
    let out = launcher()
        .args(["run", "--gpu", "1", "--", "env"])
        .env("LD_PRELOAD", "/nonexistent-other.so")
        .env("NUMA_GPU_ALLOC", "stats=off")
        .env("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        .output()
        .expect("running the launcher");
    let env = text(&out);
    assert!(out.status.success(), "{env}");
    let lib = library();
    assert!(
        env.contains(&format!(
            "LD_PRELOAD={}:/nonexistent-other.so",
            lib.display()
        )),
        "{env}"
    );
    assert!(
        env.contains("NUMA_GPU_ALLOC=bulk_max=256MiB,stats=off,gpu=1"),
        "{env}"
    );
    assert!(
        env.contains(
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True"
        ),
        "{env}"
    );
}

/// sort (with a 256 MiB buffer: a large malloc), gzip and xz (`-6`: an 8 MiB dictionary) on a
/// 2 MiB file: the same bytes out with the library as without. `scripts/preload-compare.sh`
/// runs them on GiB files.
#[test]
fn real_programs_give_identical_outputs() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("preload-real");
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("lines.txt");
    // Lines of 16 pseudo-random hex digits: xorshift, written without formatting machinery.
    let mut data = Vec::with_capacity(2 << 20);
    let mut x: u64 = 88172645463325252;
    while data.len() < 2 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend((0..16).map(|i| b"0123456789abcdef"[(x >> (4 * i)) as usize & 15]));
        data.push(b'\n');
    }
    std::fs::write(&input, data).unwrap();
    let jobs: [(&str, &[&str]); 3] = [
        ("sort", &["-S", "256M"]),
        ("gzip", &["-c", "-6"]),
        ("xz", &["-c", "-6", "-T1"]),
    ];
    for (program, args) in jobs {
        let go = |preload| {
            let out = run(Command::new(program).args(args).arg(&input), preload, &[]);
            assert!(out.status.success(), "{program}: {}", text(&out));
            out.stdout
        };
        let (with, without) = (go(true), go(false));
        assert!(!with.is_empty());
        assert!(
            with == without,
            "{program}'s output changed under the library"
        );
        eprintln!("{program}: {} bytes out, identical", with.len());
    }
}

/// Runs `cmd` as [`run`] says, killed after `seconds`: a hang fails the test, not CI.
fn run_within(cmd: &mut Command, preload: bool, env: &[(&str, &str)], seconds: u64) -> Output {
    cmd.env_remove("NUMA_GPU_ALLOC").env_remove("LD_PRELOAD");
    if preload {
        cmd.env("LD_PRELOAD", library());
    }
    cmd.envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("running the test program");
    // Drained while it runs: a program that writes more than a pipe holds would wait forever.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the program") {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = Output {
        status: status.unwrap_or_else(|| child.wait().expect("the killed program")),
        stdout: stdout.join().expect("stdout"),
        stderr: stderr.join().expect("stderr"),
    };
    assert!(
        status.is_some(),
        "{cmd:?} hung for {seconds} s: {}",
        text(&out)
    );
    out
}

/// The thresholds the cases below run at: every request from 4 KiB up is the library's, and
/// the default.
const THRESHOLDS: [&str; 2] = ["threshold=4K", "stats=off"];

/// Programs whose first large request comes from inside glibc (stdio's buffer while
/// `setlocale` holds the locale lock) start under the user's locale: nothing inside the
/// allocation takes that lock again (a `dlopen` probe there broke it for good, and the next
/// `mbstowcs` waited forever).
#[test]
fn programs_start_under_the_users_locale_at_any_threshold() {
    let locale = program("inside_glibc", &[]);
    let programs: [(&str, &[&str]); 5] = [
        ("bash", &["-c", "true"]),
        ("python3", &["-c", "pass"]),
        ("grep", &["-q", "x", "/dev/null"]),
        ("sed", &["-n", "1p", "/dev/null"]),
        (locale.to_str().unwrap(), &["locale"]),
    ];
    for settings in THRESHOLDS {
        for (exe, args) in programs {
            let env = [("LANG", "C.UTF-8"), ("NUMA_GPU_ALLOC", settings)];
            let out = run_within(Command::new(exe).args(args), true, &env, 20);
            // grep finds nothing in an empty file: status 1.
            let code = out.status.code();
            assert!(
                matches!(code, Some(0 | 1)),
                "{exe} {settings}: {}",
                text(&out)
            );
        }
    }
}

/// Successful large requests leave `errno` and a pending `dlerror()` as they were, and contain
/// no cancellation point (the per-block reads of a node's free memory were two `openat`s).
#[test]
fn errno_dlerror_and_cancellation_are_as_with_glibc() {
    let exe = program("inside_glibc", &[]);
    for settings in THRESHOLDS {
        for case in ["errno", "cancel"] {
            let env = [("NUMA_GPU_ALLOC", settings)];
            let out = run_within(Command::new(&exe).arg(case), true, &env, 30);
            assert!(out.status.success(), "{case} {settings}: {}", text(&out));
        }
    }
}

/// The library's threads block every signal: a daemon that blocks SIGTERM after setting up its
/// buffers (populated by the library's workers) and takes it with `sigwait` gets it, where a
/// worker would have died of it. Asked for no workers (`threads=1`), the process stays
/// single-threaded: `unshare(CLONE_NEWUSER)` works after its large requests.
#[test]
fn the_librarys_threads_take_no_signals_and_can_be_done_without() {
    let exe = program("sigwait", &[]);
    for settings in THRESHOLDS {
        let workers = format!("{settings},threads=4");
        let out = run_within(
            &mut Command::new(&exe),
            true,
            &[("NUMA_GPU_ALLOC", &workers)],
            30,
        );
        assert!(out.status.success(), "{workers}: {}", text(&out));
        assert!(
            text(&out).contains("sigwait took SIGTERM"),
            "{}",
            text(&out)
        );
        let single = format!("{settings},threads=1");
        let out = run_within(
            Command::new(&exe).arg("single"),
            true,
            &[("NUMA_GPU_ALLOC", &single)],
            30,
        );
        assert!(out.status.success(), "{single}: {}", text(&out));
    }
}

/// Fork handlers that a library loaded before this one registered (its constructor runs first)
/// allocate large blocks in prepare, parent and child, while two threads allocate: 20 forks
/// end, where the library's locks, taken by its own earlier-running prepare handler, made the
/// handlers wait on the forking thread itself.
#[test]
fn fork_handlers_registered_before_the_library_may_allocate() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let early = dir.join("libpreload-early-atfork.so");
    cc(
        &manifest_dir().join("tests/c/early_atfork.c"),
        &early,
        &["-shared", "-fPIC"],
    );
    let exe = program("forks", &[]);
    // Preloaded after the library, so initialised before it.
    let preload = format!("{}:{}", library().display(), early.display());
    for settings in THRESHOLDS {
        let env = [
            ("LD_PRELOAD", preload.as_str()),
            ("NUMA_GPU_ALLOC", settings),
        ];
        let out = run_within(&mut Command::new(&exe), false, &env, 60);
        assert!(out.status.success(), "{settings}: {}", text(&out));
    }
}

/// What `overcommit` (`tests/c/overcommit.c`) printed for `what`, in MiB.
fn mib_of(text: &str, what: &str) -> usize {
    text.lines()
        .find_map(|line| line.strip_prefix(what)?.strip_suffix(" MiB")?.parse().ok())
        .unwrap_or_else(|| panic!("no {what:?} in {text}"))
}

/// A `malloc` of 200 MiB with one byte written stays overcommitted, as with glibc (a table
/// sized for the worst case): the library populates such a block in bulk only once blocks of
/// its size were seen written whole, and then does. Under `bulk_max=256MiB` (the crate's own
/// default, and the library's before) the first check fails: the block is populated at once.
#[test]
fn an_untouched_malloc_stays_overcommitted_until_its_size_is_seen_written_whole() {
    let exe = program("overcommit", &[]);
    let size = 200;
    let go = |preload, env: &[(&str, &str)]| {
        let out = run(Command::new(&exe).arg(size.to_string()), preload, env);
        let text = text(&out);
        assert!(out.status.success(), "{text}");
        eprint!("{text}");
        (
            mib_of(&text, "untouched: "),
            mib_of(&text, "after whole writes: "),
        )
    };
    let (untouched, after) = go(true, &[]);
    assert!(untouched * 10 < size, "{untouched} MiB of {size} resident");
    assert!(after * 10 >= size * 9, "{after} MiB: not populated in bulk");
    let (untouched, _) = go(false, &[]);
    assert!(untouched * 10 < size, "glibc: {untouched} MiB");
    let (untouched, _) = go(true, &[("NUMA_GPU_ALLOC", "bulk_max=256MiB")]);
    assert!(
        untouched * 10 >= size * 9,
        "bulk_max=256MiB: {untouched} MiB"
    );
}
