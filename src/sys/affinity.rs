//! Which CPUs the calling thread may run on: `sched_setaffinity(2)` and `sched_getaffinity(2)`
//! with pid 0 (the calling thread), for threads that populate a node's memory from its own CPUs.
//!
//! Unsafe code here relies on the raw calls themselves: they read or write one `cpu_set_t` of
//! this module, whose size is passed with it, and the `CPU_*` helpers are only given CPUs below
//! `CPU_SETSIZE`.
#![allow(unsafe_code)]

use super::errno;
use crate::{Error, Result};

/// CPUs a `cpu_set_t` holds (`CPU_SETSIZE`, 1024 on glibc).
const SET_SIZE: usize = libc::CPU_SETSIZE as usize;

/// Binds the calling thread to the CPUs of `cpus` (`sched_setaffinity(0, …)`).
///
/// Errors: [`Error::InvalidCpuList`] for an empty list (`cpu: None`) or a CPU at or above
/// `CPU_SETSIZE` (`cpu: Some(that CPU)`), checked before the call; [`Error::Syscall`]
/// (`call: "sched_setaffinity"`) when the kernel refuses, e.g. EINVAL when none of the CPUs is
/// online and allowed by this process's cpuset.
pub(crate) fn bind_thread_to_cpus(cpus: &[usize]) -> Result<()> {
    let invalid = |cpu| Error::InvalidCpuList {
        cpu,
        limit: SET_SIZE,
    };
    if cpus.is_empty() {
        return Err(invalid(None));
    }
    // SAFETY: an all-zero cpu_set_t is the empty set (it is a plain array of bits).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= SET_SIZE {
            return Err(invalid(Some(cpu)));
        }
        // SAFETY: cpu < CPU_SETSIZE, so the bit lies inside `set`.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: the kernel reads size_of::<cpu_set_t>() bytes from `set`, which is that large.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(Error::Syscall {
            call: "sched_setaffinity",
            errno: errno(),
        });
    }
    Ok(())
}

/// The CPUs the calling thread may run on (`sched_getaffinity(0, …)`), ascending: those of this
/// process's cpuset unless the thread was bound more narrowly.
///
/// Allocates the list. Errors: [`Error::Syscall`] (`call: "sched_getaffinity"`) when the kernel
/// refuses (EINVAL on a machine with more than `CPU_SETSIZE` CPUs).
#[cfg(test)]
pub(crate) fn thread_cpus() -> Result<Vec<usize>> {
    affinity_of(0)
}

/// The CPUs the process's main thread may run on (`sched_getaffinity` of the process id): a
/// stand-in for the process's cpuset where the cgroup does not say it, narrowed by no other
/// thread's pinning. Errors: [`Error::Syscall`] (`call: "sched_getaffinity"`).
pub(crate) fn process_cpus() -> Result<Vec<usize>> {
    // SAFETY: getpid has no preconditions.
    affinity_of(unsafe { libc::getpid() })
}

fn affinity_of(pid: libc::pid_t) -> Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes at most size_of::<cpu_set_t>() bytes into `set`.
    let rc =
        unsafe { libc::sched_getaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(Error::Syscall {
            call: "sched_getaffinity",
            errno: errno(),
        });
    }
    let is_set = |cpu: usize| {
        // SAFETY: every cpu below CPU_SETSIZE lies inside `set`.
        unsafe { libc::CPU_ISSET(cpu, &set) }
    };
    Ok((0..SET_SIZE).filter(|&cpu| is_set(cpu)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_to_the_first_allowed_cpu_and_back() {
        // A thread of its own, so the test runner's threads keep their affinity whatever happens.
        std::thread::spawn(|| {
            let allowed = thread_cpus().expect("sched_getaffinity");
            assert!(!allowed.is_empty());
            assert!(allowed.windows(2).all(|w| w[0] < w[1]), "ascending");
            bind_thread_to_cpus(&allowed[..1]).expect("bind to the first allowed CPU");
            assert_eq!(thread_cpus().unwrap(), &allowed[..1]);
            bind_thread_to_cpus(&allowed).expect("restore");
            assert_eq!(thread_cpus().unwrap(), allowed);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn bad_lists_name_their_values() {
        assert_eq!(
            bind_thread_to_cpus(&[]),
            Err(Error::InvalidCpuList {
                cpu: None,
                limit: SET_SIZE
            })
        );
        let err = bind_thread_to_cpus(&[0, SET_SIZE]).unwrap_err();
        assert_eq!(
            err,
            Error::InvalidCpuList {
                cpu: Some(SET_SIZE),
                limit: SET_SIZE
            }
        );
        assert!(err.to_string().contains(&SET_SIZE.to_string()), "{err}");
    }
}
