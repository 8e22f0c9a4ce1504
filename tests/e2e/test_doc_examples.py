"""Every JSON and YAML example in README.md and docs/ goes through the reader a user would give it,
so no example can rot: a ```json block is JSONL (one record per line, as a user copies it into a
file) read by `jtree.training.tree_files.load_trees` in the format its keys name; a ```yaml block
is a config fragment read by `jtree.config.load_config` (unknown keys, wrong types and values
outside a setting's domain are refused there); a ```python block runs from the repository root
in a fresh interpreter, and a ```python fragment (code that needs what the page around it
defines, a model directory or a server) is compiled."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from jtree.config import load_config
from jtree.training.tree_files import load_trees
from tests.run_util import WORKTREE

DOCS = [WORKTREE / "README.md", *sorted((WORKTREE / "docs").glob("*.md"))]
# The keys that say a record's format (README, "Data formats").
FORMATS = (("turns", "traces"), ("messages", "chat"), ("parents", "trees"), ("tokens", "groups"))


def examples(language: str) -> list[tuple[str, str]]:
    """(`file:line`, text) of every fenced block whose info string is `language`."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in re.finditer(rf"^```{language}\n(.*?)^```", text, re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{doc.relative_to(WORKTREE)}:{line}", match.group(1)))
    return found


def record_format(where: str, line: str) -> str:
    for key, fmt in FORMATS:
        if f'"{key}"' in line:
            return fmt
    raise AssertionError(f"{where}: no format's key in {line[:80]}")


@pytest.mark.parametrize("where, text", examples("json"), ids=lambda x: str(x).split("\n")[0])
def test_json_examples_read(where: str, text: str, tmp_path: Path) -> None:
    lines = text.strip().splitlines()
    formats = {record_format(where, line) for line in lines}
    assert len(formats) == 1, f"{where}: records of several formats {formats}"
    path = tmp_path / "example.jsonl"
    path.write_text(text)
    trees, report = load_trees(path, formats.pop(), vocab_size=None)
    assert report.n_bad == 0 and len(trees) >= 1, where


@pytest.mark.parametrize("where, text", examples("yaml"), ids=lambda x: str(x).split("\n")[0])
def test_yaml_examples_load(where: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / "example.yaml"
    path.write_text(text)
    load_config(path)


@pytest.mark.parametrize("where, text", examples("python"), ids=lambda x: str(x).split("\n")[0])
def test_python_examples_run(where: str, text: str) -> None:
    run = subprocess.run([sys.executable, "-c", text], cwd=WORKTREE, capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == 0, f"{where}: {run.stderr[-3000:]}"


@pytest.mark.parametrize("where, text", examples("python fragment"),
                         ids=lambda x: str(x).split("\n")[0])
def test_python_fragments_compile(where: str, text: str) -> None:
    compile(text, where, "exec")


def test_the_docs_have_examples() -> None:
    assert len(examples("json")) >= 5 and len(examples("yaml")) >= 4
    assert len(examples("python")) >= 2 and len(examples("python fragment")) >= 5
