"""jtree installs next to distributions that own the bare names `kernels` and `launch`.

The kernels and entry points are sub-packages (`jtree/kernels/`, `jtree/launch/`), never bare
top-level names, and the wheel carries the `cpu` kernel's C++ source. The test builds the wheel from a copy
of the sources, installs it into an empty target folder together with a stand-in for the PyPI
`kernels` package (the Hugging Face kernel hub, which many transformers users have), and imports
both from a directory outside the checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.run_util import WORKTREE

SOURCES = ("pyproject.toml", "README.md", "jtree")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", *args], check=True)


def _stand_in_kernels(root: Path) -> Path:
    """A distribution named `kernels` with a top-level package `kernels` (as the kernel hub)."""
    pkg = root / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def get_kernel(name):\n    return 'hub:' + name\n")
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "kernels"
        version = "0.0.1"
        [tool.setuptools]
        packages = ["kernels"]
    """))
    return root


def test_installs_beside_a_package_named_kernels(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = WORKTREE / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    target = tmp_path / "site"
    _pip("--target", str(target), str(_stand_in_kernels(tmp_path / "hub")), str(src))
    assert (target / "kernels" / "__init__.py").exists()
    assert (target / "jtree" / "kernels" / "cpu" / "tree_attention.cc").exists()

    probe = textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(target)!r})
        import kernels
        import jtree.kernels, jtree.launch
        from jtree.kernels import tree_attention, available_impls
        assert kernels.get_kernel("x") == "hub:x", kernels.__file__
        for module in (kernels, jtree.kernels, jtree.launch):
            assert module.__file__.startswith({str(target)!r}), module.__file__
        assert "xla" in available_impls()
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
