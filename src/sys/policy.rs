//! Memory policy: [`NodeMask`], [`MemPolicy`] and `mbind(2)` ([`bind`]); which nodes this
//! process may use ([`allowed_memory_nodes`]) and which node its thread runs on ([`current_node`]).
//!
//! Unsafe code here relies on the raw calls themselves: `mbind` on a range the caller owns, and
//! `get_mempolicy`/`getcpu` writing only into buffers of this module.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_long, c_void};
use std::ptr::{self, NonNull};

use super::{check_range, errno, fault, numa_error};
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
    /// [`populate`](super::populate), or the OOM killer / SIGBUS at a later fault.
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
/// `ptr..ptr+len` must be a mapping this crate created (with
/// [`map_anonymous`](super::map_anonymous)) that nobody else uses: with `move_existing` the kernel migrates its pages, and a policy change affects every
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
    let rc: c_long = linux_only!(unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr.as_ptr() as usize,
            len,
            policy.mode() as c_long,
            nodes.words.as_ptr(),
            MBIND_MAXNODE,
            flags.bits() as c_long,
        )
    })
    .map_err(|errno| numa_error("mbind", errno))?;
    if rc != 0 {
        return Err(numa_error("mbind", errno()));
    }
    Ok(())
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
    let rc: c_long = linux_only!(unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            ptr::null_mut::<c_int>(),
            mask.words.as_mut_ptr(),
            MBIND_MAXNODE,
            ptr::null_mut::<c_void>(),
            MPOL_F_MEMS_ALLOWED,
        )
    })
    .map_err(|errno| numa_error("get_mempolicy", errno))?;
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
    let rc: c_long = linux_only!(unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu as *mut libc::c_uint,
            &mut node as *mut libc::c_uint,
            ptr::null_mut::<c_void>(),
        )
    })
    .map_err(|errno| numa_error("getcpu", errno))?;
    if rc != 0 {
        return Err(numa_error("getcpu", errno()));
    }
    Ok(node as usize)
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
}
