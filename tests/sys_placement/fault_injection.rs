//! The placement calls made to fail (feature `fault-injection`): each error comes back as the
//! documented `Error`, and a fault spent leaves the next call working.

use super::*;
use numa_gpu_alloc::unstable::sys::fault::{self, FaultPoint};

/// Serialises and clears injected faults even when the test fails.
struct Injecting(#[allow(dead_code)] MutexGuard<'static, ()>);
impl Injecting {
    fn new() -> Self {
        let g = serial();
        fault::clear();
        Injecting(g)
    }
}
impl Drop for Injecting {
    fn drop(&mut self) {
        fault::clear();
    }
}

#[test]
fn mmap_fault_counts_down() {
    let _i = Injecting::new();
    let ps = sys::page_size();
    fault::inject(FaultPoint::Mmap, libc::ENOMEM, 2);
    let enomem = Err(Error::Syscall {
        call: "mmap",
        errno: libc::ENOMEM,
    });
    assert_eq!(sys::map_anonymous(ps, ps), enomem);
    // Argument checks come first and consume nothing.
    assert_eq!(
        sys::map_anonymous(0, ps),
        Err(Error::InvalidRange { addr: 0, len: 0 })
    );
    assert_eq!(fault::remaining(FaultPoint::Mmap), 1);
    assert_eq!(sys::map_anonymous(ps, GIB), enomem);
    assert_eq!(fault::remaining(FaultPoint::Mmap), 0);
    let p = sys::map_anonymous(ps, ps).unwrap();
    // SAFETY: ours.
    unsafe { sys::unmap(p, ps) }.unwrap();
}

#[test]
fn mbind_eperm_is_numa_unavailable_until_cleared() {
    let _i = Injecting::new();
    let r = Region::new(MIB);
    fault::inject(FaultPoint::Mbind, libc::EPERM, u32::MAX);
    for _ in 0..3 {
        assert_eq!(
            r.bind(MemPolicy::Bind, &node0()),
            Err(Error::NumaUnavailable {
                call: "mbind",
                errno: libc::EPERM
            })
        );
    }
    assert_eq!(fault::remaining(FaultPoint::Mbind), u32::MAX);
    fault::inject(FaultPoint::Mbind, libc::ENOSYS, 1);
    assert!(matches!(
        r.bind(MemPolicy::Bind, &node0()),
        Err(Error::NumaUnavailable {
            errno: libc::ENOSYS,
            ..
        })
    ));
    fault::inject(FaultPoint::Mbind, libc::EIO, 1);
    assert_eq!(
        r.bind(MemPolicy::Bind, &node0()),
        Err(mbind_error(libc::EIO))
    );
    r.bind(MemPolicy::Bind, &node0()).unwrap();
}

#[test]
fn populate_einval_falls_back_to_touching_once_probed() {
    let _i = Injecting::new();
    let len = 4 * MIB;
    let pages = len / sys::page_size();
    // First probe says "unknown advice" → touch fallback, remembered.
    fault::inject(FaultPoint::Populate, libc::EINVAL, 1);
    let a = Region::new(len);
    a.bind(MemPolicy::Bind, &node0()).unwrap();
    // SAFETY: ours, fresh (zeros).
    unsafe {
        assert_eq!(sys::populate(a.ptr, len), Ok(PopulateMethod::TouchPages));
        assert_eq!(sys::census(a.ptr, len, 0).unwrap().on_node, pages);
        assert_eq!(*a.ptr.as_ptr().add(len - 1), 0, "content kept");
    }
    let b = Region::new(len);
    // SAFETY: ours, fresh.
    unsafe {
        assert_eq!(sys::populate(b.ptr, len), Ok(PopulateMethod::TouchPages));
        assert_eq!(sys::census(b.ptr, len, 0).unwrap().absent, 0);
    }
    // In touch mode an injected fault is still reported.
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 1);
    // SAFETY: ours.
    assert_eq!(
        unsafe { sys::populate(b.ptr, len) },
        Err(Error::Syscall {
            call: "madvise(MADV_POPULATE_WRITE)",
            errno: libc::ENOMEM
        })
    );
    // clear() forgets the probe: madvise works on this kernel.
    fault::clear();
    let c = Region::new(len);
    // SAFETY: ours, fresh.
    unsafe {
        assert_eq!(
            sys::populate(c.ptr, len),
            Ok(PopulateMethod::MadvisePopulateWrite)
        );
    }
    // Once madvise has worked, EINVAL is a real error, not "old kernel".
    fault::inject(FaultPoint::Populate, libc::EINVAL, 1);
    // SAFETY: ours.
    assert_eq!(
        unsafe { sys::populate(c.ptr, len) },
        Err(Error::Syscall {
            call: "madvise(MADV_POPULATE_WRITE)",
            errno: libc::EINVAL
        })
    );
    // SAFETY: ours.
    assert_eq!(
        unsafe { sys::populate(c.ptr, len) },
        Ok(PopulateMethod::MadvisePopulateWrite)
    );
}

#[test]
fn populate_enomem_is_reported() {
    let _i = Injecting::new();
    let len = MIB;
    let r = Region::new(len);
    fault::inject(FaultPoint::Populate, libc::ENOMEM, 1);
    // SAFETY: ours.
    let err = unsafe { sys::populate(r.ptr, len) }.unwrap_err();
    assert_eq!(
        err,
        Error::Syscall {
            call: "madvise(MADV_POPULATE_WRITE)",
            errno: libc::ENOMEM
        }
    );
    // SAFETY: ours, untouched by the failed call.
    assert_eq!(unsafe { sys::census(r.ptr, len, 0) }.unwrap().on_node, 0);
}

#[test]
fn populate_retries_every_eintr() {
    let _i = Injecting::new();
    let len = MIB;
    let r = Region::new(len);
    // A busy signal: a thousand interrupted attempts in a row.
    fault::inject(FaultPoint::Populate, libc::EINTR, 1000);
    // SAFETY: ours, fresh (zeros).
    assert_eq!(
        unsafe { sys::populate(r.ptr, len) },
        Ok(PopulateMethod::MadvisePopulateWrite)
    );
    assert_eq!(fault::remaining(FaultPoint::Populate), 0);
    // SAFETY: ours, populated above.
    assert_eq!(unsafe { sys::census(r.ptr, len, 0) }.unwrap().absent, 0);
}

#[test]
fn move_pages_eperm_is_numa_unavailable() {
    let _i = Injecting::new();
    let len = MIB;
    let r = Region::new(len);
    fault::inject(FaultPoint::MovePages, libc::EPERM, 1);
    let mut calls = 0;
    // SAFETY: ours.
    let err = unsafe { sys::page_nodes(r.ptr, len, |_, _| calls += 1) }.unwrap_err();
    assert_eq!(
        err,
        Error::NumaUnavailable {
            call: "move_pages",
            errno: libc::EPERM
        }
    );
    assert_eq!(calls, 0);
    fault::inject(FaultPoint::MovePages, libc::ENOSYS, 1);
    // SAFETY: ours.
    assert!(matches!(
        unsafe { sys::census(r.ptr, len, 0) },
        Err(Error::NumaUnavailable {
            call: "move_pages",
            errno: libc::ENOSYS
        })
    ));
    // SAFETY: ours.
    assert!(unsafe { sys::census(r.ptr, len, 0) }.is_ok());
}

#[test]
fn injection_is_thread_safe() {
    let _i = Injecting::new();
    let ps = sys::page_size();
    fault::inject(FaultPoint::Mmap, libc::ENOMEM, 1000);
    let failures: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let mut failed = 0;
                    for _ in 0..400 {
                        match sys::map_anonymous(ps, ps) {
                            Err(_) => failed += 1,
                            // SAFETY: ours.
                            Ok(p) => unsafe { sys::unmap(p, ps) }.unwrap(),
                        }
                    }
                    failed
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(failures, 1000, "exactly `count` calls fail");
    assert_eq!(fault::remaining(FaultPoint::Mmap), 0);
}
