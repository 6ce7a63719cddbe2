//! One shared pool, several processes: each attaches by an inherited descriptor, allocates and
//! frees at random, fills its blocks with a tag of its own, and reads the others' blocks at the
//! handles they publish; a tag found wrong is two live blocks overlapping. Then a process is
//! killed with SIGKILL while it holds the pool's lock, and the others must finish. Last, what
//! an allocate and free pair costs, in one process and in two at once (the pool's lock).
//!
//! Run: `cargo run --release --example shared_pool -- --processes 8 [--ops 2000]` (Linux).

#[path = "support/cli.rs"]
mod cli;
#[cfg(target_os = "linux")]
#[path = "support/shared_workload.rs"]
mod shared_workload;

const USAGE: &str = "usage: shared_pool [--processes N] [--ops N]
  --processes N  processes attached to one pool (default 8)
  --ops N        allocate/free steps per process (default 2000)
Prints `processes N: ... overlaps 0`, the run with a process killed holding the lock, then
the time of an allocate and free pair in one process and in two at once.";

#[cfg(target_os = "linux")]
fn main() {
    if shared_workload::child() {
        return;
    }
    let (mut processes, mut ops) = (8usize, 2000u64);
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        if cli::is_help(&arg) {
            cli::help(USAGE);
        }
        let mut value = |name: &str| -> u64 { cli::option_value(&mut args, name, USAGE) };
        match arg.to_string_lossy().as_ref() {
            "--processes" => processes = value("--processes").max(1) as usize,
            "--ops" => ops = value("--ops"),
            other => cli::usage_error(format_args!("unknown argument {other:?}"), USAGE),
        }
    }
    let exe = std::env::current_exe().expect("the running program");
    let command = || std::process::Command::new(&exe);
    let s = shared_workload::run(processes, ops, false, command);
    println!(
        "processes {}: {} operations, {} reads of others' blocks, {}/{} finished, overlaps {} ({:.2} s)",
        s.processes, s.operations, s.cross_reads, s.finished, s.processes, s.overlaps,
        s.elapsed.as_secs_f64()
    );
    let k = shared_workload::run(processes, ops / 4, true, command);
    let ok = k.finished == processes && k.overlaps == 0 && k.rebuilds >= 1;
    println!(
        "killed 1 process holding the pool's lock: {}/{} others finished, {} operations, state rebuilt {} time(s), overlaps {}: {}",
        k.finished, processes, k.operations, k.rebuilds, k.overlaps,
        if ok { "ok" } else { "FAILED" }
    );
    let pairs = (ops * 100).max(1000);
    let one = shared_workload::pair_cost(1, pairs, command);
    let two = shared_workload::pair_cost(2, pairs, command);
    println!(
        "allocate+free pairs ({pairs} each): 1 process {one:.0} ns/pair, 2 processes at once {two:.0} ns/pair each"
    );
    if s.overlaps != 0 || s.finished != processes || !ok {
        std::process::exit(1);
    }
}

#[cfg(not(target_os = "linux"))]
fn main() {
    let _ = USAGE;
    eprintln!("shared pools are Linux-only");
}
