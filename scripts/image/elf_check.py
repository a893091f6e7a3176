"""Run inside the image's root filesystem by its own Python: every ELF file finds its libraries.

The root filesystem holds only the Debian packages of debian-packages.txt, not their dependency
closure, so a wheel or a library needing a package left out would fail only when first loaded.
This asks the image's dynamic loader (`ld.so --list`, as ldd does) about every executable and
shared object, and fails naming each library not found. Standard library only (it runs on the
image's interpreter, before anything else is installed there).
"""

from __future__ import annotations

import os
import subprocess
import sys

LOADER = "/lib64/ld-linux-x86-64.so.2"
SKIP = ("/proc", "/dev", "/sys")


def elf_files(top: str) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if os.path.join(folder, d) not in SKIP]
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    found.append(path)
    return sorted(found)


def main() -> None:
    missing: list[str] = []
    files = elf_files(sys.argv[1] if len(sys.argv) > 1 else "/")
    for path in files:
        listed = subprocess.run([LOADER, "--list", path], capture_output=True, text=True)
        missing += [f"{path}: {line.strip()}" for line in listed.stdout.splitlines() if "not found" in line]
    if missing:
        sys.exit("elf_check: libraries not found:\n" + "\n".join(missing))
    print(f"elf_check: {len(files)} ELF files, every library found")


if __name__ == "__main__":
    main()
