//! Reservations' work: bytes of chunks for the calling thread's target, waited for or made on a
//! thread of its own ([`NumaGpuAlloc::reserve_bytes`], [`NumaGpuAlloc::reserve_in_background`]).

use std::sync::Arc;

use super::NumaGpuAlloc;
use crate::blocks::reserve::Tally;
use crate::guard::Inside;
use crate::process::job::Background;
use crate::reservation::{self, Reservation, ReserveProgress};
use crate::runtime::route;
use crate::runtime::Runtime;
use crate::Error;

/// Reserves `bytes` for the calling thread's target, counted in `tally`, and waits for it: what
/// was made, or the error it stopped at. Called inside the re-entrancy guard.
pub(super) fn wait_for(rt: &Runtime, bytes: usize, tally: Tally) -> Result<ReserveProgress, Error> {
    let outcome = reserve_for_caller(rt, bytes, &tally);
    tally.job.finish(outcome);
    let done = reservation::progress(&tally);
    match &done.error {
        Some(e) => Err(e.clone()),
        None => Ok(done),
    }
}

/// Reserves `bytes` on a thread of its own for the calling thread's target, resolved (and its
/// kind checked) now.
pub(super) fn in_background<A: Sync>(
    alloc: &'static NumaGpuAlloc<A>,
    bytes: usize,
) -> Result<Reservation, Error> {
    let inside = Inside::enter();
    let rt = alloc.runtime();
    let target = route::target(rt);
    let kind = rt.blocks.kind(&target)?;
    drop(inside);
    let tally = Arc::new(Tally::new(bytes));
    let job = Background::spawn("numa-reserve", "reservation thread", tally, move |tally| {
        let _inside = Inside::enter();
        // Alive while `alloc` is: `'static`.
        let rt = alloc.runtime();
        rt.blocks
            .reserver()
            .reserve_bytes(bytes, &target, kind, tally)
    })?;
    Ok(Reservation::new(job))
}

/// Reserves for the calling thread's target.
fn reserve_for_caller(rt: &Runtime, bytes: usize, tally: &Tally) -> Result<(), Error> {
    let target = route::target(rt);
    let kind = rt.blocks.kind(&target)?;
    rt.blocks
        .reserver()
        .reserve_bytes(bytes, &target, kind, tally)
}
