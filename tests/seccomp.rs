//! A real seccomp filter, as Docker's default profile has: `mbind`, `get_mempolicy`,
//! `set_mempolicy` and `move_pages` answer EPERM. A child process (this test binary, re-executed)
//! installs it and then allocates through `NumaGpuAlloc` as its `#[global_allocator]`: every
//! allocation succeeds unplaced, contents check out, and the stats say why.

use numa_gpu_alloc::{Error, MemPolicy, NumaGpuAlloc};

#[macro_use]
mod common {
    pub mod child;
    pub mod pattern;
    #[macro_use]
    pub mod require;
}
use common::pattern::{check, fill};

#[global_allocator]
static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new();

const MIB: usize = 1 << 20;
const CHILD_VAR: &str = "NUMA_GPU_ALLOC_TEST_SECCOMP_CHILD";
const CHILD_OK: &str = "seccomp child: all checks passed";
const CHILD_SKIP: &str = "seccomp child: skipped";

// Classic BPF, from linux/filter.h and linux/seccomp.h (defined here: the libc crate's set
// depends on its version).
const BPF_LD: u16 = 0x00;
const BPF_W: u16 = 0x00;
const BPF_ABS: u16 = 0x20;
const BPF_JMP: u16 = 0x05;
const BPF_JEQ: u16 = 0x10;
const BPF_K: u16 = 0x00;
const BPF_RET: u16 = 0x06;
const BPF_LD_W_ABS: u16 = BPF_LD | BPF_W | BPF_ABS;
const BPF_JMP_JEQ_K: u16 = BPF_JMP | BPF_JEQ | BPF_K;
const BPF_RET_K: u16 = BPF_RET | BPF_K;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_SET_MODE_FILTER: libc::c_uint = 1;
/// `offsetof(struct seccomp_data, nr)` and `arch`.
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e; // AUDIT_ARCH_X86_64
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7; // AUDIT_ARCH_AARCH64

const fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

const fn jeq(k: u32, jt: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: BPF_JMP_JEQ_K,
        jt,
        jf: 0,
        k,
    }
}

/// Installs the filter on the calling thread (threads it creates later inherit it). Returns
/// false when the kernel has no seccomp filters.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn install_filter() -> bool {
    let refused = [
        libc::SYS_mbind,
        libc::SYS_get_mempolicy,
        libc::SYS_set_mempolicy,
        libc::SYS_move_pages,
    ];
    let n = refused.len() as u8;
    let mut program = vec![
        stmt(BPF_LD_W_ABS, OFFSET_ARCH),
        // Another architecture (or ABI): not ours to judge, allow.
        jeq(AUDIT_ARCH, 1),
        stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
        stmt(BPF_LD_W_ABS, OFFSET_NR),
    ];
    for (i, &nr) in refused.iter().enumerate() {
        // Jump over the remaining comparisons and the ALLOW to the EPERM return.
        program.push(jeq(nr as u32, n - i as u8));
    }
    program.push(stmt(BPF_RET_K, SECCOMP_RET_ALLOW));
    program.push(stmt(BPF_RET_K, SECCOMP_RET_ERRNO | libc::EPERM as u32));
    let fprog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_mut_ptr(),
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes plain integers.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    assert_eq!(rc, 0, "prctl(PR_SET_NO_NEW_PRIVS): {}", errno_text());
    // SAFETY: fprog points to `len` valid instructions that live across the call (the kernel
    // copies them).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            SECCOMP_SET_MODE_FILTER,
            0 as libc::c_uint,
            &fprog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        let errno = std::io::Error::last_os_error().raw_os_error();
        if matches!(errno, Some(libc::ENOSYS) | Some(libc::EINVAL)) {
            return false;
        }
        panic!("seccomp(SECCOMP_SET_MODE_FILTER): {}", errno_text());
    }
    true
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn install_filter() -> bool {
    false
}

fn errno_text() -> String {
    std::io::Error::last_os_error().to_string()
}

fn child() {
    if !install_filter() {
        println!("{CHILD_SKIP}: the kernel has no seccomp filters");
        return;
    }
    // The filter works: the call the allocator makes is refused.
    // SAFETY: get_mempolicy with null pointers only asks for the policy mode, which it would
    // write nowhere; the filter refuses it before the kernel reads anything.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            std::ptr::null_mut::<libc::c_int>(),
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    assert_eq!(rc, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EPERM)
    );

    // Through the global allocator: Vec, Box, realloc across the threshold, a block big enough
    // to be populated by several threads (which inherit the filter), and reuse from the cache.
    let mut held: Vec<Vec<u8>> = Vec::new();
    for (i, size) in [3 * MIB, 8 * MIB + 123, 2 * MIB, 72 * MIB, 17 * MIB]
        .into_iter()
        .enumerate()
    {
        let mut v = vec![0u8; size];
        fill(&mut v, i as u8);
        held.push(v);
    }
    let mut grow = vec![7u8; 100_000];
    grow.resize(12 * MIB, 7);
    assert!(grow.iter().all(|&b| b == 7));
    for (i, v) in held.iter().enumerate() {
        check(v, i as u8);
    }
    drop(held);
    let again = vec![1u8; 3 * MIB];
    assert!(again.iter().all(|&b| b == 1));
    let boxed: Box<[u64]> = vec![42u64; MIB].into_boxed_slice();
    assert!(boxed.iter().all(|&x| x == 42));
    drop((grow, again, boxed));

    let stats = ALLOC.stats();
    println!("{stats}");
    assert_eq!(
        stats.numa_unavailable,
        Some(Error::NumaUnavailable {
            call: "mbind",
            errno: libc::EPERM
        })
    );
    assert!(stats.fallbacks.unplaced_blocks > 0, "{stats}");
    assert_eq!(stats.fallbacks.failed_allocations, 0, "{stats}");
    assert!(stats.cache_hits > 0, "{stats}");
    assert_eq!(stats.live_bytes(), 0, "{stats}");
    assert!(!ALLOC.placement().numa_placement);

    // policy=bind with verification: also unplaced, never a failure.
    let strict = NumaGpuAlloc::new().policy(MemPolicy::Bind).verify(true);
    let mut v: allocator_api2::vec::Vec<u8, _> =
        allocator_api2::vec::Vec::with_capacity_in(5 * MIB, &strict);
    v.resize(5 * MIB, 9);
    assert!(v.iter().all(|&b| b == 9));
    drop(v);
    let s = strict.stats();
    assert_eq!(s.fallbacks.failed_allocations, 0, "{s}");
    assert_eq!(s.fallbacks.unplaced_blocks, 1, "{s}");
    assert!(matches!(
        s.numa_unavailable,
        Some(Error::NumaUnavailable { errno, .. }) if errno == libc::EPERM
    ));
    println!("{CHILD_OK}");
}

#[test]
fn docker_like_seccomp_profile_falls_back_to_unplaced_blocks() {
    if common::child::mode(CHILD_VAR).is_some() {
        return child();
    }
    let (stdout, stderr) = common::child::run(
        "docker_like_seccomp_profile_falls_back_to_unplaced_blocks",
        CHILD_VAR,
        "1",
        &[],
    );
    require!(!stdout.contains(CHILD_SKIP), "{stdout}");
    assert!(stdout.contains(CHILD_OK), "{stdout}\n{stderr}");
    assert!(stdout.contains("NUMA unavailable: "), "{stdout}");
}
