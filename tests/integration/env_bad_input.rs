//! Bad `NUMA_GPU_ALLOC` values: malformed, out of range, duplicated, conflicting, empty. Each
//! case runs in a child process (this test binary, re-executed with the variable set), since the
//! variable is read once, when an allocator initialises. Each rejected entry gives exactly one
//! stderr line and one entry in `stats().config_errors`; the rest applies; nothing panics and the
//! allocator keeps working. The builder's checked path, `Config::apply`, gives the same errors.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::process::Command;

use allocator_api2::vec::Vec as AVec;
use numa_gpu_alloc::{
    Config, Error, GpuSelector, MemPolicy, NumaGpuAlloc, NumaTopology, PinMode, Target, ENV_VAR,
};

use crate::common;

const CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_BAD_INPUT_CHILD";
const MIB: usize = 1 << 20;

/// The child: initialise an allocator, use it, report what it ended up with.
fn child() {
    let alloc = NumaGpuAlloc::new();
    let placement = alloc.placement();
    // A large allocation (whatever the threshold became) and a small one work.
    let threshold = alloc.stats().threshold;
    let mut big: AVec<u8, _> = AVec::with_capacity_in(threshold + MIB, &alloc);
    big.resize(threshold + MIB, 0xab);
    assert!(big.iter().step_by(4096).all(|&b| b == 0xab));
    drop(big);
    let small: Vec<u8> = (0..100).collect();
    assert_eq!(small[99], 99);
    let stats = alloc.stats();
    assert_eq!(stats.fallbacks.failed_allocations, 0, "{stats}");
    assert_eq!(stats.live_bytes(), 0);
    println!("CONFIG {:?}", alloc.config());
    println!("ERRORS {:?}", stats.config_errors);
    println!("HOST {}", placement.host_node);
}

struct Outcome {
    config: String,
    errors: String,
    stderr_lines: Vec<String>,
}

fn run_child(settings: impl Into<OsString>) -> Outcome {
    let settings = settings.into();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            &common::child::test_path(module_path!(), "bad_environment_values"),
            "--exact",
            "--nocapture",
        ])
        .env(CHILD_VAR, "1")
        .env(ENV_VAR, &settings)
        .output()
        .expect("re-executing the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{settings:?}: child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("{settings:?}: no {name} line in\n{stdout}\n{stderr}"))
            .to_owned()
    };
    Outcome {
        config: field("CONFIG "),
        errors: field("ERRORS "),
        stderr_lines: stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_owned)
            .collect(),
    }
}

fn online_node_count() -> usize {
    NumaTopology::from_sysfs().map_or(1, |t| t.node_count())
}

/// One case: the setting, the keys of the parse errors expected (in order), runtime errors
/// expected after them, and a check of the resulting configuration.
struct Case {
    settings: &'static str,
    keys: &'static [&'static str],
    runtime: Vec<Error>,
    check: fn(&Config),
}

fn case(settings: &'static str, keys: &'static [&'static str], check: fn(&Config)) -> Case {
    Case {
        settings,
        keys,
        runtime: Vec::new(),
        check,
    }
}

fn key_of(e: &Error) -> &str {
    match e {
        Error::Config { key, .. } => key,
        other => panic!("not a config error: {other:?}"),
    }
}

fn defaults_kept(c: &Config) {
    assert_eq!(*c, Config::DEFAULT);
}

fn cases() -> Vec<Case> {
    let mut cases = vec![
        case("threshold=0", &["threshold"], defaults_kept),
        case("threshold=1TiB", &["threshold"], defaults_kept),
        case("threshold=4095", &["threshold"], defaults_kept),
        case("threshold=65GiB", &["threshold"], defaults_kept),
        case("threshold=-1", &["threshold"], defaults_kept),
        case("threshold=4PiB", &["threshold"], defaults_kept),
        case(
            "threshold=18446744073709551616",
            &["threshold"],
            defaults_kept,
        ),
        case("threshold=99999999999999GiB", &["threshold"], defaults_kept),
        case("threshold=", &["threshold"], defaults_kept),
        case("threshold=４MiB", &["threshold"], defaults_kept),
        case("threshold = 4 MiB", &[], |c| {
            assert_eq!(c.threshold, 4 * MIB)
        }),
        case("threshold=4KiB", &[], |c| assert_eq!(c.threshold, 4096)),
        // Control characters inside a value: rejected, not skipped over.
        case("threshold=4\nMiB", &["threshold"], defaults_kept),
        case("cache=1\tGiB", &["cache"], defaults_kept),
        case("node=1024", &["node"], defaults_kept),
        case("node=-1", &["node"], defaults_kept),
        case("node=zero", &["node"], defaults_kept),
        case("node=", &["node"], defaults_kept),
        case("gpu=pci:zz", &["gpu"], defaults_kept),
        case("gpu=pci:0000:81:00.0.0", &["gpu"], defaults_kept),
        case("gpu=pci:", &["gpu"], defaults_kept),
        case("gpu=GPU-1234", &["gpu"], defaults_kept),
        case("gpu=-3", &["gpu"], defaults_kept),
        case("gpu=", &["gpu"], defaults_kept),
        case("gpu=4294967296", &["gpu"], defaults_kept),
        case("policy=strict", &["policy"], defaults_kept),
        case("policy=", &["policy"], defaults_kept),
        case("cache=lots", &["cache"], defaults_kept),
        case("cache=99999999999TiB", &["cache"], defaults_kept),
        case("huge=2", &["huge"], defaults_kept),
        case("verify=maybe", &["verify"], defaults_kept),
        case("pin=sometimes", &["pin"], defaults_kept),
        case("devicemap=", &["devicemap"], defaults_kept),
        case("readonly=yess", &["readonly"], defaults_kept),
        case("threads=0", &["threads"], defaults_kept),
        case("threads=1025", &["threads"], defaults_kept),
        case("threads=-2", &["threads"], defaults_kept),
        case("colour=blue", &["colour"], defaults_kept),
        case("THRESHOLD=4MiB", &["THRESHOLD"], defaults_kept),
        case("=4MiB", &[""], defaults_kept),
        case("threshold", &["threshold"], defaults_kept),
        case("threshold==4MiB", &["threshold"], defaults_kept),
        case("", &[], defaults_kept),
        case(",,,,", &[], defaults_kept),
        case(" , ,, ", &[], defaults_kept),
        // Duplicates: reported, the last value applies.
        case("huge=off,huge=on", &["huge"], |c| assert!(c.huge_pages)),
        case(
            "threshold=8MiB,threshold=0",
            &["threshold", "threshold"],
            |c| {
                assert_eq!(
                    c.threshold,
                    8 * MIB,
                    "a rejected later value leaves the earlier one"
                )
            },
        ),
        // Conflicts: node= and gpu= both given: reported, the later one applies.
        case("gpu=3,node=0", &["node"], |c| {
            assert_eq!(c.target, Target::Node(0))
        }),
        // Bad entries among good ones: the good ones apply.
        case(
            "threshold=0,cache=1GiB,bogus,huge=off,policy=strict,verify=on,pin=off",
            &["threshold", "bogus", "policy"],
            |c| {
                assert_eq!(c.threshold, Config::DEFAULT.threshold);
                assert_eq!(c.cache_limit, 1 << 30);
                assert!(!c.huge_pages && c.verify);
                assert_eq!(c.policy, MemPolicy::Preferred);
                assert_eq!(c.pin, PinMode::Off);
            },
        ),
    ];
    // node=99 parses but names no online node: recorded at initialisation, and blocks go to
    // the calling thread's node instead.
    // reserve= parses, but its blocks would be below the threshold: recorded at initialisation,
    // nothing reserved.
    cases.push(Case {
        settings: "reserve=2x4KiB",
        keys: &[],
        runtime: vec![Error::ReserveRejected {
            blocks: 2,
            block_size: 4096,
            threshold: Config::DEFAULT.threshold,
        }],
        check: |c| assert_eq!(c.reserve.blocks, 2),
    });
    cases.push(Case {
        settings: "node=99",
        keys: &[],
        runtime: vec![Error::UnknownNode {
            node: 99,
            node_count: online_node_count(),
        }],
        check: |c| assert_eq!(c.target, Target::Node(99)),
    });
    cases
}

/// What starts every line the crate prints.
const PREFIX: &str = "numa-gpu-alloc: ";

#[test]
fn bad_environment_values() {
    if std::env::var_os(CHILD_VAR).is_some() {
        return child();
    }
    for case in cases() {
        let mut expected_config = Config::DEFAULT;
        let mut expected = expected_config.apply_settings(case.settings);
        let keys: Vec<&str> = expected.iter().map(key_of).collect();
        assert_eq!(keys, case.keys, "{:?}", case.settings);
        (case.check)(&expected_config);
        expected.extend(case.runtime);

        let got = run_child(case.settings);
        assert_eq!(
            got.config,
            format!("{expected_config:?}"),
            "{:?}",
            case.settings
        );
        assert_eq!(got.errors, format!("{expected:?}"), "{:?}", case.settings);
        // One clear line per error, the error's own text after the crate's prefix.
        let lines: Vec<String> = expected.iter().map(|e| format!("{PREFIX}{e}")).collect();
        assert_eq!(got.stderr_lines, lines, "{:?}", case.settings);
        for line in &got.stderr_lines {
            assert!(line.len() < 400, "{line}");
        }
    }
}

#[test]
fn odd_bytes_in_the_environment() {
    if std::env::var_os(CHILD_VAR).is_some() {
        return; // only `bad_environment_values` acts as the child
    }
    // Not UTF-8: replaced, reported as an unknown key, the rest applies.
    let got = run_child(OsString::from_vec(b"huge=off,\xff\xfe=1".to_vec()));
    assert!(got.config.contains("huge_pages: false"), "{}", got.config);
    assert_eq!(got.stderr_lines.len(), 1, "{:?}", got.stderr_lines);
    assert!(got.stderr_lines[0].contains('\u{fffd}'));
    // A very long value: still one line.
    let long = format!("threshold={}", "9".repeat(10_000));
    let got = run_child(long);
    assert_eq!(got.stderr_lines.len(), 1);
    // Control characters in values and keys are escaped: one line per error.
    let got = run_child("policy=bi\nnd,col\nour=1,ta\tb=2");
    assert_eq!(got.stderr_lines.len(), 3, "{:?}", got.stderr_lines);
    assert!(
        got.stderr_lines[1].contains(r"col\nour"),
        "{:?}",
        got.stderr_lines
    );
}

#[test]
fn builder_checked_path_gives_the_same_errors() {
    for case in cases() {
        for entry in case.settings.split(',').map(str::trim) {
            let Some((key, value)) = entry.split_once('=') else {
                continue;
            };
            let (key, value) = (key.trim(), value.trim());
            let mut via_apply = Config::DEFAULT;
            let applied = via_apply.apply(key, value);
            let mut via_settings = Config::DEFAULT;
            let errors = via_settings.apply_settings(entry);
            assert_eq!(via_apply, via_settings, "{entry:?}");
            match applied {
                Ok(()) => assert!(errors.is_empty(), "{entry:?}: {errors:?}"),
                Err(e) => {
                    assert_eq!(errors, std::slice::from_ref(&e), "{entry:?}");
                    assert_eq!(via_apply, Config::DEFAULT, "an error changes nothing");
                    let text = e.to_string();
                    assert!(text.starts_with("bad setting "), "{text}");
                    assert!(text.contains("expected "), "{text}");
                    assert!(!text.contains('\n'), "{text}");
                }
            }
        }
    }
    // The builder's own setters clamp instead of failing.
    let alloc = NumaGpuAlloc::new().threshold(0);
    assert_eq!(alloc.builder_config().threshold, 4096);
    let alloc = NumaGpuAlloc::new().threshold(usize::MAX);
    assert_eq!(alloc.builder_config().threshold, 64 << 30);
    // Every selector form that parses also applies through `apply`.
    let mut c = Config::DEFAULT;
    c.apply("gpu", "pci:00000000:81:00.0").unwrap();
    assert!(matches!(c.target, Target::Gpu(GpuSelector::Pci(_))));
    c.apply("gpu", "auto").unwrap();
    assert_eq!(c.target, Target::Gpu(GpuSelector::Auto));
}

#[test]
fn every_printed_line_has_the_prefix() {
    if std::env::var_os(CHILD_VAR).is_some() {
        return; // only `bad_environment_values` acts as the child
    }
    // Problems found at initialisation: a node, a PCI device and a CUDA device nobody has.
    for settings in [
        "node=1000",
        "gpu=pci:0000:ff:1f.7",
        "gpu=77",
        "pin=on,gpu=77",
    ] {
        let got = run_child(settings);
        assert!(!got.stderr_lines.is_empty(), "{settings}: nothing printed");
        for line in &got.stderr_lines {
            assert!(line.starts_with(PREFIX), "{settings}: {line}");
        }
    }
}

const ONCE_VAR: &str = "NUMA_GPU_ALLOC_TEST_ONCE_CHILD";
/// Bad entries (and a node no machine has) for every value of the process.
const ONCE_SETTINGS: &str = "threshold=-1,gpu=pci:zz,colour=blue,node=1000,huge=2";

/// Three values, two of them with a reservation the builder made too small: each value prints
/// its own problem, the environment's are printed once.
fn three_values() {
    static FIRST: NumaGpuAlloc = NumaGpuAlloc::new();
    let small = NumaGpuAlloc::new().reserve_at_init(1, 4096);
    let also_small = NumaGpuAlloc::new().reserve_at_init(1, 4096);
    for alloc in [&FIRST, &small, &also_small] {
        let _ = alloc.placement();
        println!("ERRORS {:?}", alloc.stats().config_errors);
    }
}

#[test]
fn each_bad_setting_is_printed_once_per_process() {
    if common::child::mode(ONCE_VAR).is_some() {
        return three_values();
    }
    let (stdout, stderr) = common::child::run(
        &common::child::test_path(
            module_path!(),
            "each_bad_setting_is_printed_once_per_process",
        ),
        ONCE_VAR,
        "1",
        &[(ENV_VAR, ONCE_SETTINGS)],
    );
    let mut env_errors = Config::default().apply_settings(ONCE_SETTINGS);
    env_errors.push(Error::UnknownNode {
        node: 1000,
        node_count: online_node_count(),
    });
    let rejected = Error::ReserveRejected {
        blocks: 1,
        block_size: 4096,
        threshold: Config::DEFAULT.threshold,
    };
    let count = |e: &Error| {
        let line = format!("{PREFIX}{e}");
        stderr.lines().filter(|l| *l == line).count()
    };
    for e in &env_errors {
        assert_eq!(count(e), 1, "{e}: once per process\n{stderr}");
    }
    assert_eq!(count(&rejected), 2, "once per value that has it\n{stderr}");
    assert_eq!(stderr.lines().count(), env_errors.len() + 2, "{stderr}");
    // Every value lists the environment's problems: they apply to it.
    // (The first one follows libtest's "test … " on its line.)
    let listed: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.find("ERRORS ").map(|at| &l[at..]))
        .collect();
    assert_eq!(listed.len(), 3, "{stdout}");
    for (value, line) in listed.iter().enumerate() {
        let mut expected = env_errors.clone();
        if value > 0 {
            expected.push(rejected.clone());
        }
        assert_eq!(*line, format!("ERRORS {expected:?}"), "value {value}");
    }
}
