//! The sysfs trees of real machines in `tests/fixtures/` (its README says which machine each
//! models): what the topology reads from them, and where an allocator decides to place blocks.
//! One binary: neither needs a process of its own.

mod placement;
mod topology;
