//! The handle of a reservation of bytes made in the background, and what it reports.

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::blocks::reserve::Tally;
use crate::process::job::{Background, Tail};
use crate::Error;

/// A reservation of bytes under way on a thread of its own (see
/// [`NumaGpuAlloc::reserve_in_background`](crate::NumaGpuAlloc::reserve_in_background)).
///
/// Its chunks join the arena one by one as they are made: requests are served from them while
/// later ones are still being made. Dropping the handle lets the reservation go on to its end;
/// [`cancel`](Self::cancel) stops it after the chunk in progress.
pub struct Reservation {
    job: Background<Tally>,
}

impl Reservation {
    pub(crate) fn new(job: Background<Tally>) -> Reservation {
        Reservation { job }
    }

    /// What it has done so far.
    pub fn progress(&self) -> ReserveProgress {
        progress(self.job.state())
    }

    /// Whether it ended (all made, failed or cancelled), or can go on no more (in a child forked
    /// since it was made: the progress is what it was at the fork).
    pub fn is_finished(&self) -> bool {
        self.job.is_finished()
    }

    /// Stops it after the chunk in progress; what was made stays.
    pub fn cancel(&self) {
        self.job.cancel();
    }

    /// Waits for its end; what it did.
    ///
    /// # Errors
    /// Why it stopped early: the error of the chunk that failed (a CUDA error names its code;
    /// [`Error::PinLimit`] at the pinned limit). The chunks made before it stay usable.
    /// [`Error::ReservationLost`] when its thread panicked, or at once in a child forked since
    /// it was made.
    pub fn wait(mut self) -> Result<ReserveProgress, Error> {
        self.job.wait()?;
        Ok(self.progress())
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Reservation")
            .field(&self.progress())
            .finish()
    }
}

/// A snapshot of a reservation of bytes. Each count is read on its own, at about the same time.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ReserveProgress {
    /// Bytes asked for.
    pub requested: usize,
    /// Bytes mapped and placed on the node (each count includes a chunk that then failed).
    pub placed: usize,
    /// Bytes populated (faulted in).
    pub populated: usize,
    /// Bytes registered with the driver (page-locked).
    pub registered: usize,
    /// Chunks added to the arena, where requests are served from them.
    pub chunks: usize,
    /// Bytes of those chunks.
    pub usable: usize,
    /// The longest single registration (`cuMemHostRegister`) so far.
    pub longest_driver_call: Duration,
    /// From the start to the first chunk usable, once there is one.
    pub first_chunk: Option<Duration>,
    /// Since the start.
    pub elapsed: Duration,
    /// Whether it ended.
    pub finished: bool,
    /// Why it stopped early, if it did.
    pub error: Option<Error>,
}

pub(crate) fn progress(tally: &Tally) -> ReserveProgress {
    let job = &tally.job;
    ReserveProgress {
        requested: job.requested(),
        placed: tally.placed.load(Ordering::Relaxed),
        populated: tally.populated.load(Ordering::Relaxed),
        registered: tally.registered.load(Ordering::Relaxed),
        chunks: job.chunks(),
        usable: job.bytes(),
        longest_driver_call: job.longest_driver_call(),
        first_chunk: job.first_chunk(),
        elapsed: job.elapsed(),
        finished: job.finished(),
        error: job.error(),
    }
}

impl fmt::Display for ReserveProgress {
    /// One line, usable of requested first: `reserve 12.0/64.0 GiB: placed 13.0, populated 12.5,
    /// registered 12.0 GiB in 12 chunks, first in 150 ms, longest driver call 21 ms, 3.20 s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, first, longest) = (self, self.first_chunk, self.longest_driver_call);
        const GIB: f64 = (1u64 << 30) as f64;
        let gib = |bytes: usize| bytes as f64 / GIB;
        write!(
            f,
            "reserve {:.1}/{:.1} GiB: placed {:.1}, populated {:.1}, registered {:.1} GiB in {} \
             chunks",
            gib(self.usable),
            gib(self.requested),
            gib(self.placed),
            gib(self.populated),
            gib(self.registered),
            self.chunks
        )?;
        write!(
            f,
            "{}",
            Tail::of(first, longest, s.elapsed, s.finished, &s.error)
        )
    }
}
