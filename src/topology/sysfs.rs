//! Parsers and readers for the sysfs (and procfs) files the crate reads.
//!
//! The parsers take the file's text and never panic: every malformed input gives
//! [`Error::Parse`] with the path `"<input>"`; the readers in this crate replace that path with the
//! file's real path.
//!
//! Public as `numa_gpu_alloc::unstable::sysfs` so the parsers can be fuzzed and reused (the node lists of
//! `cpulist`, `distance` rows, `meminfo`); the readers stay inside the crate. Nothing here knows
//! the topology types: [`NumaTopology`](crate::NumaTopology) is built from what it reads.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The largest id [`parse_list`] accepts (2²⁰ − 1).
///
/// The kernel's limits are far lower (`MAX_NUMNODES` ≤ 1024, `NR_CPUS` ≤ 8192); the bound exists
/// so a corrupt or hostile file cannot make us allocate a giant list.
pub const MAX_LIST_ID: usize = 1_048_575;

/// The largest file a reader accepts; sysfs attributes are at most one page.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// How much of an offending input an error message quotes.
const MAX_FOUND_CHARS: usize = 80;

/// The path parse errors carry until a reader attaches the real one.
const INPUT_PATH: &str = "<input>";

/// Builds a parse error for string input, quoting at most [`MAX_FOUND_CHARS`] characters.
pub(crate) fn parse_error(expected: &'static str, found: &str) -> Error {
    let mut quoted: String = found.chars().take(MAX_FOUND_CHARS).collect();
    if found.chars().nth(MAX_FOUND_CHARS).is_some() {
        quoted.push('…');
    }
    Error::Parse {
        path: PathBuf::from(INPUT_PATH),
        expected,
        found: quoted,
    }
}

/// Replaces the `"<input>"` path of a parse error with `path`; other errors pass through.
pub(crate) fn at_path(err: Error, path: &Path) -> Error {
    match err {
        Error::Parse {
            path: p,
            expected,
            found,
        } if p.as_os_str() == INPUT_PATH => Error::Parse {
            path: path.to_path_buf(),
            expected,
            found,
        },
        other => other,
    }
}

fn io_error(path: &Path, err: &std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        kind: err.kind(),
        errno: err.raw_os_error(),
    }
}

/// Node `node`'s free huge pages of `page_bytes` (`nodeN/hugepages/hugepages-<kB>kB/
/// free_hugepages` under `root`); 0 when the file cannot be read (no such pages reserved).
#[cfg(target_os = "linux")] // Only shared pools ask.
pub(crate) fn free_huge_pages(root: &Path, node: usize, page_bytes: usize) -> usize {
    let file = root.join(format!(
        "devices/system/node/node{node}/hugepages/hugepages-{}kB/free_hugepages",
        page_bytes >> 10
    ));
    read_parsed(&file, |s| {
        s.trim().parse().map_err(|_| parse_error("a count", s))
    })
    .unwrap_or(0)
}

pub(crate) fn read_text(path: &Path) -> Result<String> {
    read_optional_text(path)?.ok_or_else(|| Error::Io {
        path: path.to_path_buf(),
        kind: std::io::ErrorKind::NotFound,
        errno: Some(libc::ENOENT),
    })
}

/// Like [`read_text`], but a missing file is `Ok(None)`.
pub(crate) fn read_optional_text(path: &Path) -> Result<Option<String>> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(path, &e)),
    };
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(path, &e))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(at_path(
            parse_error("a file of at most 1 MiB", "(larger file)"),
            path,
        ));
    }
    match String::from_utf8(bytes) {
        Ok(s) => Ok(Some(s)),
        Err(e) => Err(at_path(
            parse_error("UTF-8 text", &String::from_utf8_lossy(e.as_bytes())),
            path,
        )),
    }
}

/// Reads `path` and parses it with `parse`, attaching the path to parse errors.
pub(crate) fn read_parsed<T>(path: &Path, parse: impl FnOnce(&str) -> Result<T>) -> Result<T> {
    let text = read_text(path)?;
    parse(&text).map_err(|e| at_path(e, path))
}

/// Like [`read_parsed`], but a missing file is `Ok(None)`.
pub(crate) fn read_parsed_optional<T>(
    path: &Path,
    parse: impl FnOnce(&str) -> Result<T>,
) -> Result<Option<T>> {
    match read_optional_text(path)? {
        Some(text) => parse(&text).map(Some).map_err(|e| at_path(e, path)),
        None => Ok(None),
    }
}

/// Parses a decimal id (no sign, no spaces) of at most [`MAX_LIST_ID`].
fn parse_id(s: &str, whole: &str) -> Result<usize> {
    const EXPECTED: &str = "a kernel list such as 0-3,8,10-11";
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(parse_error(EXPECTED, whole));
    }
    match s.parse::<usize>() {
        Ok(v) if v <= MAX_LIST_ID => Ok(v),
        _ => Err(parse_error("list ids of at most 1048575", whole)),
    }
}

/// Parses the kernel's list format (`cpulist`, `online`, `has_memory`): `"0-3,8,10-11\n"`.
///
/// Surrounding whitespace (the trailing newline) is ignored; an empty string is an empty list.
/// Ranges must not be reversed and the list must be strictly ascending, as the kernel prints it;
/// that, with [`MAX_LIST_ID`], bounds the result to about a million entries.
///
/// # Errors
///
/// [`Error::Parse`] (path `"<input>"`) for anything else.
pub fn parse_list(s: &str) -> Result<Vec<usize>> {
    let text = s.trim();
    let mut out = Vec::new();
    if text.is_empty() {
        return Ok(out);
    }
    // Lowest id the next element may have; keeps the list strictly ascending.
    let mut next_min = 0;
    for part in text.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (parse_id(a, s)?, parse_id(b, s)?),
            None => {
                let v = parse_id(part, s)?;
                (v, v)
            }
        };
        if lo > hi {
            return Err(parse_error("ranges written low-high", s));
        }
        if lo < next_min {
            return Err(parse_error("a strictly ascending list", s));
        }
        out.extend(lo..=hi);
        // hi <= MAX_LIST_ID, so this cannot overflow.
        next_min = hi + 1;
    }
    Ok(out)
}

/// Formats ids in the kernel's list format, e.g. `[0, 1, 2, 3, 8]` → `"0-3,8"`.
///
/// The inverse of [`parse_list`] for ascending input.
#[must_use]
pub fn format_list(ids: &[usize]) -> String {
    let mut out = String::new();
    let mut iter = ids.iter().copied().peekable();
    while let Some(start) = iter.next() {
        let mut end = start;
        while let Some(&next) = iter.peek() {
            if end.checked_add(1) != Some(next) {
                break;
            }
            end = next;
            iter.next();
        }
        if !out.is_empty() {
            out.push(',');
        }
        if start == end {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
    }
    out
}

/// Parses one row of `nodeN/distance`: whitespace-separated decimal distances, e.g. `"10 21\n"`.
///
/// # Errors
///
/// [`Error::Parse`] (path `"<input>"`) for an empty row, a non-numeric entry or a distance above
/// 255.
pub fn parse_distance_row(s: &str) -> Result<Vec<u8>> {
    let mut row = Vec::new();
    for token in s.split_ascii_whitespace() {
        if !token.bytes().all(|b| b.is_ascii_digit()) {
            return Err(parse_error("whitespace-separated node distances", s));
        }
        match token.parse::<u8>() {
            Ok(d) => row.push(d),
            Err(_) => return Err(parse_error("node distances between 0 and 255", s)),
        }
    }
    if row.is_empty() {
        return Err(parse_error("a row of node distances", s));
    }
    Ok(row)
}

/// Parses the `MemTotal` line of `nodeN/meminfo` (`"Node 0 MemTotal:  3893464 kB"`) or of
/// `/proc/meminfo` (`"MemTotal:  3893464 kB"`) and returns it in bytes.
///
/// # Errors
///
/// [`Error::Parse`] (path `"<input>"`) if there is no such line, the value is not a number in kB,
/// or the byte count overflows `u64`.
pub fn parse_meminfo_total(s: &str) -> Result<u64> {
    const EXPECTED: &str = "a line \"MemTotal: <n> kB\"";
    for line in s.lines() {
        let mut tokens = line.split_ascii_whitespace();
        if !tokens.any(|t| t == "MemTotal:") {
            continue;
        }
        let (Some(value), Some("kB"), None) = (tokens.next(), tokens.next(), tokens.next()) else {
            return Err(parse_error(EXPECTED, line));
        };
        if !value.bytes().all(|b| b.is_ascii_digit()) {
            return Err(parse_error(EXPECTED, line));
        }
        return value
            .parse::<u64>()
            .ok()
            .and_then(|kb| kb.checked_mul(1024))
            .ok_or_else(|| parse_error("a MemTotal that fits in 64 bits of bytes", line));
    }
    Err(parse_error(EXPECTED, s))
}

/// Parses a hexadecimal sysfs attribute such as `vendor` (`"0x10de\n"`) or `class`
/// (`"0x030200\n"`). The `0x` prefix is optional; at most 8 hex digits.
///
/// # Errors
///
/// [`Error::Parse`] (path `"<input>"`) for anything else.
pub fn parse_hex_u32(s: &str) -> Result<u32> {
    let t = s.trim();
    let digits = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(parse_error("a hexadecimal number such as 0x10de", s));
    }
    u32::from_str_radix(digits, 16).map_err(|_| parse_error("a hexadecimal number", s))
}

/// Parses a PCI device's `numa_node` attribute: a node id, or `-1` (the kernel's
/// `NUMA_NO_NODE`: firmware did not say) → `None`.
///
/// # Errors
///
/// [`Error::Parse`] (path `"<input>"`) for anything else.
pub fn parse_numa_node(s: &str) -> Result<Option<usize>> {
    let t = s.trim();
    if t == "-1" {
        return Ok(None);
    }
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(parse_error("a node id or -1", s));
    }
    match t.parse::<usize>() {
        Ok(v) if v <= MAX_LIST_ID => Ok(Some(v)),
        _ => Err(parse_error("a node id of at most 1048575", s)),
    }
}

/// One online node as its files describe it: `nodeN/cpulist`, `MemTotal` of `nodeN/meminfo`,
/// and whether `has_memory` and `has_cpu` list it.
pub(crate) struct NodeFiles {
    pub(crate) id: usize,
    pub(crate) cpus: Vec<usize>,
    pub(crate) memory_bytes: u64,
    pub(crate) has_memory: bool,
    pub(crate) has_cpu: bool,
}

/// What [`read_node_tree`] found under `<root>/devices/system/node`.
pub(crate) enum NodeTree {
    /// The online nodes, ascending by id, and their `distance` rows in the same order
    /// (row-major, one distance per online node in each row).
    Nodes {
        nodes: Vec<NodeFiles>,
        distances: Vec<u8>,
    },
    /// No such directory (a kernel built without NUMA): the online CPUs
    /// (`<root>/devices/system/cpu/online`, none if missing) and the `MemTotal` of
    /// `<root>/../proc/meminfo` (that is `/proc/meminfo` for `/sys`; 0 if missing).
    NoNuma { cpus: Vec<usize>, memory_bytes: u64 },
}

/// Reads the node files and the distance rows under `<root>/devices/system/node`, or, when `root`
/// exists but that directory does not, what a machine without NUMA has ([`NodeTree::NoNuma`]).
/// What the facts make (a topology) is for the caller to build.
pub(crate) fn read_node_tree(root: &Path) -> Result<NodeTree> {
    let node_dir = root.join("devices/system/node");
    if !node_dir.is_dir() {
        // A mistyped root must not pass for a non-NUMA machine.
        if let Err(e) = std::fs::read_dir(root) {
            return Err(io_error(root, &e));
        }
        return read_non_numa(root);
    }
    let online = read_parsed(&node_dir.join("online"), parse_list)?;
    // Older kernels lack has_cpu/has_memory: then every online node has both.
    let has_memory = read_parsed_optional(&node_dir.join("has_memory"), parse_list)?
        .unwrap_or_else(|| online.clone());
    let has_cpu = read_parsed_optional(&node_dir.join("has_cpu"), parse_list)?
        .unwrap_or_else(|| online.clone());

    let mut nodes = Vec::with_capacity(online.len());
    let mut distances = Vec::new();
    for &id in &online {
        let dir = node_dir.join(format!("node{id}"));
        let cpus = read_parsed(&dir.join("cpulist"), parse_list)?;
        let memory_bytes = read_parsed(&dir.join("meminfo"), parse_meminfo_total)?;
        let distance_path = dir.join("distance");
        let text = read_text(&distance_path)?;
        let row = parse_distance_row(&text).map_err(|e| at_path(e, &distance_path))?;
        // The row lists online nodes only, in id order; any other length is a broken matrix.
        if row.len() != online.len() {
            return Err(at_path(
                parse_error("one distance per online node", &text),
                &distance_path,
            ));
        }
        distances.extend_from_slice(&row);
        nodes.push(NodeFiles {
            id,
            cpus,
            memory_bytes,
            // Both lists are ascending (parse_list guarantees it).
            has_memory: has_memory.binary_search(&id).is_ok(),
            has_cpu: has_cpu.binary_search(&id).is_ok(),
        });
    }
    Ok(NodeTree::Nodes { nodes, distances })
}

fn read_non_numa(root: &Path) -> Result<NodeTree> {
    let cpus = read_parsed_optional(&root.join("devices/system/cpu/online"), parse_list)?
        .unwrap_or_default();
    let memory_bytes =
        read_parsed_optional(&root.join("../proc/meminfo"), parse_meminfo_total)?.unwrap_or(0);
    Ok(NodeTree::NoNuma { cpus, memory_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_parse(r: &Result<impl std::fmt::Debug>) -> bool {
        matches!(r, Err(Error::Parse { path, .. }) if path.as_os_str() == "<input>")
    }

    #[test]
    fn list_formats() {
        assert_eq!(parse_list(""), Ok(vec![]));
        assert_eq!(parse_list("\n"), Ok(vec![]));
        assert_eq!(parse_list("0\n"), Ok(vec![0]));
        assert_eq!(parse_list("0-3,8,10-11\n"), Ok(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_list("0,2"), Ok(vec![0, 2]));
        assert_eq!(parse_list("1048575"), Ok(vec![MAX_LIST_ID]));
    }

    #[test]
    fn list_rejects_malformed() {
        for bad in [
            "3-1",
            "1048576",
            "0-99999999999999999999999",
            "a",
            "1,,2",
            "1-",
            "-1",
            "+1",
            "0 1",
            "2,1",
            "0-3,2",
            "1,1",
            ",",
            "0-1048575,0-1048575",
        ] {
            assert!(is_parse(&parse_list(bad)), "{bad:?} accepted");
        }
    }

    #[test]
    fn list_round_trips() {
        for s in ["", "0", "0-3,8,10-11", "0,2,4-5", "1048575"] {
            assert_eq!(format_list(&parse_list(s).unwrap()), s);
        }
    }

    #[test]
    fn distance_rows() {
        assert_eq!(parse_distance_row("10 21\n"), Ok(vec![10, 21]));
        assert_eq!(
            parse_distance_row("10  12 32 32\n"),
            Ok(vec![10, 12, 32, 32])
        );
        for bad in ["", "\n", "10 x", "10 256", "10 -1", "10,20", "10 2.5"] {
            assert!(is_parse(&parse_distance_row(bad)), "{bad:?} accepted");
        }
    }

    #[test]
    fn meminfo_totals() {
        let node = "Node 0 MemTotal:        3893464 kB\nNode 0 MemFree:  1 kB\n";
        assert_eq!(parse_meminfo_total(node), Ok(3_893_464 * 1024));
        let proc = "MemTotal:        4679896 kB\nMemFree:         3727932 kB\n";
        assert_eq!(parse_meminfo_total(proc), Ok(4_679_896 * 1024));
        for bad in [
            "",
            "Node 0 MemFree: 1 kB",
            "Node 0 MemTotal: x kB",
            "Node 0 MemTotal: 12",
            "Node 0 MemTotal: 12 MB",
            "MemTotal: 18446744073709551615 kB",
        ] {
            assert!(is_parse(&parse_meminfo_total(bad)), "{bad:?} accepted");
        }
    }

    #[test]
    fn hex_and_numa_node() {
        assert_eq!(parse_hex_u32("0x10de\n"), Ok(0x10de));
        assert_eq!(parse_hex_u32("0X030200"), Ok(0x030200));
        assert_eq!(parse_hex_u32("ffffffff"), Ok(u32::MAX));
        for bad in ["", "0x", "0x123456789", "0x+1", "10de h"] {
            assert!(is_parse(&parse_hex_u32(bad)), "{bad:?} accepted");
        }
        assert_eq!(parse_numa_node("-1\n"), Ok(None));
        assert_eq!(parse_numa_node("3\n"), Ok(Some(3)));
        for bad in ["", "-2", "x", "+1", "1048576"] {
            assert!(is_parse(&parse_numa_node(bad)), "{bad:?} accepted");
        }
    }

    #[test]
    fn long_input_is_quoted_truncated() {
        let long = "x".repeat(1000);
        match parse_list(&long) {
            Err(Error::Parse { found, .. }) => assert!(found.chars().count() <= 81),
            other => panic!("{other:?}"),
        }
    }
}
