//! Results measured outside criterion's timing loop, written as table rows for
//! `scripts/bench-table.py` (`<criterion dir>/<group>/rows.json`).

use std::path::PathBuf;

/// Where criterion writes its results (same lookup order, short of asking `cargo metadata`).
pub fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    // The workspace's target directory: this package is `benches/`, one below the root.
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("criterion")
}

/// One row: `ours` and `peer` in `unit`; the target, when there is one, bounds ours / peer.
pub fn row(
    workload: &str,
    ours: f64,
    peer_label: &str,
    peer: f64,
    unit: &str,
    target: Option<f64>,
) -> String {
    let target = target.map_or_else(|| "null".to_owned(), |t| t.to_string());
    format!(
        "{{\"workload\": \"{workload}\", \"ours\": {ours}, \"peer_label\": \"{peer_label}\", \
         \"peer\": {peer}, \"unit\": \"{unit}\", \"target\": {target}}}"
    )
}

/// Writes `rows` to `<criterion dir>/<group>/rows.json`.
pub fn write(group: &str, rows: &[String]) {
    let dir = criterion_dir().join(group);
    let json = format!("[\n{}\n]\n", rows.join(",\n"));
    if let Err(err) =
        std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join("rows.json"), json))
    {
        eprintln!(
            "{group}: cannot write {}: {err}",
            dir.join("rows.json").display()
        );
    }
}
