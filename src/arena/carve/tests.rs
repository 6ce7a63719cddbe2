//! Unit tests of the carver: splits and merges, regions, alignment, growth in place, idle
//! tracking and stale handles. Every step is followed by the full invariant check.

use super::check::Span;
use super::*;

const Q: usize = 4096;
const BASE: usize = 0x1000_0000;

/// A carver with one region of `quanta` at BASE, added at time 0.
fn one_region(quanta: usize, clean: bool) -> (Carver, RegionId) {
    let mut c = Carver::new(Q);
    let r = c.add_region(BASE, quanta * Q, 0, clean).unwrap();
    c.check();
    (c, r)
}

fn carve(c: &mut Carver, quanta: usize, align: usize) -> Range {
    let r = c.carve(quanta * Q, align).unwrap().unwrap();
    c.check();
    r
}

fn free(c: &mut Carver, r: Range, now: u64) {
    assert_eq!(c.free(r.handle, r.addr, now), Some(r));
    c.check();
}

fn clean(c: &mut Carver, r: Range) {
    assert_eq!(c.give_back_clean(r.handle, r.addr), Some(r));
    c.check();
}

/// A free span of `quanta` at BASE + `at` quanta.
fn span(at: usize, quanta: usize, dirty: bool, stamp: u64) -> Span {
    Span {
        addr: BASE + at * Q,
        size: quanta * Q,
        dirty,
        stamp,
    }
}

#[test]
fn split_leaves_the_tail_free_with_the_source_state() {
    let (mut c, r) = one_region(16, true);
    let a = carve(&mut c, 2, 1);
    let b = carve(&mut c, 3, 1);
    assert_eq!((a.addr, a.size, a.region), (BASE, 2 * Q, r));
    assert_eq!(b.addr, BASE + 2 * Q);
    assert_eq!(c.free_spans(r), [span(5, 11, false, 0)]);
    let stats = c.stats();
    assert_eq!((stats.used_bytes, stats.used_ranges), (5 * Q, 2));
    assert_eq!((stats.free_bytes, stats.free_ranges), (11 * Q, 1));
    assert_eq!((stats.largest_free, stats.dirty_free_bytes), (11 * Q, 0));
}

#[test]
fn free_merges_left_right_and_both() {
    let (mut c, r) = one_region(10, true);
    let [a, b, x, d, e] = [2, 2, 2, 2, 2].map(|q| carve(&mut c, q, 1));
    free(&mut c, a, 5);
    // Left: b joins a.
    free(&mut c, b, 6);
    assert_eq!(c.free_spans(r), [span(0, 4, true, 6)]);
    // Right: d joins e.
    free(&mut c, e, 7);
    free(&mut c, d, 8);
    assert_eq!(c.free_spans(r), [span(0, 4, true, 6), span(6, 4, true, 8)]);
    // Both: x joins both, and the region is one free range again.
    free(&mut c, x, 9);
    assert_eq!(c.free_spans(r), [span(0, 10, true, 9)]);
    assert_eq!(c.wholly_free(r), Some(9));
    assert_eq!(c.stats().free_ranges, 1);
}

#[test]
fn a_merge_with_a_clean_range_is_dirty_and_takes_the_latest_stamp() {
    let (mut c, r) = one_region(8, true);
    let a = carve(&mut c, 2, 1);
    free(&mut c, a, 4);
    assert_eq!(c.free_spans(r), [span(0, 8, true, 4)]);
    assert_eq!(c.stats().dirty_free_bytes, 8 * Q);
}

#[test]
fn regions_never_merge_even_when_adjacent() {
    let mut c = Carver::new(Q);
    // Added in descending address order, touching.
    let high = c.add_region(BASE + 4 * Q, 4 * Q, 0, false).unwrap();
    let low = c.add_region(BASE, 4 * Q, 0, false).unwrap();
    c.check();
    let listed: Vec<_> = c.regions().collect();
    assert_eq!(listed, [(low, BASE, 4 * Q), (high, BASE + 4 * Q, 4 * Q)]);
    // No block straddles the two.
    assert_eq!(c.carve(5 * Q, 1), Ok(None));
    let x = carve(&mut c, 4, 1);
    let y = carve(&mut c, 4, 1);
    assert_ne!(x.region, y.region);
    free(&mut c, x, 1);
    free(&mut c, y, 1);
    assert_eq!(c.stats().free_ranges, 2);
    assert_eq!(c.wholly_free(low), Some(1));
    assert_eq!(c.wholly_free(high), Some(1));
    assert_eq!(c.carve(8 * Q, 1), Ok(None));
}

#[test]
fn alignment_padding_stays_free_and_is_reused() {
    let mut c = Carver::new(Q);
    let r = c.add_region(BASE + Q, 32 * Q, 3, false).unwrap();
    let a = c.carve(2 * Q, 8 * Q).unwrap().unwrap();
    c.check();
    assert_eq!(a.addr, BASE + 8 * Q);
    // Padding and tail inherit the source's dirty flag and stamp.
    assert_eq!(
        c.free_spans(r),
        [span(1, 7, true, 3), span(10, 23, true, 3)]
    );
    // The padding serves the next request that fits it exactly.
    let b = carve(&mut c, 7, 1);
    assert_eq!(b.addr, BASE + Q);
    assert_eq!(c.free_spans(r), [span(10, 23, true, 3)]);
    // An alignment below the quantum means the quantum.
    let d = c.carve(Q, 8).unwrap().unwrap();
    assert_eq!(d.addr, BASE + 10 * Q);
    c.check();
}

#[test]
fn a_range_that_fits_only_by_its_alignment_is_found() {
    let (mut c, r) = one_region(16, true);
    let _a = carve(&mut c, 8, 1);
    let b = carve(&mut c, 4, 1);
    let _rest = carve(&mut c, 4, 1);
    free(&mut c, b, 1);
    // 4 quanta at 8-quanta alignment: a good fit would need 11 quanta, but the free range at
    // BASE + 8Q is aligned already.
    let x = c.carve(4 * Q, 8 * Q).unwrap().unwrap();
    assert_eq!(x.addr, BASE + 8 * Q);
    c.check();
    assert!(c.free_spans(r).is_empty());
}

#[test]
fn good_fit_rounds_to_a_class_and_falls_back_to_an_exact_fit() {
    // Free ranges of 101 and 110 quanta. Classes above 64 quanta are 1/32 of a power of two
    // wide: 101 quanta share a class with 100, so a request of 101 searches from the class of
    // 102 and takes the larger range.
    let (mut c, r) = one_region(101 + 1 + 110 + 1, true);
    let [a, _s, b, _t] = [101, 1, 110, 1].map(|q| carve(&mut c, q, 1));
    free(&mut c, a, 1);
    free(&mut c, b, 2);
    let x = carve(&mut c, 101, 1);
    assert_eq!(x.addr, b.addr);
    // Only the exact range is left that fits: the scan below the good-fit class finds it.
    let y = carve(&mut c, 101, 1);
    assert_eq!(y.addr, a.addr);
    assert_eq!(c.carve(101 * Q, 1), Ok(None));
    assert_eq!(c.free_spans(r), [span(101 + 1 + 101, 9, true, 2)]);
}

#[test]
fn sizes_are_rounded_to_the_quantum() {
    assert_eq!(Carver::new(3).quantum, 4);
    assert_eq!(Carver::new(0).quantum, 1);
    let (mut c, _) = one_region(16, true);
    assert_eq!(c.carve(1, 1).unwrap().unwrap().size, Q);
    assert_eq!(c.carve(0, 1).unwrap().unwrap().size, Q);
    assert_eq!(c.carve(Q + 1, 1).unwrap().unwrap().size, 2 * Q);
    assert_eq!(c.carve(usize::MAX, 1), Ok(None));
    assert_eq!(c.carve(Q, 1 << (usize::BITS - 1)), Ok(None));
    c.check();
    assert_eq!(c.stats().used_bytes, 4 * Q);
}

#[test]
fn grow_in_place_takes_from_the_free_range_after() {
    let (mut c, r) = one_region(16, false);
    let a = carve(&mut c, 2, 1);
    let b = carve(&mut c, 2, 1);
    // a is followed by a used range.
    assert!(!c.grow_in_place(a.handle, a.addr, 3 * Q));
    // Rounded up to 5 quanta, taken from the tail, which keeps its stamp.
    assert!(c.grow_in_place(b.handle, b.addr, 4 * Q + 1));
    c.check();
    assert_eq!(c.free_spans(r), [span(7, 9, true, 0)]);
    // All of the tail.
    assert!(c.grow_in_place(b.handle, b.addr, 14 * Q));
    c.check();
    assert!(c.free_spans(r).is_empty());
    assert!(!c.grow_in_place(b.handle, b.addr, 15 * Q));
    // Already that size: nothing to do; smaller: not a growth.
    assert!(c.grow_in_place(b.handle, b.addr, 14 * Q));
    assert!(!c.grow_in_place(b.handle, b.addr, 13 * Q));
    assert_eq!(
        c.used_containing(BASE + 15 * Q).map(|x| x.size),
        Some(14 * Q)
    );
    assert_eq!(c.stats().used_bytes, 16 * Q);
    c.check();
}

#[test]
fn shrink_in_place_frees_the_tail_and_merges_it() {
    let (mut c, r) = one_region(16, true);
    let a = carve(&mut c, 8, 1);
    let b = carve(&mut c, 8, 1);
    // Nothing free after b: the tail is a new range (rounded: 5 quanta + 1 byte keeps 6).
    assert_eq!(c.shrink_in_place(b.handle, b.addr, 5 * Q + 1, 10), Ok(true));
    c.check();
    assert_eq!(c.free_spans(r), [span(14, 2, true, 10)]);
    // Now the tail merges with the free range after it.
    assert_eq!(c.shrink_in_place(b.handle, b.addr, 4 * Q, 20), Ok(true));
    c.check();
    assert_eq!(c.free_spans(r), [span(12, 4, true, 20)]);
    // a is followed by b: its tail is a range of its own.
    assert_eq!(c.shrink_in_place(a.handle, a.addr, 7 * Q, 30), Ok(true));
    c.check();
    assert_eq!(
        c.free_spans(r),
        [span(7, 1, true, 30), span(12, 4, true, 20)]
    );
    // Not shrinks: to nothing, to more; the same size is already done.
    assert_eq!(c.shrink_in_place(a.handle, a.addr, 0, 40), Ok(false));
    assert_eq!(c.shrink_in_place(a.handle, a.addr, 8 * Q, 40), Ok(false));
    assert_eq!(c.shrink_in_place(a.handle, a.addr, 7 * Q, 40), Ok(true));
    assert_eq!(c.stats().used_bytes, 11 * Q);
    c.check();
}

#[test]
fn take_idle_takes_the_oldest_dirty_ranges_first() {
    let (mut c, r) = one_region(16, true);
    let parts = [2; 8].map(|q| carve(&mut c, q, 1));
    // Freed out of address order and with a clock that went back once.
    free(&mut c, parts[4], 20);
    free(&mut c, parts[0], 10);
    free(&mut c, parts[2], 30);
    free(&mut c, parts[6], 15);
    assert_eq!(c.take_idle(9), None);
    let first = c.take_idle(25).unwrap();
    let second = c.take_idle(25).unwrap();
    let third = c.take_idle(25).unwrap();
    c.check();
    assert_eq!(
        [first.addr, second.addr, third.addr],
        [parts[0].addr, parts[6].addr, parts[4].addr]
    );
    assert_eq!(c.take_idle(25), None);
    // Taken ranges are used: no carve hands them out, no free merges with them.
    assert_eq!(c.stats().used_ranges, 8 - 4 + 3);
    assert_eq!(c.used_containing(first.addr), Some(first));
    clean(&mut c, first);
    assert_eq!(c.free_spans(r)[0], span(0, 2, false, 10));
    assert_eq!(c.take_idle(u64::MAX).map(|x| x.addr), Some(parts[2].addr));
}

#[test]
fn clean_ranges_merge_by_the_rules() {
    let (mut c, r) = one_region(8, true);
    let [x, y, z, w] = [2; 4].map(|q| carve(&mut c, q, 1));
    free(&mut c, x, 10);
    free(&mut c, z, 20);
    // Clean between two dirty ranges: dirty, with the latest of their stamps.
    clean(&mut c, y);
    assert_eq!(c.free_spans(r), [span(0, 6, true, 20)]);
    // Purged, it comes back clean with the stamp it had when it went idle.
    let idle = c.take_idle(20).unwrap();
    assert_eq!((idle.addr, idle.size), (BASE, 6 * Q));
    clean(&mut c, idle);
    assert_eq!(c.free_spans(r), [span(0, 6, false, 20)]);
    assert_eq!(c.stats().dirty_free_bytes, 0);
    // Dirty next to clean: dirty, stamped now.
    free(&mut c, w, 30);
    assert_eq!(c.free_spans(r), [span(0, 8, true, 30)]);
    let idle = c.take_idle(30).unwrap();
    clean(&mut c, idle);
    assert_eq!(c.wholly_free(r), Some(30));
    // Clean next to clean stays clean, with the latest stamp.
    let v = carve(&mut c, 3, 1);
    clean(&mut c, v);
    assert_eq!(c.free_spans(r), [span(0, 8, false, 30)]);
    assert_eq!(c.take_idle(u64::MAX), None);
}

#[test]
fn only_dirty_regions_start_idle() {
    let mut c = Carver::new(Q);
    c.add_region(BASE, 4 * Q, 5, true).unwrap();
    assert_eq!(c.take_idle(u64::MAX), None);
    let dirty = c.add_region(BASE + 8 * Q, 4 * Q, 6, false).unwrap();
    c.check();
    assert_eq!(c.stats().dirty_free_bytes, 4 * Q);
    let idle = c.take_idle(6).unwrap();
    assert_eq!(
        (idle.addr, idle.size, idle.region),
        (BASE + 8 * Q, 4 * Q, dirty)
    );
    // Taken, the region is not wholly free.
    assert_eq!(c.wholly_free(dirty), None);
    assert_eq!(c.remove_region(dirty), None);
    clean(&mut c, idle);
    assert_eq!(c.wholly_free(dirty), Some(6));
}

#[test]
fn remove_region_only_when_wholly_free_and_ids_are_reused() {
    let mut c = Carver::new(Q);
    let one = c.add_region(BASE, 8 * Q, 0, true).unwrap();
    let two = c.add_region(BASE + 16 * Q, 4 * Q, 0, true).unwrap();
    // Only `one` holds 6 quanta.
    let a = c.carve(6 * Q, 1).unwrap().unwrap();
    assert_eq!(a.region, one);
    assert_eq!(c.remove_region(one), None);
    assert_eq!(c.remove_region(two), Some((BASE + 16 * Q, 4 * Q)));
    assert_eq!(c.remove_region(two), None);
    assert_eq!(c.remove_region(77), None);
    c.check();
    let three = c.add_region(BASE + 32 * Q, 4 * Q, 0, true).unwrap();
    assert_eq!(three, two);
    free(&mut c, a, 1);
    assert_eq!(c.remove_region(one), Some((BASE, 8 * Q)));
    c.check();
    assert_eq!(
        c.regions().collect::<Vec<_>>(),
        [(three, BASE + 32 * Q, 4 * Q)]
    );
    assert_eq!(c.remove_region(three), Some((BASE + 32 * Q, 4 * Q)));
    c.check();
    assert_eq!(c.stats(), CarverStats::default());
}

#[test]
fn stale_handles_are_refused() {
    let (mut c, _) = one_region(16, false);
    let a = carve(&mut c, 2, 1);
    let b = carve(&mut c, 2, 1);
    free(&mut c, a, 1);
    let before = c.stats();
    assert_eq!(c.free(a.handle, a.addr, 2), None);
    assert_eq!(c.give_back_clean(a.handle, a.addr), None);
    assert!(!c.grow_in_place(a.handle, a.addr, 3 * Q));
    assert_eq!(c.shrink_in_place(a.handle, a.addr, Q, 2), Ok(false));
    // A live handle with another address, and handles that name no node.
    assert_eq!(c.free(b.handle, b.addr + Q, 2), None);
    assert_eq!(c.free(NONE, b.addr, 2), None);
    assert_eq!(c.free(12_345, b.addr, 2), None);
    // A reused node at another address is not the old range.
    let d = carve(&mut c, 3, 1);
    if d.handle == a.handle {
        assert_ne!(d.addr, a.addr);
    }
    assert_eq!(c.free(a.handle, a.addr, 2), None);
    assert_eq!(c.stats().used_ranges, before.used_ranges + 1);
    c.check();
}

#[test]
fn used_containing_finds_the_range_around_an_address() {
    let mut c = Carver::new(Q);
    c.add_region(BASE + 64 * Q, 8 * Q, 0, true).unwrap();
    c.add_region(BASE, 8 * Q, 0, true).unwrap();
    let a = c.carve(2 * Q, 1).unwrap().unwrap();
    let b = c.carve(3 * Q, 1).unwrap().unwrap();
    for addr in [a.addr, a.addr + 1, a.addr + a.size - 1] {
        assert_eq!(c.used_containing(addr), Some(a));
    }
    assert_eq!(c.used_containing(a.addr + a.size), Some(b));
    assert_eq!(c.used_containing(b.addr + b.size), None);
    assert_eq!(c.used_containing(0), None);
    assert_eq!(c.used_containing(BASE + 40 * Q), None);
    assert_eq!(c.used_containing(usize::MAX), None);
}

#[test]
fn released_nodes_are_reused_before_the_table_grows() {
    let (mut c, _) = one_region(64, false);
    for round in 0..3 {
        let ranges: Vec<Range> = (1..8).map(|q| carve(&mut c, q, Q << (q % 3))).collect();
        for r in ranges.into_iter().rev() {
            free(&mut c, r, round);
        }
        if round == 0 {
            assert!(c.nodes.len() <= 16);
        }
    }
    // Three rounds of the same carves needed no more slots than the first.
    assert!(c.nodes.len() <= 16);
    assert_eq!(c.stats().free_ranges, 1);
}

#[test]
#[cfg(target_pointer_width = "64")]
fn a_node_is_56_bytes() {
    assert_eq!(size_of::<Node>(), 56);
}

#[test]
fn a_range_whose_purge_failed_is_not_taken_again_until_it_merges() {
    let (mut c, r) = one_region(10, true);
    let [x, k1, y, k2, z] = [2; 5].map(|q| carve(&mut c, q, 1));
    free(&mut c, x, 10);
    free(&mut c, y, 20);
    let taken = [c.take_idle(30).unwrap(), c.take_idle(30).unwrap()];
    for t in taken {
        assert_eq!(c.give_back_unpurged(t.handle, t.addr), Some(t));
        c.check();
    }
    // Dirty with the stamps they had, out of decay's sight.
    assert_eq!(
        c.free_spans(r)[..2],
        [span(0, 2, true, 10), span(4, 2, true, 20)]
    );
    assert_eq!(c.take_idle(u64::MAX), None);
    let stats = c.stats();
    assert_eq!(
        (stats.dirty_free_bytes, stats.unpurgeable_bytes),
        (4 * Q, 4 * Q)
    );
    assert_eq!(c.unpurgeable_bytes(), 4 * Q);
    // What a carve leaves of one stays unpurgeable; freed again, the block merges with it.
    let piece = carve(&mut c, 1, 1);
    assert_eq!(piece.addr, y.addr, "the latest range of its class");
    assert_eq!(c.free_spans(r)[1], span(5, 1, true, 20));
    assert_eq!(c.take_idle(u64::MAX), None);
    free(&mut c, piece, 40);
    assert_eq!(c.free_spans(r)[1], span(4, 2, true, 40));
    let again = c.take_idle(u64::MAX).unwrap();
    assert_eq!((again.addr, again.size), (y.addr, 2 * Q));
    clean(&mut c, again);
    // A neighbour freed beside one makes the whole worth a purge again.
    free(&mut c, k1, 50);
    assert_eq!(c.free_spans(r)[0], span(0, 6, true, 50));
    assert_eq!(c.stats().unpurgeable_bytes, 0);
    assert_eq!(c.take_idle(u64::MAX).map(|t| t.size), Some(6 * Q));
    // A region that is one unpurgeable range can still be released whole.
    let (mut c, r) = one_region(4, false);
    let t = c.take_idle(u64::MAX).unwrap();
    assert_eq!(c.give_back_unpurged(t.handle, t.addr), Some(t));
    c.check();
    assert_eq!(
        (c.stats().unpurgeable_bytes, c.unpurgeable_bytes()),
        (4 * Q, 0)
    );
    assert_eq!(c.remove_region(r), Some((BASE, 4 * Q)));
    let _ = (k2, z);
}
