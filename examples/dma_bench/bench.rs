//! The sections of the benchmark: what each measures, on the state they share.

use super::host_numa::{peer_note, placement, Peer, PeerSamples};
use super::*;

/// Everything the sections share.
pub(super) struct Bench<'a> {
    pub(super) args: &'a Args,
    pub(super) topo: &'a NumaTopology,
    /// The driver and device ordinal, when CUDA is usable.
    pub(super) driver: Option<&'a Driver>,
    /// Why CUDA is not usable, when it is not.
    pub(super) no_cuda: Option<String>,
    /// Whether the driver is the simulator: its DMA and host-NUMA rows say so.
    pub(super) simulated: bool,
    /// Where blocks go: the GPU's host node, else this thread's node.
    pub(super) host: usize,
    pub(super) far: Option<usize>,
    pub(super) started: Instant,
    pub(super) rows: Vec<Row>,
    /// Sections that stopped on an error.
    pub(super) failed_sections: usize,
    /// Ours, without a cache: every block is cold.
    pub(super) ours: NumaGpuAlloc,
    /// Ours, caching freed blocks of the first cold size.
    pub(super) cached: NumaGpuAlloc,
}

/// An allocator of ours for `host`: pinning explicitly on (strict) with a driver, off without;
/// populated when handed out either way (as the peers' memory is by their touch or registration).
pub(super) fn ours_alloc(args: &Args, cuda: bool, host: usize, cache: usize) -> NumaGpuAlloc {
    let alloc = NumaGpuAlloc::new().cache_limit(cache).populate_eager(true);
    if cuda {
        alloc.gpu(args.gpu).pin(PinMode::Strict)
    } else {
        alloc.node(host).pin(PinMode::Off)
    }
}

impl Bench<'_> {
    /// Runs one section unless the time budget is spent, then prints its rows and duration.
    pub(super) fn section(&mut self, title: &str, run: impl FnOnce(&mut Self) -> Res<()>) {
        let first = self.rows.len();
        let elapsed = self.started.elapsed().as_secs();
        println!("\n== {title}");
        if self.args.max_seconds.is_some_and(|max| elapsed >= max) {
            println!("skipped: --max-seconds reached after {elapsed} s");
            return;
        }
        progress(format_args!("{title}"));
        let start = Instant::now();
        if let Err(e) = run(self) {
            self.failed_sections += 1;
            println!("failed: {e}");
        }
        print_rows(&self.rows[first..]);
        println!("[{title}: {:.1} s]", start.elapsed().as_secs_f64());
    }

    /// Cold cost of `size` bytes, methods alternated, median of `reps`.
    pub(super) fn cold(&mut self, size: usize) -> Res<()> {
        if let Some(why) = short_of_memory(2 * size + GIB) {
            println!("{why}");
            return Ok(());
        }
        // Twice the size: the memory each method then gets back is equally warm.
        pre_touch(2 * size);
        let (mut ours, mut ours_pin) = (Vec::new(), Vec::new());
        let (mut host_alloc, mut naive, mut naive_reg) = (Vec::new(), Vec::new(), Vec::new());
        let mut populate = Vec::new();
        let mut peers: Vec<PeerSamples> = Peer::ALL.iter().map(|_| Default::default()).collect();
        let mut ours_placement = String::new();
        let alloc = &self.ours;
        let _ = alloc.placement(); // context and topology set up outside the timing
        let reps = self.args.reps;
        let methods = if self.driver.is_some() {
            "ours, cuMemHostAlloc, malloc+register, CUDA's host-NUMA memory"
        } else {
            "ours, malloc+touch"
        };
        for rep in 1..=reps {
            progress(format_args!(
                "cold cost {}: sample {rep} of {reps} ({methods})",
                size_text(size)
            ));
            let before = alloc.stats();
            let (block, took) = OurBlock::new(alloc, size)?;
            let after = alloc.stats();
            if ours.is_empty() {
                ours_placement = placement(block.ptr, size, self.host);
            }
            drop(block);
            alloc.trim();
            ours.push(ms(took));
            ours_pin.push(ms(after
                .pin_time
                .total
                .saturating_sub(before.pin_time.total)));
            populate.push(ms(after
                .populate_time
                .total
                .saturating_sub(before.populate_time.total)));
            let Some(driver) = self.driver else {
                // The system allocator, first touch included (no placement, no pinning).
                let start = Instant::now();
                let mut v: Vec<u8> = Vec::with_capacity(size);
                for page in v.spare_capacity_mut().iter_mut().step_by(4096) {
                    page.write(0);
                }
                naive.push(ms(start.elapsed()));
                drop(std::hint::black_box(v));
                continue;
            };
            let start = Instant::now();
            let block = driver.host_alloc(size)?;
            host_alloc.push(ms(start.elapsed()));
            drop(block);
            // The naive path: a zeroed Vec (untouched pages from calloc), then registered.
            let start = Instant::now();
            let mut v = vec![0u8; size];
            let ptr = NonNull::new(v.as_mut_ptr()).ok_or("null Vec")?;
            let reg_start = Instant::now();
            // SAFETY: the Vec's buffer is mapped, not registered, and outlives the guard
            // (dropped first, below); the context is current on this thread.
            let registered = unsafe { driver.register(ptr, size) }?;
            naive_reg.push(ms(reg_start.elapsed()));
            naive.push(ms(start.elapsed()));
            drop(registered);
            drop(v);
            for (peer, samples) in Peer::ALL.into_iter().zip(&mut peers) {
                self.peer_sample(driver, peer, size, samples);
            }
        }
        let node = Some(self.host);
        let (ours_note, ours_reg) = if self.driver.is_some() {
            (
                "mmap + mbind + populate + cuMemHostRegister",
                Some(median(ours_pin)),
            )
        } else {
            ("mmap + mbind + populate", None)
        };
        self.rows.push(Row {
            test: "cold",
            memory: "ours",
            node,
            bytes: size,
            ms: Some(median(ours.clone())),
            register_ms: ours_reg,
            note: format!(
                "{ours_note}; populate {:.1} ms; {ours_placement}; {}",
                median(populate),
                spread(&ours)
            ),
            ..Row::default()
        });
        if self.driver.is_some() {
            self.rows.push(Row {
                test: "cold",
                memory: "cuMemHostAlloc",
                bytes: size,
                ms: Some(median(host_alloc.clone())),
                note: format!(
                    "pages on the calling thread's node; {}",
                    spread(&host_alloc)
                ),
                ..Row::default()
            });
            self.rows.push(Row {
                test: "cold",
                memory: "malloc+register",
                bytes: size,
                ms: Some(median(naive.clone())),
                register_ms: Some(median(naive_reg)),
                note: format!(
                    "vec![0; n] + cuMemHostRegister, no placement; {}",
                    spread(&naive)
                ),
                ..Row::default()
            });
            self.peer_rows(size, peers);
        } else {
            self.rows.push(Row {
                test: "cold",
                memory: "malloc+touch",
                bytes: size,
                ms: Some(median(naive.clone())),
                note: format!("malloc + first touch, no placement; {}", spread(&naive)),
                ..Row::default()
            });
            self.peers_not_measured("cold", size);
        }
        Ok(())
    }

    /// A freed block taken back from the cache.
    pub(super) fn reuse(&mut self, size: usize) -> Res<()> {
        if let Some(why) = short_of_memory(size + GIB) {
            println!("{why}");
            return Ok(());
        }
        drop(OurBlock::new(&self.cached, size)?);
        let (block, took) = OurBlock::new(&self.cached, size)?;
        drop(block);
        self.rows.push(Row {
            test: "reuse",
            memory: "ours",
            node: Some(self.host),
            bytes: size,
            ms: Some(ms(took)),
            note: if self.driver.is_some() {
                "freed block taken from the cache, still placed and pinned"
            } else {
                "freed block taken from the cache, still placed"
            }
            .into(),
            ..Row::default()
        });
        match self.driver {
            Some(driver) => match short_of_memory(size + GIB) {
                // Ours' freed block stays cached meanwhile.
                Some(why) => println!("host-NUMA pool {why}"),
                None => self.pool_hit(driver, size),
            },
            None => self.peers_not_measured("reuse", size),
        }
        Ok(())
    }

    /// Cold place + populate of one block with each thread count (host-only: no pinning).
    pub(super) fn scaling(&mut self) -> Res<()> {
        let size = self.args.scaling_size;
        if let Some(why) = short_of_memory(size + GIB) {
            println!("{why}");
            return Ok(());
        }
        pre_touch(size);
        let allocs: Vec<NumaGpuAlloc> = (self.args.threads.iter())
            .map(|&threads| {
                NumaGpuAlloc::new()
                    .node(self.host)
                    .pin(PinMode::Off)
                    .cache_limit(0)
                    .populate_eager(true)
                    .populate_threads(threads)
            })
            .collect();
        allocs.iter().for_each(|a| drop(a.placement()));
        // Thread counts take turns, so that a slow spell of the machine (a hypervisor backing
        // memory again) lands on one sample of each row rather than on one row.
        let mut samples = vec![Vec::new(); allocs.len()];
        let reps = self.args.reps;
        for rep in 1..=reps {
            progress(format_args!(
                "populate scaling {}: round {rep} of {reps} ({} threads)",
                size_text(size),
                self.args
                    .threads
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ));
            for (alloc, samples) in allocs.iter().zip(&mut samples) {
                let (block, took) = OurBlock::new(alloc, size)?;
                drop(block);
                samples.push(ms(took));
            }
        }
        let base = median(samples[0].clone());
        for (&threads, samples) in self.args.threads.iter().zip(samples) {
            let m = median(samples.clone());
            self.rows.push(Row {
                test: "populate",
                memory: "ours",
                node: Some(self.host),
                bytes: size,
                threads: Some(threads),
                ms: Some(m),
                note: format!("{:.2}x the first row; {}", base / m, spread(&samples)),
                ..Row::default()
            });
        }
        Ok(())
    }

    /// Host→device and device→host bandwidth for every size and kind of host memory.
    pub(super) fn bandwidth(&mut self, driver: &Driver) -> Res<()> {
        let max = self.args.bw_sizes.iter().copied().max().unwrap_or(0);
        let copier = driver.copier(max)?;
        // One pool for every size: its blocks stay in it (the release threshold is raised).
        let pool = driver.host_numa_pool(self.host);
        let ours = &self.ours;
        // `bind`: every page really is on the far node, or the allocation fails.
        let far = self.far.map(|n| {
            let alloc = NumaGpuAlloc::new()
                .node(n)
                .policy(MemPolicy::Bind)
                .pin(PinMode::Off)
                .cache_limit(0);
            (n, alloc)
        });
        for &size in &self.args.bw_sizes {
            let copies = MIN_SAMPLE_BYTES.div_ceil(size).max(1);
            progress(format_args!(
                "bandwidth {}: {} runs per direction and kind of memory",
                size_text(size),
                self.args.runs
            ));
            let measure = |memory: &'static str, node: Option<usize>, host: &mut [u8]| {
                let mut row = Row {
                    test: "bandwidth",
                    memory,
                    node,
                    bytes: size,
                    note: format!(
                        "{copies} cop{} per sample",
                        if copies == 1 { "y" } else { "ies" }
                    ),
                    ..Row::default()
                };
                let mut rate = |direction| -> Res<f64> {
                    copier.time(host, direction, 1)?; // warm-up
                    let samples = (0..self.args.runs)
                        .map(|_| copier.time(host, direction, copies))
                        .collect::<Result<Vec<f64>, _>>()?;
                    let gbps = samples.iter().map(|s| (size * copies) as f64 / s / 1e9);
                    Ok(median(gbps.collect()))
                };
                match (rate(Direction::HtoD), rate(Direction::DtoH)) {
                    (Ok(h2d), Ok(d2h)) => (row.h2d_gbps, row.d2h_gbps) = (Some(h2d), Some(d2h)),
                    (Err(e), _) | (_, Err(e)) => row.note = format!("failed: {e}"),
                }
                row
            };
            let mut rows = Vec::new();
            rows.push(measure("pageable", None, &mut vec![0x11u8; size]));
            let mut pinned = driver.host_alloc(size)?;
            rows.push(measure("cuMemHostAlloc", None, pinned.as_mut_slice()));
            drop(pinned);
            let (mut block, _) = OurBlock::new(ours, size)?;
            rows.push(measure("ours", Some(self.host), block.filled(0x22)));
            drop(block);
            if let Some((node, alloc)) = &far {
                let (mut block, _) = OurBlock::new(alloc, size)?;
                let slice = block.filled(0x33);
                let ptr = NonNull::new(slice.as_mut_ptr()).ok_or("null block")?;
                // SAFETY: the block is mapped, not registered (its allocator does not pin),
                // and outlives the guard, dropped at the end of this block.
                let _registered = unsafe { driver.register(ptr, size) }?;
                rows.push(measure("ours-far", Some(*node), slice));
            }
            let not_given = |memory, e: &numa_gpu_alloc::Error| Row {
                test: "bandwidth",
                memory,
                node: Some(self.host),
                bytes: size,
                note: peer_note(e),
                ..Row::default()
            };
            let (create, pooled) = (Peer::Create.memory(), Peer::Pool.memory());
            match driver.host_numa_memory(self.host, size) {
                Ok(mut mem) => rows.push(measure(
                    create,
                    Some(self.host),
                    &mut mem.as_mut_slice()[..size],
                )),
                Err(e) => rows.push(not_given(create, &e)),
            }
            let block = (pool.as_ref().map_err(Clone::clone)).and_then(|pool| pool.alloc(size));
            match block {
                Ok(mut block) => rows.push(measure(pooled, Some(self.host), block.as_mut_slice())),
                Err(e) => rows.push(not_given(pooled, &e)),
            }
            for mut row in rows {
                row.note = self.mark(row.note);
                self.rows.push(row);
            }
        }
        Ok(())
    }

    /// Without a GPU: memcpy bandwidth from a buffer on each node to one on `host`.
    pub(super) fn host_copies(&mut self, size: usize) -> Res<()> {
        let dst_alloc = NumaGpuAlloc::new().node(self.host).pin(PinMode::Off);
        let (mut dst, _) = OurBlock::new(&dst_alloc, size)?;
        let dst = dst.filled(0);
        for info in self.topo.nodes().iter().filter(|n| n.has_memory) {
            let src_alloc = NumaGpuAlloc::new().node(info.id).pin(PinMode::Off);
            let (mut src, _) = OurBlock::new(&src_alloc, size)?;
            let src = src.filled(0xa5);
            dst.copy_from_slice(src); // warm-up
            let rates = (0..self.args.runs)
                .map(|_| {
                    let start = Instant::now();
                    dst.copy_from_slice(src);
                    std::hint::black_box(&dst[..]);
                    size as f64 / start.elapsed().as_secs_f64() / 1e9
                })
                .collect();
            self.rows.push(Row {
                test: "host_copy",
                memory: "ours",
                node: Some(info.id),
                bytes: size,
                copy_gbps: Some(median(rates)),
                note: format!("node {} -> node {}", info.id, self.host),
                ..Row::default()
            });
        }
        Ok(())
    }
}
