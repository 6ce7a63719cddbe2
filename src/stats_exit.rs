//! `NUMA_GPU_ALLOC=stats=exit` (or `stats=json`): each allocator's stats on stderr when the
//! process exits, as `MIMALLOC_SHOW_STATS` does.
//!
//! An allocator registers when it initialises; the first registration installs a `libc::atexit`
//! handler. Other threads may still be allocating when it runs, or hold the arena lock, and the
//! exiting thread may itself have been inside the allocator, so the handler:
//! - allocates nothing: it refreshes, in place, a snapshot built at registration (node rows, GPU
//!   name and setup errors already there, room for every error code and for heap and GPU rows), formats into a buffer on
//!   its stack and writes that to fd 2 with `write(2)` (no stderr lock). It runs marked as inside
//!   the allocator, so anything below it that does allocate (an errno's text) gets the inner
//!   allocator, never our arena;
//! - never blocks on the arenas: it tries each lock for a bounded time, then prints the counters
//!   without the node rows and says so (the counters' one lock, the last pin error's, is held
//!   only to copy that error);
//! - prints each report once, however often `exit` runs.
//!
//! Only allocators that live in a static (the `#[global_allocator]`, any `static`) are reported:
//! the handler reads them after `main` has returned, and only a static is sure to be neither moved
//! nor dropped by then. `dladdr` tells whether the allocator lies in a loaded object's image.
//!
//! The raw calls (`atexit`, `write`, `dladdr`) are in [`crate::sys`].
//!
//! Unsafe code here relies on the exit handler reading reports leaked at registration, which
//! nothing else touches once published.
#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::fmt::{self, Write};
use std::io::Write as _;
use std::ptr;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicPtr;
use std::sync::atomic::Ordering::{AcqRel, Acquire};
use std::time::Duration;

use crate::config::StatsAtExit;
use crate::guard::Inside;
use crate::process::NODES;
use crate::runtime::Runtime;
use crate::stats::{Stats, ERROR_CODE_SLOTS};
use crate::sys;

/// One allocator to report on at exit.
struct Report {
    runtime: &'static Runtime,
    format: StatsAtExit,
    /// Built at registration, refreshed and printed by the handler, which alone touches it.
    stats: UnsafeCell<Stats>,
    /// The report registered before this one.
    next: *const Report,
}

/// Registered reports, newest first. Pushed with compare-exchange, never removed or freed.
static REPORTS: AtomicPtr<Report> = AtomicPtr::new(ptr::null_mut());
/// Set once the atexit handler is installed.
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// Set by the handler's first run.
static PRINTED: AtomicBool = AtomicBool::new(false);

/// Heap rows and GPU rows the report at exit has room for (beyond those at registration).
const EXIT_ROWS: usize = 64;

/// How often, a millisecond apart, the handler tries the arena lock before giving up on node rows.
const ARENA_TRIES: u32 = 100;

/// Registers `rt` for a report at exit when its settings ask for one; `owner_in_image`: whether
/// the allocator that boxed it lies in the image of a loaded object (the executable or a shared
/// library), that is in a static, never moved or dropped — so neither is the runtime (freed only
/// by the allocator's `Drop`). Called once per allocator, right after initialisation, inside the
/// allocator (so its own allocations go to the inner allocator).
pub(crate) fn register(rt: &Runtime, owner_in_image: bool) {
    if rt.config.stats_at_exit == StatsAtExit::Off {
        return;
    }
    let Some(runtime) = as_static(rt, owner_in_image) else {
        note("stats at exit are printed for allocators in a static only; read stats() instead");
        return;
    };
    let mut stats = runtime.stats();
    stats.pin_failures_by_code.reserve(ERROR_CODE_SLOTS);
    // Room for the rows refreshed at exit, which allocates nothing (see `fill_nodes`).
    stats.heaps.reserve(EXIT_ROWS);
    stats.gpus.reserve(EXIT_ROWS);
    let report = Box::into_raw(Box::new(Report {
        runtime,
        format: runtime.config.stats_at_exit,
        stats: UnsafeCell::new(stats),
        next: ptr::null(),
    }));
    let mut head = REPORTS.load(Acquire);
    loop {
        // SAFETY: `report` came from `Box::into_raw` above and is not shared until the exchange
        // below publishes it.
        unsafe { (*report).next = head };
        match REPORTS.compare_exchange_weak(head, report, AcqRel, Acquire) {
            Ok(_) => break,
            Err(current) => head = current,
        }
    }
    if !INSTALLED.swap(true, AcqRel) && sys::at_exit(print_reports).is_err() {
        note("stats at exit: atexit refused the handler; nothing will be printed");
    }
}

/// `rt` as `'static` when its allocator lies in a static (see [`register`]).
pub(crate) fn as_static(rt: &Runtime, in_image: bool) -> Option<&'static Runtime> {
    let rt: *const Runtime = rt;
    // SAFETY: a static lives until the process exits, or until its library is unloaded, which
    // first runs that library's atexit handlers (the only reader of the reference); its runtime
    // lives as long.
    in_image.then(|| unsafe { &*rt })
}

/// One line on stderr at registration time (allocating is fine there).
fn note(text: &str) {
    let _ = writeln!(std::io::stderr(), "numa-gpu-alloc: {text}");
}

/// The atexit handler: prints every registered report, once.
extern "C" fn print_reports() {
    if PRINTED.swap(true, AcqRel) {
        return;
    }
    // `None` when this thread was already inside the allocator: the flag is set either way.
    let _inside = Inside::enter();
    let mut out = Fd2::default();
    let mut next = REPORTS.load(Acquire).cast_const();
    while !next.is_null() {
        // SAFETY: reports are leaked at registration, never freed, and published complete by
        // the release exchange that `Acquire` above pairs with.
        let report = unsafe { &*next };
        // SAFETY: only this handler touches the snapshot, and it runs once (`PRINTED`).
        let stats = unsafe { &mut *report.stats.get() };
        // A failed write to stderr leaves nothing better to do.
        let _ = write_report(report.runtime, report.format, stats, &mut out);
        next = report.next;
    }
    out.flush();
}

/// Refreshes `stats` from `rt` without allocating or blocking, then writes it in `format`.
fn write_report(
    rt: &Runtime,
    format: StatsAtExit,
    stats: &mut Stats,
    out: &mut dyn Write,
) -> fmt::Result {
    rt.blocks.stats().fill_counters(stats);
    stats.page_locked_bytes = crate::chunk::page_locked_bytes();
    if stats.numa_unavailable.is_none() {
        // Set after initialisation only by a refused `mbind`: `NumaUnavailable`, no heap data.
        stats.numa_unavailable = rt.blocks.mbind_refusal();
    }
    if stats.pinning && !rt.pinning() {
        // A child forked since registration: its blocks are not page-locked (no heap data).
        stats.pinning = false;
        stats.pinning_off = rt.pinning_off();
    }
    let nodes_fresh = fill_nodes(stats);
    if format == StatsAtExit::Json {
        writeln!(out, "{}", stats.json())?;
    } else {
        write!(out, "{stats}")?;
    }
    if !nodes_fresh {
        writeln!(
            out,
            "numa-gpu-alloc: an arena stayed busy at exit; node rows left out"
        )?;
    }
    Ok(())
}

/// Refreshes the node, heap and GPU rows under each node's arena lock, if each can be had
/// within [`ARENA_TRIES`] milliseconds (rows beyond the room reserved at registration are left
/// out: nothing is allocated); otherwise empties them (without freeing) and returns `false`.
fn fill_nodes(stats: &mut Stats) -> bool {
    stats.heaps.clear();
    stats.gpus.clear();
    for row in &mut stats.nodes {
        let Some(arena) = NODES.existing(row.node) else {
            continue;
        };
        let Some(locked) = (0..ARENA_TRIES).find_map(|_| {
            arena.try_lock().or_else(|| {
                std::thread::sleep(Duration::from_millis(1));
                None
            })
        }) else {
            stats.nodes.clear();
            stats.heaps.clear();
            stats.gpus.clear();
            return false;
        };
        locked.fill(row);
        let room = stats.heaps.capacity() - stats.heaps.len();
        stats.heaps.extend(locked.heap_rows().take(room));
        let room = stats.gpus.capacity() - stats.gpus.len();
        stats.gpus.extend(locked.gpus().iter().take(room).cloned());
    }
    true
}

/// Text for fd 2, gathered in a buffer on the stack and written with `write(2)`.
struct Fd2 {
    buf: [u8; 8192],
    len: usize,
}

impl Default for Fd2 {
    fn default() -> Self {
        Fd2 {
            buf: [0; 8192],
            len: 0,
        }
    }
}

impl Fd2 {
    fn flush(&mut self) {
        sys::write_stderr(&self.buf[..self.len]);
        self.len = 0;
    }
}

impl Write for Fd2 {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let mut text = text.as_bytes();
        while !text.is_empty() {
            if self.len == self.buf.len() {
                self.flush();
            }
            let n = text.len().min(self.buf.len() - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&text[..n]);
            self.len += n;
            text = &text[n..];
        }
        Ok(())
    }
}
