//! Where the pages of a range are: `move_pages(2)` without target nodes ([`page_nodes`]) and the
//! count it gives ([`census`]).
//!
//! Unsafe code here relies on `move_pages` only reading page tables when given no target nodes,
//! with address and status arrays of this module.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_long, c_void};
use std::ptr::{self, NonNull};

use super::{check_range, errno, fault, numa_error, page_size};
use crate::Result;

/// Move_pages batch size: bounded so the address and status arrays fit on the stack (6 KiB).
const MOVE_PAGES_CHUNK: usize = 512;

/// Where the pages of a range are, as counted by [`census`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageCensus {
    /// Pages in the range.
    pub pages: usize,
    /// Pages present on the node asked about.
    pub on_node: usize,
    /// Pages present on another node.
    pub elsewhere: usize,
    /// Pages with no node: not faulted in yet (`-ENOENT`), or another per-page error such as
    /// `-EFAULT`.
    pub absent: usize,
}

/// Calls `f(page_index, node)` for every page of `ptr..ptr+len`, in order.
///
/// `node` is the id of the node holding the page, or a negated errno: `-ENOENT` for a page not
/// faulted in yet, `-EFAULT` for an address that is not mapped (or maps the shared zero page).
/// Uses `move_pages(0, n, pages, NULL, status, 0)` in batches of 512 pages on the stack; `f` may
/// already have been called for earlier batches when an error is returned. Errors:
/// [`Error::InvalidRange`] for an empty or misaligned range, [`Error::NumaUnavailable`]
/// (`call: "move_pages"`) for EPERM/ENOSYS (Docker's default seccomp profile always refuses
/// `move_pages`), [`Error::Syscall`] otherwise.
///
/// [`Error::InvalidRange`]: crate::Error::InvalidRange
/// [`Error::NumaUnavailable`]: crate::Error::NumaUnavailable
/// [`Error::Syscall`]: crate::Error::Syscall
///
/// # Safety
///
/// `ptr..ptr+len` should be a mapping this crate created. The kernel only reads page tables (it
/// moves nothing when no target nodes are given), so no memory is accessed, but the answer about
/// a range someone else may unmap concurrently is meaningless.
pub unsafe fn page_nodes(
    ptr: NonNull<u8>,
    len: usize,
    mut f: impl FnMut(usize, i32),
) -> Result<()> {
    let pages = check_range(ptr, len)?;
    if let Some(errno) = fault::injected(fault::FaultPoint::MovePages) {
        return Err(numa_error("move_pages", errno));
    }
    let base = ptr.as_ptr() as usize;
    let ps = page_size();
    let mut addrs = [ptr::null_mut::<c_void>(); MOVE_PAGES_CHUNK];
    let mut status: [c_int; MOVE_PAGES_CHUNK] = [0; MOVE_PAGES_CHUNK];
    let mut first = 0;
    while first < pages {
        let n = (pages - first).min(MOVE_PAGES_CHUNK);
        for (i, slot) in addrs[..n].iter_mut().enumerate() {
            *slot = (base + (first + i) * ps) as *mut c_void;
        }
        // SAFETY: addrs and status hold n valid entries each; with nodes == NULL the kernel only
        // reports each page's node into status and touches no user memory otherwise.
        let rc: c_long = linux_only!(unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0 as c_long, // this process
                n as libc::c_ulong,
                addrs.as_ptr(),
                ptr::null::<c_int>(),
                status.as_mut_ptr(),
                0 as c_long,
            )
        })
        .map_err(|errno| numa_error("move_pages", errno))?;
        if rc < 0 {
            return Err(numa_error("move_pages", errno()));
        }
        for (i, &node) in status[..n].iter().enumerate() {
            f(first + i, node);
        }
        first += n;
    }
    Ok(())
}

/// Counts where the pages of `ptr..ptr+len` are relative to `node`, with [`page_nodes`].
///
/// Same errors as [`page_nodes`].
///
/// # Safety
///
/// As for [`page_nodes`].
pub unsafe fn census(ptr: NonNull<u8>, len: usize, node: usize) -> Result<PageCensus> {
    let mut census = PageCensus::default();
    // SAFETY: forwarded from the caller.
    unsafe {
        page_nodes(ptr, len, |_, status| {
            census.pages += 1;
            if status < 0 {
                census.absent += 1;
            } else if status as usize == node {
                census.on_node += 1;
            } else {
                census.elsewhere += 1;
            }
        })
    }?;
    Ok(census)
}
