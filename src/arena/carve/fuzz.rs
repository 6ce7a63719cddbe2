//! Sequences of random operations, checked after every step against a model (the used ranges by
//! address) and the carver's full invariant check.
//!
//! The model knows which ranges are used; the free space of a region is what they leave, so it
//! tells whether a carve could have succeeded, whether a range can grow in place, and what a
//! region removal or an address lookup must answer. It also tracks which quanta may be
//! resident (freed by the user, not purged since, or whose purge failed): a free range holding
//! one must be dirty, or decay would never purge it. `CARVE_FUZZ_SEQUENCES` sets how many sequences run (1000 by
//! default, a few seconds in a debug build).

use std::collections::{BTreeMap, BTreeSet};

use super::*;

const Q: usize = 4096;
/// Regions are placed in slots of this much address space, in any order; a region filling its
/// slot touches the next slot's.
const SLOT: usize = 128 * Q;
const SLOTS: usize = 10;
const BASE: usize = 1 << 32;
const STEPS: usize = 100;
const ALIGNS: [usize; 7] = [1, 8, Q, 2 * Q, 4 * Q, 8 * Q, 16 * Q];

/// splitmix64: small, deterministic, good enough to pick operations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// A used range as the model knows it.
#[derive(Clone, Copy, Debug)]
struct Held {
    range: Range,
    /// Taken by `take_idle` (to be given back clean, or unpurged) rather than carved.
    taken: bool,
}

#[derive(Default)]
struct Model {
    regions: BTreeMap<RegionId, (usize, usize)>,
    used: BTreeMap<usize, Held>,
    /// Recently released ranges: their (handle, addr) pairs are stale unless reused.
    dead: Vec<Range>,
    /// Quanta whose memory may be resident.
    resident: BTreeSet<usize>,
}

impl Model {
    fn in_region(&self, region: RegionId) -> impl Iterator<Item = &Held> + '_ {
        let (base, len) = self.regions.get(&region).copied().unwrap_or((0, 0));
        self.used.range(base..base + len).map(|(_, h)| h)
    }

    /// The free spans of a region: what its used ranges leave.
    fn gaps(&self, region: RegionId) -> Vec<(usize, usize)> {
        let (base, len) = self.regions[&region];
        let mut out = Vec::new();
        let mut at = base;
        for held in self.in_region(region) {
            if held.range.addr > at {
                out.push((at, held.range.addr));
            }
            at = held.range.addr + held.range.size;
        }
        if at < base + len {
            out.push((at, base + len));
        }
        out
    }

    fn fits_anywhere(&self, size: usize, align: usize) -> bool {
        self.regions.keys().any(|&r| {
            self.gaps(r)
                .iter()
                .any(|&(start, end)| start.next_multiple_of(align) + size <= end)
        })
    }

    /// Where the free space after a used range ends (its own end if none).
    fn room_after(&self, range: Range) -> usize {
        let end = range.addr + range.size;
        let (base, len) = self.regions[&range.region];
        self.used
            .range(end..base + len)
            .next()
            .map_or(base + len, |(&addr, _)| addr)
    }

    /// The region holding an address.
    fn region_at(&self, addr: usize) -> Option<RegionId> {
        self.regions
            .iter()
            .find(|(_, &(base, len))| (base..base + len).contains(&addr))
            .map(|(&r, _)| r)
    }

    /// Asserts that `range` lies in its region and overlaps no used range.
    fn assert_unused(&self, range: Range) {
        let (base, len) = self.regions[&range.region];
        assert!(base <= range.addr && range.addr + range.size <= base + len);
        if let Some((_, below)) = self.used.range(..=range.addr).next_back() {
            assert!(
                below.range.addr + below.range.size <= range.addr,
                "{range:?} overlaps"
            );
        }
        if let Some((&above, _)) = self.used.range(range.addr..).next() {
            assert!(range.addr + range.size <= above, "{range:?} overlaps");
        }
    }

    fn pick(&self, rng: &mut Rng, taken: Option<bool>) -> Option<Held> {
        let candidates: Vec<&Held> = self
            .used
            .values()
            .filter(|h| taken.is_none_or(|t| h.taken == t))
            .collect();
        let n = candidates.len();
        (n > 0).then(|| *candidates[rng.below(n)])
    }

    fn set_resident(&mut self, addr: usize, size: usize, resident: bool) {
        for q in (addr..addr + size).step_by(Q) {
            if resident {
                self.resident.insert(q);
            } else {
                self.resident.remove(&q);
            }
        }
    }

    fn release(&mut self, range: Range) {
        self.used.remove(&range.addr);
        self.dead.push(range);
        if self.dead.len() > 16 {
            self.dead.remove(0);
        }
    }
}

fn add_region(c: &mut Carver, m: &mut Model, rng: &mut Rng, now: u64) {
    let taken: Vec<usize> = m
        .regions
        .values()
        .map(|&(base, _)| (base - BASE) / SLOT)
        .collect();
    let free: Vec<usize> = (0..SLOTS).filter(|s| !taken.contains(s)).collect();
    if free.is_empty() {
        return;
    }
    let slot = BASE + free[rng.below(free.len())] * SLOT;
    let len = if rng.chance(50) {
        SLOT
    } else {
        (rng.below(SLOT / Q) + 1) * Q
    };
    // At the start of its slot or at its end, touching the next one.
    let base = if rng.chance(50) {
        slot
    } else {
        slot + SLOT - len
    };
    let clean = rng.chance(50);
    let id = c.add_region(base, len, now, clean).unwrap();
    m.set_resident(base, len, !clean);
    assert!(!m.regions.contains_key(&id));
    m.regions.insert(id, (base, len));
}

fn carve(c: &mut Carver, m: &mut Model, rng: &mut Rng) {
    let size = rng.below(64 * Q) + 1;
    let align = ALIGNS[rng.below(ALIGNS.len())];
    let rounded = size.next_multiple_of(Q);
    match c.carve(size, align).unwrap() {
        Some(range) => {
            assert_eq!(range.size, rounded);
            assert!(range.addr.is_multiple_of(align.max(Q)));
            m.assert_unused(range);
            let held = Held {
                range,
                taken: false,
            };
            m.used.insert(range.addr, held);
        }
        None => assert!(
            !m.fits_anywhere(rounded, align.max(Q)),
            "carve({size}, {align}) found nothing, but something fits"
        ),
    }
}

fn step(c: &mut Carver, m: &mut Model, rng: &mut Rng, now: u64) {
    // Now and then a clock that went back: the idle list must stay ordered anyway.
    let stamp = if rng.chance(5) {
        now.saturating_sub(rng.below(20) as u64)
    } else {
        now
    };
    match rng.below(100) {
        0..30 => carve(c, m, rng),
        30..50 => {
            if let Some(held) = m.pick(rng, None) {
                let r = held.range;
                // A taken range's purge fails now and then (locked memory).
                let unpurged = held.taken && rng.chance(30);
                let purged = !unpurged && (held.taken || rng.chance(10));
                let got = if unpurged {
                    c.give_back_unpurged(r.handle, r.addr)
                } else if purged {
                    c.give_back_clean(r.handle, r.addr)
                } else {
                    c.free(r.handle, r.addr, stamp)
                };
                m.set_resident(r.addr, r.size, !purged);
                assert_eq!(got, Some(r));
                m.release(r);
            }
        }
        50..58 => {
            if let Some(held) = m.pick(rng, Some(false)) {
                let r = held.range;
                let new = r.size + rng.below(16 * Q) + 1;
                let rounded = new.next_multiple_of(Q);
                let room = r.addr + rounded <= m.room_after(r);
                assert_eq!(c.grow_in_place(r.handle, r.addr, new), room);
                if room {
                    m.used.get_mut(&r.addr).unwrap().range.size = rounded;
                }
            }
        }
        58..66 => {
            if let Some(held) = m.pick(rng, Some(false)) {
                let r = held.range;
                let new = rng.below(r.size - 1) + 1;
                assert_eq!(c.shrink_in_place(r.handle, r.addr, new, stamp), Ok(true));
                let kept = new.next_multiple_of(Q);
                m.used.get_mut(&r.addr).unwrap().range.size = kept;
                m.set_resident(r.addr + kept, r.size - kept, true);
            }
        }
        66..76 => {
            if let Some(range) = c.take_idle(now.saturating_sub(rng.below(40) as u64)) {
                // A whole free range: a gap between used ranges.
                m.assert_unused(range);
                let gap = (range.addr, range.addr + range.size);
                assert!(
                    m.gaps(range.region).contains(&gap),
                    "{range:?} is not whole"
                );
                m.used.insert(range.addr, Held { range, taken: true });
            }
        }
        76..82 => add_region(c, m, rng, now),
        82..88 => {
            let id = rng.below(m.regions.len() + 2) as RegionId;
            let expect = m
                .regions
                .get(&id)
                .copied()
                .filter(|_| m.in_region(id).next().is_none());
            assert_eq!(c.wholly_free(id).is_some(), expect.is_some());
            assert_eq!(c.remove_region(id), expect);
            if expect.is_some() {
                m.regions.remove(&id);
            }
        }
        88..94 => {
            // A stale pair, or one naming no node, changes nothing.
            let r = match m.dead.len() {
                0 => return,
                n => m.dead[rng.below(n)],
            };
            let handle = if rng.chance(30) {
                rng.next() as u32
            } else {
                r.handle
            };
            if m.used
                .get(&r.addr)
                .is_some_and(|h| h.range.handle == handle)
            {
                return;
            }
            assert_eq!(c.free(handle, r.addr, now), None);
            assert_eq!(c.give_back_clean(handle, r.addr), None);
            assert_eq!(c.give_back_unpurged(handle, r.addr), None);
            assert!(!c.grow_in_place(handle, r.addr, r.size + Q));
            assert_eq!(c.shrink_in_place(handle, r.addr, Q, now), Ok(false));
        }
        _ => {
            let addr = match m.regions.values().nth(rng.below(m.regions.len())) {
                Some(&(base, len)) => base + rng.below(len + Q),
                None => BASE + rng.below(SLOT),
            };
            let expect = m
                .used
                .range(..=addr)
                .next_back()
                .map(|(_, h)| h.range)
                .filter(|r| addr < r.addr + r.size);
            assert_eq!(c.used_containing(addr), expect);
        }
    }
}

/// The carver agrees with the model on every used range and on the totals.
fn compare(c: &Carver, m: &Model) {
    c.check();
    let used: Vec<Range> = m.used.values().map(|h| h.range).collect();
    assert_eq!(c.used_ranges(), used);
    for r in &used {
        assert_eq!(m.region_at(r.addr), Some(r.region));
    }
    let regions: Vec<(RegionId, usize, usize)> = c.regions().collect();
    let mut expect: Vec<_> = m.regions.iter().map(|(&r, &(b, l))| (r, b, l)).collect();
    expect.sort_by_key(|&(_, base, _)| base);
    assert_eq!(regions, expect);
    let stats = c.stats();
    assert_eq!(stats.used_bytes, used.iter().map(|r| r.size).sum::<usize>());
    assert_eq!(stats.used_ranges, used.len());
    assert_eq!(
        stats.region_bytes,
        expect.iter().map(|r| r.2).sum::<usize>()
    );
    assert_eq!(stats.free_bytes, stats.region_bytes - stats.used_bytes);
    for &(region, ..) in &regions {
        for span in c.free_spans(region) {
            let resident = m.resident.range(span.addr..span.addr + span.size).next();
            assert!(span.dirty || resident.is_none(), "{span:?} is resident");
        }
    }
}

#[test]
fn random_sequences_agree_with_the_model() {
    let sequences = std::env::var("CARVE_FUZZ_SEQUENCES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000u64);
    for seed in 0..sequences {
        let run = std::panic::catch_unwind(|| {
            let mut rng = Rng(seed);
            let mut c = Carver::new(Q);
            let mut m = Model::default();
            let mut now = 0;
            for _ in 0..rng.below(3) + 1 {
                add_region(&mut c, &mut m, &mut rng, now);
            }
            compare(&c, &m);
            for _ in 0..STEPS {
                now += rng.below(3) as u64;
                step(&mut c, &mut m, &mut rng, now);
                compare(&c, &m);
            }
        });
        assert!(run.is_ok(), "sequence {seed} failed (see the panic above)");
    }
}
