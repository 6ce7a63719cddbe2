//! The dedicated path: a request too large to carve (or a growing one) gets a mapping of its
//! own, a cached one (reused within 1/8 of its size) or a new one made by the placer
//! (`chunk/place.rs`: mmap → mbind → populate → check → cuMemHostRegister), retried once after
//! giving idle memory back when short of it; and an unpinned one grows by moving its pages
//! (`mremap`). Runs outside the arena lock, inside the re-entrancy guard, on memory this call
//! owns ([`Mapping`], [`Memory`]) or a [`Part`] it holds alone.

use std::alloc::Layout;
use std::ptr::NonNull;

use super::pressure::{shortage_bytes, Pressure};
use super::{Blocks, Resolved};
use crate::arena::{class_size, count_release, Arena, Block, Dedicated, Fit, Kind, Released};
use crate::chunk::{Cause, Memory, PinPolicy};
#[cfg(doc)]
use crate::chunk::{Mapping, Part};
use crate::sys::NodeMask;
use crate::Error;

/// The dedicated-block side of a value's large path.
pub(crate) struct DedicatedPath<'a> {
    pub(super) blocks: &'a Blocks,
}

impl DedicatedPath<'_> {
    /// A block of its own for a request too large to carve (or a growing one): a cached one (for
    /// a growing one, one it can grow into: [`Fit::for_growth`]), or a new mapping.
    pub(crate) fn dedicated(
        &self,
        layout: Layout,
        zeroed: bool,
        growing: bool,
        target: &Resolved,
        kind: Kind,
    ) -> Option<Block> {
        let (capacity, fit) = self.fit(layout, kind)?;
        let fit = if growing { fit.for_growth() } else { fit };
        let zero = zeroed.then_some(layout.size());
        // Fresh anonymous memory is already zero: `zeroed` costs nothing for a new block.
        self.take_cached(fit, zero, target)
            .or_else(|| self.create(layout.size(), capacity, fit, target, zeroed))
    }

    /// The capacity a dedicated request gets, and the cached blocks of `kind` that may serve it.
    pub(crate) fn fit(&self, layout: Layout, kind: Kind) -> Option<(usize, Fit)> {
        let capacity = class_size(layout.size(), self.blocks.page_size())?;
        let align = layout.align().max(self.blocks.page_size());
        Some((capacity, Fit::new(layout.size(), capacity, align, kind)))
    }

    /// A cached dedicated block for `fit` from the target node's arena, now live (a cache hit)
    /// for the target's GPU, once pending blocks that are ready joined the cache; its first
    /// `zero` bytes zeroed when asked: then it is taken out under the lock, zeroed outside it,
    /// and recorded live under it again (in between it is this call's alone: no `trim` or
    /// decay can release it).
    fn take_cached(&self, fit: Fit, zero: Option<usize>, target: &Resolved) -> Option<Block> {
        /// A cache hit, recorded live (if room could be had) or to zero first.
        enum Taken {
            Recorded(Option<Block>),
            ToZero(Dedicated, usize),
        }
        let blocks = self.blocks;
        let limit = blocks.settings.cache_limit;
        let node = target.host_node;
        // A block no room could be found to record goes back to the cache (released if that
        // fails too).
        let record = |arena: &mut Arena, hit, out: &mut Released| {
            arena
                .insert_dedicated(hit)
                .map_err(|unrecorded| arena.cache(unrecorded, limit, out))
                .ok()
        };
        let taken = blocks.with_arena(node, |arena, out| {
            arena.settle_pending(limit, out);
            let hit = arena.take_cached(fit);
            if hit.is_none() && arena.pending_fits(fit) {
                blocks.counters.reuse_deferred.incr();
            }
            let mut hit = hit?;
            hit.block.routed_for = target.ordinal;
            Some(match zero {
                Some(len) => Taken::ToZero(hit, len),
                None => Taken::Recorded(record(arena, hit, out)),
            })
        })??;
        let block = match taken {
            Taken::Recorded(block) => block,
            Taken::ToZero(mut hit, len) => {
                let block = hit.block;
                let drop = NonNull::new(block.addr as *mut u8).is_some_and(|ptr| {
                    Blocks::clears_by_dropping(block.kind, ptr, len.min(block.capacity))
                });
                hit.zero(len, drop);
                blocks.with_arena(node, |arena, out| record(arena, hit, out))?
            }
        }?;
        blocks.counters.cache_hits.incr();
        Some(block)
    }

    /// A new live dedicated block of `fit`'s kind for `target` (a cache miss), populated as
    /// [`Blocks::populate_plan`] says, and watched when it says so. One populated for a request
    /// not asked zeroed (written whole) is first made of a cached block of another size that
    /// making room would evict ([`Self::resize_cached`]).
    fn create(
        &self,
        size: usize,
        capacity: usize,
        fit: Fit,
        target: &Resolved,
        zeroed: bool,
    ) -> Option<Block> {
        let blocks = self.blocks;
        blocks.counters.cache_misses.incr();
        // The rounding up to the class is faulted in if ever written, unless the whole block must
        // be resident (pinned) or checked.
        let region = if fit.kind.pinned || fit.kind.verified {
            capacity
        } else {
            size.next_multiple_of(blocks.page_size()).min(capacity)
        };
        // The mapping is aligned to its huge pages (if any): its start is 0 modulo them.
        let plan = blocks.populate_plan(fit.kind, zeroed, capacity, (0, region));
        let limit = blocks.settings.cache_limit;
        let resizable = (plan.head > 0 && !zeroed).then_some(fit);
        let old = blocks.with_arena(target.host_node, |arena, out| {
            arena.make_room_from_cache(resizable, capacity, limit, out)
        });
        if let Some(old) = old.flatten() {
            if let Some(block) = self.resize_cached(old, (size, capacity), fit, target) {
                return Some(block);
            }
        }
        let made = self
            .create_block(capacity, fit.align, target, plan.head)
            .ok()?;
        let block = self.record_created(made)?;
        if let Some(watch) = plan.watch {
            watch.set(block.addr, block.capacity, block.addr);
        }
        Some(block)
    }

    /// A new block of `capacity` bytes (`size` asked for) for `fit` made of `old`, a cached block
    /// of another size
    /// ([`Arena::make_room_from_cache`] says which): a larger one shrinks in place (its tail
    /// unmapped), a smaller one's pages move to the head of a new mapping (`mremap`,
    /// [`Self::grow_block`]) whose tail alone is fresh and populated. A phase of a program that
    /// asks for a buffer of another size than the last one so takes the resident pages the last
    /// one left instead of faulting in as many fresh ones while those are evicted. `None` when
    /// it failed: `old` goes back to the cache, and the room is made again.
    fn resize_cached(
        &self,
        old: Dedicated,
        (size, capacity): (usize, usize),
        fit: Fit,
        target: &Resolved,
    ) -> Option<Block> {
        let blocks = self.blocks;
        let resized = if old.block.capacity > capacity {
            let mut old = old;
            if old.memory.truncate(capacity) {
                old.block.capacity = capacity;
                Ok(old)
            } else {
                Err(old)
            }
        } else {
            self.grow_block(old, (size, capacity), fit.align, &target.nodes)
        };
        match resized {
            Ok(mut made) => {
                made.block.routed_for = target.ordinal;
                let block = self.record_created(made)?;
                blocks.counters.resized_from_cache.incr();
                Some(block)
            }
            Err(old) => {
                let limit = blocks.settings.cache_limit;
                blocks.with_arena(target.host_node, |arena, out| {
                    arena.cache(old, limit, out);
                    arena.make_room(capacity, limit, out);
                });
                None
            }
        }
    }

    /// Creates a block of `capacity` bytes for `target`, placed, its first `populate` bytes
    /// populated and (when configured) pinned, whose address is a multiple of `align`. When that fails for want of memory, gives
    /// the target node's cached blocks back and retries: first the oldest ones, only as many
    /// bytes as the block needs, then, if it fails again, all of them. Blocks pending on GPU work
    /// stay.
    pub(crate) fn create_block(
        &self,
        capacity: usize,
        align: usize,
        target: &Resolved,
        populate: usize,
    ) -> Result<Dedicated, Error> {
        let blocks = self.blocks;
        let mut created = self.try_create_block(capacity, align, target, populate);
        if let Err((_, e)) = &created {
            let needed = shortage_bytes(e, capacity);
            if (Pressure { blocks }).relieves(target.host_node, needed, e) {
                created = self.try_create_block(capacity, align, target, populate);
            }
        }
        created.map_err(|(cause, e)| {
            cause.count(&blocks.counters);
            e
        })
    }

    /// One attempt of [`Self::create_block`]: the placer's block, pinned as the value's pin
    /// policy decides for the target.
    fn try_create_block(
        &self,
        capacity: usize,
        align: usize,
        target: &Resolved,
        populate: usize,
    ) -> Result<Dedicated, (Cause, Error)> {
        let blocks = self.blocks;
        let pin = PinPolicy::decide(blocks.settings.pin, target.gpu.is_some());
        let (memory, pinned) =
            blocks
                .placer()
                .block(capacity, align, &target.place(), populate, pin)?;
        Ok(Dedicated::new(
            memory,
            target.host_node,
            blocks.kind_of(pinned),
            target.ordinal,
        ))
    }

    /// Records a dedicated block just created (or grown) as live in its node's arena, releases
    /// what the cache may no longer hold, and returns what to hand out. `None` when its node has
    /// no arena (an id beyond the table, from a strange sysfs) or the arena could not record it:
    /// the block is released then, as nothing could free it.
    pub(crate) fn record_created(&self, dedicated: Dedicated) -> Option<Block> {
        let blocks = self.blocks;
        let node = dedicated.block.node;
        let Some(mut arena) = blocks.arena(node) else {
            self.release(dedicated);
            return None;
        };
        let mut out = Released::default();
        let recorded = arena.insert_created(dedicated, blocks.settings.cache_limit, &mut out);
        drop(arena);
        blocks.finish(node, &mut out);
        recorded.map_err(|unrecorded| self.release(unrecorded)).ok()
    }

    /// Unregisters (if pinned) and unmaps a dedicated block nobody uses any more, counted.
    pub(crate) fn release(&self, dedicated: Dedicated) {
        count_release(&self.blocks.counters, dedicated.memory.release());
    }

    /// Grows an unpinned dedicated block to `capacity` without copying: a new mapping of that
    /// size (aligned to `align`) gets its tail placed on the block's node (`nodes`, the policy's
    /// nodes there) and populated, then the block's pages move onto its head (`mremap`). Nothing
    /// is left behind to cache, and only the tail is populated. A lazy block instead moves and
    /// grows in one `mremap` into the new mapping's place (one kernel mapping still, so it can
    /// grow so again on kernels that move only one at a time), and then its tail is populated
    /// too, up to the `size` asked for: a growing block is written whole
    /// ([`Blocks::populates_request`]), but not the rounding up to its class. When it cannot grow
    /// so, the block is given back untouched (the caller then moves it by copying).
    pub(crate) fn grow_block(
        &self,
        dedicated: Dedicated,
        (size, capacity): (usize, usize),
        align: usize,
        nodes: &NodeMask,
    ) -> Result<Dedicated, Dedicated> {
        let old = dedicated.block;
        // Growing means a longer block: anything else is the caller's to copy.
        let Some(tail_len) = capacity.checked_sub(old.capacity).filter(|&n| n > 0) else {
            return Err(dedicated);
        };
        let placer = self.blocks.placer();
        let limits = self.blocks.process.memory_limits();
        if old.kind.lazy {
            // Nothing to populate first: the block moves and grows in one call, one mapping
            // still, its new pages under its policy (placed where touched).
            let place = limits
                .check(tail_len)
                .and_then(|()| placer.map(capacity, align));
            let Ok(place) = place else {
                return Err(dedicated);
            };
            return match dedicated.memory.grow_into(place) {
                Ok(mut memory) => {
                    let page = self.blocks.page_size();
                    let written = size.next_multiple_of(page).min(capacity);
                    let populated = written.saturating_sub(old.capacity);
                    let tail = (populated > 0).then(|| memory.part(old.capacity, populated));
                    if let Some(mut tail) = tail.flatten() {
                        // A failure leaves the tail to be faulted in where written, as before
                        // populating it: the block has grown either way.
                        let _ = placer.populate(&mut tail, nodes);
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
        let mut grown = match limits.check(tail_len).and_then(|()| {
            let mut mapping = placer.map(capacity, align)?;
            // Block capacities are whole pages, so the tail starts on a page.
            let mut tail = mapping.part(old.capacity, tail_len)?;
            placer
                .place_and_populate(&mut tail, nodes, tail_len)
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
}
