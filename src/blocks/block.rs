//! Making and releasing one block: mmap → mbind → populate → check → cuMemHostRegister, and
//! back. Runs outside the arena lock, inside the re-entrancy guard.
//!
//! Unsafe code here relies on fresh mappings of this crate used by nobody else, and dedicated
//! blocks the arena no longer holds.
#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::time::Instant;

use super::{shortage, shortage_kind, Blocks, Resolved, HUGE_PAGE};
use crate::arena::{count_release, Block, Kind};
use crate::chunk::{release_dedicated, Mapping, ANONYMOUS};
use crate::config::PinMode;
use crate::cuda::Gpu;
use crate::process::workers;
use crate::sys::{self, MbindFlags, MemPolicy, NodeMask};
use crate::Error;

/// Blocks smaller than this are populated by one thread: thread start-up would cost more.
const PARALLEL_POPULATE_MIN: usize = 64 << 20;

/// The step at which a block could not be created, counted once per failed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    MemoryLimit,
    Mmap,
    Populate,
    BindExhausted,
    /// Counted where it happens (placement, registration), or not a memory failure.
    Other,
}

/// The error of a `policy=bind` block with pages off the node.
fn bind_exhausted() -> Error {
    Error::Syscall {
        call: "mbind(MPOL_BIND)",
        errno: libc::ENOMEM,
    }
}

impl Blocks {
    /// Creates a block of `capacity` bytes for `target`, placed, populated and (when configured)
    /// pinned, whose address is a multiple of `align`. When that fails for want of memory, gives
    /// the target node's cached blocks back and retries: first the oldest ones, only as many
    /// bytes as the block needs, then, if it fails again, all of them. Blocks pending on GPU work
    /// stay.
    pub(crate) fn create_block(
        &self,
        capacity: usize,
        align: usize,
        target: &Resolved,
    ) -> Result<Block, Error> {
        let mut created = self.try_create_block(capacity, align, target);
        if let Err((_, e)) = &created {
            let needed = match e {
                Error::MemoryLimit {
                    available,
                    requested,
                    ..
                } => requested.saturating_sub(*available),
                _ => capacity,
            };
            if shortage(e) && self.give_back_for(target.host_node, needed, shortage_kind(e)) {
                self.counters.pressure_retries.incr();
                created = self.try_create_block(capacity, align, target);
            }
        }
        created.map_err(|(cause, e)| {
            let counter = match cause {
                Cause::MemoryLimit => &self.counters.memory_limited,
                Cause::Mmap => &self.counters.map_failures,
                Cause::Populate => &self.counters.populate_failures,
                Cause::BindExhausted => &self.counters.bind_exhausted,
                Cause::Other => return e,
            };
            counter.incr();
            e
        })
    }

    /// Records a dedicated block just created (or grown) as live in its node's arena, and
    /// releases what the cache may no longer hold. `false` when its node has no arena (an id
    /// beyond the table, from a strange sysfs) or the arena could not record it: nothing records
    /// it then, so the caller must not hand it out.
    pub(crate) fn record_created(&self, block: Block) -> bool {
        let limit = self.settings.cache_limit;
        self.with_arena(block.node, |arena, out| {
            arena.insert_created(block, limit, out)
        })
        .unwrap_or(false)
    }

    /// A fresh anonymous mapping of `capacity` bytes at a multiple of `align`: 2 MiB aligned and
    /// advised `MADV_HUGEPAGE` for big blocks when huge pages are on.
    fn map(&self, capacity: usize, align: usize) -> Result<Mapping, Error> {
        let huge = self.settings.huge_pages && capacity >= HUGE_PAGE;
        let map_align = if huge { align.max(HUGE_PAGE) } else { align };
        // Anonymous: a dedicated block grows by `mremap` and is released as anonymous memory.
        let mapping = Mapping::new(&ANONYMOUS, capacity, map_align.max(self.page_size))?;
        if huge {
            // SAFETY: the mapping was just made by us. Without THP this is a no-op hint.
            let _ = unsafe { sys::advise_hugepage(mapping.ptr(), capacity) };
        }
        Ok(mapping)
    }

    /// One attempt of [`Self::create_block`].
    fn try_create_block(
        &self,
        capacity: usize,
        align: usize,
        target: &Resolved,
    ) -> Result<Block, (Cause, Error)> {
        // Populating beyond a cgroup's limit would summon the OOM killer: fail before mapping.
        self.memory_limits
            .check(capacity)
            .map_err(|e| (Cause::MemoryLimit, e))?;
        let mapping = self.map(capacity, align).map_err(|e| (Cause::Mmap, e))?;
        // SAFETY: the mapping is ours and not yet shared with anyone.
        match unsafe { self.place_and_pin(mapping.ptr(), capacity, target) } {
            Ok(kind) => Ok(Block {
                addr: mapping.keep().as_ptr() as usize,
                capacity,
                node: target.host_node,
                kind,
                registered_by: target.gpu.filter(|_| kind.pinned).map(Gpu::ordinal),
                routed_for: target.ordinal,
            }),
            Err(e) => {
                // Unmapped by its guard: nothing registered it (pinning is the last step).
                drop(mapping);
                self.counters.released_blocks.incr();
                Err(e)
            }
        }
    }

    /// Places, populates, checks and pins for `target`; returns what the block was made with.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a fresh private mapping of this crate, used by nobody else.
    unsafe fn place_and_pin(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        target: &Resolved,
    ) -> Result<Kind, (Cause, Error)> {
        // SAFETY: forwarded from the caller.
        unsafe { self.place_and_populate(ptr, len, &target.nodes) }?;
        // SAFETY: forwarded from the caller.
        let pinned = unsafe { self.pin(ptr, len, target.gpu) }.map_err(|e| (Cause::Other, e))?;
        Ok(self.kind_of(pinned))
    }

    /// Places on `nodes`, populates and checks (steps 2–4 of the pipeline).
    ///
    /// # Safety
    /// As [`Self::place_and_pin`].
    unsafe fn place_and_populate(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        nodes: &NodeMask,
    ) -> Result<(), (Cause, Error)> {
        // SAFETY: forwarded from the caller.
        let placed = unsafe { self.place(ptr, len, nodes) }.map_err(|e| (Cause::Other, e))?;
        let start = Instant::now();
        // SAFETY: forwarded from the caller.
        let populated = unsafe { self.populate(ptr, len, nodes) };
        self.counters.populate.record(start.elapsed());
        populated.map_err(|e| (Cause::Populate, e))?;
        if placed {
            // SAFETY: forwarded from the caller.
            unsafe { self.check_placement(ptr, len, nodes) }.map_err(|e| {
                let cause = if e == bind_exhausted() {
                    Cause::BindExhausted
                } else {
                    Cause::Other
                };
                (cause, e)
            })?;
        }
        Ok(())
    }

    /// Grows an unpinned block to `capacity` without copying: a new mapping of that size (aligned
    /// to `align`) gets its tail placed on the block's node (`nodes`, the policy's nodes there)
    /// and populated, then the block's pages move onto its head
    /// (`mremap`). Nothing is left behind to cache, and only the tail is populated. On failure the
    /// block is untouched (the caller then moves it by copying).
    ///
    /// # Safety
    /// `block` is a live, unpinned block of this runtime that nothing uses while this runs (the
    /// caller owns it, no GPU work is recorded against it); on success it no longer exists.
    pub(crate) unsafe fn grow_block(
        &self,
        block: Block,
        capacity: usize,
        align: usize,
        nodes: &NodeMask,
    ) -> Result<Block, Error> {
        // Growing means a longer block: anything else is the caller's to copy.
        let Some(tail_len) = capacity.checked_sub(block.capacity).filter(|&n| n > 0) else {
            return Err(Error::InvalidRange {
                addr: block.addr,
                len: capacity,
            });
        };
        let old = NonNull::new(block.addr as *mut u8).ok_or(Error::InvalidRange {
            addr: block.addr,
            len: block.capacity,
        })?;
        self.memory_limits.check(tail_len)?;
        let mapping = self.map(capacity, align)?;
        let region = mapping.ptr();
        // SAFETY: block.capacity < capacity: inside the region. Block capacities are whole
        // pages, so the tail starts on a page.
        let tail = unsafe { region.add(block.capacity) };
        // SAFETY: the tail is part of the fresh mapping, used by nobody; then the caller's block
        // (unused while this runs) moves onto the region's head, which nobody uses either.
        let grown = unsafe {
            self.place_and_populate(tail, tail_len, nodes)
                .map_err(|(_, e)| e)
                .and_then(|()| sys::move_mapping(old, region, block.capacity))
        };
        // On failure the guard unmaps the region: the block did not move (move_mapping is last).
        grown.map(|()| Block {
            addr: mapping.keep().as_ptr() as usize,
            capacity,
            ..block
        })
    }

    /// Sets the range's NUMA policy. `Ok(false)` when placement is unavailable (counted).
    ///
    /// `policy=bind` is first applied as `preferred`, so that a node too small for the block
    /// shows up as misplaced pages (and a clean failure) instead of the OOM killer at populate
    /// time; the strict policy is set once every page is known to be on the node.
    ///
    /// # Safety
    /// As [`Self::place_and_pin`].
    pub(crate) unsafe fn place(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        nodes: &NodeMask,
    ) -> Result<bool, Error> {
        if !self.numa_placement() {
            self.counters.unplaced_blocks.incr();
            return Ok(false);
        }
        let policy = match self.settings.policy {
            MemPolicy::Bind => MemPolicy::Preferred,
            other => other,
        };
        // SAFETY: forwarded from the caller.
        match unsafe { sys::bind(ptr, len, policy, nodes, MbindFlags::default()) } {
            Ok(()) => Ok(true),
            Err(Error::NumaUnavailable { errno, .. }) => {
                self.refuse_mbind(errno);
                self.counters.unplaced_blocks.incr();
                Ok(false)
            }
            // `preferred` and `interleave` are best effort: a refused policy (EINVAL: a node the
            // cpuset or the kernel does not allow) leaves the block unplaced, counted.
            Err(_) if self.settings.policy != MemPolicy::Bind => {
                self.counters.placement_failures.incr();
                self.counters.unplaced_blocks.incr();
                Ok(false)
            }
            Err(e) => {
                self.counters.placement_failures.incr();
                Err(e)
            }
        }
    }

    /// Counts pages off the policy's nodes (`verify=on` or `policy=bind`); under `bind` any
    /// misplaced page fails the block, otherwise the strict policy is set. When `move_pages` is
    /// refused (seccomp), `bind` sets the strict policy with `MPOL_MF_STRICT`, so that the kernel
    /// does the check (EIO for a misplaced page).
    ///
    /// # Safety
    /// As [`Self::place_and_pin`], and the range is populated.
    pub(crate) unsafe fn check_placement(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        nodes: &NodeMask,
    ) -> Result<(), Error> {
        let bind = self.settings.policy == MemPolicy::Bind;
        if !(bind || self.settings.verify) {
            return Ok(());
        }
        let (mut checked, mut misplaced) = (0u64, 0u64);
        // SAFETY: forwarded from the caller.
        let counted = unsafe {
            sys::page_nodes(ptr, len, |_, node| {
                checked += 1;
                let on_policy_node = usize::try_from(node).is_ok_and(|n| nodes.contains(n));
                misplaced += u64::from(!on_policy_node);
            })
        };
        // Whether the kernel must check instead (MPOL_MF_STRICT: EIO if a page is off the nodes).
        let mut strict = false;
        match counted {
            Ok(()) => {
                self.counters.pages_checked.add(checked);
                self.counters.pages_misplaced.add(misplaced);
            }
            // A kernel that refuses move_pages (seccomp) cannot check; placement itself worked.
            Err(Error::NumaUnavailable { .. }) if !bind => {
                self.counters.unverified_blocks.incr();
                return Ok(());
            }
            // Containers allowed mbind (CAP_SYS_NICE) still refuse move_pages: let mbind check.
            Err(Error::NumaUnavailable { .. }) => {
                self.counters.unverified_blocks.incr();
                strict = true;
            }
            Err(e) => {
                self.counters.placement_failures.incr();
                return Err(e);
            }
        }
        if bind {
            if misplaced > 0 {
                return Err(bind_exhausted());
            }
            let flags = MbindFlags {
                strict,
                move_existing: false,
            };
            // SAFETY: forwarded from the caller.
            match unsafe { sys::bind(ptr, len, MemPolicy::Bind, nodes, flags) } {
                Err(Error::Syscall { errno, .. }) if strict && errno == libc::EIO => {
                    return Err(bind_exhausted());
                }
                other => other?,
            }
        }
        Ok(())
    }

    /// Populates the range for `nodes`: big ranges with the pooled workers of the node (bound
    /// to its CPUs), up to `populate_threads` threads in all; a huge-page range that stalls in
    /// compaction goes on in small pages (counted).
    ///
    /// # Safety
    /// As [`Self::place_and_pin`].
    pub(crate) unsafe fn populate(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        nodes: &NodeMask,
    ) -> Result<(), Error> {
        let threads = if len >= PARALLEL_POPULATE_MIN {
            self.populate_threads
        } else {
            1
        };
        let mut only = nodes.iter();
        // Pages spread over several nodes (interleave) get workers bound to none.
        let node = match (only.next(), only.next()) {
            (Some(node), None) => Some(node),
            _ => None,
        };
        // Workers for several nodes' pages run on any CPU the process may use.
        let cpus = || node.map_or_else(process_allowed_cpus, |node| self.node_cpus(node));
        let huge = self.settings.huge_pages && len >= HUGE_PAGE;
        // SAFETY: forwarded from the caller.
        let small_pages = unsafe { workers::populate(node, cpus, ptr, len, threads, huge) }?;
        if small_pages {
            self.counters.huge_page_stalls.incr();
        }
        Ok(())
    }

    /// The CPUs of `node` that this process may run on (its cgroup's cpuset within its main
    /// thread's affinity: never the calling thread's, which may be pinned to one core); all it
    /// may run on when the node has none (a CPU-less memory node).
    fn node_cpus(&self, node: usize) -> Vec<usize> {
        let allowed = process_allowed_cpus();
        let on_node: Vec<usize> = self
            .topology
            .nodes()
            .iter()
            .find(|n| n.id == node)
            .map(|n| {
                n.cpus
                    .iter()
                    .copied()
                    .filter(|c| allowed.contains(c))
                    .collect()
            })
            .unwrap_or_default();
        if on_node.is_empty() {
            allowed
        } else {
            on_node
        }
    }

    /// Registers the block through `gpu`'s context when pinning is on; returns whether it is
    /// pinned (the registration is kept in the block, and released with it). Under `pin=strict`
    /// a failure fails the block; otherwise it is served unpinned, counted (under `pin=off` not
    /// counted: nothing fell back).
    ///
    /// # Safety
    /// As [`Self::place_and_pin`], and the range is populated.
    unsafe fn pin(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        gpu: Option<&'static Gpu>,
    ) -> Result<bool, Error> {
        if self.settings.pin == PinMode::Off {
            // Not a fallback: nobody asked for pinning.
            return Ok(false);
        }
        // SAFETY: forwarded from the caller; the range is not registered yet, and stays mapped
        // until `release_dedicated` adopts the registration back.
        match unsafe { self.register(gpu, ptr, len) } {
            Ok(registration) => {
                registration.keep();
                Ok(true)
            }
            Err(e) if self.settings.pin == PinMode::Strict => Err(e),
            Err(_) => {
                self.counters.unpinned_blocks.incr();
                Ok(false)
            }
        }
    }

    /// Unregisters (if pinned) and unmaps a block nobody uses any more.
    ///
    /// # Safety
    /// `block` came from [`Self::create_block`], is no longer handed out or cached, and is released
    /// once.
    pub(crate) unsafe fn release_block(&self, block: Block) {
        // SAFETY: forwarded from the caller.
        count_release(&self.counters, unsafe {
            release_dedicated(block.addr, block.capacity, block.registered_by)
        });
    }
}

/// The CPUs this process may use: its cgroup's cpuset within its main thread's affinity (what
/// `taskset` chose), see [`within_affinity`] (empty when neither can be read: workers are then
/// left unbound).
fn process_allowed_cpus() -> Vec<usize> {
    within_affinity(
        crate::topology::cgroup::allowed_cpus(),
        sys::process_cpus().ok(),
    )
}

/// The CPUs of `cgroup` that `affinity` has too; whichever of the two is known when the other
/// is not; `affinity` when they share none (the kernel keeps a thread's affinity inside its
/// cpuset: such a cgroup file describes another view of the CPUs, a namespace's say).
fn within_affinity(cgroup: Option<Vec<usize>>, affinity: Option<Vec<usize>>) -> Vec<usize> {
    match (cgroup, affinity) {
        (Some(cgroup), Some(affinity)) => {
            let both: Vec<usize> = cgroup
                .into_iter()
                .filter(|cpu| affinity.contains(cpu))
                .collect();
            if both.is_empty() {
                affinity
            } else {
                both
            }
        }
        (cgroup, affinity) => cgroup.or(affinity).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::within_affinity;

    #[test]
    fn workers_stay_within_the_affinity_the_user_chose() {
        let cgroup = Some((0..8).collect::<Vec<usize>>());
        // taskset -c 2,3,9 under a cgroup of CPUs 0-7.
        assert_eq!(within_affinity(cgroup.clone(), Some(vec![2, 3, 9])), [2, 3]);
        assert_eq!(
            within_affinity(cgroup.clone(), Some(vec![9])),
            [9],
            "none shared"
        );
        assert_eq!(within_affinity(cgroup, None), (0..8).collect::<Vec<_>>());
        assert_eq!(within_affinity(None, Some(vec![1])), [1]);
        assert!(within_affinity(None, None).is_empty());
    }
}
