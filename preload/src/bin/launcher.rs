//! `numa-gpu-alloc run [--gpu N] -- CMD [ARGS…]`: runs CMD with `libnuma_gpu_alloc.so`
//! preloaded, so that its large `malloc`s are placed on the node nearest GPU N.
//!
//! It sets, keeping what the caller already set:
//! - `LD_PRELOAD`: the library (next to this program, or `NUMA_GPU_ALLOC_LIBRARY`) first, then
//!   the caller's entries;
//! - `NUMA_GPU_ALLOC`: `bulk_max=256MiB` (a GPU program's pinned buffers are populated in bulk
//!   by the node's workers before the framework registers them, as the crate does, instead of
//!   faulted in by the registration on one thread), then the caller's settings, then `gpu=N`
//!   for `--gpu N` (later entries win);
//! - `PYTORCH_CUDA_ALLOC_CONF`: the caller's value, with `pinned_use_cuda_host_register:True`
//!   added unless it names that key: PyTorch then takes pinned memory from `malloc` (placed by
//!   the library) and registers it itself, instead of `cudaHostAlloc`, which no preload sees.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The library's file names next to this program, in the order looked for: as cargo builds it
/// (the package's library is `numa_gpu_alloc_preload`, since `numa_gpu_alloc` is the crate's),
/// then as shipped in the wheel. Cargo's first: a target folder may still hold a
/// `libnuma_gpu_alloc.so` of an older build, which cargo no longer updates.
const LIBRARY: [&str; 2] = ["libnuma_gpu_alloc_preload.so", "libnuma_gpu_alloc.so"];
/// Names the library to preload instead of the one next to this program.
const LIBRARY_VAR: &str = "NUMA_GPU_ALLOC_LIBRARY";
const PYTORCH_VAR: &str = "PYTORCH_CUDA_ALLOC_CONF";
const PYTORCH_KEY: &str = "pinned_use_cuda_host_register";

const USAGE: &str = "usage: numa-gpu-alloc run [--gpu N] -- CMD [ARGS...]

Runs CMD with libnuma_gpu_alloc.so (next to this program, or NUMA_GPU_ALLOC_LIBRARY) preloaded: its malloc/posix_memalign/aligned_alloc requests of
at least the threshold (2 MiB) are placed on the NUMA node nearest the GPU. Settings come from
NUMA_GPU_ALLOC (see the crate's README), over bulk_max=256MiB (buffers populated in bulk, as a
GPU program's pinned memory wants); --gpu N adds gpu=N. PyTorch is told to register the
pinned memory it takes from malloc (PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
merged with the caller's value).";

/// What the command line asked for.
#[derive(Debug, PartialEq)]
struct Run {
    gpu: Option<u32>,
    command: Vec<OsString>,
}

fn parse(args: &[OsString]) -> Result<Run, String> {
    let mut rest = args.iter();
    match rest.next().and_then(|a| a.to_str()) {
        Some("run") => {}
        Some("-h" | "--help") => return Err(String::new()),
        other => return Err(format!("expected `run`, got {other:?}")),
    }
    let mut gpu = None;
    while let Some(arg) = rest.next() {
        match arg.to_str() {
            Some("--") => {
                let command: Vec<OsString> = rest.cloned().collect();
                if command.is_empty() {
                    return Err("no command after `--`".into());
                }
                return Ok(Run { gpu, command });
            }
            Some("--gpu") => {
                let value = rest.next().and_then(|v| v.to_str()).unwrap_or("");
                let n = value.parse().map_err(|_| {
                    format!("--gpu takes a CUDA device index (0, 1, ...), got {value:?}")
                })?;
                gpu = Some(n);
            }
            Some("-h" | "--help") => return Err(String::new()),
            _ => {
                return Err(format!(
                    "unknown option {arg:?} (the command goes after `--`)"
                ))
            }
        }
    }
    Err("no `--` before the command".into())
}

/// `LD_PRELOAD` with `library` first and the caller's other entries after it.
fn preload(library: &Path, existing: Option<&str>) -> OsString {
    let mut value = OsString::from(library);
    let lib = library.to_string_lossy();
    for entry in existing.unwrap_or("").split([':', ' ']) {
        if !entry.is_empty() && entry != lib {
            value.push(":");
            value.push(entry);
        }
    }
    value
}

/// The launcher's default under the caller's settings: the crate's bulk populate bound, where the
/// library alone keeps overcommit (`bulk_max=0`). PyTorch's pinned blocks, taken from `malloc`
/// and registered once, are never freed for the library to learn they were written whole.
const GPU_DEFAULTS: &str = "bulk_max=256MiB";

/// `NUMA_GPU_ALLOC`: the launcher's defaults, the caller's settings, then `gpu=N` (which wins).
fn settings(existing: Option<&str>, gpu: Option<u32>) -> String {
    let mut all = vec![GPU_DEFAULTS.to_owned()];
    all.extend(existing.filter(|s| !s.is_empty()).map(str::to_owned));
    all.extend(gpu.map(|n| format!("gpu={n}")));
    all.join(",")
}

/// `PYTORCH_CUDA_ALLOC_CONF` with the register flag added, unless the caller set that key.
fn pytorch_conf(existing: Option<&str>) -> String {
    let flag = format!("{PYTORCH_KEY}:True");
    match existing.filter(|s| !s.trim().is_empty()) {
        None => flag,
        Some(theirs)
            if theirs
                .split(',')
                .any(|e| e.split(':').next().map(str::trim) == Some(PYTORCH_KEY)) =>
        {
            theirs.to_owned()
        }
        Some(theirs) => format!("{theirs},{flag}"),
    }
}

/// The library `NUMA_GPU_ALLOC_LIBRARY` names, or the one next to this program.
fn library() -> Result<PathBuf, String> {
    if let Some(named) = std::env::var_os(LIBRARY_VAR) {
        let lib = PathBuf::from(named);
        return match lib.is_file() {
            true => Ok(lib),
            false => Err(format!("{LIBRARY_VAR}={} is not a file", lib.display())),
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("finding this program's path: {e}"))?;
    LIBRARY
        .iter()
        .map(|name| exe.with_file_name(name))
        .find(|lib| lib.is_file())
        .ok_or_else(|| {
            format!(
                "neither {} nor {} found next to {}: build it (`cargo build --release` builds \
                 both), install the wheel, or name it in {LIBRARY_VAR}",
                LIBRARY[0],
                LIBRARY[1],
                exe.display()
            )
        })
}

fn env_str(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let run = match parse(&args) {
        Ok(run) => run,
        Err(why) if why.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(why) => {
            eprintln!("numa-gpu-alloc: {why}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let library = match library() {
        Ok(lib) => lib,
        Err(why) => {
            eprintln!("numa-gpu-alloc: {why}");
            return ExitCode::from(2);
        }
    };
    let mut command = Command::new(&run.command[0]);
    command.args(&run.command[1..]);
    command.env(
        "LD_PRELOAD",
        preload(&library, env_str("LD_PRELOAD").as_deref()),
    );
    command.env(
        numa::ENV_VAR,
        settings(env_str(numa::ENV_VAR).as_deref(), run.gpu),
    );
    command.env(PYTORCH_VAR, pytorch_conf(env_str(PYTORCH_VAR).as_deref()));
    let error = command.exec();
    eprintln!(
        "numa-gpu-alloc: running {:?}: {error}",
        run.command[0].to_string_lossy()
    );
    ExitCode::from(127)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_command_follows_the_double_dash() {
        let run = parse(&args(&["run", "--gpu", "3", "--", "python", "-c", "1"])).unwrap();
        assert_eq!(run.gpu, Some(3));
        assert_eq!(run.command, args(&["python", "-c", "1"]));
        assert!(parse(&args(&["run", "python"])).is_err());
        assert!(parse(&args(&["run", "--gpu", "x", "--", "ls"])).is_err());
        assert!(parse(&args(&["run", "--"])).is_err());
    }

    #[test]
    fn the_callers_values_are_kept() {
        let lib = Path::new("/opt/libnuma_gpu_alloc.so");
        assert_eq!(preload(lib, None), "/opt/libnuma_gpu_alloc.so");
        assert_eq!(
            preload(lib, Some("/a.so /opt/libnuma_gpu_alloc.so:/b.so")),
            "/opt/libnuma_gpu_alloc.so:/a.so:/b.so"
        );
        assert_eq!(settings(None, None), "bulk_max=256MiB");
        assert_eq!(
            settings(Some("stats=exit,bulk_max=0"), None),
            "bulk_max=256MiB,stats=exit,bulk_max=0"
        );
        assert_eq!(
            settings(Some("stats=exit,gpu=0"), Some(1)),
            "bulk_max=256MiB,stats=exit,gpu=0,gpu=1"
        );
        assert_eq!(pytorch_conf(None), "pinned_use_cuda_host_register:True");
        assert_eq!(
            pytorch_conf(Some("expandable_segments:True")),
            "expandable_segments:True,pinned_use_cuda_host_register:True"
        );
        assert_eq!(
            pytorch_conf(Some("pinned_use_cuda_host_register:False")),
            "pinned_use_cuda_host_register:False"
        );
    }
}
