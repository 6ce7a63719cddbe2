"""Builds the numa_gpu_alloc wheel from a cargo build, with the standard library only (no
network, no build backend): the package's Python files, the preload library (cargo's
``libnuma_gpu_alloc_preload.so``, shipped as ``libnuma_gpu_alloc.so``) and the launcher, tagged
for this machine's Linux architecture.

usage: python3 build_wheel.py TARGET_DIR OUT_DIR   (TARGET_DIR: e.g. target/release)
Prints the wheel's path.
"""

import base64
import hashlib
import os
import platform
import re
import stat
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "numa_gpu_alloc"


def version():
    """The preload package's version, from its Cargo.toml."""
    with open(os.path.join(HERE, "..", "Cargo.toml")) as f:
        return re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


def record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def main():
    target, out = sys.argv[1], sys.argv[2]
    ver = version()
    tag = f"py3-none-linux_{platform.machine()}"
    dist_info = f"{NAME}-{ver}.dist-info"
    files = []  # (path in the wheel, bytes, executable)
    for name in ("__init__.py", "__main__.py"):
        with open(os.path.join(HERE, NAME, name), "rb") as f:
            files.append((f"{NAME}/{name}", f.read(), False))
    # (as cargo builds it, as the wheel ships it, executable): the package's library is
    # `numa_gpu_alloc_preload` for cargo (`numa_gpu_alloc` is the crate's), `LIBRARY` here.
    for built, name, exe in (
        ("libnuma_gpu_alloc_preload.so", "libnuma_gpu_alloc.so", False),
        ("numa-gpu-alloc", "numa-gpu-alloc", True),
    ):
        path = os.path.join(target, built)
        if not os.path.isfile(path):
            sys.exit(f"{path} not found: run `cargo build --release -p numa-gpu-alloc-preload` first")
        with open(path, "rb") as f:
            files.append((f"{NAME}/{name}", f.read(), exe))
    metadata = (
        "Metadata-Version: 2.1\n"
        f"Name: numa-gpu-alloc\nVersion: {ver}\n"
        "Summary: Places large malloc()s of Python programs on the NUMA node nearest the GPU "
        "(an LD_PRELOAD library and its launcher)\n"
        "License: MIT OR Apache-2.0\nRequires-Python: >=3.8\n"
    )
    wheel = f"Wheel-Version: 1.0\nGenerator: build_wheel.py\nRoot-Is-Purelib: false\nTag: {tag}\n"
    files.append((f"{dist_info}/METADATA", metadata.encode(), False))
    files.append((f"{dist_info}/WHEEL", wheel.encode(), False))
    record = [record_line(p, d) for p, d, _ in files] + [f"{dist_info}/RECORD,,"]
    files.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode(), False))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{NAME}-{ver}-{tag}.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data, exe in files:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            mode = 0o755 if exe else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(info, data)
    print(path)


if __name__ == "__main__":
    main()
