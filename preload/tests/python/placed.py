"""Python buffers of 64 MiB and more, checked page by page on the asked node.

usage: placed.py NODE [MIB ...]   (default sizes: 64 256)

Run under the preload library (``numa-gpu-alloc run -- python3 placed.py NODE``). For each size:
a ``bytearray`` (``PyByteArray`` takes ``malloc``), one grown by ``realloc`` from 1 MiB (glibc's
side of the threshold) to that size, and numpy's ``np.empty``/``np.zeros`` arrays
(``malloc``/``calloc``, aligned by numpy itself) when numpy is installed. One buffer lives at a
time, so the largest size is the most the asked node must hold. Every page is touched, then asked
for its node with ``move_pages``; the mapping's policy comes from ``/proc/self/numa_maps``
(glibc's memory says ``default``). Prints one line per buffer (the nodes of pages elsewhere in
brackets) and exits 1 when a page is elsewhere or a policy is not the library's.
"""

import collections
import ctypes
import os
import platform
import sys

MOVE_PAGES = {"x86_64": 279, "aarch64": 239}[platform.machine()]
PAGE = os.sysconf("SC_PAGESIZE")
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def address(buf):
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def nodes(addr, length):
    """Each page's node (negative: an errno, e.g. -ENOENT for a page never touched)."""
    first = addr // PAGE * PAGE
    count = (addr + length - first + PAGE - 1) // PAGE
    pages = (ctypes.c_void_p * count)(*[first + i * PAGE for i in range(count)])
    status = (ctypes.c_int * count)()
    if libc.syscall(MOVE_PAGES, 0, ctypes.c_ulong(count), pages, None, status, 0) != 0:
        raise OSError(ctypes.get_errno(), "move_pages")
    return list(status)


def policy(addr):
    """The NUMA policy of the mapping holding addr, as numa_maps writes it."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= addr < end:
                break
        else:
            return "?"
    with open("/proc/self/numa_maps") as numa:
        for line in numa:
            at, pol = line.split()[:2]
            if int(at, 16) == start:
                return pol
    return "?"


def check(name, buf, addr, node):
    view = memoryview(buf).cast("B")
    for i in range(0, len(view), PAGE):
        view[i] = 1
    view[-1] = 1  # the last page, when the buffer does not start on a page
    found = nodes(addr, len(view))
    count = collections.Counter(found)
    on = count.pop(node, 0)
    pol = policy(addr)
    others = ", ".join(f"node {n}: {k}" if n >= 0 else f"absent ({-n}): {k}" for n, k in sorted(count.items()))
    others = f" ({others})" if others else ""
    print(f"{name} {len(view) >> 20} MiB: policy {pol}, pages on node {node}: {on}, elsewhere: {len(found) - on}{others}")
    return on == len(found) and pol != "default"


def main():
    node = int(sys.argv[1])
    sizes = [int(mib) for mib in sys.argv[2:]] or [64, 256]
    try:
        import numpy as np
    except ImportError:
        np = None
        print("numpy: not installed, its arrays not checked")
    ok = True
    for mib in sizes:
        buf = bytearray(mib << 20)
        ok &= check("bytearray", buf, address(buf), node)
        del buf
        grown = bytearray(1 << 20)
        grown *= mib  # realloc from glibc's side of the threshold to ours, no other buffer
        ok &= check("bytearray.grown", grown, address(grown), node)
        del grown
        if np is not None:
            for make in (np.empty, np.zeros):
                arr = make(mib << 20, dtype=np.uint8)
                ok &= check(f"numpy.{make.__name__}", arr, arr.ctypes.data, node)
                del arr
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
