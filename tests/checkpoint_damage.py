"""Damaged Orbax checkpoints: each way a step directory of `jtree.training.checkpoint.Checkpointer` can be
damaged, for the tests of falling back to the newest intact checkpoint (directly and in a resumed
run)."""

from __future__ import annotations

from pathlib import Path


def _largest_chunk(step_dir: Path) -> Path:
    """The OCDBT data file that holds the arrays (the others hold the B-tree)."""
    chunks = [p for p in (step_dir / "state").rglob("d/*") if p.is_file()]
    assert chunks, sorted(p.relative_to(step_dir) for p in step_dir.rglob("*"))
    return max(chunks, key=lambda p: p.stat().st_size)


def damage(step_dir: Path, how: str) -> str:
    """Damage one step directory in the way `how` names (`chunk`, `state_metadata`,
    `meta_metadata`, `commit`); returns what the log line must say."""
    if how == "chunk":
        _largest_chunk(step_dir).unlink()
        return "unreadable (ValueError: FAILED_PRECONDITION"
    if how == "state_metadata":
        (step_dir / "state" / "_METADATA").unlink()
        return "state/_METADATA is missing"
    if how == "meta_metadata":
        (step_dir / "meta" / "metadata").unlink()
        return "meta/metadata is missing"
    assert how == "commit"
    for marker in step_dir.rglob("commit_success.txt"):
        marker.unlink()
    return "not committed"
