"""The package layers of docs/architecture.md, checked by `lint-imports` (pyproject.toml's
contracts) on the layout as it installs.

`kernels/` and `launch/` sit at the repository root and install as `jtree.kernels` and
`jtree.launch` (a setuptools package-dir mapping). import-linter's graph builder (grimp) reads a
root package's modules from its one folder and does not follow such a mapping, so run on the
checkout it would find neither package. `stage` copies the Python sources into the shape they
have once installed (`jtree/kernels/`, `jtree/launch/`) and `lint` runs lint-imports on that copy
with the repository's own contracts.

    python -m tests.import_layers     # what `make test` runs first
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WORKTREE = Path(__file__).resolve().parent.parent
MAPPED = {"kernels": "jtree/kernels", "launch": "jtree/launch"}  # pyproject.toml's package-dir


def stage(root: Path, into: Path) -> Path:
    """Copy `root`'s packages into `into` as they install; returns `into`."""
    only_python = shutil.ignore_patterns("__pycache__", "*.cc", "*.h", "*.sh", "*.sbatch")
    shutil.copytree(root / "jtree", into / "jtree", ignore=only_python)
    for folder, package_path in MAPPED.items():
        shutil.copytree(root / folder, into / package_path, ignore=only_python)
    return into


def lint(staged: Path, config: Path) -> subprocess.CompletedProcess:
    """lint-imports with `config`'s contracts over the staged copy (its exit status: 0 = kept)."""
    exe = Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=str(staged))
    return subprocess.run([str(exe), str(config), "--no-cache"], cwd=staged, env=env,
                          capture_output=True, text=True, timeout=600)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="jtree-layers-") as tmp:
        run = lint(stage(WORKTREE, Path(tmp)), WORKTREE / "pyproject.toml")
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
