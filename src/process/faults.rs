//! Whether fresh huge pages fault in cheaper than small ones here, decided once per process the
//! first time a lazy block is mapped, and used to give lazy blocks small pages where huge ones
//! cost more ([`advise_lazy`]).
//!
//! A lazy block's pages are faulted in where its user first touches them, often inside the
//! kernel (a `read()` into the buffer). On bare metal a fresh huge page costs less per byte than
//! 512 small ones. On a virtual machine whose host takes the guest's free memory back (free page
//! reporting), a huge-page fault takes a whole free 2 MiB block, nearly always one the host took
//! back, and waits while the host backs it again; small pages come first from the kernel's lists
//! of small free pieces, which the host keeps. On the 2-vCPU VM of the benchmarks a 1 GiB `read()`
//! into a fresh buffer took 0.17–2.26 s in huge pages (median 0.85 s, 6 runs) and 0.46–0.92 s in
//! small ones (median 0.54 s), as glibc's.
//!
//! The rule: lazy blocks keep huge pages unless the host takes free memory back
//! ([`topology::host::free_page_reporting`]) or a probe ([`sys::fault_costs`]: 4 MiB faulted in
//! each way, one write per page, a few milliseconds once) finds huge pages slower. The probe
//! alone cannot see the host's reclaim: the first free huge blocks it gets are the ones freed
//! last, not yet reported, and fast (80 µs per 2 MiB against 600–2,000 µs in small pages on that
//! VM, while the same process's 1 GiB buffer then took 2.8 s). Blocks populated in bulk keep
//! their huge pages: the populate workers fault them in off the user's path, and they serve every
//! later use with fewer TLB misses.
//!
//! Whether the host takes free memory back is read from sysfs by the process's initialisation
//! ([`learn_host`]), not inside the allocation that meets the first lazy block: the probe there
//! makes system calls only (`mmap`, `madvise`, page faults). Two threads meeting the first lazy
//! block at once: one decides, the other keeps huge pages meanwhile. A probe that fails (no
//! transparent huge pages) leaves huge pages as they were.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use std::path::Path;

use crate::chunk::Part;
use crate::sys::{self, FaultCosts};
use crate::topology;

/// Huge pages probed per kind: the fastest of two counts, so one preempted fault does not decide.
const PROBE_GROUPS: usize = 2;

/// What is known of this machine's huge-page faults.
const UNKNOWN: u8 = 0;
const PROBING: u8 = 1;
const HUGE_PAY: u8 = 2;
const HUGE_COST_MORE: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
/// Whether the host takes the guest's free memory back, as [`learn_host`] read it.
static HOST_TAKES_FREE_MEMORY: AtomicBool = AtomicBool::new(false);

/// Reads whether the host takes free memory back (sysfs under `root`), for the decision the
/// first lazy block makes. Called by the process's initialisation, outside any allocation.
pub(crate) fn learn_host(root: &Path) {
    HOST_TAKES_FREE_MEMORY.store(topology::host::free_page_reporting(root), Ordering::Relaxed);
}

/// Whether huge pages fault in at no more than the cost of the same bytes in small pages: the
/// rule the probe's figures are read by. A tie keeps huge pages (they save TLB misses after).
pub(crate) fn huge_pages_pay(costs: FaultCosts) -> bool {
    costs.huge <= costs.small
}

/// Whether a lazy block should keep its huge pages (see the module's docs), decided on first
/// use; `true` while another thread decides.
pub(crate) fn lazy_blocks_keep_huge_pages() -> bool {
    match STATE.load(Ordering::Acquire) {
        HUGE_COST_MORE => false,
        UNKNOWN => decide(),
        _ => true,
    }
}

/// Decides unless another thread claimed it, records and returns the answer.
fn decide() -> bool {
    if STATE
        .compare_exchange(UNKNOWN, PROBING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return STATE.load(Ordering::Acquire) != HUGE_COST_MORE;
    }
    let pay = !HOST_TAKES_FREE_MEMORY.load(Ordering::Relaxed)
        && sys::fault_costs(PROBE_GROUPS).map_or(true, huge_pages_pay);
    STATE.store(
        if pay { HUGE_PAY } else { HUGE_COST_MORE },
        Ordering::Release,
    );
    pay
}

/// Advises a fresh lazy block's whole `part` (mapped, nothing faulted in yet) `MADV_NOHUGEPAGE`
/// where huge pages cost more to fault in than small ones ([`lazy_blocks_keep_huge_pages`]).
pub(crate) fn advise_lazy(part: &mut Part<'_>) {
    if !lazy_blocks_keep_huge_pages() {
        part.advise_huge(false);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::chunk::{Mapping, ANONYMOUS};

    /// The `VmFlags` line of the mapping starting at `addr`, from `/proc/self/smaps`.
    /// The flags of the mapping that holds `addr` (the kernel may have merged it with a
    /// neighbour of the same flags, so it need not start there).
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let holds = |line: &str| {
            let range = line.split_whitespace().next().unwrap_or_default();
            let Some((start, end)) = range.split_once('-') else {
                return false;
            };
            let bound = |hex| usize::from_str_radix(hex, 16).ok();
            matches!((bound(start), bound(end)), (Some(s), Some(e)) if s <= addr && addr < e)
        };
        let mut lines = smaps.lines().skip_while(|l| !holds(l));
        lines
            .find_map(|l| l.strip_prefix("VmFlags:"))
            .unwrap_or_default()
            .to_owned()
    }

    #[test]
    fn a_lazy_block_gets_small_pages_where_huge_ones_cost_more() {
        let len = 8 << 20;
        let mut mapping = Mapping::new(&ANONYMOUS, len, crate::sys::HUGE_PAGE).expect("mmap");
        mapping.whole().advise_huge(true);
        let addr = mapping.ptr().as_ptr() as usize;
        // What the probe would record on the VM whose host took its free huge blocks back.
        let before = STATE.swap(HUGE_COST_MORE, Ordering::AcqRel);
        advise_lazy(&mut mapping.whole());
        STATE.store(before, Ordering::Release);
        let flags = vm_flags(addr);
        assert!(
            flags.split_whitespace().any(|f| f == "nh") && !flags.contains("hg"),
            "a lazy block where huge faults cost more is advised MADV_NOHUGEPAGE: VmFlags {flags:?}"
        );
    }

    #[test]
    fn huge_pages_are_kept_unless_they_fault_in_slower() {
        let costs = |huge_us, small_us| FaultCosts {
            huge: Duration::from_micros(huge_us),
            small: Duration::from_micros(small_us),
        };
        // Bare metal: one clear of 2 MiB against 512 faults.
        assert!(huge_pages_pay(costs(90, 300)));
        assert!(huge_pages_pay(costs(300, 300)), "a tie keeps huge pages");
        // The 2-vCPU VM whose host took its free huge blocks back.
        assert!(!huge_pages_pay(costs(6_000, 1_200)));
    }
}
