//! Registering this process's mapping of a shared pool in the background, chunk by chunk, with
//! the reservations' handle (`Reservation`: progress, wait, cancel).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Inner, SharedPool};
use crate::blocks::reserve::Tally;
use crate::chunk::PinFlags;
use crate::cuda::{Device, Gpu, RegisterFlags, FORKED_REASON};
use crate::pool::pinning::{Pinned, Registration};
use crate::pool::DATA_START;
use crate::{Error, GpuSelector, Reservation};

impl SharedPool {
    /// Registers this process's mapping of the pool with `gpu`'s CUDA context on a thread of
    /// its own, chunk by chunk (each chunk one `cuMemHostRegister`, holding the pool's
    /// registration lock, which lives in the pool, so that two of its processes do not register
    /// at the same moment), within `pin_limit` bytes page-locked by this process through the
    /// crate. Blocks are usable meanwhile (unpinned until their chunk is registered); the
    /// handle reports progress, waits, cancels. Chunks registered already are skipped. A
    /// process without a driver, or that does not pin, just does not call this: the pool works
    /// unpinned.
    ///
    /// # What it costs each process
    /// Page-locking is charged per process, not per pool: the kernel counts the registered
    /// bytes against this process (its locked memory), and the driver keeps a page table for
    /// this process's registration (16 bytes per 4 KiB page, about 0.4 %). Every process that
    /// registers the pool pays that again, though the memory is there once: plan a host's
    /// headroom for the number of registering processes ([`PoolStats::registered_bytes`](super::PoolStats::registered_bytes) is
    /// this process's share, [`PoolStats::registrations`](super::PoolStats::registrations) every process's chunks).
    ///
    /// A wait for the registration lock stops when the registration is cancelled (or the pool
    /// dropped), and fails with [`Error::PoolLockHeld`], naming the holder, after the pool's
    /// lock wait ([`SharedPoolBuilder::lock_wait`](crate::SharedPoolBuilder::lock_wait),
    /// [`PoolAttach::lock_wait`](crate::PoolAttach::lock_wait)).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without a usable driver (or in a forked child, for a pool it
    /// inherited), [`Error::GpuNotFound`]; a failure to
    /// start the thread. Later errors (a chunk refused, [`Error::PinLimit`]) come from the
    /// handle; the chunks registered before stay so until detach.
    pub fn register_in_background(
        &self,
        gpu: GpuSelector,
        pin_limit: usize,
    ) -> Result<Reservation, Error> {
        if self.inner.inherited() {
            return Err(Error::CudaUnavailable {
                reason: FORKED_REASON,
            });
        }
        let gpu = Gpu::shared(Device::find(gpu)?)?;
        let flags = PinFlags {
            register: RegisterFlags::default(),
            limit: pin_limit,
        };
        let tally = Arc::new(Tally::new(self.inner.map.len() - DATA_START));
        let (inner, shared) = (Arc::clone(&self.inner), Arc::clone(&tally));
        let thread = std::thread::Builder::new()
            .name("numa-pool-pin".into())
            .spawn(move || {
                let ended = EndOnUnwind(&shared);
                shared.finish(register_chunks(&inner, gpu, flags, &shared));
                drop(ended);
            })
            .map_err(|e| Error::Syscall {
                call: "registration thread",
                errno: e.raw_os_error().unwrap_or(libc::EAGAIN),
            })?;
        *self.background.lock() = Some(Arc::clone(&tally));
        Ok(Reservation::new(tally, thread))
    }
}

/// Registers the pool's chunks one by one until all are, or cancelled, or one fails.
fn register_chunks(
    inner: &Inner,
    gpu: &'static Gpu,
    flags: PinFlags,
    tally: &Tally,
) -> Result<(), Error> {
    for index in 0.. {
        let Some((_, len)) = Pinned::chunk_range(&inner.map, index) else {
            break;
        };
        if tally.cancel.load(Ordering::Acquire) {
            break;
        }
        let wait = (&tally.cancel, inner.lock_wait);
        match inner.pinned.register(&inner.map, index, gpu, flags, wait)? {
            Registration::Made(took) => {
                let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
                tally.longest_call_ns.fetch_max(ns, Ordering::Relaxed);
            }
            Registration::Already => {}
            Registration::Cancelled => break,
        }
        for bytes in [
            &tally.placed,
            &tally.populated,
            &tally.registered,
            &tally.usable,
        ] {
            bytes.fetch_add(len, Ordering::Relaxed);
        }
        tally.chunks.fetch_add(1, Ordering::Release);
        let ns = u64::try_from(tally.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let _ = tally.first_chunk_ns.compare_exchange(
            0,
            ns.max(1),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }
    Ok(())
}

/// Ends a registration whose thread unwinds, so that its handle does not wait for ever.
struct EndOnUnwind<'a>(&'a Tally);

impl Drop for EndOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.finish(Err(Error::ReservationLost {
                reason: "its thread panicked",
            }));
        }
    }
}
