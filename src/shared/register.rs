//! Registering this process's mapping of a shared pool in the background, chunk by chunk
//! (`pool/chunks.rs` registers each), with a handle of its own ([`PoolRegistration`]:
//! progress, wait, cancel).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::build;
use super::inner::Inner;
#[cfg(doc)]
use super::SharedPool;
use crate::chunk::{Numa, PinFlags, Placer};
use crate::cuda::{Device, Gpu, RegisterFlags, FORKED_REASON};
use crate::pool::chunks::{self, PoolSeams};
use crate::pool::DATA_START;
use crate::process::job::{Background, Job, Tail};
use crate::{Error, GpuSelector};

/// A registration of a [`SharedPool`]'s chunks under way in the background
/// ([`SharedPool::register_in_background`]).
///
/// Dropping the handle lets the registration go on to its end (or until the pool is dropped);
/// [`cancel`](Self::cancel) stops it after the chunk in progress, or its wait for the pool's
/// registration lock.
pub struct PoolRegistration {
    job: Background<Job>,
}

impl PoolRegistration {
    /// Starts registering `inner`'s mapping with `gpu`'s context on a thread of its own, within
    /// `pin_limit` ([`SharedPool::register_in_background`]); the handle, and the job the pool
    /// cancels at detach.
    pub(super) fn start(
        inner: &Arc<Inner>,
        gpu: GpuSelector,
        pin_limit: usize,
    ) -> Result<(PoolRegistration, Arc<Job>), Error> {
        if inner.inherited() {
            return Err(Error::CudaUnavailable {
                reason: FORKED_REASON,
            });
        }
        let gpu = Gpu::shared(Device::find(gpu)?)?;
        let flags = PinFlags {
            register: RegisterFlags::default(),
            limit: pin_limit,
        };
        let (config, large) = build::process_settings();
        let hugetlb = inner.pool.header().huge != 0;
        let rules = chunks::rules(hugetlb, 1, flags, config.register_max);
        let job = Arc::new(Job::new(inner.pool.len() - DATA_START));
        let inner = Arc::clone(inner);
        let background = Background::spawn(
            "numa-pool-pin",
            "registration thread",
            Arc::clone(&job),
            move |job| {
                let numa = Numa::new(None);
                let placer = Placer {
                    rules: &rules,
                    numa: &numa,
                    counters: &inner.counters,
                    seams: &PoolSeams(large),
                };
                chunks::register_all(&inner.pool, placer, gpu, inner.lock_wait, job)
            },
        )?;
        Ok((PoolRegistration { job: background }, job))
    }

    /// What it has done so far.
    pub fn progress(&self) -> RegisterProgress {
        let job = self.job.state();
        RegisterProgress {
            requested: job.requested(),
            registered: job.bytes(),
            chunks: job.chunks(),
            longest_driver_call: job.longest_driver_call(),
            first_chunk: job.first_chunk(),
            elapsed: job.elapsed(),
            finished: job.finished(),
            error: job.error(),
        }
    }

    /// Whether it ended (all registered, failed or cancelled), or can go on no more (in a child
    /// forked since it was made: the progress is what it was at the fork).
    pub fn is_finished(&self) -> bool {
        self.job.is_finished()
    }

    /// Stops it after the chunk in progress (or its wait for the pool's registration lock);
    /// the chunks registered stay so until the pool is dropped.
    pub fn cancel(&self) {
        self.job.cancel();
    }

    /// Waits for its end; what it did.
    ///
    /// # Errors
    /// Why it stopped early: the error of the chunk that failed (a CUDA error names its code;
    /// [`Error::PinLimit`] at the pinned limit; [`Error::PoolLockHeld`] after the lock wait).
    /// The chunks registered before it stay so. [`Error::ReservationLost`] when its thread
    /// panicked, or at once in a child forked since it was made.
    pub fn wait(mut self) -> Result<RegisterProgress, Error> {
        self.job.wait()?;
        Ok(self.progress())
    }
}

impl fmt::Debug for PoolRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PoolRegistration")
            .field(&self.progress())
            .finish()
    }
}

/// A snapshot of a pool's registration in this process. Each count is read on its own, at
/// about the same time.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RegisterProgress {
    /// Bytes of the pool's blocks (its chunks, all together).
    pub requested: usize,
    /// Bytes of the chunks registered, by this run or before it.
    pub registered: usize,
    /// Chunks registered, by this run or before it.
    pub chunks: usize,
    /// The longest single registration (`cuMemHostRegister`) of this run so far.
    pub longest_driver_call: Duration,
    /// From the start to the first chunk registered, once there is one.
    pub first_chunk: Option<Duration>,
    /// Since the start.
    pub elapsed: Duration,
    /// Whether it ended.
    pub finished: bool,
    /// Why it stopped early, if it did.
    pub error: Option<Error>,
}

impl fmt::Display for RegisterProgress {
    /// One line: `pool registration 1.0/4.0 GiB in 4 chunks, first in 20 ms, longest driver
    /// call 21 ms, 0.10 s; done`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, first, longest) = (self, self.first_chunk, self.longest_driver_call);
        const GIB: f64 = (1u64 << 30) as f64;
        write!(
            f,
            "pool registration {:.1}/{:.1} GiB in {} chunks",
            self.registered as f64 / GIB,
            self.requested as f64 / GIB,
            self.chunks
        )?;
        write!(
            f,
            "{}",
            Tail::of(first, longest, s.elapsed, s.finished, &s.error)
        )
    }
}
