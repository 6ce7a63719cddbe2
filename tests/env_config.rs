//! `NUMA_GPU_ALLOC` is read once per process, at the first initialisation, and overrides the
//! builder. One test in this process (the variable is process-wide); the others run in child
//! processes.

use allocator_api2::alloc::Allocator;
use allocator_api2::vec::Vec;
use numa_gpu_alloc::{Error, MemPolicy, NumaGpuAlloc, Target, ENV_VAR};

#[macro_use]
mod common {
    pub mod child;
    #[macro_use]
    pub mod require;
}

#[test]
fn environment_overrides_builder_and_reports_bad_entries() {
    std::env::set_var(
        ENV_VAR,
        "threshold=4MiB,node=0,policy=bind,cache=8GiB,huge=off,verify=on,reserve=2x5MiB,colour=blue",
    );
    let alloc = NumaGpuAlloc::new()
        .threshold(3 << 20)
        .policy(MemPolicy::Interleave);
    assert_eq!(
        alloc.stats().threshold,
        3 << 20,
        "not read before initialisation"
    );

    let v: Vec<u8, _> = Vec::with_capacity_in(5 << 20, &alloc);
    let config = alloc.config();
    assert_eq!(config.threshold, 4 << 20);
    assert_eq!(config.target, Target::Node(0));
    assert_eq!(config.policy, MemPolicy::Bind);
    assert_eq!(config.cache_limit, 8 << 30);
    assert!(!config.huge_pages && config.verify);

    let stats = alloc.stats();
    assert_eq!(
        stats.large_allocations, 1,
        "5 MiB is above the new 4 MiB threshold"
    );
    assert!(stats.pages_checked > 0, "verify=on applied");
    assert_eq!(
        (stats.cache_hits, stats.cache_misses, stats.cached_bytes()),
        (1, 0, 5 << 20),
        "reserve=2x5MiB: two blocks made at initialisation, one taken by the request"
    );
    assert_eq!(
        stats.config_errors,
        [Error::Config {
            key: "colour".into(),
            value: "blue".into(),
            expected: "one of threshold, node, gpu, policy, cache, huge, verify, pin, devicemap, \
                       readonly, pin_limit, register_max, threads, populate, bulk_max, stats, \
                       reserve, reserve_background, decay, decay_thread",
        }]
    );

    // Read once per process: later changes apply neither to an initialised allocator nor to
    // one initialised afterwards (each bad entry is printed once: see `env_bad_input.rs`).
    std::env::set_var(ENV_VAR, "threshold=16MiB");
    drop(v);
    assert_eq!(alloc.config().threshold, 4 << 20);
    let later = NumaGpuAlloc::new();
    let _ = later.placement();
    assert_eq!(
        later.config().threshold,
        4 << 20,
        "the first reading applies"
    );
    assert_eq!(later.stats().config_errors, stats.config_errors);
    std::env::remove_var(ENV_VAR);
}

const CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_ENV_CONFIG_CHILD";

/// `pin=strict` with no driver: two values (a static, as the global allocator is, and a local
/// one), each asked for 256 MiB and 4 MiB. Every request fails before anything is mapped or
/// populated, each value's stats say why, and stderr says it once.
fn strict_without_a_driver() {
    static FIRST: NumaGpuAlloc = NumaGpuAlloc::new();
    let second = NumaGpuAlloc::new();
    for alloc in [&FIRST, &second] {
        for size in [256 << 20, 4 << 20] {
            let start = std::time::Instant::now();
            let got = alloc.allocate(std::alloc::Layout::from_size_align(size, 64).unwrap());
            println!("REFUSED {size} bytes in {:?}", start.elapsed());
            assert!(got.is_err(), "pin=strict handed out a block without a GPU");
        }
        let stats = alloc.stats();
        assert_eq!(stats.fallbacks.failed_allocations, 2, "{stats}");
        assert_eq!(stats.fallbacks.strict_refused, 2, "{stats}");
        assert_eq!(
            (stats.cache_misses, stats.released_blocks),
            (0, 0),
            "nothing mapped: {stats}"
        );
        assert_eq!(
            stats.populate_time.total,
            std::time::Duration::ZERO,
            "{stats}"
        );
        let why = stats.last_pin_error.as_ref().map(ToString::to_string);
        assert!(
            why.as_ref().is_some_and(|w| w.contains("pin=strict")),
            "{stats}"
        );
        assert!(
            stats
                .config_errors
                .iter()
                .any(|e| e.to_string().contains("pin=strict")),
            "{stats}"
        );
    }
}

#[test]
fn pin_strict_without_a_driver_fails_at_once_and_says_why_once() {
    if common::child::mode(CHILD_VAR).is_some() {
        return strict_without_a_driver();
    }
    require!(
        !numa_gpu_alloc::cuda_driver_present(),
        "a CUDA driver is present, so pin=strict can pin"
    );
    let (stdout, stderr) = common::child::run(
        "pin_strict_without_a_driver_fails_at_once_and_says_why_once",
        CHILD_VAR,
        "strict",
        &[(ENV_VAR, "pin=strict")],
    );
    println!("{stdout}{stderr}");
    let lines: std::vec::Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("pin=strict"))
        .collect();
    assert_eq!(lines.len(), 1, "said once per process:\n{stderr}");
    assert!(
        lines[0].starts_with(
            "numa-gpu-alloc: pin=strict, but blocks cannot be page-locked: no usable CUDA \
             driver: CUDA unavailable: "
        ),
        "{stderr}"
    );
}

/// `pin=strict,pin_limit=0,cache=0`: no block can ever be page-locked, with a driver or without.
/// Every large request fails before anything is mapped; set-up says why in one line, and that
/// `cache=0` keeps nothing in another.
fn strict_without_room() {
    let alloc = NumaGpuAlloc::new();
    let got = alloc.allocate(std::alloc::Layout::from_size_align(4 << 20, 64).unwrap());
    assert!(got.is_err(), "pin=strict handed out a block it may not pin");
    let stats = alloc.stats();
    assert_eq!(stats.fallbacks.strict_refused, 1, "{stats}");
    assert_eq!(stats.cache_misses, 0, "nothing mapped: {stats}");
    assert_eq!(stats.config_errors.len(), 2, "{stats}");
}

#[test]
fn pin_strict_with_a_zero_pinned_limit_says_so_at_set_up() {
    if common::child::mode(CHILD_VAR).is_some() {
        return strict_without_room();
    }
    let (stdout, stderr) = common::child::run(
        "pin_strict_with_a_zero_pinned_limit_says_so_at_set_up",
        CHILD_VAR,
        "no-room",
        &[(ENV_VAR, "pin=strict,pin_limit=0,cache=0")],
    );
    println!("{stdout}{stderr}");
    let ours: std::vec::Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("numa-gpu-alloc: "))
        .collect();
    assert_eq!(
        ours,
        [
            "numa-gpu-alloc: setting cache=\"0\" accepted: nothing freed is kept for reuse: each \
             large free gives its memory back at once, and each large allocation maps, places \
             and populates anew (cache=SIZE keeps up to SIZE)",
            "numa-gpu-alloc: pin=strict, but blocks cannot be page-locked: pin_limit=0 allows no \
             page-locked byte; large requests fail before anything is mapped (pin=on would hand \
             out unpinned blocks)",
        ],
        "{stderr}"
    );
}
