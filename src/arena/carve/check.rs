//! The carver's invariants, checked in full after every step of the tests.

use super::regions::RegionSlot;
use super::table::{class_at_least, class_of, CLASSES, FL_COUNT, SL_COUNT};
use super::*;

/// A free range as the tests see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Span {
    pub(super) addr: usize,
    pub(super) size: usize,
    pub(super) dirty: bool,
    pub(super) stamp: u64,
}

/// The lowest size, in quanta, of a class's ranges.
fn class_floor(class: usize) -> usize {
    let (fl, sl) = (class / SL_COUNT, class % SL_COUNT);
    if fl == 0 {
        sl
    } else {
        (SL_COUNT + sl) << (fl - 1)
    }
}

impl Carver {
    /// The nodes of a region in address order.
    fn physical(&self, region: RegionId) -> Vec<(u32, Node)> {
        let Some(first) = self.regions.first(region) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut i = first;
        while let Some(n) = self.nodes.node(i) {
            out.push((i, *n));
            assert!(out.len() <= self.nodes.len(), "physical list loops");
            i = n.phys_next;
        }
        out
    }

    /// Every used range, in address order.
    pub(super) fn used_ranges(&self) -> Vec<Range> {
        let mut out: Vec<Range> = (0..self.nodes.len() as u32)
            .filter_map(|i| {
                let n = self.nodes.node(i)?;
                (n.state == State::Used).then_some(Range {
                    addr: n.start,
                    size: n.size,
                    region: n.region,
                    handle: i,
                })
            })
            .collect();
        out.sort_by_key(|r| r.addr);
        out
    }

    /// The free ranges of a region in address order.
    pub(super) fn free_spans(&self, region: RegionId) -> Vec<Span> {
        self.physical(region)
            .into_iter()
            .filter(|(_, n)| n.state == State::Free)
            .map(|(_, n)| Span {
                addr: n.start,
                size: n.size,
                dirty: n.dirty,
                stamp: n.stamp,
            })
            .collect()
    }

    /// Panics unless every invariant holds.
    pub(super) fn check(&self) {
        let q = self.quantum;
        assert!(q.is_power_of_two() && q == 1 << self.nodes.shift);

        // Vacant slots: exactly the chained ones.
        let mut vacant = 0;
        let mut i = self.nodes.vacant_node;
        while let Some(n) = self.nodes.node(i) {
            assert_eq!(n.state, State::Vacant);
            vacant += 1;
            assert!(vacant <= self.nodes.len(), "vacant chain loops");
            i = n.free_next;
        }
        assert_eq!(i, NONE);
        assert_eq!(vacant, self.nodes.vacant_nodes);
        let states = |s| self.nodes.slots.iter().filter(|n| n.state == s).count();
        assert_eq!(states(State::Vacant), vacant);

        // Regions: by_base lists the live ones, sorted, disjoint; vacant region slots chained.
        let live: Vec<RegionId> = (0..self.regions.slots.len() as RegionId)
            .filter(|&r| matches!(self.regions.slots[r as usize], RegionSlot::Live { .. }))
            .collect();
        let mut sorted = self.regions.by_base.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, live);
        let listed: Vec<(RegionId, usize, usize)> = self.regions().collect();
        assert_eq!(listed.len(), live.len());
        for pair in listed.windows(2) {
            assert!(
                pair[0].1 + pair[0].2 <= pair[1].1,
                "regions overlap: {pair:?}"
            );
        }
        let mut vacant_regions = 0;
        let mut r = self.regions.vacant;
        while let Some(slot) = self.regions.slots.get(r as usize) {
            let RegionSlot::Vacant { next } = slot else {
                panic!("live region {r} in the vacant chain");
            };
            vacant_regions += 1;
            assert!(vacant_regions <= self.regions.slots.len());
            r = *next;
        }
        assert_eq!(vacant_regions + live.len(), self.regions.slots.len());

        // Physical lists tile their regions; no two free nodes touch.
        let mut reached = 0;
        let mut expect = CarverStats::default();
        for &(id, base, len) in &listed {
            expect.regions += 1;
            expect.region_bytes += len;
            let nodes = self.physical(id);
            assert!(!nodes.is_empty());
            let mut at = base;
            let mut prev: Option<(u32, Node)> = None;
            for &(i, n) in &nodes {
                assert_eq!(n.region, id);
                assert_eq!(n.start, at, "region {id} not tiled");
                assert!(n.size > 0 && n.size.is_multiple_of(q) && n.start.is_multiple_of(q));
                assert_ne!(n.state, State::Vacant);
                assert_eq!(n.phys_prev, prev.map_or(NONE, |(p, _)| p));
                if let Some((_, p)) = prev {
                    let both_free = p.state == State::Free && n.state == State::Free;
                    assert!(!both_free, "free neighbours at {:#x}", n.start);
                }
                match n.state {
                    State::Used => {
                        expect.used_bytes += n.size;
                        expect.used_ranges += 1;
                    }
                    _ => {
                        expect.free_bytes += n.size;
                        expect.free_ranges += 1;
                        expect.largest_free = expect.largest_free.max(n.size);
                        if n.dirty {
                            expect.dirty_free_bytes += n.size;
                        }
                        if n.unpurgeable {
                            assert!(n.dirty, "clean but unpurgeable at {:#x}", n.start);
                            expect.unpurgeable_bytes += n.size;
                        }
                    }
                }
                at += n.size;
                prev = Some((i, n));
            }
            assert_eq!(at, base + len, "region {id} not tiled to its end");
            reached += nodes.len();
        }
        assert_eq!(
            reached,
            self.nodes.len() - vacant,
            "nodes outside every region"
        );
        assert_eq!(self.stats(), expect);

        // Size classes: each free node in the list of its class, once; the bitmaps say which
        // lists are non-empty. Only those are walked (walking all classes would dominate the tests).
        let mut seen = vec![false; self.nodes.len()];
        let mut in_classes = 0;
        let mut listed_classes = 0;
        for fl in 0..FL_COUNT {
            assert_eq!(
                self.nodes.first & (1 << fl) != 0,
                self.nodes.second[fl] != 0
            );
            let mut bits = self.nodes.second[fl];
            while bits != 0 {
                let class = fl * SL_COUNT + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                listed_classes += 1;
                let mut prev = NONE;
                let mut i = self.nodes.heads[class];
                assert_ne!(i, NONE, "class {class} is marked but empty");
                while let Some(n) = self.nodes.node(i) {
                    assert_eq!(n.state, State::Free);
                    assert_eq!(n.free_prev, prev);
                    assert_eq!(class_of(n.size / q), class);
                    assert!(n.size / q >= class_floor(class));
                    assert!(!std::mem::replace(&mut seen[i as usize], true));
                    in_classes += 1;
                    prev = i;
                    i = n.free_next;
                }
            }
        }
        assert_eq!(self.nodes.first >> FL_COUNT, 0);
        assert_eq!(in_classes, expect.free_ranges);
        // Heads outside the bitmaps: compared a level at a time (a slice compare is a memcmp).
        let mut heads = 0;
        for (fl, level) in self.nodes.heads.chunks_exact(SL_COUNT).enumerate() {
            if self.nodes.second[fl] == 0 {
                assert_eq!(level, [NONE; SL_COUNT], "a list head outside the bitmaps");
            } else {
                heads += level.iter().filter(|&&h| h != NONE).count();
            }
        }
        assert_eq!(heads, listed_classes, "a list head outside the bitmaps");

        // The idle list: exactly the dirty free nodes not unpurgeable, oldest first.
        let mut idle = 0;
        let mut prev = NONE;
        let mut stamp = 0;
        let mut i = self.nodes.idle_head;
        while let Some(n) = self.nodes.node(i) {
            assert!(n.state == State::Free && n.idle());
            assert_eq!(n.idle_prev, prev);
            assert!(n.stamp >= stamp, "idle list out of order");
            stamp = n.stamp;
            idle += 1;
            assert!(idle <= self.nodes.len(), "idle list loops");
            prev = i;
            i = n.idle_next;
        }
        assert_eq!(self.nodes.idle_tail, prev);
        let dirty_free = self
            .nodes
            .slots
            .iter()
            .filter(|n| n.state == State::Free && n.idle())
            .count();
        assert_eq!(idle, dirty_free);
    }
}

#[test]
fn class_floors_are_monotone_and_exact_below_64() {
    for units in 1..5000 {
        let class = class_of(units);
        assert!(class_floor(class) <= units);
        assert!(class_floor(class + 1) > units);
        if units < 2 * SL_COUNT {
            assert_eq!(class_floor(class), units);
        }
        let at_least = class_at_least(units).unwrap();
        assert!(class_floor(at_least) >= units);
        assert!(at_least == 0 || class_floor(at_least - 1) < units);
    }
    assert_eq!(class_of(usize::MAX), CLASSES - 1);
    assert_eq!(class_at_least(usize::MAX), None);
}
