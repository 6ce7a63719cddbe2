//! A shared pool's locks pass from a holder only once the kernel says it is gone: a holder in
//! another PID namespace keeps its lock; one killed and not reaped (a zombie), one whose thread
//! id a live process got since, one whose child (which used the pool) lives on, and the holder
//! recorded in a copy of the pool's file all give it up at once. Stray values in the lock's
//! words never fence the pool. A call that cannot take the lock says so (not "freed already").
//! And the edges: a size that overflows, a symbolic link at the path, a sparse pool file.
//!
//! The PID namespaces need root (`unshare(CLONE_NEWPID)`); elsewhere those tests end as
//! `common/require.rs` says.
#![cfg(target_os = "linux")]

#[macro_use]
mod common {
    pub mod pools;
    #[macro_use]
    pub mod require;
}

use std::alloc::Layout;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::pools::{pool_path, small_pool_at, with_pool_lock_held};
use numa_gpu_alloc::{Error, PoolHandle, SharedPool};

const MIB: usize = 1 << 20;
/// Set in a child: `MODE,PATH[,handle]`, what it does.
const CHILD_VAR: &str = "NUMA_GPU_ALLOC_LOCKS_CHILD";
/// Where the registration lock's and the carving lock's words are in a pool's file (the
/// header's `register` and `mutex`, `src/pool/mod.rs`): four `u32`s each.
const LOCKS_AT: [u64; 2] = [108, 124];
/// Long enough for any wait that should end at once; far shorter than the default 30 s.
const WAIT: Duration = Duration::from_secs(3);

/// Runs this test binary again, as a child doing `mode` on `path` (`extra` after them), its
/// stdout piped.
fn spawn(test: &str, spec: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("running the test binary again")
}

/// As [`spawn`], the child being process 1 of a PID namespace of its own; `None` (the test
/// ends as `require.rs` says) where this process may not make one.
fn spawn_in_new_pid_namespace(test: &'static str, spec: String) -> Option<Child> {
    // The namespace is the children's of the thread that unshares: a thread of its own, so
    // that the harness's threads fork into this one's.
    let unshared = std::thread::spawn(move || {
        // SAFETY: unshare changes only the namespace this thread's children are made in.
        if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(spawn(test, &spec))
    });
    match unshared.join().unwrap() {
        Ok(child) => Some(child),
        Err(e) => {
            common::require::met(
                false,
                format_args!("{test} needs root, to make a PID namespace (unshare: {e})"),
            );
            None
        }
    }
}

/// `child`'s stdout, line by line, read on a thread of its own (so that it never blocks on a
/// full pipe).
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let (sent, lines) = mpsc::channel();
    let out = BufReader::new(child.stdout.take().unwrap());
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            let _ = sent.send(line);
        }
    });
    lines
}

/// The next of `lines` that contains `word` (libtest may begin it with its own), from `word` on.
fn line_with(lines: &mpsc::Receiver<String>, word: &str) -> String {
    lines
        .iter()
        .find_map(|l| l.find(word).map(|at| l[at..].to_owned()))
        .unwrap_or_else(|| panic!("the child never said {word:?}"))
}

/// The number after `name` in `line`.
fn field(line: &str, name: &str) -> i64 {
    let at = line
        .find(name)
        .unwrap_or_else(|| panic!("{name:?} in {line:?}"))
        + name.len();
    let digits: String = line[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .ok()
        .unwrap_or_else(|| panic!("a number after {name:?} in {line:?}"))
}

fn gettid() -> i64 {
    // SAFETY: gettid has no preconditions.
    i64::from(unsafe { libc::gettid() })
}

/// What a child started by a test does: `mode` on the pool at `path`.
fn child(spec: &str) {
    let mut f = spec.split(',');
    let (mode, path) = (f.next().unwrap(), Path::new(f.next().unwrap()));
    match mode {
        // Takes the pool's lock and keeps it until killed.
        "hold" => {
            let pool = SharedPool::attach(path).unwrap();
            numa_gpu_alloc::unstable::hold_pool_lock(&pool, || {
                println!("holding tid {}", gettid());
                std::thread::sleep(Duration::from_secs(60));
            })
            .unwrap();
        }
        // Attaches (which takes the lock) while another process holds it, then reads the flag
        // its holder sets just before it lets go.
        "flag" => {
            let words: Vec<u64> = f.map(|w| w.parse().unwrap()).collect();
            let flag = PoolHandle {
                offset: words[0],
                len: words[1],
                pool: words[2] as u32,
                serial: words[3] as u32,
            };
            // SAFETY: getpid has no preconditions.
            println!("attaching as pid {}", unsafe { libc::getpid() });
            let pool = SharedPool::attacher()
                .lock_wait(Duration::from_secs(20))
                .attach(path)
                .unwrap();
            let ptr = pool.ptr(flag).unwrap();
            // SAFETY: the flag's block, a word of the pool's mapping, read as an atomic.
            let seen = unsafe { &*ptr.as_ptr().cast::<AtomicU64>() }.load(Ordering::Acquire);
            let carved = pool.allocate(Layout::from_size_align(4096, 64).unwrap());
            println!(
                "flag {seen} carved {} rebuilds {}",
                u8::from(carved.is_some()),
                pool.stats().rebuilds
            );
        }
        // As process 1 of a PID namespace: a holder is killed and reaped, a process that never
        // used the pool gets its thread id, and then this one attaches.
        "reuse" => reuse_the_holders_id(path),
        other => panic!("no child mode {other}"),
    }
}

fn reuse_the_holders_id(path: &Path) {
    let test = "a_live_process_given_a_dead_holders_thread_id_does_not_hold_the_lock";
    let mut holder = spawn(test, &format!("hold,{}", path.display()));
    let tid = field(
        &line_with(&lines_of(&mut holder), "holding tid"),
        "holding tid",
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    // The next process this namespace makes gets the holder's thread id.
    std::fs::write("/proc/sys/kernel/ns_last_pid", (tid - 1).to_string()).unwrap();
    let mut stranger = Command::new("sleep").arg("60").spawn().unwrap();
    println!("holder's tid {tid}, stranger's pid {}", stranger.id());
    let start = Instant::now();
    let attached = SharedPool::attacher().lock_wait(WAIT).attach(path);
    let took = start.elapsed().as_millis();
    let _ = stranger.kill();
    let _ = stranger.wait();
    match attached {
        Ok(pool) => println!("attached in {took} ms rebuilds {}", pool.stats().rebuilds),
        Err(e) => println!("attached in {took} ms error {e}"),
    }
}

/// Sets the flag word in `flag` just before the lock is let go of.
fn set(pool: &SharedPool, flag: PoolHandle) {
    let ptr = pool.ptr(flag).unwrap();
    // SAFETY: the flag's block, a word of the pool's mapping, written as an atomic.
    unsafe { &*ptr.as_ptr().cast::<AtomicU64>() }.store(1, Ordering::Release);
}

#[test]
fn a_holder_in_another_pid_namespace_keeps_the_lock() {
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        return child(&spec);
    }
    let test = "a_holder_in_another_pid_namespace_keeps_the_lock";
    let path = pool_path("pidns");
    let pool = small_pool_at(&path);
    let flag = pool
        .allocate_handle(Layout::from_size_align(64, 64).unwrap())
        .unwrap();
    let spec = format!(
        "flag,{},{},{},{},{}",
        path.display(),
        flag.offset,
        flag.len,
        flag.pool,
        flag.serial
    );
    let (sent, told) = mpsc::channel();
    let outcome = numa_gpu_alloc::unstable::hold_pool_lock(&pool, || {
        let mut other = spawn_in_new_pid_namespace(test, spec)?;
        let lines = lines_of(&mut other);
        let pid = field(&line_with(&lines, "attaching as pid"), "attaching as pid");
        // Its attach waits for this lock, or takes it from under this process.
        std::thread::sleep(Duration::from_millis(500));
        set(&pool, flag);
        let _ = sent.send((other, lines));
        Some(pid)
    })
    .unwrap();
    let Some(pid) = outcome else {
        std::fs::remove_file(&path).unwrap();
        return;
    };
    let (mut other, lines) = told.recv().unwrap();
    let status = other.wait().unwrap();
    let said = line_with(&lines, "flag");
    std::fs::remove_file(&path).unwrap();
    println!("the other namespace's process {pid} said: {said}");
    assert_eq!(pid, 1, "the other process is its namespace's first");
    assert!(status.success(), "{said}");
    assert!(
        said.contains("flag 1 carved 1 rebuilds 0"),
        "it took the lock from a live holder: {said}"
    );
    assert_eq!(pool.stats().rebuilds, 0);
}

/// Forks a process that runs `f` with the write end of a pipe, then waits to be killed; it never
/// returns into the harness, nor runs the exit handlers (one whose `f` panicked ends at once,
/// closing the pipe). Its pid, and the read end.
fn fork_then_wait(f: impl FnOnce(&mut File)) -> (libc::pid_t, File) {
    let mut pipe = [0; 2];
    // SAFETY: pipe2 fills the two descriptors.
    assert_eq!(
        unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) },
        0
    );
    // SAFETY: descriptors just made, owned by these files alone.
    let (read, mut write) = unsafe { (File::from_raw_fd(pipe[0]), File::from_raw_fd(pipe[1])) };
    // SAFETY: the child runs `f`, then waits for its kill; it leaves through `_exit` only.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        drop(read);
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut write))).is_err() {
            // SAFETY: ends the child without the harness's exit handlers.
            unsafe { libc::_exit(1) };
        }
        wait_for_the_kill();
    }
    assert!(pid > 0, "fork failed");
    (pid, read)
}

fn wait_for_the_kill() -> ! {
    loop {
        // SAFETY: waits for a signal.
        unsafe { libc::pause() };
    }
}

/// Holds `pool`'s lock from now until the process is killed, once it said `word` on `pipe`.
fn hold_until_killed(pool: &SharedPool, pipe: &mut File, word: &[u8]) {
    numa_gpu_alloc::unstable::hold_pool_lock(pool, || {
        pipe.write_all(word).unwrap();
        wait_for_the_kill()
    })
    .unwrap();
}

fn kill(pid: libc::pid_t) {
    // SAFETY: a process of this test's.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
}

fn reap(pid: libc::pid_t) {
    // SAFETY: waits for a child of this process's.
    assert_eq!(unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) }, pid);
}

/// A pool at `path` (a file left there before is removed) whose lock waits are [`WAIT`].
fn waiting_pool_at(path: &Path) -> SharedPool {
    let _ = std::fs::remove_file(path);
    SharedPool::builder(8 * MIB)
        .node(0)
        .chunk(2 * MIB)
        .path(path)
        .lock_wait(WAIT)
        .create()
        .unwrap()
}

/// How long `pool` takes to carve a block, and whether it did.
fn carve_timed(pool: &SharedPool) -> (bool, Duration) {
    let start = Instant::now();
    let carved = pool.allocate_handle(Layout::from_size_align(4096, 64).unwrap());
    (carved.is_some(), start.elapsed())
}

#[test]
fn a_killed_holder_not_yet_reaped_gives_the_lock_up_at_once() {
    let path = pool_path("zombie");
    let pool = waiting_pool_at(&path);
    // The holder holds the lock on its main thread: killed, that thread stays a zombie until
    // reaped (the others go at once).
    let (holder, mut told) = fork_then_wait(|pipe| {
        hold_until_killed(&SharedPool::attach(&path).unwrap(), pipe, b"h");
    });
    told.read_exact(&mut [0])
        .expect("the holder holds the lock");
    kill(holder);
    // Not waited for: a zombie until this process reaps it.
    let stat = format!("/proc/{holder}/stat");
    let zombie = |s: String| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z'))
    };
    while !std::fs::read_to_string(&stat).is_ok_and(zombie) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (carved, took) = carve_timed(&pool);
    reap(holder);
    std::fs::remove_file(&path).unwrap();
    println!("carved: {carved}, in {took:?}, past a zombie holder");
    assert!(carved && took < Duration::from_secs(1), "{took:?}");
    assert_eq!(
        pool.stats().rebuilds,
        1,
        "checked once, after its holder died"
    );
}

#[test]
fn a_child_that_used_its_parents_pool_does_not_keep_the_dead_parents_lock() {
    let path = pool_path("forked");
    let pool = waiting_pool_at(&path);
    let (parent, mut told) = fork_then_wait(|pipe| {
        let pool = SharedPool::attach(&path).unwrap();
        let (child, mut heard) = fork_then_wait(|pipe| {
            // Its copy of its parent's pool, used: keys of its own, the parent's let go of.
            pool.allocate_handle(Layout::from_size_align(64, 64).unwrap())
                .unwrap();
            pipe.write_all(b"c").unwrap();
        });
        heard.read_exact(&mut [0]).unwrap();
        hold_until_killed(&pool, pipe, &child.to_ne_bytes());
    });
    let mut child = [0; 4];
    told.read_exact(&mut child)
        .expect("the parent holds the lock");
    kill(parent);
    reap(parent);
    let (carved, took) = carve_timed(&pool);
    // Its grandchild, reaped by whoever it was given to.
    kill(libc::pid_t::from_ne_bytes(child));
    std::fs::remove_file(&path).unwrap();
    println!("carved: {carved}, in {took:?}, the dead holder's child alive");
    assert!(carved && took < Duration::from_secs(1), "{took:?}");
}

#[test]
fn a_live_process_given_a_dead_holders_thread_id_does_not_hold_the_lock() {
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        return child(&spec);
    }
    let test = "a_live_process_given_a_dead_holders_thread_id_does_not_hold_the_lock";
    let path = pool_path("reuse");
    let _pool = small_pool_at(&path);
    let Some(mut init) = spawn_in_new_pid_namespace(test, format!("reuse,{}", path.display()))
    else {
        std::fs::remove_file(&path).unwrap();
        return;
    };
    let lines = lines_of(&mut init);
    let said = format!(
        "{}\n{}",
        line_with(&lines, "holder's tid"),
        line_with(&lines, "attached in")
    );
    init.wait().unwrap();
    std::fs::remove_file(&path).unwrap();
    println!("{said}");
    assert_eq!(
        field(&said, "holder's tid"),
        field(&said, "stranger's pid"),
        "the id was given again"
    );
    assert!(field(&said, "attached in") < 1000, "{said}");
    assert!(said.contains("rebuilds 1"), "{said}");
}

#[test]
fn a_copy_of_a_pool_made_while_it_was_locked_attaches_at_once() {
    let path = pool_path("original");
    let copy = pool_path("copy");
    let pool = small_pool_at(&path);
    let _ = std::fs::remove_file(&copy);
    numa_gpu_alloc::unstable::hold_pool_lock(&pool, || std::fs::copy(&path, &copy).unwrap())
        .unwrap();
    let start = Instant::now();
    let attached = SharedPool::attacher().lock_wait(WAIT).attach(&copy);
    let took = start.elapsed();
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(&copy).unwrap();
    let attached = attached.expect("the copy attaches");
    println!("the copy attached in {took:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert_eq!(attached.stats().rebuilds, 1, "its state checked once");
    assert_eq!(pool.stats().rebuilds, 0, "the original is left as it was");
}

#[test]
fn calls_that_cannot_take_the_lock_say_so() {
    let path = pool_path("busy");
    let _ = std::fs::remove_file(&path);
    let pool = SharedPool::builder(8 * MIB)
        .node(0)
        .path(&path)
        .lock_wait(Duration::from_millis(200))
        .create()
        .unwrap();
    let other = SharedPool::attacher()
        .lock_wait(Duration::from_millis(200))
        .attach(&path)
        .unwrap();
    let handle = pool
        .allocate_handle(Layout::from_size_align(4096, 64).unwrap())
        .unwrap();
    let told = with_pool_lock_held(&pool, || {
        let mut told = Vec::new();
        // By another thread of this attachment, and by another attachment.
        for who in [&pool, &other] {
            // SAFETY: the test's block, used by nobody; refused while the lock is held.
            told.push(unsafe { who.free(handle) }.map(|()| "freed".to_owned()));
            told.push(who.is_live(handle).map(|live| format!("live {live}")));
            let ptr = who.ptr(handle).unwrap();
            told.push(who.handle_of(ptr).map(|h| format!("handle {h:?}")));
        }
        told
    });
    for said in &told {
        println!("{said:?}");
        let e = said.as_ref().expect_err("the lock is held");
        assert!(
            matches!(e, Error::PoolLockHeld { lock: "carving", pid: Some(pid), .. } if *pid == std::process::id()),
            "{e}"
        );
        assert!(e.to_string().contains("alive"), "{e}");
    }
    assert!(pool.is_live(handle).unwrap());
    assert_eq!(
        other.handle_of(other.ptr(handle).unwrap()).unwrap(),
        Some(handle)
    );
    // SAFETY: the test's block, used by nobody.
    unsafe { other.free(handle) }.unwrap();
    assert!(!pool.is_live(handle).unwrap());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn stray_values_in_the_lock_words_never_fence_the_pool() {
    let path = pool_path("words");
    let _ = std::fs::remove_file(&path);
    let pool = SharedPool::builder(8 * MIB)
        .node(0)
        .path(&path)
        .lock_wait(WAIT)
        .create()
        .unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let layout = Layout::from_size_align(4096, 64).unwrap();
    let start = Instant::now();
    for lock in LOCKS_AT {
        for word in 0..4 {
            for value in [1u32, 2, 3, 0x5eed_1234, u32::MAX] {
                file.write_all_at(&value.to_ne_bytes(), lock + 4 * word)
                    .unwrap();
                let carved = pool.allocate_handle(layout);
                let registered = numa_gpu_alloc::unstable::hold_registration_lock(&pool, || ());
                assert!(
                    carved.is_some() && registered.is_ok(),
                    "{value:#x} at {}: {registered:?}",
                    lock + 4 * word
                );
                // SAFETY: the test's block, used by nobody.
                unsafe { pool.free(carved.unwrap()) }.unwrap();
            }
        }
    }
    let took = start.elapsed();
    let stats = pool.stats();
    std::fs::remove_file(&path).unwrap();
    println!("40 stray values in {took:?}: {stats:?}");
    assert!(took < WAIT, "no wait ran to its deadline");
    assert_eq!(stats.live_blocks, 0);
}

#[test]
fn a_pool_of_usize_max_bytes_is_too_large_not_a_panic() {
    let e = SharedPool::builder(usize::MAX)
        .node(0)
        .create()
        .unwrap_err();
    println!("{e}");
    assert!(matches!(e, Error::PoolTooLarge { node: 0, .. }), "{e}");
}

#[test]
fn attach_refuses_a_symbolic_link() {
    let path = pool_path("target");
    let link = pool_path("link");
    let _pool = small_pool_at(&path);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&path, &link).unwrap();
    let attached = SharedPool::attach(&link).map(drop);
    std::fs::remove_file(&link).unwrap();
    std::fs::remove_file(&path).unwrap();
    let e = attached.expect_err("attached through a symbolic link");
    println!("{e}");
    assert!(matches!(e, Error::PoolSymlink { .. }), "{e}");
    assert!(e.to_string().contains("symbolic link"), "{e}");
}

#[test]
fn a_sparse_pool_file_is_refused_as_damaged_and_not_filled() {
    let path = pool_path("sparse");
    let _pool = small_pool_at(&path);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    // Its blocks' pages dropped: the header says 8 MiB, 2 are there.
    // SAFETY: fallocate on a descriptor of the test's file touches no memory of ours.
    let punched = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            2 * MIB as i64,
            6 * MIB as i64,
        )
    };
    assert_eq!(punched, 0, "{}", std::io::Error::last_os_error());
    let blocks = || std::fs::metadata(&path).unwrap().blocks();
    let before = blocks();
    let attached = SharedPool::attach(&path).map(drop);
    let after = blocks();
    std::fs::remove_file(&path).unwrap();
    let e = attached.expect_err("a sparse pool attached");
    println!("{e}");
    assert!(matches!(e, Error::PoolSparse { .. }), "{e}");
    assert!(e.to_string().contains("damaged"), "{e}");
    assert_eq!(before, after, "the attach allocated pages of the file");
}
