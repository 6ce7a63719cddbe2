//! Making and releasing one dedicated block: mmap → mbind → populate → check → cuMemHostRegister,
//! and back; and the placement steps every block and chunk goes through. Runs outside the arena
//! lock, inside the re-entrancy guard, on memory this call owns ([`Mapping`], [`Memory`]) or a
//! [`Part`] it holds alone.

use std::time::Instant;

use super::{shortage, shortage_kind, Blocks, Resolved, HUGE_PAGE};
use crate::arena::{count_release, Block, Dedicated};
use crate::chunk::{Mapping, Memory, Part, ANONYMOUS};
use crate::config::PinMode;
use crate::cuda::Gpu;
use crate::process::{faults, workers};
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
        populate: bool,
    ) -> Result<Dedicated, Error> {
        let mut created = self.try_create_block(capacity, align, target, populate);
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
                created = self.try_create_block(capacity, align, target, populate);
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

    /// Records a dedicated block just created (or grown) as live in its node's arena, releases
    /// what the cache may no longer hold, and returns what to hand out. `None` when its node has
    /// no arena (an id beyond the table, from a strange sysfs) or the arena could not record it:
    /// the block is released then, as nothing could free it.
    pub(crate) fn record_created(&self, dedicated: Dedicated) -> Option<Block> {
        let node = dedicated.block.node;
        let Some(mut arena) = self.arena(node) else {
            self.release(dedicated);
            return None;
        };
        let mut out = crate::arena::Released::default();
        let recorded = arena.insert_created(dedicated, self.settings.cache_limit, &mut out);
        drop(arena);
        self.finish(node, &mut out);
        recorded.map_err(|unrecorded| self.release(unrecorded)).ok()
    }

    /// Unregisters (if pinned) and unmaps a dedicated block nobody uses any more, counted.
    pub(crate) fn release(&self, dedicated: Dedicated) {
        count_release(&self.counters, dedicated.memory.release());
    }

    /// A fresh anonymous mapping of `capacity` bytes at a multiple of `align`: 2 MiB aligned and
    /// advised `MADV_HUGEPAGE` for big blocks when huge pages are on.
    fn map(&self, capacity: usize, align: usize) -> Result<Mapping, Error> {
        let huge = self.settings.huge_pages && capacity >= HUGE_PAGE;
        let map_align = if huge { align.max(HUGE_PAGE) } else { align };
        // Anonymous: a dedicated block grows by `mremap` and is released as anonymous memory.
        let mut mapping = Mapping::new(&ANONYMOUS, capacity, map_align.max(self.page_size))?;
        if huge {
            mapping.whole().advise_huge(true);
        }
        Ok(mapping)
    }

    /// One attempt of [`Self::create_block`].
    fn try_create_block(
        &self,
        capacity: usize,
        align: usize,
        target: &Resolved,
        populate: bool,
    ) -> Result<Dedicated, (Cause, Error)> {
        // Populating beyond a cgroup's limit would summon the OOM killer: fail before mapping.
        self.memory_limits
            .check(capacity)
            .map_err(|e| (Cause::MemoryLimit, e))?;
        let mut mapping = self.map(capacity, align).map_err(|e| (Cause::Mmap, e))?;
        if !populate && self.settings.huge_pages && capacity >= HUGE_PAGE {
            faults::advise_lazy(&mut mapping.whole(), self.settings.sysfs_root.as_ref());
        }
        let placed = self.place_and_populate(&mut mapping.whole(), &target.nodes, populate);
        let made = placed.and_then(|()| {
            let mut memory = Memory::new(mapping);
            let pinned = self.pin(&mut memory, target.gpu);
            pinned
                .map(|pinned| (memory, pinned))
                .map_err(|e| (Cause::Other, e))
        });
        match made {
            Ok((memory, pinned)) => Ok(Dedicated::new(
                memory,
                target.host_node,
                self.kind_of(pinned),
                target.ordinal,
            )),
            Err(e) => {
                // Unmapped by its guard: nothing registered it (pinning is the last step).
                self.counters.released_blocks.incr();
                Err(e)
            }
        }
    }

    /// Places on `nodes`, populates and checks a part never written (steps 2–4 of the pipeline);
    /// without `populate` (a lazy kind) only places it: its pages are faulted in where touched.
    fn place_and_populate(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
        populate: bool,
    ) -> Result<(), (Cause, Error)> {
        let placed = self.place(part, nodes).map_err(|e| (Cause::Other, e))?;
        if !populate {
            return Ok(());
        }
        let start = Instant::now();
        let populated = self.populate(part, nodes);
        self.counters.populate.record(start.elapsed());
        populated.map_err(|e| (Cause::Populate, e))?;
        if placed {
            self.check_placement(part, nodes).map_err(|e| {
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

    /// Grows an unpinned dedicated block to `capacity` without copying: a new mapping of that
    /// size (aligned to `align`) gets its tail placed on the block's node (`nodes`, the policy's
    /// nodes there) and populated, then the block's pages move onto its head (`mremap`). Nothing
    /// is left behind to cache, and only the tail is populated. A lazy block instead moves and
    /// grows in one `mremap` into the new mapping's place (one kernel mapping still, so it can
    /// grow so again on kernels that move only one at a time), and then its tail is populated
    /// too: a growing block is written whole ([`Self::populates_request`]). When it cannot grow
    /// so, the block is given back untouched (the caller then moves it by copying).
    pub(crate) fn grow_block(
        &self,
        dedicated: Dedicated,
        capacity: usize,
        align: usize,
        nodes: &NodeMask,
    ) -> Result<Dedicated, Dedicated> {
        let old = dedicated.block;
        // Growing means a longer block: anything else is the caller's to copy.
        let Some(tail_len) = capacity.checked_sub(old.capacity).filter(|&n| n > 0) else {
            return Err(dedicated);
        };
        if old.kind.lazy {
            // Nothing to populate first: the block moves and grows in one call, one mapping
            // still, its new pages under its policy (placed where touched).
            let place = self
                .memory_limits
                .check(tail_len)
                .and_then(|()| self.map(capacity, align));
            let Ok(place) = place else {
                return Err(dedicated);
            };
            return match dedicated.memory.grow_into(place) {
                Ok(mut memory) => {
                    if let Some(mut tail) = memory.part(old.capacity, tail_len) {
                        let start = Instant::now();
                        // A failure leaves the tail to be faulted in where written, as before
                        // populating it: the block has grown either way.
                        let _ = self.populate(&mut tail, nodes);
                        self.counters.populate.record(start.elapsed());
                    }
                    Ok(Dedicated {
                        block: Block {
                            addr: memory.base(),
                            capacity,
                            ..old
                        },
                        memory,
                    })
                }
                Err(memory) => Err(Dedicated { block: old, memory }),
            };
        }
        let mut grown = match self.memory_limits.check(tail_len).and_then(|()| {
            let mut mapping = self.map(capacity, align)?;
            // Block capacities are whole pages, so the tail starts on a page.
            let mut tail = mapping.part(old.capacity, tail_len)?;
            self.place_and_populate(&mut tail, nodes, true)
                .map_err(|(_, e)| e)?;
            Ok(Memory::new(mapping))
        }) {
            Ok(grown) => grown,
            // The new mapping's guard unmapped it: the block did not move.
            Err(_) => return Err(dedicated),
        };
        match dedicated.memory.move_onto(&mut grown) {
            Ok(()) => Ok(Dedicated {
                block: Block {
                    addr: grown.base(),
                    capacity,
                    ..old
                },
                memory: grown,
            }),
            Err(memory) => Err(Dedicated { block: old, memory }),
        }
    }

    /// Sets the part's NUMA policy. `Ok(false)` when placement is unavailable (counted).
    ///
    /// `policy=bind` is first applied as `preferred`, so that a node too small for the block
    /// shows up as misplaced pages (and a clean failure) instead of the OOM killer at populate
    /// time; the strict policy is set once every page is known to be on the node.
    pub(crate) fn place(&self, part: &mut Part<'_>, nodes: &NodeMask) -> Result<bool, Error> {
        if !self.numa_placement() {
            self.counters.unplaced_blocks.incr();
            return Ok(false);
        }
        let policy = match self.settings.policy {
            MemPolicy::Bind => MemPolicy::Preferred,
            other => other,
        };
        match part.bind(policy, nodes, MbindFlags::default()) {
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

    /// Counts pages off the policy's nodes (`verify=on` or `policy=bind`) of a populated part;
    /// under `bind` any misplaced page fails the block, otherwise the strict policy is set. When
    /// `move_pages` is refused (seccomp), `bind` sets the strict policy with `MPOL_MF_STRICT`,
    /// so that the kernel does the check (EIO for a misplaced page).
    pub(crate) fn check_placement(
        &self,
        part: &mut Part<'_>,
        nodes: &NodeMask,
    ) -> Result<(), Error> {
        let bind = self.settings.policy == MemPolicy::Bind;
        if !(bind || self.settings.verify) {
            return Ok(());
        }
        let (mut checked, mut misplaced) = (0u64, 0u64);
        let counted = part.page_nodes(|_, node| {
            checked += 1;
            let on_policy_node = usize::try_from(node).is_ok_and(|n| nodes.contains(n));
            misplaced += u64::from(!on_policy_node);
        });
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
            match part.bind(MemPolicy::Bind, nodes, flags) {
                Err(Error::Syscall { errno, .. }) if strict && errno == libc::EIO => {
                    return Err(bind_exhausted());
                }
                other => other?,
            }
        }
        Ok(())
    }

    /// Populates a part never written for `nodes`: big parts with the pooled workers of the node
    /// (bound to its CPUs), up to `populate_threads` threads in all; a huge-page part that stalls
    /// in compaction goes on in small pages (counted).
    pub(crate) fn populate(&self, part: &mut Part<'_>, nodes: &NodeMask) -> Result<(), Error> {
        let len = part.len();
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
        let small_pages = workers::populate(node, cpus, part, threads, huge)?;
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

    /// Registers `memory` (populated) through `gpu`'s context when pinning is on; returns whether
    /// it is pinned (the registration is the memory's, released with it). Under `pin=strict` a
    /// failure fails the block; otherwise it is served unpinned, counted (under `pin=off` not
    /// counted: nothing fell back).
    fn pin(&self, memory: &mut Memory, gpu: Option<&'static Gpu>) -> Result<bool, Error> {
        if self.settings.pin == PinMode::Off {
            // Not a fallback: nobody asked for pinning.
            return Ok(false);
        }
        match self.register(gpu, memory) {
            Ok(()) => Ok(true),
            Err(e) if self.settings.pin == PinMode::Strict => Err(e),
            Err(_) => {
                self.counters.unpinned_blocks.incr();
                Ok(false)
            }
        }
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
