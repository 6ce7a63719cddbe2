//! Unit tests, with a fake driver table made of Rust functions (`fake.rs`).

mod contexts;
mod devices;
mod errors;
#[cfg(feature = "pinned-buffer")]
mod events;
mod fake;
mod host_numa;
