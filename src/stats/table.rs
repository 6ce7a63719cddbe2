//! The [`Stats`] table (`Display`), written without allocating: the exit report prints it.

use std::fmt;

use super::Stats;
use crate::Error;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// A byte count in the largest binary unit that keeps a whole or one-decimal number: `4 KiB`,
/// `2.5 MiB`, `64 GiB` (the threshold ranges from 4 KiB to 64 GiB). Without allocating.
pub(super) struct Size(pub(super) usize);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = ["B", "KiB", "MiB", "GiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < units.len() {
            value /= 1024.0;
            unit += 1;
        }
        let tenths = (value * 10.0).round();
        if tenths % 10.0 == 0.0 {
            write!(f, "{} {}", tenths / 10.0, units[unit])
        } else {
            write!(f, "{value:.1} {}", units[unit])
        }
    }
}

/// A node id, or `-` when unknown (without allocating: the exit report prints this).
struct Opt(Option<usize>);

impl fmt::Display for Opt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(v) => write!(f, "{v}"),
            None => f.write_str("-"),
        }
    }
}

/// `on`, or `off` and why: what the user changes depends on it (without allocating).
struct Pinning<'a>(bool, Option<&'a Error>);

impl fmt::Display for Pinning<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            _ if self.0 => f.write_str("on"),
            None => f.write_str("off"),
            Some(Error::PinningOff) => f.write_str("off (pin=off)"),
            Some(Error::DriverUnusable { driver }) => match driver {
                Error::CudaUnavailable { reason } => write!(f, "off: CUDA unusable ({reason})"),
                driver => write!(f, "off: CUDA unusable ({driver})"),
            },
            Some(Error::NodeTarget) => f.write_str("off: the target is a NUMA node, not a GPU"),
            Some(Error::CudaUnavailable { reason }) => write!(f, "off: {reason}"),
            Some(e) => write!(f, "off: {e}"),
        }
    }
}

/// Ends a line with its struct's labelled event counters, `, label value` each: a counter declared
/// with a label in `snapshot!` needs no code here.
fn end_line(
    f: &mut fmt::Formatter<'_>,
    events: impl Iterator<Item = (&'static str, u64)>,
) -> fmt::Result {
    for (label, value) in events {
        write!(f, ", {label} {value}")?;
    }
    writeln!(f)
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            // Pinning last: the reason it is off may be long.
            "numa-gpu-alloc: host node {}, GPU {} (home node {}), threshold {}, pinning {}",
            Opt(self.host_node),
            self.gpu.as_deref().unwrap_or("none"),
            Opt(self.home_node),
            Size(self.threshold),
            Pinning(self.pinning, self.pinning_off.as_ref())
        )?;
        if let Some(limit) = self.pin_limit {
            writeln!(
                f,
                "page-locked {} of the pinned limit {} (the whole process)",
                Size(self.page_locked_bytes),
                Size(limit)
            )?;
        }
        // Two spaces between columns, and names of two words where one would be ambiguous, so
        // that the header reads column by column. `cached MiB` is the chunks' `free MiB` plus
        // the cached dedicated blocks, which are mappings of their own outside `chunk MiB`.
        writeln!(
            f,
            "{:>4}  {:>10}  {:>10}  {:>10}  {:>11}  {:>10}  {:>6}  {:>10}  {:>12}  {:>10}  {:>16}  \
             {:>6}",
            "node",
            "live MiB",
            "peak MiB",
            "pinned MiB",
            "live blocks",
            "cached MiB",
            "chunks",
            "chunk MiB",
            "resident MiB",
            "free MiB",
            "largest free MiB",
            "free %"
        )?;
        for n in &self.nodes {
            writeln!(
                f,
                "{:>4}  {:>10.1}  {:>10.1}  {:>10.1}  {:>11}  {:>10.1}  {:>6}  {:>10.1}  \
                 {:>12.1}  {:>10.1}  {:>16.1}  {:>6.0}",
                n.node,
                mib(n.live_bytes),
                mib(n.peak_live_bytes),
                mib(n.pinned_bytes),
                n.live_blocks,
                mib(n.cached_bytes),
                n.chunks,
                mib(n.mapped_bytes),
                mib(n.resident_bytes),
                mib(n.free_bytes),
                mib(n.largest_free),
                n.free_fraction() * 100.0
            )?;
        }
        for h in &self.heaps {
            writeln!(
                f,
                "chunks on node {} ({:?}{}{}{}): {} ({:.1} MiB, {:.1} resident, {:.1} free in {} \
                 ranges, largest {:.1}), made {}, registered {}, purged {:.1} MiB",
                h.node,
                h.policy,
                if h.pinned { ", pinned" } else { "" },
                if h.huge_pages { ", huge pages" } else { "" },
                if h.reserved { ", reserved" } else { "" },
                h.chunks,
                mib(h.mapped_bytes),
                mib(h.resident_bytes),
                mib(h.free_bytes),
                h.free_ranges,
                mib(h.largest_free),
                h.chunks_made,
                h.registrations,
                h.purged_bytes as f64 / f64::from(1u32 << 20)
            )?;
        }
        for g in &self.gpus {
            writeln!(
                f,
                "gpu {} on node {}: live {:.1} MiB ({} blocks, {:.1} MiB pinned), peak {:.1} MiB",
                g.ordinal,
                g.node,
                mib(g.live_bytes),
                g.live_blocks,
                mib(g.pinned_bytes),
                mib(g.peak_live_bytes)
            )?;
        }
        write!(
            f,
            "large allocations {} (cache hits {}, misses {})",
            self.large_allocations, self.cache_hits, self.cache_misses
        )?;
        end_line(f, self.labelled_events())?;
        writeln!(
            f,
            "populate {:.3?} total, {:.3?} max; pin {:.3?} total, {:.3?} max; unpin {:.3?} total, \
             {:.3?} max; registrations {}, unregistrations {}; reserved {} in {} chunks",
            self.populate_time.total,
            self.populate_time.max,
            self.pin_time.total,
            self.pin_time.max,
            self.unpin_time.total,
            self.unpin_time.max,
            self.registrations,
            self.unregistrations,
            Size(usize::try_from(self.reserved_bytes).unwrap_or(usize::MAX)),
            self.reserved_chunks
        )?;
        if self.requests_by_octave.iter().any(|&n| n > 0) {
            f.write_str("requests by size:")?;
            for (k, &n) in self.requests_by_octave.iter().enumerate() {
                if n > 0 {
                    write!(f, " {}+ {n}", Size(Stats::octave_start(k)))?;
                }
            }
            writeln!(f)?;
        }
        writeln!(
            f,
            "pages checked {}, misplaced {}",
            self.pages_checked, self.pages_misplaced
        )?;
        let (blocks, bytes) = self.nodes.iter().fold((0, 0), |(n, b), row| {
            (n + row.pending_blocks, b + row.pending_bytes)
        });
        writeln!(
            f,
            "pending {blocks} blocks ({:.1} MiB), GPU uses recorded {}, reuse deferred {}; \
             retries after giving back {} cached blocks: {}",
            mib(bytes),
            self.in_flight_recorded,
            self.reuse_deferred,
            self.pressure_released_blocks,
            self.pressure_retries
        )?;
        let fb = &self.fallbacks;
        write!(
            f,
            "fallbacks: unplaced {}, unpinned {}, unverified {}, pin failures {}, unregister \
             failures {}, failed allocations {} (bind exhausted {}, mmap {}, placement {}, \
             populate {}, memory limit {}, strict refused {})",
            fb.unplaced_blocks,
            fb.unpinned_blocks,
            fb.unverified_blocks,
            fb.pin_failures,
            fb.unregister_failures,
            fb.failed_allocations,
            fb.bind_exhausted,
            fb.map_failures,
            fb.placement_failures,
            fb.populate_failures,
            fb.memory_limited,
            fb.strict_refused
        )?;
        end_line(f, fb.labelled_events())?;
        for c in &self.pin_failures_by_code {
            writeln!(f, "pin failure {} ({}): {}", c.name, c.code, c.count)?;
        }
        if let Some(e) = &self.last_pin_error {
            writeln!(f, "last pin failure: {e}")?;
        }
        if let Some(e) = &self.numa_unavailable {
            writeln!(f, "NUMA unavailable: {e}")?;
        }
        for e in &self.config_errors {
            writeln!(f, "setup: {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Counters, NodeStats};
    use super::*;

    #[test]
    fn display_renders_a_table() {
        let stats = Stats {
            threshold: 2 << 20,
            host_node: Some(1),
            nodes: vec![NodeStats {
                node: 1,
                live_bytes: 3 << 20,
                ..NodeStats::default()
            }],
            ..Stats::default()
        };
        let text = stats.to_string();
        assert!(text.contains("host node 1"), "{text}");
        assert!(text.contains("threshold 2 MiB"), "{text}");
        assert_eq!(
            [4096, 2_621_440, 64 << 30, 1000].map(|b| Size(b).to_string()),
            ["4 KiB", "2.5 MiB", "64 GiB", "1000 B"]
        );
        assert!(text.contains("   1         3.0"), "{text}");
        assert_eq!(stats.live_bytes(), 3 << 20);
    }

    #[test]
    fn the_header_says_why_pinning_is_off() {
        static DRIVER: Error = Error::CudaUnavailable {
            reason: "libcuda.so could not be loaded",
        };
        let header = |pinning, pinning_off| {
            let stats = Stats {
                pinning,
                pinning_off,
                ..Stats::default()
            };
            stats
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned()
        };
        let forked = Error::CudaUnavailable {
            reason: crate::cuda::FORKED_REASON,
        };
        for (pinning, off, end) in [
            (true, None, ", pinning on".to_owned()),
            (
                false,
                Some(Error::PinningOff),
                ", pinning off (pin=off)".to_owned(),
            ),
            (
                false,
                Some(Error::DriverUnusable { driver: &DRIVER }),
                ", pinning off: CUDA unusable (libcuda.so could not be loaded)".to_owned(),
            ),
            (
                false,
                Some(forked),
                format!(", pinning off: {}", crate::cuda::FORKED_REASON),
            ),
        ] {
            let line = header(pinning, off);
            assert!(line.ends_with(&end), "{line}");
        }
    }

    /// `cached MiB` may exceed `chunk MiB` (cached dedicated blocks are outside chunks); `free %`
    /// is the chunks' free share.
    #[test]
    fn node_columns_say_what_they_count() {
        let stats = Stats {
            nodes: vec![NodeStats {
                cached_bytes: 96 << 20,
                mapped_bytes: 32 << 20,
                free_bytes: 32 << 20,
                chunks: 1,
                ..NodeStats::default()
            }],
            ..Stats::default()
        };
        let text = stats.to_string();
        let mut lines = text.lines().skip_while(|l| !l.starts_with("node"));
        let header = lines.next().unwrap_or_default();
        for column in [
            "live blocks",
            "cached MiB",
            "chunk MiB",
            "free MiB",
            "free %",
        ] {
            assert!(header.contains(&format!("  {column}")), "{header}");
        }
        let row: Vec<&str> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        assert_eq!(
            row[5..],
            ["96.0", "1", "32.0", "0.0", "32.0", "0.0", "100"],
            "{text}"
        );
        assert_eq!(stats.nodes[0].free_fraction(), 1.0);
    }

    /// Guards the entries of `snapshot!` without a label: each must have a place in a line here.
    #[test]
    fn every_event_counter_is_printed() {
        let counters = Counters::default();
        let values = 1001..;
        for (counter, value) in counters.each().zip(values.clone()) {
            counter.add(value);
        }
        let mut stats = Stats::default();
        counters.fill(&mut stats);
        let text = stats.to_string();
        let printed: Vec<u64> = text
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse().ok())
            .collect();
        for value in values.take(counters.each().count()) {
            assert!(printed.contains(&value), "{value} missing from\n{text}");
        }
    }
}
