//! The churn workloads: what a child process runs, at the full or the `--quick` scale.
//!
//! Every buffer of (a)–(d) and (g)–(i) is written, so that its pages are really touched: every
//! byte (`vec![byte; n]` is a `memset`, `extend_from_slice` a `memcpy`, `read()` the kernel's
//! copy), or in (c) one byte per 4 KiB page; (j) is (i) over a buffer asked for zeroed. (e) and
//! (f) are the zeroed, barely touched shapes of public allocator benchmarks: `vec![0u8; n]` is
//! `alloc_zeroed`, and one byte of each buffer is written. (g) asks for zeroed buffers and then
//! writes them whole (a buffer cleared before it is filled, as `vec![0; n]` followed by a fill or
//! a read): the allocator cannot tell it from (e) by the request alone. (k) is the other way
//! round: not asked zeroed, yet barely touched (a sort buffer sized for the worst case).

use std::collections::VecDeque;
use std::hint::black_box;
use std::mem::MaybeUninit;

use super::measure::splitmix64;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const PAGE: usize = 4 * KIB;

/// How much each workload does.
pub struct Scale {
    /// (a): batches of 24 buffers per producer.
    batches: usize,
    /// (b): buffers allocated and filled.
    ring_steps: usize,
    /// (c): free-one/allocate-one rounds.
    pool_rounds: usize,
    /// (d): times the vector is grown to 256 MiB.
    growths: usize,
    /// (e): zeroed buffers of 5-25 MiB allocated into the 20 slots.
    large_zeroed: usize,
    /// (f): zeroed 1 GiB buffers, one live at a time.
    gib_zeroed: usize,
    /// (h): phases of the mixed program.
    phases: usize,
    /// (i): bytes of the file read.
    read_bytes: usize,
    /// (k): bytes of each sort buffer, and how many.
    sort_bytes: usize,
    sort_buffers: usize,
}

pub const FULL: Scale = Scale {
    batches: 6,
    ring_steps: 1200,
    pool_rounds: 20_000,
    growths: 6,
    large_zeroed: 2000,
    gib_zeroed: 200,
    phases: 10,
    read_bytes: GIB,
    sort_bytes: GIB,
    sort_buffers: 10,
};
pub const QUICK: Scale = Scale {
    batches: 1,
    ring_steps: 150,
    pool_rounds: 2_000,
    growths: 2,
    large_zeroed: 200,
    gib_zeroed: 4,
    phases: 2,
    read_bytes: 64 * MIB,
    sort_bytes: 512 * MIB,
    sort_buffers: 2,
};

pub struct Workload {
    pub key: &'static str,
    /// What it does; `{n}` stands for [`Self::count`].
    pub title: &'static str,
    pub count: fn(&Scale) -> usize,
    pub run: fn(&Scale) -> u64,
    /// What the driver makes before the workload's children run (the file (i) reads).
    pub prepare: Option<fn(&Scale) -> std::io::Result<()>>,
    /// Ours/mimalloc wall time over mimalloc's.
    pub wall_target: f64,
    /// Ours/mimalloc peak RSS over mimalloc's.
    pub rss_target: Option<f64>,
    /// Ours/mimalloc wall time over jemalloc's.
    pub jemalloc_wall_target: Option<f64>,
    /// Ours/glibc wall time over glibc's.
    pub glibc_wall_target: Option<f64>,
}

pub const WORKLOADS: [Workload; 11] = [
    Workload {
        key: "a",
        title:
            "(a) 3 producer threads -> bounded channel -> 1 consumer: {n} batches of 24 Vec<u8> \
                of 1-48 MiB per producer, filled, dropped by the consumer",
        count: |s| s.batches,
        run: producers_consumer,
        prepare: None,
        wall_target: 1.0,
        rss_target: Some(1.0),
        jemalloc_wall_target: None,
        glibc_wall_target: GLIBC,
    },
    Workload {
        key: "b",
        title: "(b) 1 thread, a ring of 8 live Vec<u8> cycling through 3, 4, ..., 15 MiB: {n} \
                allocated and filled",
        count: |s| s.ring_steps,
        run: ring,
        prepare: None,
        wall_target: 1.0,
        rss_target: Some(1.0),
        jemalloc_wall_target: None,
        glibc_wall_target: GLIBC,
    },
    Workload {
        key: "c",
        title: "(c) a pool of 512 x 2 MiB blocks, then {n} rounds of free one at random / \
                allocate one (one byte written per 4 KiB page)",
        count: |s| s.pool_rounds,
        run: pool,
        prepare: None,
        wall_target: 0.95,
        rss_target: None,
        jemalloc_wall_target: None,
        glibc_wall_target: GLIBC,
    },
    Workload {
        key: "d",
        title: "(d) a Vec<u8> grown to 256 MiB by extend_from_slice of 64 KiB chunks (realloc), \
                dropped; {n} times",
        count: |s| s.growths,
        run: growth,
        prepare: None,
        wall_target: 0.6,
        rss_target: None,
        jemalloc_wall_target: None,
        glibc_wall_target: GLIBC,
    },
    Workload {
        key: "e",
        title: "(e) 20 slots, {n} zeroed Vec<u8> (vec![0u8; n]) of 5-25 MiB each put into a \
                random slot, dropping the one there; one byte written per buffer",
        count: |s| s.large_zeroed,
        run: large_zeroed,
        prepare: None,
        wall_target: 1.0,
        rss_target: None,
        jemalloc_wall_target: Some(10.0),
        glibc_wall_target: None,
    },
    Workload {
        key: "f",
        title: "(f) {n} zeroed Vec<u8> of 1 GiB (vec![0u8; n]), one live at a time; one byte \
                written per buffer",
        count: |s| s.gib_zeroed,
        run: gib_zeroed,
        prepare: None,
        wall_target: 1.0,
        rss_target: None,
        jemalloc_wall_target: Some(10.0),
        glibc_wall_target: None,
    },
    Workload {
        key: "g",
        title:
            "(g) as (b), but each buffer asked for zeroed (vec![0u8; n]) and then written whole: \
                {n} allocated, filled",
        count: |s| s.ring_steps,
        run: ring_zeroed,
        prepare: None,
        wall_target: 1.0,
        rss_target: Some(1.0),
        jemalloc_wall_target: None,
        glibc_wall_target: GLIBC,
    },
    Workload {
        key: "h",
        title: "(h) a mixed program: {n} phases, each a large buffer of 64-144 MiB held while 16 \
                or 17 of 2-24 MiB are filled and dropped and small objects are built (178 large \
                requests at full scale), all written whole",
        count: |s| s.phases,
        run: mixed,
        prepare: None,
        wall_target: 1.0,
        rss_target: Some(1.0),
        jemalloc_wall_target: None,
        glibc_wall_target: GLIBC,
    },
    Workload {
        key: "i",
        title: "(i) one read() of a {n} MiB file (in the page cache) into a new Vec<u8>",
        count: |s| s.read_bytes / MIB,
        run: read_file,
        prepare: Some(make_file),
        wall_target: 1.0,
        rss_target: Some(1.0),
        jemalloc_wall_target: None,
        glibc_wall_target: Some(1.1),
    },
    Workload {
        key: "j",
        title: "(j) as (i), into a new Vec<u8> asked for zeroed (vec![0u8; n]): one read() of a \
                {n} MiB file over it",
        count: |s| s.read_bytes / MIB,
        run: read_file_zeroed,
        prepare: Some(make_file),
        wall_target: 1.0,
        rss_target: Some(1.0),
        jemalloc_wall_target: None,
        glibc_wall_target: Some(1.1),
    },
    Workload {
        key: "k",
        title: "(k) {n} sort buffers, one live at a time: a Vec<u8> with a capacity of 1 GiB \
                (512 MiB quick) of which 8 MiB are written (`sort -S 1G` on a small input)",
        count: |s| s.sort_buffers,
        run: sort_buffers,
        prepare: None,
        wall_target: 1.0,
        rss_target: Some(1.0),
        jemalloc_wall_target: None,
        glibc_wall_target: Some(1.1),
    },
];

/// Ours/glibc wall time over glibc's on the written workloads. The zeroed ones have none: glibc's
/// `calloc` of a fresh mapping does nothing, and ours is held to mimalloc and jemalloc there.
const GLIBC: Option<f64> = Some(0.8);

/// (a) Three producers send filled buffers of random sizes to a consumer that drops them.
fn producers_consumer(scale: &Scale) -> u64 {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(4);
    let consumer = std::thread::spawn(move || rx.iter().map(|b| u64::from(b[b.len() - 1])).sum());
    let producers: Vec<_> = (0..3u64)
        .map(|thread| {
            let tx = tx.clone();
            let batches = scale.batches;
            std::thread::spawn(move || {
                let mut state = 0x5eed_0000 + thread;
                for batch in 0..batches {
                    for _ in 0..24 {
                        let len = MIB + (splitmix64(&mut state) % (47 * MIB as u64 + 1)) as usize;
                        let buf = vec![(batch as u8) | 1; len];
                        tx.send(black_box(buf)).expect("the consumer hung up");
                    }
                }
            })
        })
        .collect();
    drop(tx);
    producers
        .into_iter()
        .for_each(|p| p.join().expect("producer"));
    consumer.join().expect("consumer")
}

/// (b) Drops the oldest of 8 live buffers, then allocates and fills the next size.
fn ring(scale: &Scale) -> u64 {
    let mut live: VecDeque<Vec<u8>> = VecDeque::with_capacity(8);
    let mut sum = 0u64;
    for step in 0..scale.ring_steps {
        if live.len() == 8 {
            sum += live.pop_front().map_or(0, |b| u64::from(b[b.len() / 2]));
        }
        live.push_back(black_box(vec![(step as u8) | 1; (3 + step % 13) * MIB]));
    }
    sum
}

/// (g) As [`ring`], each buffer zeroed when asked for and then written whole.
fn ring_zeroed(scale: &Scale) -> u64 {
    let mut live: VecDeque<Vec<u8>> = VecDeque::with_capacity(8);
    let mut sum = 0u64;
    for step in 0..scale.ring_steps {
        if live.len() == 8 {
            sum += live.pop_front().map_or(0, |b| u64::from(b[b.len() / 2]));
        }
        let mut buf = black_box(vec![0u8; (3 + step % 13) * MIB]);
        buf.fill((step as u8) | 1);
        live.push_back(black_box(buf));
    }
    sum
}

/// The large buffers of (h)'s phases, MiB: sizes a program's stages might hold, no two phases in
/// a row alike.
const PHASE_MIB: [usize; 10] = [64, 96, 72, 128, 80, 112, 64, 144, 88, 100];

/// (h) Phases of a program: each holds one large buffer while it fills and drops medium ones and
/// builds small objects (a map of strings), then drops it.
fn mixed(scale: &Scale) -> u64 {
    let mut state = 0x313d;
    let mut sum = 0u64;
    for phase in 0..scale.phases {
        let big = black_box(vec![
            (phase as u8) | 1;
            PHASE_MIB[phase % PHASE_MIB.len()] * MIB
        ]);
        let mediums = if phase < 8 { 17 } else { 16 };
        for i in 0..mediums {
            let len = 2 * MIB + (splitmix64(&mut state) % (22 * MIB as u64 + 1)) as usize;
            let buf = black_box(vec![(i as u8) | 1; len]);
            sum += u64::from(buf[len - 1]);
            let words: std::collections::HashMap<String, u64> = (0..2_000u64)
                .map(|k| (format!("{phase}-{i}-{k}"), splitmix64(&mut state)))
                .collect();
            sum += words.len() as u64;
        }
        sum += u64::from(big[big.len() / 2]);
    }
    sum
}

/// The file (i) reads, of `len` bytes.
fn file_path(len: usize) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("churn-bench-read-{}-mib", len / MIB))
}

/// Writes (i)'s file unless it is there, and reads it once so that it is in the page cache.
fn make_file(scale: &Scale) -> std::io::Result<()> {
    let path = file_path(scale.read_bytes);
    if std::fs::metadata(&path).map(|m| m.len()).ok() != Some(scale.read_bytes as u64) {
        let chunk: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
        let mut file = std::fs::File::create(&path)?;
        for _ in 0..scale.read_bytes / MIB {
            std::io::Write::write_all(&mut file, &chunk)?;
        }
    }
    std::io::copy(&mut std::fs::File::open(&path)?, &mut std::io::sink()).map(|_| ())
}

/// (i) Reads the whole file into a new buffer with one `read()` (the kernel's copy faults the
/// buffer's pages in), as a loader does.
fn read_file(scale: &Scale) -> u64 {
    use std::os::fd::AsRawFd;
    let len = scale.read_bytes;
    let file = std::fs::File::open(file_path(len)).expect("the driver made the file");
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    // SAFETY: `buf` has room for `len` bytes; the file is open.
    let got = unsafe { libc::read(file.as_raw_fd(), buf.as_mut_ptr().cast(), len) };
    assert_eq!(got, len as isize, "one read() of the whole file");
    // SAFETY: `read` wrote `len` bytes.
    unsafe { buf.set_len(len) };
    u64::from(black_box(&buf)[len / 2])
}

/// (j) Reads the whole file with one `read()` over a buffer asked for zeroed (a buffer cleared
/// before it is filled): the allocator leaves such a buffer's fresh pages to be faulted in where
/// touched, here inside the kernel's copy.
fn read_file_zeroed(scale: &Scale) -> u64 {
    use std::io::Read;
    let len = scale.read_bytes;
    let mut file = std::fs::File::open(file_path(len)).expect("the driver made the file");
    let mut buf = black_box(vec![0u8; len]);
    // `File::read` of a regular file is one `read()`.
    let got = file.read(&mut buf).expect("read");
    assert_eq!(got, len, "one read() of the whole file");
    u64::from(black_box(&buf)[len / 2])
}

/// (k) Buffers of `sort_bytes` capacity, not asked zeroed, of which only the first 8 MiB are
/// written: a request not asked zeroed that its user barely touches.
fn sort_buffers(scale: &Scale) -> u64 {
    let mut sum = 0u64;
    for i in 0..scale.sort_buffers {
        let mut buf: Vec<u8> = Vec::with_capacity(scale.sort_bytes);
        buf.resize(8 * MIB, i as u8);
        sum += u64::from(black_box(&buf)[4 * MIB]);
    }
    sum
}

/// A block of `len` bytes with one byte written per page.
fn touched(len: usize, byte: u8) -> Box<[MaybeUninit<u8>]> {
    let mut block = Box::<[u8]>::new_uninit_slice(len);
    for page in (0..len).step_by(PAGE) {
        block[page].write(byte);
    }
    black_box(block.as_mut_ptr()); // the writes are kept
    block
}

/// (c) Frees a random block of the pool and allocates one in its place.
fn pool(scale: &Scale) -> u64 {
    let mut state = 0x9001;
    let mut pool: Vec<Option<Box<[MaybeUninit<u8>]>>> =
        (0..512).map(|_| Some(touched(2 * MIB, 1))).collect();
    for round in 0..scale.pool_rounds {
        let index = (splitmix64(&mut state) % 512) as usize;
        pool[index] = None;
        pool[index] = Some(touched(2 * MIB, (round as u8) | 1));
    }
    pool.iter().flatten().count() as u64
}

/// (d) Grows a vector by appending chunks (std's `extend_from_slice`: `memcpy`, growth by
/// doubling through `realloc`).
fn growth(scale: &Scale) -> u64 {
    let chunk = vec![7u8; 64 * KIB];
    let mut sum = 0u64;
    for _ in 0..scale.growths {
        let mut vec = Vec::new();
        while vec.len() < 256 * MIB {
            vec.extend_from_slice(black_box(&chunk));
        }
        sum += u64::from(black_box(&vec)[vec.len() - 1]);
    }
    sum
}

/// A zeroed buffer of `len` bytes with one byte written, in the middle.
fn zeroed(len: usize, byte: u8) -> Vec<u8> {
    let mut buf = black_box(vec![0u8; len]);
    buf[len / 2] = byte;
    black_box(buf)
}

/// (e) Replaces the buffer of a random slot with a zeroed one of a random size.
fn large_zeroed(scale: &Scale) -> u64 {
    let mut state = 0x1a29e;
    let mut slots: Vec<Vec<u8>> = (0..20).map(|_| Vec::new()).collect();
    for i in 0..scale.large_zeroed {
        let slot = (splitmix64(&mut state) % 20) as usize;
        let len = 5 * MIB + (splitmix64(&mut state) % (20 * MIB as u64 + 1)) as usize;
        slots[slot] = zeroed(len, (i as u8) | 1);
    }
    slots.iter().map(|b| b.len() as u64).sum()
}

/// (f) Allocates, writes one byte of and drops a zeroed 1 GiB buffer, again and again.
fn gib_zeroed(scale: &Scale) -> u64 {
    (0..scale.gib_zeroed)
        .map(|i| {
            let buf = zeroed(GIB, (i as u8) | 1);
            u64::from(buf[GIB / 2])
        })
        .sum()
}
