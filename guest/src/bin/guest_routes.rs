//! Per-thread routing in a whole program, checked from inside a QEMU guest with several PCI
//! devices on different nodes (see `scripts/numa-guests.sh`, topology `g-three-devices`).
//!
//! `guest/init` runs it with each device's address and the host node its buffers must land on;
//! `guest_check --routes-report FILE` folds its lines (`PASS routes.<name>` or
//! `FAIL routes.<name>: expected X, got Y`, then `routes: N passed, M failed`) into the table.
//!
//! ```text
//! guest_routes --devices DDDD:BB:DD.F=HOST[,DDDD:BB:DD.F=HOST...]
//! ```
//!
//! What it checks: one thread per device, bound to it (`bind_thread(Route::Gpu(Pci))`), gets a
//! `Vec` through the `#[global_allocator]` and one through `Vec::new_in` on a handle with the
//! default target, every page on that device's host node (`move_pages`); per-node live bytes are
//! those buffers, carved from one chunk of the node (32 MiB, the rest cached); freed by the main
//! thread (unbound), each block goes back to its node's chunk; a second round of bound threads
//! gets the same space back (cache hits, the same addresses), still on their nodes.

use std::process::ExitCode;

use allocator_api2::vec::Vec as AVec;
use numa_gpu_alloc::unstable::pci::PciAddress;
use numa_gpu_alloc::{bind_thread, GpuSelector, NumaGpuAlloc, Route, Stats};

#[path = "../report.rs"]
mod report;
use report::Report;

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();

/// A handle with the default target: a thread's route applies to it too.
static HANDLE: NumaGpuAlloc = NumaGpuAlloc::new();

const MIB: usize = 1 << 20;
/// Buffer sizes in whole pages, so that live bytes are their sum.
const GLOBAL_LEN: usize = 8 * MIB;
const HANDLE_LEN: usize = 6 * MIB;
/// A node's first chunk (as `CHUNK_FIRST` in src/arena/mod.rs): both buffers fit in it.
const CHUNK_FIRST: usize = 32 * MIB;

/// One device's buffers: through the global allocator and through the handle.
type Buffers = (Vec<u8>, AVec<u8, &'static NumaGpuAlloc>);

/// Allocates and fills one device's buffers on a thread bound to it.
fn on_bound_thread(device: PciAddress, seed: u8) -> Buffers {
    let _bound = bind_thread(Route::Gpu(GpuSelector::Pci(device)));
    let global = vec![seed; GLOBAL_LEN];
    let mut handle = AVec::with_capacity_in(HANDLE_LEN, &HANDLE);
    handle.resize(HANDLE_LEN, !seed);
    (global, handle)
}

/// One round: a bound thread per device; checks every page of its buffers.
fn round(r: &mut Report, name: &str, devices: &[(PciAddress, usize)]) -> Vec<Buffers> {
    let buffers: Vec<Buffers> = std::thread::scope(|s| {
        let threads: Vec<_> = (devices.iter().zip(1u8..))
            .map(|(&(device, _), seed)| s.spawn(move || on_bound_thread(device, seed)))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for ((global, handle), &(device, host)) in buffers.iter().zip(devices) {
        let at = format!("{name}.{device}");
        r.on_node(
            &format!("{at}.global.pages"),
            global.as_ptr(),
            global.len(),
            host,
        );
        r.on_node(
            &format!("{at}.new_in.pages"),
            handle.as_ptr(),
            handle.len(),
            host,
        );
    }
    buffers
}

/// (node, live bytes, cached bytes, chunks, mapped bytes) of each node, from the process's
/// arenas.
fn rows(stats: &Stats) -> Vec<(usize, usize, usize, usize, usize)> {
    stats
        .nodes
        .iter()
        .map(|n| {
            (
                n.node,
                n.live_bytes,
                n.cached_bytes,
                n.chunks,
                n.mapped_bytes,
            )
        })
        .collect()
}

/// Checks the node rows: each host node holds its devices' buffers, live or freed, in one chunk
/// whose other bytes are cached; other nodes hold nothing.
fn check_rows(r: &mut Report, name: &str, devices: &[(PciAddress, usize)], live: bool) {
    let stats = ALLOC.stats();
    let expected: Vec<_> = stats
        .nodes
        .iter()
        .map(|n| {
            let count = devices.iter().filter(|d| d.1 == n.node).count();
            let bytes = (GLOBAL_LEN + HANDLE_LEN) * count;
            let (chunks, mapped) = if count > 0 { (1, CHUNK_FIRST) } else { (0, 0) };
            let live = if live { bytes } else { 0 };
            (n.node, live, mapped - live, chunks, mapped)
        })
        .collect();
    r.eq(&format!("{name}.node_rows"), expected, rows(&stats));
}

/// The blocks' addresses.
fn addresses(buffers: &[Buffers]) -> Vec<(*const u8, *const u8)> {
    buffers
        .iter()
        .map(|(g, h)| (g.as_ptr(), h.as_ptr()))
        .collect()
}

fn run(r: &mut Report, devices: &[(PciAddress, usize)]) {
    let first = round(r, "first", devices);
    check_rows(r, "first", devices, true);
    r.eq(
        "first.same_rows_through_the_handle",
        rows(&ALLOC.stats()),
        rows(&HANDLE.stats()),
    );
    let freed = addresses(&first);
    drop(first); // by this (unbound) thread
    check_rows(r, "freed", devices, false);
    let hits = (ALLOC.stats().cache_hits, HANDLE.stats().cache_hits);
    let second = round(r, "second", devices);
    r.eq("second.same_blocks", freed, addresses(&second));
    let n = devices.len() as u64;
    r.eq(
        "second.cache_hits",
        (hits.0 + n, hits.1 + n),
        (ALLOC.stats().cache_hits, HANDLE.stats().cache_hits),
    );
    check_rows(r, "second", devices, true);
    r.eq(
        "unplaced",
        0,
        ALLOC.stats().fallbacks.unplaced_blocks + HANDLE.stats().fallbacks.unplaced_blocks,
    );
}

/// `ADDR=HOST,ADDR=HOST`.
fn parse_devices(text: &str) -> Result<Vec<(PciAddress, usize)>, String> {
    text.split(',')
        .map(|pair| {
            let (addr, host) = pair.split_once('=').ok_or(format!("{pair:?}: no '='"))?;
            let addr = addr.parse().map_err(|e| format!("{addr:?}: {e}"))?;
            let host = host.parse().map_err(|e| format!("{host:?}: {e}"))?;
            Ok((addr, host))
        })
        .collect()
}

fn main() -> ExitCode {
    // The allocators take their targets from the builder (the default one), not the environment.
    std::env::remove_var(numa_gpu_alloc::ENV_VAR);
    let mut r = Report::new("routes");
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, devices] if flag == "--devices" => match parse_devices(devices) {
            Ok(devices) => run(&mut r, &devices),
            Err(e) => r.check("args", false, || "ADDR=HOST pairs".into(), e),
        },
        _ => r.check(
            "args",
            false,
            || "--devices ADDR=HOST,...".into(),
            format!("{args:?}"),
        ),
    }
    r.finish()
}
