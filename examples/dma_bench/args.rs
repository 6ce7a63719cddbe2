//! `dma_bench`'s command line.

use numa_gpu_alloc::GpuSelector;

use super::{cli, GIB, MIB};

/// Printed by `--help` (stdout) and after a bad argument (stderr).
pub(super) const USAGE: &str = "\
usage: dma_bench [--cold-sizes S,..] [--numa-sizes S,..|none] [--reps N] [--scaling-size S]
                 [--threads N,..] [--bw-sizes S,..] [--runs N] [--gpu auto|N]
                 [--max-seconds N] [--json-out FILE]
  --cold-sizes    cold-cost block sizes (default 1GiB,16GiB; skipped when memory is short)
  --numa-sizes    more sizes for ours vs CUDA's host-NUMA memory, cold (default 64GiB)
  --reps          cold-cost samples per method, alternated; the median is reported (default 3)
  --scaling-size  block for populate scaling (default 4GiB)
  --threads       populate thread counts (default 1,2,4,8,16)
  --bw-sizes      bandwidth sizes (default 4MiB,16MiB,64MiB,256MiB,1GiB)
  --runs          bandwidth samples per size and direction, median reported (default 5)
  --gpu           CUDA device ordinal, or auto (LOCAL_RANK etc.; default)
  --max-seconds   skip the sections that would start after this many seconds
  --json-out      also write every row as JSON to FILE
The tables go to stdout; a line on stderr says what each long step is doing.";

pub(super) struct Args {
    pub(super) cold_sizes: Vec<usize>,
    pub(super) numa_sizes: Vec<usize>,
    pub(super) reps: usize,
    pub(super) scaling_size: usize,
    pub(super) threads: Vec<usize>,
    pub(super) bw_sizes: Vec<usize>,
    pub(super) runs: usize,
    pub(super) gpu: GpuSelector,
    pub(super) max_seconds: Option<u64>,
    pub(super) json_out: Option<String>,
}

fn parse_sizes(v: &str) -> Result<Vec<usize>, String> {
    v.split(',')
        .map(|s| {
            numa_gpu_alloc::unstable::parse_size(s)
                .filter(|&b| b > 0)
                .ok_or_else(|| format!("bad size {s:?}: expected e.g. 64MiB or 1GiB"))
        })
        .collect()
}

fn parse_count(v: &str) -> Result<usize, String> {
    v.parse()
        .ok()
        .filter(|&n: &usize| n > 0)
        .ok_or_else(|| format!("bad count {v:?}: expected a whole number above 0"))
}

/// The arguments, or what is wrong with them (the caller prints the usage with it).
pub(super) fn parse_args() -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut args = Args {
        cold_sizes: vec![GIB, 16 * GIB],
        numa_sizes: vec![64 * GIB],
        reps: 3,
        scaling_size: 4 * GIB,
        threads: vec![1, 2, 4, 8, 16],
        bw_sizes: vec![4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB],
        runs: 5,
        gpu: GpuSelector::Auto,
        max_seconds: None,
        json_out: None,
    };
    let mut parser = lexopt::Parser::from_env();
    let usage = |e: lexopt::Error| e.to_string();
    let value = |parser: &mut lexopt::Parser| -> Result<String, String> {
        parser.value().map_err(usage)?.string().map_err(usage)
    };
    while let Some(arg) = parser.next().map_err(usage)? {
        match arg {
            Long("cold-sizes") => args.cold_sizes = parse_sizes(&value(&mut parser)?)?,
            Long("numa-sizes") => {
                args.numa_sizes = match value(&mut parser)?.as_str() {
                    "none" => Vec::new(),
                    v => parse_sizes(v)?,
                }
            }
            Long("reps") => args.reps = parse_count(&value(&mut parser)?)?,
            Long("scaling-size") => args.scaling_size = parse_sizes(&value(&mut parser)?)?[0],
            Long("threads") => {
                args.threads = value(&mut parser)?
                    .split(',')
                    .map(parse_count)
                    .collect::<Result<_, _>>()?;
            }
            Long("bw-sizes") => args.bw_sizes = parse_sizes(&value(&mut parser)?)?,
            Long("runs") => args.runs = parse_count(&value(&mut parser)?)?,
            Long("gpu") => {
                let v = value(&mut parser)?;
                args.gpu =
                    if v.eq_ignore_ascii_case("auto") {
                        GpuSelector::Auto
                    } else {
                        GpuSelector::Ordinal(v.parse().map_err(|_| {
                            format!("bad GPU {v:?}: expected auto or a device ordinal")
                        })?)
                    };
            }
            Long("max-seconds") => {
                args.max_seconds = Some(parse_count(&value(&mut parser)?)? as u64)
            }
            Long("json-out") => args.json_out = Some(value(&mut parser)?),
            Short('h') | Long("help") => cli::help(USAGE),
            // `cargo bench`/`cargo test` style flags are ignored.
            Long("bench") | Long("nocapture") => {}
            _ => return Err(usage(arg.unexpected())),
        }
    }
    Ok(args)
}
