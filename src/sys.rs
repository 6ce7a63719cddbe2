//! Raw placement syscalls: `mmap`, `mremap`, `mbind`, `madvise`, `move_pages`, `getcpu`; and the
//! allocator's `futex` and `pthread_atfork` calls.
//!
//! This is the only module of the crate that makes these calls (see the design notes). Everything
//! here runs inside a memory allocator, so nothing allocates on the heap, nothing panics, and errno
//! is read without building an [`std::io::Error`] payload (an `Os` error is just an integer).
//!
//! The pipeline is [`map_anonymous`] → [`bind`] → [`populate`]. Never map with `MAP_POPULATE`:
//! pages faulted in before `mbind` sets the policy stay on whichever node the faulting CPU chose.
//! [`page_nodes`] and [`census`] check afterwards where the pages really are.
//!
//! Unsafe code here relies on the raw calls themselves: each wrapper checks its range and documents
//! what the caller must own.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_long, c_void};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, AtomicU8, AtomicUsize, Ordering};

use crate::{Error, Result};

/// Largest node id + 1 that a [`NodeMask`] can hold (the kernel's `MAX_NUMNODES` on distributions
/// built with `NODES_SHIFT=10`).
pub const MAX_NODES: usize = 1024;

const MASK_WORDS: usize = MAX_NODES / 64;

/// `maxnode` argument of `mbind` and `get_mempolicy`: the kernel reads `maxnode - 1` bits, so one more than the mask has.
const MBIND_MAXNODE: usize = 64 * MASK_WORDS + 1;

// Constants the libc crate lacks (values from include/uapi/linux/mempolicy.h and mman-common.h,
// identical on every Linux architecture).
const MPOL_PREFERRED: c_int = 1;
const MPOL_BIND: c_int = 2;
const MPOL_INTERLEAVE: c_int = 3;
const MPOL_MF_STRICT: u32 = 1;
const MPOL_F_MEMS_ALLOWED: libc::c_ulong = 4;
const MPOL_MF_MOVE: u32 = 2;
// libc only has it from 0.2.171 on; Cargo.toml allows 0.2.170.
const MADV_POPULATE_WRITE: c_int = 23;

const POPULATE_CALL: &str = "madvise(MADV_POPULATE_WRITE)";

/// Move_pages batch size: bounded so the address and status arrays fit on the stack (6 KiB).
const MOVE_PAGES_CHUNK: usize = 512;

/// Bitmask of node ids for `mbind`, of fixed size so that building one never allocates.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NodeMask {
    words: [u64; MASK_WORDS],
}

impl NodeMask {
    /// A mask with no node.
    pub const fn empty() -> Self {
        NodeMask {
            words: [0; MASK_WORDS],
        }
    }

    /// A mask with only `node`.
    ///
    /// Fails with [`Error::UnknownNode`] when `node >= MAX_NODES`.
    pub fn single(node: usize) -> Result<Self> {
        let mut mask = Self::empty();
        mask.insert(node)?;
        Ok(mask)
    }

    /// A mask with every node of `nodes` (an empty slice gives an empty mask).
    ///
    /// Fails with [`Error::UnknownNode`] for the first id `>= MAX_NODES`.
    pub fn from_nodes(nodes: &[usize]) -> Result<Self> {
        let mut mask = Self::empty();
        for &node in nodes {
            mask.insert(node)?;
        }
        Ok(mask)
    }

    /// Adds `node`; fails with [`Error::UnknownNode`] when `node >= MAX_NODES`.
    pub fn insert(&mut self, node: usize) -> Result<()> {
        if node >= MAX_NODES {
            return Err(Error::UnknownNode {
                node,
                node_count: MAX_NODES,
            });
        }
        self.words[node / 64] |= 1 << (node % 64);
        Ok(())
    }

    /// Whether `node` is in the mask (always false for ids `>= MAX_NODES`).
    pub fn contains(&self, node: usize) -> bool {
        node < MAX_NODES && self.words[node / 64] & (1 << (node % 64)) != 0
    }

    /// Whether the mask has no node.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The node ids in the mask, in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let bit = rest.trailing_zeros() as usize;
                rest &= rest - 1; // clear the lowest set bit
                Some(i * 64 + bit)
            })
        })
    }
}

impl Default for NodeMask {
    fn default() -> Self {
        Self::empty()
    }
}

impl std::fmt::Debug for NodeMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeMask ")?;
        f.debug_set().entries(self.iter()).finish()
    }
}

/// The `mbind` mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum MemPolicy {
    /// `MPOL_PREFERRED`: allocate on the (first) node of the mask, fall back to others when it is
    /// full (the default).
    #[default]
    Preferred,
    /// `MPOL_BIND`: allocate only on the mask's nodes. An exhausted node means ENOMEM from
    /// [`populate`], or the OOM killer / SIGBUS at a later fault.
    Bind,
    /// `MPOL_INTERLEAVE`: spread pages round-robin over the mask's nodes.
    Interleave,
}

impl MemPolicy {
    fn mode(self) -> c_int {
        match self {
            MemPolicy::Preferred => MPOL_PREFERRED,
            MemPolicy::Bind => MPOL_BIND,
            MemPolicy::Interleave => MPOL_INTERLEAVE,
        }
    }
}

/// `mbind` flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MbindFlags {
    /// `MPOL_MF_STRICT`: fail with EIO if a page already present does not follow the policy
    /// (or, with `move_existing`, could not be moved).
    pub strict: bool,
    /// `MPOL_MF_MOVE`: migrate pages already present (and mapped only by this process) to follow
    /// the policy.
    pub move_existing: bool,
}

impl MbindFlags {
    fn bits(self) -> u32 {
        (if self.strict { MPOL_MF_STRICT } else { 0 })
            | (if self.move_existing { MPOL_MF_MOVE } else { 0 })
    }
}

/// How [`populate`] faulted the pages in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PopulateMethod {
    /// `madvise(MADV_POPULATE_WRITE)` (Linux ≥ 5.14).
    MadvisePopulateWrite,
    /// One volatile zero-byte write per page (older kernels).
    TouchPages,
}

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

/// The system page size, from `sysconf(_SC_PAGESIZE)` on first use, then cached.
pub fn page_size() -> usize {
    static PAGE_SIZE: AtomicUsize = AtomicUsize::new(0);
    let cached = PAGE_SIZE.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    // sysconf cannot fail for _SC_PAGESIZE on Linux; 4 KiB keeps us going if it ever does.
    let size = if size > 0 { size as usize } else { 4096 };
    // Races are harmless: every thread stores the same value.
    PAGE_SIZE.store(size, Ordering::Relaxed);
    size
}

/// The calling thread's errno, without allocating (an `Os` io::Error holds just the number).
fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// EPERM (seccomp) and ENOSYS (kernel without NUMA) mean "no NUMA here"; callers fall back.
fn numa_error(call: &'static str, errno: i32) -> Error {
    if errno == libc::EPERM || errno == libc::ENOSYS {
        Error::NumaUnavailable { call, errno }
    } else {
        Error::Syscall { call, errno }
    }
}

/// Checks that `ptr..ptr+len` is non-empty, starts on a page boundary and does not wrap.
fn check_range(ptr: NonNull<u8>, len: usize) -> Result<usize> {
    let addr = ptr.as_ptr() as usize;
    let ps = page_size();
    if len == 0 || !addr.is_multiple_of(ps) || addr.checked_add(len).is_none() {
        return Err(Error::InvalidRange { addr, len });
    }
    // The kernel rounds a partial last page up, so do we.
    Ok(len.div_ceil(ps))
}

/// Maps `len` bytes of fresh, zeroed, private anonymous memory aligned to `align`.
///
/// The mapping is readable and writable and has no pages yet (never `MAP_POPULATE`: pages must
/// be faulted in only after [`bind`] has set the policy). `len` must be a non-zero multiple of
/// [`page_size`] and `align` a power of two; alignments above the page size (up to 1 GiB and
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
/// Fails with [`Error::InvalidRange`] for an empty or misaligned range, [`Error::Syscall`]
/// (`call: "mremap"`) if the kernel refuses; then both ranges are as they were.
///
/// # Safety
///
/// Both ranges must be mappings this crate created with [`map_anonymous`], must not overlap, and
/// nothing may use either while this runs; afterwards `from..from+len` must not be used.
pub unsafe fn move_mapping(from: NonNull<u8>, to: NonNull<u8>, len: usize) -> Result<()> {
    check_range(from, len)?;
    check_range(to, len)?;
    // SAFETY: the caller guarantees both ranges are our mappings and unused; FIXED replaces only
    // the caller's own range at `to`.
    let moved = unsafe {
        libc::mremap(
            from.as_ptr().cast(),
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to.as_ptr().cast::<c_void>(),
        )
    };
    if moved == libc::MAP_FAILED {
        return Err(Error::Syscall {
            call: "mremap",
            errno: errno(),
        });
    }
    Ok(())
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

/// Sets the memory policy of `ptr..ptr+len` with `mbind(2)`.
///
/// Pages faulted in afterwards follow the policy; pages already present move only with
/// [`MbindFlags::move_existing`]. For [`MemPolicy::Preferred`] the kernel uses the first node of
/// the mask (an empty mask means "the faulting CPU's node").
///
/// Errors: [`Error::InvalidRange`] for an empty, misaligned or wrapping range (checked before the
/// call); [`Error::NumaUnavailable`] for EPERM/ENOSYS (seccomp, kernel without NUMA);
/// [`Error::Syscall`] (`call: "mbind"`) otherwise — EINVAL for a node that does not exist or an
/// empty mask with `Bind`/`Interleave`, EFAULT or ENOMEM for a range that is not mapped, EIO for a
/// `strict` violation.
///
/// # Safety
///
/// `ptr..ptr+len` must be a mapping this crate created (with [`map_anonymous`]) that nobody else
/// uses: with `move_existing` the kernel migrates its pages, and a policy change affects every
/// later fault in the range.
pub unsafe fn bind(
    ptr: NonNull<u8>,
    len: usize,
    policy: MemPolicy,
    nodes: &NodeMask,
    flags: MbindFlags,
) -> Result<()> {
    check_range(ptr, len)?;
    if let Some(errno) = fault::injected(fault::FaultPoint::Mbind) {
        return Err(numa_error("mbind", errno));
    }
    // SAFETY: the mask points to MASK_WORDS u64s = MBIND_MAXNODE - 1 bits, exactly what the
    // kernel reads; the caller guarantees the range is ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr.as_ptr() as usize,
            len,
            policy.mode() as c_long,
            nodes.words.as_ptr(),
            MBIND_MAXNODE,
            flags.bits() as c_long,
        )
    };
    if rc != 0 {
        return Err(numa_error("mbind", errno()));
    }
    Ok(())
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
/// `ptr..ptr+len` must be a writable mapping this crate created with [`map_anonymous`], that
/// nobody else uses, and whose content is still all zeros (the fallback writes zeros).
pub unsafe fn populate(ptr: NonNull<u8>, len: usize) -> Result<PopulateMethod> {
    let pages = check_range(ptr, len)?;
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
        let mut result = match fault::injected(fault::FaultPoint::Populate) {
            Some(errno) => Err(errno),
            None => madvise_populate_write(ptr, len),
        };
        // EINTR: a signal arrived while faulting; what was populated stays, so just retry.
        let mut retries = 0;
        while result == Err(libc::EINTR) && retries < 16 {
            retries += 1;
            result = madvise_populate_write(ptr, len);
        }
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
    // SAFETY: MADV_HUGEPAGE only changes how later faults are served, not the content; the
    // caller guarantees the range is ours.
    unsafe { advise(ptr, len, libc::MADV_HUGEPAGE, "madvise(MADV_HUGEPAGE)") }
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
    // SAFETY: MADV_NOHUGEPAGE only changes how later faults are served, not the content; the
    // caller guarantees the range is ours.
    unsafe { advise(ptr, len, libc::MADV_NOHUGEPAGE, "madvise(MADV_NOHUGEPAGE)") }
}

/// Gives the pages of `ptr..ptr+len` back to the kernel (`madvise(MADV_DONTNEED)`).
///
/// The mapping and its memory policy stay; the next access faults in fresh zeroed pages under
/// that policy. Errors: [`Error::InvalidRange`] for an empty or misaligned range,
/// [`Error::Syscall`] (`call: "madvise(MADV_DONTNEED)"`) otherwise.
///
/// # Safety
///
/// `ptr..ptr+len` must be a private anonymous mapping this crate created with [`map_anonymous`]
/// whose content nobody needs any more: it reads as zeros afterwards. It must not be registered
/// (page-locked) with CUDA, whose device mappings would keep pointing at the old pages.
pub unsafe fn advise_dontneed(ptr: NonNull<u8>, len: usize) -> Result<()> {
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
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0 as c_long, // this process
                n as libc::c_ulong,
                addrs.as_ptr(),
                ptr::null::<c_int>(),
                status.as_mut_ptr(),
                0 as c_long,
            )
        };
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

/// The memory nodes this process may allocate from (`get_mempolicy(MPOL_F_MEMS_ALLOWED)`): a
/// cgroup cpuset (`docker run --cpuset-mems`, Slurm, Kubernetes) can exclude the GPU's node, and
/// `mbind` to an excluded node fails with EINVAL.
///
/// Errors: [`Error::NumaUnavailable`] (`call: "get_mempolicy"`) for EPERM/ENOSYS,
/// [`Error::Syscall`] otherwise.
pub fn allowed_memory_nodes() -> Result<NodeMask> {
    let mut mask = NodeMask::empty();
    // SAFETY: the mask is valid for writes of MBIND_MAXNODE - 1 bits (its whole size); mode and
    // addr may be NULL with MPOL_F_MEMS_ALLOWED.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            ptr::null_mut::<c_int>(),
            mask.words.as_mut_ptr(),
            MBIND_MAXNODE,
            ptr::null_mut::<c_void>(),
            MPOL_F_MEMS_ALLOWED,
        )
    };
    if rc != 0 {
        return Err(numa_error("get_mempolicy", errno()));
    }
    Ok(mask)
}

/// The NUMA node of the CPU the calling thread runs on right now (`getcpu(2)`).
///
/// The thread may migrate right after; use it as a hint. Errors: [`Error::NumaUnavailable`]
/// (`call: "getcpu"`) for EPERM/ENOSYS, [`Error::Syscall`] otherwise.
pub fn current_node() -> Result<usize> {
    let mut cpu: libc::c_uint = 0;
    let mut node: libc::c_uint = 0;
    // SAFETY: cpu and node are valid for writes; the third argument (tcache) is unused and may
    // be NULL.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu as *mut libc::c_uint,
            &mut node as *mut libc::c_uint,
            ptr::null_mut::<c_void>(),
        )
    };
    if rc != 0 {
        return Err(numa_error("getcpu", errno()));
    }
    Ok(node as usize)
}

/// Sleeps while `word` holds `expected` (`FUTEX_WAIT_PRIVATE`, no timeout). Returns on a wake-up,
/// a signal, or at once when the value already differs: callers re-check in a loop.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: the kernel only reads the aligned u32 behind `word`, which outlives the call; the
    // null timeout means "no timeout" and the two unused arguments are ignored for FUTEX_WAIT.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            ptr::null::<libc::timespec>(),
        )
    };
}

/// Wakes one thread sleeping in [`futex_wait`] on `word` (`FUTEX_WAKE_PRIVATE`).
pub(crate) fn futex_wake_one(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; `word` is a live, aligned u32.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1,
        )
    };
}

/// Wakes every thread sleeping in [`futex_wait`] on `word`.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; `word` is a live, aligned u32.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        )
    };
}

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

/// Fault injection for tests (feature `fault-injection`; never enable it in production).
///
/// An injected fault stands in for the kernel's answer, after argument checks: the function
/// returns exactly what it would if the syscall had failed with that errno (so an injected EPERM
/// into [`bind`] gives [`Error::NumaUnavailable`], an injected EINVAL into a first
/// [`populate`] falls back to touching pages). Faults are process-wide and
/// thread-safe (one atomic per point); tests that inject must serialise with every other test of
/// their binary that reaches these calls.
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod fault {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    /// A syscall site that can be made to fail.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum FaultPoint {
        /// The `mmap` of [`map_anonymous`](super::map_anonymous).
        Mmap,
        /// The `mbind` of [`bind`](super::bind).
        Mbind,
        /// The `madvise(MADV_POPULATE_WRITE)` of [`populate`](super::populate).
        Populate,
        /// The `move_pages` of [`page_nodes`](super::page_nodes) (first batch).
        MovePages,
        /// The CUDA registration (`cuMemHostRegister_v2`) of a chunk or a dedicated block. The
        /// injected value is the `CUresult` code. A chunk meets it where it would be registered
        /// (a GPU targeted, pinning on); a dedicated block wherever pinning is on, even without
        /// a GPU (not checked with `pin=off`, which never registers).
        Register,
    }

    // Per point: errno in the high 32 bits, remaining count in the low 32, so that one
    // compare-exchange reads and consumes both consistently.
    static FAULTS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

    fn slot(point: FaultPoint) -> &'static AtomicU64 {
        &FAULTS[point as usize]
    }

    /// Makes the next `count` calls at `point` fail with `errno` (`u32::MAX`: until [`clear`]).
    /// Replaces any fault pending at that point; `count == 0` removes it.
    pub fn inject(point: FaultPoint, errno: i32, count: u32) {
        slot(point).store(
            (u64::from(errno as u32) << 32) | u64::from(count),
            Ordering::SeqCst,
        );
    }

    /// Removes every pending fault and forgets which populate method works, so the next
    /// [`populate`](super::populate) probes `MADV_POPULATE_WRITE` again.
    pub fn clear() {
        for f in &FAULTS {
            f.store(0, Ordering::SeqCst);
        }
        super::POPULATE_METHOD.store(super::METHOD_UNKNOWN, Ordering::Relaxed);
    }

    /// How many calls at `point` will still fail (`u32::MAX`: until cleared).
    pub fn remaining(point: FaultPoint) -> u32 {
        slot(point).load(Ordering::SeqCst) as u32
    }

    static IGNORE_IN_FLIGHT: AtomicBool = AtomicBool::new(false);

    /// Makes frees ignore GPU work recorded against a block, so that it is cached (and reused) at
    /// once: stream-ordered reuse switched off, for tests that show they catch the bug. Process-wide;
    /// [`clear`] does not reset it.
    pub fn ignore_in_flight(on: bool) {
        IGNORE_IN_FLIGHT.store(on, Ordering::SeqCst);
    }

    /// Whether [`ignore_in_flight`] is on.
    pub(crate) fn in_flight_ignored() -> bool {
        IGNORE_IN_FLIGHT.load(Ordering::SeqCst)
    }

    /// Consumes one pending fault at `point`, returning its errno.
    pub(crate) fn injected(point: FaultPoint) -> Option<i32> {
        let slot = slot(point);
        let mut cur = slot.load(Ordering::SeqCst);
        loop {
            let count = cur as u32;
            let errno = (cur >> 32) as u32 as i32;
            if count == 0 {
                return None;
            }
            if count == u32::MAX {
                return Some(errno);
            }
            match slot.compare_exchange_weak(cur, cur - 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Some(errno),
                Err(now) => cur = now,
            }
        }
    }
}

/// Without the feature nothing is ever injected, and the checks compile away.
#[cfg(not(feature = "fault-injection"))]
pub(crate) mod fault {
    #[derive(Clone, Copy)]
    pub(super) enum FaultPoint {
        Mmap,
        Mbind,
        Populate,
        MovePages,
    }

    #[inline(always)]
    pub(super) fn injected(_point: FaultPoint) -> Option<i32> {
        None
    }

    #[inline(always)]
    pub(crate) fn in_flight_ignored() -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_may_use_node_zero() {
        let allowed = allowed_memory_nodes().expect("get_mempolicy");
        assert!(allowed.contains(0));
    }

    #[test]
    fn mbind_maxnode_covers_the_whole_mask() {
        // The kernel reads maxnode - 1 bits: exactly the mask's bits, no more.
        assert_eq!(MBIND_MAXNODE - 1, std::mem::size_of::<NodeMask>() * 8);
        assert_eq!(MBIND_MAXNODE - 1, MAX_NODES);
    }

    #[test]
    fn node_bits_land_in_the_kernel_layout() {
        // Bit n of the mask is bit n % 64 of word n / 64 (unsigned long array, as the kernel
        // reads it on 64-bit targets).
        let mask = NodeMask::from_nodes(&[0, 63, 64, 1023]).unwrap();
        assert_eq!(mask.words[0], 1 | 1 << 63);
        assert_eq!(mask.words[1], 1);
        assert_eq!(mask.words[15], 1 << 63);
        assert!(mask.words[2..15].iter().all(|&w| w == 0));
    }

    #[test]
    fn flags_and_modes() {
        assert_eq!(MbindFlags::default().bits(), 0);
        let both = MbindFlags {
            strict: true,
            move_existing: true,
        };
        assert_eq!(both.bits(), 3);
        assert_eq!(MemPolicy::Preferred.mode(), 1);
        assert_eq!(MemPolicy::Bind.mode(), 2);
        assert_eq!(MemPolicy::Interleave.mode(), 3);
    }

    #[test]
    fn page_size_is_cached_and_sane() {
        let ps = page_size();
        assert!(ps.is_power_of_two() && ps >= 4096);
        assert_eq!(page_size(), ps);
    }
}
