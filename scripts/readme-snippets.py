#!/usr/bin/env python3
"""Builds and runs every ```rust block of README.md as a reader would paste it: each in a fresh
binary crate (`cargo new`'s edition) whose `[dependencies]` are the README's ```toml block, with
numa-gpu-alloc taken from this checkout. Offline, with the checkout's Cargo.lock (the versions the
crate is tested with) and one target directory for all, so the dependencies build once.

Fails, naming the snippet, when one does not build, exits non-zero (a panic included) or within
60 s, or holds a line rustdoc hides (`# ...`): GitHub and crates.io show those. A snippet that
needs a GPU must check for one and, without, say so and exit 0.

    python3 scripts/readme-snippets.py [--target-dir DIR]   (default: the checkout's target/)
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EDITION = "2024"  # what `cargo new` writes
RUN_SECONDS = 60


def blocks(path):
    """(info string, first line number, text) of each fenced block."""
    found, info, start, body = [], None, 0, []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fence = re.match(r"```(\S*)\s*$", line)
            if info is None and fence:
                info, start, body = fence.group(1), number + 1, []
            elif info is not None and line.rstrip() == "```":
                found.append((info, start, "".join(body)))
                info = None
            elif info is not None:
                body.append(line)
    return found


def dependencies(readme_blocks):
    """The README's `[dependencies]`, numa-gpu-alloc pointed at this checkout."""
    tables = [text for info, _, text in readme_blocks if info == "toml" and "[dependencies]" in text]
    if len(tables) != 1:
        sys.exit(f"README.md: expected one ```toml block with [dependencies], found {len(tables)}")
    deps = tomllib.loads(tables[0])["dependencies"]
    with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
        version = tomllib.load(f)["package"]["version"]
    wanted = deps.get("numa-gpu-alloc")
    if not isinstance(wanted, str) or not (version + ".").startswith(wanted + "."):
        sys.exit(f"README.md: [dependencies] should name numa-gpu-alloc's version {version}, has {wanted!r}")
    lines = [f'numa-gpu-alloc = {{ path = "{ROOT}" }}']
    lines += [line for line in tables[0].splitlines()
              if line.strip() and not line.startswith(("[", "numa-gpu-alloc "))]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-dir", default=os.path.join(ROOT, "target"))
    args = parser.parse_args()
    readme_blocks = blocks(os.path.join(ROOT, "README.md"))
    deps = dependencies(readme_blocks)
    snippets = [(line, text) for info, line, text in readme_blocks if info.split(",")[0] == "rust"]
    work = os.path.join(ROOT, "target", "readme-snippets")
    shutil.rmtree(work, ignore_errors=True)
    failed = []
    for n, (line, text) in enumerate(snippets, 1):
        first = next((l for l in text.splitlines() if l.strip()), "")
        name = f"snippet {n} (README.md line {line}: `{first.strip()}`)"
        print(f"==> {name}", flush=True)
        hidden = [line + i for i, l in enumerate(text.splitlines()) if re.match(r"\s*#(\s|$)", l)]
        if hidden:
            failed.append(f"{name}: rustdoc's hidden lines at {hidden} show on GitHub and crates.io")
            continue
        package = f"readme-snippet-{n}"
        crate = os.path.join(work, package)
        os.makedirs(os.path.join(crate, "src"))
        with open(os.path.join(crate, "Cargo.toml"), "w") as f:
            f.write(f'[package]\nname = "{package}"\nversion = "0.0.0"\nedition = "{EDITION}"\n'
                    f"publish = false\n\n[dependencies]\n{deps}\n")
        with open(os.path.join(crate, "src", "main.rs"), "w") as f:
            f.write(text)
        shutil.copy(os.path.join(ROOT, "Cargo.lock"), crate)
        build = subprocess.run(["cargo", "build", "--offline", "--quiet", "--target-dir", args.target_dir],
                               cwd=crate, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if build.returncode != 0:
            print(build.stdout, end="")
            failed.append(f"{name}: does not build")
            continue
        try:
            run = subprocess.run([os.path.join(args.target_dir, "debug", package)], cwd=crate,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 timeout=RUN_SECONDS)
        except subprocess.TimeoutExpired:
            failed.append(f"{name}: still running after {RUN_SECONDS} s")
            continue
        for out in run.stdout.splitlines():
            print(f"    {out}")
        if run.returncode != 0:
            failed.append(f"{name}: exited with status {run.returncode}")
    if not snippets:
        failed.append("README.md holds no ```rust block")
    for why in failed:
        print(f"FAILED: {why}", file=sys.stderr)
    print(f"{len(snippets) - len(failed)} of {len(snippets)} README snippets build and run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
