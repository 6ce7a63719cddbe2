//! The chunk's granule bookkeeping: populated once, zeroed only when dirty, purged whole; a
//! pool's memory: its registration ranges, its shared file source (one mapping at a time, purged
//! in the file).

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

/// A memory file of `len` bytes as a shared file source.
#[cfg(target_os = "linux")]
fn shared_file(len: usize) -> std::sync::Arc<SharedFile> {
    let fd = crate::sys::memfd(c"numa-gpu-alloc chunk test", false, false).unwrap();
    let file = std::fs::File::from(fd);
    file.set_len(len as u64).unwrap();
    std::sync::Arc::new(SharedFile::new(file.into()))
}

#[test]
#[cfg(target_os = "linux")]
fn a_pools_memory_has_one_registration_range_per_chunk_after_its_header() {
    let mapping = Mapping::held(shared_file(11 * MIB), 11 * MIB, 2 * MIB).unwrap();
    let memory = Memory::ranged(mapping, 2 * MIB, 4 * MIB).unwrap();
    assert_eq!(memory.ranges(), 3);
    assert_eq!(memory.range(0), Some((2 * MIB, 4 * MIB)));
    assert_eq!(
        memory.range(2),
        Some((10 * MIB, MIB)),
        "the last to the end"
    );
    assert_eq!(memory.range(3), None);
    assert_eq!(memory.registered(), (0, 0));
    assert!(!memory.pinned() && !memory.range_registered(0));
    let whole = Memory::new(Mapping::new(&ANONYMOUS, 4 * MIB, 2 * MIB).unwrap());
    assert_eq!((whole.ranges(), whole.range(0)), (1, Some((0, 4 * MIB))));
    let mapping = Mapping::held(shared_file(4 * MIB), 4 * MIB, 2 * MIB).unwrap();
    assert!(
        Memory::ranged(mapping, 4 * MIB, 2 * MIB).is_err(),
        "no range"
    );
}

#[test]
#[cfg(target_os = "linux")]
fn a_shared_file_is_mapped_once_at_a_time_and_purged_to_zero_in_the_file() {
    let len = 4 * MIB;
    let source = shared_file(len);
    let mut mapping = Mapping::held(source.clone(), len, 2 * MIB).unwrap();
    assert!(
        mapping.process_source().is_none(),
        "held, not the process's"
    );
    assert!(
        Mapping::held(source.clone(), len, 2 * MIB).is_err(),
        "a second mapping would alias the first"
    );
    let page = crate::sys::page_size();
    mapping.whole().zero();
    let part = mapping.part(page, page).unwrap();
    // SAFETY: inside the mapping, borrowed alone.
    unsafe { part.ptr().as_ptr().write_bytes(7, page) };
    // SAFETY: the part's page, ours alone and unregistered.
    unsafe { source.purge(part.ptr(), page) }.unwrap();
    let mut byte = [0u8];
    // The file itself reads zero: the page left it, not only this mapping.
    std::os::unix::fs::FileExt::read_exact_at(
        &std::fs::File::from(source.fd().try_clone_to_owned().unwrap()),
        &mut byte,
        page as u64,
    )
    .unwrap();
    assert_eq!(byte, [0]);
    assert!(
        Chunk::new(mapping, 2 * MIB).is_err(),
        "arenas take chunks only from sources for the whole process"
    );
    // Given back with the refused chunk: mapped again.
    let again = Mapping::held(source, len, 2 * MIB).unwrap();
    assert_eq!(again.len(), len);
}

#[test]
#[cfg(target_os = "linux")]
fn memory_never_registered_unregisters_nothing_and_unmaps() {
    let mapping = Mapping::held(shared_file(4 * MIB), 4 * MIB, 2 * MIB).unwrap();
    let memory = Memory::ranged(mapping, 2 * MIB, 2 * MIB).unwrap();
    let released = memory.release();
    assert!(released.unmapped && released.unregistered.is_none());
}
