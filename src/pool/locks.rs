//! A pool's two locks as this process takes them (`sys/pool_lock.rs` says how they pass from a
//! holder that is gone): the carving lock, under which the extent table is the holder's
//! ([`PoolGuard`]), and the registration lock, which serialises every process's chunk
//! registrations ([`RegistrationGuard`]); and this process's keys to them ([`PoolKeys`]).
//!
//! Unsafe code here relies on the keys being boxes of this module's, freed only when the pool
//! drops (a child's replaced ones never), and on a guard's thread holding its lock.
#![allow(unsafe_code)]

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::time::{Duration, Instant};

use super::extents::{Admit, ExtentTable};
use super::{Header, Pool, DATA_START};
use crate::sys::{self, Gate, Held, LockKey, Locked};
use crate::Error;

/// What a lock of the pool is called in errors, and the slice of a cancellable wait.
const CARVING: &str = "carving";
const REGISTRATION: &str = "registration";
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// One process's keys to a pool's locks: its [`LockKey`] (a description of the pool's file of
/// its own, holding the kernel's lock on its token's byte) and a gate per lock for its threads.
#[derive(Debug)]
pub(crate) struct Keys {
    key: LockKey,
    carving: Gate,
    register: Gate,
}

impl Keys {
    /// Keys for this process to the locks in `header`, of the file `file` (`name` in errors).
    ///
    /// # Errors
    /// [`Error::PoolPermission`] when this process may not open the file again (a descriptor
    /// passed by another user, of a file this one may not open); the lock's.
    fn new(file: BorrowedFd<'_>, header: &Header, name: &Path) -> Result<Keys, Error> {
        let in_use = |token| header.mutex.owned_by(token) || header.register.owned_by(token);
        let key = LockKey::new(file, sys::process_id(), in_use).map_err(|e| match e {
            Error::Syscall {
                errno: libc::EACCES | libc::EPERM,
                ..
            } => {
                let found = sys::file_owner(file).ok();
                Error::PoolPermission {
                    path: name.into(),
                    owner: found.map(|(owner, _, _)| owner),
                    mode: found.map(|(_, mode, _)| mode),
                    uid: sys::effective_uid(),
                }
            }
            e => e,
        })?;
        Ok(Keys {
            key,
            carving: Gate::default(),
            register: Gate::default(),
        })
    }
}

/// The keys of the process that uses the pool: made when it attaches, and made again in a
/// forked child at its first lock. The parent's key, whose description the child shares, is
/// retired there, so that the child does not keep vouching for the parent; a child that never
/// takes a lock keeps it until it drops the pool, execs or exits.
#[derive(Debug)]
pub(super) struct PoolKeys(AtomicPtr<Keys>);

impl PoolKeys {
    /// This process's keys to the locks in `header`, of the file `file` (`name` in errors).
    pub(super) fn new(
        file: BorrowedFd<'_>,
        header: &Header,
        name: &Path,
    ) -> Result<PoolKeys, Error> {
        let keys = Box::new(Keys::new(file, header, name)?);
        Ok(PoolKeys(AtomicPtr::new(Box::into_raw(keys))))
    }
}

impl Drop for PoolKeys {
    fn drop(&mut self) {
        // SAFETY: a box of `new` or `Pool::keys`, not freed before (a replaced one is leaked),
        // and nobody else uses it once the pool drops.
        drop(unsafe { Box::from_raw(*self.0.get_mut()) });
    }
}

impl Pool {
    /// The keys of process `pid` (this process's id, which the caller has at hand).
    fn keys(&self, pid: u32) -> Result<&Keys, Error> {
        let current = self.keys.0.load(Ordering::Acquire);
        // SAFETY: a box of `PoolKeys`, freed only when the pool drops (a replaced one never:
        // another thread may still read it).
        let keys = unsafe { &*current };
        if keys.key.pid() == pid {
            return Ok(keys);
        }
        // A forked child's first lock.
        let made = Box::into_raw(Box::new(Keys::new(self.fd(), self.header(), &self.name)?));
        match self
            .keys
            .0
            .compare_exchange(current, made, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                keys.key.retire();
                // SAFETY: the box just made, now the pool's.
                Ok(unsafe { &*made })
            }
            Err(now) => {
                // SAFETY: the box just made, which nobody else saw.
                drop(unsafe { Box::from_raw(made) });
                // SAFETY: another thread of this process made these, as above.
                Ok(unsafe { &*now })
            }
        }
    }

    /// Takes the pool's carving lock for process `pid` (waiting at most `wait`), then admits
    /// the extent table ([`ExtentTable::admit`]): whole, or rebuilt when its holder died or it
    /// does not hold together (a stray write), so that no operation reads a count, index or
    /// extent past its table.
    ///
    /// # Errors
    /// [`Error::PoolLockHeld`] when a live process held it all of `wait`, naming it;
    /// [`Error::PoolCorrupt`] when the extent table could not be made whole (the next locker
    /// tries again); the kernel's, when it could not say whether the holder lives.
    pub(crate) fn lock(&self, wait: Duration, pid: u32) -> Result<PoolGuard<'_>, Error> {
        let header = self.header();
        let keys = self.keys(pid)?;
        let locked = header
            .mutex
            .lock_for(&keys.key, &keys.carving, wait)?
            .map_err(|held| self.held(CARVING, held, wait))?;
        let mut guard = PoolGuard {
            header,
            keys,
            repaired: true,
        };
        let admitted = guard.extents().admit(
            DATA_START as u64,
            self.len() as u64,
            self.chunk,
            locked == Locked::OwnerDied,
        );
        if admitted == Admit::Broken {
            guard.repaired = false;
            return Err(Error::PoolCorrupt {
                path: self.name.clone(),
                reason: "its extent table does not hold together even after a rebuild",
            });
        }
        Ok(guard)
    }

    /// Takes the lock every process's chunk registrations of this pool are serialised by,
    /// waiting in slices so that `cancel` stops the wait, and at most `wait`; `None` when
    /// cancelled. A holder that died leaves nothing to repair.
    ///
    /// # Errors
    /// [`Error::PoolLockHeld`] when a live process held it all of `wait`, naming it; the
    /// kernel's, when it could not say whether the holder lives.
    pub(crate) fn lock_registration(
        &self,
        cancel: &AtomicBool,
        wait: Duration,
    ) -> Result<Option<RegistrationGuard<'_>>, Error> {
        let header = self.header();
        let keys = self.keys(sys::process_id())?;
        let start = Instant::now();
        loop {
            if cancel.load(Ordering::Acquire) {
                return Ok(None);
            }
            let slice = WAIT_SLICE.min(wait.saturating_sub(start.elapsed()));
            match header.register.lock_for(&keys.key, &keys.register, slice)? {
                Ok(_) => return Ok(Some(RegistrationGuard { header, keys })),
                Err(held) if start.elapsed() >= wait => {
                    return Err(self.held(REGISTRATION, held, wait));
                }
                Err(_) => {}
            }
        }
    }

    /// The error for a lock a live process held all of `wait`.
    fn held(&self, lock: &'static str, held: Held, wait: Duration) -> Error {
        Error::PoolLockHeld {
            path: self.name.clone(),
            lock,
            pid: held.pid,
            waited_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// The pool's carving lock, held: the extent table is the holder's.
pub(crate) struct PoolGuard<'a> {
    header: &'a Header,
    keys: &'a Keys,
    /// Whether the extent table is whole: if not, the lock is left marked for the next locker
    /// to rebuild it.
    repaired: bool,
}

impl PoolGuard<'_> {
    pub(crate) fn extents(&mut self) -> &mut ExtentTable {
        // SAFETY: the lock is held while the guard lives, and the guard is borrowed mutably.
        unsafe { &mut *self.header.extents.get() }
    }
}

impl Drop for PoolGuard<'_> {
    fn drop(&mut self) {
        let keys = self.keys;
        // SAFETY: this thread took the lock through these keys when it made the guard.
        unsafe {
            self.header
                .mutex
                .unlock(&keys.key, &keys.carving, self.repaired)
        };
    }
}

/// The pool's registration lock, held.
pub(crate) struct RegistrationGuard<'a> {
    header: &'a Header,
    keys: &'a Keys,
}

impl Drop for RegistrationGuard<'_> {
    fn drop(&mut self) {
        let keys = self.keys;
        // SAFETY: this thread took the lock through these keys when it made the guard; it
        // guards no state, so it is never left to repair.
        unsafe { self.header.register.unlock(&keys.key, &keys.register, true) };
    }
}
