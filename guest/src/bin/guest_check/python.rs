//! Python's buffers, seen from the preload library's users: `guest/init` runs
//! `preload/tests/python/placed.py` (bytearrays, a bytearray grown by `realloc`, numpy's
//! `empty`/`zeros` arrays, each checked page by page with `move_pages`) on node 0's CPUs, asking
//! for the device's host node, once under `LD_PRELOAD` of `libnuma_gpu_alloc.so`
//! (`--python-placed`) and once without it (`--python-unplaced`).
//!
//! Placed, every page of every buffer must be on the host node, in a mapping of the library's.
//! Unplaced, every page must be on node 0 in glibc's memory (the default policy: first touch on
//! the CPUs the program runs on), and the script must fail its own check: so the placed run's
//! pages are where they are because of the library, and the script can tell.

use super::*;

/// One buffer line of `placed.py`:
/// `LABEL N MiB: policy P, pages on node K: X, elsewhere: Y[ (node A: a, …, absent: b)]`.
#[derive(Debug, PartialEq)]
struct Buffer {
    label: String,
    mib: usize,
    policy: String,
    node: usize,
    on: usize,
    elsewhere: usize,
    /// The bracket's `(where, pages)` pairs: where the pages not on `node` are.
    others: Vec<(String, usize)>,
}

impl Buffer {
    fn parse(line: &str) -> Option<Buffer> {
        let (head, rest) = line.split_once(" MiB: policy ")?;
        let (label, mib) = head.rsplit_once(' ')?;
        let (policy, rest) = rest.split_once(", pages on node ")?;
        let (node, rest) = rest.split_once(": ")?;
        let (on, rest) = rest.split_once(", elsewhere: ")?;
        let (elsewhere, others) = rest.split_once(' ').unwrap_or((rest, ""));
        let others = others
            .strip_prefix('(')
            .and_then(|o| o.strip_suffix(')'))
            .unwrap_or(others);
        let others = others
            .split(", ")
            .filter(|o| !o.is_empty())
            .map(|o| {
                let (place, pages) = o.rsplit_once(": ")?;
                Some((place.to_owned(), pages.parse().ok()?))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Buffer {
            label: label.to_owned(),
            mib: mib.parse().ok()?,
            policy: policy.to_owned(),
            node: node.parse().ok()?,
            on: on.parse().ok()?,
            elsewhere: elsewhere.parse().ok()?,
            others,
        })
    }
}

/// A run's buffer lines and its exit status (`exit rc=N`, appended by `guest/init`); the whole
/// text for the failure messages.
struct Run {
    buffers: Vec<Buffer>,
    rc: Option<String>,
    text: String,
}

fn read(path: &Path) -> Result<Run, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let buffers = text.lines().filter_map(Buffer::parse).collect();
    let rc = text
        .lines()
        .find_map(|l| l.strip_prefix("exit rc="))
        .map(|rc| rc.trim().to_owned());
    Ok(Run { buffers, rc, text })
}

/// The checks of both runs (nothing when `guest/init` ran neither).
pub(super) fn python(cx: &Ctx) -> Vec<Check> {
    let mut out = Vec::new();
    if let Some(path) = &cx.args.python_placed {
        out.extend(placed(path, cx.args.expect_host));
    }
    if let Some(path) = &cx.args.python_unplaced {
        out.extend(unplaced(path));
    }
    out
}

/// Under the library: every page of every buffer on the host node, in the library's mapping.
fn placed(path: &Path, host: Option<usize>) -> Vec<Check> {
    let run = match read(path) {
        Ok(run) => run,
        Err(e) => return vec![Check::fail("python", "placed.py's report", e)],
    };
    let Some(host) = host else {
        return vec![Check::fail("python", "a host node (--expect-host)", "none")];
    };
    let mut out: Vec<Check> = run
        .buffers
        .iter()
        .map(|b| {
            let pages = (b.mib << 20) / sys::page_size();
            let name = format!("python.{}.{}MiB", b.label, b.mib);
            let placed = b.node == host && b.on == pages && b.elsewhere == 0;
            if placed && b.policy != "default" {
                Check::pass(name)
            } else {
                let expected =
                    format!("{pages} pages on node {host} in a mapping of the library's");
                Check::fail(name, expected, format!("{b:?}"))
            }
        })
        .collect();
    // numpy's arrays are half the point: an interpreter without numpy must not pass quietly.
    let numpy = run.buffers.iter().any(|b| b.label.starts_with("numpy."));
    out.push(Check::eq("python.numpy", true, numpy));
    out.push(exit(&run, "python.exit", "0"));
    out
}

/// Without the library: every page on node 0, where the program's CPUs are, in glibc's memory,
/// and placed.py says so by failing.
fn unplaced(path: &Path) -> Vec<Check> {
    let run = match read(path) {
        Ok(run) => run,
        Err(e) => return vec![Check::fail("python.unplaced", "placed.py's report", e)],
    };
    let mut out: Vec<Check> = run
        .buffers
        .iter()
        .map(|b| {
            let name = format!("python.unplaced.{}.{}MiB.node0", b.label, b.mib);
            let on_node0 = b.on == 0 && b.others == [("node 0".to_owned(), b.elsewhere)];
            if on_node0 && b.policy == "default" {
                Check::pass(name)
            } else {
                Check::fail(
                    name,
                    "every page on node 0, policy default",
                    format!("{b:?}"),
                )
            }
        })
        .collect();
    out.push(Check::eq(
        "python.unplaced.buffers",
        true,
        !run.buffers.is_empty(),
    ));
    // placed.py's own check fails without the library: it can.
    out.push(exit(&run, "python.unplaced.exit", "1"));
    out
}

fn exit(run: &Run, name: &str, expected: &str) -> Check {
    if run.rc.as_deref() == Some(expected) {
        Check::pass(name)
    } else {
        let got = format!("{:?}; output: {}", run.rc, run.text.replace('\n', " | "));
        Check::fail(name, format!("exit rc={expected}"), got)
    }
}
