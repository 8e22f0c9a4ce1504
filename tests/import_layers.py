"""The package layers of docs/architecture.md, checked by a bare `lint-imports` on the layout as
it installs.

`kernels/` and `launch/` sit at the repository root and install as `jtree.kernels` and
`jtree.launch` (a setuptools package-dir mapping). import-linter's graph builder (grimp) reads a
root package's modules from its one folder and does not follow such a mapping, so on the checkout
it would find neither package. pyproject.toml therefore declares one contract of the type
`InstalledLayout`: it `stage`s the Python sources into the shape they have once installed
(`jtree/kernels/`, `jtree/launch/`) and `lint`s that copy with the real contracts, kept in
tests/import_layers.toml. The test suite's modules are staged too (`tests/`), for the contract
of the type `TestFilesAreLeaves`: no module imports a test file (`tests/**/test_*.py`); what
several test files share lives in the helper modules named for their concept
(tests/conftest.py lists them).

    lint-imports      # from the repository root; what `make test` runs first
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck

WORKTREE = Path(__file__).resolve().parent.parent
CONTRACTS = WORKTREE / "tests" / "import_layers.toml"
MAPPED = {"kernels": "jtree/kernels", "launch": "jtree/launch"}  # pyproject.toml's package-dir


def _python_only(folder: str, names: list[str]) -> list[str]:
    """copytree's `ignore`: everything but subfolders and Python files (and no __pycache__)."""
    return [n for n in names if n == "__pycache__" or
            not (n.endswith(".py") or Path(folder, n).is_dir())]


def stage(root: Path, into: Path) -> Path:
    """Copy `root`'s packages into `into` as they install, and its test suite's modules
    (`tests/`); returns `into`."""
    shutil.copytree(root / "jtree", into / "jtree", ignore=_python_only)
    for folder, package_path in MAPPED.items():
        shutil.copytree(root / folder, into / package_path, ignore=_python_only)
    shutil.copytree(root / "tests", into / "tests", ignore=_python_only)
    return into


def lint(staged: Path, config: Path = CONTRACTS) -> subprocess.CompletedProcess:
    """lint-imports with `config`'s contracts over the staged copy (its exit status: 0 = kept)."""
    exe = Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=str(staged))
    return subprocess.run([str(exe), str(config), "--no-cache", "--no-logo"], check=False,
                          cwd=staged, env=env,
                          capture_output=True, text=True, timeout=600)


class InstalledLayout(Contract):
    """An import-linter contract type: the contracts of the file `contracts` (relative to the
    repository root), kept by the sources staged as they install. The graph lint-imports built
    from the checkout is not used: it lacks `jtree.kernels` and `jtree.launch`."""

    contracts = fields.StringField()

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        with tempfile.TemporaryDirectory(prefix="jtree-layers-") as tmp:
            run = lint(stage(WORKTREE, Path(tmp)), WORKTREE / self.contracts)
        output.verbose_print(verbose, run.stdout)
        return ContractCheck(kept=run.returncode == 0,
                             metadata={"report": run.stdout + run.stderr})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print(check.metadata["report"])


def is_test_module(module: str) -> bool:
    """A test file's module (pytest collects `test_*.py`)."""
    return module.rpartition(".")[2].startswith("test_")


class TestFilesAreLeaves(Contract):
    """An import-linter contract type: no module of the package `tests` imports a test module
    (one whose file pytest collects, `test_*.py`): a test file holds its own tests, and what
    several share is a helper module's. Broken: every such import, by file, line and text."""

    __test__ = False  # a contract type, not a test class for pytest to collect
    tests = fields.StringField()

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        found = []
        for importer in sorted(graph.find_descendants(self.tests) | {self.tests}):
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if is_test_module(imported):
                    for detail in graph.get_import_details(importer=importer, imported=imported):
                        found.append((importer, imported, detail["line_number"],
                                      detail["line_contents"]))
        return ContractCheck(kept=not found, metadata={"imports": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported, line, text in check.metadata["imports"]:
            output.print(f"{importer.replace('.', '/')}.py:{line} imports the test file "
                         f"{imported}: {text}")
        output.print("Move what is shared into a helper module named for its concept "
                     "(tests/conftest.py lists them) and import it from there.")
