//! The node table: the process's one arena per NUMA node, shared by every allocator value.
//!
//! Slots are indexed by node id and filled on first use with a boxed, lock-protected arena that
//! lives as long as the process (a block may be freed through any value at any time, so no value
//! may own one). A slot is filled under the initialisation lock, which the fork handlers take
//! first: the list of arenas they lock, in node order, cannot grow during a fork.
//!
//! Unsafe code here relies on slots hold arenas leaked on first use and never freed.
#![allow(unsafe_code)]

use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::arena::Arena;
use crate::sys::lock::{Guard, Lock};
use crate::sys::MAX_NODES;

/// One slot per possible node id: null until that node's arena is first used.
pub(crate) struct NodeTable {
    slots: [AtomicPtr<Lock<Arena>>; MAX_NODES],
}

/// The process's arenas.
pub(crate) static NODES: NodeTable = NodeTable::new();

impl NodeTable {
    const fn new() -> Self {
        NodeTable {
            slots: [const { AtomicPtr::new(ptr::null_mut()) }; MAX_NODES],
        }
    }

    /// The arena of `node`, if it was ever used.
    pub(crate) fn existing(&self, node: usize) -> Option<&Lock<Arena>> {
        let slot = self.slots.get(node)?;
        // SAFETY: non-null slots hold arenas leaked by `arena`, never freed.
        unsafe { slot.load(Ordering::Acquire).as_ref() }
    }

    /// The arena of `node`, made now if this is its first use. `None` for a node id beyond
    /// [`MAX_NODES`], which no topology holds. Must be called inside the re-entrancy guard, not
    /// holding the initialisation lock (taken to make an arena).
    pub(crate) fn arena(&self, node: usize) -> Option<&Lock<Arena>> {
        if let Some(arena) = self.existing(node) {
            return Some(arena);
        }
        let slot = self.slots.get(node)?;
        let _init = super::INIT.lock();
        if slot.load(Ordering::Acquire).is_null() {
            let arena = Box::into_raw(Box::new(Lock::new(Arena::new(node))));
            slot.store(arena, Ordering::Release);
        }
        self.existing(node)
    }

    /// Locks `node`'s arena (see [`Self::arena`]).
    pub(crate) fn lock(&self, node: usize) -> Option<Guard<'_, Arena>> {
        self.arena(node).map(Lock::lock)
    }

    /// Every arena made so far, in node order (the fork handlers' lock order).
    pub(crate) fn arenas(&self) -> impl DoubleEndedIterator<Item = &Lock<Arena>> {
        (0..MAX_NODES).filter_map(|node| self.existing(node))
    }

    /// Runs `f` on each arena made so far, under its lock, in node order, until `f` returns
    /// `Some` (then that), trying `first` before the others.
    pub(crate) fn find_map<T>(
        &self,
        first: usize,
        mut f: impl FnMut(&mut Arena) -> Option<T>,
    ) -> Option<T> {
        let first_arena = self.existing(first);
        if let Some(found) = first_arena.and_then(|a| f(&mut a.lock())) {
            return Some(found);
        }
        self.arenas()
            .filter(|a| !first_arena.is_some_and(|f| ptr::eq(*a, f)))
            .find_map(|a| f(&mut a.lock()))
    }
}
