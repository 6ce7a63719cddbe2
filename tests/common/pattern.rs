//! A pattern that shows whether a buffer's pages kept their contents: one byte per page derived
//! from a seed, and the last byte.

/// Writes the pattern derived from `seed` into every page of `buf` (and its last byte).
pub fn fill(buf: &mut [u8], seed: u8) {
    for i in (0..buf.len()).step_by(4096) {
        buf[i] = seed.wrapping_add((i / 4096) as u8);
    }
    if let Some(last) = buf.last_mut() {
        *last = seed ^ 0x5a;
    }
}

/// Asserts that `buf` (not empty) holds the pattern [`fill`] wrote with `seed`.
pub fn check(buf: &[u8], seed: u8) {
    for i in (0..buf.len().saturating_sub(1)).step_by(4096) {
        assert_eq!(buf[i], seed.wrapping_add((i / 4096) as u8), "byte {i}");
    }
    assert_eq!(buf.last(), Some(&(seed ^ 0x5a)));
}
