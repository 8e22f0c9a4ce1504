"""The wheel is the package: built from a copy of the checkout, installed into an empty folder, it
imports as `jtree.kernels` and `jtree.launch` beside distributions that own the bare names
`kernels` and `launch`, carries every file the package needs at run time, and builds the C++ `cpu`
kernel from its installed sources.

`kernels/` and `launch/` sit at the repository root and install through pyproject.toml's
package-dir mapping; its package list is written out, so a test here checks it against the folders.
The install test builds the wheel, installs it with a stand-in for the PyPI `kernels` package
(the Hugging Face kernel hub, which many transformers users have), and in a process started
outside the checkout compiles the C++ kernels into a fresh cache folder and runs one tree-attention
call (forward and gradients) against the dense reference. A header left out of the wheel fails
that compile.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from tests.run_util import WORKTREE

SOURCES = ("pyproject.toml", "README.md", "jtree", "kernels", "launch")
RUNTIME_FILES = ("*.cc", "*.h", "*.sh", "*.sbatch")  # non-Python files the package reads or runs


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index"], check=True, timeout=600)


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


def _installed_name(path: Path) -> str:
    """`kernels/cpu/gemm.h` -> `jtree/kernels/cpu/gemm.h`: where a source file lands installed."""
    top = path.relative_to(WORKTREE).parts[0]
    return str(path.relative_to(WORKTREE)) if top == "jtree" else f"jtree/{path.relative_to(WORKTREE)}"


def test_package_list_names_every_folder() -> None:
    config = tomllib.loads((WORKTREE / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {folder: package for package, folder in config["package-dir"].items()}
    found = set()
    for init in WORKTREE.glob("*/**/__init__.py"):
        parts = init.parent.relative_to(WORKTREE).parts
        if parts[0] == "jtree":
            found.add(".".join(parts))
        elif parts[0] in mapped:
            found.add(".".join((mapped[parts[0]], *parts[1:])))
    assert set(config["packages"]) == found


def test_wheel_installs_and_builds_the_cpu_kernel(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = WORKTREE / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    _pip("wheel", "--wheel-dir", str(tmp_path / "dist"), str(src))
    wheel, = (tmp_path / "dist").glob("jtree-*.whl")
    target = tmp_path / "site"
    _pip("install", "--target", str(target), str(_stand_in_kernels(tmp_path / "hub")), str(wheel))
    assert (target / "kernels" / "__init__.py").exists()
    assert not (target / "launch").exists()
    for pattern in RUNTIME_FILES:
        for folder in ("kernels", "launch"):
            for path in (WORKTREE / folder).rglob(pattern):
                assert (target / _installed_name(path)).is_file(), _installed_name(path)

    probe = textwrap.dedent(f"""\
        import os, sys
        sys.path.insert(0, {str(target)!r})
        os.environ["JTREE_KERNEL_CACHE"] = {str(tmp_path / "kernel_cache")!r}
        import jax, jax.numpy as jnp, numpy as np
        import kernels
        import jtree.kernels, jtree.launch, jtree.launch.bench
        from jtree.kernels import TreeMask, available_impls, tree_attention
        from jtree.kernels.cpu import library
        assert kernels.get_kernel("x") == "hub:x", kernels.__file__
        for module in (kernels, jtree.kernels, jtree.launch, jtree.launch.bench, library):
            assert module.__file__.startswith({str(target)!r}), module.__file__
        assert library.build_error() is None, library.build_error()
        assert "cpu" in available_impls()
        # row 0: a tree whose root [0] has a child [1..5] and a second branch [6..9], then two
        # padding tokens; row 1: a chain with a path ending at token 9 and another at 11
        end = np.array([[10, 6, 6, 6, 6, 6, 10, 10, 10, 10, 11, 12],
                        [12, 12, 12, 12, 12, 12, 12, 12, 10, 10, 12, 12]], np.int32)
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.normal(size=(2, 12, 2, 16)), jnp.float32) for _ in range(3))

        def loss(impl):
            def f(q, k, v):
                out = tree_attention(q, k, v, TreeMask(end), impl=impl)
                return jnp.sum(out * jnp.cos(out)), out
            return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

        (_, got), got_grads = loss("cpu")
        (_, want), want_grads = loss("reference")
        for a, b in zip((got, *got_grads), (want, *want_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        assert any(name.endswith(".so") for name in os.listdir(os.environ["JTREE_KERNEL_CACHE"]))
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")
