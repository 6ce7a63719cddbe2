//! Reading the stats the checks compare: a node's row, its chunks, event counter deltas, and a
//! byte pattern that tells offsets apart.

use super::*;

/// Live bytes, live blocks and cached bytes of `node`, as the stats report them.
pub(super) fn node_row(stats: &Stats, node: usize) -> (usize, usize, usize) {
    stats
        .nodes
        .iter()
        .find(|n| n.node == node)
        .map_or((0, 0, 0), |n| (n.live_bytes, n.live_blocks, n.cached_bytes))
}

/// `node`'s row of the stats (all zero when it has none).
pub(super) fn node_stats(stats: &Stats, node: usize) -> NodeStats {
    stats
        .nodes
        .iter()
        .find(|n| n.node == node)
        .cloned()
        .unwrap_or_default()
}

/// Chunks and their mapped bytes on `node`.
pub(super) fn chunks(stats: &Stats, node: usize) -> (usize, usize) {
    let n = node_stats(stats, node);
    (n.chunks, n.mapped_bytes)
}

/// The stats once no free range is out of its carver for purging: the decay thread takes an
/// idle range out, purges it outside the lock and gives it back, and meanwhile the node's cached
/// bytes lack it. While only carved blocks exist (as in `run` before its last block), a node's
/// live and cached bytes then add up to its mapped bytes; after a few tries the stats are taken
/// as they are (the checks then show the difference).
pub(super) fn quiet_stats() -> Stats {
    let mut stats = ALLOC.stats();
    for _ in 0..20 {
        if stats
            .nodes
            .iter()
            .all(|n| n.live_bytes + n.cached_bytes == n.mapped_bytes)
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        stats = ALLOC.stats();
    }
    stats
}

/// Live bytes of every node but `node` (all zero when the blocks stay apart).
pub(super) fn others_live(stats: &Stats, node: usize) -> Vec<(usize, usize)> {
    stats
        .nodes
        .iter()
        .filter(|n| n.node != node && n.live_bytes != 0)
        .map(|n| (n.node, n.live_bytes))
        .collect()
}

/// Event counters, as deltas are compared: (large allocations, cache hits, cache misses, frees).
pub(super) fn counters(stats: &Stats) -> [u64; 4] {
    [
        stats.large_allocations,
        stats.cache_hits,
        stats.cache_misses,
        stats.frees,
    ]
}

pub(super) fn delta(before: [u64; 4], after: [u64; 4]) -> [u64; 4] {
    std::array::from_fn(|i| after[i].wrapping_sub(before[i]))
}

/// A byte pattern that tells offsets apart (period 251, prime).
pub(super) fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

pub(super) fn is_pattern(data: &[u8]) -> bool {
    data.iter().enumerate().all(|(i, &b)| b == pattern(i))
}

/// The CPUs (`Cpus_allowed_list`) of each of this process's populate workers for `node`.
pub(super) fn populate_workers(node: usize) -> Vec<String> {
    let name = format!("numa-populate-{node}");
    let tasks = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten();
    tasks
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm")).is_ok_and(|c| c.trim() == name)
        })
        .filter_map(|task| {
            let status = std::fs::read_to_string(task.path().join("status")).ok()?;
            let cpus = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
            Some(cpus.trim().to_owned())
        })
        .collect()
}
