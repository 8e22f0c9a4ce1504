"""Damaged Orbax checkpoints: each way a disk, a copy or a killed writer can damage a step directory
of `jtree.training.checkpoint.Checkpointer`, for the tests of detecting it and falling back to the newest
intact checkpoint (directly and in a resumed run). Each damage returns the part of the one-line
log that names it, spelled out here rather than taken from jtree.training.checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DAMAGES = ("chunk", "truncate", "bitflip", "state_metadata", "garble_state_metadata",
           "meta_metadata", "garble_meta_metadata", "garble_step_metadata", "commit", "manifest",
           "extra_file")


def _largest_chunk(step_dir: Path) -> Path:
    """The OCDBT data file that holds the arrays (the others hold the B-tree)."""
    chunks = [p for p in (step_dir / "state").rglob("d/*") if p.is_file()]
    assert chunks, sorted(p.relative_to(step_dir) for p in step_dir.rglob("*"))
    return max(chunks, key=lambda p: p.stat().st_size)


def _overwrite_middle(path: Path, n: int = 64, seed: int = 0) -> None:
    """Change `n` bytes in the middle of `path` in place (XOR with non-zero random bytes, so every
    one of them differs), keeping its size: what a bad sector or a flipped bit leaves."""
    data = bytearray(path.read_bytes())
    n = min(n, len(data))
    start = (len(data) - n) // 2
    noise = np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8)
    old = np.frombuffer(bytes(data[start:start + n]), np.uint8)
    data[start:start + n] = (old ^ noise).tobytes()
    path.write_bytes(bytes(data))


def damage(step_dir: Path, how: str) -> str:
    """Damage one step directory in the way `how` names (one of DAMAGES); returns what the log
    line must say."""
    chunk = _largest_chunk(step_dir)
    name = chunk.relative_to(step_dir).as_posix()
    if how == "chunk":
        chunk.unlink()
        return f"{name} is missing"
    if how == "truncate":
        size = chunk.stat().st_size
        with open(chunk, "r+b") as f:
            f.truncate(size // 2)
        return f"{name} has {size // 2} bytes, {size} were written"
    if how == "bitflip":
        _overwrite_middle(chunk)
        return f"{name} does not match its sha256"
    if how in ("state_metadata", "meta_metadata"):
        name = "state/_METADATA" if how == "state_metadata" else "meta/metadata"
        (step_dir / name).unlink()
        return f"{name} is missing"
    if how in ("garble_state_metadata", "garble_meta_metadata"):
        name = "state/_METADATA" if how == "garble_state_metadata" else "meta/metadata"
        _overwrite_middle(step_dir / name, n=4)
        return f"{name} does not match its sha256"
    if how == "garble_step_metadata":
        _overwrite_middle(step_dir / "_CHECKPOINT_METADATA", n=4)
        return "_CHECKPOINT_METADATA unreadable"
    if how == "manifest":
        (step_dir / "jtree_checksums.json").unlink()
        return "no jtree_checksums.json (written by a jtree without checksums"
    if how == "extra_file":
        (step_dir / "state" / "d" / "stray").write_bytes(b"x")
        return "state/d/stray is not in jtree_checksums.json"
    assert how == "commit", how
    for marker in step_dir.rglob("commit_success.txt"):
        marker.unlink()
    return "not committed"
