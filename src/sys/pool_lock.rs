//! The locks of a shared pool ([`SharedMutex`]): words in the pool's file, taken over from a
//! holder only once the kernel says it is gone, in whatever PID namespace, zombie or not.
//!
//! Each process that attaches holds a lock of the kernel's on the pool's file for as long as it
//! is attached ([`LockKey`]): an open-file-description lock (`fcntl(F_OFD_SETLK)`) on one byte
//! past the file's end, at [`SLOTS`] + its token, a random number no other attached process
//! holds. A lock's futex word holds its holder's token. A waiter that finds the word held for a
//! whole slice asks the kernel whether that byte is still locked (`F_OFD_GETLK`): the kernel
//! drops the lock when the holder's descriptors close, which its death does before it is a
//! zombie, so an unlocked byte means the holder is gone (or the file is a copy, on which nobody
//! holds anything), and the waiter takes the lock over. Nothing is asked by process or thread
//! id, which another PID namespace does not see and which the kernel gives again.
//!
//! The kernel's lock belongs to an open file description, so each attachment opens one of its
//! own (through `/proc/self/fd`): the descriptor it attached by may be shared with other
//! processes (inherited, or passed over a socket), which would keep its lock after it died. A
//! forked child shares its parent's until it closes it: the pool makes the child keys of its
//! own at its first lock (`pool/locks.rs`).
//!
//! The description is every thread's of the process: the kernel's lock says the process lives,
//! not which thread holds. A [`Gate`] of the attachment's lets one thread at a time through to
//! the word, so that the word holding the attachment's own token means the thread at the gate's:
//! a stray write, or a holder that left without unlocking, never a live sibling.
//!
//! The words are plain numbers, never pointers: a process that may write the pool can make a
//! lock look held, free or left by a dead holder, never make another process write anywhere
//! but the pool; whatever it writes, the next locker takes the lock within a slice of a holder
//! that is gone, and a [`Locked::OwnerDied`] makes it check what the lock guards.
//!
//! Unsafe code here relies on the raw calls themselves: the descriptors are this module's own,
//! the `flock` records and paths live on the caller's stack, and the futex words are aligned
//! `u32`s that outlive the calls.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::errno;
use super::shm::random_u32;
use crate::{Error, Result};

/// Where the bytes the attachments lock start: past any pool's end (a lock may lie past a
/// file's end, and changes nothing in it).
const SLOTS: i64 = 1 << 40;
/// How long a waiter sleeps before it asks again whether the holder lives.
const SLICE: Duration = Duration::from_millis(10);
/// Tokens tried before an attach gives up (each is taken by another attached process with a
/// chance of one in four billion per process).
const TOKEN_TRIES: usize = 64;

/// A lock in a pool's file that every attached process takes through its [`LockKey`].
#[repr(C)]
pub struct SharedMutex {
    /// The holder's token, 0 when free: the futex word.
    owner: AtomicU32,
    /// Nonzero from a lock to its unlock: found so by a locker, the holder died holding it (or
    /// a stray write set it), and what the lock guards is to be checked.
    held: AtomicU32,
    /// The holder's process id, as its own PID namespace numbers it (0: none recorded): for
    /// errors only.
    pid: AtomicU32,
    /// Threads sleeping on `owner`: an unlock wakes one only when there are some.
    waiters: AtomicU32,
}

/// How [`SharedMutex::lock_for`] got the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Locked {
    /// From an unlock.
    Clean,
    /// From a holder that died holding it (or a stray write): what it guards may be half
    /// changed.
    OwnerDied,
}

/// A lock a live process held for all of a wait: its id, as its own PID namespace numbers it,
/// when it recorded one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// `None` where the holder had not recorded itself (it had just taken the lock, or a
    /// stray write put a live attachment's token in the word).
    pub pid: Option<u32>,
}

impl SharedMutex {
    /// Initialises the lock at `this`: free.
    ///
    /// # Safety
    /// `this` points at writable memory for a `SharedMutex` (shared memory, for other processes
    /// to use), not in use by anyone.
    pub unsafe fn init(this: *mut SharedMutex) {
        // SAFETY: the caller's memory, for a `SharedMutex`, used by nobody yet.
        unsafe {
            this.write(SharedMutex {
                owner: AtomicU32::new(0),
                held: AtomicU32::new(0),
                pid: AtomicU32::new(0),
                waiters: AtomicU32::new(0),
            });
        }
    }

    /// Whether the lock's word holds `token` (an attach refuses a token a dead holder left).
    pub fn owned_by(&self, token: u32) -> bool {
        self.owner.load(Ordering::Acquire) == token
    }

    /// Takes the lock through `key`, passing `gate` (the attachment's gate for this lock),
    /// waiting at most `wait`; `Err(Held)` when a live holder kept it all that time.
    ///
    /// # Errors
    /// The kernel's, when it cannot say whether the holder lives (`fcntl(F_OFD_GETLK)`).
    pub fn lock_for(
        &self,
        key: &LockKey,
        gate: &Gate,
        wait: Duration,
    ) -> Result<std::result::Result<Locked, Held>> {
        // A wait too long for the clock is no deadline.
        let deadline = Instant::now().checked_add(wait);
        let held = || {
            let pid = self.pid.load(Ordering::Relaxed);
            Held {
                pid: (pid != 0).then_some(pid),
            }
        };
        // Past the gate, or another thread of this process kept it (holding the lock, or
        // waiting for another process's holder).
        if !gate.enter(deadline) {
            return Ok(Err(held()));
        }
        match self.take(key, deadline) {
            Ok(true) => {}
            Ok(false) => {
                gate.leave();
                return Ok(Err(held()));
            }
            Err(e) => {
                gate.leave();
                return Err(e);
            }
        }
        self.pid.store(key.pid, Ordering::Relaxed);
        Ok(Ok(if self.held.swap(1, Ordering::AcqRel) == 0 {
            Locked::Clean
        } else {
            Locked::OwnerDied
        }))
    }

    /// Sets the word to `key`'s token, from free, from a holder the kernel says is gone, or
    /// from this attachment's own token (no other thread of it holds the lock: the caller
    /// passed the gate); `false` when a live holder kept it until `deadline`.
    fn take(&self, key: &LockKey, deadline: Option<Instant>) -> Result<bool> {
        // Set once a whole slice passed with the word unchanged: only then is the kernel
        // asked, so that a lock passed from hand to hand costs no system call.
        let mut suspect = false;
        loop {
            let holder = self.owner.load(Ordering::Acquire);
            if holder == key.token {
                return Ok(true);
            }
            let left = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()));
            let gone = holder == 0 || ((suspect || left.is_zero()) && !key.alive(holder)?);
            if gone
                && self
                    .owner
                    .compare_exchange(holder, key.token, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return Ok(true);
            }
            if left.is_zero() {
                return Ok(false);
            }
            if gone {
                // Taken by another waiter meanwhile: look again at once.
                continue;
            }
            // Counted before the kernel compares `owner` (both sequentially consistent, as the
            // unlock's store and load): either the unlock sees this waiter, or the kernel sees
            // the word changed. A wake missed all the same costs one slice.
            self.waiters.fetch_add(1, Ordering::SeqCst);
            suspect = futex_wait(&self.owner, holder, left.min(SLICE), false);
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Releases the lock and `gate`. Unless `repaired`, the lock stays marked as left by a
    /// holder that died, so that the next locker checks what it guards again.
    ///
    /// # Safety
    /// The calling thread holds it, through `key` and `gate` (from [`Self::lock_for`]).
    pub unsafe fn unlock(&self, key: &LockKey, gate: &Gate, repaired: bool) {
        if repaired {
            self.held.store(0, Ordering::Release);
        }
        self.pid.store(0, Ordering::Relaxed);
        // Only its own token: a lock taken over meanwhile (after a stray write) stays its new
        // holder's.
        let released = self
            .owner
            .compare_exchange(key.token, 0, Ordering::SeqCst, Ordering::Relaxed)
            .is_ok();
        if released && self.waiters.load(Ordering::SeqCst) != 0 {
            futex_wake(&self.owner, false);
        }
        gate.leave();
    }
}

/// One attachment's key to a pool's locks: a description of the pool's file of its own, holding
/// the kernel's lock on its token's byte for as long as the key lives.
#[derive(Debug)]
pub struct LockKey {
    /// The description's descriptor (close-on-exec); -1 once retired.
    fd: AtomicI32,
    token: u32,
    /// The process that made it.
    pid: u32,
}

impl LockKey {
    /// Opens a description of `file` of this process's own (`/proc/self/fd/N`, read and write,
    /// close-on-exec) and locks a token's byte there: one no other attached process holds, and
    /// that no lock's word holds (`in_use`: a holder that died with that token, whose lock would
    /// look alive again).
    ///
    /// # Errors
    /// The open's (`EACCES` where this process may not open the file again: a descriptor another
    /// user passed), or the lock's.
    pub fn new(file: BorrowedFd<'_>, pid: u32, in_use: impl Fn(u32) -> bool) -> Result<LockKey> {
        let mut key = LockKey {
            fd: AtomicI32::new(reopen(file)?),
            token: 0,
            pid,
        };
        for _ in 0..TOKEN_TRIES {
            let token = random_u32()?;
            if !key.set(token, libc::F_WRLCK)? {
                continue;
            }
            if in_use(token) {
                key.set(token, libc::F_UNLCK)?;
                continue;
            }
            key.token = token;
            return Ok(key);
        }
        Err(Error::Syscall {
            call: "fcntl(F_OFD_SETLK) on a token of a shared pool's file",
            errno: libc::EAGAIN,
        })
    }

    /// The process that made it.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether another description holds `token`'s byte: its attachment lives
    /// (`F_OFD_GETLK`).
    pub fn alive(&self, token: u32) -> Result<bool> {
        let mut lock = slot(token, libc::F_WRLCK);
        // SAFETY: F_OFD_GETLK on our descriptor fills the record on this stack frame.
        let asked = unsafe {
            libc::fcntl(
                self.fd.load(Ordering::Relaxed),
                libc::F_OFD_GETLK,
                &mut lock,
            )
        };
        if asked != 0 {
            return Err(syscall("fcntl(F_OFD_GETLK) on a shared pool's file"));
        }
        Ok(i32::from(lock.l_type) != libc::F_UNLCK)
    }

    /// Closes the description in a forked child, whose parent's key it is: the child would
    /// otherwise keep the parent's lock, vouching for it after it died. Nothing uses the key in
    /// the child afterwards.
    pub fn retire(&self) {
        close(self.fd.swap(-1, Ordering::AcqRel));
    }

    /// Sets (`F_WRLCK`) or clears (`F_UNLCK`) the lock of `token`'s byte without waiting;
    /// `false` when another description holds it.
    fn set(&self, token: u32, kind: libc::c_int) -> Result<bool> {
        let lock = slot(token, kind);
        // SAFETY: F_OFD_SETLK on our descriptor reads the record on this stack frame.
        if unsafe { libc::fcntl(self.fd.load(Ordering::Relaxed), libc::F_OFD_SETLK, &lock) } == 0 {
            return Ok(true);
        }
        match errno() {
            libc::EAGAIN | libc::EACCES => Ok(false),
            _ => Err(syscall("fcntl(F_OFD_SETLK) on a shared pool's file")),
        }
    }
}

impl Drop for LockKey {
    fn drop(&mut self) {
        close(*self.fd.get_mut());
    }
}

/// The lock record of `token`'s byte.
fn slot(token: u32, kind: libc::c_int) -> libc::flock {
    // SAFETY: zero is a valid flock (and `l_pid` must be 0 for open-file-description locks).
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = SLOTS + i64::from(token);
    lock.l_len = 1;
    lock
}

/// Opens `file` again (`/proc/self/fd/N`): a new open file description of the same file.
fn reopen(file: BorrowedFd<'_>) -> Result<i32> {
    // "/proc/self/fd/" and a descriptor's digits, NUL-terminated, on the stack.
    let mut path = *b"/proc/self/fd/\0\0\0\0\0\0\0\0\0\0\0";
    let mut n = file.as_raw_fd().unsigned_abs();
    let digits = n.checked_ilog10().map_or(1, |d| d as usize + 1);
    for at in (14..14 + digits).rev() {
        path[at] = b'0' + (n % 10) as u8;
        n /= 10;
    }
    let flags = libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOCTTY;
    // SAFETY: a NUL-terminated path on this stack frame; the descriptor made is ours.
    let fd = unsafe { libc::open(path.as_ptr().cast(), flags) };
    if fd < 0 {
        return Err(syscall(
            "open(/proc/self/fd/N): a shared pool's file, for its locks",
        ));
    }
    Ok(fd)
}

fn close(fd: i32) {
    if fd >= 0 {
        // SAFETY: a descriptor this module opened and nothing else closes.
        unsafe { libc::close(fd) };
    }
}

fn syscall(call: &'static str) -> Error {
    Error::Syscall {
        call,
        errno: errno(),
    }
}

/// A lock among the threads of one process, waited for until a deadline: one thread of an
/// attachment at a time reaches a [`SharedMutex`]'s word. Its word is 0 open, 1 taken, 2 taken
/// with sleepers (Drepper's "Futexes Are Tricky").
#[derive(Debug, Default)]
pub struct Gate(AtomicU32);

impl Gate {
    /// Passes the gate, waiting until `deadline` (`None`: for as long as it takes); `false`
    /// when another thread held it until then.
    fn enter(&self, deadline: Option<Instant>) -> bool {
        if self
            .0
            .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return true;
        }
        loop {
            // Marked "sleepers" so that the leaving thread wakes one: a thread that passes this
            // way keeps the mark, since others may still sleep.
            if self.0.swap(2, Ordering::Acquire) == 0 {
                return true;
            }
            let left = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                return false;
            }
            futex_wait(&self.0, 2, left, true);
        }
    }

    fn leave(&self) {
        if self.0.swap(0, Ordering::Release) == 2 {
            futex_wake(&self.0, true);
        }
    }
}

/// Sleeps while `word` holds `expected`, at most `wait` (`FUTEX_WAIT`; within this process
/// alone when `private`); whether it slept all of `wait`.
fn futex_wait(word: &AtomicU32, expected: u32, wait: Duration, private: bool) -> bool {
    let timeout = libc::timespec {
        tv_sec: wait.as_secs() as libc::time_t,
        tv_nsec: wait.subsec_nanos() as _,
    };
    let op = if private {
        libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG
    } else {
        libc::FUTEX_WAIT
    };
    // SAFETY: the kernel reads the aligned u32 behind `word`, which outlives the call, and the
    // timespec on this stack frame.
    let slept = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op,
            expected,
            &timeout as *const libc::timespec,
        )
    };
    slept != 0 && errno() == libc::ETIMEDOUT
}

/// Wakes one thread sleeping in [`futex_wait`] on `word` (of any process, unless `private`).
fn futex_wake(word: &AtomicU32, private: bool) {
    let op = if private {
        libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG
    } else {
        libc::FUTEX_WAKE
    };
    // SAFETY: FUTEX_WAKE only uses the address as a key; `word` is a live, aligned u32.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), op, 1) };
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, UnsafeCell};
    use std::os::fd::{AsFd, OwnedFd};

    use super::*;

    fn file() -> OwnedFd {
        super::super::shm::memfd(c"numa-gpu-alloc lock test", false, false).unwrap()
    }

    #[test]
    fn a_key_is_alive_to_another_until_it_drops_and_skips_a_token_in_use() {
        let file = file();
        let refused = Cell::new(0);
        let first = LockKey::new(file.as_fd(), 1, |token| {
            // The first token tried is taken to be a dead holder's, still in a lock's word.
            refused.get() == 0 && {
                refused.set(token);
                true
            }
        })
        .unwrap();
        assert_ne!(first.token, refused.get());
        let second = LockKey::new(file.as_fd(), 1, |_| false).unwrap();
        assert_ne!(first.token, second.token);
        assert!(second.alive(first.token).unwrap() && first.alive(second.token).unwrap());
        assert!(
            !second.alive(refused.get()).unwrap(),
            "its byte was let go of"
        );
        let token = first.token;
        drop(first);
        assert!(!second.alive(token).unwrap());
    }

    #[test]
    fn two_keys_exclude_each_other_and_a_gate_times_out_naming_the_holder() {
        struct Shared {
            mutex: SharedMutex,
            count: UnsafeCell<u64>,
        }
        // SAFETY: `count` is written only under `mutex`.
        unsafe impl Sync for Shared {}
        let shared = Shared {
            mutex: SharedMutex {
                owner: AtomicU32::new(0),
                held: AtomicU32::new(0),
                pid: AtomicU32::new(0),
                waiters: AtomicU32::new(0),
            },
            count: UnsafeCell::new(0),
        };
        let file = file();
        let keys = [7, 8].map(|pid| LockKey::new(file.as_fd(), pid, |_| false).unwrap());
        let gates = [Gate::default(), Gate::default()];
        std::thread::scope(|s| {
            for (key, gate) in keys.iter().zip(&gates) {
                let shared = &shared;
                s.spawn(move || {
                    for _ in 0..20_000 {
                        let locked = shared.mutex.lock_for(key, gate, Duration::MAX).unwrap();
                        assert_eq!(locked, Ok(Locked::Clean));
                        // SAFETY: under the lock; unlocked through the key and gate it was
                        // taken with.
                        unsafe {
                            *shared.count.get() += 1;
                            shared.mutex.unlock(key, gate, true);
                        }
                    }
                });
            }
        });
        // SAFETY: the threads ended.
        assert_eq!(unsafe { *shared.count.get() }, 40_000);
        let locked = shared.mutex.lock_for(&keys[0], &gates[0], Duration::ZERO);
        assert_eq!(locked.unwrap(), Ok(Locked::Clean));
        std::thread::scope(|s| {
            // Another thread of the same attachment waits at the gate; another attachment at
            // the word: both name the holder.
            let sibling = s.spawn(|| {
                shared
                    .mutex
                    .lock_for(&keys[0], &gates[0], Duration::from_millis(30))
            });
            let other = shared
                .mutex
                .lock_for(&keys[1], &gates[1], Duration::from_millis(30));
            assert_eq!(other.unwrap(), Err(Held { pid: Some(7) }));
            assert_eq!(sibling.join().unwrap().unwrap(), Err(Held { pid: Some(7) }));
        });
        // SAFETY: this thread holds it, through the first key and gate.
        unsafe { shared.mutex.unlock(&keys[0], &gates[0], true) };
    }
}
