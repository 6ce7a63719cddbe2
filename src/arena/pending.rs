//! Stream-ordered reuse: freed blocks that GPU work may still read or write wait here, out of the
//! cache, until every recorded use has completed.
//!
//! Completion is only ever polled ([`InFlight::is_complete`]) on the allocation path, O(pending).

use super::{Backing, Block, Fit};

/// GPU work that may still read or write a block: CUDA events recorded on streams.
///
/// Its methods and its `Drop` run under the arena lock, inside the re-entrancy guard: they may
/// allocate (that goes to the inner allocator) but must be quick, must not call into this
/// allocator, and must not own memory of its large path (a large free from inside the allocator
/// would be handed to the inner allocator).
pub(crate) trait InFlight: Send {
    /// Whether every recorded use has completed. Never blocks (`cuEventQuery`-style).
    fn is_complete(&mut self) -> bool;
    /// Blocks until every use completed (only where blocking is acceptable: a buffer that could
    /// not hand its work to an arena waits in its `Drop`); false when that cannot be known (the
    /// wait failed: the process is exiting, or the context broke), so the memory may still be in
    /// use.
    #[cfg_attr(
        not(feature = "pinned-buffer"),
        allow(dead_code, reason = "only the pinned front end waits")
    )]
    fn wait(&mut self) -> bool;
}

/// Work recorded against one block.
pub(crate) type Work = Vec<Box<dyn InFlight>>;

/// Drops the completed entries of `work`; whether none is left.
pub(crate) fn settle(work: &mut Work) -> bool {
    work.retain_mut(|w| !w.is_complete());
    work.is_empty()
}

/// A freed block and the work that still uses it.
struct PendingBlock {
    block: Block,
    /// Who holds its memory.
    backing: Backing,
    work: Work,
}

/// Freed blocks with work in flight, in no particular order. Room for every live block with
/// recorded work is reserved when the work is recorded ([`Self::reserve`]), so that a free never
/// allocates.
#[derive(Default)]
pub(crate) struct PendingList {
    blocks: Vec<PendingBlock>,
    bytes: usize,
}

impl PendingList {
    /// Makes room for `more` blocks beyond those pending now; false when none can be had.
    pub(crate) fn reserve(&mut self, more: usize) -> bool {
        self.blocks.try_reserve(more).is_ok()
    }

    /// Adds a freed block whose `work` is not complete, within the room reserved for it.
    pub(crate) fn push(&mut self, block: Block, backing: Backing, work: Work) {
        self.bytes += block.capacity;
        self.blocks.push(PendingBlock {
            block,
            backing,
            work,
        });
    }

    /// The next block from `cursor` on whose work has all completed, taken out (start with
    /// `cursor` 0 and call until `None`). O(pending) over the calls; never blocks.
    pub(crate) fn take_ready(&mut self, cursor: &mut usize) -> Option<(Block, Backing)> {
        while let Some(pending) = self.blocks.get_mut(*cursor) {
            if settle(&mut pending.work) {
                // The last block moves here: the cursor stays to look at it next.
                let done = self.blocks.swap_remove(*cursor);
                self.bytes -= done.block.capacity;
                return Some((done.block, done.backing));
            }
            *cursor += 1;
        }
        None
    }

    /// Whether a pending block would have served this request (a miss that stream-ordered reuse
    /// deferred): a dedicated one that `fit` admits, or a carved one of its kind and at least its
    /// size. O(pending).
    pub(crate) fn holds_fit(&self, fit: Fit) -> bool {
        self.blocks.iter().any(|p| match p.backing {
            Backing::Dedicated(_) => fit.admits(&p.block),
            Backing::Carved(_) => p.block.kind == fit.kind && p.block.capacity >= fit.least,
        })
    }

    /// Number of pending blocks.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Sum of the pending blocks' capacities.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A test double for [`InFlight`]: complete once the shared flag is set.
#[cfg(test)]
pub(crate) mod double {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::InFlight;

    /// Work that completes when its flag is set; `wait` sets it (as a finished stream would).
    pub(crate) struct Flag(pub(crate) Arc<AtomicBool>);

    impl Flag {
        /// Unfinished work and the switch that finishes it.
        pub(crate) fn unfinished() -> (Box<dyn InFlight>, Arc<AtomicBool>) {
            let done = Arc::new(AtomicBool::new(false));
            (Box::new(Flag(Arc::clone(&done))), done)
        }
    }

    impl InFlight for Flag {
        fn is_complete(&mut self) -> bool {
            self.0.load(Ordering::Acquire)
        }
        fn wait(&mut self) -> bool {
            self.0.store(true, Ordering::Release);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::double::Flag;
    use super::*;
    use crate::arena::Kind;

    const MIB: usize = 1 << 20;

    fn block(addr: usize) -> Block {
        Block {
            addr,
            capacity: 4 * MIB,
            node: 0,
            kind: PINNED,
            routed_for: None,
        }
    }

    /// A pinned dedicated block's memory at `offset` of the planned region.
    fn memory(offset: usize) -> Backing {
        let dedicated = crate::arena::tests::dedicated(offset, 4 * MIB, true);
        Backing::Dedicated(dedicated.memory)
    }

    const PINNED: Kind = Kind {
        policy: crate::MemPolicy::Preferred,
        pinned: true,
        flags: crate::cuda::RegisterFlags {
            devicemap: false,
            read_only: false,
        },
        lazy: false,
        verified: false,
    };

    #[test]
    fn a_block_is_ready_only_when_all_its_work_completed() {
        let mut list = PendingList::default();
        assert!(list.reserve(2));
        let (first, first_done) = Flag::unfinished();
        let (second, second_done) = Flag::unfinished();
        list.push(block(0x1000), memory(0x1000), vec![first, second]);
        let (other, other_done) = Flag::unfinished();
        list.push(block(0x2000), memory(0x2000), vec![other]);
        assert_eq!((list.len(), list.bytes()), (2, 8 * MIB));
        assert!(list.holds_fit(Fit::new(4 * MIB, 4 * MIB, 4096, PINNED)));
        assert!(!list.holds_fit(Fit::new(5 * MIB, 5 * MIB, 4096, PINNED)));

        let mut ready = Vec::new();
        let poll = |list: &mut PendingList, ready: &mut Vec<Block>| {
            let mut cursor = 0;
            while let Some((b, _)) = list.take_ready(&mut cursor) {
                ready.push(b);
            }
        };
        first_done.store(true, Ordering::Release);
        poll(&mut list, &mut ready);
        assert!(ready.is_empty(), "one of two uses is still running");
        other_done.store(true, Ordering::Release);
        poll(&mut list, &mut ready);
        assert_eq!(ready, [block(0x2000)]);
        second_done.store(true, Ordering::Release);
        poll(&mut list, &mut ready);
        assert_eq!(ready, [block(0x2000), block(0x1000)]);
        assert_eq!((list.len(), list.bytes()), (0, 0));
    }
}
