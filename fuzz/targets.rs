//! What each fuzz target checks, shared by the libFuzzer binaries (`fuzz_targets/*.rs`, run with
//! `cargo +nightly fuzz run <target>`) and by the crate's corpus replay on stable
//! (`tests/fuzz_corpus.rs`, which includes this file): the same input gives the same checks.
//!
//! Every target takes arbitrary bytes (lossily decoded as UTF-8), must never panic, and checks the
//! properties the parser promises when it accepts its input.

// Each user includes only the functions it calls.
#![allow(dead_code)]

use numa_gpu_alloc::unstable::pci::PciAddress;
use numa_gpu_alloc::unstable::sysfs;
use numa_gpu_alloc::Config;

/// A fuzz target's checks.
pub type Target = fn(&[u8]);

/// The corpus directories under `fuzz/corpus/` and their functions.
pub const TARGETS: [(&str, Target); 4] = [
    ("env_settings", env_settings),
    ("sysfs_list", sysfs_list),
    ("sysfs_distance", sysfs_distance),
    ("pci_address", pci_address),
];

/// `NUMA_GPU_ALLOC` parsing (`Config::apply_settings`): every error prints as one line, applying
/// the same string twice changes nothing more, and `Config::apply` agrees entry by entry.
pub fn env_settings(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut config = Config::DEFAULT;
    let errors = config.apply_settings(&text);
    let entries = text.split(',').filter(|e| !e.trim().is_empty()).count();
    // At most: one per entry, one per duplicate, and the node/gpu conflict.
    assert!(errors.len() <= 2 * entries + 1, "{} errors", errors.len());
    for e in &errors {
        assert!(!e.to_string().is_empty());
    }
    let mut again = config;
    let _ = again.apply_settings(&text);
    assert_eq!(
        again, config,
        "applying the same settings twice is idempotent"
    );
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        if let Some((key, value)) = entry.split_once('=') {
            let mut one = Config::DEFAULT;
            let before = one;
            if one.apply(key.trim(), value.trim()).is_err() {
                assert_eq!(one, before, "a rejected entry changes nothing");
            }
        }
    }
}

/// The kernel list format (`cpulist`, `online`, `has_memory`): accepted lists are strictly
/// ascending, bounded, and survive `format_list` → `parse_list`.
pub fn sysfs_list(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(ids) = sysfs::parse_list(&text) else {
        return;
    };
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "strictly ascending");
    assert!(ids.iter().all(|&id| id <= sysfs::MAX_LIST_ID));
    let formatted = sysfs::format_list(&ids);
    assert_eq!(
        sysfs::parse_list(&formatted).ok(),
        Some(ids),
        "{formatted:?}"
    );
}

/// `nodeN/distance` rows, `meminfo` totals, hex attributes and PCI `numa_node` values.
pub fn sysfs_distance(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(row) = sysfs::parse_distance_row(&text) {
        assert!(!row.is_empty());
        let joined = row.iter().map(u8::to_string).collect::<Vec<_>>().join(" ");
        assert_eq!(sysfs::parse_distance_row(&joined).ok(), Some(row));
    }
    if let Ok(bytes) = sysfs::parse_meminfo_total(&text) {
        assert_eq!(bytes % 1024, 0, "kB times 1024");
    }
    if let Ok(value) = sysfs::parse_hex_u32(&text) {
        assert_eq!(
            sysfs::parse_hex_u32(&format!("{value:#x}")).ok(),
            Some(value)
        );
    }
    if let Ok(node) = sysfs::parse_numa_node(&text) {
        let written = node.map_or_else(|| "-1".to_owned(), |n| n.to_string());
        assert_eq!(sysfs::parse_numa_node(&written).ok(), Some(node));
    }
}

/// PCI addresses (`PciAddress: FromStr`): accepted ones are in range and survive
/// `Display` → `parse`.
pub fn pci_address(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(addr) = text.parse::<PciAddress>() else {
        return;
    };
    assert!(addr.device <= 0x1f && addr.function <= 7, "{addr:?}");
    let shown = addr.to_string();
    assert_eq!(shown.parse::<PciAddress>().ok(), Some(addr), "{shown:?}");
    assert_eq!(shown, shown.trim());
}
