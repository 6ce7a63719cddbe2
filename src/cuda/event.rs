//! CUDA events for stream-ordered reuse: a process-wide pool of cudarc events, recording one on
//! a stream, and the non-blocking query and host wait through the crate's own `cuEventQuery` and
//! `cuEventSynchronize` pointers. What a freed block's event means to the arena is the front
//! end's business (`pinned/`), as is ordering a stream after an event (cudarc's
//! `CudaStream::wait`, here with the gate held).
//!
//! Events are cudarc's [`CudaEvent`]s because cudarc's safe copies record them
//! ([`cudarc::driver::SyncOnDrop::Record`]); queries and waits go through the C-typed table, so
//! an unknown `CUresult` is a number here, never a misread enum. cudarc's own calls here (create,
//! record, and destroy in its `Drop`) are made with the exit gate held, as the table's are
//! ([`DriverTable::enter`]); once the process is exiting an event is not destroyed but left to
//! the process's end.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};

use super::context::push_current;
use super::driver::{require_driver, Api, DriverTable, Live, NOT_READY, SUCCESS};
use super::{cuda_error, driver_error};
use crate::sys::lock::Lock;
use crate::Result;

/// Idle events kept for reuse. The pool's vector never grows past this (its buffer is
/// reserved once, well below the allocator's smallest threshold): pushes may happen inside the
/// allocator, where a growing vector would be served by the inner allocator.
const POOL_CAPACITY: usize = 64;

/// Idle events of every context, so that a copy or a freed block does not create one each time.
/// Each keeps its context (cudarc's `Arc<CudaContext>`) alive until the process exits.
///
/// The crate's fork-safe lock, because a forked child can take it (a `PinnedBuf` made and copied
/// there): the fork handlers (`process/mod.rs`) take it last, after the arenas' locks, since a
/// pending block's event that completed comes back here under its arena's lock, and nothing is
/// locked while it is held.
pub(crate) static POOL: Lock<Vec<CudaEvent>> = Lock::new(Vec::new());

/// The driver's table with the exit gate held (see [`DriverTable::enter`]).
fn enter() -> Result<Live<'static>> {
    require_driver().and_then(DriverTable::enter)
}

/// An idle event of `ctx`: one from the pool, else a new one.
pub(crate) fn take_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
    {
        let mut pool = POOL.lock();
        if let Some(i) = pool.iter().position(|e| Arc::ptr_eq(e.context(), ctx)) {
            return Ok(pool.swap_remove(i));
        }
    }
    let _live = enter()?;
    ctx.new_event(None)
        .map_err(|e| driver_error("cuEventCreate", e))
}

/// A pooled event of `stream`'s context, recorded on `stream` after the work queued so far.
pub(crate) fn record(stream: &CudaStream) -> Result<CudaEvent> {
    let event = take_event(stream.context())?;
    let _live = enter()?;
    event
        .record(stream)
        .map_err(|e| driver_error("cuEventRecord", e))?;
    Ok(event)
}

/// Makes `stream` wait for the work recorded on `event` (cudarc's `CudaStream::wait`, with the
/// exit gate held): the outer error is the gate's (the process is exiting, or no driver), the
/// inner one the driver's answer.
pub(crate) fn stream_wait(
    stream: &CudaStream,
    event: &CudaEvent,
) -> Result<std::result::Result<(), DriverError>> {
    let _live = enter()?;
    Ok(stream.wait(event))
}

/// Returns an event whose recorded work has completed to the pool (destroys it when full).
pub(crate) fn give_back(event: CudaEvent) {
    let mut pool = POOL.lock();
    // Reserved once, fallibly: this runs on allocation paths, which must not abort.
    let room = pool.capacity() > 0 || pool.try_reserve_exact(POOL_CAPACITY).is_ok();
    if room && pool.len() < POOL_CAPACITY {
        pool.push(event);
    } else {
        drop(pool);
        destroy(event);
    }
}

/// Destroys `event` without changing the calling thread's current context: cudarc's `Drop`
/// makes the event's context current first, which a free on an unrelated thread must not do.
pub(crate) fn destroy(event: CudaEvent) {
    let Ok(live) = enter() else {
        // The process is exiting (the driver may be tearing down): no cuEventDestroy.
        std::mem::forget(event);
        return;
    };
    // SAFETY: the event's context is alive (the event holds it).
    let current = unsafe { push_current(&live, event.context().cu_ctx().cast()) };
    drop(event);
    drop(current);
}

/// Whether the work recorded on `event` has completed. Never blocks.
pub(crate) fn is_complete(event: &CudaEvent) -> Result<bool> {
    let live = enter()?;
    outcome(&live, event.cu_event().cast())
}

/// Blocks until the work recorded on `event` has completed.
pub(crate) fn wait(event: &CudaEvent) -> Result<()> {
    let api = enter()?;
    // SAFETY: `event_synchronize` is cuEventSynchronize from the loaded driver; the handle is a
    // live event (the `CudaEvent` owns it until dropped).
    let res = unsafe { (api.event_synchronize)(event.cu_event().cast()) };
    api.check("cuEventSynchronize", res)
}

/// `cuEventQuery`'s answer: done, still running, or an error.
pub(super) fn outcome(api: &Api, event: *mut c_void) -> Result<bool> {
    // SAFETY: `event_query` is cuEventQuery from the loaded driver (or the tests' fake); the
    // handle is a live event of the caller.
    match unsafe { (api.event_query)(event) } {
        SUCCESS => Ok(true),
        NOT_READY => Ok(false),
        code => Err(cuda_error("cuEventQuery", code, |c| api.error_name(c))),
    }
}
