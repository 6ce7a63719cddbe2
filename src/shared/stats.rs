//! What a pool holds, as its processes see it.

/// What a [`SharedPool`](super::SharedPool) holds now. Each count is read on its own, at about the same time.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes of the pool's file, its header included.
    pub pool_bytes: usize,
    /// Bytes blocks may use.
    pub usable_bytes: usize,
    /// Bytes of live blocks, all processes together.
    pub live_bytes: usize,
    /// Live blocks, all processes together.
    pub live_blocks: usize,
    /// Processes attached (as far as the pool knows: one killed is still counted).
    pub attached: usize,
    /// Blocks handed out and freed since the pool was made, all processes together.
    pub allocations: u64,
    /// See `allocations`.
    pub frees: u64,
    /// Times the extent table was rebuilt after a process died holding the pool's lock.
    pub rebuilds: u64,
    /// Chunk registrations held, all processes together (as far as the pool knows: those of a
    /// killed process are still counted).
    pub registrations: u64,
    /// Chunks this process registered, and their bytes (counted in its pinned limit).
    pub registered_chunks: usize,
    /// See `registered_chunks`. This is what page-locking the pool costs this process: the
    /// kernel and the driver charge each registering process for its own registration (its
    /// locked memory; a driver page table of 16 bytes per 4 KiB page), though the pages are
    /// there once. Every process that registers the pool pays it again.
    pub registered_bytes: usize,
    /// Bytes registered by every process together (`registrations` chunks, the last chunk
    /// counted whole): what page-locking the pool costs the machine in charges, as opposed to
    /// memory.
    pub registered_bytes_all: u64,
    /// The node the pool's pages are on.
    pub node: usize,
    /// Whether its pages are huge pages (hugetlbfs).
    pub huge_pages: bool,
    /// Pages this process found on the node, page by page, as it made the pool: every page of
    /// its blocks in the creator (0 where the kernel refuses `move_pages`), 0 in a process that
    /// attached.
    pub pages_checked: u64,
}
