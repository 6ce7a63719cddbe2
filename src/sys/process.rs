//! Process-wide handlers: `pthread_atfork(3)` ([`at_fork`]).
//!
//! Unsafe code here relies on the handlers being plain functions that live as long as the program.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};

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

/// Runs `spawn` with every signal blocked on the calling thread, and restores its mask after: a
/// thread inherits the mask of the thread that makes it, so the threads `spawn` starts take no
/// signal from their first instruction. A program that blocks a signal in all its threads and
/// waits for it with `sigwait` or `signalfd` would otherwise lose it to one of ours, and die of
/// it where its default action kills.
pub(crate) fn with_signals_blocked<T>(spawn: impl FnOnce() -> T) -> T {
    /// Restores the mask, however `spawn` ends.
    struct Restore(libc::sigset_t);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: `self.0` is the mask `pthread_sigmask` wrote below.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
        }
    }
    let mut all = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    let mut old = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: `sigfillset` initialises `all`; `pthread_sigmask` reads it and writes the old mask
    // into `old`, both valid sigsets on this stack.
    let blocked = unsafe {
        libc::sigfillset(all.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_SETMASK, all.as_ptr(), old.as_mut_ptr()) == 0
    };
    // SAFETY: written by the successful call above.
    let _restore = blocked.then(|| Restore(unsafe { old.assume_init() }));
    spawn()
}

/// What glibc needs of a new thread's stack besides the stack itself (its static TLS and guard),
/// from its `__pthread_get_minstack`: found with `dlsym` by [`find_thread_overhead`] at
/// initialisation, never inside an allocation. 0 until then, or where glibc has none.
static MIN_STACK: AtomicUsize = AtomicUsize::new(0);

/// Looks glibc's `__pthread_get_minstack` up, once, for [`spawn_detached`] (std does the same
/// at its first spawn). Called by the process's initialisation.
pub(crate) fn find_thread_overhead() {
    if MIN_STACK.load(Ordering::Relaxed) != 0 {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the loaded objects.
        let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__pthread_get_minstack".as_ptr()) };
        if !found.is_null() {
            type MinStack = unsafe extern "C" fn(*const libc::pthread_attr_t) -> usize;
            // SAFETY: glibc's `__pthread_get_minstack` has this signature.
            let min_stack: MinStack = unsafe { std::mem::transmute(found) };
            let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
            // SAFETY: `attr` is initialised before use and destroyed after.
            let overhead = unsafe {
                libc::pthread_attr_init(attr.as_mut_ptr());
                let size = min_stack(attr.as_ptr());
                libc::pthread_attr_destroy(attr.as_mut_ptr());
                size
            };
            MIN_STACK.store(overhead, Ordering::Relaxed);
        }
    }
}

/// Starts `body` on a detached thread of `stack` bytes (plus what glibc takes from a stack for
/// static TLS, [`find_thread_overhead`]) that takes no signal ([`with_signals_blocked`]), named
/// `name` (at most 15 bytes are kept). `pthread_create` itself, not `std::thread`: std looks
/// `__pthread_get_minstack` up with `dlsym` at its first spawn, which inside an allocation would
/// take the loader's lock and clear the program's pending `dlerror()`. A panic in `body` ends the
/// thread, not the process. Fails with [`Error::Syscall`] naming `pthread_create` and its error.
pub(crate) fn spawn_detached(
    name: &str,
    stack: usize,
    body: Box<dyn FnOnce() + Send>,
) -> Result<()> {
    struct Start {
        /// NUL-terminated.
        name: [u8; 16],
        body: Box<dyn FnOnce() + Send>,
    }
    extern "C" fn start(arg: *mut libc::c_void) -> *mut libc::c_void {
        // SAFETY: `arg` is the `Start` boxed below, handed to this thread alone.
        let start = unsafe { Box::from_raw(arg.cast::<Start>()) };
        #[cfg(target_os = "linux")]
        // SAFETY: PR_SET_NAME reads a NUL-terminated name of at most 16 bytes.
        unsafe {
            libc::prctl(libc::PR_SET_NAME, start.name.as_ptr())
        };
        // Unwinding out of this `extern "C"` function would abort the process.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(start.body));
        std::ptr::null_mut()
    }
    let mut comm = [0u8; 16];
    let len = name.len().min(15);
    comm[..len].copy_from_slice(&name.as_bytes()[..len]);
    let arg = Box::into_raw(Box::new(Start { name: comm, body }));
    let stack = stack.saturating_add(MIN_STACK.load(Ordering::Relaxed));
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    let mut thread = std::mem::MaybeUninit::<libc::pthread_t>::uninit();
    let rc = with_signals_blocked(|| {
        // SAFETY: `attr` is initialised by `pthread_attr_init` before use and destroyed after;
        // `start` takes ownership of `arg` only when `pthread_create` succeeds.
        unsafe {
            if libc::pthread_attr_init(attr.as_mut_ptr()) != 0 {
                return libc::ENOMEM;
            }
            let stack = stack.max(libc::PTHREAD_STACK_MIN);
            libc::pthread_attr_setstacksize(attr.as_mut_ptr(), stack);
            libc::pthread_attr_setdetachstate(attr.as_mut_ptr(), libc::PTHREAD_CREATE_DETACHED);
            let rc = libc::pthread_create(thread.as_mut_ptr(), attr.as_ptr(), start, arg.cast());
            libc::pthread_attr_destroy(attr.as_mut_ptr());
            rc
        }
    });
    if rc != 0 {
        // SAFETY: the thread was not made, so `arg` is still ours.
        drop(unsafe { Box::from_raw(arg) });
        return Err(Error::Syscall {
            call: "pthread_create",
            errno: rc,
        });
    }
    Ok(())
}
