//! Finding a device: by ordinal, PCI address, UUID, or automatically from the local rank.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint};

use super::driver::{
    require_driver, Api, CuContext, CuDevice, CuUuid, DriverTable, ATTRIBUTE_HOST_NUMA_ID,
    ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, SUCCESS,
};
use crate::config::GpuSelector;
use crate::topology::pci::PciAddress;
use crate::{Error, Result};

/// Environment variables that launchers set to the process's rank on its node, in the order
/// they are consulted by [`GpuSelector::Auto`].
pub(super) const LOCAL_RANK_VARS: [&str; 4] = [
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
];

/// The local rank from the first of [`LOCAL_RANK_VARS`] whose value parses as a number.
/// `lookup` reads one variable (it is `std::env::var` in production, a map in tests).
pub(super) fn local_rank(lookup: impl Fn(&str) -> Option<String>) -> Option<usize> {
    LOCAL_RANK_VARS
        .iter()
        .find_map(|var| lookup(var).and_then(|v| v.trim().parse::<usize>().ok()))
}

/// The ordinal `GpuSelector::Auto` picks among `device_count` devices.
pub(super) fn auto_ordinal(lookup: impl Fn(&str) -> Option<String>, device_count: usize) -> usize {
    match (local_rank(lookup), device_count) {
        (Some(rank), n) if n > 0 => rank % n,
        _ => 0,
    }
}

/// A selector as the user would write it, for [`Error::GpuNotFound`].
pub(super) fn selector_text(selector: &GpuSelector) -> String {
    match selector {
        GpuSelector::Auto => "auto".to_owned(),
        GpuSelector::Ordinal(n) => n.to_string(),
        GpuSelector::Pci(addr) => format!("pci:{addr}"),
        GpuSelector::Uuid(bytes) => uuid_text(bytes),
        GpuSelector::Current => "current".to_owned(),
    }
}

thread_local! {
    /// The calling thread's last current context (its address; 0: none yet) and the ordinal of
    /// its device. Const-initialised without `Drop`: readable on the allocation path.
    static CURRENT: Cell<(usize, u32)> = const { Cell::new((0, 0)) };
}

/// The ordinal of the device of the calling thread's current CUDA context: one
/// `cuCtxGetCurrent`, and `cuCtxGetDevice` only when the context changed since the last call on
/// this thread. `None` without a usable driver or a current context, and in a forked child (which
/// never calls the driver). Allocates only on a context's first use (the driver probe); never
/// panics.
pub(crate) fn current_ordinal() -> Option<u32> {
    if crate::fork::generation() > 0 {
        return None;
    }
    let live = require_driver().ok()?.enter().ok()?;
    current_ordinal_in(&live)
}

/// [`current_ordinal`] through `api`.
pub(super) fn current_ordinal_in(api: &Api) -> Option<u32> {
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: cuCtxGetCurrent from the initialised driver; `ctx` is a valid out-pointer.
    let res = unsafe { (api.ctx_get_current)(&mut ctx) };
    if res != SUCCESS || ctx.is_null() {
        return None;
    }
    let (seen, ordinal) = CURRENT.try_with(Cell::get).ok()?;
    if seen == ctx as usize {
        return Some(ordinal);
    }
    let mut dev: CuDevice = 0;
    // SAFETY: cuCtxGetDevice from the initialised driver (a context is current); `dev` is a
    // valid out-pointer.
    let res = unsafe { (api.ctx_get_device)(&mut dev) };
    if res != SUCCESS {
        return None;
    }
    // The handle is not promised to be the ordinal: find the ordinal whose handle it is.
    let count = raw::device_count(api).ok()?;
    let ordinal = (0..count).find(|&i| raw::device(api, i).ok() == Some(dev))?;
    let ordinal = u32::try_from(ordinal).ok()?;
    let _ = CURRENT.try_with(|c| c.set((ctx as usize, ordinal)));
    Some(ordinal)
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub(super) fn uuid_text(bytes: &[u8; 16]) -> String {
    let mut s = String::with_capacity(40);
    s.push_str("GPU-");
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Bytes of a NUL-terminated C string in `buf` (all of it when there is no NUL).
pub(super) fn c_buf_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Safe wrappers for the per-device queries, through the resolved entry points.
pub(super) mod raw {
    use super::*;

    pub(in crate::cuda) fn device_count(api: &Api) -> Result<usize> {
        let mut count: c_int = 0;
        // SAFETY: `api` holds cuDeviceGetCount from the loaded, initialised driver; `count` is a
        // valid out-pointer.
        let res = unsafe { (api.device_get_count)(&mut count) };
        api.check("cuDeviceGetCount", res)?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    pub(in crate::cuda) fn device(api: &Api, ordinal: usize) -> Result<CuDevice> {
        let ordinal = c_int::try_from(ordinal).map_err(|_| Error::Cuda {
            call: "cuDeviceGet",
            code: 101,
            name: "CUDA_ERROR_INVALID_DEVICE",
        })?;
        let mut dev: CuDevice = 0;
        // SAFETY: cuDeviceGet from the initialised driver; `dev` is a valid out-pointer.
        let res = unsafe { (api.device_get)(&mut dev, ordinal) };
        api.check("cuDeviceGet", res)?;
        Ok(dev)
    }

    pub(in crate::cuda) fn pci_bus_id(api: &Api, dev: CuDevice) -> Result<String> {
        let mut buf: [c_char; 64] = [0; 64];
        // SAFETY: cuDeviceGetPCIBusId from the initialised driver; the buffer is 64 bytes and its
        // length is passed, the driver writes at most that many bytes including the NUL.
        let res = unsafe { (api.device_get_pci_bus_id)(buf.as_mut_ptr(), 64, dev) };
        api.check("cuDeviceGetPCIBusId", res)?;
        Ok(c_buf_text(&buf))
    }

    pub(in crate::cuda) fn pci_address(api: &Api, dev: CuDevice) -> Result<PciAddress> {
        let text = pci_bus_id(api, dev)?;
        text.parse::<PciAddress>()
            .map_err(|_| Error::InvalidPciAddress { input: text })
    }

    pub(in crate::cuda) fn name(api: &Api, dev: CuDevice) -> Result<String> {
        let mut buf: [c_char; 256] = [0; 256];
        // SAFETY: cuDeviceGetName from the initialised driver; the buffer is 256 bytes and its
        // length is passed.
        let res = unsafe { (api.device_get_name)(buf.as_mut_ptr(), 256, dev) };
        api.check("cuDeviceGetName", res)?;
        Ok(c_buf_text(&buf))
    }

    /// Whether `want` is the device's UUID as either entry point reports it: under MIG,
    /// `cuDeviceGetUuid_v2` gives the MIG instance's UUID and `cuDeviceGetUuid` the physical
    /// GPU's, and users may name either.
    pub(in crate::cuda) fn uuid_matches(api: &Api, dev: CuDevice, want: &[u8; 16]) -> Result<bool> {
        let getters = [
            ("cuDeviceGetUuid_v2", api.device_get_uuid_v2),
            ("cuDeviceGetUuid", api.device_get_uuid),
        ];
        if getters.iter().all(|(_, getter)| getter.is_none()) {
            return Err(Error::CudaUnavailable {
                reason: "libcuda exports neither cuDeviceGetUuid_v2 nor cuDeviceGetUuid",
            });
        }
        for (call, getter) in getters {
            let Some(getter) = getter else { continue };
            let mut uuid = CuUuid { bytes: [0; 16] };
            // SAFETY: the entry point was resolved from the initialised driver with the
            // prototype `CUresult (CUuuid *, CUdevice)`; `uuid` is a valid out-pointer to a
            // 16-byte `#[repr(C)]` struct.
            let res = unsafe { getter(&mut uuid, dev) };
            api.check(call, res)?;
            if uuid.bytes == *want {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// An integer attribute of the device; `None` when the driver refuses the query (drivers
    /// older than the attribute answer CUDA_ERROR_INVALID_VALUE): unknown, not an error.
    pub(in crate::cuda) fn attribute(api: &Api, dev: CuDevice, attribute: c_uint) -> Option<c_int> {
        let mut value: c_int = -1;
        // SAFETY: cuDeviceGetAttribute from the initialised driver; `value` is a valid
        // out-pointer; an attribute the driver does not know is refused, not misread.
        let res = unsafe { (api.device_get_attribute)(&mut value, attribute, dev) };
        (res == SUCCESS).then_some(value)
    }
}

/// A CUDA device, found but not opened: what placement needs (no context is created).
#[derive(Clone, Debug)]
pub(crate) struct Device {
    pub(super) driver: &'static DriverTable,
    pub(super) ordinal: u32,
    pub(super) dev: CuDevice,
    pub(super) pci: PciAddress,
    pub(super) name: String,
    pub(super) host_numa_id: Option<usize>,
    /// `CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED`, when the driver reports it.
    pub(super) read_only_register: Option<bool>,
}

impl Device {
    /// Finds the device the selector names, without creating a context.
    ///
    /// `Auto` takes the first of `LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `MPI_LOCALRANKID` that parses, modulo the device count, else device 0. `Pci` compares
    /// `cuDeviceGetPCIBusId` as a parsed address (so case and domain width do not matter). `Uuid`
    /// compares the 16 bytes with `cuDeviceGetUuid_v2` and with `cuDeviceGetUuid` (whichever the
    /// driver exports), so that under MIG both the instance's and the GPU's UUID match.
    ///
    /// Errors: [`Error::CudaUnavailable`] without a usable driver or with no visible device,
    /// [`Error::GpuNotFound`] when no device matches, [`Error::Cuda`] when a driver call fails.
    pub(crate) fn find(selector: GpuSelector) -> Result<Device> {
        let driver = require_driver()?;
        let live = driver.enter()?;
        let api: &Api = &live;
        let count = raw::device_count(api)?;
        if count == 0 {
            return Err(Error::CudaUnavailable {
                reason: "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)",
            });
        }
        let not_found = || Error::GpuNotFound {
            selector: selector_text(&selector),
            device_count: count,
        };
        let ordinal = match selector {
            GpuSelector::Auto => auto_ordinal(|v| std::env::var(v).ok(), count),
            GpuSelector::Current => current_ordinal()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(not_found)?,
            GpuSelector::Ordinal(n) => match usize::try_from(n) {
                Ok(n) if n < count => n,
                _ => return Err(not_found()),
            },
            GpuSelector::Pci(want) => {
                let mut found = None;
                for i in 0..count {
                    let dev = raw::device(api, i)?;
                    if raw::pci_address(api, dev).ok() == Some(want) {
                        found = Some(i);
                        break;
                    }
                }
                found.ok_or_else(not_found)?
            }
            GpuSelector::Uuid(want) => {
                let mut found = None;
                for i in 0..count {
                    let dev = raw::device(api, i)?;
                    if raw::uuid_matches(api, dev, &want)? {
                        found = Some(i);
                        break;
                    }
                }
                found.ok_or_else(not_found)?
            }
        };
        let dev = raw::device(api, ordinal)?;
        let pci = raw::pci_address(api, dev)?;
        let name = raw::name(api, dev)?;
        // Drivers before 12.2 do not know HOST_NUMA_ID; -1 means no NUMA affinity.
        let host_numa_id = raw::attribute(api, dev, ATTRIBUTE_HOST_NUMA_ID)
            .and_then(|node| usize::try_from(node).ok());
        let read_only_register =
            raw::attribute(api, dev, ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED).map(|v| v != 0);
        Ok(Device {
            driver,
            ordinal: u32::try_from(ordinal).unwrap_or(u32::MAX),
            dev,
            pci,
            name,
            host_numa_id,
            read_only_register,
        })
    }

    /// The CUDA device ordinal (an index among the visible devices).
    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's PCI address.
    pub(crate) fn pci_address(&self) -> PciAddress {
        self.pci
    }

    /// The device's marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub(crate) fn name(&self) -> String {
        self.name.clone()
    }

    /// Whether the device accepts `CU_MEMHOSTREGISTER_READ_ONLY`; `None` when the driver does not
    /// say.
    pub(crate) fn read_only_register(&self) -> Option<bool> {
        self.read_only_register
    }

    /// The GPU's home NUMA node: the driver's host NUMA id, else the `numa_node` of its PCI
    /// device under `sysfs_root`.
    pub(crate) fn home_node(&self, sysfs_root: &std::path::Path) -> Result<Option<usize>> {
        match self.host_numa_id {
            Some(node) => Ok(Some(node)),
            None => crate::topology::pci::home_node(sysfs_root, &self.pci),
        }
    }
}
