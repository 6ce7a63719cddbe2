//! The exit protocol: from the moment the driver's teardown can begin, no thread calls the driver.
//!
//! libcuda tears its state down at exit (in its own exit handler or its library destructor); a
//! call that another thread makes afterwards touches freed driver state. Exit handlers run in
//! reverse order of registration; library destructors run in the dynamic loader's handler,
//! which the C runtime registered before `main`, so after every handler registered later. The
//! handler here closes the gate, then waits for the calls already through it to end. The driver
//! probe registers it before it loads libcuda (a handler registered only once the library is
//! loaded can be registered while the process already exits, and then runs after the loader's
//! handler: too late), again right after `cuInit` (to run before whatever teardown the driver
//! registered there), and once more after the first primary context is retained, in case the
//! driver registers its teardown only then. It runs once, whichever comes first.
//!
//! Every driver call passes the gate: [`DriverCall`] is entered only by
//! `driver::DriverTable::enter`, the one way to the driver's entry points.
//!
//! The gate is one word: the closed bit and the count of calls in flight. Entering and closing
//! are read-modify-writes of that word, so whichever comes first in its modification order wins:
//! a call that entered before the gate closed is waited for, one that comes after is refused.
//! (Two separate flags, each side storing its own and loading the other's, would need `SeqCst`
//! on all four accesses to rule out both sides missing each other.)

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::{sys, Error, Result};

/// Why a driver call is refused at exit.
pub(crate) const EXITING_REASON: &str = "the process is exiting (the driver may be tearing down)";

/// Set once the exit handler ran.
const CLOSED: u32 = 1 << 31;

/// [`CLOSED`], and the number of driver calls in flight.
static GATE: AtomicU32 = AtomicU32::new(0);

/// How long the exit handler waits for calls in flight: one registration of at most a chunk
/// (tens of milliseconds on current drivers), or a block registered whole (94 GB in one call
/// took 11.6 s on one driver).
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// Registers the exit handler that closes the gate. Called when the program is loaded (the
/// process's constructor: before any library the program loads later registers its teardown,
/// and also where the program loaded libcuda before this crate's first probe), by the driver
/// probe before it loads libcuda and again after `cuInit` (so that it runs before the driver's
/// teardown, whichever way the driver registers it), and once a primary context is first
/// retained (the handler runs once, whichever comes first).
pub(crate) fn close_at_exit() -> Result<()> {
    sys::at_exit(close).map_err(|_| Error::CudaUnavailable {
        reason: "the exit handler that keeps driver calls out of the driver's teardown could not \
                 be registered (atexit failed)",
    })
}

/// A driver call in flight: the exit handler waits for it to end.
pub(super) struct DriverCall(());

impl DriverCall {
    /// Enters the gate, or [`Error::CudaUnavailable`] with [`EXITING_REASON`] once the process
    /// is exiting.
    pub(super) fn enter() -> Result<DriverCall> {
        let before = GATE.fetch_add(1, Ordering::Acquire);
        if before & CLOSED != 0 {
            GATE.fetch_sub(1, Ordering::Release);
            return Err(Error::CudaUnavailable {
                reason: EXITING_REASON,
            });
        }
        Ok(DriverCall(()))
    }
}

impl Drop for DriverCall {
    fn drop(&mut self) {
        GATE.fetch_sub(1, Ordering::Release);
    }
}

/// Whether the gate is closed (the process is exiting): work that would end in a driver call
/// can stop early. [`DriverCall::enter`] is what decides.
pub(crate) fn exiting() -> bool {
    GATE.load(Ordering::Relaxed) & CLOSED != 0
}

/// Forgets the calls in flight in the parent at a fork, keeping the closed bit: their threads do
/// not exist in the child, whose exit must not wait for them. Called by the child fork handler.
pub(crate) fn forget_calls_in_child() {
    GATE.fetch_and(CLOSED, Ordering::Relaxed);
}

/// The exit handler: closes the gate, then waits (at most [`DRAIN_LIMIT`]) for the calls in
/// flight.
extern "C" fn close() {
    if GATE.fetch_or(CLOSED, Ordering::AcqRel) & CLOSED != 0 {
        return;
    }
    let deadline = Instant::now() + DRAIN_LIMIT;
    while GATE.load(Ordering::Acquire) & !CLOSED != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}
