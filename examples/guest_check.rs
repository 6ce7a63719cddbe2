//! Checks the crate against a real multi-node Linux kernel, from inside a QEMU guest.
//!
//! `scripts/numa-guests.sh` boots one guest per topology in `guest/topologies/` and runs this
//! program from the guest's `/init` (`guest/init`), after saving `numactl --hardware`'s output
//! to a file. It prints one line per check, `PASS <name>` or `FAIL <name>: expected X, got Y`,
//! then `guest <topology>: N passed, M failed`, and exits with status 1 if any check failed.
//!
//! ```text
//! guest_check --topology NAME --numactl FILE --device DDDD:BB:DD.F
//!             --expect-home NODE --expect-host NODE [--unknown-device DDDD:BB:DD.F]
//!             [--alloc-report FILE] [--limit-report FILE] [--routes-report FILE]
//!             [--cpuset-report NAME=FILE]... [--sysfs /sys]
//! ```
//!
//! * `--numactl`: the saved `numactl --hardware` output, the reference for node ids, CPUs,
//!   memory sizes and distances;
//! * `--device`: the PCI address of the device the host placed behind a `pxb-pcie` bus;
//! * `--expect-home`: the node that device's `numa_node` must report;
//! * `--expect-host`: the node the crate must choose for host buffers (nearest node with memory);
//! * `--unknown-device`: a device whose `numa_node` is -1 (on a bus without a proximity
//!   domain), for which the crate must report no node;
//! * `--alloc-report`: what `examples/guest_alloc.rs` (the allocator as `#[global_allocator]`,
//!   run by `guest/init` with `NUMA_GPU_ALLOC=gpu=pci:<device>`) printed, followed by the line
//!   `exit rc=N`; its `PASS`/`FAIL` lines join this table;
//! * `--limit-report`: the same for `guest_alloc --mode limit`, run by `guest/init` inside a
//!   cgroup with a `memory.max` (topologies that set `MEMORY_MAX`);
//! * `--routes-report`: the same for `examples/guest_routes.rs` (threads bound to devices on
//!   different nodes; topologies that set `ROUTES`);
//! * `--cpuset-report NAME=FILE` (once per allocator): the same for `examples/guest_mixed.rs`
//!   with allocator `NAME`, run by `guest/init` inside a cgroup whose cpuset confines it to one
//!   node (topologies that set `CPUSET_NODE`), followed by the cgroup's `memory.events` line:
//!   lines `cpuset.NAME.*`, and `cpuset.NAME.no_oom_kill`.
//!
//! The allocator checks make their own `NumaGpuAlloc` values (`.node(N)`, `.policy(..)`) and use
//! them through allocator-api2: one per node with memory, an interleaved block, two handles on
//! two nodes, and `policy=bind` on a node too small for the request (a clean `AllocError`) next
//! to `preferred` with `verify` (success, misplaced pages counted). `NUMA_GPU_ALLOC` would
//! override their settings, so this program removes it from its own environment first.
//!
//! It also runs on an ordinary machine (any NUMA layout, even one node) with
//! `--expect-home`/`--expect-host none`, which skips the PCI expectations.
//!
//! Checks come from the [`GROUPS`] table; adding a kind of check is adding a function there.
//! Nothing here panics on what the guest reports: every surprise becomes a `FAIL` line.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::ptr::NonNull;

use allocator_api2::alloc::Allocator;
use allocator_api2::vec::Vec as AVec;
use numa_gpu_alloc::pci::{self, PciAddress};
use numa_gpu_alloc::sys::{self, MbindFlags, MemPolicy, NodeMask};
use numa_gpu_alloc::{NumaGpuAlloc, NumaTopology, Stats};

const MIB: usize = 1 << 20;
/// Bytes mapped, bound and populated per node by the placement checks.
const PLACEMENT_BYTES: usize = 16 * MIB;
/// Bytes of the block each per-node allocator hands out.
const NODE_BYTES: usize = 8 * MIB;
/// Bytes of the interleaved block.
const INTERLEAVE_BYTES: usize = 64 * MIB;
/// How far the `policy=bind` request exceeds the node's free memory.
const BIND_EXCESS: usize = 48 * MIB;
/// Free memory the other nodes must keep beyond what spills onto them.
const BIND_MARGIN: usize = 64 * MIB;

/// The result of one check.
enum Outcome {
    Pass,
    Fail { expected: String, got: String },
}

/// One line of the report.
struct Check {
    name: String,
    outcome: Outcome,
}

impl Check {
    fn pass(name: impl Into<String>) -> Self {
        Check {
            name: name.into(),
            outcome: Outcome::Pass,
        }
    }

    fn fail(name: impl Into<String>, expected: impl Into<String>, got: impl Into<String>) -> Self {
        Check {
            name: name.into(),
            outcome: Outcome::Fail {
                expected: expected.into(),
                got: got.into(),
            },
        }
    }

    /// Passes when `expected == got`; both are shown with `{:?}` otherwise.
    fn eq<T: PartialEq + Debug>(name: impl Into<String>, expected: T, got: T) -> Self {
        if expected == got {
            Check::pass(name)
        } else {
            Check::fail(name, format!("{expected:?}"), format!("{got:?}"))
        }
    }
}

/// Command-line arguments (see the module docs).
struct Args {
    topology: String,
    numactl: PathBuf,
    device: String,
    expect_home: Option<usize>,
    expect_host: Option<usize>,
    unknown_device: Option<String>,
    alloc_report: Option<PathBuf>,
    limit_report: Option<PathBuf>,
    routes_report: Option<PathBuf>,
    /// `(allocator, report)` of each `guest_mixed` run.
    cpuset_reports: Vec<(String, PathBuf)>,
    sysfs: PathBuf,
}

/// The layout as `numactl --hardware` printed it.
#[derive(Default)]
struct Numactl {
    /// Node ids in the order printed.
    nodes: Vec<usize>,
    cpus: BTreeMap<usize, Vec<usize>>,
    size_mb: BTreeMap<usize, u64>,
    /// Row per node: distances to the nodes of `columns`, in that order.
    distances: BTreeMap<usize, Vec<u8>>,
    columns: Vec<usize>,
}

impl Numactl {
    fn parse(text: &str) -> Result<Self, String> {
        let mut out = Numactl::default();
        let mut in_distances = false;
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["node", "distances:"] => in_distances = true,
                ["node", id, "cpus:", cpus @ ..] if !in_distances => {
                    let id = num(id)?;
                    out.nodes.push(id);
                    out.cpus
                        .insert(id, cpus.iter().map(|c| num(c)).collect::<Result<_, _>>()?);
                }
                ["node", id, "size:", mb, "MB"] if !in_distances => {
                    out.size_mb.insert(num(id)?, num(mb)? as u64);
                }
                ["node", columns @ ..] if in_distances => {
                    out.columns = columns.iter().map(|c| num(c)).collect::<Result<_, _>>()?;
                }
                [row, values @ ..] if in_distances && row.ends_with(':') => {
                    let row = num(row.trim_end_matches(':'))?;
                    let values = values
                        .iter()
                        .map(|v| v.parse::<u8>().map_err(|_| format!("distance {v:?}")))
                        .collect::<Result<_, _>>()?;
                    out.distances.insert(row, values);
                }
                _ => {}
            }
        }
        if out.nodes.is_empty() {
            return Err("no `node N cpus:` lines".into());
        }
        Ok(out)
    }

    /// The distance row of `node` over `self.nodes`, `None` where numactl printed nothing.
    fn row(&self, node: usize) -> Vec<Option<u8>> {
        let row = self.distances.get(&node);
        self.nodes
            .iter()
            .map(|to| {
                let col = self.columns.iter().position(|c| c == to)?;
                row?.get(col).copied()
            })
            .collect()
    }
}

fn num(s: &str) -> Result<usize, String> {
    s.parse()
        .map_err(|_| format!("number expected, found {s:?}"))
}

/// Everything the checks look at, gathered once.
struct Ctx {
    args: Args,
    numactl: Result<Numactl, String>,
    topology: Result<NumaTopology, String>,
}

/// A group of checks: returns one [`Check`] per line it wants printed.
type Group = fn(&Ctx) -> Vec<Check>;

/// The checks, in the order they run.
const GROUPS: &[Group] = &[
    inputs,
    topology_nodes,
    topology_distances,
    pci_home,
    host_node,
    placement,
    global_allocator,
    memory_limit,
    routes,
    cpuset,
    node_allocators,
    interleave,
    two_handles,
    bind_exhausted,
];

/// The inputs are usable: numactl's output parsed and the crate read the topology.
fn inputs(cx: &Ctx) -> Vec<Check> {
    let numactl = match &cx.numactl {
        Ok(_) => Check::pass("numactl.parse"),
        Err(e) => Check::fail("numactl.parse", "numactl --hardware output", e.clone()),
    };
    let topo = match &cx.topology {
        Ok(_) => Check::pass("topology.from_sysfs"),
        Err(e) => Check::fail("topology.from_sysfs", "Ok", e.clone()),
    };
    vec![numactl, topo]
}

/// Node ids, CPUs, memory sizes and flags agree with numactl.
fn topology_nodes(cx: &Ctx) -> Vec<Check> {
    let (Ok(n), Ok(t)) = (&cx.numactl, &cx.topology) else {
        return vec![Check::fail(
            "topology.nodes",
            "numactl and topology",
            "unavailable",
        )];
    };
    let mut out = vec![Check::eq(
        "topology.node_ids",
        n.nodes.as_slice(),
        t.node_ids(),
    )];
    for &id in &n.nodes {
        let Some(info) = t.nodes().iter().find(|i| i.id == id) else {
            out.push(Check::fail(format!("node{id}"), "a node", "missing"));
            continue;
        };
        let cpus = n.cpus.get(&id).cloned().unwrap_or_default();
        out.push(Check::eq(
            format!("node{id}.cpus"),
            cpus.as_slice(),
            &info.cpus[..],
        ));
        out.push(Check::eq(
            format!("node{id}.has_cpu"),
            !cpus.is_empty(),
            info.has_cpu,
        ));
        let mb = n.size_mb.get(&id).copied();
        // numactl prints the node's MemTotal in whole MiB, rounded down.
        let got_mb = info.memory_bytes >> 20;
        let name = format!("node{id}.memory_mb");
        out.push(match mb {
            Some(mb) if mb.abs_diff(got_mb) <= 1 => Check::pass(name),
            Some(mb) => Check::fail(name, format!("{mb} (±1)"), got_mb.to_string()),
            None => Check::fail(name, "a size line from numactl", "none"),
        });
        let has_memory = mb.is_some_and(|mb| mb > 0);
        out.push(Check::eq(
            format!("node{id}.has_memory"),
            has_memory,
            info.has_memory,
        ));
    }
    out
}

/// The distance matrix agrees with numactl, row by row.
fn topology_distances(cx: &Ctx) -> Vec<Check> {
    let (Ok(n), Ok(t)) = (&cx.numactl, &cx.topology) else {
        return vec![Check::fail(
            "distance",
            "numactl and topology",
            "unavailable",
        )];
    };
    n.nodes
        .iter()
        .map(|&from| {
            let got: Vec<Option<u8>> = n.nodes.iter().map(|&to| t.distance(from, to)).collect();
            Check::eq(format!("distance.row{from}"), n.row(from), got)
        })
        .collect()
}

/// The device's address parses and round-trips, and its home node is the expected one.
fn pci_home(cx: &Ctx) -> Vec<Check> {
    let addr: PciAddress = match cx.args.device.parse() {
        Ok(a) => a,
        Err(e) => return vec![Check::fail("pci.parse", "a PCI address", e.to_string())],
    };
    let mut out = vec![Check::eq(
        "pci.parse",
        cx.args.device.clone(),
        addr.to_string(),
    )];
    if let Some(home) = cx.args.expect_home {
        let got = pci::home_node(&cx.args.sysfs, &addr).map_err(|e| e.to_string());
        out.push(Check::eq(
            format!("pci.home_node({addr}) = {home}"),
            Ok(Some(home)),
            got,
        ));
    }
    // A device on a bus without a proximity domain reads `numa_node` -1: no node, no guess.
    if let Some(other) = &cx.args.unknown_device {
        let name = format!("pci.home_node({other}) = none");
        out.push(match other.parse::<PciAddress>() {
            Ok(a) => {
                let got = pci::home_node(&cx.args.sysfs, &a).map_err(|e| e.to_string());
                Check::eq(name, Ok(None), got)
            }
            Err(e) => Check::fail(name, "a PCI address", e.to_string()),
        });
    }
    out
}

/// `host_node_for(home)` picks the expected node.
fn host_node(cx: &Ctx) -> Vec<Check> {
    let (Some(home), Some(host)) = (cx.args.expect_home, cx.args.expect_host) else {
        return Vec::new();
    };
    let name = format!("topology.host_node_for({home}) = {host}");
    match &cx.topology {
        Ok(t) => vec![Check::eq(
            name,
            Ok(host),
            t.host_node_for(home).map_err(|e| e.to_string()),
        )],
        Err(_) => vec![Check::fail(name, host.to_string(), "no topology")],
    }
}

/// For each node with memory: map, bind, populate and count where the pages went. A node
/// without memory must refuse the binding with an error.
fn placement(cx: &Ctx) -> Vec<Check> {
    let Ok(n) = &cx.numactl else {
        return vec![Check::fail("place", "numactl output", "unavailable")];
    };
    n.nodes
        .iter()
        .map(|&node| {
            if n.size_mb.get(&node).is_some_and(|&mb| mb > 0) {
                let name = format!("place.node{node}");
                let pages = PLACEMENT_BYTES / sys::page_size();
                match place_on(node) {
                    Ok(c) if c.on_node == pages => Check::pass(name),
                    Ok(c) => Check::fail(
                        name,
                        format!("{pages} pages on node {node}"),
                        format!(
                            "{} there, {} elsewhere, {} absent",
                            c.on_node, c.elsewhere, c.absent
                        ),
                    ),
                    Err(e) => Check::fail(name, format!("{pages} pages on node {node}"), e),
                }
            } else {
                let name = format!("place.node{node}.refused");
                match place_on(node) {
                    Err(e) if e.starts_with("bind:") => Check::pass(name),
                    Err(e) => Check::fail(name, "bind: <error>", e),
                    Ok(c) => Check::fail(name, "bind: <error>", format!("{c:?}")),
                }
            }
        })
        .collect()
}

/// Maps [`PLACEMENT_BYTES`], binds it to `node`, populates it, counts its pages, unmaps it.
fn place_on(node: usize) -> Result<sys::PageCensus, String> {
    let len = PLACEMENT_BYTES;
    let ptr: NonNull<u8> =
        sys::map_anonymous(len, sys::page_size()).map_err(|e| format!("map: {e}"))?;
    let mask = NodeMask::single(node).map_err(|e| format!("mask: {e}"));
    let result = mask.and_then(|mask| {
        // SAFETY: `ptr..ptr+len` is the fresh mapping made above, used by nothing else.
        unsafe { sys::bind(ptr, len, MemPolicy::Bind, &mask, MbindFlags::default()) }
            .map_err(|e| format!("bind: {e}"))?;
        // SAFETY: as above; the mapping is writable and still all zeros.
        unsafe { sys::populate(ptr, len) }.map_err(|e| format!("populate: {e}"))?;
        // SAFETY: as above.
        unsafe { sys::census(ptr, len, node) }.map_err(|e| format!("census: {e}"))
    });
    // SAFETY: the mapping came from map_anonymous and nothing refers to it any more.
    let unmapped = unsafe { sys::unmap(ptr, len) };
    match (result, unmapped) {
        (Ok(c), Ok(())) => Ok(c),
        (Ok(_), Err(e)) => Err(format!("unmap: {e}")),
        (Err(e), _) => Err(e),
    }
}

/// The allocator as `#[global_allocator]`: the lines `guest_alloc` printed, and its exit status
/// (`exit rc=N`, appended by `guest/init`). Nothing when `--alloc-report` was not given.
fn global_allocator(cx: &Ctx) -> Vec<Check> {
    cx.args
        .alloc_report
        .as_deref()
        .map_or_else(Vec::new, |path| report(path, "global"))
}

/// The same under a cgroup memory limit (`guest_alloc --mode limit`, `--limit-report`).
fn memory_limit(cx: &Ctx) -> Vec<Check> {
    cx.args
        .limit_report
        .as_deref()
        .map_or_else(Vec::new, |path| report(path, "limit"))
}

/// Threads routed to several devices (`guest_routes`, `--routes-report`).
fn routes(cx: &Ctx) -> Vec<Check> {
    cx.args
        .routes_report
        .as_deref()
        .map_or_else(Vec::new, |path| report(path, "routes"))
}

/// A client program confined to one node by a cgroup's cpuset (`guest_mixed`,
/// `--cpuset-report`): its lines, and that the kernel's OOM killer never ran in its cgroup
/// (`memory.events`, appended by `guest/init`).
fn cpuset(cx: &Ctx) -> Vec<Check> {
    let mut out = Vec::new();
    for (name, path) in &cx.args.cpuset_reports {
        let prefix = format!("cpuset.{name}");
        out.extend(report(path, &prefix));
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let events = text.lines().find_map(|l| l.strip_prefix("memory.events:"));
        let value = |key: &str| -> Option<u64> {
            let mut words = events?.split_whitespace();
            words.find(|&w| w == key)?;
            words.next()?.parse().ok()
        };
        out.push(Check::eq(
            format!("{prefix}.no_oom_kill"),
            (Some(0), Some(0)),
            (value("oom"), value("oom_kill")),
        ));
    }
    out
}

/// The checks of one `guest_alloc` run: its lines, whether it printed its `<prefix>: ` summary,
/// and its exit status.
fn report(path: &Path, prefix: &str) -> Vec<Check> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            let got = format!("{}: {e}", path.display());
            return vec![Check::fail(prefix, "guest_alloc's report", got)];
        }
    };
    let (mut out, mut summary, mut rc) = (Vec::new(), false, None);
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("PASS ") {
            out.push(Check::pass(name));
        } else if let Some(rest) = line.strip_prefix("FAIL ") {
            // `name: expected X, got Y`, printed again as it came.
            let (name, detail) = rest.split_once(": ").unwrap_or((rest, ""));
            let detail = detail.strip_prefix("expected ").unwrap_or(detail);
            let (expected, got) = detail.split_once(", got ").unwrap_or((detail, "?"));
            out.push(Check::fail(name, expected, got));
        } else if line
            .strip_prefix(prefix)
            .is_some_and(|l| l.starts_with(": "))
        {
            summary = true;
        } else if let Some(code) = line.strip_prefix("exit rc=") {
            rc = Some(code.trim().to_owned());
        }
    }
    out.push(Check::eq(format!("{prefix}.completed"), true, summary));
    out.push(Check::eq(
        format!("{prefix}.exit"),
        Some("0".to_owned()),
        rc,
    ));
    out
}

/// The nodes numactl reports memory for.
fn memory_nodes(n: &Numactl) -> Vec<usize> {
    n.nodes
        .iter()
        .copied()
        .filter(|id| n.size_mb.get(id).is_some_and(|&mb| mb > 0))
        .collect()
}

/// Where the allocator checks put their blocks: the expected host node, else the first node
/// with memory.
fn target_node(cx: &Ctx, n: &Numactl) -> Option<usize> {
    cx.args
        .expect_host
        .or_else(|| memory_nodes(n).first().copied())
}

/// numactl's output and [`target_node`], or the `FAIL` line of check `name` when either is
/// missing.
fn numactl_and_target<'a>(cx: &'a Ctx, name: &str) -> Result<(&'a Numactl, usize), Check> {
    cx.numactl
        .as_ref()
        .ok()
        .and_then(|n| Some((n, target_node(cx, n)?)))
        .ok_or_else(|| Check::fail(name, "numactl output", "unavailable"))
}

/// Requests of at least this size get a mapping of their own (as `DEDICATED_MIN` in
/// src/arena/mod.rs); smaller ones are carved from the node's chunks.
const DEDICATED_MIN: usize = 64 * MIB;
/// Chunks are whole multiples of this (as `CHUNK_ALIGN` in src/arena/mod.rs).
const CHUNK_ALIGN: usize = 2 * MIB;
/// A node's first chunk (as `CHUNK_FIRST` in src/arena/mod.rs).
const CHUNK_FIRST: usize = 32 * MIB;

/// The crate's capacity for a request of `size` bytes: carved, the request in whole pages;
/// dedicated, 8 size classes per power of two, whole pages (as `class_size` in
/// src/arena/mod.rs).
fn capacity(size: usize) -> usize {
    let size = size.max(1);
    if size < DEDICATED_MIN {
        return size.next_multiple_of(sys::page_size());
    }
    let octave = usize::BITS - 1 - size.leading_zeros();
    let step = (1usize << octave.saturating_sub(3)).max(sys::page_size());
    size.next_multiple_of(step)
}

/// A vector of `bytes` bytes from `alloc`, filled with `byte`; `Err` when the allocator refused.
fn filled(alloc: &NumaGpuAlloc, bytes: usize, byte: u8) -> Result<AVec<u8, &NumaGpuAlloc>, String> {
    let mut v = AVec::new_in(alloc);
    v.try_reserve_exact(bytes).map_err(|e| format!("{e:?}"))?;
    v.resize(bytes, byte);
    Ok(v)
}

/// The pages of a live block by node (negative keys: `-errno`, not present).
fn page_counts(ptr: *const u8, len: usize) -> Result<BTreeMap<i32, usize>, String> {
    let ptr = NonNull::new(ptr.cast_mut()).ok_or("a null pointer")?;
    let mut counts = BTreeMap::new();
    // SAFETY: `ptr..ptr+len` lies in a live large block of this process (page-aligned, mapped);
    // move_pages without target nodes only reads the page tables.
    unsafe { sys::page_nodes(ptr, len, |_, node| *counts.entry(node).or_default() += 1) }
        .map_err(|e| format!("move_pages: {e}"))?;
    Ok(counts)
}

fn describe_counts(counts: &BTreeMap<i32, usize>) -> String {
    let parts: Vec<String> = counts
        .iter()
        .map(|(&node, pages)| match node {
            0.. => format!("{pages} on node {node}"),
            _ => format!("{pages} absent (errno {})", -node),
        })
        .collect();
    parts.join(", ")
}

/// Passes when every page of `ptr..ptr+len` is present on `node`.
fn on_node(name: impl Into<String>, ptr: *const u8, len: usize, node: usize) -> Check {
    let pages = len.div_ceil(sys::page_size());
    let expected = format!("{pages} pages on node {node}");
    match page_counts(ptr, len) {
        Ok(c) if c.len() == 1 && i32::try_from(node).is_ok_and(|n| c.get(&n) == Some(&pages)) => {
            Check::pass(name)
        }
        Ok(c) => Check::fail(name, expected, describe_counts(&c)),
        Err(e) => Check::fail(name, expected, e),
    }
}

/// `rows` in node order, as [`live_rows`] lists them.
fn by_node<const N: usize>(mut rows: [(usize, usize, usize); N]) -> Vec<(usize, usize, usize)> {
    rows.sort();
    rows.to_vec()
}

/// `(node, live bytes, live blocks)` of every node with live blocks.
fn live_rows(stats: &Stats) -> Vec<(usize, usize, usize)> {
    stats
        .nodes
        .iter()
        .filter(|r| r.live_bytes != 0 || r.live_blocks != 0)
        .map(|r| (r.node, r.live_bytes, r.live_blocks))
        .collect()
}

/// `node=N` for each node: an allocator built with `.node(N)` places its block there. Explicitly
/// naming a node without memory must not crash: the block is refused (counted) or goes to the
/// nearest node with memory.
fn node_allocators(cx: &Ctx) -> Vec<Check> {
    let Ok(n) = &cx.numactl else {
        return vec![Check::fail("alloc.node", "numactl output", "unavailable")];
    };
    let memory = memory_nodes(n);
    let mut out = Vec::new();
    for &node in &n.nodes {
        let alloc = NumaGpuAlloc::new().node(node);
        let name = format!("alloc.node{node}");
        let p = alloc.placement();
        if memory.contains(&node) {
            let errors = alloc.stats().config_errors.len();
            out.push(Check::eq(
                format!("{name}.placement"),
                (node, true, false, 0),
                (p.host_node, p.numa_placement, p.pinning, errors),
            ));
            match filled(&alloc, NODE_BYTES, (node % 250) as u8 + 1) {
                Ok(v) => {
                    out.push(on_node(format!("{name}.pages"), v.as_ptr(), v.len(), node));
                    out.push(Check::eq(
                        format!("{name}.live"),
                        vec![(node, NODE_BYTES, 1)],
                        live_rows(&alloc.stats()),
                    ));
                }
                Err(e) => out.push(Check::fail(format!("{name}.pages"), "an 8 MiB block", e)),
            }
        } else {
            match filled(&alloc, NODE_BYTES, 1) {
                Err(_) => {
                    let s = alloc.stats();
                    eprintln!(
                        "note {name}: refused, host_node {}, config_errors {:?}",
                        p.host_node, s.config_errors
                    );
                    out.push(Check::eq(
                        format!("{name}.memoryless.refused"),
                        (1, 0),
                        (s.fallbacks.failed_allocations, s.live_bytes()),
                    ));
                }
                Ok(v) => {
                    let near = cx
                        .topology
                        .as_ref()
                        .ok()
                        .and_then(|t| t.host_node_for(node).ok());
                    let name = format!("{name}.memoryless.nearest");
                    out.push(match near {
                        Some(near) => on_node(name, v.as_ptr(), v.len(), near),
                        None => Check::fail(name, "a nearest node with memory", "none"),
                    });
                }
            }
        }
    }
    out
}

/// `policy=interleave` (with `verify`): a 64 MiB block's pages are spread over every node with
/// memory (each holds some), none on a memoryless node, none counted misplaced, and the block is
/// accounted to the allocator's node.
fn interleave(cx: &Ctx) -> Vec<Check> {
    let (n, target) = match numactl_and_target(cx, "alloc.interleave") {
        Ok(found) => found,
        Err(fail) => return vec![fail],
    };
    let memory = memory_nodes(n);
    let alloc = NumaGpuAlloc::new()
        .node(target)
        .policy(MemPolicy::Interleave)
        .verify(true);
    let v = match filled(&alloc, INTERLEAVE_BYTES, 0x5a) {
        Ok(v) => v,
        Err(e) => return vec![Check::fail("alloc.interleave", "a 64 MiB block", e)],
    };
    let counts = match page_counts(v.as_ptr(), v.len()) {
        Ok(c) => c,
        Err(e) => return vec![Check::fail("alloc.interleave", "page nodes", e)],
    };
    // Diagnostics for the serial log (the harness compares only PASS/FAIL lines).
    eprintln!("note alloc.interleave: {}", describe_counts(&counts));
    let pages = INTERLEAVE_BYTES / sys::page_size();
    let present: usize = counts.range(0..).map(|(_, k)| k).sum();
    let mut out = vec![Check::eq("alloc.interleave.present", pages, present)];
    for &node in &n.nodes {
        let held = i32::try_from(node)
            .ok()
            .and_then(|id| counts.get(&id))
            .copied()
            .unwrap_or(0);
        let name = format!("alloc.interleave.node{node}");
        out.push(if memory.contains(&node) && held > 0 {
            Check::pass(name)
        } else if memory.contains(&node) {
            Check::fail(name, "some pages", describe_counts(&counts))
        } else {
            Check::eq(format!("{name}.none"), 0, held)
        });
    }
    let s = alloc.stats();
    out.push(Check::eq(
        "alloc.interleave.live",
        vec![(target, INTERLEAVE_BYTES, 1)],
        live_rows(&s),
    ));
    // verify=on checks against every node of the policy: nothing is misplaced.
    out.push(Check::eq(
        "alloc.interleave.verified",
        (pages as u64, 0),
        (s.pages_checked, s.pages_misplaced),
    ));
    out
}

/// Two `Allocator` handles on two nodes in one process keep their blocks apart: each block is on
/// its handle's node, both handles' stats show the same node rows (the process's arenas), and one
/// handle never reuses space the other freed on another node: each node carves its handle's
/// blocks from a chunk of its own (one 32 MiB chunk holds them all), the freed space stays in
/// its node's chunk.
fn two_handles(cx: &Ctx) -> Vec<Check> {
    let (n, a_node) = match numactl_and_target(cx, "alloc.handles") {
        Ok(found) => found,
        Err(fail) => return vec![fail],
    };
    let Some(b_node) = memory_nodes(n).into_iter().find(|&id| id != a_node) else {
        return Vec::new(); // one node with memory: nothing to keep apart
    };
    let (a, b) = (
        NumaGpuAlloc::new().node(a_node),
        NumaGpuAlloc::new().node(b_node),
    );
    let blocks = (|| {
        let a1 = filled(&a, 8 * MIB, 0xa1)?;
        let b1 = filled(&b, 12 * MIB, 0xb1)?;
        let a2 = filled(&a, 16 * MIB, 0xa2)?;
        let b2 = filled(&b, 4 * MIB, 0xb2)?;
        Ok::<_, String>((a1, b1, a2, b2))
    })();
    let (a1, b1, a2, b2) = match blocks {
        Ok(blocks) => blocks,
        Err(e) => return vec![Check::fail("alloc.handles", "four blocks", e)],
    };
    let (na, nb) = (format!("node{a_node}"), format!("node{b_node}"));
    let mut out = vec![
        on_node(
            format!("alloc.handles.{na}.8MiB"),
            a1.as_ptr(),
            a1.len(),
            a_node,
        ),
        on_node(
            format!("alloc.handles.{nb}.12MiB"),
            b1.as_ptr(),
            b1.len(),
            b_node,
        ),
        on_node(
            format!("alloc.handles.{na}.16MiB"),
            a2.as_ptr(),
            a2.len(),
            a_node,
        ),
        on_node(
            format!("alloc.handles.{nb}.4MiB"),
            b2.as_ptr(),
            b2.len(),
            b_node,
        ),
        Check::eq(
            "alloc.handles.live",
            by_node([(a_node, 24 * MIB, 2), (b_node, 16 * MIB, 2)]),
            live_rows(&a.stats()),
        ),
        Check::eq(
            "alloc.handles.live.same_rows",
            live_rows(&a.stats()),
            live_rows(&b.stats()),
        ),
    ];
    drop(a1);
    let b3 = filled(&b, 8 * MIB, 0xb3);
    let (sa, sb) = (a.stats(), b.stats());
    // Per node: (live bytes, live blocks, cached bytes, chunks, mapped bytes).
    let chunk_rows = |s: &Stats| -> Vec<_> {
        s.nodes
            .iter()
            .filter(|r| r.mapped_bytes != 0 || r.live_bytes != 0)
            .map(|r| {
                (
                    r.node,
                    (
                        r.live_bytes,
                        r.live_blocks,
                        r.cached_bytes,
                        r.chunks,
                        r.mapped_bytes,
                    ),
                )
            })
            .collect()
    };
    let mut expected = vec![
        (
            a_node,
            (16 * MIB, 1, CHUNK_FIRST - 16 * MIB, 1, CHUNK_FIRST),
        ),
        (
            b_node,
            (24 * MIB, 3, CHUNK_FIRST - 24 * MIB, 1, CHUNK_FIRST),
        ),
    ];
    expected.sort();
    out.push(Check::eq(
        format!("alloc.handles.{na}.after_free"),
        expected,
        chunk_rows(&sa),
    ));
    // b asks for the size a just freed: a's cached block must not be handed to b.
    out.push(match &b3 {
        Ok(v) => on_node(
            format!("alloc.handles.{nb}.8MiB.fresh"),
            v.as_ptr(),
            v.len(),
            b_node,
        ),
        Err(e) => Check::fail(
            format!("alloc.handles.{nb}.8MiB.fresh"),
            "a block",
            e.clone(),
        ),
    });
    // b's requests: the first made b's node's chunk (a miss), the other two were carved from it.
    out.push(Check::eq(
        format!("alloc.handles.{nb}.no_cross_reuse"),
        (2, 1),
        (sb.cache_hits, sb.cache_misses),
    ));
    let intact = a2.iter().all(|&x| x == 0xa2)
        && b1.iter().all(|&x| x == 0xb1)
        && b2.iter().all(|&x| x == 0xb2)
        && b3.as_ref().map_or(true, |v| v.iter().all(|&x| x == 0xb3));
    out.push(Check::eq("alloc.handles.data", true, intact));
    out
}

/// Free memory of each node, from `nodeN/meminfo`.
fn free_bytes(sysfs: &Path, nodes: &[usize]) -> Result<BTreeMap<usize, usize>, String> {
    let mut free = BTreeMap::new();
    for &node in nodes {
        let path = sysfs.join(format!("devices/system/node/node{node}/meminfo"));
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // `Node 1 MemFree:          123456 kB`
        let kb = text
            .lines()
            .find_map(
                |l| match l.split_whitespace().collect::<Vec<_>>().as_slice() {
                    ["Node", _, "MemFree:", kb, "kB"] => kb.parse::<usize>().ok(),
                    _ => None,
                },
            )
            .ok_or_else(|| format!("{}: no MemFree line", path.display()))?;
        free.insert(node, kb * 1024);
    }
    Ok(free)
}

/// `policy=bind` on the node with the least free memory, for more than it has free (but less
/// than the guest has): a clean `AllocError`, counted (a carved request's chunk stays, wholly
/// free; a dedicated mapping is unmapped), and the allocator still works. The same
/// request under `preferred` with `verify`: it succeeds, and the pages that spilled to other
/// nodes are counted as misplaced.
fn bind_exhausted(cx: &Ctx) -> Vec<Check> {
    let Ok(n) = &cx.numactl else {
        return vec![Check::fail("alloc.bind", "numactl output", "unavailable")];
    };
    let memory = memory_nodes(n);
    if memory.len() < 2 {
        return Vec::new(); // nowhere to spill to
    }
    let free = match free_bytes(&cx.args.sysfs, &memory) {
        Ok(f) => f,
        Err(e) => return vec![Check::fail("alloc.bind", "free memory per node", e)],
    };
    let Some((&node, &node_free)) = free.iter().min_by_key(|(_, &bytes)| bytes) else {
        return Vec::new();
    };
    let request = capacity(node_free + BIND_EXCESS);
    let others: usize = free.values().sum::<usize>() - node_free;
    if others < request - node_free + BIND_MARGIN {
        let need = (request - node_free + BIND_MARGIN) >> 20;
        let got = format!("{} MiB free on the other nodes", others >> 20);
        return vec![Check::fail("alloc.bind.room", format!("{need} MiB"), got)];
    }
    let Ok(layout) = Layout::from_size_align(request, sys::page_size()) else {
        return vec![Check::fail(
            "alloc.bind",
            "a layout",
            format!("{request} bytes"),
        )];
    };
    let what = format!(
        "{} MiB on node {node} ({} MiB free)",
        request >> 20,
        node_free >> 20
    );
    eprintln!(
        "note alloc.bind: {what}, {} MiB free elsewhere",
        others >> 20
    );

    let bind = NumaGpuAlloc::new().node(node).policy(MemPolicy::Bind);
    let mut out = vec![match Allocator::allocate(&bind, layout) {
        Err(_) => Check::pass("alloc.bind.refused"),
        Ok(block) => {
            let got = match page_counts(block.cast::<u8>().as_ptr(), request) {
                Ok(c) => format!("a block ({})", describe_counts(&c)),
                Err(e) => format!("a block ({e})"),
            };
            // SAFETY: allocated just above from `bind` with `layout`, not used since.
            unsafe { Allocator::deallocate(&bind, block.cast(), layout) };
            Check::fail("alloc.bind.refused", format!("AllocError for {what}"), got)
        }
    }];
    let s = bind.stats();
    if let Ok(after) = free_bytes(&cx.args.sysfs, &[node]) {
        let n = s.nodes.iter().find(|r| r.node == node);
        eprintln!(
            "note alloc.bind: after the refusal {} MiB free on node {node}; chunks {:?}, \
             resident {:?} MiB",
            after.get(&node).copied().unwrap_or(0) >> 20,
            n.map(|r| r.chunks),
            n.map(|r| r.resident_bytes >> 20),
        );
    }
    // A carved request's chunk stays for later requests (all of it free: cached); a dedicated
    // mapping is unmapped.
    let chunk = if request < DEDICATED_MIN {
        let len = request.next_multiple_of(CHUNK_ALIGN).max(CHUNK_FIRST);
        (1, len, len)
    } else {
        (0, 0, 0)
    };
    out.push(Check::eq(
        "alloc.bind.counted",
        (1, 1, 0, chunk),
        (
            s.fallbacks.failed_allocations,
            s.fallbacks.bind_exhausted,
            s.live_bytes(),
            (
                s.nodes.iter().map(|r| r.chunks).sum::<usize>(),
                s.cached_bytes(),
                s.nodes.iter().map(|r| r.mapped_bytes).sum::<usize>(),
            ),
        ),
    ));
    out.push(match filled(&bind, NODE_BYTES, 0x42) {
        Ok(v) => on_node("alloc.bind.then_8MiB", v.as_ptr(), v.len(), node),
        Err(e) => Check::fail("alloc.bind.then_8MiB", "an 8 MiB block", e),
    });
    drop(bind);

    let preferred = NumaGpuAlloc::new().node(node).verify(true);
    match Allocator::allocate(&preferred, layout) {
        Ok(block) => {
            let ptr = block.cast::<u8>();
            let counts = page_counts(ptr.as_ptr(), request);
            if let Ok(c) = &counts {
                eprintln!("note alloc.preferred: {}", describe_counts(c));
            }
            let s = preferred.stats();
            // SAFETY: allocated just above from `preferred` with `layout`, not used since.
            unsafe { Allocator::deallocate(&preferred, ptr, layout) };
            out.push(Check::pass("alloc.preferred.succeeds"));
            let pages = request / sys::page_size();
            out.push(Check::eq(
                "alloc.preferred.pages_checked",
                pages as u64,
                s.pages_checked,
            ));
            let elsewhere = counts.map(|c| {
                c.iter()
                    .filter(|(&id, _)| usize::try_from(id).is_ok_and(|id| id != node))
                    .map(|(_, &k)| k as u64)
                    .sum::<u64>()
            });
            out.push(match elsewhere {
                Ok(e) if e > 0 && e == s.pages_misplaced => {
                    Check::pass("alloc.preferred.misplaced")
                }
                Ok(e) => Check::fail(
                    "alloc.preferred.misplaced",
                    format!("> 0 and = {e} pages found off node {node}"),
                    s.pages_misplaced.to_string(),
                ),
                Err(e) => Check::fail("alloc.preferred.misplaced", "page nodes", e),
            });
        }
        Err(_) => out.push(Check::fail(
            "alloc.preferred.succeeds",
            format!("a block of {what}"),
            "AllocError",
        )),
    }
    out
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        topology: "unknown".into(),
        numactl: PathBuf::new(),
        device: String::new(),
        expect_home: None,
        expect_host: None,
        unknown_device: None,
        alloc_report: None,
        limit_report: None,
        routes_report: None,
        cpuset_reports: Vec::new(),
        sysfs: PathBuf::from("/sys"),
    };
    let node = |v: String| match v.as_str() {
        "none" | "" => Ok(None),
        _ => num(&v).map(Some),
    };
    const FLAGS: &[&str] = &[
        "--topology",
        "--numactl",
        "--device",
        "--expect-home",
        "--expect-host",
        "--unknown-device",
        "--alloc-report",
        "--limit-report",
        "--routes-report",
        "--cpuset-report",
        "--sysfs",
    ];
    while let Some(flag) = it.next() {
        if !FLAGS.contains(&flag.as_str()) {
            return Err(format!("unknown argument {flag:?}"));
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--topology" => args.topology = value,
            "--numactl" => args.numactl = value.into(),
            "--device" => args.device = value,
            "--expect-home" => args.expect_home = node(value)?,
            "--expect-host" => args.expect_host = node(value)?,
            "--unknown-device" => args.unknown_device = Some(value).filter(|v| !v.is_empty()),
            "--alloc-report" => args.alloc_report = Some(value.into()),
            "--limit-report" => args.limit_report = Some(value.into()),
            "--routes-report" => args.routes_report = Some(value.into()),
            "--cpuset-report" => {
                let (name, path) = value
                    .split_once('=')
                    .ok_or_else(|| format!("--cpuset-report {value:?}: NAME=FILE"))?;
                args.cpuset_reports.push((name.to_owned(), path.into()));
            }
            "--sysfs" => args.sysfs = value.into(),
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    // The allocator checks configure their allocators with the builder; the environment would
    // override it. Nothing else runs yet, so changing the environment races with nobody.
    std::env::remove_var(numa_gpu_alloc::ENV_VAR);
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            println!("FAIL args: expected the arguments in the module docs, got {e}");
            println!("guest unknown: 0 passed, 1 failed");
            return ExitCode::FAILURE;
        }
    };
    let numactl = std::fs::read_to_string(&args.numactl)
        .map_err(|e| format!("{}: {e}", args.numactl.display()))
        .and_then(|text| Numactl::parse(&text));
    let topology = if args.sysfs == Path::new("/sys") {
        NumaTopology::from_sysfs()
    } else {
        NumaTopology::from_sysfs_root(&args.sysfs)
    }
    .map_err(|e| e.to_string());
    let cx = Ctx {
        args,
        numactl,
        topology,
    };

    let (mut passed, mut failed) = (0, 0);
    // The arenas are the process's: each group starts with every node's cache empty, as if it
    // ran alone (blocks of a dropped allocator stay cached for the others).
    let empty_caches = || {
        let any = NumaGpuAlloc::new();
        let _ = any.placement();
        any.trim();
    };
    for check in GROUPS.iter().flat_map(|group| {
        empty_caches();
        group(&cx)
    }) {
        match check.outcome {
            Outcome::Pass => {
                passed += 1;
                println!("PASS {}", check.name);
            }
            Outcome::Fail { expected, got } => {
                failed += 1;
                println!("FAIL {}: expected {expected}, got {got}", check.name);
            }
        }
    }
    println!(
        "guest {}: {passed} passed, {failed} failed",
        cx.args.topology
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
