//! `NUMA_GPU_ALLOC` is read once per process, at the first initialisation, and overrides the
//! builder. One test: the variable is process-wide.

use allocator_api2::vec::Vec;
use numa_gpu_alloc::{Error, MemPolicy, NumaGpuAlloc, Target, ENV_VAR};

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
                       readonly, threads, stats, reserve",
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
