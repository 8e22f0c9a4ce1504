"""Orbax checkpoints of a training run: train state, data-iterator state and run metadata.

Each checkpoint is one Orbax step directory holding three items: `state` (the TrainState:
parameters, optimizer state, step; sharded arrays are written by every host in parallel), `data`
(the grain iterator state, JSON) and `meta` (architecture, model config, seeds, JSON). Orbax
writes into a temporary directory and renames it when complete, so a killed run never leaves a
half-written checkpoint that looks valid; `async_save` lets training continue while arrays are
written; only the last `keep` checkpoints are kept.

A step directory can still be damaged after it was written (a lost or truncated file, bytes
changed by a disk or a copy), and Orbax lists it and reads it all the same: Orbax's chunk format
checksums only its chunk indices, not the array bytes, and not the metadata files, so changed
array bytes load silently. So every checkpoint carries a manifest, `jtree_checksums.json`: the
size and SHA-256 of every file in the step directory. It is written by the primary host (process
0) from Orbax's post-finalization callback, which runs once every host's writes of the step are
complete (Orbax's barrier) and before Orbax renames the temporary directory; so a step that counts
as committed always has its manifest, and with `async_save` the hashing runs on Orbax's background
thread, not in the training loop. Two files Orbax writes at the commit itself are not hashed: the
step's commit marker (checked to exist) and `_CHECKPOINT_METADATA` (Orbax's step record, rewritten
with the commit time; checked to be a JSON object that names the three items).

Before a checkpoint is used it is verified: committed (Orbax's commit marker in the step directory
and in every item), `_CHECKPOINT_METADATA` readable, every file of the manifest there with its
size and hash, no file the manifest does not list; then its saved arrays of the shapes being
trained and readable. Every process verifies on its own (the step directory is on a filesystem
all hosts share, so they reach the same verdict), reading the checkpoint once more. A checkpoint
without a manifest (written by a jtree without checksums) cannot be told from one whose manifest
was lost, so it is damage too; `write_manifest(step_dir)` adopts one that is trusted.
`restore_latest` falls back to the newest intact checkpoint and sets the damaged newer ones aside
(`<step>.corrupt`), so the resumed run can write those steps again; a checkpoint of another model
or run is not damage and stops the run.

Restoring takes the abstract train state with the shardings of the *current* mesh, so a run
saved on one mesh shape resumes on another; given the model's layer groups
(`jtree.parallel.layer_stack`), a run saved with its decoder layers scanned resumes unscanned and back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jtree.parallel.layer_stack import LayerGroup, convert_tree, layer_sharding

OnCorrupt = Literal["fallback", "raise"]

# Orbax's commit marker (in the step directory and in every item) and its step record; the
# items of a jtree checkpoint; jtree's manifest of file sizes and hashes.
COMMIT_MARKER = "commit_success.txt"
STEP_METADATA = "_CHECKPOINT_METADATA"
ITEMS = ("state", "data", "meta")
MANIFEST = "jtree_checksums.json"
# SHA-256: OpenSSL computes it with the CPU's SHA instructions (x86 SHA-NI, ARMv8), as fast as a
# non-cryptographic hash in hashlib, and no corruption pattern can slip past it as one can past a
# CRC; hashlib.file_digest releases the GIL, so hashing on Orbax's thread does not stall training.
HASH = "sha256"
# Written by Orbax's commit after the manifest, so not in it (checked otherwise, see `verify`).
UNHASHED = frozenset({MANIFEST, COMMIT_MARKER, STEP_METADATA})


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
        self._async = async_save
        self._sealing: int | None = None  # the step whose write is in flight
        # Always Orbax's async checkpointer: only it runs a callback between the last write and
        # the commit, where the manifest goes; a synchronous save waits for it (`save`).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal))
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start writing checkpoint `step` (returns before the write finishes when async)."""
        self._manager.wait_until_finished()  # Orbax would wait too; `_seal` reads `_sealing`
        self._sealing = step
        self._manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        ))
        if not self._async:
            self._manager.wait_until_finished()

    def _seal(self) -> None:
        """Write the manifest of the step being saved into its temporary directory. Orbax calls
        this on the primary host only, after every host's writes and before the commit; an error
        here leaves the step uncommitted and is raised by the next `save` or `wait`."""
        pending = sorted(self.directory.glob(f"{self._sealing}{ocp.utils.TMP_DIR_SUFFIX}*"))
        if len(pending) != 1:
            raise RuntimeError(f"{self.where(self._sealing)}: expected one temporary directory "
                               f"to seal, found {[p.name for p in pending]}")
        write_manifest(pending[0])

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """The steps the directory holds checkpoints of, oldest first."""
        return sorted(self._manager.all_steps())

    def where(self, step: int) -> str:
        return f"checkpoint {self.directory}/{step}"

    def verify(self, step: int) -> None:
        """Raise CorruptCheckpoint naming the first damaged file unless `step` is committed and
        every file matches its manifest (Orbax lists a step directory, and reads changed array
        bytes, whatever happened to it)."""
        root = self.directory / str(step)
        for item in ("", *ITEMS):
            if not (root / item / COMMIT_MARKER).is_file():
                raise CorruptCheckpoint(f"{self.where(step)}: not committed (no "
                                        f"{(Path(item) / COMMIT_MARKER).as_posix()})")
        damage = _step_metadata_damage(root) or _manifest_damage(root)
        if damage is not None:
            raise CorruptCheckpoint(f"{self.where(step)}: {damage}")

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


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, HASH).hexdigest()


def _hashed_files(step_dir: Path) -> set[str]:
    """The files of a step directory that its manifest lists (paths relative to it)."""
    return {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
            if p.is_file() and p.relative_to(step_dir).as_posix() not in UNHASHED}


def write_manifest(step_dir: str | Path) -> None:
    """Write `step_dir`/jtree_checksums.json: the size and hash of every file but those Orbax's
    commit writes. Called at save before the commit; called by hand, it adopts a checkpoint
    written without one (by an older jtree) that is trusted, so that it can be resumed."""
    step_dir = Path(step_dir)
    files = {name: {"bytes": (step_dir / name).stat().st_size, HASH: _digest(step_dir / name)}
             for name in sorted(_hashed_files(step_dir))}
    (step_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def _read_manifest(step_dir: Path) -> dict[str, tuple[int, str]] | str:
    """name -> (bytes, hash) of the manifest, or why it cannot be read."""
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
        return {str(name): (int(e["bytes"]), str(e[HASH])) for name, e in files.items()}
    except FileNotFoundError:
        return (f"no {MANIFEST} (written by a jtree without checksums, or lost; "
                "jtree.training.checkpoint.write_manifest adopts a checkpoint you trust)")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({_reason(e)})"


def _manifest_damage(step_dir: Path) -> str | None:
    """The first file of `step_dir` that is missing, of another size or hash than its manifest
    says, or not listed in it; None when all match."""
    saved = _read_manifest(step_dir)
    if isinstance(saved, str):
        return saved
    on_disk = _hashed_files(step_dir)
    for name, (size, digest) in sorted(saved.items()):
        if name not in on_disk:
            return f"{name} is missing"
        have = (step_dir / name).stat().st_size
        if have != size:
            return f"{name} has {have} bytes, {size} were written"
        if _digest(step_dir / name) != digest:
            return f"{name} does not match its {HASH} in {MANIFEST}"
    extra = sorted(on_disk - set(saved))
    return f"{extra[0]} is not in {MANIFEST}" if extra else None


def _step_metadata_damage(step_dir: Path) -> str | None:
    """Orbax's step record is rewritten at the commit, after the manifest: it must be a JSON
    object naming the three items' handlers (what Orbax reads of it to restore)."""
    try:
        handlers = json.loads((step_dir / STEP_METADATA).read_text())["item_handlers"]
    except FileNotFoundError:
        return f"{STEP_METADATA} is missing"
    except (ValueError, KeyError, TypeError) as e:
        return f"{STEP_METADATA} unreadable ({_reason(e)})"
    if not isinstance(handlers, dict) or sorted(handlers) != sorted(ITEMS):
        return f"{STEP_METADATA} unreadable (item handlers {handlers!r:.100})"
    return None


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
