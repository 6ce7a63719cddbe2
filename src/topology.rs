//! NUMA topology (in progress).

/// The ACPI SLIT distance from a node to itself.
pub const LOCAL_NUMA_DISTANCE: u8 = 10;
