"""A bare `lint-imports` at the repository root checks the layers on the layout as it installs:
an import that breaks a layer, added to `kernels/` or `launch/` (folders at the root, installed as
`jtree.kernels` and `jtree.launch`) or to `jtree/`, fails it (tests/import_layers.py says how).
Likewise a test file imported by another module of tests/ (`TestFilesAreLeaves`): every form of
the import (absolute, relative, of the package's attribute, inside a function) is named by file
and line, and the checkout's own tests/ keeps the rule."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests.import_layers import WORKTREE, TestFilesAreLeaves


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


def bare_lint_imports(root: Path) -> tuple[int, str]:
    """`lint-imports` at `root`: (exit status, report with its line wrapping undone)."""
    run = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
                         check=False, cwd=root, capture_output=True, text=True, timeout=600)
    return run.returncode, " ".join((run.stdout + run.stderr).split())


def test_bare_lint_imports_refuses_a_test_file_imported_by_another(tmp_path: Path) -> None:
    root = checkout_copy(tmp_path)
    (root / "tests" / "test_a.py").write_text("X = 1\n")
    (root / "tests" / "test_b.py").write_text("import os\nfrom tests.test_a import X\n")
    code, report = bare_lint_imports(root)
    assert code != 0, report[-3000:]
    assert "imports a test file (shared pieces live in helper modules) BROKEN" in report
    assert "tests/test_b.py:2 imports the test file tests.test_a: from tests.test_a import X" \
        in report, report[-3000:]


SUITE = {  # a package `suite`: its modules and their text
    "__init__.py": "",
    "helper.py": "def g():\n    return 1\n",
    "leaky_helper.py": "from .a.test_x import f\n",
    "a/__init__.py": "",
    "a/test_x.py": "from suite.helper import g\n\n\ndef f():\n    return g()\n",
    "a/test_absolute.py": "import os\nfrom suite.a.test_x import f\n",
    "a/test_relative.py": "from . import test_x\n",
    "b/__init__.py": "",
    "b/test_in_function.py": "def test_it():\n    import suite.a.test_x\n",
}


def test_every_form_of_importing_a_test_file_is_named(tmp_path: Path, monkeypatch) -> None:
    for name, text in SUITE.items():
        path = tmp_path / "suite" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    contract = TestFilesAreLeaves("leaves", {}, {"tests": "suite"})
    check = contract.check(grimp.build_graph("suite", cache_dir=None), verbose=False)
    assert not check.kept
    assert [(importer, imported, line) for importer, imported, line, _ in
            check.metadata["imports"]] == [
        ("suite.a.test_absolute", "suite.a.test_x", 2),
        ("suite.a.test_relative", "suite.a.test_x", 1),
        ("suite.b.test_in_function", "suite.a.test_x", 2),
        ("suite.leaky_helper", "suite.a.test_x", 1),
    ]


def test_the_checkouts_test_files_are_imported_by_no_module() -> None:
    """The rule on tests/ as it is (what `lint-imports` checks before `make test`)."""
    check = TestFilesAreLeaves("leaves", {}, {"tests": "tests"}).check(
        grimp.build_graph("tests", cache_dir=None), verbose=False)
    assert check.kept, check.metadata["imports"]
