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
//!             [--shared-report FILE] [--python-placed FILE] [--python-unplaced FILE]
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
//! * `--alloc-report`: what `guest_alloc` (the allocator as `#[global_allocator]`,
//!   run by `guest/init` with `NUMA_GPU_ALLOC=gpu=pci:<device>`) printed, followed by the line
//!   `exit rc=N`; its `PASS`/`FAIL` lines join this table;
//! * `--limit-report`: the same for `guest_alloc --mode limit`, run by `guest/init` inside a
//!   cgroup with a `memory.max` (topologies that set `MEMORY_MAX`);
//! * `--routes-report`: the same for `guest_routes` (threads bound to devices on
//!   different nodes; topologies that set `ROUTES`);
//! * `--shared-report`: the same for `guest_shared` (a shared pool on each node, attached by a
//!   second process);
//! * `--python-placed`, `--python-unplaced`: what `preload/tests/python/placed.py` printed
//!   under the preload library and without it (`python.rs`; topologies that set `PYTHON_MIB`);
//! * `--cpuset-report NAME=FILE` (once per allocator): the same for `guest_mixed`
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
use numa_gpu_alloc::unstable::pci::{self, PciAddress};
use numa_gpu_alloc::unstable::sys::{self, MbindFlags, MemPolicy, NodeMask};
use numa_gpu_alloc::{NumaGpuAlloc, NumaTopology, Stats};

mod allocators;
mod numactl;
mod python;
use allocators::{bind_exhausted, interleave, node_allocators, two_handles};
use numactl::*;
use python::python;

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
    shared_report: Option<PathBuf>,
    python_placed: Option<PathBuf>,
    python_unplaced: Option<PathBuf>,
    /// `(allocator, report)` of each `guest_mixed` run.
    cpuset_reports: Vec<(String, PathBuf)>,
    sysfs: PathBuf,
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
    shared,
    python,
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

/// Shared pools on each node, seen from two processes (`guest_shared`, `--shared-report`).
fn shared(cx: &Ctx) -> Vec<Check> {
    cx.args
        .shared_report
        .as_deref()
        .map_or_else(Vec::new, |path| report(path, "shared"))
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
        shared_report: None,
        python_placed: None,
        python_unplaced: None,
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
        "--shared-report",
        "--python-placed",
        "--python-unplaced",
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
            "--shared-report" => args.shared_report = Some(value.into()),
            "--python-placed" => args.python_placed = Some(value.into()),
            "--python-unplaced" => args.python_unplaced = Some(value.into()),
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
