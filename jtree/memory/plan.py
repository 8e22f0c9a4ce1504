"""Per-device memory of a config's train step, at full depth, from a compile at reduced depth.

A full-depth compile of a pod-sized model on a CPU host is what this avoids (minutes to hours per
config, and it grows with depth), so the plan takes each number from where it is exact or cheap:

- **Parameters, gradients, optimizer state, batch inputs**: exact bytes of one device's shard of
  every array, from the step's argument shardings at full depth (`jax.ShapeDtypeStruct`s, nothing
  allocated). The gradient accumulator holds one gradient per trainable parameter in the
  parameter dtype, sharded like the parameter.
- **Activations and temporaries**: XLA's own buffer assignment (`compiled.memory_analysis()`) of
  the real sharded step compiled on this host at two reduced depths, with the target's mesh (so
  every per-device shape is the target's), `seq_len`, `micro_batches` and remat policy. XLA's
  temporaries contain the gradient accumulator; its exact bytes are subtracted first, leaving
  T(L). The rule: T(L) = a + b * L, linear in the number of repeated layer blocks, fitted through
  the two compiled depths. `b * L` are the **activations** each layer keeps for the backward
  (its remat residuals and saved inputs: they are live together at the end of the forward);
  `a` is the **largest temporary** that does not grow with depth: the working set of the one layer
  being recomputed and differentiated, the logits and loss, the optimizer update.
  A block is the smallest repeating run of layer kinds (1 layer for a dense or MoE model, 3 Gated
  DeltaNet + 1 attention layers for Qwen3-Next), so each compiled depth holds whole blocks.
  `tests/memory/test_memory_plan.py` checks the rule against an actual compile at a third depth.
  The depths compile what the config runs. With `runtime.scan_layers` they are 2 and 3 blocks,
  each a real scan over its blocks (a stack of one block is not scanned, so 1 block would be a
  different program), so each layer's recomputation and gradient happen inside its own backward
  iteration as at full depth. Unscanned configs compile 1 and 2 blocks, unrolled: there XLA may
  schedule one layer's recomputation next to another's (docs/memory.md), as it may at full depth.
  A scanned compile costs the same at any depth, so the upper depth may be the full one
  (`depth_blocks=(2, layers // block)`): the total is then the full-depth compile's, where the
  default depths can understate it at long `seq_len` (docs/memory.md has the checks).
- **Layer lists that repeat no single block** (Kimi-Linear: one dense layer, six blocks of 3 KDA
  + 1 MLA, two KDA layers; Nemotron 3 Nano's pattern): no depth holds whole blocks, so the rule
  takes one slope per repeated block instead, T = a + sum_g b_g * repeats_g, over the groups
  the scanned model is cut into (`jtree.parallel.layer_stack.layer_groups`: Kimi-Linear's
  [KDA, KDA, KDA, MLA] x 6 and [KDA] x 2), each group's slope from two compiles that differ
  by repeats of that group only (`group_compiles` says which); a layer outside any repeated
  block (Kimi-Linear's dense first layer) is compiled as it is every time, in `a`. Scanned,
  each compile keeps the full model's groups (checked), so each group is one scan in every
  compile, as at full depth. One slope per layer kind instead (stacks of one kind each)
  predicted a scanned irregular test model's T 71% low: its layers outside repeated blocks run
  unrolled, not as a stack.

The compile runs for this host's backend, so its buffer assignment is XLA:CPU's: fusion and
scheduling differ on a GPU or TPU, so `T` is an estimate of the accelerator's, not a measurement
of it. One CPU lowering would distort it beyond that: `jax.lax.ragged_dot` (the MoE experts)
expands densely to [groups, rows, features] on CPU, so the step is compiled with a grouped
lowering of a TPU's buffer sizes (`jtree.memory.grouped_matmul_lowering`). XLA:GPU expands it
densely too, so for a MoE model on GPU the plan is far below the compiler's (docs/memory.md);
`python -m jtree.launch.memory_plan --target` gives the compiler's own. Everything except `T` is
exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import jax

from jtree.config import TrainConfig, load_config
from jtree.memory.grouped_matmul_lowering import grouped_matmul_lowering
from jtree.memory.step_shapes import abstract_step_args
from jtree.models.lora import trainable
from jtree.parallel.layer_stack import LayerGroup, layer_groups
from jtree.parallel.sharding import describe_mesh
from jtree.training.trainer import Trainer

GIB = 1024**3
# The depths compiled by default, in repeated layer blocks: a scan needs two repeats or more.
SCANNED_DEPTHS, UNROLLED_DEPTHS = (2, 3), (1, 2)


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of `tree`'s sharded `jax.ShapeDtypeStruct`s (each array's shard)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree_util.tree_leaves(tree))


def layer_block(layer_types: Sequence[str] | None) -> int:
    """Layers in the smallest run of layer kinds that repeats to give `layer_types` (1 when the
    architecture has one kind)."""
    types = tuple(layer_types or ("layer",))
    return next(p for p in range(1, len(types) + 1)
                if len(types) % p == 0 and types == types[:p] * (len(types) // p))


def depth_override(model_config: Any, layers: int) -> str:
    """The override that builds `model_config` at its first `layers` layers: `num_hidden_layers`,
    or, where the depth is the length of the layer list (Nemotron-H's `layers_block_type`), that
    list cut."""
    types = getattr(model_config, "layers_block_type", None)
    if types is None:
        return f"model.num_hidden_layers={layers}"
    return f"model.layers_block_type={json.dumps(list(types[:layers]))}"


# The model-config fields that hold one entry per decoder layer (the architectures' layer lists).
PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "layers_block_type")


def layers_override(model_config: Any, picks: Sequence[int]) -> list[str]:
    """The overrides that build `model_config` from its layers `picks` (indices, in that order,
    repeats allowed): every per-layer list cut to those entries, and the depth."""
    names = {f.name for f in dataclasses.fields(model_config)}
    out = [f"model.num_hidden_layers={len(picks)}"] if "num_hidden_layers" in names else []
    for name in PER_LAYER_FIELDS:
        values = getattr(model_config, name, None) if name in names else None
        if values is not None:
            out.append(f"model.{name}={json.dumps([values[i] for i in picks])}")
    return out


def group_name(group: LayerGroup) -> str:
    """How the report names a group's block: each layer's mixer and feed-forward ("none" left
    out)."""
    return "[" + ", ".join("+".join(p for p in kind if p != "none") for kind in group.block) + "]"


def group_picks(groups: Sequence[LayerGroup], repeats: Sequence[int]) -> list[int]:
    """Layer indices of the model whose group g repeats its block `repeats[g]` times: each
    group's first repeat, copied."""
    return [g.layer(0, j) for g, n in zip(groups, repeats) for _ in range(n)
            for j in range(len(g.block))]


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compile of the step at `layers` layers: XLA's temporaries minus the gradient
    accumulator (`activations_and_temps`), and how long tracing and compiling took."""

    layers: int
    activations_and_temps: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of a config's train step at full depth (see the module docstring)."""

    config: str
    mesh: str
    layers: int
    block: int
    seq_len: int
    micro_batches: int
    rows: int
    remat: str
    scanned: bool
    params: int
    grads: int
    opt_state: int
    inputs: int
    activations: int
    largest_temporary: int
    compiled: tuple[Compiled, ...]
    leading: int = 0  # `leading_layers`: their activations are in `largest_temporary`
    # `group_plan`'s (group's block, its repeats at full depth, bytes per repeat); () otherwise
    groups: tuple[tuple[str, int, float], ...] = ()

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.opt_state + self.inputs + self.activations
                + self.largest_temporary)

    def fits(self, device_gib: float) -> bool:
        return self.total <= device_gib * GIB

    def report(self, device_gib: float) -> str:
        """The plan as printed by `python -m jtree.launch.memory_plan`."""
        gib = lambda n: f"{n / GIB:9.2f} GiB"  # noqa: E731
        blocks = (self.layers - self.leading) // self.block
        unit = "layer" if self.block == 1 else f"block of {self.block} layers"
        slope = self.activations / blocks
        rule = ", one slope per repeated block" if self.groups else ""
        depths = " and ".join(f"{c.layers} ({c.seconds:.0f} s)" for c in self.compiled)
        free = device_gib * GIB - self.total
        lines = [
            f"memory plan: {self.config}, mesh {self.mesh}, {self.layers} layers, seq_len "
            f"{self.seq_len}, micro_batches {self.micro_batches}, {self.rows} row(s) per "
            f"micro-batch per device, remat {self.remat}",
            f"  parameters         {gib(self.params)}",
            f"  gradients          {gib(self.grads)}",
            f"  optimizer state    {gib(self.opt_state)}",
            f"  batch inputs       {gib(self.inputs)}",
            f"  activations        {gib(self.activations)}  ("
            + (" + ".join(f"{n} x {b / GIB:.3f} GiB per {block}" for block, n, b in self.groups)
               if self.groups else f"{blocks} x {slope / GIB:.3f} GiB per {unit}") + ")",
            f"  largest temporary  {gib(self.largest_temporary)}",
            f"  total              {gib(self.total)}  per device: "
            + (f"fits {device_gib:g} GiB ({free / GIB:.2f} GiB free)" if free >= 0 else
               f"does NOT fit {device_gib:g} GiB ({-free / GIB:.2f} GiB over)"),
            f"  activations and temporaries fitted from XLA:CPU compiles at {depths} layers, "
            + ("scanned" if self.scanned else "unrolled") + rule,
        ]
        return "\n".join(lines)


def activations_and_temps(cfg: TrainConfig, rows: int) -> Compiled:
    """Compile the step of `cfg` for this host, its MoE grouped matmuls lowered as an
    accelerator's (`grouped_matmul_lowering`), and return XLA's temporaries less the gradient
    accumulator."""
    start = time.perf_counter()
    trainer = Trainer.build(cfg)
    state, inputs = abstract_step_args(trainer, rows)
    with grouped_matmul_lowering():
        analysis = trainer.step_fn.lower(state, inputs).compile().memory_analysis()
    grads = shard_bytes(trainable(state.params))
    return Compiled(cfg.model.config.num_hidden_layers, analysis.temp_size_in_bytes - grads,
                    time.perf_counter() - start)


def leading_layers(config: Any) -> int:
    """Layers before the repeated blocks, compiled at every depth: DeepSeek-V3's
    `first_k_dense_replace` dense layers ahead of its MoE layers (0 for the other
    architectures). Each compiled depth is these plus whole blocks, so the fit's slope is the
    blocks' and its intercept holds the leading layers."""
    return getattr(config, "first_k_dense_replace", 0)


def fit_linear(samples: Sequence[Compiled], block: int, leading: int = 0
               ) -> tuple[float, float]:
    """(a, b) of T = a + b * blocks through two compiled depths (each `leading` layers plus
    whole blocks)."""
    (l0, t0), (l1, t1) = [((c.layers - leading) // block, c.activations_and_temps)
                          for c in samples]
    b = (t1 - t0) / (l1 - l0)
    return t0 - b * l0, b


def memory_plan(config: str, overrides: Sequence[str] = (), rows: int = 1,
                depth_blocks: tuple[int, int] | None = None) -> MemoryPlan:
    """The per-device memory plan of `config` (with `overrides`) on the devices jax sees, from
    compiles at `depth_blocks` repeated layer blocks (default `SCANNED_DEPTHS` when the config
    scans its layers, else `UNROLLED_DEPTHS`), scanned or unrolled as the config runs."""
    cfg = load_config(config, overrides)
    layers = cfg.model.config.num_hidden_layers
    block = layer_block(getattr(cfg.model.config, "layer_types", None))
    leading = leading_layers(cfg.model.config)
    scanned = cfg.runtime.scan_layers
    depth_blocks = depth_blocks or (SCANNED_DEPTHS if scanned else UNROLLED_DEPTHS)
    lowest = min(SCANNED_DEPTHS if scanned else UNROLLED_DEPTHS)
    if depth_blocks[0] == depth_blocks[1] or min(depth_blocks) < lowest:
        raise ValueError(
            f"depth_blocks: {depth_blocks} must be two different depths >= {lowest}"
            + (" with runtime.scan_layers (a stack of one block is not scanned)"
               if scanned else ""))
    trainer = Trainer.build(cfg)
    state, inputs = abstract_step_args(trainer, rows)
    exact = {  # the fields both rules share, exact at full depth
        "config": config, "mesh": describe_mesh(trainer.mesh), "layers": layers,
        "seq_len": cfg.data.seq_len, "micro_batches": cfg.data.micro_batches, "rows": rows,
        "remat": cfg.runtime.remat, "scanned": scanned, "params": shard_bytes(state.params),
        "grads": shard_bytes(trainable(state.params)),
        "opt_state": shard_bytes(state.opt_state), "inputs": shard_bytes(inputs)}
    if block == layers - leading and block > 1:
        return group_plan(config, overrides, rows, depth_blocks, exact)
    if leading + max(depth_blocks) * block > layers:
        raise ValueError(f"{config}: model.num_hidden_layers={layers} is below the compiled depth "
                         f"{leading + max(depth_blocks) * block}")
    samples = tuple(
        activations_and_temps(
            load_config(config, [*overrides, depth_override(cfg.model.config, leading + n * block)]),
            rows)
        for n in depth_blocks)
    a, b = fit_linear(samples, block, leading)
    return MemoryPlan(
        **exact, block=block, activations=round(b * (layers - leading) / block),
        largest_temporary=round(a), compiled=samples, leading=leading)


def group_compiles(config: str, overrides: Sequence[str], depth_blocks: tuple[int, int],
                   scanned: bool) -> tuple[tuple[LayerGroup, ...], list[int], list[TrainConfig]]:
    """What `group_plan` compiles: the full model's groups, each group's repeats in the base
    compile, and the configs of the base and of one compile per repeated group with
    `depth_blocks[1] - depth_blocks[0]` more repeats of it. In the base each group has
    `depth_blocks[0]` repeats unscanned; scanned (where a compile costs the same at any depth),
    its full repeats less that step, at least `depth_blocks[0]`. A group of one repeat is
    compiled whole every time. Scanned, every compile must be cut into the same groups, each
    one scan as at full depth; a list that would regroup is refused."""
    model_config = load_config(config, overrides).model.config
    groups = layer_groups(model_config.decoder().layers)
    low, high = depth_blocks
    base = [g.repeats if g.repeats == 1 else max(low, g.repeats - (high - low)) if scanned
            else low for g in groups]
    configs = []
    for more in [None, *(i for i, g in enumerate(groups) if g.repeats > 1)]:
        repeats = [n + (high - low) * (i == more) for i, n in enumerate(base)]
        cfg = load_config(config, [*overrides, *layers_override(
            model_config, group_picks(groups, repeats))])
        got = layer_groups(cfg.model.config.decoder().layers)
        if scanned and [(g.block, g.repeats) for g in got] != [
                (g.block, n) for g, n in zip(groups, repeats)]:
            raise ValueError(f"depth_blocks: {depth_blocks} regroups the scanned layers of "
                             f"{config} (the compile would not be the same program); a larger "
                             "first depth keeps more repeats of each group")
        configs.append(cfg)
    return groups, base, configs


def group_plan(config: str, overrides: Sequence[str], rows: int, depth_blocks: tuple[int, int],
               exact: dict[str, Any]) -> MemoryPlan:
    """The plan of a layer list that repeats no single block (module docstring): T = a +
    sum_g b_g * repeats_g over its repeated groups (`layer_groups`), b_g from the compiles of
    `group_compiles`, per repeat."""
    groups, base_repeats, configs = group_compiles(config, overrides, depth_blocks,
                                                   exact["scanned"])
    varied = [g for g, group in enumerate(groups) if group.repeats > 1]
    samples = tuple(activations_and_temps(cfg, rows) for cfg in configs)
    base, step = samples[0], depth_blocks[1] - depth_blocks[0]
    slopes = [(c.activations_and_temps - base.activations_and_temps) / step for c in samples[1:]]
    a = base.activations_and_temps - sum(b * base_repeats[g] for g, b in zip(varied, slopes))
    return MemoryPlan(
        **exact, block=exact["layers"], largest_temporary=round(a),
        activations=round(sum(b * groups[g].repeats for g, b in zip(varied, slopes))),
        compiled=samples, groups=tuple((group_name(groups[g]), groups[g].repeats, b)
                                       for g, b in zip(varied, slopes)))
