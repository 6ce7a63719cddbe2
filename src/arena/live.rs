//! The live set: every block handed out, by address, with who holds its memory and the GPU
//! work recorded against it; and the node's and each GPU's live bytes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::block::{Backing, Block, Slot};
use super::pending::{settle, InFlight, Work};
use crate::stats::{GpuStats, NodeStats};

/// A block handed out, who holds its memory, and the GPU work recorded against it.
pub(crate) struct Live {
    pub(crate) block: Block,
    pub(super) backing: Backing,
    pub(super) work: Work,
}

impl Live {
    /// The same block with its recorded work dropped (tests switch stream-ordered reuse off).
    pub(crate) fn without_work(self) -> Live {
        Live {
            work: Work::new(),
            ..self
        }
    }
}

/// Hashes page-aligned addresses for the live map: the page number, scrambled by a multiply
/// (hashbrown reads the top bits).
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, addr: usize) {
        self.0 = ((addr as u64) >> 12).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The live blocks of one node's arena, and their counts.
pub(super) struct LiveSet {
    /// The node the GPU rows are for.
    node: usize,
    /// Every live block, by address.
    blocks: HashMap<usize, Live, BuildHasherDefault<AddrHasher>>,
    /// Live blocks with GPU work recorded: the pending list keeps room for each.
    with_work: usize,
    /// Live dedicated blocks: the dedicated cache keeps room for each.
    dedicated: usize,
    /// Bytes of the live blocks.
    bytes: usize,
    peak_bytes: usize,
    /// Live blocks per GPU they were handed out for, in ordinal order.
    gpus: Vec<GpuStats>,
}

impl LiveSet {
    /// No live block, on `node`.
    pub(super) fn new(node: usize) -> Self {
        LiveSet {
            node,
            blocks: HashMap::default(),
            with_work: 0,
            dedicated: 0,
            bytes: 0,
            peak_bytes: 0,
            gpus: Vec::new(),
        }
    }

    /// The live block at `addr` (its start).
    pub(super) fn get(&self, addr: usize) -> Option<&Live> {
        self.blocks.get(&addr)
    }

    /// Whether a live block starts at `addr`.
    pub(super) fn contains(&self, addr: usize) -> bool {
        self.blocks.contains_key(&addr)
    }

    /// Room for `more` blocks beyond those live now; false when it could not be had.
    pub(super) fn try_reserve(&mut self, more: usize) -> bool {
        self.blocks.try_reserve(more).is_ok()
    }

    /// Bytes of the live blocks.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Live blocks with GPU work recorded.
    pub(super) fn with_work(&self) -> usize {
        self.with_work
    }

    /// Live dedicated blocks.
    pub(super) fn dedicated(&self) -> usize {
        self.dedicated
    }

    /// Records a live block; the map has room (reserved by the caller).
    pub(super) fn insert(&mut self, block: Block, backing: Backing) {
        self.account(&block, true);
        self.dedicated += usize::from(matches!(backing, Backing::Dedicated(_)));
        let work = Work::new();
        let live = Live {
            block,
            backing,
            work,
        };
        self.blocks.insert(block.addr, live);
        self.peak_bytes = self.peak_bytes.max(self.bytes);
    }

    /// Removes a live block and its recorded work; `None` if no live block starts at `addr`.
    pub(super) fn remove(&mut self, addr: usize) -> Option<Live> {
        let live = self.blocks.remove(&addr)?;
        self.dedicated = self
            .dedicated
            .saturating_sub(usize::from(matches!(live.backing, Backing::Dedicated(_))));
        if !live.work.is_empty() {
            self.with_work = self.with_work.saturating_sub(1);
        }
        self.account(&live.block, false);
        Some(live)
    }

    /// The live dedicated block containing `addr` (anywhere inside): its start.
    pub(super) fn dedicated_containing(&self, addr: usize) -> Option<usize> {
        self.blocks
            .values()
            .find(|l| {
                matches!(l.backing, Backing::Dedicated(_))
                    && (l.block.addr..l.block.addr + l.block.capacity).contains(&addr)
            })
            .map(|l| l.block.addr)
    }

    /// Attaches `work` to the live block at `start`, where `reserved` says whether the pending
    /// list has room for one more block with work; gives it back when there is no block there
    /// or no room for it.
    pub(super) fn record(
        &mut self,
        start: usize,
        work: Box<dyn InFlight>,
        reserved: bool,
    ) -> Result<(), Box<dyn InFlight>> {
        let Some(live) = self.blocks.get_mut(&start) else {
            return Err(work);
        };
        // Counted already: the pending list has room for this block.
        let counted = !live.work.is_empty();
        // A long-lived block recorded on every copy: keep only the work still running.
        settle(&mut live.work);
        let room = (counted || reserved) && live.work.try_reserve(1).is_ok();
        let result = if room {
            live.work.push(work);
            Ok(())
        } else {
            Err(work)
        };
        match (counted, !live.work.is_empty()) {
            (false, true) => self.with_work += 1,
            (true, false) => self.with_work = self.with_work.saturating_sub(1),
            _ => {}
        }
        result
    }

    /// The live carved block at `addr` and its slot, when it may be resized to `new_size` bytes:
    /// a tail GPU work may still use must not be carved again (such a block moves instead).
    pub(super) fn resizable(&mut self, addr: usize, new_size: usize) -> Option<(Block, Slot)> {
        let live = self.blocks.get_mut(&addr)?;
        if new_size < live.block.capacity && !live.work.is_empty() {
            if !settle(&mut live.work) {
                return None;
            }
            self.with_work = self.with_work.saturating_sub(1);
        }
        let live = self.blocks.get(&addr)?;
        let (Backing::Carved(slot), old) = (&live.backing, live.block) else {
            return None;
        };
        Some((old, *slot))
    }

    /// Records the live block `old` resized (where it lies) to `new_size` bytes.
    pub(super) fn resized(&mut self, old: Block, new_size: usize) {
        self.account(&old, false);
        let new = Block {
            capacity: new_size,
            ..old
        };
        self.account(&new, true);
        if let Some(live) = self.blocks.get_mut(&old.addr) {
            live.block = new;
        }
        self.peak_bytes = self.peak_bytes.max(self.bytes);
    }

    /// Adds (or removes) a live block's bytes to the node's and its GPU's rows. Saturating: a free
    /// path must not panic, even on accounting that drifted.
    fn account(&mut self, block: &Block, live: bool) {
        self.bytes = if live {
            self.bytes.saturating_add(block.capacity)
        } else {
            self.bytes.saturating_sub(block.capacity)
        };
        // A free finds the row its allocation made (it adds none: the free path allocates nothing).
        let row = if live {
            self.gpu_row(block.routed_for)
        } else {
            let ordinal = block.routed_for;
            self.gpus
                .iter_mut()
                .find(|row| Some(row.ordinal) == ordinal)
        };
        if let Some(row) = row {
            let pinned = if block.kind.pinned { block.capacity } else { 0 };
            if live {
                row.live_bytes += block.capacity;
                row.live_blocks += 1;
                row.pinned_bytes += pinned;
                row.peak_live_bytes = row.peak_live_bytes.max(row.live_bytes);
            } else {
                row.live_bytes = row.live_bytes.saturating_sub(block.capacity);
                row.live_blocks = row.live_blocks.saturating_sub(1);
                row.pinned_bytes = row.pinned_bytes.saturating_sub(pinned);
            }
        }
    }

    /// The row of GPU `ordinal`, added if it is new.
    fn gpu_row(&mut self, ordinal: Option<u32>) -> Option<&mut GpuStats> {
        let ordinal = ordinal?;
        let at = match self.gpus.binary_search_by_key(&ordinal, |row| row.ordinal) {
            Ok(at) => at,
            Err(at) => {
                if self.gpus.try_reserve(1).is_err() {
                    return None;
                }
                let row = GpuStats {
                    ordinal,
                    node: self.node,
                    ..GpuStats::default()
                };
                self.gpus.insert(at, row);
                at
            }
        };
        self.gpus.get_mut(at)
    }

    /// Starts the peaks over from the bytes live now.
    pub(super) fn reset_peak(&mut self) {
        self.peak_bytes = self.bytes;
        for row in &mut self.gpus {
            row.peak_live_bytes = row.live_bytes;
        }
    }

    /// The rows of the GPUs blocks were handed out for.
    pub(super) fn gpus(&self) -> &[GpuStats] {
        &self.gpus
    }

    /// Fills in the node row's live counts.
    pub(super) fn fill(&self, row: &mut NodeStats) {
        row.live_bytes = self.bytes;
        row.peak_live_bytes = self.peak_bytes;
        row.live_blocks = self.blocks.len();
    }
}
