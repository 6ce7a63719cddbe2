//! CUDA's own host-NUMA memory as a peer: `cuMemCreate` with a host-NUMA location mapped with
//! device and host access, and a pool with such a location; what a driver that lacks or refuses
//! them gives; where their pages are.

use super::*;
use numa_gpu_alloc::Error as CrateError;

/// Which of CUDA's host-NUMA allocators.
#[derive(Clone, Copy)]
pub(super) enum Peer {
    /// `cuMemCreate` + `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess`.
    Create,
    /// A fresh pool (`cuMemPoolCreate`) and its first block.
    Pool,
}

impl Peer {
    pub(super) const ALL: [Peer; 2] = [Peer::Create, Peer::Pool];

    pub(super) fn memory(self) -> &'static str {
        match self {
            Peer::Create => "cuMemCreate/numa",
            Peer::Pool => "cuMemPool/numa",
        }
    }

    /// What a cold sample times, until the host may use the memory.
    fn what(self) -> &'static str {
        match self {
            Peer::Create => "cuMemCreate + reserve + map + access (device, host)",
            Peer::Pool => "cuMemPoolCreate + first cuMemAllocFromPoolAsync + stream sync",
        }
    }
}

/// One peer's cold samples at one size.
#[derive(Default)]
pub(super) struct PeerSamples {
    ms: Vec<f64>,
    /// Where the first sample's pages were.
    placement: String,
    /// Why sampling stopped (the driver lacks or refuses it), as the row's note.
    stopped: Option<String>,
}

/// The note for a peer the driver could not give: `not measured` (libcuda lacks an entry, or no
/// driver), `refused` (the driver's code), else `failed` (counted as a failure).
pub(super) fn peer_note(e: &CrateError) -> String {
    match e {
        CrateError::CudaUnavailable { reason } => format!("not measured: {reason}"),
        CrateError::Cuda { call, code, name } => format!("refused: {call}: {name} ({code})"),
        other => format!("failed: {other}"),
    }
}

/// Writes one byte per page of `ptr..ptr+len` (so the host has touched it all), then counts on
/// which node its pages are (`move_pages`).
pub(super) fn placement(ptr: NonNull<u8>, len: usize, node: usize) -> String {
    let page = numa_gpu_alloc::unstable::sys::page_size();
    let len = len / page * page;
    for offset in (0..len).step_by(page) {
        // SAFETY: `offset` is inside the caller's `len` host-writable bytes at `ptr`.
        unsafe { ptr.as_ptr().add(offset).write_volatile(0) };
    }
    // SAFETY: the range is mapped by the caller's allocation for the call's duration; the kernel
    // only reads page tables.
    match unsafe { numa_gpu_alloc::unstable::sys::census(ptr, len, node) } {
        Ok(c) if c.on_node == c.pages => format!("all {} pages on node {node}", c.pages),
        Ok(c) => format!(
            "{} of {} pages on node {node}, {} elsewhere, {} absent",
            c.on_node, c.pages, c.elsewhere, c.absent
        ),
        Err(e) => format!("placement not counted: {e}"),
    }
}

impl Bench<'_> {
    /// `note`, said to be the simulator's when it is (failures stay first, as `failed:` lines
    /// are counted).
    pub(super) fn mark(&self, note: String) -> String {
        if self.simulated && !note.starts_with("failed:") {
            format!("simulated; {note}")
        } else {
            note
        }
    }

    /// One cold sample of `peer` at `size` on the host node: the time until the host may use the
    /// memory; on the first, where its pages are (outside the timing).
    pub(super) fn peer_sample(
        &self,
        driver: &Driver,
        peer: Peer,
        size: usize,
        samples: &mut PeerSamples,
    ) {
        if samples.stopped.is_some() {
            return;
        }
        let (node, first) = (self.host, samples.ms.is_empty());
        let start = Instant::now();
        let taken = match peer {
            Peer::Create => driver.host_numa_memory(node, size).map(|mem| {
                let took = start.elapsed();
                if first {
                    samples.placement = placement(mem.as_ptr(), mem.len(), node);
                }
                took
            }),
            Peer::Pool => driver.host_numa_pool(node).and_then(|pool| {
                let block = pool.alloc(size)?;
                let took = start.elapsed();
                if first {
                    samples.placement = placement(block.as_ptr(), block.len(), node);
                }
                Ok(took)
            }),
        };
        match taken {
            Ok(took) => samples.ms.push(ms(took)),
            Err(e) => samples.stopped = Some(peer_note(&e)),
        }
    }

    /// The peers' cold rows at `size`.
    pub(super) fn peer_rows(&mut self, size: usize, samples: Vec<PeerSamples>) {
        for (peer, s) in Peer::ALL.into_iter().zip(samples) {
            let (ms, note) = match s.stopped {
                Some(why) => (None, why),
                None => (
                    Some(median(s.ms.clone())),
                    format!("{}; {}; {}", peer.what(), s.placement, spread(&s.ms)),
                ),
            };
            let note = self.mark(note);
            self.rows.push(Row {
                test: "cold",
                memory: peer.memory(),
                node: Some(self.host),
                bytes: size,
                ms,
                note,
                ..Row::default()
            });
        }
    }

    /// Without a driver: the peers' rows, saying why they were not measured.
    pub(super) fn peers_not_measured(&mut self, test: &'static str, size: usize) {
        let why = self.no_cuda.clone().unwrap_or_default();
        for peer in Peer::ALL {
            self.rows.push(Row {
                test,
                memory: peer.memory(),
                bytes: size,
                note: format!("not measured: {why}"),
                ..Row::default()
            });
        }
    }

    /// Ours and the peers cold at `size`, alternated: one sample above 16 GiB (the budget), else
    /// `--reps`; progress printed after each.
    pub(super) fn numa_cold(&mut self, size: usize) -> Res<()> {
        let Some(driver) = self.driver else {
            self.peers_not_measured("cold", size);
            return Ok(());
        };
        if let Some(why) = short_of_memory(size + 2 * GIB) {
            println!("{why}");
            return Ok(());
        }
        pre_touch(size);
        let reps = if size > 16 * GIB { 1 } else { self.args.reps };
        let mut peers: Vec<PeerSamples> = Peer::ALL.iter().map(|_| Default::default()).collect();
        let (mut ours, mut ours_placement) = (Vec::new(), String::new());
        let _ = self.ours.placement(); // context and topology set up outside the timing
        for rep in 1..=reps {
            progress(format_args!(
                "ours vs CUDA's host-NUMA memory {}: sample {rep} of {reps}",
                size_text(size)
            ));
            let (block, took) = OurBlock::new(&self.ours, size)?;
            if ours.is_empty() {
                ours_placement = placement(block.ptr, size, self.host);
            }
            drop(block);
            self.ours.trim();
            ours.push(ms(took));
            let mut line = format!("sample {rep}/{reps}: ours {:.1} ms", ms(took));
            for (peer, samples) in Peer::ALL.into_iter().zip(&mut peers) {
                self.peer_sample(driver, peer, size, samples);
                let last = samples.ms.last().filter(|_| samples.stopped.is_none());
                let _ = write!(line, ", {} {} ms", peer.memory(), opt(last.copied(), 1));
            }
            println!("{line}");
        }
        let note = format!(
            "mmap + mbind + populate + cuMemHostRegister; {ours_placement}; {}",
            spread(&ours)
        );
        self.rows.push(Row {
            test: "cold",
            memory: "ours",
            node: Some(self.host),
            bytes: size,
            ms: Some(median(ours)),
            note,
            ..Row::default()
        });
        self.peer_rows(size, peers);
        Ok(())
    }

    /// A pool hit: `size` bytes from a host-NUMA pool (release threshold raised) that has given
    /// back a block of that size, until the host may use them; 5 samples.
    pub(super) fn pool_hit(&mut self, driver: &Driver, size: usize) {
        let mut row = Row {
            test: "reuse",
            memory: Peer::Pool.memory(),
            node: Some(self.host),
            bytes: size,
            ..Row::default()
        };
        let hits = || -> numa_gpu_alloc::Result<Vec<f64>> {
            let pool = driver.host_numa_pool(self.host)?;
            drop(pool.alloc(size)?); // the pool grows once
            (0..5)
                .map(|_| {
                    let start = Instant::now();
                    let block = pool.alloc(size)?;
                    let took = ms(start.elapsed());
                    drop(block);
                    Ok(took)
                })
                .collect()
        };
        row.note = match hits() {
            Ok(samples) => {
                row.ms = Some(median(samples.clone()));
                let us: Vec<f64> = samples.iter().map(|ms| ms * 1e3).collect();
                format!(
                    "cuMemAllocFromPoolAsync + stream sync after a free; 5 samples, {:.1}…{:.1} µs",
                    us.iter().copied().fold(f64::INFINITY, f64::min),
                    us.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                )
            }
            Err(e) => peer_note(&e),
        };
        row.note = self.mark(row.note);
        self.rows.push(row);
    }
}
