//! Filling large vectors fast in the unoptimised test build, where `Vec::resize` writes one byte
//! per loop turn (seconds per GiB).

use allocator_api2::alloc::Allocator;
use allocator_api2::vec::Vec;

/// What `vec.resize(len, byte)` does for a longer `len`, by one `memset`.
pub fn resize<A: Allocator>(vec: &mut Vec<u8, A>, len: usize, byte: u8) {
    let add = len
        .checked_sub(vec.len())
        .expect("resize only lengthens here");
    vec.reserve(add);
    // SAFETY: `reserve` made room for `add` more bytes; they are written before the length
    // covers them.
    unsafe {
        std::ptr::write_bytes(vec.as_mut_ptr().add(vec.len()), byte, add);
        vec.set_len(len);
    }
}
