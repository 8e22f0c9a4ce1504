"""Orbax checkpoints of a training run: train state, data-iterator state and run metadata.

Each checkpoint is one Orbax step directory holding three items: `state` (the TrainState:
parameters, optimizer state, step; sharded arrays are written by every host in parallel), `data`
(the grain iterator state, JSON) and `meta` (architecture, model config, seeds, JSON). Orbax
writes into a temporary directory and renames it when complete, so a killed run never leaves a
half-written checkpoint that looks valid; `async_save` lets training continue while arrays are
written; only the last `keep` checkpoints are kept.

Restoring takes the abstract train state with the shardings of the *current* mesh, so a run
saved on one mesh shape resumes on another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Save and restore (state, iterator state, metadata) under one directory."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start writing checkpoint `step` (returns before the write finishes when async)."""
        self._manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        ))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(state, data_state, meta) of checkpoint `step`, laid out like `abstract_state` (a tree of
        jax.ShapeDtypeStruct with shardings). A checkpoint of another model fails with a
        ValueError naming the directory."""
        meta = self.read_meta(step)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
            ))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"checkpoint {self.directory}/{step}: does not match the model or "
                             f"optimizer being trained ({type(e).__name__}: {e})") from None
        return out["state"], out["data"], meta

    def read_meta(self, step: int) -> dict[str, Any]:
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"]

    def wait(self) -> None:
        """Block until every started save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree` (arrays or structs) with the given shardings."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
