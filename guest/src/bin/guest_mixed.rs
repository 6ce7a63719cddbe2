//! A client program's allocations inside a cgroup whose cpuset confines it to one small node,
//! checked from inside a QEMU guest (see `scripts/numa-guests.sh`, topology
//! `h-cpuset-small-node`).
//!
//! `guest/init` runs it twice, each time in a cgroup v2 of its own whose `cpuset.mems` is the
//! node (and `cpuset.cpus` its CPUs), with no `memory.max`: with glibc (`System`) and with ours
//! (`NUMA_GPU_ALLOC=gpu=pci:<device on that node>`). It saves the standard output, the exit
//! status and the cgroup's `memory.events`, and `guest_check --cpuset-report NAME=FILE` folds the
//! lines in (`PASS cpuset.<allocator>.<name>` or `FAIL ...: expected X, got Y`, then
//! `cpuset.<allocator>: N passed, M failed`), with the exit status and the OOM counters.
//! Figures that vary from run to run (peak resident memory, the node's free memory) go to
//! standard error, the guest's console.
//!
//! ```text
//! guest_mixed --allocator glibc|ours --node NODE
//! ```
//!
//! The workload: two threads reuse buffers of 3–15 MiB (two each at a time) while the main
//! thread grows a `Vec` to 64 MiB; then the large buffers are freed and both threads build
//! JSON-like trees (maps, strings, arrays; no allocation of 2 MiB or more) until 200 MiB are
//! live, keep them for a few seconds, walk them and free them. On a 300 MiB node glibc reuses
//! the freed buffers' memory for the small objects; an allocator that kept the freed large
//! blocks resident (the arena before chunks and decay kept about 73 MiB) runs the node out of
//! memory and the kernel's OOM killer ends the program (a cpuset has no `memory.max` to fail
//! against first). Ours must survive like glibc: while nothing large is allocated its decay
//! thread gives the idle free space back.
//!
//! What it checks: the process may use only memory of `NODE` (`Mems_allowed_list`); the data
//! survives every phase; with ours, large requests took the large path on `NODE`, none failed,
//! and by the end of the small-object phase the idle memory of the node's arena was given back.

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use numa_gpu_alloc::NumaGpuAlloc;
use serde_json::{Map, Value};

#[path = "../report.rs"]
#[allow(dead_code)] // the page census is for the other guest programs
mod report;
use report::Report;

const MIB: usize = 1 << 20;
/// Large buffers each worker allocates, fills and checks in the first phase (two live at once).
const BUFFERS: usize = 24;
/// Their sizes: 3 to 15 MiB.
const BUFFER_MIN: usize = 3 * MIB;
const BUFFER_MAX: usize = 15 * MIB;
/// The main thread's `Vec` grows to this many bytes, 64 KiB at a time.
const VEC_BYTES: usize = 64 * MIB;
/// Bytes live in small objects at the top of the second phase (both workers together).
const SMALL_BYTES: usize = 170 * MIB;
/// The second phase reaches `SMALL_BYTES` no sooner than this.
const RAMP: Duration = Duration::from_secs(3);
/// How long the trees stay live once built.
const HOLD: Duration = Duration::from_secs(3);
const WORKERS: usize = 2;

// ---------------------------------------------------------------------------------------------
// The global allocator: glibc or ours, chosen by `--allocator` before the workload starts.

static OURS: NumaGpuAlloc = NumaGpuAlloc::new();
/// Set once by `main`, before the workload allocates anything.
static USE_OURS: AtomicBool = AtomicBool::new(false);
/// Bytes requested and not yet freed, whichever allocator serves them.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Sends every request to glibc until `main` chooses ours, then to ours. What the runtime
/// allocated before the choice goes back to glibc when freed through ours: ours passes small
/// frees to its inner allocator (`System`) by size, and frees of large pointers it does not hold
/// too (as foreign frees; there are none here). Every peer pays the same: a load, a branch and a
/// counter per request.
struct Chosen;

#[global_allocator]
static GLOBAL: Chosen = Chosen;

impl Chosen {
    fn allocator(&self) -> &'static dyn GlobalAlloc {
        if USE_OURS.load(Relaxed) {
            &OURS
        } else {
            &System
        }
    }
}

// SAFETY: forwards every call to glibc or ours; each frees what either made (see `Chosen`).
unsafe impl GlobalAlloc for Chosen {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        let ptr = unsafe { self.allocator().alloc(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size(), Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        let ptr = unsafe { self.allocator().alloc_zeroed(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size(), Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        // SAFETY: forwarded from the caller.
        unsafe { self.allocator().dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        let moved = unsafe { self.allocator().realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            LIVE.fetch_sub(layout.size(), Relaxed);
            LIVE.fetch_add(new_size, Relaxed);
        }
        moved
    }
}

// ---------------------------------------------------------------------------------------------
// The workload.

/// splitmix64: a fixed, dependency-free sequence.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const WORDS: [&str; 12] = [
    "alpha", "beta", "gamma", "delta", "tensor", "batch", "stream", "node", "cuda", "numa", "page",
    "block",
];

/// A string of 16 to 400 bytes made of words.
fn text(rng: &mut u64) -> String {
    let len = 16 + (next(rng) % 385) as usize;
    let mut s = String::with_capacity(len);
    while s.len() < len {
        s.push_str(WORDS[(next(rng) % 12) as usize]);
        s.push(' ');
    }
    s.truncate(len);
    s
}

/// A JSON-like tree: objects of 4 to 11 fields (strings, numbers, arrays of numbers, and below
/// the top `depth` levels nested objects and arrays of objects).
fn tree(rng: &mut u64, depth: u32) -> Value {
    let mut map = Map::new();
    for field in 0..4 + next(rng) % 8 {
        let key = format!("{}_{field}", WORDS[(next(rng) % 12) as usize]);
        let value = match (next(rng) % 6, depth) {
            (0 | 1, _) | (4 | 5, 0) => Value::String(text(rng)),
            (2, _) => Value::from(next(rng) % 1_000_000),
            (3, _) => Value::Array((0..next(rng) % 16).map(|i| Value::from(i * 3)).collect()),
            (4, _) => tree(rng, depth - 1),
            _ => Value::Array(
                (0..1 + next(rng) % 3)
                    .map(|_| tree(rng, depth - 1))
                    .collect(),
            ),
        };
        map.insert(key, value);
    }
    Value::Object(map)
}

/// A checksum of a tree: its strings' lengths and its numbers.
fn digest(value: &Value) -> u64 {
    match value {
        Value::String(s) => s.len() as u64,
        Value::Number(n) => n.as_u64().unwrap_or(1),
        Value::Array(items) => items.iter().map(digest).fold(7, u64::wrapping_add),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| (k.len() as u64).wrapping_mul(31).wrapping_add(digest(v)))
            .fold(11, u64::wrapping_add),
        _ => 0,
    }
}

/// A byte pattern that tells buffers and offsets apart.
fn byte(seed: usize, i: usize) -> u8 {
    (seed.wrapping_mul(131) ^ (i / 4096)) as u8
}

/// One worker: large buffers, then small objects. Returns whether its data checked out.
fn worker(id: usize, phase_two: &Barrier, small_start: &Barrier) -> bool {
    let mut rng = 0x5eed_0000 + id as u64;
    let mut ok = true;
    // --- Phase 1: buffers of 3-15 MiB, two live at a time, each filled and checked.
    let mut held: Vec<(usize, Vec<u8>)> = Vec::new();
    for n in 0..BUFFERS {
        let len = BUFFER_MIN + (next(&mut rng) as usize % (BUFFER_MAX - BUFFER_MIN + 1));
        let len = len & !4095;
        let seed = id * 1000 + n;
        let mut buf = Vec::with_capacity(len);
        for page in 0..len / 4096 {
            buf.extend(std::iter::repeat_n(byte(seed, page * 4096), 4096));
        }
        held.push((seed, buf));
        if held.len() > 2 {
            let (seed, old) = held.remove(0);
            ok &= old
                .iter()
                .step_by(4096)
                .enumerate()
                .all(|(p, &b)| b == byte(seed, p * 4096));
        }
    }
    phase_two.wait();
    // --- Phase 2: the buffers go, small objects come (none of 2 MiB or more).
    for (seed, old) in held.drain(..) {
        ok &= old
            .iter()
            .step_by(4096)
            .enumerate()
            .all(|(p, &b)| b == byte(seed, p * 4096));
    }
    drop(held);
    small_start.wait();
    let start = Instant::now();
    let mut docs: Vec<Vec<Value>> = Vec::new();
    let mut sums: Vec<u64> = Vec::new();
    let mut batch = Vec::new();
    while LIVE.load(Relaxed) < SMALL_BYTES {
        // Paced: the live bytes grow no faster than SMALL_BYTES over RAMP.
        let due = SMALL_BYTES as f64 * (start.elapsed().as_secs_f64() / RAMP.as_secs_f64());
        if (LIVE.load(Relaxed) as f64) > due {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let doc = tree(&mut rng, 3);
        sums.push(digest(&doc));
        batch.push(doc);
        if batch.len() == 256 {
            docs.push(std::mem::take(&mut batch));
        }
    }
    docs.push(batch);
    std::thread::sleep(HOLD);
    let walked = docs.iter().flatten().map(digest);
    ok &= walked.eq(sums.iter().copied());
    ok
}

/// A `Key: value` line of /proc/self/status.
fn status(key: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

/// The kB figure of a /proc/self/status line, in MiB.
fn status_mib(key: &str) -> f64 {
    let kb = status(key)
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// `node`'s free memory in MiB (`nodeN/meminfo`).
fn node_free_mib(node: usize) -> f64 {
    let path = format!("/sys/devices/system/node/node{node}/meminfo");
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let kb = text
        .lines()
        .find_map(
            |l| match l.split_whitespace().collect::<Vec<_>>().as_slice() {
                ["Node", _, "MemFree:", kb, "kB"] => kb.parse::<f64>().ok(),
                _ => None,
            },
        )
        .unwrap_or(0.0);
    kb / 1024.0
}

/// Bytes of `node`'s arena that hold no live block but may be resident: resident chunk space
/// not under a live block (at least), and cached dedicated blocks.
fn idle_resident(node: usize) -> usize {
    let stats = OURS.stats();
    let Some(n) = stats.nodes.iter().find(|n| n.node == node) else {
        return 0;
    };
    // Cached bytes beyond the chunks' free space are cached dedicated blocks (resident); live
    // bytes beyond what the chunks hold are dedicated blocks (not in resident_bytes).
    let chunk_free = n.mapped_bytes.saturating_sub(n.live_bytes);
    let dedicated_cached = n.cached_bytes.saturating_sub(chunk_free);
    let chunk_live = n.live_bytes.min(n.mapped_bytes);
    n.resident_bytes.saturating_sub(chunk_live) + dedicated_cached
}

struct Args {
    ours: bool,
    node: usize,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let (mut ours, mut node) = (None, None);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match (flag.as_str(), value.as_str()) {
            ("--allocator", "ours") => ours = Some(true),
            ("--allocator", "glibc") => ours = Some(false),
            ("--node", v) => node = Some(v.parse().map_err(|_| format!("node id {v:?}"))?),
            _ => return Err(format!("{flag} {value:?}")),
        }
    }
    Ok(Args {
        ours: ours.ok_or("--allocator glibc|ours")?,
        node: node.ok_or("--node NODE")?,
    })
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            let mut r = Report::new("cpuset");
            r.check(
                "args",
                false,
                || "the arguments in the module docs".into(),
                e,
            );
            return r.finish();
        }
    };
    USE_OURS.store(args.ours, Relaxed);
    let name = if args.ours { "ours" } else { "glibc" };
    let mut r = Report::new(if args.ours {
        "cpuset.ours"
    } else {
        "cpuset.glibc"
    });
    let node = args.node;
    eprintln!(
        "guest_mixed {name}: node {node} has {:.1} MiB free at the start",
        node_free_mib(node)
    );
    r.eq(
        "mems_allowed",
        Some(node.to_string()),
        status("Mems_allowed_list"),
    );

    let start = Instant::now();
    let phase_two = Barrier::new(WORKERS + 1);
    let small_start = Barrier::new(WORKERS + 1);
    let (data_ok, idle) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..WORKERS)
            .map(|id| {
                let (phase_two, small_start) = (&phase_two, &small_start);
                s.spawn(move || worker(id, phase_two, small_start))
            })
            .collect();
        // The main thread's Vec grows 64 KiB at a time while the workers churn buffers.
        let piece: Vec<u64> = (0..8192u64).collect();
        let mut grown: Vec<u64> = Vec::new();
        while grown.len() * 8 < VEC_BYTES {
            grown.extend_from_slice(&piece);
        }
        let mut ok = grown
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i % 8192) as u64);
        phase_two.wait();
        eprintln!(
            "guest_mixed {name}: large phase done at {:.1} s, resident {:.1} MiB, node free {:.1} MiB",
            start.elapsed().as_secs_f64(),
            status_mib("VmRSS"),
            node_free_mib(node)
        );
        if args.ours {
            eprintln!("{}", OURS.stats());
        }
        drop(grown);
        small_start.wait();
        // Watch the node while the trees grow: its least free memory, and the arena's idle
        // memory once the trees are all there.
        let mut least_free = f64::MAX;
        while !workers.iter().all(|w| w.is_finished()) && LIVE.load(Relaxed) < SMALL_BYTES {
            least_free = least_free.min(node_free_mib(node));
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(HOLD / 2);
        least_free = least_free.min(node_free_mib(node));
        let idle = args.ours.then(|| idle_resident(node));
        eprintln!(
            "guest_mixed {name}: small objects {:.1} MiB live at {:.1} s, resident {:.1} MiB, node free {:.1} MiB (least {least_free:.1})",
            LIVE.load(Relaxed) as f64 / MIB as f64,
            start.elapsed().as_secs_f64(),
            status_mib("VmRSS"),
            node_free_mib(node)
        );
        if args.ours {
            eprintln!("{}", OURS.stats());
        }
        for w in workers {
            ok &= w.join().unwrap_or(false);
        }
        (ok, idle)
    });
    r.eq("data", true, data_ok);
    if let Some(idle) = idle {
        let stats = OURS.stats();
        let placement = OURS.placement();
        r.eq(
            "large_path",
            (node, true, 0),
            (
                placement.host_node,
                stats.large_allocations > 0,
                stats.fallbacks.failed_allocations,
            ),
        );
        // Free space idle for the decay time is purged; what may stay resident is at most the
        // huge pages free space shares with live blocks' (the trees' Vecs are small: none).
        r.check(
            "idle_given_back",
            idle <= 4 * MIB,
            || "at most 4 MiB idle and resident in the arena".into(),
            format!("{:.1} MiB", idle as f64 / MIB as f64),
        );
    }
    eprintln!(
        "guest_mixed {name}: finished in {:.1} s, peak resident {:.1} MiB (VmHWM)",
        start.elapsed().as_secs_f64(),
        status_mib("VmHWM")
    );
    r.finish()
}
