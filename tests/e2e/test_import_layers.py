"""The layer contracts see the installed layout: an import that breaks a layer, added to the staged
`jtree.kernels` or `jtree.launch` (folders at the repository root), fails lint-imports, as it would
in the installed package (tests/import_layers.py says why the sources are staged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_layers import WORKTREE, lint, stage


@pytest.mark.parametrize("module, line, broken", [
    (None, "", None),
    ("jtree/kernels/tree_mask.py", "import jtree.config\n", "kernels import nothing else"),
    ("jtree/kernels/gdn/delta_rule.py", "import jtree.launch.train\n", "layers BROKEN"),
    ("jtree/training/run.py", "import jtree.launch.bench.step\n", "layers BROKEN"),
])
def test_contracts_see_kernels_and_launch(tmp_path: Path, module: str | None, line: str,
                                          broken: str | None) -> None:
    staged = stage(WORKTREE, tmp_path)
    if module is not None:
        path = staged / module
        path.write_text(path.read_text() + line)
    run = lint(staged, WORKTREE / "pyproject.toml")
    if broken is None:
        assert run.returncode == 0, run.stdout[-3000:]
    else:
        assert run.returncode != 0 and broken in run.stdout, run.stdout[-3000:]
