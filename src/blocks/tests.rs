//! The chunk seam with a test double: chunks come from the process's [`ChunkSource`], go back to
//! it whole, and have their idle ranges purged through it; a source that cannot map fails the
//! request cleanly, counted, and loses nothing.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

use super::{Blocks, Resolved};
use crate::alloc::tests::serial;
use crate::chunk::{ChunkSource, ANONYMOUS};
use crate::config::{Config, PinMode};
use crate::process::LargePath;
use crate::sys::resident_sample;
use crate::sys::NodeMask;
use crate::{Error, NumaTopology};

/// Anonymous memory, counted, whose mapping can be made to fail.
#[derive(Debug)]
struct CountingSource {
    maps: AtomicUsize,
    unmaps: AtomicUsize,
    purges: AtomicUsize,
    /// Bytes mapped and not given back.
    mapped: AtomicUsize,
    refuse: AtomicBool,
}

impl CountingSource {
    const fn new() -> CountingSource {
        CountingSource {
            maps: AtomicUsize::new(0),
            unmaps: AtomicUsize::new(0),
            purges: AtomicUsize::new(0),
            mapped: AtomicUsize::new(0),
            refuse: AtomicBool::new(false),
        }
    }
}

// SAFETY: every range comes from the anonymous source, whose contract it forwards.
unsafe impl ChunkSource for CountingSource {
    fn map(&self, len: usize, align: usize) -> Result<NonNull<u8>, Error> {
        if self.refuse.load(Relaxed) {
            return Err(Error::Syscall {
                call: "mmap",
                errno: libc::ENOMEM,
            });
        }
        let ptr = ANONYMOUS.map(len, align)?;
        self.maps.fetch_add(1, Relaxed);
        self.mapped.fetch_add(len, Relaxed);
        Ok(ptr)
    }

    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) -> Result<(), Error> {
        self.unmaps.fetch_add(1, Relaxed);
        self.mapped.fetch_sub(len, Relaxed);
        // SAFETY: forwarded from the caller; the range is the anonymous source's.
        unsafe { ANONYMOUS.unmap(ptr, len) }
    }

    unsafe fn purge(&self, ptr: NonNull<u8>, len: usize) -> Result<(), Error> {
        self.purges.fetch_add(1, Relaxed);
        // SAFETY: forwarded from the caller.
        unsafe { ANONYMOUS.purge(ptr, len) }
    }
}

/// The addresses of the large paths the tests leaked.
static LARGE_PATHS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

/// A value's large path on node 0 with chunks from `source`: unpinned, no decay (so that only
/// `trim` gives back), no decay thread.
fn blocks(source: &'static CountingSource) -> (Blocks, Resolved) {
    blocks_with(source, Config::DEFAULT)
}

/// [`blocks`] over `config`.
fn blocks_with(source: &'static CountingSource, config: Config) -> (Blocks, Resolved) {
    let config = Config {
        pin: PinMode::Off,
        decay_ms: u64::MAX,
        decay_thread: false,
        ..config
    };
    let process = Box::leak(Box::new(LargePath::new(
        NumaTopology::single_node(),
        false,
        source,
    )));
    // Leaked as the process leaks its own, and kept reachable so a leak checker does not
    // count it lost.
    LARGE_PATHS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(std::ptr::from_ref(process) as usize);
    let blocks = Blocks::new(config, None, process);
    let mut nodes = NodeMask::empty();
    let _ = nodes.insert(0);
    let target = Resolved {
        host_node: 0,
        nodes,
        gpu: None,
        ordinal: None,
        unpinnable: None,
    };
    (blocks, target)
}

const MIB: usize = 1 << 20;

#[test]
fn chunks_come_from_the_source_and_go_back_to_it() {
    static SOURCE: CountingSource = CountingSource::new();
    let _serial = serial();
    let (blocks, target) = blocks(&SOURCE);
    let layout = Layout::from_size_align(4 * MIB, 4096).unwrap();
    let a = blocks
        .allocate(layout, false, false, &target)
        .expect("a carved block");
    let b = blocks
        .allocate(layout, false, false, &target)
        .expect("a second one");
    assert_eq!(SOURCE.maps.load(Relaxed), 1, "one chunk, from the source");
    // SAFETY: the blocks are ours, 4 MiB each.
    unsafe {
        a.as_ptr().write_bytes(1, layout.size());
        b.as_ptr().write_bytes(2, layout.size());
    }
    assert!(blocks.free(a.as_ptr() as usize, 0));
    blocks.trim();
    assert!(
        SOURCE.purges.load(Relaxed) >= 1,
        "the idle range of a chunk still in use is purged through its source"
    );
    assert_eq!(
        SOURCE.unmaps.load(Relaxed),
        0,
        "the chunk holds a live block"
    );
    assert!(blocks.free(b.as_ptr() as usize, 0));
    blocks.trim();
    assert_eq!(
        SOURCE.unmaps.load(Relaxed),
        1,
        "the wholly free chunk goes back to it"
    );
    assert_eq!(SOURCE.mapped.load(Relaxed), 0, "whole");
    assert_eq!(blocks.counters.released_blocks.get(), 1);
}

#[test]
fn a_source_that_cannot_map_fails_the_request_and_loses_nothing() {
    static SOURCE: CountingSource = CountingSource::new();
    let _serial = serial();
    let (blocks, target) = blocks(&SOURCE);
    let layout = Layout::from_size_align(2 * MIB, 4096).unwrap();
    SOURCE.refuse.store(true, Relaxed);
    assert!(blocks.allocate(layout, false, false, &target).is_none());
    assert_eq!(blocks.counters.failed_allocations.get(), 1);
    assert_eq!(
        blocks.counters.map_failures.get(),
        1,
        "counted once per request"
    );
    assert_eq!(SOURCE.maps.load(Relaxed), 0);
    SOURCE.refuse.store(false, Relaxed);
    let block = blocks
        .allocate(layout, true, false, &target)
        .expect("mapped again");
    // SAFETY: ours, 2 MiB, asked zeroed.
    let bytes = unsafe { std::slice::from_raw_parts(block.as_ptr(), layout.size()) };
    assert!(bytes.iter().all(|&b| b == 0));
    assert!(blocks.free(block.as_ptr() as usize, 0));
    blocks.trim();
    assert_eq!(SOURCE.mapped.load(Relaxed), 0, "given back whole");
}

/// Of 8 pages spread over the `len` bytes at `ptr`, how many are resident.
fn resident(ptr: NonNull<u8>, len: usize) -> usize {
    resident_sample(ptr, len, 8).expect("mapped").0
}

#[test]
fn a_block_not_asked_zeroed_is_populated_and_a_zeroed_one_is_faulted_where_touched() {
    static SOURCE: CountingSource = CountingSource::new();
    let _serial = serial();
    let (blocks, target) = blocks(&SOURCE);
    assert!(!blocks.populates(), "the default: lazy blocks");
    let layout = Layout::from_size_align(8 * MIB, 4096).unwrap();
    let written = blocks.allocate(layout, false, false, &target).unwrap();
    assert_eq!(resident(written, layout.size()), 8, "populated in bulk");
    let zeroed = blocks.allocate(layout, true, false, &target).unwrap();
    assert_eq!(
        resident(zeroed, layout.size()),
        0,
        "faulted in where touched"
    );
    // Past the dedicated size: a mapping of its own, the same rule.
    let big = Layout::from_size_align(80 * MIB, 4096).unwrap();
    let written_big = blocks.allocate(big, false, false, &target).unwrap();
    assert_eq!(resident(written_big, big.size()), 8);
    let zeroed_big = blocks.allocate(big, true, false, &target).unwrap();
    assert_eq!(resident(zeroed_big, big.size()), 0);
    for block in [written, zeroed, written_big, zeroed_big] {
        assert!(blocks.free(block.as_ptr() as usize, 0));
    }
    blocks.trim();
}

#[test]
fn a_zeroed_reuse_writes_over_what_its_last_user_wrote_and_drops_what_it_left() {
    static SOURCE: CountingSource = CountingSource::new();
    let _serial = serial();
    let (blocks, target) = blocks(&SOURCE);
    let layout = Layout::from_size_align(8 * MIB, 4096).unwrap();
    let len = layout.size();
    let zeroed_again = |ptr: NonNull<u8>| {
        assert!(blocks.free(ptr.as_ptr() as usize, 0));
        let again = blocks.allocate(layout, true, false, &target).unwrap();
        assert_eq!(again, ptr, "the same range, carved again");
        again
    };
    // Read after residency is looked at: reading maps the zero page, which `mincore` counts.
    let all_zero = |ptr: NonNull<u8>| {
        // SAFETY: ours, `len` bytes, asked zeroed.
        let bytes = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
        assert!(bytes.iter().all(|&b| b == 0), "zeroed");
    };
    // Written whole, then asked zeroed: the pages stay, written over.
    let whole = blocks.allocate(layout, false, false, &target).unwrap();
    // SAFETY: ours, `len` bytes.
    unsafe { whole.as_ptr().write_bytes(7, len) };
    let purges = SOURCE.purges.load(Relaxed);
    let again = zeroed_again(whole);
    assert_eq!(SOURCE.purges.load(Relaxed), purges, "nothing given back");
    assert_eq!(resident(again, len), 8);
    all_zero(again);
    assert!(blocks.free(again.as_ptr() as usize, 0));
    blocks.trim();
    // Zeroed and barely touched, then asked zeroed again: the pages go back.
    let barely = blocks.allocate(layout, true, false, &target).unwrap();
    // SAFETY: inside the block.
    unsafe { barely.as_ptr().add(len / 2).write(7) };
    let purges = SOURCE.purges.load(Relaxed);
    let again = zeroed_again(barely);
    assert_eq!(SOURCE.purges.load(Relaxed), purges + 1, "given back");
    assert!(resident(again, len) <= 1, "the edges' huge pages at most");
    all_zero(again);
    assert!(blocks.free(again.as_ptr() as usize, 0));
    blocks.trim();
}

/// Under `bulk_max=0` (the preload library's default) a request not asked zeroed, carved or with
/// a mapping of its own, is handed out lazily until blocks of its size were seen written whole,
/// then populated in bulk; a carved one handed out lazily takes small pages, so that a byte
/// written makes a page resident, not a huge one.
#[test]
fn under_bulk_max_0_a_block_is_populated_once_blocks_of_its_size_were_written_whole() {
    static SOURCE: CountingSource = CountingSource::new();
    let _serial = serial();
    let config = Config {
        bulk_max: 0,
        ..Config::DEFAULT
    };
    let (blocks, target) = blocks_with(&SOURCE, config);
    for size in [8 * MIB, 80 * MIB] {
        super::written::LEARNT.reset(size);
        let layout = Layout::from_size_align(size, 4096).unwrap();
        let first = blocks.allocate(layout, false, false, &target).unwrap();
        // SAFETY: ours, `size` bytes.
        unsafe { first.as_ptr().write(1) };
        assert_eq!(resident(first, size), 0, "{size}: lazily, a page touched");
        assert!(blocks.free(first.as_ptr() as usize, 0));
        let second = blocks.allocate(layout, false, false, &target).unwrap();
        assert_eq!(
            resident(second, size),
            0,
            "{size}: barely touched, still lazily"
        );
        // SAFETY: ours, `size` bytes.
        unsafe { second.as_ptr().write_bytes(2, size) };
        assert!(blocks.free(second.as_ptr() as usize, 0));
        let third = blocks.allocate(layout, false, false, &target).unwrap();
        assert_eq!(
            resident(third, size),
            8,
            "{size}: written whole, then in bulk"
        );
        assert!(blocks.free(third.as_ptr() as usize, 0));
    }
    blocks.trim();
}
