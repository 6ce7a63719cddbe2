//! The extent table of a shared pool, kept inside the pool's own memory so that every process
//! that maps the pool carves from it: two tables of extents (free ranges by offset, merged; live
//! blocks by offset, each with the pid that carved it, for [`ExtentTable::reclaim`]) and an intent
//! record written before each change.
//!
//! Everything here runs under the pool's lock. A holder killed in the middle of a change
//! leaves the tables half changed; the next holder sees it (the mutex says its owner died) and
//! [`ExtentTable::rebuild`]s them: the live table is the truth (sorted, checked, the block of the
//! intent dropped, since its owner died before it could hand the block out or had asked to free
//! it), and the free table is made again from the gaps between live blocks. A block is never in
//! both tables afterwards, whatever instant the holder died at.
//!
//! Blocks never cross a chunk boundary (a multiple of `chunk` from `start`): each chunk is one
//! registration in every attached process, and no block straddles two.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::sys::HUGE_PAGE;

/// Offsets and lengths are multiples of this (a cache line: no two blocks share one).
pub(crate) const GRANULE: u64 = 64;
/// The most live blocks a pool holds at once; the free table holds one more (each free range
/// but the last is followed by a live block).
pub(crate) const EXTENTS: usize = 4096;
/// The largest alignment a block may ask for: a huge page (the mapping is aligned to it).
pub(crate) const MAX_ALIGN: u64 = HUGE_PAGE as u64;

/// `offset..offset+len` of the pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Extent {
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// A live block, the process that carved it, and its serial (the pool's allocation count when
/// it was carved, truncated: a handle freed twice does not match a later block at its offset).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Live {
    pub(crate) block: Extent,
    pub(crate) pid: u32,
    pub(crate) serial: u32,
}

impl Extent {
    /// Its end; saturated for a corrupt extent, which then fits no pool.
    fn end(self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// The pool's geometry as the extent table records it: where blocks start and end, and the
/// chunk no block crosses (set once when the pool is made).
///
/// # Safety
/// `table` points to the extent table of a mapped pool; only these fields, which nothing
/// changes after the pool is made, are read (its tables may be changing under another process).
pub(crate) unsafe fn geometry(table: *const ExtentTable) -> (u64, u64, u64) {
    // SAFETY: forwarded: mapped, and these fields are written only before the pool is shared.
    unsafe {
        (
            std::ptr::addr_of!((*table).start).read_volatile(),
            std::ptr::addr_of!((*table).end).read_volatile(),
            std::ptr::addr_of!((*table).chunk).read_volatile(),
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

/// The extent table (all zeros until [`ExtentTable::init`]).
#[repr(C)]
pub(crate) struct ExtentTable {
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

/// What a locker found ([`ExtentTable::admit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Whole: every operation may rely on it.
    Whole,
    /// Not whole (a holder died mid-change, or a stray write): rebuilt, and now whole.
    Repaired,
    /// Not whole even after a rebuild: nothing may table it.
    Broken,
}

impl ExtentTable {
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

    /// What each locker runs before it uses the state: checks that it is whole ([`Self::consistent`]:
    /// every count, index and extent against its table and the pool) with the bounds and chunk
    /// this process attached with (`start`, `end`, `chunk`, which never change), and, when it is
    /// not or when `holder_died`, puts those back and rebuilds it. Every byte of the state may
    /// be anything here (every attached process can write it): nothing panics.
    pub(crate) fn admit(&mut self, start: u64, end: u64, chunk: u64, holder_died: bool) -> Admit {
        if !holder_died
            && (self.start, self.end, self.chunk) == (start, end, chunk)
            && self.consistent()
        {
            return Admit::Whole;
        }
        (self.start, self.end, self.chunk) = (start, end, chunk);
        self.rebuild();
        if self.consistent() {
            Admit::Repaired
        } else {
            Admit::Broken
        }
    }

    /// The live entries (empty when the count is past the table: [`Self::admit`] catches it).
    pub(crate) fn live(&self) -> &[Live] {
        self.live.get(..self.live_count as usize).unwrap_or(&[])
    }

    /// The free ranges (empty when the count is past the table, as for [`Self::live`]).
    pub(crate) fn free_ranges(&self) -> &[Extent] {
        self.free.get(..self.free_count as usize).unwrap_or(&[])
    }

    /// Carves `len` bytes at a multiple of `align` (up to [`MAX_ALIGN`]) inside one chunk, first
    /// fit by offset; `None` when no free range holds it or the live table is full.
    pub(crate) fn allocate(&mut self, len: u64, align: u64, pid: u32) -> Option<Extent> {
        let len = len.max(1).checked_next_multiple_of(GRANULE)?;
        let align = align.max(GRANULE);
        if len > self.chunk || align > MAX_ALIGN || self.live_count as usize == EXTENTS {
            return None;
        }
        // Checked arithmetic throughout: another process may write these words even while this
        // one holds the lock, and bytes in the file must never make the allocator panic.
        let (index, offset) = self.free_ranges().iter().enumerate().find_map(|(i, &e)| {
            let mut at = e.offset.checked_next_multiple_of(align)?;
            let into_chunk = at.checked_sub(self.start)?.checked_rem(self.chunk)?;
            if into_chunk.saturating_add(len) > self.chunk {
                at = at.checked_add(self.chunk.checked_sub(into_chunk)?)?;
            }
            (at.checked_add(len)? <= e.end()).then_some((i, at))
        })?;
        let block = Extent { offset, len };
        let serial = self.allocations.wrapping_add(1) as u32;
        self.intent.begin(ALLOCATE, pid, block);
        let range = self.free[index];
        let head = Extent {
            offset: range.offset,
            len: offset.saturating_sub(range.offset),
        };
        let tail = Extent {
            offset: block.end(),
            len: range.end().saturating_sub(block.end()),
        };
        match (head.len > 0, tail.len > 0) {
            (true, true) => {
                self.free[index] = head;
                insert(
                    &mut self.free,
                    &mut self.free_count,
                    index + 1,
                    tail,
                    &mut always,
                );
            }
            (true, false) => self.free[index] = head,
            (false, true) => self.free[index] = tail,
            (false, false) => remove(&mut self.free, &mut self.free_count, index, &mut always),
        }
        let at = self.live().partition_point(|e| e.block.offset < offset);
        insert(
            &mut self.live,
            &mut self.live_count,
            at,
            Live { block, pid, serial },
            &mut always,
        );
        self.live_bytes = self.live_bytes.wrapping_add(len);
        self.allocations = self.allocations.wrapping_add(1);
        self.intent.end();
        Some(block)
    }

    /// Records `pid` as the owner of the live block at `offset` of `len` and `serial` (so that
    /// `reclaim` of the process that carved it leaves it be); `false` when there is none.
    pub(crate) fn adopt(&mut self, offset: u64, len: u64, serial: u32, pid: u32) -> bool {
        let count = self.live().len();
        let at = self.live().partition_point(|e| e.block.offset < offset);
        match self.live[..count].get_mut(at) {
            // One aligned word: a holder killed here leaves either pid, both valid.
            Some(e) if (e.block.offset, e.block.len, e.serial) == (offset, len, serial) => {
                e.pid = pid;
                true
            }
            _ => false,
        }
    }

    /// The live block at `offset`, if there is one.
    pub(crate) fn find(&self, offset: u64) -> Option<Live> {
        let live = self.live();
        let at = live.partition_point(|e| e.block.offset < offset);
        live.get(at).filter(|e| e.block.offset == offset).copied()
    }

    /// Frees the live block at `offset` (whoever carved it), merging it with its free
    /// neighbours; its length. With `expect` (a length and a serial), only a block of that
    /// length and serial: a handle freed twice must not free a later block carved at the same
    /// offset.
    pub(crate) fn free(
        &mut self,
        offset: u64,
        expect: Option<(u64, u32)>,
        pid: u32,
    ) -> Result<u64, NotLive> {
        let at = self.live().partition_point(|e| e.block.offset < offset);
        let block = self
            .live()
            .get(at)
            .filter(|e| {
                e.block.offset == offset
                    && expect.is_none_or(|(len, serial)| (e.block.len, e.serial) == (len, serial))
            })
            .ok_or(NotLive)?
            .block;
        self.intent.begin(FREE, pid, block);
        remove(&mut self.live, &mut self.live_count, at, &mut always);
        let next = self.free_ranges().partition_point(|e| e.offset < offset);
        let joins_prev = next > 0 && self.free[next - 1].end() == offset;
        let joins_next = next < self.free_ranges().len() && self.free[next].offset == block.end();
        match (joins_prev, joins_next) {
            (true, true) => {
                self.free[next - 1].len += block.len + self.free[next].len;
                remove(&mut self.free, &mut self.free_count, next, &mut always);
            }
            (true, false) => self.free[next - 1].len += block.len,
            (false, true) => {
                self.free[next].offset = offset;
                self.free[next].len += block.len;
            }
            // Room: free ranges are separated by live blocks, so there are at most one more
            // of them than live blocks, and the free table has that one more slot.
            (false, false) => insert(
                &mut self.free,
                &mut self.free_count,
                next,
                block,
                &mut always,
            ),
        }
        self.live_bytes = self.live_bytes.wrapping_sub(block.len);
        self.frees = self.frees.wrapping_add(1);
        self.intent.end();
        Ok(block.len)
    }

    /// Frees every live block process `pid` carved (as `by`); how many, and their bytes.
    pub(crate) fn reclaim(&mut self, pid: u32, by: u32) -> (usize, u64) {
        let (mut blocks, mut bytes) = (0, 0);
        while let Some(e) = self.live().iter().find(|e| e.pid == pid).copied() {
            // A block just found live frees.
            let Ok(len) = self.free(e.block.offset, None, by) else {
                break;
            };
            blocks += 1;
            bytes += len;
        }
        (blocks, bytes)
    }

    /// Whether the tables hold together: counts inside their tables, each table sorted, inside
    /// the pool, live blocks inside one chunk, free ranges merged, the two together covering the
    /// pool exactly once, the live bytes their sum, no change under way.
    pub(crate) fn consistent(&self) -> bool {
        if self.start >= self.end
            || self.chunk == 0
            || !self.chunk.is_multiple_of(MAX_ALIGN)
            || self.free_count as usize > EXTENTS + 1
            || self.live_count as usize > EXTENTS
        {
            return false;
        }
        let chunk_of = |at: u64| at.checked_sub(self.start)?.checked_div(self.chunk);
        if self.live().iter().map(|e| e.block).any(|e| {
            e.len == 0
                || chunk_of(e.offset).is_none()
                || chunk_of(e.offset) != chunk_of(e.end().saturating_sub(1))
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
        // Summed only once they cover the pool exactly once: then the sum cannot overflow.
        at == self.end
            && self.intent.pending().is_none()
            && self.live().iter().map(|e| e.block.len).sum::<u64>() == self.live_bytes
    }

    /// Makes the state whole again after a holder died mid-change: keeps the live blocks that
    /// hold together (in order, inside the pool and one chunk, not overlapping), drops the block
    /// of the change under way, and makes the free ranges again from the gaps. Returns how many
    /// live entries were dropped.
    pub(crate) fn rebuild(&mut self) -> usize {
        self.rebuild_until(&mut always)
    }

    /// [`Self::rebuild`], asking `go_on` before each store that matters to a later rebuild:
    /// `false` stops there, as a kill would (the tests kill it at each in turn).
    fn rebuild_until(&mut self, go_on: &mut impl FnMut() -> bool) -> usize {
        // One slot past the count too: a holder killed inside an insert may have shifted the
        // last live block there before counting it. A shift killed at any store leaves entries
        // in order, at worst one twice or one torn, each after a whole entry at its offset
        // (see `insert` and `remove`); removes clear the slot they vacate. A rebuild killed
        // while it moves the kept entries down leaves, past them, entries it had kept (twice,
        // now) or dropped. The one pass below drops all of those: each starts before the end
        // of a block kept before it, or at the intent's block. Nothing is sorted: a kill inside
        // a swap could lose an entry.
        let count = (self.live_count as usize).min(EXTENTS);
        let scanned = (count + 1).min(EXTENTS);
        if self.chunk == 0 || self.start >= self.end {
            return count;
        }
        let doomed = self.intent.pending();
        let (mut kept, mut end) = (0, self.start);
        let mut live_bytes = 0;
        for i in 0..scanned {
            let entry = self.live[i];
            let e = entry.block;
            let fits = e.len > 0
                && e.offset >= end
                && e.offset >= self.start
                && e.end() <= self.end
                && (e.offset - self.start).checked_div(self.chunk)
                    == (e.end() - 1 - self.start).checked_div(self.chunk);
            // By its offset: an entry torn while it was written or shifted over starts there.
            if fits && doomed.is_none_or(|d| d.offset != e.offset) {
                // Down, offset last, as `remove` shifts, over an entry already kept or dropped.
                if kept < i && !self.live[kept].store(entry, false, go_on) {
                    return 0;
                }
                kept += 1;
                end = e.end();
                live_bytes += e.len;
            }
        }
        let dropped = count.saturating_sub(kept);
        // Nothing stale past the kept ones for a later rebuild to take back.
        for slot in &mut self.live[kept..scanned] {
            if !slot.store(Live::default(), false, go_on) {
                return 0;
            }
        }
        if !go_on() {
            return 0;
        }
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
        if !go_on() {
            return 0;
        }
        self.intent.end();
        self.rebuilds = self.rebuilds.wrapping_add(1);
        dropped
    }
}

/// A table entry, stored field by field ([`insert`], [`remove`], [`ExtentTable::rebuild`]).
trait Entry: Copy + Default {
    /// Stores `to` in `self` field by field, the offset first or last, asking `go_on` before
    /// each; returns whether all were stored. Volatile stores: the compiler may neither merge
    /// them nor move them across the table's other stores, so a holder killed between two
    /// instructions leaves exactly the stores before that point.
    fn store(&mut self, to: Self, offset_first: bool, go_on: &mut impl FnMut() -> bool) -> bool;
}

impl Entry for Extent {
    fn store(&mut self, to: Self, offset_first: bool, go_on: &mut impl FnMut() -> bool) -> bool {
        (!offset_first || put(&mut self.offset, to.offset, go_on))
            && put(&mut self.len, to.len, go_on)
            && (offset_first || put(&mut self.offset, to.offset, go_on))
    }
}

impl Entry for Live {
    fn store(&mut self, to: Self, offset_first: bool, go_on: &mut impl FnMut() -> bool) -> bool {
        let block = &mut self.block;
        (!offset_first || put(&mut block.offset, to.block.offset, go_on))
            && put(&mut block.len, to.block.len, go_on)
            && put(&mut self.pid, to.pid, go_on)
            && put(&mut self.serial, to.serial, go_on)
            && (offset_first || put(&mut block.offset, to.block.offset, go_on))
    }
}

/// One volatile store of an entry's field, if `go_on` says so.
fn put<T: Copy>(field: &mut T, value: T, go_on: &mut impl FnMut() -> bool) -> bool {
    if !go_on() {
        return false;
    }
    // SAFETY: `field` is a valid reference, borrowed mutably for this call.
    unsafe { std::ptr::write_volatile(field, value) };
    true
}

/// For [`insert`] and [`remove`] outside the tests: every store goes on.
fn always() -> bool {
    true
}

/// Shifts `table[at..count]` one up and puts `e` at `at`, then counts it.
///
/// Entry by entry from the top, each entry's offset stored first ([`Entry::store`]), so that a
/// holder killed at any store leaves every entry whole, a copy of the one below it, or torn with
/// the offset of the one below and the rest its own; the one below is whole either way.
/// [`ExtentTable::rebuild`] drops the copy and the torn entry (each starts where a whole entry before
/// it does) and `e` (the intent's block). `go_on` is asked before each store: `false` stops
/// there, as a kill would (the tests' way to kill it at every store).
fn insert<T: Entry, const N: usize>(
    table: &mut [T; N],
    count: &mut u32,
    at: usize,
    e: T,
    go_on: &mut impl FnMut() -> bool,
) {
    let n = *count as usize;
    // Room for one more, at a place inside the table: what `ExtentTable::admit` made sure of.
    if n >= N || at > n {
        return;
    }
    for i in (at + 1..=n).rev() {
        let below = table[i - 1];
        if !table[i].store(below, true, go_on) {
            return;
        }
    }
    if table[at].store(e, true, go_on) && go_on() {
        *count += 1;
    }
}

/// Shifts `table[at + 1..count]` one down over `table[at]`, uncounts the last and clears it.
///
/// Entry by entry from the bottom, each entry's offset stored last, so that a holder killed at
/// any store leaves every entry whole, a copy of the one above it, or torn with its own offset
/// and the rest of the one above; its own entry is whole just below it (or, at `at`, was the
/// block being freed). [`ExtentTable::rebuild`] drops the copy and the torn entry (each starts where a
/// whole entry before it, or the intent's block, does); a cleared entry is empty. `go_on` as for
/// [`insert`].
fn remove<T: Entry, const N: usize>(
    table: &mut [T; N],
    count: &mut u32,
    at: usize,
    go_on: &mut impl FnMut() -> bool,
) {
    let n = *count as usize;
    if n > N || at >= n {
        return;
    }
    for i in at..n - 1 {
        let above = table[i + 1];
        if !table[i].store(above, false, go_on) {
            return;
        }
    }
    if !go_on() {
        return;
    }
    *count -= 1;
    // The vacated slot holds no extent a rebuild could take for live.
    table[n - 1].store(T::default(), false, go_on);
}

#[cfg(test)]
mod tests;
