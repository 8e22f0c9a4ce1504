"""A bare `lint-imports` at the repository root checks the layers on the layout as it installs:
an import that breaks a layer, added to `kernels/` or `launch/` (folders at the root, installed as
`jtree.kernels` and `jtree.launch`) or to `jtree/`, fails it (tests/import_layers.py says how)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_layers import WORKTREE


def checkout_copy(into: Path) -> Path:
    """What lint-imports reads of a checkout: pyproject.toml, the sources, the contract files."""
    for name in ("jtree", "kernels", "launch"):
        shutil.copytree(WORKTREE / name, into / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (into / "tests").mkdir()
    for name in ("pyproject.toml", "tests/__init__.py", "tests/import_layers.py",
                 "tests/import_layers.toml"):
        shutil.copy(WORKTREE / name, into / name)
    return into


@pytest.mark.parametrize("module, line, broken", [
    (None, "", None),
    ("kernels/tree_mask.py", "import jtree.config\n", "kernels import nothing else of jtree"),
    ("kernels/gdn/delta_rule.py", "import jtree.launch.train\n", "jtree's packages in layers"),
    ("jtree/training/run.py", "import jtree.launch.bench.step\n",
     "jtree's packages in layers"),
])
def test_bare_lint_imports_sees_kernels_and_launch(tmp_path: Path, module: str | None, line: str,
                                                   broken: str | None) -> None:
    root = checkout_copy(tmp_path)
    if module is not None:
        path = root / module
        path.write_text(path.read_text() + line)
    run = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
                         check=False, cwd=root, capture_output=True, text=True, timeout=600)
    report = run.stdout + run.stderr
    if broken is None:
        assert run.returncode == 0, report[-3000:]
        assert "1 kept, 0 broken" in report, report[-3000:]
    else:
        assert run.returncode != 0, report[-3000:]
        assert f"{broken} BROKEN" in report, report[-3000:]
