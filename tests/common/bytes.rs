//! Checking large buffers fast in the unoptimised test build, where `iter().all` takes a loop
//! turn per byte (seconds per GiB, minutes under valgrind).

/// Whether every byte of `bytes` is `byte`, compared by `memcmp` a chunk at a time.
pub fn all_bytes_are(bytes: &[u8], byte: u8) -> bool {
    const CHUNK: usize = 64 << 10;
    let pattern = [byte; CHUNK];
    bytes
        .chunks(CHUNK)
        .all(|chunk| chunk == &pattern[..chunk.len()])
}
