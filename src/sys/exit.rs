//! What the exit report needs from libc: an `atexit(3)` handler ([`at_exit`]), unbuffered writes
//! to fd 2 ([`write_stderr`]), and whether an address lies in a loaded object's image
//! ([`in_loaded_image`], `dladdr(3)`).
//!
//! Unsafe code here relies on the raw calls themselves: `atexit` gets a plain function that lives
//! as long as its object, `write` a live slice with its length, `dladdr` a buffer of this module.
#![allow(unsafe_code)]

use super::errno;
use crate::{Error, Result};

/// Has `handler` run when the process exits (`atexit(3)`), or when the shared library holding it
/// is unloaded (glibc runs a library's handlers then).
///
/// Fails with [`Error::Syscall`] (`call: "atexit"`, ENOMEM) when libc cannot store it.
pub(crate) fn at_exit(handler: extern "C" fn()) -> Result<()> {
    // SAFETY: `handler` is a C-ABI function without arguments, as atexit expects, and stays valid
    // until its object is unloaded, which first runs the handler.
    if unsafe { libc::atexit(handler) } != 0 {
        return Err(Error::Syscall {
            call: "atexit",
            errno: libc::ENOMEM,
        });
    }
    Ok(())
}

/// Writes all of `bytes` to fd 2 with `write(2)`: no lock and no allocation, so an exit handler
/// may call it while other threads hold `std::io::stderr`. Retries after EINTR and partial
/// writes; gives up silently on any other error (there is nowhere better to report it).
pub(crate) fn write_stderr(bytes: &[u8]) {
    let mut rest = bytes;
    while !rest.is_empty() {
        // SAFETY: `rest` is valid for reads of `rest.len()` bytes.
        let written = unsafe { libc::write(libc::STDERR_FILENO, rest.as_ptr().cast(), rest.len()) };
        if written < 0 && errno() == libc::EINTR {
            continue;
        }
        match usize::try_from(written) {
            Ok(n) if n > 0 => rest = &rest[n.min(rest.len())..],
            _ => break,
        }
    }
}

/// Whether `addr` lies in the image of a loaded object, the executable or a shared library
/// (`dladdr(3)`): true for a static, false for the stack or the heap.
pub(crate) fn in_loaded_image<T>(addr: *const T) -> bool {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the loader's list of loaded objects and writes only `info`; the
    // address itself is never dereferenced.
    unsafe { libc::dladdr(addr.cast(), info.as_mut_ptr()) != 0 }
}
