"""``python -m numa_gpu_alloc run [--gpu N] -- CMD ...``: the bundled launcher, with its
arguments. It replaces this process (exec), so CMD's exit status is the command's."""

import os
import sys

from numa_gpu_alloc import LAUNCHER


def main():
    os.execv(LAUNCHER, [LAUNCHER] + sys.argv[1:])


if __name__ == "__main__":
    main()
