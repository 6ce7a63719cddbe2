//! The examples' command lines, alike: `--help` or `-h` prints the usage to stdout and exits 0;
//! an argument an example does not take prints what is wrong and the usage to stderr and exits 2;
//! a failed run prints `error: ` and the error's `Display` text (not its `Debug`, which is what a
//! `main` returning `Err` prints) and exits 1.
//!
//! Included with `#[path]` by the examples (not every one uses every function).
#![allow(dead_code)]

use std::ffi::OsString;
use std::fmt::Display;

/// Whether an argument asks for help.
pub fn is_help(arg: &OsString) -> bool {
    arg == "--help" || arg == "-h"
}

/// Prints `usage` and exits 0.
pub fn help(usage: &str) -> ! {
    println!("{usage}");
    std::process::exit(0)
}

/// Prints `problem` and `usage` to stderr and exits 2 (bad usage).
pub fn usage_error(problem: impl Display, usage: &str) -> ! {
    eprintln!("error: {problem}\n\n{usage}");
    std::process::exit(2)
}

/// The arguments after the program's name, once `--help` has been answered: at most `max` of
/// them, none starting with `-` (the examples that use this take no option).
pub fn positional(usage: &str, max: usize) -> Vec<OsString> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.iter().any(is_help) {
        help(usage);
    }
    if let Some(option) = args.iter().find(|a| a.to_string_lossy().starts_with('-')) {
        usage_error(format_args!("unknown option {option:?}"), usage);
    }
    if args.len() > max {
        usage_error(format_args!("unexpected argument {:?}", args[max]), usage);
    }
    args
}

/// The value after the option `name`, parsed; a missing or unparsable one is a usage error.
pub fn option_value<T: std::str::FromStr>(
    args: &mut impl Iterator<Item = OsString>,
    name: &str,
    usage: &str,
) -> T {
    let v = args
        .next()
        .unwrap_or_else(|| usage_error(format_args!("{name} needs a value"), usage));
    v.to_string_lossy()
        .parse()
        .unwrap_or_else(|_| usage_error(format_args!("bad {name} {v:?}"), usage))
}

/// Exits 1 with `error: {e}` on stderr when the run failed.
pub fn exit_on_error<E: Display>(result: Result<(), E>) {
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
