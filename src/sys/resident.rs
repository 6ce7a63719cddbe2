//! Faulting pages in under the range's policy: `madvise(MADV_POPULATE_WRITE)`, or one write per
//! page on kernels older than 5.14 ([`populate`]).
//!
//! Unsafe code here relies on the caller's promise that the range is its own, writable and still
//! all zeros, so that faulting it in (or writing zeros into it) changes no content.
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

use super::{check_range, errno, fault, page_size};
use crate::{Error, Result};

// libc only has it from 0.2.171 on; Cargo.toml allows 0.2.170.
const MADV_POPULATE_WRITE: c_int = 23;

const POPULATE_CALL: &str = "madvise(MADV_POPULATE_WRITE)";

/// How [`populate`] faulted the pages in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PopulateMethod {
    /// `madvise(MADV_POPULATE_WRITE)` (Linux ≥ 5.14).
    MadvisePopulateWrite,
    /// One volatile zero-byte write per page (older kernels).
    TouchPages,
}

/// How [`populate`] faults pages in; probed once per process.
static POPULATE_METHOD: AtomicU8 = AtomicU8::new(METHOD_UNKNOWN);
const METHOD_UNKNOWN: u8 = 0;
const METHOD_MADVISE: u8 = 1;
const METHOD_TOUCH: u8 = 2;

/// Faults in every page of `ptr..ptr+len` for writing, under the range's memory policy.
///
/// Uses `madvise(MADV_POPULATE_WRITE)` (Linux ≥ 5.14), which reports an exhausted node as ENOMEM
/// instead of invoking the OOM killer. If the kernel answers EINVAL to the first attempt (too
/// old), this and every later call write one zero byte per page with a volatile write instead.
/// Returns the method used. Errors: [`Error::InvalidRange`] for an empty or misaligned range,
/// [`Error::Syscall`] (`call: "madvise(MADV_POPULATE_WRITE)"`) otherwise (ENOMEM: no memory on
/// the allowed nodes, or the range is not mapped; EFAULT: SIGBUS while faulting).
///
/// # Safety
///
/// `ptr..ptr+len` must be a writable mapping this crate created with
/// [`map_anonymous`](super::map_anonymous), that nobody else uses, and whose content is still all zeros (the fallback writes zeros).
pub unsafe fn populate(ptr: NonNull<u8>, len: usize) -> Result<PopulateMethod> {
    let pages = check_range(ptr, len)?;
    if fault::cleared() {
        // The tests' `fault::clear`: probe again.
        POPULATE_METHOD.store(METHOD_UNKNOWN, Ordering::Relaxed);
    }
    let method = POPULATE_METHOD.load(Ordering::Relaxed);
    if method == METHOD_TOUCH {
        // The fallback makes no syscall, but an injected fault should still be seen.
        if let Some(errno) = fault::injected(fault::FaultPoint::Populate) {
            return Err(Error::Syscall {
                call: POPULATE_CALL,
                errno,
            });
        }
    } else {
        // EINTR: a signal arrived while faulting. The pages populated so far stay, so each retry
        // goes on where the last one stopped, however busy the signals (a fatal one ends the
        // process on its way back from the call). No other errno is retried: no bound needed.
        let result = loop {
            let attempt = match fault::injected(fault::FaultPoint::Populate) {
                Some(errno) => Err(errno),
                None => madvise_populate_write(ptr, len),
            };
            if attempt != Err(libc::EINTR) {
                break attempt;
            }
        };
        match result {
            Ok(()) => {
                POPULATE_METHOD.store(METHOD_MADVISE, Ordering::Relaxed);
                return Ok(PopulateMethod::MadvisePopulateWrite);
            }
            // Before 5.14 the advice is unknown (EINVAL). Once it has worked, EINVAL means
            // something else (e.g. a VM_PFNMAP range) and is reported.
            Err(libc::EINVAL) if method == METHOD_UNKNOWN => {
                POPULATE_METHOD.store(METHOD_TOUCH, Ordering::Relaxed);
            }
            Err(errno) => {
                return Err(Error::Syscall {
                    call: POPULATE_CALL,
                    errno,
                })
            }
        }
    }
    let ps = page_size();
    for page in 0..pages {
        // SAFETY: page * ps < len rounded up to a page, inside the caller's writable mapping,
        // which is zero-filled so writing zero keeps its content; volatile so the write (and
        // therefore the fault) is not optimised away.
        unsafe { ptr.as_ptr().add(page * ps).write_volatile(0) };
    }
    Ok(PopulateMethod::TouchPages)
}

fn madvise_populate_write(ptr: NonNull<u8>, len: usize) -> std::result::Result<(), i32> {
    // SAFETY: MADV_POPULATE_WRITE only faults pages in (as a write would); it never changes
    // content, and fails cleanly (ENOMEM) on unmapped parts.
    if unsafe { libc::madvise(ptr.as_ptr().cast(), len, MADV_POPULATE_WRITE) } != 0 {
        return Err(errno());
    }
    Ok(())
}

/// The page at the middle of the `i`th of `samples` equal slices of `pages` pages.
fn sample_index(i: usize, pages: usize, samples: usize) -> usize {
    (2 * i + 1) * pages / (2 * samples)
}

/// The page size, how many pages are sampled (`samples`, no more than the range has), and the
/// first byte of each, spread evenly over `ptr..ptr+len`; `None` for a range without a whole
/// page.
fn sampled_pages(
    ptr: NonNull<u8>,
    len: usize,
    samples: usize,
) -> Option<(usize, usize, impl Iterator<Item = *mut u8>)> {
    let page = page_size();
    let pages = len / page;
    let samples = samples.min(pages);
    (samples > 0).then(|| {
        let at = move |i| {
            ptr.as_ptr()
                .wrapping_add(sample_index(i, pages, samples) * page)
        };
        (page, samples, (0..samples).map(at))
    })
}

/// How many of `samples` pages spread evenly over `ptr..ptr+len` are resident (`mincore`), and
/// how many were asked about: what the range's last user touched, seen without touching it.
/// `None` when the kernel refused (a range not mapped, an empty one). Allocates nothing: one
/// call per sampled page.
pub(crate) fn resident_sample(
    ptr: NonNull<u8>,
    len: usize,
    samples: usize,
) -> Option<(usize, usize)> {
    let (page, asked, pages) = sampled_pages(ptr, len, samples)?;
    let mut resident = 0;
    for at in pages {
        let mut vec = 0u8;
        // SAFETY: the address is page-aligned and inside the caller's range; `vec` holds the
        // one byte `mincore` writes for one page. It reads page tables only.
        let rc = unsafe {
            libc::mincore(
                at.cast(),
                page,
                // `unsigned char *` on Linux, `char *` elsewhere.
                std::ptr::addr_of_mut!(vec).cast(),
            )
        };
        if rc != 0 {
            return None;
        }
        resident += usize::from(vec & 1);
    }
    Some((resident, asked))
}

/// How many of `samples` pages spread evenly over `ptr..ptr+len` were written (a page of their
/// own on some node: `move_pages`, which reports a page only read, mapped to the kernel's
/// shared zero page, as absent), and how many were asked about. Where `move_pages` is refused
/// (seccomp), [`resident_sample`], which counts a page only read as resident. `None` when the
/// kernel refused both. Allocates nothing: one call per sampled page.
pub(crate) fn written_sample(
    ptr: NonNull<u8>,
    len: usize,
    samples: usize,
) -> Option<(usize, usize)> {
    let (page, asked, pages) = sampled_pages(ptr, len, samples)?;
    let mut written = 0;
    for at in pages {
        let mut node = -1;
        // SAFETY: one page-aligned page inside the caller's range; `move_pages` without target
        // nodes reads page tables only.
        match unsafe { super::page_nodes(NonNull::new(at)?, page, |_, n| node = n) } {
            Ok(()) => written += usize::from(node >= 0),
            Err(Error::NumaUnavailable { .. }) => return resident_sample(ptr, len, samples),
            Err(_) => return None,
        }
    }
    Some((written, asked))
}
