"""Orbax checkpoints of a training run: train state, data-iterator state and run metadata.

Each checkpoint is one Orbax step directory holding three items: `state` (the TrainState:
parameters, optimizer state, step; sharded arrays are written by every host in parallel), `data`
(the grain iterator state, JSON) and `meta` (architecture, model config, seeds, JSON). Orbax
writes into a temporary directory and renames it when complete, so a killed run never leaves a
half-written checkpoint that looks valid; `async_save` lets training continue while arrays are
written; only the last `keep` checkpoints are kept.

A step directory can still be damaged after it was written (a lost file, a disk or copy error),
and Orbax lists it as a step all the same. So a checkpoint is verified before it is used: committed
(Orbax's commit marker in the step directory and in every item), its metadata files present, its
saved arrays of the shapes being trained, and readable. `restore_latest` falls back to the newest
intact checkpoint and sets the damaged newer ones aside (`<step>.corrupt`), so the resumed run can
write those steps again; a checkpoint of another model or run is not damage and stops the run.

Restoring takes the abstract train state with the shardings of the *current* mesh, so a run
saved on one mesh shape resumes on another; given the model's layer groups
(`jtree.parallel.layer_stack`), a run saved with its decoder layers scanned resumes unscanned and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jtree.parallel.layer_stack import LayerGroup, convert_tree, layer_sharding

OnCorrupt = Literal["fallback", "raise"]

# What Orbax writes in a committed step directory (besides the arrays): the commit marker in the
# step directory and in every item, the step metadata, and each item's metadata files.
COMMIT_MARKER = "commit_success.txt"
STEP_METADATA = "_CHECKPOINT_METADATA"
ITEM_FILES = {"state": ("_METADATA", "manifest.ocdbt"), "data": ("metadata",),
              "meta": ("metadata",)}


class CorruptCheckpoint(ValueError):
    """A checkpoint that is uncommitted, incomplete or unreadable (not one of another run)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint: its step, train state, data-iterator state and run metadata."""

    step: int
    state: Any
    data_state: dict[str, Any]
    meta: dict[str, Any]


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

    def where(self, step: int) -> str:
        return f"checkpoint {self.directory}/{step}"

    def verify(self, step: int) -> None:
        """Raise CorruptCheckpoint unless `step` is committed and its metadata files are there
        (Orbax lists a step directory whatever is missing inside it)."""
        root = self.directory / str(step)
        for item in ("", *ITEM_FILES):
            if not (root / item / COMMIT_MARKER).is_file():
                raise CorruptCheckpoint(f"{self.where(step)}: not committed (no "
                                        f"{(Path(item) / COMMIT_MARKER).as_posix()})")
        for name in (STEP_METADATA, *(f"{item}/{f}" for item, files in ITEM_FILES.items()
                                      for f in files)):
            if not (root / name).is_file():
                raise CorruptCheckpoint(f"{self.where(step)}: {name} is missing")

    def restore(self, step: int, abstract_state: Any,
                check_meta: Callable[[dict[str, Any], str], None] | None = None,
                layer_groups: Sequence[LayerGroup] = ()) -> Restored:
        """Checkpoint `step`, laid out like `abstract_state` (a tree of jax.ShapeDtypeStruct with
        shardings). `check_meta(meta, where)` may reject the run metadata (ValueError) before any
        array is read. Raises CorruptCheckpoint for a damaged checkpoint, ValueError for one whose
        arrays do not match `abstract_state` (another model or optimizer).

        With the model's `layer_groups` (`jtree.parallel.layer_stack`), a checkpoint written with the
        decoder layers scanned restores into an unscanned state and back: it is read in its own
        layout (sharded like the target) and converted on the devices, so for that restore the
        state is held twice."""
        self.verify(step)
        where = self.where(step)
        meta = self.read_meta(step)
        if check_meta is not None:
            check_meta(meta, where)
        try:
            saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
        except Exception as e:  # noqa: BLE001 - any failure to read it is damage
            raise CorruptCheckpoint(f"{where}: state metadata unreadable ({_reason(e)})") from None
        scanned = _saved_layout(saved.tree, abstract_state, layer_groups)
        target = abstract_state if scanned is None else convert_tree(
            abstract_state, layer_groups, scanned=scanned, stack=_stacked_struct,
            unstack=_layer_struct)
        _check_shapes(saved.tree, target, where)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                data=ocp.args.JsonRestore(),
            ))
        except Exception as e:  # noqa: BLE001 - shapes match, so a failed read is damage
            raise CorruptCheckpoint(f"{where}: unreadable ({_reason(e)})") from None
        state = out["state"]
        if scanned is not None:  # into the layout being trained, where it is trained
            state = jax.device_put(convert_tree(state, layer_groups, scanned=not scanned),
                                   jax.tree.map(lambda x: x.sharding, abstract_state))
        return Restored(step, state, out["data"], meta)

    def restore_latest(self, abstract_state: Any, *, on_corrupt: OnCorrupt = "fallback",
                       check_meta: Callable[[dict[str, Any], str], None] | None = None,
                       layer_groups: Sequence[LayerGroup] = (),
                       log: Callable[[str], None] = print) -> Restored | None:
        """The newest intact checkpoint (None: there is none to resume; `layer_groups` as in
        `restore`). A damaged one is logged in one line and, with `on_corrupt="fallback"`, the
        next older one is tried (and the damaged ones are set aside once one restores); with
        `"raise"` it stops the run, as does a directory with no intact checkpoint."""
        if on_corrupt not in ("fallback", "raise"):
            raise ValueError(f"on_corrupt: {on_corrupt!r} is not 'fallback' or 'raise'")
        corrupt: list[int] = []
        self._manager.reload()  # the steps on disk now, not those cached at open
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                restored = self.restore(step, abstract_state, check_meta, layer_groups)
            except CorruptCheckpoint as e:
                if on_corrupt == "raise":
                    raise CorruptCheckpoint(f"{e} (checkpoint.on_corrupt=fallback resumes from "
                                            "the newest intact checkpoint)") from None
                log(f"{e}; trying the next older checkpoint")
                corrupt.append(step)
                continue
            self._set_aside(corrupt)
            return restored
        if corrupt:
            raise CorruptCheckpoint(f"checkpoint {self.directory}: no intact checkpoint (damaged "
                                    f"steps {sorted(corrupt)})")
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename damaged step directories to `<step>.corrupt[N]` (kept for inspection, no
        longer a step), so the resumed run can save those steps again."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                target, n = self.directory / f"{step}.corrupt", 1
                while target.exists():
                    n += 1
                    target = self.directory / f"{step}.corrupt{n}"
                (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jtree.training.checkpoint.set_aside")
        self._manager.reload()

    def read_meta(self, step: int) -> dict[str, Any]:
        try:
            return self._manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - a missing or garbled file is damage
            raise CorruptCheckpoint(f"{self.where(step)}: meta unreadable ({_reason(e)})") from None

    def wait(self) -> None:
        """Block until every started save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _reason(e: BaseException) -> str:
    """The first line of the error's root cause (Orbax wraps TensorStore's one-line status, such
    as a truncated chunk, in a message that runs to a hundred lines)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """`a/b/0` -> shape of every leaf, whatever container types spell the path (Orbax's saved
    metadata has dicts where the train state has dataclasses and tuples)."""
    return {"/".join(_key_name(k) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_shapes(saved: Any, abstract_state: Any, where: str) -> None:
    """A checkpoint of another model or optimizer is a config error, not damage."""
    have, want = _shapes(saved), _shapes(abstract_state)
    if have == want:
        return
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        detail = (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}")
    else:
        key = next(k for k in want if have[k] != want[k])
        detail = f"{key} has shape {have[key]}, the model wants {want[key]}"
    raise ValueError(f"{where}: does not match the model or optimizer being trained ({detail})")


def _saved_layout(saved: Any, abstract_state: Any,
                  layer_groups: Sequence[LayerGroup]) -> bool | None:
    """None when the checkpoint is in the layout of `abstract_state` (or in none the layer
    groups explain); else whether it was written scanned."""
    have = _shapes(saved)
    if not layer_groups or have == _shapes(abstract_state):
        return None
    for scanned in (True, False):
        other = convert_tree(abstract_state, layer_groups, scanned=scanned,
                             stack=_stacked_struct, unstack=_layer_struct)
        if _shapes(other) == have:
            return scanned
    return None


def _stacked_struct(layers: list[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
    one = layers[0]
    return jax.ShapeDtypeStruct((len(layers), *one.shape), one.dtype,
                                sharding=layer_sharding(one.sharding, scanned=True))


def _layer_struct(stacked: jax.ShapeDtypeStruct, _: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype,
                                sharding=layer_sharding(stacked.sharding, scanned=False))


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree` (arrays or structs) with the given shardings."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
