//! What the host of a virtual machine does with the guest's free memory.

use std::path::Path;

/// `VIRTIO_BALLOON_F_REPORTING`: the guest reports free blocks of memory to the host, which
/// takes them back (the virtio specification, 5.5.3).
const BALLOON_F_REPORTING: usize = 5;

/// Whether a virtio balloon under `root` (`/sys` normally) has free page reporting on: the guest
/// kernel hands free blocks (of `page_reporting_order` and up, 128 KiB–2 MiB) to the host, and
/// the next fault on such a block waits for the host to back it again, page by page. A huge-page
/// fault takes a whole free 2 MiB block, after a few seconds idle nearly always a reported one;
/// small pages come first from the kernel's lists of small free pieces, which are not reported.
/// `false` without such a device (bare metal, other hypervisors) or when sysfs cannot be read.
/// Allocates (a directory listing): call it inside the re-entrancy guard.
pub(crate) fn free_page_reporting(root: &Path) -> bool {
    let Ok(devices) = std::fs::read_dir(root.join("bus/virtio/drivers/virtio_balloon")) else {
        return false;
    };
    devices.flatten().any(|device| {
        // The device's negotiated feature bits, one character per bit from bit 0.
        std::fs::read_to_string(device.path().join("features"))
            .is_ok_and(|bits| bits.as_bytes().get(BALLOON_F_REPORTING) == Some(&b'1'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_page_reporting_is_read_from_the_balloons_feature_bits() {
        let root = std::env::temp_dir().join(format!("nga-balloon-{}", std::process::id()));
        let device = root.join("bus/virtio/drivers/virtio_balloon/virtio0");
        std::fs::create_dir_all(&device).unwrap();
        assert!(!free_page_reporting(&root), "no features file");
        // This VM's balloon (Firecracker): bits 1, 2, 5 and 32.
        let features = "0110010100000000000000000000000010000000";
        std::fs::write(device.join("features"), features).unwrap();
        assert!(free_page_reporting(&root));
        std::fs::write(device.join("features"), "0110000100000000").unwrap();
        assert!(!free_page_reporting(&root), "bit 5 clear");
        std::fs::remove_dir_all(&root).unwrap();
        assert!(!free_page_reporting(&root), "no balloon");
    }
}
