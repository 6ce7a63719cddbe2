//! The reservations an allocator value makes for its target: `reserve=` at initialisation (now
//! or on a thread of its own), and [`Runtime::reserve`] for the calling thread's route. The
//! chunks and blocks themselves are made by [`Reserver`](crate::blocks::Reserver) (`blocks/reserve.rs`).

use std::io::Write as _;

use super::route;
use super::Runtime;
use crate::blocks::reserve::Tally;
use crate::blocks::Resolved;
use crate::config::Reserve;
use crate::guard::Inside;
use crate::sys;
use crate::Error;

impl Runtime {
    /// Makes the configured reservation (`reserve=`) now; called once, right after
    /// initialisation. A failure is printed as one line on stderr (the cause is also counted in
    /// the stats); one refused for its figures (see [`check`](crate::blocks::reserve::check)) or by `pin=strict` is already a
    /// setup error.
    pub(crate) fn reserve_configured(&self) {
        let tally = Tally::new(self.configured_bytes());
        match self.reserve_as_configured(&route::target(self), &tally) {
            Ok(()) | Err(Error::ReserveRejected { .. } | Error::StrictPinning { .. }) => {}
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "numa-gpu-alloc: reserve: {e}");
            }
        }
    }

    /// [`Self::reserve_configured`] on a thread of its own (`reserve_background=on`), which
    /// prints one line when it ends: what was made, or why it stopped.
    pub(crate) fn reserve_configured_in_background(&'static self) {
        // The initialising thread's target (its route), not the new thread's.
        let target = route::target(self);
        let started = sys::with_signals_blocked(|| {
            std::thread::Builder::new()
                .name("numa-reserve".into())
                .spawn(move || {
                    let _inside = Inside::enter();
                    let tally = Tally::new(self.configured_bytes());
                    let outcome = self.reserve_as_configured(&target, &tally);
                    let mib = |bytes: usize| bytes >> 20;
                    let (usable, chunks) = (tally.job.bytes(), tally.job.chunks());
                    let _ = match outcome {
                        Ok(()) => writeln!(
                            std::io::stderr(),
                            "numa-gpu-alloc: reserve in the background: {} MiB usable in {chunks} \
                         chunks after {:.2} s",
                            mib(usable),
                            tally.job.elapsed().as_secs_f64()
                        ),
                        Err(e) => writeln!(
                            std::io::stderr(),
                            "numa-gpu-alloc: reserve in the background stopped with {} of {} MiB \
                         usable in {chunks} chunks: {e}",
                            mib(usable),
                            mib(tally.job.requested())
                        ),
                    };
                })
        });
        if let Err(e) = started {
            let _ = writeln!(
                std::io::stderr(),
                "numa-gpu-alloc: reserve: no thread for the background ({e}); reserving now"
            );
            self.reserve_configured();
        }
    }

    /// The bytes `reserve=` asks for.
    fn configured_bytes(&self) -> usize {
        let Reserve {
            blocks,
            block_size,
            bytes,
            ..
        } = self.config.reserve;
        bytes.max(blocks.saturating_mul(block_size))
    }

    fn reserve_as_configured(&self, target: &Resolved, tally: &Tally) -> Result<(), Error> {
        let reserve = self.config.reserve;
        if reserve.bytes > 0 {
            let kind = self.blocks.kind(target)?;
            self.blocks
                .reserver()
                .reserve_bytes(reserve.bytes, target, kind, tally)
        } else {
            self.blocks
                .reserver()
                .reserve_blocks(reserve.blocks, reserve.block_size, target, tally)
        }
    }

    /// Makes room for `blocks` blocks of `block_size` bytes (placed, populated, pinned as
    /// configured) for the node where the calling thread's blocks go (see
    /// [`Reserver::reserve_blocks`](crate::blocks::Reserver::reserve_blocks)).
    pub(crate) fn reserve(&self, blocks: usize, block_size: usize) -> Result<(), Error> {
        let tally = Tally::new(blocks.saturating_mul(block_size));
        // On the node where the calling thread's blocks go (its route, or the value's target).
        self.blocks
            .reserver()
            .reserve_blocks(blocks, block_size, &route::target(self), &tally)
    }
}
