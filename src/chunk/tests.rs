//! The chunk's granule bookkeeping: populated once, zeroed only when dirty, purged whole.

use super::*;

const MIB: usize = 1 << 20;

fn chunk(len: usize, granule: usize) -> Chunk {
    Chunk::new(Mapping::new(&ANONYMOUS, len, 2 * MIB).unwrap(), granule).unwrap()
}

#[test]
fn each_granule_is_populated_once_in_the_callers_range() {
    let mut c = chunk(8 * MIB, 2 * MIB);
    let base = c.base();
    // 3 MiB at 1 MiB touches granules 0 and 1: populated in the range only.
    assert_eq!(
        c.plan_populate(base + MIB, 3 * MIB),
        Some(Span {
            addr: base + MIB,
            len: 3 * MIB
        })
    );
    assert_eq!(c.resident(), 4 * MIB);
    assert_eq!(
        c.plan_populate(base + 2 * MIB, MIB),
        None,
        "granule 1 is resident"
    );
    assert_eq!(
        c.plan_populate(base + 3 * MIB, 2 * MIB),
        Some(Span {
            addr: base + 4 * MIB,
            len: MIB
        })
    );
    assert!(c.any_resident(base + 5 * MIB, 100));
    assert!(!c.any_resident(base + 6 * MIB, MIB));
}

#[test]
fn only_dirty_granules_are_zeroed_and_purging_cleans_them() {
    let page = crate::sys::page_size();
    let mut c = chunk(8 * MIB, page);
    let base = c.base();
    assert_eq!(c.hand_out(base, 2 * page), None, "fresh memory is zero");
    assert_eq!(
        c.hand_out(base + page, 2 * page),
        Some(Span {
            addr: base + page,
            len: page
        }),
        "the page handed out before"
    );
    c.plan_populate(base, 4 * page);
    // Only whole granules inside the free range are purged.
    assert_eq!(
        c.plan_purge(base + 100, 3 * page),
        Some(Span {
            addr: base + page,
            len: 2 * page
        })
    );
    assert_eq!(c.resident(), 2 * page);
    assert_eq!(c.hand_out(base + page, page), None, "purged: zero again");
}

#[test]
fn a_released_chunk_is_unmapped() {
    let c = chunk(4 * MIB, 2 * MIB);
    let released = c.release();
    assert!(released.unmapped && released.unregistered.is_none());
}
