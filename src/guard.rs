//! Re-entrancy guard: marks the current thread as "inside the allocator".
//!
//! Code the large path calls allocates (the arena's maps, sysfs reads, libcuda loading, threads
//! that populate). Those allocations must not re-enter the large path, so while the flag is set
//! the large path sends every request to the inner allocator, which serves small requests anyway:
//! every pointer that is not a block of an arena is the inner allocator's, so frees are dispatched by one
//! rule. The flag is a const-initialised `Cell<bool>` with no destructor, so reading it never
//! allocates and works during thread teardown.

use std::cell::Cell;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Proof that this thread entered the allocator; leaving (drop) clears the flag.
pub(crate) struct Inside {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Inside {
    /// Enters the allocator, or `None` when this thread is already inside it.
    pub(crate) fn enter() -> Option<Inside> {
        INSIDE.with(|flag| {
            if flag.replace(true) {
                None
            } else {
                Some(Inside {
                    _not_send: std::marker::PhantomData,
                })
            }
        })
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|flag| flag.set(false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_entry_is_refused_until_the_outer_one_leaves() {
        let outer = Inside::enter().expect("first entry");
        assert!(Inside::enter().is_none());
        drop(outer);
        assert!(Inside::enter().is_some());
    }
}
