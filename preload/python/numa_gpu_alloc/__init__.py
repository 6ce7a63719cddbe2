"""numa-gpu-alloc for Python programs: the preload library and its launcher, bundled.

``python -m numa_gpu_alloc run [--gpu N] -- CMD ...`` runs CMD with ``libnuma_gpu_alloc.so``
preloaded, so that its large ``malloc``s (PyTorch's pinned memory with
``pinned_use_cuda_host_register:True``, CPU tensors, numpy arrays, bytearrays) are placed on the
NUMA node nearest the GPU. See the crate's README, "Python and other programs".
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

#: The preload library bundled with this package.
LIBRARY = os.path.join(_HERE, "libnuma_gpu_alloc.so")
#: The launcher bundled with this package (it finds the library next to itself).
LAUNCHER = os.path.join(_HERE, "numa-gpu-alloc")
