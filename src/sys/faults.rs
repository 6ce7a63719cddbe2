//! What faulting fresh anonymous memory in costs, in huge pages and in small ones
//! ([`fault_costs`]).
//!
//! A fresh huge page is usually cheaper per byte than 512 small ones (one fault, one clear). On
//! some virtual machines it is several times dearer: the host took back the guest's free huge
//! blocks (free page reporting, ballooning) and backs each again, page by page, when the guest
//! first clears it. The probe asks the kernel, on this machine, now.
//!
//! Unsafe code here relies on writing only into the two fresh private mappings this module made,
//! unmapped before it returns.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use super::{advise_hugepage, advise_nohugepage, map_anonymous, page_size, unmap, HUGE_PAGE};
use crate::Result;

/// The fastest time to fault in one huge page's worth of bytes (2 MiB) of fresh anonymous
/// memory: `huge`, as one transparent huge page (advised `MADV_HUGEPAGE`); `small`, as 4 KiB
/// pages (advised `MADV_NOHUGEPAGE`), one write each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultCosts {
    /// One huge page faulted in.
    pub huge: Duration,
    /// The same bytes faulted in as small pages.
    pub small: Duration,
}

/// Faults in `groups` huge pages of one fresh mapping and as many bytes of small pages of another
/// (both mapped before either is touched, so that neither gets the other's freed pages), one
/// write per page, and returns the fastest group of each: a thread preempted during one group
/// does not count. Allocates nothing; both mappings are unmapped before it returns. About
/// `2 * groups` MiB are resident while it runs. Errors: a failed `mmap`, or a kernel that refuses
/// the advice (a kernel without transparent huge pages: [`crate::Error::Syscall`], `madvise`).
pub fn fault_costs(groups: usize) -> Result<FaultCosts> {
    let len = groups.max(1) * HUGE_PAGE;
    let huge = map_anonymous(len, HUGE_PAGE)?;
    let small = match map_anonymous(len, HUGE_PAGE) {
        Ok(small) => small,
        Err(e) => {
            // SAFETY: the mapping just made, never handed out.
            let _ = unsafe { unmap(huge, len) };
            return Err(e);
        }
    };
    // SAFETY: the two fresh mappings above, ours alone, `len` bytes each.
    let costs = unsafe { advise_hugepage(huge, len) }
        .and_then(|()| unsafe { advise_nohugepage(small, len) })
        .map(|()| FaultCosts {
            // SAFETY: as above; each is written only here.
            huge: unsafe { fastest_group(huge, len, HUGE_PAGE) },
            // SAFETY: as above.
            small: unsafe { fastest_group(small, len, page_size()) },
        });
    // SAFETY: the two mappings above, unmapped once, nothing points into them any more.
    unsafe {
        let _ = unmap(huge, len);
        let _ = unmap(small, len);
    }
    costs
}

/// Writes one byte per `step` bytes of `base..base+len`, timing each huge page's worth of
/// bytes; the fastest.
///
/// # Safety
///
/// `base..base+len` is a writable mapping of the caller's alone; `len` is a multiple of
/// [`HUGE_PAGE`] and `step` divides it.
unsafe fn fastest_group(base: NonNull<u8>, len: usize, step: usize) -> Duration {
    let mut fastest = Duration::MAX;
    for group in (0..len).step_by(HUGE_PAGE) {
        let start = Instant::now();
        for offset in (group..group + HUGE_PAGE).step_by(step) {
            // SAFETY: inside the caller's writable mapping (offset < len); volatile, so that the
            // write (the fault it causes) happens here.
            unsafe { base.as_ptr().add(offset).write_volatile(1) };
        }
        fastest = fastest.min(start.elapsed());
    }
    fastest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_fault_costs_are_measured() {
        let costs = fault_costs(2).expect("the probe maps and advises 4 MiB twice");
        // Faulting 2 MiB in takes at least a clear of 2 MiB: microseconds, not zero, not hours.
        for cost in [costs.huge, costs.small] {
            assert!(
                cost > Duration::ZERO && cost < Duration::from_secs(10),
                "{costs:?}"
            );
        }
    }
}
