//! Placement syscalls against the real kernel: map → bind → populate → census.
//!
//! Written for a host with at least node 0; checks that need "exactly one node" say so.
//! Fault-injection tests (`--features fault-injection`) change process-wide state, so every test
//! in this binary takes `serial()` first.

use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

use numa_gpu_alloc::unstable::sys::{
    self, MbindFlags, MemPolicy, NodeMask, PageCensus, PopulateMethod,
};
use numa_gpu_alloc::Error;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// The lowest node id this host does not have online (5 on most test hosts would be wrong on an
/// 8-node EPYC NPS4 or SNC machine).
fn missing_node() -> usize {
    let topology = numa_gpu_alloc::NumaTopology::from_sysfs().expect("topology");
    (0..).find(|&id| !topology.contains(id)).expect("a free id")
}

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    // A failed test poisons the lock; the others should still run.
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A mapping that is unmapped on drop, so failing tests don't leak 64 MiB each.
struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

impl Region {
    fn new(len: usize) -> Self {
        let ptr = sys::map_anonymous(len, sys::page_size()).expect("mmap");
        Region { ptr, len }
    }

    /// Binds the whole region to `mask` with `policy` and the default flags.
    fn bind(&self, policy: MemPolicy, mask: &NodeMask) -> Result<(), Error> {
        // SAFETY: the mapping is ours for as long as `self` lives.
        unsafe { sys::bind(self.ptr, self.len, policy, mask, MbindFlags::default()) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping was created in `new` and is not used after drop.
        unsafe { sys::unmap(self.ptr, self.len) }.expect("munmap");
    }
}

fn node0() -> NodeMask {
    NodeMask::single(0).unwrap()
}

/// What a failed `mbind` call returns.
fn mbind_error(errno: i32) -> Error {
    Error::Syscall {
        call: "mbind",
        errno,
    }
}

fn bind_populate_and_count(policy: MemPolicy) {
    let len = 64 * MIB;
    let r = Region::new(len);
    r.bind(policy, &node0()).unwrap();
    // SAFETY: the region is ours and fresh (still all zeros).
    let method = unsafe { sys::populate(r.ptr, len) }.unwrap();
    // Kernel 6.18 here: the madvise path is expected (the fallback is tested with injection).
    assert_eq!(method, PopulateMethod::MadvisePopulateWrite);
    let pages = len / sys::page_size();
    // SAFETY: the region is ours.
    let census = unsafe { sys::census(r.ptr, len, 0) }.unwrap();
    assert_eq!(
        census,
        PageCensus {
            pages,
            on_node: pages,
            elsewhere: 0,
            absent: 0
        }
    );
    if sys::page_size() == 4096 {
        assert_eq!(census.pages, 16384);
    }
    let mut seen = 0;
    // SAFETY: the region is ours.
    unsafe {
        sys::page_nodes(r.ptr, len, |i, node| {
            assert_eq!(i, seen, "pages are reported in order");
            assert_eq!(node, 0, "page {i}");
            seen += 1;
        })
    }
    .unwrap();
    assert_eq!(seen, pages);
    // The memory is usable and reads back.
    // SAFETY: populated, writable, ours.
    unsafe {
        r.ptr.as_ptr().write(7);
        r.ptr.as_ptr().add(len - 1).write(9);
        assert_eq!(*r.ptr.as_ptr(), 7);
        assert_eq!(*r.ptr.as_ptr().add(len - 1), 9);
    }
}

#[test]
fn bind_to_node0_and_populate_places_every_page() {
    let _g = serial();
    bind_populate_and_count(MemPolicy::Bind);
}

#[test]
fn preferred_node0_places_every_page() {
    let _g = serial();
    bind_populate_and_count(MemPolicy::Preferred);
}

#[test]
fn interleave_over_node0_places_every_page() {
    let _g = serial();
    let len = 4 * MIB;
    let r = Region::new(len);
    // SAFETY: ours, fresh.
    unsafe {
        sys::bind(
            r.ptr,
            len,
            MemPolicy::Interleave,
            &node0(),
            MbindFlags {
                strict: true,
                move_existing: true,
            },
        )
        .unwrap();
        sys::populate(r.ptr, len).unwrap();
        let c = sys::census(r.ptr, len, 0).unwrap();
        assert_eq!(c.on_node, len / sys::page_size());
    }
}

#[test]
fn fresh_mapping_has_no_pages() {
    let _g = serial();
    let len = 2 * MIB;
    let r = Region::new(len);
    let mut statuses = Vec::new();
    // SAFETY: ours.
    unsafe { sys::page_nodes(r.ptr, len, |_, s| statuses.push(s)) }.unwrap();
    assert_eq!(statuses.len(), len / sys::page_size());
    assert!(
        statuses.iter().all(|&s| s == -libc::ENOENT),
        "expected -ENOENT everywhere, got {:?}",
        &statuses[..8]
    );
    // SAFETY: ours.
    let c = unsafe { sys::census(r.ptr, len, 0) }.unwrap();
    assert_eq!(c.absent, c.pages);
    assert_eq!(c.on_node + c.elsewhere, 0);
}

#[test]
fn partly_touched_mapping_is_counted_per_page() {
    let _g = serial();
    let ps = sys::page_size();
    let len = 600 * ps; // more than one move_pages batch of 512
    let r = Region::new(len);
    // SAFETY: ours, writable.
    unsafe {
        r.ptr.as_ptr().write(1);
        r.ptr.as_ptr().add(550 * ps).write(1);
    }
    let mut present = Vec::new();
    // SAFETY: ours.
    unsafe {
        sys::page_nodes(r.ptr, len, |i, s| {
            if s >= 0 {
                present.push(i)
            }
        })
    }
    .unwrap();
    assert_eq!(present, [0, 550]);
    // SAFETY: ours.
    let c = unsafe { sys::census(r.ptr, len, 0) }.unwrap();
    assert_eq!((c.pages, c.on_node, c.absent), (600, 2, 598));
}

#[test]
fn binding_to_a_missing_node_is_a_clear_error() {
    let _g = serial();
    let r = Region::new(MIB);
    let err = r
        .bind(MemPolicy::Bind, &NodeMask::single(missing_node()).unwrap())
        .unwrap_err();
    assert_eq!(err, mbind_error(libc::EINVAL));
    assert!(err.to_string().contains("mbind"), "{err}");
    // Node 1023 (the last a mask can hold) does not exist either.
    let err = r.bind(MemPolicy::Preferred, &NodeMask::single(1023).unwrap());
    assert_eq!(err, Err(mbind_error(libc::EINVAL)));
}

#[test]
fn empty_mask_with_bind_is_einval() {
    let _g = serial();
    let r = Region::new(MIB);
    let err = r.bind(MemPolicy::Bind, &NodeMask::empty());
    assert_eq!(err, Err(mbind_error(libc::EINVAL)));
}

#[test]
fn misaligned_or_empty_ranges_are_rejected_before_the_kernel() {
    let _g = serial();
    let ps = sys::page_size();
    let r = Region::new(4 * ps);
    // SAFETY: offset stays inside the region.
    let odd = unsafe { NonNull::new_unchecked(r.ptr.as_ptr().add(1)) };
    let range = |addr: NonNull<u8>, len| Error::InvalidRange {
        addr: addr.as_ptr() as usize,
        len,
    };
    // SAFETY (all calls below): the arguments are rejected before any memory is touched.
    unsafe {
        let flags = MbindFlags::default();
        assert_eq!(
            sys::bind(odd, ps, MemPolicy::Bind, &node0(), flags),
            Err(range(odd, ps))
        );
        assert_eq!(
            sys::bind(r.ptr, 0, MemPolicy::Bind, &node0(), flags),
            Err(range(r.ptr, 0))
        );
        assert_eq!(sys::populate(odd, ps), Err(range(odd, ps)));
        assert_eq!(sys::populate(r.ptr, 0), Err(range(r.ptr, 0)));
        assert_eq!(sys::advise_hugepage(odd, ps), Err(range(odd, ps)));
        assert_eq!(sys::advise_dontneed(r.ptr, 0), Err(range(r.ptr, 0)));
        assert_eq!(sys::page_nodes(odd, ps, |_, _| {}), Err(range(odd, ps)));
        assert_eq!(sys::census(r.ptr, 0, 0), Err(range(r.ptr, 0)));
        assert_eq!(sys::unmap(odd, ps), Err(range(odd, ps)));
        // A range that wraps around the address space.
        assert_eq!(
            sys::populate(r.ptr, usize::MAX - ps),
            Err(range(r.ptr, usize::MAX - ps))
        );
    }
    // Nothing above touched the region: still no pages.
    // SAFETY: ours.
    let c = unsafe { sys::census(r.ptr, 4 * ps, 0) }.unwrap();
    assert_eq!(c.absent, 4);
}

#[test]
fn map_anonymous_rejects_bad_sizes() {
    let _g = serial();
    let ps = sys::page_size();
    let bad = |len| Error::InvalidRange { addr: 0, len };
    assert_eq!(sys::map_anonymous(0, ps), Err(bad(0)));
    assert_eq!(sys::map_anonymous(ps + 1, ps), Err(bad(ps + 1)));
    assert_eq!(sys::map_anonymous(ps, 3 * ps), Err(bad(ps)));
    assert_eq!(sys::map_anonymous(ps, 0), Err(bad(ps)));
    assert_eq!(
        sys::map_anonymous(usize::MAX - ps + 1, GIB),
        Err(bad(usize::MAX - ps + 1))
    );
    // Too big for the address space: the kernel says ENOMEM.
    let huge = (usize::MAX / 2) & !(ps - 1);
    assert_eq!(
        sys::map_anonymous(huge, ps),
        Err(Error::Syscall {
            call: "mmap",
            errno: libc::ENOMEM
        })
    );
}

#[test]
fn binding_or_populating_an_unmapped_range_is_an_error() {
    let _g = serial();
    let len = 4 * MIB;
    let ptr = sys::map_anonymous(len, sys::page_size()).unwrap();
    // SAFETY: ours, unmapped once and never dereferenced afterwards.
    unsafe { sys::unmap(ptr, len) }.unwrap();
    // SAFETY: the range is unmapped; the kernel checks that and fails.
    let err = unsafe { sys::bind(ptr, len, MemPolicy::Bind, &node0(), MbindFlags::default()) }
        .unwrap_err();
    match err {
        Error::Syscall {
            call: "mbind",
            errno,
        } => assert!(errno == libc::EFAULT || errno == libc::ENOMEM, "{err}"),
        other => panic!("unexpected {other:?}"),
    }
    // SAFETY: as above; MADV_POPULATE_WRITE answers ENOMEM for a hole, it does not fault.
    let err = unsafe { sys::populate(ptr, len) }.unwrap_err();
    assert_eq!(
        err,
        Error::Syscall {
            call: "madvise(MADV_POPULATE_WRITE)",
            errno: libc::ENOMEM
        }
    );
    // move_pages reports holes per page.
    // SAFETY: page tables are only read.
    let c = unsafe { sys::census(ptr, len, 0) }.unwrap();
    assert_eq!(c.absent, c.pages);
}

#[test]
fn one_gib_alignment() {
    let _g = serial();
    let len = 2 * MIB;
    let ptr = sys::map_anonymous(len, GIB).unwrap();
    assert_eq!(ptr.as_ptr() as usize % GIB, 0);
    // (That exactly `len` stays mapped is checked in over_mapping_leaves_exactly_len_mapped.)
    // SAFETY: ours, writable.
    unsafe {
        ptr.as_ptr().write(1);
        ptr.as_ptr().add(len - 1).write(1);
        sys::unmap(ptr, len).unwrap();
    }
    // Large length with large alignment.
    let len = GIB;
    let ptr = sys::map_anonymous(len, GIB).unwrap();
    assert_eq!(ptr.as_ptr() as usize % GIB, 0);
    // SAFETY: ours.
    unsafe { sys::unmap(ptr, len) }.unwrap();
}

#[test]
fn over_mapping_leaves_exactly_len_mapped() {
    let _g = serial();
    let ps = sys::page_size();
    let len = 2 * MIB;
    let align = 64 * MIB;
    let ptr = sys::map_anonymous(len, align).unwrap();
    let addr = ptr.as_ptr() as usize;
    assert_eq!(addr % align, 0);
    let mapped = |start: usize, size: usize| -> bool {
        // mincore fails with ENOMEM on any unmapped page of the range.
        let mut vec = [0u8; 1];
        // SAFETY: mincore only reads page tables; vec holds one entry per page (size == ps).
        unsafe { libc::mincore(start as *mut libc::c_void, size, vec.as_mut_ptr()) == 0 }
    };
    assert!(mapped(addr, ps));
    assert!(mapped(addr + len - ps, ps));
    // The trimmed head and tail are gone (nothing else maps there this soon, in a serial test).
    assert!(!mapped(addr - ps, ps));
    assert!(!mapped(addr + len, ps));
    // SAFETY: ours.
    unsafe { sys::unmap(ptr, len) }.unwrap();
}

#[test]
fn advise_hugepage_and_free() {
    let _g = serial();
    let len = 4 * MIB;
    let ptr = sys::map_anonymous(len, 2 * MIB).unwrap();
    // SAFETY: ours, fresh.
    unsafe {
        // THP may be compiled out; then EINVAL is the documented answer.
        match sys::advise_hugepage(ptr, len) {
            Ok(()) => {}
            Err(Error::Syscall { errno, .. }) => assert_eq!(errno, libc::EINVAL),
            Err(e) => panic!("{e}"),
        }
        sys::bind(ptr, len, MemPolicy::Bind, &node0(), MbindFlags::default()).unwrap();
        sys::populate(ptr, len).unwrap();
        ptr.as_ptr().write(42);
        sys::advise_dontneed(ptr, len).unwrap();
        let c = sys::census(ptr, len, 0).unwrap();
        assert_eq!(c.absent, c.pages, "DONTNEED dropped the pages");
        assert_eq!(*ptr.as_ptr(), 0, "and they read back as zero");
        sys::unmap(ptr, len).unwrap();
    }
}

#[test]
fn current_node_is_an_online_node() {
    let _g = serial();
    let node = sys::current_node().unwrap();
    // This machine has exactly one node.
    if std::path::Path::new("/sys/devices/system/node/node1").exists() {
        assert!(std::path::Path::new(&format!("/sys/devices/system/node/node{node}")).exists());
    } else {
        assert_eq!(node, 0);
    }
}

#[test]
fn node_mask_basics() {
    assert!(NodeMask::empty().is_empty());
    assert_eq!(NodeMask::default(), NodeMask::empty());
    let mask = NodeMask::single(1023).unwrap();
    assert!(mask.contains(1023));
    assert!(!mask.contains(1022));
    assert!(!mask.contains(1024));
    assert!(!mask.contains(usize::MAX));
    assert_eq!(
        NodeMask::single(1024),
        Err(Error::UnknownNode {
            node: 1024,
            node_count: sys::MAX_NODES
        })
    );
    let mut m = NodeMask::empty();
    assert_eq!(
        m.insert(4096),
        Err(Error::UnknownNode {
            node: 4096,
            node_count: 1024
        })
    );
    assert!(m.is_empty(), "a rejected insert changes nothing");
    let m = NodeMask::from_nodes(&[64, 3, 0, 1023, 63, 3]).unwrap();
    assert_eq!(m.iter().collect::<Vec<_>>(), [0, 3, 63, 64, 1023]);
    assert_eq!(format!("{m:?}"), "NodeMask {0, 3, 63, 64, 1023}");
    assert_eq!(format!("{:?}", NodeMask::empty()), "NodeMask {}");
    assert!(NodeMask::from_nodes(&[]).unwrap().is_empty());
    assert_eq!(
        NodeMask::from_nodes(&[1, 2000, 3]),
        Err(Error::UnknownNode {
            node: 2000,
            node_count: 1024
        })
    );
    let all = NodeMask::from_nodes(&(0..1024).collect::<Vec<_>>()).unwrap();
    assert_eq!(all.iter().count(), 1024);
    assert!(all.iter().eq(0..1024));
}

#[cfg(feature = "fault-injection")]
mod fault_injection;

/// Counts heap allocations made by the current thread, to prove the syscall layer makes none.
mod no_heap {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    struct Counting;

    thread_local! {
        static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
    }

    // SAFETY: forwards to System; the counter is a const-initialised thread-local without Drop,
    // so it never allocates itself.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            ALLOCATIONS.with(|c| c.set(c.get() + 1));
            // SAFETY: forwarded contract.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: forwarded contract.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            ALLOCATIONS.with(|c| c.set(c.get() + 1));
            // SAFETY: forwarded contract.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    fn allocations() -> usize {
        ALLOCATIONS.with(|c| c.get())
    }

    #[test]
    fn placement_path_does_not_allocate() {
        let _g = serial();
        let len = 8 * MIB;
        let node0 = node0();
        let missing = NodeMask::single(super::missing_node()).unwrap();
        let before = allocations();
        let ps = sys::page_size();
        let ptr = sys::map_anonymous(len, 2 * MIB).unwrap();
        let mut sum = 0i64;
        // SAFETY: ours, fresh.
        let (census, bad) = unsafe {
            sys::advise_hugepage(ptr, len).ok();
            sys::bind(ptr, len, MemPolicy::Bind, &node0, MbindFlags::default()).unwrap();
            sys::populate(ptr, len).unwrap();
            sys::page_nodes(ptr, len, |_, n| sum += i64::from(n)).unwrap();
            let census = sys::census(ptr, len, 0).unwrap();
            // Error paths must not allocate either.
            let bad = sys::bind(ptr, len, MemPolicy::Bind, &missing, MbindFlags::default());
            sys::advise_dontneed(ptr, len).unwrap();
            sys::unmap(ptr, len).unwrap();
            (census, bad)
        };
        let _ = sys::map_anonymous(ps + 1, ps);
        let node = sys::current_node();
        let after = allocations();
        assert_eq!(after - before, 0, "heap allocations on the placement path");
        assert_eq!(census.on_node, len / ps);
        assert_eq!(sum, 0);
        assert!(bad.is_err());
        assert!(node.is_ok());
        // The counter does see this thread's allocations.
        std::hint::black_box(Vec::<u8>::with_capacity(1));
        assert!(allocations() > after);
    }
}
