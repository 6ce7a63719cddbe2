//! PCI addresses, a device's home NUMA node, and the NVIDIA GPUs found in sysfs.
//!
//! Public as `numa_gpu_alloc::unstable::pci` (part of [`topology`](crate::NumaTopology)'s layer): for
//! programs that look up a GPU's node themselves, and for the fuzz targets of [`PciAddress`]'s
//! parser. The allocator uses it to find a GPU's home node when CUDA does not say.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use super::sysfs::{parse_hex_u32, parse_numa_node, read_parsed, read_parsed_optional};
use crate::{Error, Result};

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR_ID: u16 = 0x10de;

/// PCI class codes (base class, subclass) of GPUs: VGA controller and 3D controller.
const GPU_CLASSES: [u32; 2] = [0x0300, 0x0302];

/// A PCI bus address `DOMAIN:BUS:DEVICE.FUNCTION`.
///
/// Parses the forms CUDA (`0000:81:00.0`) and NVML (`00000000:81:00.0`) print, in either case and
/// with surrounding whitespace. Displays as sysfs names devices: `%04x:%02x:%02x.%x`.
///
/// ```
/// use numa_gpu_alloc::unstable::pci::PciAddress;
/// let a: PciAddress = "00000000:81:00.0".parse()?;
/// assert_eq!(a.to_string(), "0000:81:00.0");
/// # Ok::<(), numa_gpu_alloc::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number, at most `0x1f`.
    pub device: u8,
    /// Function number, at most 7.
    pub function: u8,
}

/// Parses 1..=`max_digits` hex digits (no sign, no prefix).
fn hex_field(s: &str, max_digits: usize) -> Option<u32> {
    if s.is_empty() || s.len() > max_digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

impl FromStr for PciAddress {
    type Err = Error;

    fn from_str(input: &str) -> Result<Self> {
        let invalid = || Error::InvalidPciAddress {
            input: input.to_owned(),
        };
        let (domain, rest) = input.trim().split_once(':').ok_or_else(invalid)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(invalid)?;
        let (device, function) = rest.split_once('.').ok_or_else(invalid)?;
        let domain = hex_field(domain, 8).ok_or_else(invalid)?;
        let bus = hex_field(bus, 2).and_then(|v| u8::try_from(v).ok());
        let device = hex_field(device, 2)
            .filter(|&v| v <= 0x1f)
            .and_then(|v| u8::try_from(v).ok());
        let function = hex_field(function, 1)
            .filter(|&v| v <= 7)
            .and_then(|v| u8::try_from(v).ok());
        match (bus, device, function) {
            (Some(bus), Some(device), Some(function)) => Ok(Self {
                domain,
                bus,
                device,
                function,
            }),
            _ => Err(invalid()),
        }
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

/// The home NUMA node of the PCI device `addr`: `<sysfs_root>/bus/pci/devices/<addr>/numa_node`.
///
/// `Ok(None)` when the kernel does not know (`-1`, or no `numa_node` attribute on a kernel without
/// NUMA). The node is never guessed from `local_cpus`, which then lists every CPU.
///
/// # Errors
///
/// * [`Error::Io`] if the device does not exist or the file cannot be read;
/// * [`Error::Parse`] if `numa_node` is malformed.
pub fn home_node(sysfs_root: &Path, addr: &PciAddress) -> Result<Option<usize>> {
    let dir = sysfs_root.join("bus/pci/devices").join(addr.to_string());
    let path = dir.join("numa_node");
    match read_parsed_optional(&path, parse_numa_node)? {
        Some(node) => Ok(node),
        // The device exists but has no attribute: a non-NUMA kernel.
        None if dir.is_dir() => Ok(None),
        None => Err(Error::Io {
            path,
            kind: std::io::ErrorKind::NotFound,
            errno: Some(libc::ENOENT),
        }),
    }
}

/// An NVIDIA GPU found in sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Its PCI address.
    pub address: PciAddress,
    /// The PCI device id (`device`), e.g. `0x2330` for an H100 SXM.
    pub device_id: u16,
    /// The 24-bit PCI class code (`class`), `0x0300xx` or `0x0302xx`.
    pub class: u32,
    /// Its home NUMA node, `None` if the kernel does not know (see [`home_node`]).
    pub home_node: Option<usize>,
}

/// Lists the NVIDIA GPUs (vendor `0x10de`, class VGA `0x0300xx` or 3D `0x0302xx`) under
/// `<sysfs_root>/bus/pci/devices`, sorted by address.
///
/// No such directory (no PCI bus, or a stripped container `/sys`) gives an empty list. Entries
/// whose names are not PCI addresses are skipped.
///
/// # Errors
///
/// [`Error::Io`] / [`Error::Parse`] if the directory or a device's `vendor`, `class`, `device` or
/// `numa_node` cannot be read or parsed.
pub fn nvidia_gpus(sysfs_root: &Path) -> Result<Vec<GpuInfo>> {
    let devices = sysfs_root.join("bus/pci/devices");
    let io = |e: std::io::Error| Error::Io {
        path: devices.clone(),
        kind: e.kind(),
        errno: e.raw_os_error(),
    };
    let entries = match std::fs::read_dir(&devices) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(e)),
    };
    let mut gpus = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io)?;
        let Some(address) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<PciAddress>().ok())
        else {
            continue;
        };
        let dir = entry.path();
        let vendor = read_parsed(&dir.join("vendor"), parse_hex_u32)?;
        if vendor != u32::from(NVIDIA_VENDOR_ID) {
            continue;
        }
        let class = read_parsed(&dir.join("class"), parse_hex_u32)?;
        if !GPU_CLASSES.contains(&(class >> 8)) {
            continue;
        }
        let device_path = dir.join("device");
        let device_id = read_parsed(&device_path, parse_hex_u32)?;
        let device_id = u16::try_from(device_id).map_err(|_| {
            super::sysfs::at_path(
                super::sysfs::parse_error("a 16-bit device id", &format!("{device_id:#x}")),
                &device_path,
            )
        })?;
        let home_node = read_parsed_optional(&dir.join("numa_node"), parse_numa_node)?.flatten();
        gpus.push(GpuInfo {
            address,
            device_id,
            class,
            home_node,
        });
    }
    gpus.sort_by_key(|gpu| gpu.address);
    Ok(gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(domain: u32, bus: u8, device: u8, function: u8) -> PciAddress {
        PciAddress {
            domain,
            bus,
            device,
            function,
        }
    }

    #[test]
    fn parses_cuda_and_nvml_forms() {
        let want = addr(0, 0x81, 0, 0);
        assert_eq!("0000:81:00.0".parse(), Ok(want));
        assert_eq!("00000000:81:00.0".parse(), Ok(want));
        assert_eq!("  0000:81:00.0\n".parse(), Ok(want));
        assert_eq!("0001:C1:1F.7".parse(), Ok(addr(1, 0xc1, 0x1f, 7)));
        assert_eq!("0001:c1:1f.7".parse(), Ok(addr(1, 0xc1, 0x1f, 7)));
    }

    #[test]
    fn rejects_malformed_addresses() {
        for bad in [
            "",
            "81:00.0",
            "0000:81:00",
            "0000:81:20.0",
            "0000:81:00.8",
            "0000:181:00.0",
            "000000000:81:00.0",
            "0000:81:00.0.1",
            "0000:+1:00.0",
            "0000:81:00.g",
            "0000 :81:00.0",
            "0000:81:00:0",
        ] {
            assert_eq!(
                bad.parse::<PciAddress>(),
                Err(Error::InvalidPciAddress {
                    input: bad.to_owned()
                }),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn displays_like_sysfs() {
        assert_eq!(addr(0, 0x81, 0, 0).to_string(), "0000:81:00.0");
        assert_eq!(addr(0xabcd, 1, 0x1f, 7).to_string(), "abcd:01:1f.7");
        assert_eq!(addr(0x10000, 2, 3, 4).to_string(), "10000:02:03.4");
        let round: PciAddress = "10000:02:03.4".parse().expect("parse");
        assert_eq!(round, addr(0x10000, 2, 3, 4));
    }

    #[test]
    fn sorts_by_domain_then_bus() {
        let mut v = [addr(1, 0, 0, 0), addr(0, 0x81, 0, 0), addr(0, 0x02, 1, 0)];
        v.sort();
        assert_eq!(v, [addr(0, 2, 1, 0), addr(0, 0x81, 0, 0), addr(1, 0, 0, 0)]);
    }
}
