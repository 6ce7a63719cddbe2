//! [`RecordedEvent`], the record the arena keeps for a freed block until the GPU work that uses
//! it has completed, and [`NumaGpuAlloc::record_stream`], which attaches one to a block.

use cudarc::driver::{CudaEvent, CudaStream};

use crate::arena::InFlight;
use crate::cuda::event;
use crate::{fork, NumaGpuAlloc, Result};

/// An event recorded on a stream after the copies that use a block: the block is reused only
/// once it completed.
pub(super) struct RecordedEvent {
    /// `None` once completed (the event went back to the pool).
    event: Option<CudaEvent>,
    /// The fork generation that recorded it: in a child forked since, the GPU works on the
    /// parent's pages, never on the child's copy, and no CUDA call may be made.
    generation: u32,
}

impl RecordedEvent {
    /// Wraps an event that is already recorded.
    pub(super) fn new(event: CudaEvent) -> RecordedEvent {
        RecordedEvent {
            event: Some(event),
            generation: fork::generation(),
        }
    }

    fn forked(&self) -> bool {
        self.generation != fork::generation()
    }
}

impl InFlight for RecordedEvent {
    fn is_complete(&mut self) -> bool {
        let Some(recorded) = &self.event else {
            return true;
        };
        if self.forked() {
            // Destroying it would call the driver in the child: keep its few bytes instead.
            std::mem::forget(self.event.take());
            return true;
        }
        match event::is_complete(recorded) {
            Ok(true) => {
                if let Some(done) = self.event.take() {
                    event::give_back(done);
                }
                true
            }
            // An error (a context that died, say) does not tell that the DMA is over: the block
            // stays pending, never reused and never unmapped.
            Ok(false) | Err(_) => false,
        }
    }

    fn wait(&mut self) -> bool {
        // In a forked child the GPU works on the parent's pages, never on the child's copy.
        match &self.event {
            Some(recorded) if !self.forked() => event::wait(recorded).is_ok(),
            _ => true,
        }
    }
}

impl Drop for RecordedEvent {
    fn drop(&mut self) {
        if self.forked() {
            std::mem::forget(self.event.take());
        } else if let Some(recorded) = self.event.take() {
            event::destroy(recorded);
        }
    }
}

impl<A> NumaGpuAlloc<A> {
    /// Marks the large block that holds `ptr` as used by the work queued on `stream` so far (a
    /// copy from or to a plain `Vec` or slice of this allocator, with pinning on): once freed,
    /// the block is reused only after that work has completed. `Ok(false)` when `ptr` is not in
    /// a large block of this allocator (small allocations are pageable: copies with them are
    /// synchronous).
    ///
    /// This protects reuse only: reading a device-to-host destination still needs the stream
    /// synchronised first. [`PinnedBuf`](crate::PinnedBuf) does both by itself.
    #[cfg_attr(docsrs, doc(cfg(feature = "pinned-buffer")))]
    pub fn record_stream<T>(&self, ptr: *const T, stream: &CudaStream) -> Result<bool> {
        let recorded = RecordedEvent::new(event::record(stream)?);
        // Not ours: dropping the record destroys its event, which CUDA allows while it runs.
        Ok(self
            .record_in_flight(ptr.cast(), Box::new(recorded))
            .is_ok())
    }
}
