//! Replays the fuzz corpus (`fuzz/corpus/<target>/*`) on stable: every file goes through the same
//! checks as under `cargo +nightly fuzz run <target>` (`fuzz/targets.rs`), and none may panic.
//! `bash scripts/fuzz-replay.sh` runs this test.

use std::path::Path;

#[path = "../fuzz/targets.rs"]
mod targets;

#[test]
fn fuzz_corpus_replays_without_panics() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for (target, check) in targets::TARGETS {
        let dir = corpus.join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{}: no seed files", dir.display());
        for file in &files {
            let data = std::fs::read(file).unwrap();
            let replay = std::panic::catch_unwind(|| check(&data));
            assert!(
                replay.is_ok(),
                "{target}: {} ({:?}) panicked",
                file.display(),
                String::from_utf8_lossy(&data)
            );
        }
        eprintln!("{target}: {} inputs replayed", files.len());
    }
}

#[test]
fn targets_see_edge_inputs() {
    // Inputs no corpus file may hold (invalid UTF-8, NULs, long runs) go through every target.
    let long_list = (0..2000)
        .map(|i| (i * 2).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let inputs: [&[u8]; 6] = [
        b"\xff\xfe\x00",
        b"\0",
        &[b','; 4096],
        long_list.as_bytes(),
        "threshold=４MiB,gpu=GPU-ééé,node=٣".as_bytes(),
        b"0000:81:00.0\0",
    ];
    for (_, check) in targets::TARGETS {
        for input in inputs {
            check(input);
        }
    }
}
