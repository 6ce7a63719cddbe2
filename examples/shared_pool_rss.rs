//! Resident memory and start-up time of processes sharing one pool against processes with pools
//! of their own: eight processes attach one pool (map only: the pages are the creator's, placed
//! and populated once) or each make and populate its own; each reports its resident set
//! (`VmRSS`, `RssShmem`) and proportional share (`Pss`, from `/proc/self/smaps_rollup`; the
//! parent's added) while all are alive, and how long it took until it could use the pool.
//!
//! Run: `cargo run --release --example shared_pool_rss -- [--gib N] [--processes N]` (Linux;
//! defaults 1 GiB and 8). Without a CUDA driver nothing is registered: the times are map and
//! populate only, said so.

#[path = "support/cli.rs"]
mod cli;

const USAGE: &str = "usage: shared_pool_rss [--gib N] [--processes N]
  --gib N        the pool's size in GiB (default 1)
  --processes N  processes (default 8)
Prints the PSS and RSS of N processes sharing one pool against N pools of their own.";

#[cfg(target_os = "linux")]
mod run {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::process::{Child, Command, Stdio};
    use std::time::Instant;

    use numa_gpu_alloc::{cuda_driver_present, GpuSelector, SharedPool};

    const CHILD_ENV: &str = "NUMA_GPU_ALLOC_RSS_CHILD";
    const GIB: f64 = (1u64 << 30) as f64;

    /// `key:` of a `/proc/self` file, in bytes.
    fn kib_field(file: &str, key: &str) -> u64 {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kib| kib << 10)
    }

    /// In a child: attach (`attach:FD`) or make its own pool (`own:BYTES`), report, wait for
    /// the parent to close our stdin.
    pub fn child() -> bool {
        let Ok(spec) = std::env::var(CHILD_ENV) else {
            return false;
        };
        let (mode, value) = spec.split_once(':').unwrap();
        let start = Instant::now();
        let pool = if mode == "attach" {
            // SAFETY: the descriptor the parent left open for us.
            let fd = unsafe { OwnedFd::from_raw_fd(value.parse().unwrap()) };
            SharedPool::attach_fd(fd).expect("attaching")
        } else {
            SharedPool::builder(value.parse().unwrap())
                .node(0)
                .create()
                .expect("making a pool of its own")
        };
        if cuda_driver_present() {
            if let Ok(r) = pool.register_in_background(GpuSelector::Auto, usize::MAX) {
                let _ = r.wait();
            }
        }
        let ready = start.elapsed();
        println!(
            "ready_us {} rss {} shmem {} pss {}",
            ready.as_micros(),
            kib_field("/proc/self/status", "VmRSS:"),
            kib_field("/proc/self/status", "RssShmem:"),
            kib_field("/proc/self/smaps_rollup", "Pss:")
        );
        std::io::stdout().flush().unwrap();
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        drop(pool);
        true
    }

    #[derive(Default)]
    struct Sum {
        ready_ms: Vec<f64>,
        rss: u64,
        shmem: u64,
        pss: u64,
    }

    fn measure(processes: usize, spec: &str) -> Sum {
        let exe = std::env::current_exe().unwrap();
        let mut children: Vec<Child> = (0..processes)
            .map(|_| {
                Command::new(&exe)
                    .env(CHILD_ENV, spec)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("a child")
            })
            .collect();
        let mut sum = Sum::default();
        for child in &mut children {
            let mut line = String::new();
            BufReader::new(child.stdout.as_mut().unwrap())
                .read_line(&mut line)
                .unwrap();
            let f: Vec<&str> = line.split_whitespace().collect();
            let num = |i: usize| f[i].parse::<u64>().unwrap();
            sum.ready_ms.push(num(1) as f64 / 1000.0);
            sum.rss += num(3);
            sum.shmem += num(5);
            sum.pss += num(7);
        }
        // While every child is alive: the creator's share (it maps the shared pool too).
        sum.pss += kib_field("/proc/self/smaps_rollup", "Pss:");
        for mut child in children {
            drop(child.stdin.take());
            child.wait().unwrap();
        }
        sum
    }

    pub fn main(gib: f64, processes: usize) {
        let bytes = (gib * GIB) as usize;
        let model = std::fs::read_to_string("/proc/cpuinfo")
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .unwrap_or("?")
            .trim()
            .to_owned();
        let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
        let date = Command::new("date")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        println!("machine: {model}, {cpus} CPUs; {date}");
        let pinned = if cuda_driver_present() {
            "map + register"
        } else {
            "no CUDA driver: map only, nothing registered"
        };
        let start = Instant::now();
        let pool = SharedPool::builder(bytes)
            .node(0)
            .inherit(true)
            .create()
            .expect("the pool");
        let made_ms = start.elapsed().as_secs_f64() * 1e3;
        let pool_bytes = pool.stats().pool_bytes as f64;
        let shared = measure(processes, &format!("attach:{}", pool.fd().as_raw_fd()));
        drop(pool);
        let own = measure(processes, &format!("own:{bytes}"));
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (mut s, mut o) = (shared.ready_ms, own.ready_ms);
        println!(
            "{processes} processes sharing one {gib} GiB pool: PSS {:.3} GiB in total (the creator's \
             included) = {:.3}x one pool; RSS {:.2} GiB summed (RssShmem {:.2}), each counting \
             the shared pages",
            shared.pss as f64 / GIB,
            shared.pss as f64 / pool_bytes,
            shared.rss as f64 / GIB,
            shared.shmem as f64 / GIB
        );
        println!(
            "{processes} processes with a pool each: PSS {:.3} GiB in total (the parent's \
             included) = {:.3}x one pool; RSS {:.2} GiB summed",
            own.pss as f64 / GIB,
            own.pss as f64 / pool_bytes,
            own.rss as f64 / GIB
        );
        println!(
            "until usable ({pinned}), median of {processes}: attach {:.1} ms, own pool {:.1} ms \
             (the shared pool was made once in {made_ms:.1} ms)",
            median(&mut s),
            median(&mut o)
        );
    }
}

#[cfg(target_os = "linux")]
fn main() {
    if run::child() {
        return;
    }
    let (mut gib, mut processes) = (1.0f64, 8usize);
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        if cli::is_help(&arg) {
            cli::help(USAGE);
        }
        let mut value = |name: &str| -> f64 { cli::option_value(&mut args, name, USAGE) };
        match arg.to_string_lossy().as_ref() {
            "--gib" => gib = value("--gib"),
            "--processes" => processes = (value("--processes") as usize).max(1),
            other => cli::usage_error(format_args!("unknown argument {other:?}"), USAGE),
        }
    }
    run::main(gib, processes);
}

#[cfg(not(target_os = "linux"))]
fn main() {
    let _ = USAGE;
    eprintln!("shared pools are Linux-only");
}
