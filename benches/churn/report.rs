//! The table and JSON of `benches/churn/`: medians per allocator, ratios against targets, and
//! the machine and time of the run.

use serde_json::{json, Value};

use super::machine::machine;
use super::{med, Peer, Sample, Scale, Workload};

pub fn header(runs: usize, quick: bool, date: &str) -> String {
    format!(
        "churn: large buffers, each allocator the #[global_allocator] of its own processes{}\n\
         machine: {}; started {}\n\
         figures: median of {runs} run(s), alternated across allocators; wall = the workload \
         alone; user, sys, peak RSS = the whole child process (getrusage)",
        if quick { " (--quick)" } else { "" },
        machine(),
        date
    )
}

/// One figure of a sample.
type Figure = fn(&Sample) -> f64;

/// One ratio of ours to a peer, with its target if it has one.
struct Ratio {
    label: &'static str,
    value: f64,
    target: Option<f64>,
}

/// One workload's results.
pub struct Block {
    key: &'static str,
    title: String,
    /// Per allocator, in [`Peer::ALL`]'s order.
    samples: Vec<Vec<Sample>>,
    ratios: Vec<Ratio>,
}

impl Block {
    pub fn new(workload: &Workload, scale: &Scale, samples: Vec<Vec<Sample>>) -> Block {
        let title = workload
            .title
            .replace("{n}", &(workload.count)(scale).to_string());
        let figure = |peer: Peer, f: Figure| {
            let i = Peer::ALL.iter().position(|&p| p == peer).unwrap_or(0);
            med(&samples[i], f)
        };
        let (wall, rss): (Figure, Figure) = (|s| s.wall, |s| s.peak_mib);
        let ratio = |label, ours, peer, f, target| Ratio {
            label,
            value: figure(ours, f) / figure(peer, f),
            target,
        };
        let ours = Peer::OursMimalloc;
        let ratios = vec![
            ratio(
                "ours/mimalloc vs mimalloc, wall",
                ours,
                Peer::Mimalloc,
                wall,
                Some(workload.wall_target),
            ),
            ratio(
                "ours/mimalloc vs mimalloc, peak RSS",
                ours,
                Peer::Mimalloc,
                rss,
                workload.rss_target,
            ),
            ratio(
                "ours/mimalloc vs jemalloc, wall",
                ours,
                Peer::Jemalloc,
                wall,
                workload.jemalloc_wall_target,
            ),
            ratio(
                "ours/mimalloc vs jemalloc, peak RSS",
                ours,
                Peer::Jemalloc,
                rss,
                None,
            ),
            ratio(
                "ours/glibc vs glibc, wall",
                Peer::OursGlibc,
                Peer::Glibc,
                wall,
                workload.glibc_wall_target,
            ),
        ];
        Block {
            key: workload.key,
            title,
            samples,
            ratios,
        }
    }

    pub fn render(&self) -> String {
        let mut out = format!(
            "\n{}\n{:<14} {:>7} {:>15} {:>7} {:>7} {:>9}  {}\n",
            self.title,
            "allocator",
            "wall s",
            "(min-max)",
            "user s",
            "sys s",
            "peak MiB",
            "ours: cache hits/large allocs, registrations"
        );
        for (peer, samples) in Peer::ALL.iter().zip(&self.samples) {
            let walls = samples.iter().map(|s| s.wall);
            let (min, max) = walls.fold((f64::INFINITY, 0.0f64), |(lo, hi), w| {
                (lo.min(w), hi.max(w))
            });
            let ours = ours_median(samples).map_or_else(String::new, |[hits, large, regs]| {
                format!("{hits:.0}/{large:.0}, {regs:.0}")
            });
            out += &format!(
                "{:<14} {:>7.3} {:>15} {:>7.3} {:>7.3} {:>9.1}  {ours}\n",
                peer.name(),
                med(samples, |s| s.wall),
                format!("({min:.3}-{max:.3})"),
                med(samples, |s| s.user),
                med(samples, |s| s.sys),
                med(samples, |s| s.peak_mib),
            );
        }
        for r in &self.ratios {
            let verdict = r.target.map_or_else(
                || "(no target)".to_owned(),
                |t| {
                    format!(
                        "target <= {t:.2}x: {}",
                        if r.value <= t { "PASS" } else { "MISS" }
                    )
                },
            );
            out += &format!(
                "  ({}) {:<36} {:>6.3}x  {verdict}\n",
                self.key, r.label, r.value
            );
        }
        out
    }
}

/// The medians of ours' counters over the runs (cache hits, large allocations, registrations).
fn ours_median(samples: &[Sample]) -> Option<[f64; 3]> {
    let counters: Vec<[u64; 3]> = samples.iter().filter_map(|s| s.ours).collect();
    (!counters.is_empty())
        .then(|| [0, 1, 2].map(|i| super::median(counters.iter().map(|c| c[i] as f64).collect())))
}

/// Every run's figures, the medians and the ratios.
pub fn json(blocks: &[Block], runs: usize, quick: bool, date: &str) -> Value {
    let workloads: Vec<Value> = blocks
        .iter()
        .map(|b| {
            let allocators: Vec<Value> = Peer::ALL
                .iter()
                .zip(&b.samples)
                .map(|(peer, samples)| {
                    let all = |f: Figure| samples.iter().map(f).collect::<Vec<_>>();
                    json!({
                        "allocator": peer.name(),
                        "wall_s": all(|s| s.wall),
                        "user_s": all(|s| s.user),
                        "sys_s": all(|s| s.sys),
                        "peak_rss_mib": all(|s| s.peak_mib),
                        "ours_cache_hits_large_registrations":
                            samples.iter().filter_map(|s| s.ours).collect::<Vec<_>>(),
                        "median": {
                            "wall_s": med(samples, |s| s.wall),
                            "user_s": med(samples, |s| s.user),
                            "sys_s": med(samples, |s| s.sys),
                            "peak_rss_mib": med(samples, |s| s.peak_mib),
                        },
                    })
                })
                .collect();
            let ratios: Vec<Value> = b
                .ratios
                .iter()
                .map(|r| {
                    json!({
                        "ratio": r.label,
                        "value": r.value,
                        "target": r.target,
                        "met": r.target.map(|t| r.value <= t),
                    })
                })
                .collect();
            json!({"workload": b.key, "title": b.title, "allocators": allocators, "ratios": ratios})
        })
        .collect();
    json!({
        "machine": machine(),
        "date": date,
        "runs": runs,
        "quick": quick,
        "workloads": workloads,
    })
}
