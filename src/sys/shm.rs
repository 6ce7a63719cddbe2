//! Memory several processes map: memory files ([`memfd`]), shared mappings of a file
//! ([`map_shared`], [`map_in`], [`remove_pages`]), what a file lives on ([`on_hugetlbfs`]), file
//! descriptors passed over a Unix socket ([`send_fd`], [`recv_fd`], `SCM_RIGHTS`), whether a
//! process still exists ([`process_alive`]), who owns a file and who may use it
//! ([`file_owner`], [`access_mode`], [`effective_uid`]), free space ([`free_bytes`]), close-on-exec
//! ([`set_cloexec`]) and random ids ([`random_u32`]). A shared pool's locks are `pool_lock.rs`'s.
//!
//! Unsafe code here relies on the raw calls themselves: each wrapper checks what it is given,
//! owns the descriptors it makes, and the callers of the `unsafe fn`s own the memory they pass.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::{self, NonNull};

use super::{errno, page_size};
use crate::{Error, Result};

fn syscall(call: &'static str) -> Error {
    Error::Syscall {
        call,
        errno: errno(),
    }
}

/// A new memory file (`memfd_create`, close-on-exec unless `inherit`: a descriptor without it
/// survives `exec` into any program), of 2 MiB huge pages (`MFD_HUGETLB | MFD_HUGE_2MB`,
/// whatever the system's default huge page size) when `huge`; sealing allowed, for
/// [`seal_size`].
pub fn memfd(name: &CStr, huge: bool, inherit: bool) -> Result<OwnedFd> {
    let mut flags = libc::MFD_ALLOW_SEALING;
    if !inherit {
        flags |= libc::MFD_CLOEXEC;
    }
    if huge {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: `name` is a valid C string; the call touches no memory of ours besides it.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(syscall("memfd_create"));
    }
    // SAFETY: a descriptor just made, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Seals the size of a memory file made by [`memfd`] (`F_ADD_SEALS`: `F_SEAL_SHRINK`,
/// `F_SEAL_GROW`, then `F_SEAL_SEAL` so that nobody lifts them): another process holding the
/// descriptor can no longer truncate it under every process that maps it (which would end each
/// in `SIGBUS`), nor grow it. Memory files of huge pages take these seals too (hugetlbfs
/// supports them since Linux 4.16; on 6.18 the seals are added and a shrink is refused with
/// `EPERM`, as for other memory files).
pub fn seal_size(fd: BorrowedFd<'_>) -> Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on a descriptor we hold touches no memory.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(syscall("fcntl(F_ADD_SEALS)"));
    }
    Ok(())
}

/// Maps bytes `0..len` of `fd` shared (`MAP_SHARED`, readable and writable) at a multiple of
/// `align` (a power of two, at least the page size): an address range is reserved
/// (`PROT_NONE`, anonymous), the file mapped over its aligned part, the slack given back.
/// Nothing is populated.
pub fn map_shared(fd: BorrowedFd<'_>, len: usize, align: usize) -> Result<NonNull<u8>> {
    let bad = Error::InvalidRange { addr: 0, len };
    if len == 0 || !len.is_multiple_of(page_size()) || !align.is_power_of_two() {
        return Err(bad);
    }
    let total = len
        .checked_add(align)
        .ok_or(Error::InvalidRange { addr: 0, len })?;
    // SAFETY: an anonymous reservation at an address of the kernel's choosing touches no
    // existing memory.
    let base = unsafe {
        libc::mmap(
            ptr::null_mut(),
            total,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(syscall("mmap"));
    }
    let start = (base as usize).next_multiple_of(align);
    // SAFETY: start..start+len lies inside the reservation just made, which nobody else knows.
    let mapped = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    let outcome = if mapped == libc::MAP_FAILED {
        Err(syscall("mmap"))
    } else {
        Ok(())
    };
    let head = start - base as usize;
    let tail = total - head - len;
    // SAFETY: the slack before and after the file's mapping is the rest of our reservation (all
    // of it when the file's mapping failed).
    unsafe {
        if outcome.is_err() {
            libc::munmap(base, total);
        } else {
            if head != 0 {
                libc::munmap(base, head);
            }
            if tail != 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
    }
    outcome?;
    NonNull::new(start as *mut u8).ok_or(bad)
}

/// Maps the pages a shared mapping's file already has into the page tables
/// (`madvise(MADV_POPULATE_READ)`, Linux ≥ 5.14; older kernels leave them to fault in).
///
/// # Safety
/// `ptr..ptr+len` is a shared file mapping of the caller's, mapped while this runs.
pub unsafe fn map_in(ptr: NonNull<u8>, len: usize) -> Result<()> {
    // libc has it only in later versions than Cargo.toml allows.
    const MADV_POPULATE_READ: libc::c_int = 22;
    // SAFETY: the caller's mapping; reading faults in existing pages and changes no content.
    if unsafe { libc::madvise(ptr.as_ptr().cast(), len, MADV_POPULATE_READ) } != 0 {
        return Err(syscall("madvise(MADV_POPULATE_READ)"));
    }
    Ok(())
}

/// Drops the pages of `ptr..ptr+len` from a shared mapping's file (`madvise(MADV_REMOVE)`:
/// tmpfs, memory files and hugetlbfs free them): they read as zero afterwards, in every process
/// that maps the file.
///
/// # Safety
/// `ptr..ptr+len` is a shared file mapping of the caller's (whole pages), whose content nobody in
/// any process needs any more, and that is not registered with CUDA.
pub unsafe fn remove_pages(ptr: NonNull<u8>, len: usize) -> Result<()> {
    if len == 0 || !len.is_multiple_of(page_size()) {
        return Err(Error::InvalidRange {
            addr: ptr.as_ptr() as usize,
            len,
        });
    }
    // SAFETY: the caller's mapping, whose content nobody needs (forwarded).
    if unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_REMOVE) } != 0 {
        return Err(syscall("madvise(MADV_REMOVE)"));
    }
    Ok(())
}

/// How a descriptor was opened (`fcntl(F_GETFL)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `O_RDWR`: what a writable shared mapping needs.
    ReadWrite,
    /// `O_RDONLY`.
    ReadOnly,
    /// `O_WRONLY`: not even readable.
    WriteOnly,
    /// `O_PATH`: names the file, neither reads nor writes it.
    PathOnly,
}

/// How `fd` was opened.
pub fn access_mode(fd: BorrowedFd<'_>) -> Result<Access> {
    // SAFETY: F_GETFL on a descriptor we hold touches no memory.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(syscall("fcntl(F_GETFL)"));
    }
    Ok(if flags & libc::O_PATH != 0 {
        Access::PathOnly
    } else {
        match flags & libc::O_ACCMODE {
            libc::O_RDWR => Access::ReadWrite,
            libc::O_WRONLY => Access::WriteOnly,
            _ => Access::ReadOnly,
        }
    })
}

/// Who owns `fd`'s file, its permission bits (`st_mode & 0o7777`), and whether it is a regular
/// file (`fstat`; works on an `O_PATH` descriptor too).
pub fn file_owner(fd: BorrowedFd<'_>) -> Result<(u32, u32, bool)> {
    let mut st = MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: `st` is a writable stat the call fills.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(syscall("fstat"));
    }
    // SAFETY: filled by the successful call (and zeroed before).
    let st = unsafe { st.assume_init() };
    let regular = st.st_mode & libc::S_IFMT == libc::S_IFREG;
    Ok((st.st_uid, st.st_mode & 0o7777, regular))
}

/// This process's effective user id: whose files it trusts.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// Bytes free to this process on `fd`'s filesystem (`fstatvfs`: `f_bavail * f_frsize`); `None`
/// for one without a size (a memory file's internal mount reports no blocks).
pub fn free_bytes(fd: BorrowedFd<'_>) -> Result<Option<u64>> {
    let mut st = MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `st` is a writable statvfs the call fills.
    if unsafe { libc::fstatvfs(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(syscall("fstatvfs"));
    }
    // SAFETY: filled by the successful call (and zeroed before).
    let st = unsafe { st.assume_init() };
    Ok((st.f_blocks != 0).then(|| st.f_bavail.saturating_mul(st.f_frsize)))
}

/// Sets or clears `fd`'s close-on-exec flag (`FD_CLOEXEC`).
pub fn set_cloexec(fd: BorrowedFd<'_>, on: bool) -> Result<()> {
    let flag = if on { libc::FD_CLOEXEC } else { 0 };
    // SAFETY: F_SETFD on a descriptor we hold touches no memory.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, flag) } != 0 {
        return Err(syscall("fcntl(F_SETFD)"));
    }
    Ok(())
}

/// A random number from the kernel (`getrandom`), nonzero.
pub fn random_u32() -> Result<u32> {
    let mut bytes = [0u8; 4];
    loop {
        // SAFETY: writes at most 4 bytes into `bytes`, which we own.
        let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
        if got == 4 && bytes != [0; 4] {
            return Ok(u32::from_ne_bytes(bytes));
        }
        if got < 0 && errno() != libc::EINTR {
            return Err(syscall("getrandom"));
        }
    }
}

/// Whether `fd` lives on a hugetlbfs mount (or is a `MFD_HUGETLB` memory file), by `fstatfs`.
pub fn on_hugetlbfs(fd: BorrowedFd<'_>) -> Result<bool> {
    let mut st = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `st` is a writable statfs the call fills.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(syscall("fstatfs"));
    }
    // SAFETY: filled by the successful call (and zeroed before).
    let st = unsafe { st.assume_init() };
    Ok(st.f_type == libc::HUGETLBFS_MAGIC)
}

/// Room for one descriptor's control message.
#[repr(C)]
union FdMessage {
    bytes: [u8; 64],
    _align: libc::cmsghdr,
}

/// Sends `fd` over the Unix socket `socket` (`sendmsg`, `SCM_RIGHTS`, one byte of data).
pub fn send_fd(socket: BorrowedFd<'_>, fd: BorrowedFd<'_>) -> Result<()> {
    let mut byte = [b'p'];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = FdMessage { bytes: [0; 64] };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as usize;
    // SAFETY: zero is a valid msghdr (null pointers, zero lengths), filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ptr::addr_of_mut!(control).cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer is 64 bytes, aligned for a cmsghdr, and holds one message of
    // one descriptor (CMSG_SPACE(4) = 24); CMSG_FIRSTHDR of it is its start.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
        ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
    }
    loop {
        // SAFETY: `msg` points at live buffers of the sizes it names.
        if unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) } >= 0 {
            return Ok(());
        }
        if errno() != libc::EINTR {
            return Err(syscall("sendmsg"));
        }
    }
}

/// Receives a descriptor [`send_fd`] sent over `socket` (`recvmsg`, close-on-exec).
///
/// # Errors
/// [`Error::FdNotReceived`] when the message carried no descriptor, more than one, or was cut
/// short (`MSG_CTRUNC`); every descriptor that did arrive is closed.
pub fn recv_fd(socket: BorrowedFd<'_>) -> Result<OwnedFd> {
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = FdMessage { bytes: [0; 64] };
    // SAFETY: zero is a valid msghdr, filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ptr::addr_of_mut!(control).cast();
    msg.msg_controllen = size_of::<FdMessage>() as _;
    loop {
        // SAFETY: `msg` points at live, writable buffers of the sizes it names.
        let got = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if got > 0 {
            break;
        }
        if got == 0 {
            return Err(Error::Syscall {
                call: "recvmsg",
                errno: libc::ECONNRESET,
            });
        }
        if errno() != libc::EINTR {
            return Err(syscall("recvmsg"));
        }
    }
    // Every descriptor that came, owned (closed on drop) before anything is decided: the
    // 64-byte buffer holds at most 12.
    let mut fds: [Option<OwnedFd>; 12] = Default::default();
    let mut count = 0;
    // SAFETY: the kernel filled the control buffer `msg` points at; CMSG_FIRSTHDR and
    // CMSG_NXTHDR walk the messages inside it, each SCM_RIGHTS one holding
    // `(cmsg_len - CMSG_LEN(0)) / 4` descriptors this process now owns.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let bytes = ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                for i in 0..bytes / size_of::<libc::c_int>() {
                    let fd = OwnedFd::from_raw_fd(ptr::read_unaligned(data.add(i)));
                    if let Some(slot) = fds.get_mut(count) {
                        *slot = Some(fd);
                    }
                    count += 1;
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    let reason = if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        "the control message was cut short (MSG_CTRUNC: this process may be at its open-file \
         limit, RLIMIT_NOFILE, or more descriptors were sent than fit), and the descriptors \
         that did arrive were closed; raise the limit, or send one descriptor"
    } else if count > 1 {
        "the message carried more than one descriptor (all were closed); send one, as \
         SharedPool::send does"
    } else {
        match fds[0].take() {
            Some(fd) => return Ok(fd),
            None => "the message carried no descriptor; send it with SharedPool::send",
        }
    };
    Err(Error::FdNotReceived { reason })
}

/// Whether process `pid` exists (`kill(pid, 0)`; one of another user's counts as existing).
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0 && (unsafe { libc::kill(pid, 0) } == 0 || errno() == libc::EPERM)
}

/// This process's id.
pub fn process_id() -> u32 {
    std::process::id()
}
