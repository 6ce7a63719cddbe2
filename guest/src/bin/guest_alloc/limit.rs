//! `--mode limit`: inside a cgroup with a `memory.max`, idle memory is given back when a block
//! fits only then, blocks beyond the limit fail cleanly, and the OOM killer never runs.

use super::*;

/// Sizes of the memory-limit checks: each fits under the limit alone, the first two together do
/// not, and the last never does.
const LIMIT_FIRST: usize = 96 * MIB;
const LIMIT_SECOND: usize = 120 * MIB;
const LIMIT_TOO_BIG: usize = 256 * MIB;

/// A `Vec` of `len` bytes equal to `byte`, or `None` when the allocator says no (a `vec!` would
/// abort instead).
fn filled(len: usize, byte: u8) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).ok()?;
    v.resize(len, byte);
    Some(v)
}

/// This process's cgroup directory (cgroup v2, mounted at /sys/fs/cgroup by `guest/init`).
fn own_cgroup() -> String {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or("/");
    format!("/sys/fs/cgroup{}", path.trim())
}

/// A `key value` line of a cgroup file such as `memory.events`.
fn cgroup_value(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("{}/{file}", own_cgroup())).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// (retries, blocks given back, failed allocations, refused for the memory limit, bind exhausted)
fn pressure(s: &Stats) -> (u64, u64, u64, u64, u64) {
    let f = &s.fallbacks;
    (
        s.pressure_retries,
        s.pressure_released_blocks,
        f.failed_allocations,
        f.memory_limited,
        f.bind_exhausted,
    )
}

pub(super) fn run_limit(r: &mut Report, memory_max: Option<usize>) {
    let path = format!("{}/memory.max", own_cgroup());
    let max = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| t.trim().parse().ok());
    r.eq("cgroup.memory_max", memory_max, max);
    let node = ALLOC.placement().host_node;

    // --- The global allocator: a freed 96 MiB block stays cached (a wholly free chunk, or a
    // dedicated block); 120 MiB fit only once it is given back, which the arena does before it
    // maps the new block (holding both would pass the most ever in use by more than an eighth),
    // so the memory limit is never reached and no retry is needed. ---------------------------
    drop(filled(LIMIT_FIRST, 1));
    r.eq("global.cached", LIMIT_FIRST, ALLOC.stats().cached_bytes());
    match filled(LIMIT_SECOND, 2) {
        Some(second) => {
            r.on_node(
                "global.given_back.pages",
                second.as_ptr(),
                second.len(),
                node,
            );
            r.eq(
                "global.given_back.data",
                true,
                second.iter().all(|&b| b == 2),
            );
        }
        None => r.check(
            "global.given_back",
            false,
            || format!("{LIMIT_SECOND} bytes after giving back the cache"),
            "AllocError".into(),
        ),
    }
    let s = ALLOC.stats();
    r.eq("global.given_back.counters", (0, 0, 0, 0, 0), pressure(&s));
    ALLOC.trim();

    // --- policy=bind, same steps; then a block beyond the limit fails cleanly, and at once:
    // what is idle (the second block's 120 MiB) could not make room for it. ------------------
    let bind = NumaGpuAlloc::new().node(node).policy(MemPolicy::Bind);
    let mut first: AVec<u8, _> = AVec::new_in(&bind);
    let first_ok = first.try_reserve_exact(LIMIT_FIRST).is_ok();
    drop(first);
    let mut second: AVec<u8, _> = AVec::new_in(&bind);
    let second_ok = second.try_reserve_exact(LIMIT_SECOND).is_ok();
    if second_ok {
        second.resize(LIMIT_SECOND, 3);
    }
    r.eq("bind.given_back", (true, true), (first_ok, second_ok));
    r.on_node("bind.given_back.pages", second.as_ptr(), second.len(), node);
    drop(second);
    let mut too_big: AVec<u8, _> = AVec::new_in(&bind);
    r.eq(
        "bind.too_big.fails",
        true,
        too_big.try_reserve_exact(LIMIT_TOO_BIG).is_err(),
    );
    // No retry for the second block (the first was given back before it was mapped); the
    // too-big one refused for the memory limit, at once.
    r.eq("bind.counters", (0, 0, 1, 1, 0), pressure(&bind.stats()));
    eprintln!("{}", bind.stats());

    // --- The default policy beyond the limit, with nothing idle to give back: the same clean
    // failure, at once. ------------------------------------------------------------------------
    bind.trim();
    let preferred = NumaGpuAlloc::new().node(node);
    let mut too_big: AVec<u8, _> = AVec::new_in(&preferred);
    r.eq(
        "preferred.too_big.fails",
        true,
        too_big.try_reserve_exact(LIMIT_TOO_BIG).is_err(),
    );
    r.eq(
        "preferred.counters",
        (0, 0, 1, 1, 0),
        pressure(&preferred.stats()),
    );
    eprintln!("{}", preferred.stats());

    // --- The kernel never had to kill anything. --------------------------------------------
    r.eq(
        "no_oom_kill",
        (Some(0), Some(0)),
        (
            cgroup_value("memory.events", "oom"),
            cgroup_value("memory.events", "oom_kill"),
        ),
    );
}
