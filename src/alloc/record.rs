//! [`RecordedEvent`], the record the arena keeps for a freed block until the GPU work that uses
//! it has completed; [`PinnedBuf`](crate::PinnedBuf) and
//! [`NumaGpuAlloc::record_stream`](crate::NumaGpuAlloc::record_stream) attach one to a block.

use cudarc::driver::CudaEvent;

use crate::arena::InFlight;
use crate::cuda::event;
use crate::fork;

/// An event recorded on a stream after the copies that use a block: the block is reused only
/// once it completed.
pub(crate) struct RecordedEvent {
    /// `None` once completed (the event went back to the pool).
    event: Option<CudaEvent>,
    /// The fork generation that recorded it: in a child forked since, the GPU works on the
    /// parent's pages, never on the child's copy, and no CUDA call may be made.
    generation: u32,
}

impl RecordedEvent {
    /// Wraps an event that is already recorded.
    pub(crate) fn new(event: CudaEvent) -> RecordedEvent {
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
