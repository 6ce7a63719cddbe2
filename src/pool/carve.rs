//! The carving state of a shared pool, kept inside the pool's own memory so that every process
//! that maps the pool carves from it: two tables of extents (free ranges by offset, merged; live
//! blocks by offset, each with the pid that carved it, for [`Carve::reclaim`]) and an intent
//! record written before each change.
//!
//! Everything here runs under the pool's robust mutex. A holder killed in the middle of a change
//! leaves the tables half changed; the next holder sees it (the mutex says its owner died) and
//! [`Carve::rebuild`]s them: the live table is the truth (sorted, checked, the block of the
//! intent dropped, since its owner died before it could hand the block out or had asked to free
//! it), and the free table is made again from the gaps between live blocks. A block is never in
//! both tables afterwards, whatever instant the holder died at.
//!
//! Blocks never cross a chunk boundary (a multiple of `chunk` from `start`): each chunk is one
//! registration in every attached process, and no block straddles two.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Offsets and lengths are multiples of this (a cache line: no two blocks share one).
pub(crate) const GRANULE: u64 = 64;
/// The most live blocks a pool holds at once; the free table holds one more (each free range
/// but the last is followed by a live block).
pub(crate) const EXTENTS: usize = 4096;
/// The largest alignment a block may ask for (the mapping is aligned to it).
pub(crate) const MAX_ALIGN: u64 = 2 << 20;

/// `offset..offset+len` of the pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Extent {
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// A live block and the process that carved it (0: not known, see [`Carve::rebuild`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Live {
    pub(crate) block: Extent,
    pub(crate) pid: u32,
}

impl Extent {
    /// Its end; saturated for a corrupt extent, which then fits no pool.
    fn end(self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// The pool's geometry as the carving state records it: where blocks start and end, and the
/// chunk no block crosses (set once when the pool is made).
///
/// # Safety
/// `carve` points to the carving state of a mapped pool; only these fields, which nothing
/// changes after the pool is made, are read (its tables may be changing under another process).
pub(crate) unsafe fn geometry(carve: *const Carve) -> (u64, u64, u64) {
    // SAFETY: forwarded: mapped, and these fields are written only before the pool is shared.
    unsafe {
        (
            std::ptr::addr_of!((*carve).start).read_volatile(),
            std::ptr::addr_of!((*carve).end).read_volatile(),
            std::ptr::addr_of!((*carve).chunk).read_volatile(),
        )
    }
}

/// What the holder of the lock is changing, written before it starts and cleared after.
///
/// Atomics with release ordering, not plain fields: plain stores are the compiler's to reorder
/// against the tables' (or to drop, as a store overwritten by the clear with nothing reading it
/// in between), and a survivor that takes the lock after the holder died reads whatever reached
/// memory. With these, the record is in memory before any table changes, and cleared only after
/// they all did.
#[repr(C)]
#[derive(Debug, Default)]
struct Intent {
    /// 0: nothing; [`ALLOCATE`]; [`FREE`].
    op: AtomicU32,
    /// Who is changing it (for a reader of the pool's memory).
    pid: AtomicU32,
    offset: AtomicU64,
    len: AtomicU64,
}

impl Intent {
    /// Records `op` on `block`, before the tables change: the block first, then the op (a
    /// release store: a survivor that sees the op sees its block), then a release fence, which
    /// keeps the tables' stores after all of it.
    fn begin(&self, op: u32, pid: u32, block: Extent) {
        self.offset.store(block.offset, Ordering::Relaxed);
        self.len.store(block.len, Ordering::Relaxed);
        self.pid.store(pid, Ordering::Relaxed);
        self.op.store(op, Ordering::Release);
        fence(Ordering::Release);
    }

    /// Clears the record once the tables are whole: the fence keeps their stores before it.
    fn end(&self) {
        fence(Ordering::Release);
        self.op.store(0, Ordering::Relaxed);
    }

    /// The block of the change under way, if one is.
    fn pending(&self) -> Option<Extent> {
        (self.op.load(Ordering::Acquire) != 0).then(|| Extent {
            offset: self.offset.load(Ordering::Relaxed),
            len: self.len.load(Ordering::Relaxed),
        })
    }
}

const ALLOCATE: u32 = 1;
const FREE: u32 = 2;

/// The carving state (all zeros until [`Carve::init`]).
#[repr(C)]
pub(crate) struct Carve {
    start: u64,
    end: u64,
    chunk: u64,
    intent: Intent,
    free_count: u32,
    live_count: u32,
    /// Bytes of live blocks.
    pub(crate) live_bytes: u64,
    /// Blocks handed out, and freed, since the pool was made (every process together).
    pub(crate) allocations: u64,
    pub(crate) frees: u64,
    /// Times the state was rebuilt after a holder died.
    pub(crate) rebuilds: u64,
    free: [Extent; EXTENTS + 1],
    live: [Live; EXTENTS],
}

/// Why a free was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NotLive;

impl Carve {
    /// The state of an empty pool whose blocks lie in `start..end`, in chunks of `chunk` bytes
    /// (a multiple of [`MAX_ALIGN`]) from `start`.
    pub(crate) fn init(&mut self, start: u64, end: u64, chunk: u64) {
        self.start = start;
        self.end = end;
        self.chunk = chunk;
        self.intent.end();
        self.live_count = 0;
        self.free_count = 1;
        self.free[0] = Extent {
            offset: start,
            len: end - start,
        };
        self.live_bytes = 0;
        self.allocations = 0;
        self.frees = 0;
        self.rebuilds = 0;
    }

    pub(crate) fn live(&self) -> &[Live] {
        &self.live[..self.live_count as usize]
    }

    pub(crate) fn free_ranges(&self) -> &[Extent] {
        &self.free[..self.free_count as usize]
    }

    /// Carves `len` bytes at a multiple of `align` (up to [`MAX_ALIGN`]) inside one chunk, first
    /// fit by offset; `None` when no free range holds it or the live table is full.
    pub(crate) fn allocate(&mut self, len: u64, align: u64, pid: u32) -> Option<Extent> {
        let len = len.max(1).checked_next_multiple_of(GRANULE)?;
        let align = align.max(GRANULE);
        if len > self.chunk || align > MAX_ALIGN || self.live_count as usize == EXTENTS {
            return None;
        }
        let (index, offset) = self.free_ranges().iter().enumerate().find_map(|(i, &e)| {
            let mut at = e.offset.next_multiple_of(align);
            let into_chunk = (at - self.start) % self.chunk;
            if into_chunk + len > self.chunk {
                at += self.chunk - into_chunk;
            }
            (at + len <= e.end()).then_some((i, at))
        })?;
        let block = Extent { offset, len };
        self.intent.begin(ALLOCATE, pid, block);
        let range = self.free[index];
        let head = Extent {
            offset: range.offset,
            len: offset - range.offset,
        };
        let tail = Extent {
            offset: block.end(),
            len: range.end() - block.end(),
        };
        match (head.len > 0, tail.len > 0) {
            (true, true) => {
                self.free[index] = head;
                insert(&mut self.free, &mut self.free_count, index + 1, tail);
            }
            (true, false) => self.free[index] = head,
            (false, true) => self.free[index] = tail,
            (false, false) => remove(&mut self.free, &mut self.free_count, index),
        }
        let at = self.live().partition_point(|e| e.block.offset < offset);
        insert(
            &mut self.live,
            &mut self.live_count,
            at,
            Live { block, pid },
        );
        self.live_bytes += len;
        self.allocations += 1;
        self.intent.end();
        Some(block)
    }

    /// The live block at `offset`, if there is one.
    pub(crate) fn find(&self, offset: u64) -> Option<Extent> {
        let live = self.live();
        let at = live.partition_point(|e| e.block.offset < offset);
        live.get(at)
            .filter(|e| e.block.offset == offset)
            .map(|e| e.block)
    }

    /// Frees the live block at `offset` (whoever carved it), merging it with its free
    /// neighbours; its length.
    pub(crate) fn free(&mut self, offset: u64, pid: u32) -> Result<u64, NotLive> {
        let at = self.live().partition_point(|e| e.block.offset < offset);
        let block = self
            .live()
            .get(at)
            .filter(|e| e.block.offset == offset)
            .ok_or(NotLive)?
            .block;
        self.intent.begin(FREE, pid, block);
        remove(&mut self.live, &mut self.live_count, at);
        let next = self.free_ranges().partition_point(|e| e.offset < offset);
        let joins_prev = next > 0 && self.free[next - 1].end() == offset;
        let joins_next = next < self.free_count as usize && self.free[next].offset == block.end();
        match (joins_prev, joins_next) {
            (true, true) => {
                self.free[next - 1].len += block.len + self.free[next].len;
                remove(&mut self.free, &mut self.free_count, next);
            }
            (true, false) => self.free[next - 1].len += block.len,
            (false, true) => {
                self.free[next].offset = offset;
                self.free[next].len += block.len;
            }
            // Room: free ranges are separated by live blocks, so there are at most one more
            // of them than live blocks, and the free table has that one more slot.
            (false, false) => insert(&mut self.free, &mut self.free_count, next, block),
        }
        self.live_bytes -= block.len;
        self.frees += 1;
        self.intent.end();
        Ok(block.len)
    }

    /// Frees every live block process `pid` carved (as `by`); how many, and their bytes.
    pub(crate) fn reclaim(&mut self, pid: u32, by: u32) -> (usize, u64) {
        let (mut blocks, mut bytes) = (0, 0);
        // Never 0, the owner of blocks a rebuild could not attribute.
        while let Some(e) = self
            .live()
            .iter()
            .find(|e| pid != 0 && e.pid == pid)
            .copied()
        {
            // A block just found live frees.
            let Ok(len) = self.free(e.block.offset, by) else {
                break;
            };
            blocks += 1;
            bytes += len;
        }
        (blocks, bytes)
    }

    /// Whether the tables hold together: each sorted, inside the pool, live blocks inside one
    /// chunk, free ranges merged, and the two together covering the pool exactly once.
    pub(crate) fn consistent(&self) -> bool {
        if self.start >= self.end
            || self.chunk == 0
            || !self.chunk.is_multiple_of(MAX_ALIGN)
            || self.free_count as usize > EXTENTS + 1
            || self.live_count as usize > EXTENTS
        {
            return false;
        }
        let chunk_of = |at: u64| at.checked_sub(self.start).map(|at| at / self.chunk);
        if self.live().iter().map(|e| e.block).any(|e| {
            e.len == 0
                || chunk_of(e.offset).is_none()
                || chunk_of(e.offset) != chunk_of(e.end() - 1)
        }) {
            return false;
        }
        let mut f = self.free_ranges().iter().peekable();
        let mut l = self.live().iter().map(|e| &e.block).peekable();
        let (mut at, mut last_free) = (self.start, false);
        loop {
            let next = match (f.peek(), l.peek()) {
                (Some(a), Some(b)) if a.offset <= b.offset => (f.next(), true),
                (Some(_), None) => (f.next(), true),
                (_, Some(_)) => (l.next(), false),
                (None, None) => break,
            };
            let (Some(e), is_free) = next else { break };
            if e.offset != at || e.len == 0 || (is_free && last_free) {
                return false;
            }
            at = e.end();
            last_free = is_free;
        }
        at == self.end && self.intent.pending().is_none()
    }

    /// Makes the state whole again after a holder died mid-change: keeps the live blocks that
    /// hold together (sorted, inside the pool and one chunk, not overlapping), drops the block
    /// of the change under way, and makes the free ranges again from the gaps. Returns how many
    /// live entries were dropped.
    pub(crate) fn rebuild(&mut self) -> usize {
        // One slot past the count too: a holder killed inside an insert may have shifted the
        // last live block there before counting it (a shift leaves entries in order, at worst
        // one twice, which the overlap filter below drops; removes clear the slot they vacate).
        let count = (self.live_count as usize).min(EXTENTS);
        let scanned = (count + 1).min(EXTENTS);
        if self.chunk == 0 || self.start >= self.end {
            return count;
        }
        let doomed = self.intent.pending();
        // Insertion sort in place: no allocation inside the allocator, and the table is nearly
        // sorted (at most one entry moved when the holder died).
        for i in 1..scanned {
            let mut j = i;
            while j > 0 && self.live[j - 1].block.offset > self.live[j].block.offset {
                self.live.swap(j - 1, j);
                j -= 1;
            }
        }
        let (mut kept, mut end) = (0, self.start);
        let mut live_bytes = 0;
        for i in 0..scanned {
            let entry = self.live[i];
            let e = entry.block;
            if kept > 0 && self.live[kept - 1].block.offset == e.offset {
                // The same block twice: the holder died copying entries, and the one kept may
                // be torn (its owner another entry's): its owner is not known, and
                // `reclaim` never frees it.
                self.live[kept - 1].pid = 0;
            }
            let fits = e.len > 0
                && e.offset >= end
                && e.offset >= self.start
                && e.end() <= self.end
                && (e.offset - self.start) / self.chunk == (e.end() - 1 - self.start) / self.chunk;
            if fits && doomed != Some(e) {
                self.live[kept] = entry;
                kept += 1;
                end = e.end();
                live_bytes += e.len;
            }
        }
        let dropped = count.saturating_sub(kept);
        // Nothing stale past the kept ones for a later rebuild to take back.
        self.live[kept..scanned].fill(Live::default());
        self.live_count = kept as u32;
        self.live_bytes = live_bytes;
        let mut free = 0;
        let mut at = self.start;
        for i in 0..=kept {
            let until = self
                .live
                .get(i)
                .filter(|_| i < kept)
                .map_or(self.end, |e| e.block.offset);
            if until > at {
                self.free[free] = Extent {
                    offset: at,
                    len: until - at,
                };
                free += 1;
            }
            if i < kept {
                at = self.live[i].block.end();
            }
        }
        self.free_count = free as u32;
        self.intent.end();
        self.rebuilds += 1;
        dropped
    }
}

fn insert<T: Copy, const N: usize>(table: &mut [T; N], count: &mut u32, at: usize, e: T) {
    let n = *count as usize;
    table.copy_within(at..n, at + 1);
    table[at] = e;
    *count += 1;
}

fn remove<T: Copy + Default, const N: usize>(table: &mut [T; N], count: &mut u32, at: usize) {
    let n = *count as usize;
    table.copy_within(at + 1..n, at);
    *count -= 1;
    // The vacated slot holds no extent a rebuild could take for live.
    table[n - 1] = T::default();
}

#[cfg(test)]
mod tests {
    //! A holder dying at each point of a change: the rebuild makes the tables whole, keeps every
    //! other live block, and frees the block of the change.
    use super::*;

    fn carve() -> Box<Carve> {
        let layout = std::alloc::Layout::new::<Carve>();
        // SAFETY: integers only, for which zero is a value; the box owns the allocation.
        let mut carve = unsafe {
            let ptr = std::alloc::alloc_zeroed(layout).cast::<Carve>();
            assert!(!ptr.is_null());
            Box::from_raw(ptr)
        };
        carve.init(2 << 20, 10 << 20, 2 << 20);
        carve
    }

    fn with_blocks() -> (Box<Carve>, Vec<Extent>) {
        let mut c = carve();
        let kept: Vec<Extent> = (0..6).map(|_| c.allocate(4096, 64, 1).unwrap()).collect();
        c.free(kept[2].offset, 1).unwrap();
        let kept = [kept[0], kept[1], kept[3], kept[4], kept[5]].to_vec();
        (c, kept)
    }

    fn assert_whole(c: &mut Carve, kept: &[Extent], gone: Extent) {
        assert!(c.rebuild() <= 1);
        assert!(c.consistent());
        let live: Vec<Extent> = c.live().iter().map(|e| e.block).collect();
        assert_eq!(live, kept);
        assert!(c.find(gone.offset).is_none());
        assert_eq!(c.live_bytes, kept.iter().map(|e| e.len).sum::<u64>());
    }

    #[test]
    fn died_allocating_after_taking_the_free_range_before_recording_the_block() {
        let (mut c, kept) = with_blocks();
        let block = Extent {
            offset: kept[4].end(),
            len: 8192,
        };
        c.intent.begin(ALLOCATE, 2, block);
        let last = c.free_count as usize - 1;
        c.free[last].offset += block.len;
        c.free[last].len -= block.len;
        assert!(!c.consistent());
        assert_whole(&mut c, &kept, block);
    }

    #[test]
    fn died_allocating_after_recording_the_block() {
        let (mut c, kept) = with_blocks();
        let block = c.allocate(8192, 64, 2).unwrap();
        // As if the holder died before clearing the intent (and before handing the block out).
        c.intent.begin(ALLOCATE, 2, block);
        assert_whole(&mut c, &kept, block);
    }

    #[test]
    fn died_freeing_after_dropping_the_block_before_merging_it() {
        let (mut c, mut kept) = with_blocks();
        let block = kept.remove(1);
        c.intent.begin(FREE, 2, block);
        remove(&mut c.live, &mut c.live_count, 1);
        assert!(!c.consistent());
        assert_whole(&mut c, &kept, block);
    }

    #[test]
    fn died_inside_the_live_insert_after_shifting_before_counting() {
        let (mut c, kept) = with_blocks();
        // A block going in at index 2 (the hole a free left between kept[1] and kept[2]).
        let block = Extent {
            offset: kept[1].end(),
            len: 4096,
        };
        c.intent.begin(ALLOCATE, 2, block);
        let n = c.live_count as usize;
        c.live.copy_within(2..n, 3);
        c.live[2] = Live { block, pid: 2 };
        // Killed here: the last live block sits at index `live_count`, uncounted.
        assert!(!c.consistent());
        assert_whole(&mut c, &kept, block);
        // Its range is not handed out again.
        let again = c.allocate(4096, 64, 3).unwrap();
        assert!(kept
            .iter()
            .all(|k| again.end() <= k.offset || k.end() <= again.offset));
    }

    #[test]
    fn died_freeing_before_touching_the_tables() {
        let (mut c, mut kept) = with_blocks();
        let block = kept.remove(0);
        c.intent.begin(FREE, 2, block);
        assert_whole(&mut c, &kept, block);
    }

    #[test]
    fn reclaim_frees_the_blocks_of_one_process_only() {
        let mut c = carve();
        let blocks: Vec<Extent> = [1, 2, 1, 3]
            .iter()
            .map(|&pid| c.allocate(4096, 64, pid).unwrap())
            .collect();
        assert_eq!(c.reclaim(1, 9), (2, 8192));
        assert!(c.consistent());
        let owners: Vec<u32> = c.live().iter().map(|e| e.pid).collect();
        assert_eq!(owners, [2, 3]);
        assert!(c.find(blocks[0].offset).is_none() && c.find(blocks[1].offset).is_some());
        assert_eq!(c.reclaim(1, 9), (0, 0));
        assert_eq!(c.frees, 2);
    }

    #[test]
    fn a_block_seen_twice_by_a_rebuild_has_no_owner_to_reclaim() {
        let (mut c, kept) = with_blocks();
        // Killed shifting entries up for an insert at 2: entries 2.. copied one up, and the
        // one left at 2, the same block as at 3, torn (another process's pid over it).
        let n = c.live_count as usize;
        c.live.copy_within(2..n, 3);
        c.live[2].pid = 7;
        assert_whole(&mut c, &kept, Extent::default());
        let at = c.live().iter().position(|e| e.block == kept[2]).unwrap();
        assert_eq!(
            c.live()[at].pid,
            0,
            "the owner of a block seen twice is not known"
        );
        assert_eq!(c.reclaim(7, 9), (0, 0));
        assert_eq!(c.reclaim(0, 9), (0, 0), "owner 0 is never reclaimed");
        assert_eq!(c.live().len(), kept.len());
    }
}
