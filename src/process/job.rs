//! A job on a thread of its own, made chunk by chunk (a reservation of bytes, a pool's
//! background registration): what it has done so far ([`Job`], updated as it goes), and the
//! handle that watches it, cancels it and waits for it ([`Background`]). The front ends wrap
//! both in their public handles and snapshots.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sys;
use crate::sys::lock::Lock;
use crate::Error;

/// Why a handle in a child forked since its job started cannot wait for it.
const FORKED: &str = "this is a child forked since it was made (its thread runs in the parent)";

/// What a background job has done so far: chunks done and their bytes, the longest driver
/// call, when the first chunk was done, the cancel flag and the outcome. Each count is updated
/// on its own; readers see them at about the same time.
pub(crate) struct Job {
    /// Bytes asked for.
    requested: usize,
    start: Instant,
    chunks: AtomicUsize,
    /// Bytes of the chunks done.
    bytes: AtomicUsize,
    /// Nanoseconds of the longest driver call.
    longest_call_ns: AtomicU64,
    /// Nanoseconds from the start to the first chunk done (0: none yet).
    first_chunk_ns: AtomicU64,
    /// Set to stop after the chunk in progress.
    cancel: AtomicBool,
    /// Set once it ended.
    finished: AtomicBool,
    /// Why it ended early.
    error: Lock<Option<Error>>,
}

/// Nanoseconds of `d`, saturated.
fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Job {
    /// A job of `requested` bytes, started now.
    pub(crate) fn new(requested: usize) -> Job {
        Job {
            requested,
            start: Instant::now(),
            chunks: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            longest_call_ns: AtomicU64::new(0),
            first_chunk_ns: AtomicU64::new(0),
            cancel: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            error: Lock::new(None),
        }
    }

    /// Counts a chunk of `len` bytes done.
    pub(crate) fn chunk_done(&self, len: usize) {
        self.bytes.fetch_add(len, Ordering::Relaxed);
        self.chunks.fetch_add(1, Ordering::Release);
        let since = ns(self.start.elapsed()).max(1);
        let _ =
            self.first_chunk_ns
                .compare_exchange(0, since, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Counts a driver call that took `took`.
    pub(crate) fn driver_call(&self, took: Duration) {
        self.longest_call_ns.fetch_max(ns(took), Ordering::Relaxed);
    }

    /// Records the outcome.
    pub(crate) fn finish(&self, outcome: Result<(), Error>) {
        if let Err(e) = outcome {
            *self.error.lock() = Some(e);
        }
        self.finished.store(true, Ordering::Release);
    }

    /// Asks it to stop after the chunk in progress.
    pub(crate) fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    /// The flag [`Self::cancel`] sets (for a wait that stops when it is set).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // a shared pool's (Linux only)
    pub(crate) fn cancel_flag(&self) -> &AtomicBool {
        &self.cancel
    }

    /// Whether it was asked to stop.
    pub(crate) fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    pub(crate) fn requested(&self) -> usize {
        self.requested
    }

    /// Chunks done so far.
    pub(crate) fn chunks(&self) -> usize {
        self.chunks.load(Ordering::Acquire)
    }

    /// Bytes of the chunks done so far.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The longest driver call so far.
    pub(crate) fn longest_driver_call(&self) -> Duration {
        Duration::from_nanos(self.longest_call_ns.load(Ordering::Relaxed))
    }

    /// From the start to the first chunk done, once there is one.
    pub(crate) fn first_chunk(&self) -> Option<Duration> {
        let first = self.first_chunk_ns.load(Ordering::Relaxed);
        (first != 0).then(|| Duration::from_nanos(first))
    }

    /// Since the start.
    pub(crate) fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Whether it ended.
    pub(crate) fn finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Why it ended early, if it did.
    pub(crate) fn error(&self) -> Option<Error> {
        self.error.lock().clone()
    }
}

/// A job that counts nothing beyond its chunks (a pool's background registration).
impl AsRef<Job> for Job {
    fn as_ref(&self) -> &Job {
        self
    }
}

/// A job running on a thread of its own, over `T` (its [`Job`], and what else its kind
/// counts): watched, cancelled and waited for from here. Dropping it lets the job go on to
/// its end.
pub(crate) struct Background<T> {
    state: Arc<T>,
    thread: Option<JoinHandle<()>>,
    /// The fork generation it was made in: its thread runs only there.
    generation: u32,
}

impl<T: AsRef<Job> + Send + Sync + 'static> Background<T> {
    /// Runs `body` over `state` on a thread called `name`, then records its outcome (or that
    /// its thread panicked) in the state's [`Job`].
    ///
    /// # Errors
    /// [`Error::Syscall`] naming `call` when the thread could not start.
    pub(crate) fn spawn(
        name: &str,
        call: &'static str,
        state: Arc<T>,
        body: impl FnOnce(&T) -> Result<(), Error> + Send + 'static,
    ) -> Result<Background<T>, Error> {
        let shared = Arc::clone(&state);
        // Signals blocked: the program's own threads take them (see `sys::with_signals_blocked`).
        let thread = sys::with_signals_blocked(|| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    let job: &Job = (*shared).as_ref();
                    let ended = EndOnUnwind(job);
                    job.finish(body(&shared));
                    drop(ended);
                })
        })
        .map_err(|e| Error::Syscall {
            call,
            errno: e.raw_os_error().unwrap_or(libc::EAGAIN),
        })?;
        Ok(Background {
            state,
            thread: Some(thread),
            generation: crate::fork::generation(),
        })
    }

    fn job(&self) -> &Job {
        (*self.state).as_ref()
    }

    /// What the job shares with its thread.
    pub(crate) fn state(&self) -> &T {
        &self.state
    }

    /// Whether it ended, or can go on no more (in a child forked since it was made: its
    /// progress is what it was at the fork).
    pub(crate) fn is_finished(&self) -> bool {
        self.job().finished() || self.forked()
    }

    fn forked(&self) -> bool {
        crate::fork::generation() != self.generation
    }

    /// Stops it after the chunk in progress.
    pub(crate) fn cancel(&self) {
        self.job().cancel();
    }

    /// Waits for its end.
    ///
    /// # Errors
    /// Why it stopped early; [`Error::ReservationLost`] when its thread panicked, or at once in
    /// a child forked since it was made.
    pub(crate) fn wait(&mut self) -> Result<(), Error> {
        if self.forked() {
            return Err(Error::ReservationLost { reason: FORKED });
        }
        if let Some(thread) = self.thread.take() {
            // A panic is recorded by the thread's guard (`EndOnUnwind`).
            let _ = thread.join();
        }
        self.job().error().map_or(Ok(()), Err)
    }
}

/// The end of a job's one-line summary, from its snapshot: `, first in 20 ms, longest driver
/// call 21 ms, 0.10 s; done` (or `; stopped: ERROR`, or nothing while it runs).
pub(crate) struct Tail<'a> {
    first_chunk: Option<Duration>,
    longest_driver_call: Duration,
    elapsed: Duration,
    finished: bool,
    error: &'a Option<Error>,
}

impl Tail<'_> {
    /// The tail of a snapshot with these fields.
    pub(crate) fn of(
        first_chunk: Option<Duration>,
        longest_driver_call: Duration,
        elapsed: Duration,
        finished: bool,
        error: &Option<Error>,
    ) -> Tail<'_> {
        Tail {
            first_chunk,
            longest_driver_call,
            elapsed,
            finished,
            error,
        }
    }
}

impl fmt::Display for Tail<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(first) = self.first_chunk {
            write!(f, ", first in {} ms", first.as_millis())?;
        }
        write!(
            f,
            ", longest driver call {} ms, {:.2} s",
            self.longest_driver_call.as_millis(),
            self.elapsed.as_secs_f64()
        )?;
        match (self.error, self.finished) {
            (Some(e), _) => write!(f, "; stopped: {e}"),
            (None, true) => write!(f, "; done"),
            (None, false) => Ok(()),
        }
    }
}

/// Ends a job whose thread unwinds, so that its handle does not wait for ever.
struct EndOnUnwind<'a>(&'a Job);

impl Drop for EndOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.finish(Err(Error::ReservationLost {
                reason: "its thread panicked",
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::{Background, Job, Tail};
    use crate::Error;

    #[test]
    fn a_job_counts_its_chunks_and_ends_with_its_outcome() {
        let mut done = Background::spawn("job-test", "test thread", Arc::new(Job::new(8)), |job| {
            job.driver_call(Duration::from_millis(3));
            job.chunk_done(4);
            job.chunk_done(4);
            Ok(())
        })
        .unwrap();
        assert_eq!(done.wait(), Ok(()));
        let job = done.state();
        assert!(done.is_finished() && job.finished());
        assert_eq!((job.requested(), job.chunks(), job.bytes()), (8, 2, 8));
        assert_eq!(job.longest_driver_call(), Duration::from_millis(3));
        assert!(job.first_chunk().is_some());
        let tail = Tail::of(
            job.first_chunk(),
            Duration::from_millis(3),
            Duration::ZERO,
            true,
            &None,
        );
        assert!(
            tail.to_string()
                .ends_with(", longest driver call 3 ms, 0.00 s; done"),
            "{tail}"
        );

        let failed = Error::PinningOff;
        let mut stopped = Background::spawn("job-test", "test thread", Arc::new(Job::new(8)), {
            let failed = failed.clone();
            move |_| Err(failed)
        })
        .unwrap();
        assert_eq!(stopped.wait(), Err(failed));
    }

    #[test]
    fn a_job_whose_thread_panics_ends_lost_and_a_cancelled_one_sees_it() {
        let job = Arc::new(Job::new(0));
        job.cancel();
        let mut panicked = Background::spawn("job-test", "test thread", job, |job| {
            // Ends well unless it sees the cancel flag, then panics.
            if !job.cancelled() {
                return Ok(());
            }
            panic!("planted");
        })
        .unwrap();
        assert!(matches!(
            panicked.wait(),
            Err(Error::ReservationLost {
                reason: "its thread panicked"
            })
        ));
        assert!(panicked.is_finished());
    }
}
