"""Scanned decoder layers (`RuntimeConfig.scan_layers`): which layers are stacked together, and
the one conversion between stacked and per-layer parameter names.

A scan runs one copy of its body for every step, so program size and compile time do not grow
with depth. The layers are cut into groups (`layer_groups`): a group is a *block* of consecutive
layer kinds repeated `repeats` times (Qwen3: one attention + MLP layer repeated
`num_hidden_layers` times; Qwen3-Next: 3 x Gated DeltaNet + 1 x gated attention repeated). Layers
that do not repeat (a tail that does not fill a block, a lone dense layer among MoE layers) form
groups of one repeat and run unscanned.

A scanned model holds group g's block position j at `model/blocks/{g}/{j}/...`, every parameter
with a leading layer axis of length `repeats`: entry r is layer `start + r * len(block) + j`,
whose per-layer (Hugging Face) name is `model/layers/{layer}/...`. `layer_paths` is that
mapping; `stack_flat` / `unstack_flat` apply it to flat parameter lists, for the Hugging Face
loader and saver (`jtree.hf.load_save`) and for Orbax checkpoints (`jtree.training.checkpoint`), so a
checkpoint written scanned reads unscanned and back. `stacked_axes` says how many leading layer
axes a parameter has (sharding rules place the parameter's own axes after them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

Path = tuple[Hashable, ...]
LAYERS, BLOCKS = "layers", "blocks"
# A stacked parameter's name, '/'- or '.'-joined, anywhere in a larger tree (optimizer state).
_STACKED = re.compile(rf"(^|[./])model[./]{BLOCKS}[./]\d+[./]\d+[./]")


class LayerGroup(NamedTuple):
    """Layers `start ...` made of `block` (a tuple of layer kinds) repeated `repeats` times."""

    start: int
    block: tuple[Hashable, ...]
    repeats: int

    def layer(self, repeat: int, position: int) -> int:
        """The decoder-layer index of block position `position` in repeat `repeat`."""
        return self.start + repeat * len(self.block) + position

    @property
    def scanned(self) -> bool:
        return self.repeats > 1


def layer_groups(kinds: Sequence[Hashable]) -> tuple[LayerGroup, ...]:
    """Cut a sequence of layer kinds into repeated blocks, greedily from the first layer: at
    each layer the block (of any length) whose repeats cover the most layers, the shortest on a
    tie; a layer no block of two or more repeats starts at is a group of its own."""
    groups, i, n = [], 0, len(kinds)
    while i < n:
        best = (1, 1)  # (block length, repeats)
        for length in range(1, (n - i) // 2 + 1):
            block = tuple(kinds[i:i + length])
            repeats = 1
            while tuple(kinds[i + repeats * length:i + (repeats + 1) * length]) == block:
                repeats += 1
            if repeats > 1 and length * repeats > best[0] * best[1]:
                best = (length, repeats)
        length, repeats = best
        groups.append(LayerGroup(i, tuple(kinds[i:i + length]), repeats))
        i += length * repeats
    return tuple(groups)


def stacked_axes(name: str) -> int:
    """How many leading stacked-layer axes the parameter at `name` ('/'- or '.'-joined path,
    possibly inside a larger tree such as optimizer state) has: 1 under `model/blocks/`, else 0.
    Sharding places a parameter's own axes after these (`jtree.parallel.sharding.partition_spec`)."""
    return 1 if _STACKED.search(name) else 0


def _find(path: Path, key: str, indices: int) -> int | None:
    """Where ('model', key, int * indices) starts in `path`, or None."""
    for at in range(len(path) - indices - 1):
        if (path[at] == "model" and path[at + 1] == key
                and all(isinstance(path[at + 2 + k], int) for k in range(indices))):
            return at
    return None


def layer_paths(path: Path, groups: Sequence[LayerGroup]) -> list[Path] | None:
    """The per-layer paths (`... model, layers, N, ...`), in repeat order, of the stacked
    parameter at `path` (`... model, blocks, g, j, ...`); None when `path` is not stacked."""
    at = _find(path, BLOCKS, 2)
    if at is None:
        return None
    g, j = path[at + 2], path[at + 3]
    head, tail = path[:at], path[at + 4:]
    return [(*head, "model", LAYERS, groups[g].layer(r, j), *tail)
            for r in range(groups[g].repeats)]


def _stacked_path(path: Path, groups: Sequence[LayerGroup]) -> tuple[Path, int] | None:
    """The stacked path of the per-layer parameter at `path` and its index along the layer axis
    (the inverse of `layer_paths`); None when `path` is not a layer's."""
    at = _find(path, LAYERS, 1)
    if at is None:
        return None
    layer = path[at + 2]
    for g, group in enumerate(groups):
        offset = layer - group.start
        if 0 <= offset < len(group.block) * group.repeats:
            r, j = divmod(offset, len(group.block))
            return (*path[:at], "model", BLOCKS, g, j, *path[at + 3:]), r
    raise ValueError(f"{'/'.join(map(str, path))}: layer {layer} is beyond the "
                     f"{groups[-1].layer(groups[-1].repeats, 0)} layers of the model")


def stack_flat(flat: Sequence[tuple[Path, Any]], groups: Sequence[LayerGroup],
               stack: Callable[[list[Any]], Any]) -> list[tuple[Path, Any]]:
    """Per-layer (path, value) pairs as the scanned model holds them: the values of one stacked
    parameter are `stack`ed in repeat order; the rest pass unchanged. Raises naming the first
    stacked parameter some layer is missing."""
    out: dict[Path, Any] = {}
    parts: dict[Path, dict[int, Any]] = {}
    for path, value in flat:
        target = _stacked_path(path, groups)
        if target is None:
            out[path] = value
        else:
            out.setdefault(target[0], None)
            parts.setdefault(target[0], {})[target[1]] = value
    for path, values in parts.items():
        want = len(layer_paths(path, groups))
        missing = [r for r in range(want) if r not in values]
        if missing:
            raise ValueError(f"{'/'.join(map(str, layer_paths(path, groups)[missing[0]]))}: "
                             "missing (needed to stack the scanned layers)")
        out[path] = stack([values[r] for r in range(want)])
    return list(out.items())


def unstack_flat(flat: Sequence[tuple[Path, Any]], groups: Sequence[LayerGroup],
                 unstack: Callable[[Any, int], Any]) -> list[tuple[Path, Any]]:
    """Scanned (path, value) pairs as per-layer pairs (`unstack(value, r)` is entry r of a
    stacked value): the unstacked ones first, then every layer's, in layer order. The inverse
    of `stack_flat`."""
    rest, layers = [], []
    for path, value in flat:
        paths = layer_paths(path, groups)
        if paths is None:
            rest.append((path, value))
        else:
            layers += [(layer_path, value, r) for r, layer_path in enumerate(paths)]
    layers.sort(key=lambda item: item[0][_find(item[0], LAYERS, 1) + 2])
    return rest + [(path, unstack(value, r)) for path, value, r in layers]


def convert_state(state: nnx.State, groups: Sequence[LayerGroup], *, scanned: bool,
                  stack: Callable[[list[Any]], Any] = jnp.stack,
                  unstack: Callable[[Any, int], Any] = lambda x, r: x[r]) -> nnx.State:
    """`state` (parameters, or anything shaped like them: gradients, optimizer moments) in the
    scanned layout (`scanned`) or the per-layer one, whichever it is in now. `stack` and
    `unstack` act on the values inside the variables (arrays by default; `jtree.training.checkpoint`
    passes ones for abstract arrays)."""
    flat = list(nnx.to_flat_state(state))
    if scanned:
        out = stack_flat(flat, groups, lambda vs: vs[0].replace(stack([v.get_value() for v in vs])))
    else:
        out = unstack_flat(flat, groups, lambda v, r: v.replace(unstack(v.get_value(), r)))
    return nnx.from_flat_state(out)


def layer_sharding(sharding: jax.sharding.Sharding, *, scanned: bool) -> jax.sharding.Sharding:
    """The sharding of a stacked value (`scanned`) from one layer's, or of one layer from the
    stacked value's: the layer axis is never split. Single-device shardings hold either."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = (None, *sharding.spec) if scanned else tuple(sharding.spec)[1:]
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise ValueError(f"{sharding}: only named and single-device shardings convert between "
                     "stacked and per-layer parameters")


def convert_tree(tree: Any, groups: Sequence[LayerGroup], *, scanned: bool,
                 stack: Callable[[list[Any]], Any] = jnp.stack,
                 unstack: Callable[[Any, int], Any] = lambda x, r: x[r]) -> Any:
    """`convert_state` on every `nnx.State` inside `tree` (a train state: the parameters and the
    optimizer's moments); other leaves (step counts) are kept."""
    return jax.tree.map(
        lambda x: convert_state(x, groups, scanned=scanned, stack=stack, unstack=unstack)
        if isinstance(x, nnx.State) else x,
        tree, is_leaf=lambda x: isinstance(x, nnx.State))
