//! Reservations: blocks of a size into the cache, or bytes of chunks, now or in the background.

use std::alloc::GlobalAlloc;
use std::sync::Arc;

use super::NumaGpuAlloc;
use crate::blocks::reserve::Tally;
use crate::guard::Inside;
use crate::process::job::Background;
use crate::reservation::{self, Reservation, ReserveProgress};
use crate::runtime::route;
use crate::runtime::Runtime;
use crate::Error;

impl<A: GlobalAlloc> NumaGpuAlloc<A> {
    /// Makes room for `blocks` blocks of `block_size` bytes, populated and (when pinning)
    /// page-locked, for the node where the calling thread's blocks go (its
    /// [route](crate::bind_thread), or this value's target) now, initialising the large path if
    /// needed: the next requests of about that size are served from it instead of paying for
    /// placement and pinning. The room is reserved chunks of whole blocks, each at most the
    /// registration bound ([`register_max`](Self::register_max)) and registered once, carved
    /// for requests of any size up to a chunk's (as [`reserve_bytes`](Self::reserve_bytes));
    /// a block larger than the bound is a cached block of its own, registered whole. Bounded by
    /// the node's memory and the pinned limit, not the cache limit; [`trim`](Self::trim)
    /// releases it.
    ///
    /// Takes as long as allocating the blocks; call it at start-up, or on a thread of its own.
    /// `NUMA_GPU_ALLOC=reserve=COUNTxSIZE` (or [`reserve_at_init`](Self::reserve_at_init)) does
    /// the same at initialisation.
    ///
    /// # Errors
    /// [`Error::ReserveRejected`] when a block would be below the threshold;
    /// [`Error::ReserveTooLarge`] beyond the node's memory; [`Error::PinLimit`] beyond the
    /// pinned limit; [`Error::StrictPinning`] when `pin=strict` and nothing can be page-locked
    /// for the target; the placement or pinning error of a chunk that could not be made (what
    /// was made before it stays).
    pub fn reserve(&self, blocks: usize, block_size: usize) -> Result<(), Error> {
        let _inside = Inside::enter();
        self.runtime().reserve(blocks, block_size)
    }

    /// Reserves `bytes` (rounded up to 2 MiB) for the node where the calling thread's blocks go
    /// (its [route](crate::bind_thread), or this value's target; pinned when this value pins),
    /// and waits for it: chunks of at most the registration bound
    /// ([`register_max`](Self::register_max), 256 MiB by default), each mapped, placed, populated by the node's
    /// populate workers and registered with a single driver call, added to the arena as it is
    /// made. Requests of any size up to a chunk's are carved from them first; they are kept
    /// when idle (decay leaves them) until [`trim`](Self::trim) or memory pressure. Reserved
    /// bytes do not count against the cache limit; pinned ones count against the pinned limit.
    ///
    /// # Errors
    /// [`Error::StrictPinning`] when `pin=strict` and nothing can be page-locked for the target;
    /// [`Error::ReserveTooLarge`] beyond the node's memory; [`Error::PinLimit`] beyond the
    /// pinned limit, before anything is made; else the error of the chunk that
    /// failed (a CUDA error with its code, [`Error::PinLimit`] at the pinned limit,
    /// [`Error::MemoryLimit`]...): the reservation stops there, and the chunks made before it
    /// stay usable.
    pub fn reserve_bytes(&self, bytes: usize) -> Result<ReserveProgress, Error> {
        let _inside = Inside::enter();
        let tally = Tally::new(bytes);
        let rt = self.runtime();
        let outcome = reserve_for_caller(rt, bytes, &tally);
        tally.job.finish(outcome);
        let done = reservation::progress(&tally);
        match &done.error {
            Some(e) => Err(e.clone()),
            None => Ok(done),
        }
    }

    /// [`reserve_bytes`](Self::reserve_bytes) on a thread of its own: returns at once with a
    /// handle to watch it ([`Reservation::progress`]), wait for it or cancel it. The target is
    /// the calling thread's, resolved now. Each chunk is usable as soon as it is registered;
    /// requests that find no room in the chunks made so far are served as without a
    /// reservation (as the pin mode says), not held back. When the process exits meanwhile, the
    /// chunk in progress ends and no other is made (before the driver tears down).
    ///
    /// For another GPU or node than the calling thread's, reserve under a route:
    ///
    /// ```
    /// use numa_gpu_alloc::{with_route, NumaGpuAlloc, PinMode, Route};
    ///
    /// static KV_POOL: NumaGpuAlloc = NumaGpuAlloc::new().pin(PinMode::On);
    ///
    /// // Node 0's memory (a GPU: `Route::Gpu(GpuSelector::Ordinal(1))`), 64 MiB in chunks.
    /// let reservation = with_route(Route::Node(0), || KV_POOL.reserve_in_background(64 << 20))?;
    /// println!("{}", reservation.progress()); // reserve 0.0/0.1 GiB: placed ...
    /// let done = reservation.wait()?;
    /// assert_eq!(done.usable, 64 << 20);
    /// # KV_POOL.trim();
    /// # Ok::<(), numa_gpu_alloc::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::StrictPinning`] as for `reserve_bytes`; a failure to start the thread
    /// ([`Error::Syscall`], `call: "reservation thread"`). Later errors come from the handle.
    pub fn reserve_in_background(&'static self, bytes: usize) -> Result<Reservation, Error>
    where
        A: Sync,
    {
        let inside = Inside::enter();
        let rt = self.runtime();
        let target = route::target(rt);
        let kind = rt.blocks.kind(&target)?;
        drop(inside);
        let tally = Arc::new(Tally::new(bytes));
        let job = Background::spawn("numa-reserve", "reservation thread", tally, move |tally| {
            let _inside = Inside::enter();
            // Alive while `self` is: `'static`.
            let rt = self.runtime();
            rt.blocks
                .reserver()
                .reserve_bytes(bytes, &target, kind, tally)
        })?;
        Ok(Reservation::new(job))
    }
}

/// Reserves for the calling thread's target.
fn reserve_for_caller(rt: &Runtime, bytes: usize, tally: &Tally) -> Result<(), Error> {
    let target = route::target(rt);
    let kind = rt.blocks.kind(&target)?;
    rt.blocks
        .reserver()
        .reserve_bytes(bytes, &target, kind, tally)
}
