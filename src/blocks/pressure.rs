//! Memory pressure: when a request is short of memory, address space or room under the pinned
//! limit, idle memory of the process's arenas (free ranges, wholly free chunks, cached
//! dedicated blocks; reserved chunks last) is given back, released outside the lock and counted
//! in the value's counters, and the request retries once. Blocks pending on GPU work stay.

use super::Blocks;
use crate::arena::{Released, Shortage};
use crate::process::NODES;
use crate::Error;

/// `CUresult` of a registration beyond what the driver can page-lock.
const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;

/// The memory-pressure side of a value's large path.
pub(crate) struct Pressure<'a> {
    pub(super) blocks: &'a Blocks,
}

impl Pressure<'_> {
    /// Gives idle memory of `node` back for a request short of `bytes`; `false` (nothing given
    /// back) when all there is to give back could not cover it. Purges that failed (locked
    /// memory) gave nothing back, and are not tried again.
    pub(crate) fn give_back_for(&self, node: usize, bytes: usize, want: Shortage) -> bool {
        let blocks = self.blocks;
        let Some(mut arena) = blocks.arena(node) else {
            return false;
        };
        if arena.releasable(want) < bytes {
            return false;
        }
        let mut given = 0;
        loop {
            let mut out = Released::default();
            let released = arena.release_for(bytes - given, want, &mut out);
            drop(arena);
            let count = out.blocks.iter().count() + out.chunks.iter().count();
            blocks.counters.pressure_released_blocks.add(count as u64);
            let failed = blocks.finish(node, &mut out);
            given += released.saturating_sub(failed.bytes);
            if released == 0 || given >= bytes {
                return given > 0;
            }
            arena = match blocks.arena(node) {
                Some(arena) => arena,
                None => return given > 0,
            };
        }
    }

    /// Gives back up to `over` bytes of idle page-locked memory (wholly free pinned chunks not
    /// reserved, cached pinned blocks), spread over every node's arena, before a registration
    /// that would pass the pinned limit.
    pub(crate) fn give_back_page_locked(&self, mut over: usize) {
        for node in NODES.arenas().map(|arena| arena.lock().node()) {
            if over == 0 {
                break;
            }
            let idle = NODES
                .existing(node)
                .map_or(0, |arena| arena.lock().releasable(Shortage::PageLocked));
            let ask = over.min(idle);
            if ask > 0 && self.give_back_for(node, ask, Shortage::PageLocked) {
                over -= ask;
            }
        }
    }

    /// After a request failed with `error`: when memory given back may help (see
    /// [`shortage`]), gives back `bytes` of `node`'s idle memory of the kind the error wants;
    /// whether the request should be tried again (counted as a retry).
    pub(crate) fn relieves(&self, node: usize, bytes: usize, error: &Error) -> bool {
        let retry = shortage(error) && self.give_back_for(node, bytes, shortage_kind(error));
        if retry {
            self.blocks.counters.pressure_retries.incr();
        }
        retry
    }
}

/// Whether a failure to create a block may go away when memory is given back: mmap, populate or
/// a full node (ENOMEM), a cgroup limit, or CUDA's page-locking limit.
pub(crate) fn shortage(error: &Error) -> bool {
    match error {
        Error::Syscall { errno, .. } => *errno == libc::ENOMEM,
        Error::MemoryLimit { .. } => true,
        Error::Cuda { code, .. } => *code == CUDA_ERROR_OUT_OF_MEMORY,
        _ => false,
    }
}

/// What a request short of memory by `error` needs given back.
fn shortage_kind(error: &Error) -> Shortage {
    match error {
        Error::Syscall { call: "mmap", .. } => Shortage::AddressSpace,
        _ => Shortage::Memory,
    }
}

/// How many bytes a request short of memory by `error` needs given back (`need` unless a
/// cgroup limit says how many it lacks).
pub(crate) fn shortage_bytes(error: &Error, need: usize) -> usize {
    match error {
        Error::MemoryLimit {
            available,
            requested,
            ..
        } => requested.saturating_sub(*available),
        _ => need,
    }
}
