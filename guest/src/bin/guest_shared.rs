//! Shared pools inside a QEMU guest with several nodes (see `scripts/numa-guests.sh`, topologies
//! that set `SHARED_NODES`): for each node given, a pool made on it, and a second process that
//! attaches by the inherited descriptor. Both must see every page of the pool's blocks on the
//! node (`move_pages`, each from its own mapping), a memory-only node included (the case CUDA's
//! own host-NUMA path refuses); a block the second process allocates and fills is live and
//! readable in the first at its handle.
//!
//! `guest_check --shared-report FILE` folds its lines (`PASS shared.<name>` or
//! `FAIL shared.<name>: expected X, got Y`, then `shared: N passed, M failed`) into the table.
//!
//! ```text
//! guest_shared --nodes N[,N...]
//! ```

use std::alloc::Layout;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Command, ExitCode, Stdio};

use numa_gpu_alloc::unstable::sys;
use numa_gpu_alloc::{PoolHandle, SharedPool};

#[path = "../report.rs"]
mod report;
use report::Report;

const MIB: usize = 1 << 20;
const POOL: usize = 16 * MIB;
/// Where blocks start in a pool's file (after its header).
const BLOCKS: u64 = 2 * MIB as u64;
const CHILD_VAR: &str = "GUEST_SHARED_CHILD";

/// The pool's blocks in this process: pointer and length.
fn blocks(pool: &SharedPool) -> (*mut u8, usize) {
    let len = pool.stats().usable_bytes;
    // A handle names its pool by id: a block carved for a moment gives it.
    let Some(probe) = pool.allocate_handle(Layout::from_size_align(64, 64).unwrap()) else {
        return (std::ptr::null_mut(), len);
    };
    // SAFETY: the block just carved, used by nobody.
    let _ = unsafe { pool.free(probe) };
    let whole = PoolHandle {
        offset: BLOCKS,
        len: len as u64,
        ..probe
    };
    (
        pool.ptr(whole).map_or(std::ptr::null_mut(), |p| p.as_ptr()),
        len,
    )
}

/// Pages of the blocks on `node`, of how many (`move_pages` from this process's mapping).
fn census(pool: &SharedPool, node: usize) -> String {
    let (ptr, len) = blocks(pool);
    let Some(ptr) = std::ptr::NonNull::new(ptr) else {
        return "no blocks".into();
    };
    // SAFETY: the pool's mapping, live while `pool` is; move_pages only reads page tables.
    match unsafe { sys::census(ptr, len, node) } {
        Ok(c) => format!("{} of {} pages on node {node}", c.on_node, c.pages),
        Err(e) => format!("census: {e}"),
    }
}

/// The second process: attach, report where the pages are, allocate and fill a block, name it.
fn child(spec: &str) -> ExitCode {
    let (fd, node) = spec.split_once(',').unwrap_or((spec, "0"));
    let (Ok(fd), Ok(node)) = (fd.parse::<i32>(), node.parse::<usize>()) else {
        println!("child: bad spec {spec:?}");
        return ExitCode::FAILURE;
    };
    // SAFETY: the descriptor the parent left open for us.
    let pool = match SharedPool::attach_fd(unsafe { OwnedFd::from_raw_fd(fd) }) {
        Ok(pool) => pool,
        Err(e) => {
            println!("child: attach: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("child census: {}", census(&pool, node));
    let Some(handle) = pool.allocate_handle(Layout::from_size_align(MIB, 4096).unwrap()) else {
        println!("child: no block");
        return ExitCode::FAILURE;
    };
    if let Some(ptr) = pool.ptr(handle) {
        // SAFETY: our block, just carved.
        unsafe { ptr.as_ptr().write_bytes(0x5a, MIB) };
    }
    let bytes: Vec<String> = handle.to_bytes().iter().map(u8::to_string).collect();
    println!("child handle: {}", bytes.join(" "));
    ExitCode::SUCCESS
}

fn check_node(report: &mut Report, node: usize) {
    let pool = match SharedPool::builder(POOL)
        .node(node)
        .chunk(2 * MIB)
        .populate_threads(1)
        // The second process gets the pool's descriptor across exec.
        .inherit(true)
        .create()
    {
        Ok(pool) => pool,
        Err(e) => {
            report.check(
                &format!("node{node}.create"),
                false,
                || "Ok".into(),
                e.to_string(),
            );
            return;
        }
    };
    report.check(
        &format!("node{node}.create"),
        true,
        String::new,
        String::new(),
    );
    let pages = (POOL - BLOCKS as usize) / sys::page_size();
    let all = format!("{pages} of {pages} pages on node {node}");
    let (ptr, len) = blocks(&pool);
    report.on_node(&format!("node{node}.creator_pages"), ptr, len, node);
    let spawned = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_VAR, format!("{},{node}", pool.fd().as_raw_fd()))
        .stdout(Stdio::piped())
        .spawn();
    let Ok(mut second) = spawned else {
        report.check(
            &format!("node{node}.second_process"),
            false,
            || "started".into(),
            "not".into(),
        );
        return;
    };
    let (mut seen, mut handle) = (String::from("nothing"), None);
    for line in BufReader::new(second.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        eprintln!("guest_shared node {node}: {line}");
        if let Some(c) = line.strip_prefix("child census: ") {
            seen = c.to_owned();
        } else if let Some(h) = line.strip_prefix("child handle: ") {
            let bytes: Vec<u8> = h
                .split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect();
            handle = bytes.try_into().ok().map(PoolHandle::from_bytes);
        }
    }
    let ok = second.wait().is_ok_and(|s| s.success());
    report.eq(&format!("node{node}.second_process"), true, ok);
    report.eq(&format!("node{node}.attached_pages"), all, seen);
    let read = handle
        .filter(|&h| pool.is_live(h) == Ok(true))
        .and_then(|h| {
            let ptr = pool.ptr(h)?;
            // SAFETY: a live block of the pool, no longer written by its (exited) maker.
            let bytes = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), MIB) };
            Some(bytes.iter().all(|&b| b == 0x5a))
        });
    report.eq(
        &format!("node{node}.block_from_other_process"),
        Some(true),
        read,
    );
    if let Some(h) = handle {
        // SAFETY: the other process has read the block and exited; nothing uses it any more.
        let freed = unsafe { pool.free(h) }.is_ok();
        report.eq(&format!("node{node}.freed_by_creator"), true, freed);
    }
    report.eq(
        &format!("node{node}.live_after"),
        0,
        pool.stats().live_blocks,
    );
}

fn main() -> ExitCode {
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        return child(&spec);
    }
    let mut args = std::env::args().skip(1);
    let nodes: Vec<usize> = match (args.next().as_deref(), args.next()) {
        (Some("--nodes"), Some(list)) => list.split(',').filter_map(|n| n.parse().ok()).collect(),
        _ => {
            eprintln!("usage: guest_shared --nodes N[,N...]");
            return ExitCode::from(2);
        }
    };
    let mut report = Report::new("shared");
    for node in nodes {
        check_node(&mut report, node);
    }
    report.finish()
}
