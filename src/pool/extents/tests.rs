//! A holder dying at each point of a change: the rebuild makes the tables whole, keeps every
//! other live block, and frees the block of the change.
use super::*;

fn table() -> Box<ExtentTable> {
    let layout = std::alloc::Layout::new::<ExtentTable>();
    // SAFETY: integers only, for which zero is a value; the box owns the allocation.
    let mut table = unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<ExtentTable>();
        assert!(!ptr.is_null());
        Box::from_raw(ptr)
    };
    table.init(2 << 20, 10 << 20, 2 << 20);
    table
}

fn with_blocks() -> (Box<ExtentTable>, Vec<Extent>) {
    let mut c = table();
    let kept: Vec<Extent> = (0..6).map(|_| c.allocate(4096, 64, 1).unwrap()).collect();
    c.free(kept[2].offset, None, 1).unwrap();
    let kept = [kept[0], kept[1], kept[3], kept[4], kept[5]].to_vec();
    (c, kept)
}

fn assert_whole(c: &mut ExtentTable, kept: &[Extent], gone: Extent) {
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
    remove(&mut c.live, &mut c.live_count, 1, &mut always);
    assert!(!c.consistent());
    assert_whole(&mut c, &kept, block);
}

/// Live blocks of different lengths and owners, so that an entry torn between two differs
/// from both, with a hole at index 2 (where a freed block was).
fn with_varied_blocks() -> Box<ExtentTable> {
    let mut c = table();
    let blocks: Vec<Extent> = (1..=7)
        .map(|k| c.allocate(4096 * k, 64, 10 + k as u32).unwrap())
        .collect();
    c.free(blocks[2].offset, None, 1).unwrap();
    c
}

/// Runs `change` on [`with_varied_blocks`] killed after 0, 1, 2, … stores until it finishes,
/// checking after each kill that a rebuild keeps the live entries `change` names (with their
/// owners) and frees its block; returns how many stores the change makes. `change` gets the
/// state and the number of stores to let through, and returns its block, the entries that must
/// survive, and whether it finished.
fn killed_at_every_store(
    mut change: impl FnMut(&mut ExtentTable, usize) -> (Extent, Vec<Live>, bool),
) -> usize {
    for stores in 0.. {
        let mut c = with_varied_blocks();
        let (block, kept, finished) = change(&mut c, stores);
        rebuilt_whatever_the_kill(&c, &kept, block);
        if finished {
            return stores;
        }
    }
    unreachable!("a change makes finitely many stores")
}

/// A `go_on` for `insert` and `remove` that lets `stores` stores through, then kills.
fn kill_after(mut stores: usize) -> impl FnMut() -> bool {
    move || {
        let go = stores > 0;
        stores = stores.saturating_sub(1);
        go
    }
}

/// Rebuilds `c` killed mid-change, first killed itself at every store of its own in turn
/// (then rebuilt again), and checks each outcome: the live blocks of `kept`, with their
/// owners, and `gone` gone.
fn rebuilt_whatever_the_kill(c: &ExtentTable, kept: &[Live], gone: Extent) {
    let blocks: Vec<Extent> = kept.iter().map(|e| e.block).collect();
    for rebuild_stores in 0.. {
        let mut again = boxed_copy(c);
        let mut go_on = kill_after(rebuild_stores);
        again.rebuild_until(&mut go_on);
        let finished = go_on();
        assert_whole(&mut again, &blocks, gone);
        assert_eq!(
            again.live(),
            kept,
            "rebuild killed after {rebuild_stores} stores"
        );
        if finished {
            break;
        }
    }
}

fn boxed_copy(c: &ExtentTable) -> Box<ExtentTable> {
    let mut copy = table();
    // SAFETY: both are whole `ExtentTable`s of integers; the copy is a distinct allocation.
    unsafe { std::ptr::copy_nonoverlapping(c, &mut *copy, 1) };
    copy
}

#[test]
fn killed_at_every_store_of_the_live_insert() {
    let stores = killed_at_every_store(|c, stores| {
        let kept = c.live().to_vec();
        // Into the hole at index 2: the four blocks above it shift.
        let block = Extent {
            offset: kept[1].block.end(),
            len: 4096,
        };
        c.intent.begin(ALLOCATE, 2, block);
        let counted = c.live_count + 1;
        let new = Live {
            block,
            pid: 2,
            serial: 7,
        };
        let mut go_on = kill_after(stores);
        insert(&mut c.live, &mut c.live_count, 2, new, &mut go_on);
        (block, kept, c.live_count == counted)
    });
    // Four stores for each of the four shifted and the new one, then the count.
    assert_eq!(stores, 21, "killed at every store");
}

#[test]
fn killed_at_every_store_of_the_live_remove() {
    let stores = killed_at_every_store(|c, stores| {
        let mut kept = c.live().to_vec();
        // Index 1: the four blocks above it shift down.
        let block = kept.remove(1).block;
        c.intent.begin(FREE, 2, block);
        let counted = c.live_count - 1;
        remove(&mut c.live, &mut c.live_count, 1, &mut kill_after(stores));
        let cleared = c.live[counted as usize] == Live::default();
        (block, kept, c.live_count == counted && cleared)
    });
    // Three stores for each of the four shifted, the count, three to clear the last.
    assert_eq!(stores, 21, "killed at every store");
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
    let mut c = table();
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

impl ExtentTable {
    /// Stores `value` (truncated to the field's width) into one field of the state, as a stray
    /// writer in another process could: `field` 0 start, 1 end, 2 chunk, 3 the intent's op, pid,
    /// offset or length (`index % 4`), 4 the live count, 5 the free count, 6 the live bytes,
    /// allocations, frees or rebuilds (`index % 4`), 7 a free range's offset or length, 8 a
    /// live entry's offset, length, pid or serial (the entry `index / 4`, the field `index % 4`).
    pub(crate) fn scribble(&mut self, field: usize, index: usize, value: u64) {
        let v32 = value as u32;
        match field {
            0 => self.start = value,
            1 => self.end = value,
            2 => self.chunk = value,
            3 => match index % 4 {
                0 => self.intent.op.store(v32, Ordering::Relaxed),
                1 => self.intent.pid.store(v32, Ordering::Relaxed),
                2 => self.intent.offset.store(value, Ordering::Relaxed),
                _ => self.intent.len.store(value, Ordering::Relaxed),
            },
            4 => self.live_count = v32,
            5 => self.free_count = v32,
            6 => match index % 4 {
                0 => self.live_bytes = value,
                1 => self.allocations = value,
                2 => self.frees = value,
                _ => self.rebuilds = value,
            },
            7 => {
                let e = &mut self.free[(index / 2) % (EXTENTS + 1)];
                *(if index.is_multiple_of(2) {
                    &mut e.offset
                } else {
                    &mut e.len
                }) = value;
            }
            _ => {
                let e = &mut self.live[(index / 4) % EXTENTS];
                match index % 4 {
                    0 => e.block.offset = value,
                    1 => e.block.len = value,
                    2 => e.pid = v32,
                    _ => e.serial = v32,
                }
            }
        }
    }
}
