//! What `numactl --hardware` says about the guest (the reference the checks compare with), and
//! the node the allocator must choose from it.

use super::*;

/// The layout as `numactl --hardware` printed it.
#[derive(Default)]
pub(super) struct Numactl {
    /// Node ids in the order printed.
    pub(super) nodes: Vec<usize>,
    pub(super) cpus: BTreeMap<usize, Vec<usize>>,
    pub(super) size_mb: BTreeMap<usize, u64>,
    /// Row per node: distances to the nodes of `columns`, in that order.
    pub(super) distances: BTreeMap<usize, Vec<u8>>,
    pub(super) columns: Vec<usize>,
}

impl Numactl {
    pub(super) fn parse(text: &str) -> Result<Self, String> {
        let mut out = Numactl::default();
        let mut in_distances = false;
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["node", "distances:"] => in_distances = true,
                ["node", id, "cpus:", cpus @ ..] if !in_distances => {
                    let id = num(id)?;
                    out.nodes.push(id);
                    out.cpus
                        .insert(id, cpus.iter().map(|c| num(c)).collect::<Result<_, _>>()?);
                }
                ["node", id, "size:", mb, "MB"] if !in_distances => {
                    out.size_mb.insert(num(id)?, num(mb)? as u64);
                }
                ["node", columns @ ..] if in_distances => {
                    out.columns = columns.iter().map(|c| num(c)).collect::<Result<_, _>>()?;
                }
                [row, values @ ..] if in_distances && row.ends_with(':') => {
                    let row = num(row.trim_end_matches(':'))?;
                    let values = values
                        .iter()
                        .map(|v| v.parse::<u8>().map_err(|_| format!("distance {v:?}")))
                        .collect::<Result<_, _>>()?;
                    out.distances.insert(row, values);
                }
                _ => {}
            }
        }
        if out.nodes.is_empty() {
            return Err("no `node N cpus:` lines".into());
        }
        Ok(out)
    }

    /// The distance row of `node` over `self.nodes`, `None` where numactl printed nothing.
    pub(super) fn row(&self, node: usize) -> Vec<Option<u8>> {
        let row = self.distances.get(&node);
        self.nodes
            .iter()
            .map(|to| {
                let col = self.columns.iter().position(|c| c == to)?;
                row?.get(col).copied()
            })
            .collect()
    }
}

pub(super) fn num(s: &str) -> Result<usize, String> {
    s.parse()
        .map_err(|_| format!("number expected, found {s:?}"))
}

/// The nodes numactl reports memory for.
pub(super) fn memory_nodes(n: &Numactl) -> Vec<usize> {
    n.nodes
        .iter()
        .copied()
        .filter(|id| n.size_mb.get(id).is_some_and(|&mb| mb > 0))
        .collect()
}

/// Where the allocator checks put their blocks: the expected host node, else the first node
/// with memory.
pub(super) fn target_node(cx: &Ctx, n: &Numactl) -> Option<usize> {
    cx.args
        .expect_host
        .or_else(|| memory_nodes(n).first().copied())
}

/// numactl's output and [`target_node`], or the `FAIL` line of check `name` when either is
/// missing.
pub(super) fn numactl_and_target<'a>(
    cx: &'a Ctx,
    name: &str,
) -> Result<(&'a Numactl, usize), Check> {
    cx.numactl
        .as_ref()
        .ok()
        .and_then(|n| Some((n, target_node(cx, n)?)))
        .ok_or_else(|| Check::fail(name, "numactl output", "unavailable"))
}
