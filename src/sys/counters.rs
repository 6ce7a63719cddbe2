//! Kernel counters that an allocation reads (a node's free memory, compaction stalls), from
//! descriptors opened once by the process's initialisation and read with the raw `pread64`
//! system call: no lock of glibc's, no allocation, no cancellation point (POSIX forbids them in
//! `malloc`; glibc's `open` and `read` are ones).
//!
//! A program that closes descriptors it did not open (a daemon closing all but 0–2) takes ours
//! too: reads then fail (`EBADF`) or, where the number was reused, read another file, whose text
//! parses as no counter. Either way the counter reads as unknown, which its callers take as
//! "nothing to act on", as they did when a file could not be opened.
//!
//! Unsafe code here relies on the descriptor being a plain number: reading from one that is no
//! longer ours is a failed or meaningless read, never a memory error.
#![allow(unsafe_code)]

use std::os::fd::IntoRawFd as _;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

/// A counter file's descriptor; -1 until opened.
#[derive(Debug)]
pub(crate) struct CounterFile(AtomicI32);

impl CounterFile {
    pub(crate) const fn new() -> CounterFile {
        CounterFile(AtomicI32::new(-1))
    }

    /// Opens `path` (read-only, close-on-exec) for later reads, once: outside any allocation
    /// (it allocates the path and may take glibc's locks). False when it cannot be opened.
    pub(crate) fn open(&self, path: &Path) -> bool {
        if self.0.load(Ordering::Acquire) >= 0 {
            return true;
        }
        let Ok(file) = std::fs::File::open(path) else {
            return false;
        };
        let fd = file.into_raw_fd();
        if self
            .0
            .compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // Another thread opened it first.
            // SAFETY: `fd` was just opened here and is shared with no one.
            unsafe { libc::close(fd) };
        }
        true
    }

    /// The file's text from its start, as much as `buf` holds; `None` when it was never opened
    /// or cannot be read.
    pub(crate) fn read<'a>(&self, buf: &'a mut [u8]) -> Option<&'a [u8]> {
        let fd = self.0.load(Ordering::Acquire);
        if fd < 0 {
            return None;
        }
        let mut filled = 0;
        while filled < buf.len() {
            let rest = &mut buf[filled..];
            // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`; a descriptor that
            // is not ours any more fails or reads another file's bytes (see the module's docs).
            let read: std::result::Result<libc::c_long, i32> = linux_only!(unsafe {
                libc::syscall(
                    libc::SYS_pread64,
                    fd,
                    rest.as_mut_ptr(),
                    rest.len(),
                    filled as libc::off_t,
                )
            });
            match read.ok()? {
                0 => break,
                n if n > 0 => filled += n as usize,
                _ if super::errno() == libc::EINTR => {}
                _ => return None,
            }
        }
        Some(&buf[..filled])
    }
}

impl Drop for CounterFile {
    fn drop(&mut self) {
        let fd = *self.0.get_mut();
        if fd >= 0 {
            // SAFETY: the descriptor was opened by `open` and is this value's alone.
            unsafe { libc::close(fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_opened_once_is_read_from_its_start_each_time() {
        let dir = std::env::temp_dir().join(format!("counters-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("meminfo");
        std::fs::write(&path, "MemFree: 1 kB\n").unwrap();
        let file = CounterFile::new();
        let mut buf = [0u8; 64];
        assert_eq!(file.read(&mut buf), None, "not opened");
        assert!(file.open(&path));
        assert_eq!(file.read(&mut buf), Some(&b"MemFree: 1 kB\n"[..]));
        std::fs::write(&path, "MemFree: 22 kB\n").unwrap();
        assert_eq!(file.read(&mut buf), Some(&b"MemFree: 22 kB\n"[..]));
        assert!(!CounterFile::new().open(&dir.join("none")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn proc_files_are_generated_again_at_each_read() {
        let file = CounterFile::new();
        assert!(file.open(Path::new("/proc/self/stat")));
        let mut buf = [0u8; 512];
        let first = file.read(&mut buf).map(<[u8]>::to_vec).unwrap();
        assert!(first.starts_with(std::process::id().to_string().as_bytes()));
        assert!(file.read(&mut buf).is_some_and(|again| !again.is_empty()));
    }
}
