"""Prints the files a Python script needs from this interpreter's installation, one per line, so
that scripts/numa-guests.sh can copy a minimal Python into a guest's initramfs.

usage: python3 -S -B python-files.py SCRIPT [ARGS...]

Runs SCRIPT with ARGS (its output, exit status and errors ignored: it runs here only to import
what it imports, on the host, where it may well fail its own checks or be refused `move_pages`
in a container), then lists the interpreter, every
loaded module's file (source or extension) and its cached bytecode, and `os.py`, the landmark
from which Python finds its standard library. Run it with the flags and `PYTHONPATH` the guest
uses, so that the same modules load.
"""

import contextlib
import io
import os
import runpy
import sys


def main():
    script = sys.argv[1]
    if not os.path.isfile(script):
        sys.exit(f"python-files.py: {script} is not a file")
    sys.argv = sys.argv[1:]
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(script, run_name="__main__")
        except (SystemExit, Exception):
            pass
    files = {os.path.realpath(sys.executable), os.path.join(os.path.dirname(os.__file__), "os.py")}
    for module in list(sys.modules.values()):
        for attr in ("__file__", "__cached__"):
            path = getattr(module, attr, None)
            if isinstance(path, str) and os.path.isfile(path):
                files.add(os.path.abspath(path))
    for path in sorted(files):
        print(path)


if __name__ == "__main__":
    main()
