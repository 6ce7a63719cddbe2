//! Process-wide handlers: `pthread_atfork(3)` ([`at_fork`]).
//!
//! Unsafe code here relies on the handlers being plain functions that live as long as the program.
#![allow(unsafe_code)]

use crate::{Error, Result};

/// Registers fork handlers with `pthread_atfork(3)`: `prepare` runs in the forking thread before
/// `fork`, `parent` and `child` after it in each process.
///
/// Fails with [`Error::Syscall`] (`call: "pthread_atfork"`, ENOMEM) when glibc cannot store them.
pub(crate) fn at_fork(
    prepare: unsafe extern "C" fn(),
    parent: unsafe extern "C" fn(),
    child: unsafe extern "C" fn(),
) -> Result<()> {
    // SAFETY: the handlers are plain functions that live as long as the program.
    match unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) } {
        0 => Ok(()),
        errno => Err(Error::Syscall {
            call: "pthread_atfork",
            errno,
        }),
    }
}
