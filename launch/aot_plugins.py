"""The production compilers for ahead-of-time compiles on a host without an accelerator:

    python -m jtree.launch.aot_plugins [DIR]      (what `make aot-plugins` runs; DIR default .aot)

installs libtpu (XLA:TPU) into DIR/tpu and jax's CUDA 12 plugin and PJRT library (XLA:GPU) into
DIR/cuda, each with `pip install --target`, at the versions the installed jax asks for: libtpu at
the pin of jax's `tpu` extra, the CUDA plugin at jax's own version. They stay out of the virtual
environment on purpose: on a host without CUDA the plugin complains at every `import jax`, and
libtpu looks for TPU metadata. `jtree.launch.compile` puts one folder on the PYTHONPATH of its
worker process. The CUDA wheels go in without their dependencies (the NVIDIA runtime libraries):
compiling needs none of them.

A folder whose recorded requirement matches is left alone, so a second run installs nothing.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PLATFORMS = ("tpu", "cuda")
# Written into a platform's folder after a complete install: the requirements it holds.
STAMP = ".requirements"


def plugin_root() -> Path:
    """The folder holding one plugin folder per platform: $JTREE_AOT_DIR, else `.aot` in the
    current directory (the repository root, where `make aot-plugins` runs)."""
    return Path(os.environ.get("JTREE_AOT_DIR", ".aot"))


def requirements(platform: str) -> list[str]:
    """The pip requirements of `platform`'s compiler, read from the installed jax's metadata."""
    jax_version = importlib.metadata.version("jax")
    if platform == "cuda":
        return [f"jax-cuda12-plugin=={jax_version}", f"jax-cuda12-pjrt=={jax_version}"]
    for req in importlib.metadata.requires("jax") or []:
        match = re.fullmatch(r'libtpu\s*([^;]+?)\s*;\s*extra\s*==\s*"tpu"', req)
        if match:
            return [f"libtpu{match.group(1)}"]
    raise RuntimeError(f"jax {jax_version}: its metadata pins no libtpu for the `tpu` extra")


def installed(platform: str, root: Path | None = None) -> Path | None:
    """`platform`'s plugin folder when a complete install of today's requirements is there."""
    folder = (root or plugin_root()) / platform
    stamp = folder / STAMP
    if stamp.is_file() and stamp.read_text().split() == requirements(platform):
        return folder
    return None


def install(platform: str, root: Path) -> Path:
    """Install `platform`'s compiler into root/platform unless it is already there. pip writes
    into a scratch folder that replaces the old one only when complete, so an interrupted install
    never looks installed."""
    folder = installed(platform, root)
    if folder is not None:
        print(f"aot-plugins: {platform}: {' '.join(requirements(platform))} already in {folder}")
        return folder
    folder, scratch = root / platform, root / f"{platform}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    reqs = requirements(platform)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    str(scratch), *reqs], check=True)
    (scratch / STAMP).write_text("\n".join(reqs) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    scratch.rename(folder)
    print(f"aot-plugins: {platform}: installed {' '.join(reqs)} into {folder}")
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    root = Path(args[0]) if args else plugin_root()
    root.mkdir(parents=True, exist_ok=True)
    for platform in PLATFORMS:
        install(platform, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
