//! Mappings: [`map_anonymous`] (`mmap`), [`move_mapping`] (`mremap`, and whether it moves
//! several kernel mappings at once: [`moves_several_mappings`]), [`unmap`] (`munmap`) and
//! the `madvise` hints ([`advise_hugepage`], [`advise_nohugepage`], [`advise_dontneed`]).
//!
//! Unsafe code here relies on the raw calls themselves: each wrapper checks its range, and the
//! callers of the `unsafe fn`s own the mappings they pass.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU8, Ordering};

use super::{check_range, errno, fault, page_size};
use crate::{Error, Result};

/// Maps `len` bytes of fresh, zeroed, private anonymous memory aligned to `align`.
///
/// The mapping is readable and writable and has no pages yet (never `MAP_POPULATE`: pages must
/// be faulted in only after [`bind`](super::bind) has set the policy). `len` must be a non-zero
/// multiple of [`page_size`] and `align` a power of two; alignments above the page size (up to 1 GiB and
/// beyond) are obtained by over-mapping and unmapping the excess, so exactly `len` bytes stay
/// mapped. Bad `len`/`align` give [`Error::InvalidRange`] (with `addr` 0); a failed `mmap` gives
/// [`Error::Syscall`] (`call: "mmap"`), a failed trim `call: "munmap"`.
pub fn map_anonymous(len: usize, align: usize) -> Result<NonNull<u8>> {
    let ps = page_size();
    let bad = Error::InvalidRange { addr: 0, len };
    if len == 0 || !len.is_multiple_of(ps) || !align.is_power_of_two() {
        return Err(bad);
    }
    // mmap already returns page-aligned addresses, so `align - ps` extra bytes always contain an
    // aligned start.
    let extra = align.saturating_sub(ps);
    let total = len.checked_add(extra).ok_or(bad)?;
    if let Some(errno) = fault::injected(fault::FaultPoint::Mmap) {
        return Err(Error::Syscall {
            call: "mmap",
            errno,
        });
    }
    // SAFETY: an anonymous mapping at an address of the kernel's choosing touches no existing
    // memory.
    let base = unsafe {
        libc::mmap(
            ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(Error::Syscall {
            call: "mmap",
            errno: errno(),
        });
    }
    let base_addr = base as usize;
    let head = base_addr.wrapping_neg() & (align - 1); // bytes up to the next aligned address
    let tail = extra - head;
    if head != 0 {
        // SAFETY: base..base+head is the start of the mapping just created, which nobody else
        // knows about.
        if unsafe { libc::munmap(base, head) } != 0 {
            let errno = errno();
            // SAFETY: as above; the whole mapping is still ours, give it back.
            unsafe { libc::munmap(base, total) };
            return Err(Error::Syscall {
                call: "munmap",
                errno,
            });
        }
    }
    let start = base_addr + head;
    if tail != 0 {
        // SAFETY: start+len..start+len+tail is the end of the mapping just created.
        if unsafe { libc::munmap((start + len) as *mut c_void, tail) } != 0 {
            let errno = errno();
            // SAFETY: start..start+len+tail is what remains of our mapping.
            unsafe { libc::munmap(start as *mut c_void, len + tail) };
            return Err(Error::Syscall {
                call: "munmap",
                errno,
            });
        }
    }
    // mmap never returns address 0 for a non-fixed mapping (mmap_min_addr), so this only fails
    // if the kernel misbehaves.
    NonNull::new(start as *mut u8).ok_or(Error::Syscall {
        call: "mmap",
        errno: libc::EFAULT,
    })
}

/// Moves the pages of the mapping `from..from+len` to `to..to+len` with
/// `mremap(MREMAP_MAYMOVE | MREMAP_FIXED)`: page tables move, no byte is copied, and the pages
/// keep their node and the range its memory policy. Whatever was mapped at `to..to+len` is
/// unmapped first; `from..from+len` is unmapped afterwards.
///
/// `from..from+len` must be one kernel mapping (VMA) before Linux 6.17: older kernels refuse a
/// range of several (EFAULT), and only after unmapping `to..to+len`.
///
/// Fails with [`Error::InvalidRange`] for an empty or misaligned range, [`Error::Syscall`]
/// (`call: "mremap"`) if the kernel refuses; then `from..from+len` is as it was, but
/// `to..to+len` may already be unmapped (the kernel unmaps the destination before some of its
/// checks).
///
/// # Safety
///
/// Both ranges must be mappings this crate created with [`map_anonymous`], must not overlap, and
/// nothing may use either while this runs; afterwards `from..from+len` must not be used.
pub unsafe fn move_mapping(from: NonNull<u8>, to: NonNull<u8>, len: usize) -> Result<()> {
    // SAFETY: forwarded from the caller; the destination is as long as the range.
    unsafe { move_and_grow(from, len, to, len) }
}

/// Moves the mapping `from..from+len` to `to` and grows it there to `new_len` (at least `len`)
/// in one `mremap(MREMAP_MAYMOVE | MREMAP_FIXED)`: one kernel mapping still, its pages moved
/// without a copy, the rest fresh zero pages that take the mapping's memory policy and advice.
/// Whatever was mapped at `to..to+new_len` is unmapped first. Errors as [`move_mapping`]'s.
///
/// # Safety
///
/// As [`move_mapping`], with `to..to+new_len` for the destination.
pub(crate) unsafe fn move_and_grow(
    from: NonNull<u8>,
    len: usize,
    to: NonNull<u8>,
    new_len: usize,
) -> Result<()> {
    check_range(from, len)?;
    check_range(to, new_len)?;
    if new_len < len {
        return Err(Error::InvalidRange {
            addr: to.as_ptr() as usize,
            len: new_len,
        });
    }
    // SAFETY: the caller guarantees both ranges are our mappings and unused; FIXED replaces only
    // the caller's own range at `to`.
    let moved: *mut c_void = linux_only!(unsafe {
        libc::mremap(
            from.as_ptr().cast(),
            len,
            new_len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to.as_ptr().cast::<c_void>(),
        )
    })
    .map_err(|errno| Error::Syscall {
        call: "mremap",
        errno,
    })?;
    if moved == libc::MAP_FAILED {
        return Err(Error::Syscall {
            call: "mremap",
            errno: errno(),
        });
    }
    Ok(())
}

/// Unmaps the tail of the mapping `ptr..ptr+len` past `new_len` (a whole number of pages, less
/// than `len`); its head stays where it is, pages and all. Fails with [`Error::InvalidRange`]
/// for a misaligned range or length, [`Error::Syscall`] (`call: "munmap"`) if the kernel
/// refuses (then nothing changed).
///
/// # Safety
///
/// `ptr..ptr+len` must be a mapping this crate created (anonymous or a file's), and nothing may
/// use its tail any more.
pub(crate) unsafe fn truncate_mapping(ptr: NonNull<u8>, len: usize, new_len: usize) -> Result<()> {
    check_range(ptr, len)?;
    if new_len == 0 || new_len >= len || !new_len.is_multiple_of(super::page_size()) {
        return Err(Error::InvalidRange {
            addr: ptr.as_ptr() as usize + new_len,
            len: len.saturating_sub(new_len),
        });
    }
    // SAFETY: the tail lies inside the caller's mapping, which nothing uses there.
    if unsafe { libc::munmap(ptr.as_ptr().add(new_len).cast(), len - new_len) } != 0 {
        return Err(Error::Syscall {
            call: "munmap",
            errno: errno(),
        });
    }
    Ok(())
}

/// The size of a transparent huge page on x86-64 and of the arena's huge-page granule.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Whether [`move_mapping`] moves a range spanning several kernel mappings (Linux ≥ 6.17, for a
/// move of unchanged size with `MREMAP_FIXED`). Read once from `uname`.
pub(crate) fn moves_several_mappings() -> bool {
    static ANSWER: AtomicU8 = AtomicU8::new(0);
    match ANSWER.load(Ordering::Relaxed) {
        1 => return false,
        2 => return true,
        _ => {}
    }
    let several = cfg!(target_os = "linux")
        && kernel_release().is_some_and(|(major, minor)| (major, minor) >= (6, 17));
    ANSWER.store(1 + u8::from(several), Ordering::Relaxed);
    several
}

/// The running kernel's major and minor version (`uname`'s release, "6.17.0-…").
fn kernel_release() -> Option<(u32, u32)> {
    // SAFETY: `utsname` is plain bytes, valid zeroed, filled by the call.
    let mut name: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: a valid, writable utsname.
    if unsafe { libc::uname(&mut name) } != 0 {
        return None;
    }
    let release: Vec<u8> = name
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    parse_release(std::str::from_utf8(&release).ok()?)
}

/// "6.17.0-rc1" → (6, 17).
fn parse_release(release: &str) -> Option<(u32, u32)> {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
}

/// Unmaps `ptr..ptr+len` (the length is rounded up to whole pages, as the kernel does).
///
/// Fails with [`Error::InvalidRange`] for an empty or misaligned range, [`Error::Syscall`]
/// (`call: "munmap"`) if the kernel refuses.
///
/// # Safety
///
/// `ptr..ptr+len` must be (part of) a mapping this crate created with [`map_anonymous`], and no
/// reference or pointer into it may be used afterwards.
pub unsafe fn unmap(ptr: NonNull<u8>, len: usize) -> Result<()> {
    check_range(ptr, len)?;
    // SAFETY: the caller guarantees the range is our mapping and no longer used.
    if unsafe { libc::munmap(ptr.as_ptr().cast(), len) } != 0 {
        return Err(Error::Syscall {
            call: "munmap",
            errno: errno(),
        });
    }
    Ok(())
}

/// Asks for transparent huge pages on `ptr..ptr+len` (`madvise(MADV_HUGEPAGE)`).
///
/// Errors: [`Error::InvalidRange`] for an empty or misaligned range, [`Error::Syscall`]
/// (`call: "madvise(MADV_HUGEPAGE)"`) otherwise, e.g. EINVAL on a kernel without THP.
///
/// # Safety
///
/// `ptr..ptr+len` must be a mapping this crate created with [`map_anonymous`] that nobody else
/// uses.
pub unsafe fn advise_hugepage(ptr: NonNull<u8>, len: usize) -> Result<()> {
    let advice: c_int = linux_only!(libc::MADV_HUGEPAGE).map_err(|errno| Error::Syscall {
        call: "madvise(MADV_HUGEPAGE)",
        errno,
    })?;
    // SAFETY: MADV_HUGEPAGE only changes how later faults are served, not the content; the
    // caller guarantees the range is ours.
    unsafe { advise(ptr, len, advice, "madvise(MADV_HUGEPAGE)") }
}

/// Asks for small pages only on `ptr..ptr+len` (`madvise(MADV_NOHUGEPAGE)`), so that touching a
/// few pages never makes a whole 2 MiB huge page resident (with THP `enabled=always`).
///
/// Errors: [`Error::InvalidRange`] for an empty or misaligned range, [`Error::Syscall`]
/// (`call: "madvise(MADV_NOHUGEPAGE)"`) otherwise, e.g. EINVAL on a kernel without THP.
///
/// # Safety
///
/// `ptr..ptr+len` must be a mapping this crate created with [`map_anonymous`] that nobody else
/// uses.
pub unsafe fn advise_nohugepage(ptr: NonNull<u8>, len: usize) -> Result<()> {
    let advice: c_int = linux_only!(libc::MADV_NOHUGEPAGE).map_err(|errno| Error::Syscall {
        call: "madvise(MADV_NOHUGEPAGE)",
        errno,
    })?;
    // SAFETY: MADV_NOHUGEPAGE only changes how later faults are served, not the content; the
    // caller guarantees the range is ours.
    unsafe { advise(ptr, len, advice, "madvise(MADV_NOHUGEPAGE)") }
}

/// Gives the pages of `ptr..ptr+len` back to the kernel (`madvise(MADV_DONTNEED)`).
///
/// The mapping and its memory policy stay; the next access faults in fresh zeroed pages under
/// that policy. Errors: [`Error::InvalidRange`] for an empty or misaligned range,
/// [`Error::Syscall`] (`call: "madvise(MADV_DONTNEED)"`) otherwise (EINVAL: part of the range is
/// locked, by `mlock` or `mlockall`).
///
/// # Safety
///
/// `ptr..ptr+len` must be a private anonymous mapping this crate created with [`map_anonymous`]
/// whose content nobody needs any more: it reads as zeros afterwards. It must not be registered
/// (page-locked) with CUDA, whose device mappings would keep pointing at the old pages.
pub unsafe fn advise_dontneed(ptr: NonNull<u8>, len: usize) -> Result<()> {
    // Tests make purges fail as on locked memory (never compiled without the feature).
    #[cfg(feature = "fault-injection")]
    {
        check_range(ptr, len)?;
        if let Some(errno) = fault::injected(fault::FaultPoint::Purge) {
            return Err(Error::Syscall {
                call: "madvise(MADV_DONTNEED)",
                errno,
            });
        }
    }
    // SAFETY: the caller guarantees the range is ours and its content is no longer needed.
    unsafe { advise(ptr, len, libc::MADV_DONTNEED, "madvise(MADV_DONTNEED)") }
}

/// `madvise(advice)` on a checked range.
///
/// # Safety
///
/// The caller guarantees that `advice` is harmless for `ptr..ptr+len` (see the public wrappers).
unsafe fn advise(ptr: NonNull<u8>, len: usize, advice: c_int, call: &'static str) -> Result<()> {
    check_range(ptr, len)?;
    // SAFETY: forwarded from the caller; the range was checked to be page-aligned and non-empty.
    if unsafe { libc::madvise(ptr.as_ptr().cast(), len, advice) } != 0 {
        return Err(Error::Syscall {
            call,
            errno: errno(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_release;

    #[test]
    fn kernel_releases_parse_to_major_and_minor() {
        assert_eq!(parse_release("6.17.0-rc1"), Some((6, 17)));
        assert_eq!(parse_release("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(parse_release("6.8"), Some((6, 8)));
        assert_eq!(parse_release("unknown"), None);
    }
}
