//! PCI devices and NVIDIA GPUs found in sysfs (in progress).
