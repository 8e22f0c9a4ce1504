"""The device mesh ('data', 'fsdp', 'context', 'model') and how parameters and batches are laid
out on it.

Data parallelism splits the rows of every batch array over `data` and `fsdp` together (`ROWS`);
fully sharded data parallelism (FSDP, ZeRO-3) also splits every parameter, its gradient and its
optimizer state over `fsdp` (`fsdp_spec`), and the step gathers each decoder layer's weights
right before the layer runs (`jtree.models.layers.call_layer`; docs/training.md, "Fully sharded
data parallel"); tensor parallelism splits over `model`: Megatron-style attention heads, MLP
columns, Gated DeltaNet heads, Mamba2 groups and the vocabulary, and whole MoE experts (expert
parallel). The model side of it is a small hook in the models (`RuntimeConfig.tensor_parallel_axis`;
`row_parallel`, `vocab_parallel_embed`, `local_kv_heads` in `jtree.models.layers`, the expert
split in `jtree.models.moe`). Parameter layouts come from rule
lists (`param_rules`): ordered (regex over the '/'-joined parameter path, PartitionSpec) pairs,
first match wins, and a parameter that no rule matches is an error rather than a silent replica.
A model's list is the rules of the layer kinds its architecture config chooses
(`config.decoder()`, `jtree.config.architectures.LayerKind`), since every kind of layer splits the same
way in every architecture that uses it. The same lists place Hugging Face checkpoints on a mesh
(`jtree.hf.placement`), so training and loading cannot disagree.

Context parallelism splits the token axis of every row over `context` (docs/context_parallel.md):
device k of the axis holds the contiguous slice [k L, (k + 1) L) of each row's S = c L tokens
(`batch_specs`); parameters are not split over it (their gradients are summed over it like over
the row axes), and the model's hook is `RuntimeConfig.context_axis` (the attention gathers keys
and values over the axis, the loss exchanges a halo of hidden states: `jtree.parallel.context`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtree.config.run import MeshConfig
from jtree.layout.batch import DeviceBatch, field_axes, field_name
from jtree.parallel.layer_stack import stacked_axes

DATA, FSDP, CONTEXT, MODEL = "data", "fsdp", "context", "model"
AXES = (DATA, FSDP, CONTEXT, MODEL)
ROWS = (DATA, FSDP)  # the mesh axes the rows of a batch are split over
# The batch axes (`jtree.layout.batch` schema letters) split over `context`: the tokens, the scored
# positions (laid out per device by `jtree.parallel.context.context_batch`), the halo, and the
# Gated DeltaNet tables' chunks, exported chunks and conv halo (`jtree.layout.context_gdn_tables`: device
# k's entries in the k-th block of each).
CONTEXT_SPLIT = ("S", "K", "H", "N", "X", "W")
Rules = list[tuple[str, P]]


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'context', 'model') mesh over `devices` (default: every device of every
    process).

    The model axis varies fastest, then context, then fsdp, so with several hosts a
    tensor-parallel group (and, host size permitting, a context group, which gathers keys and
    values per attention layer, and an FSDP group, whose gathers run per layer) stays within a
    host and the data axis spans hosts. A size that does not divide the devices is an error
    naming its axis.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    where = f"the {n} devices available ({jax.process_count()} process(es))"
    inner, after = 1, []
    for axis in ("model", "context", "fsdp"):
        inner *= getattr(cfg, axis)
        if n % inner:
            times = "".join(f" x mesh.{a}={getattr(cfg, a)}" for a in after)
            raise ValueError(f"mesh.{axis}={getattr(cfg, axis)}"
                             + (f" ({times[1:]})" if after else "") + f" does not divide {where}")
        after.insert(0, axis)
    data = cfg.data if cfg.data > 0 else n // inner
    if data * inner != n:
        raise ValueError(f"mesh.data={cfg.data}: data={cfg.data} x fsdp={cfg.fsdp} x context="
                         f"{cfg.context} x model={cfg.model} does not match {where}")
    grid = np.asarray(devices, dtype=object).reshape(data, cfg.fsdp, cfg.context, cfg.model)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def describe_mesh(mesh: Mesh) -> str:
    """'data=2 x fsdp=4 x model=1', for logs and errors; with 'context=N' before 'model' when
    the mesh splits rows' tokens (N > 1)."""
    return " x ".join(f"{axis}={mesh.shape[axis]}" for axis in AXES
                      if axis != CONTEXT or mesh.shape[axis] > 1)


def context_size(mesh: Mesh) -> int:
    """How many devices each row's tokens are split over (1: no context parallelism)."""
    return mesh.shape.get(CONTEXT, 1)


def row_shards(mesh: Mesh) -> int:
    """How many pieces the rows of a batch are split into (`ROWS`: data x fsdp)."""
    return mesh.shape[DATA] * mesh.shape[FSDP]


# ---------------------------------------------------------------------- parameter rules
# The single source of truth for where every parameter lives on the mesh: used by the train step
# (`param_specs`) and by Hugging Face loading (`jtree.hf.placement`). Patterns are searched in the
# '/'-joined parameter path ('model/layers/0/self_attn/q_proj/kernel').


def _divides(what: str, count: int, model: int) -> None:
    if count % model:
        raise ValueError(f"mesh.model={model} must divide {what} ({count})")


def _embedding_rules(cfg: Any, model: int) -> Rules:
    """Vocab-parallel embedding and LM head, replicated norms (every norm weight is per feature of
    a whole hidden vector or of one head) and a replicated value head (hidden x 1)."""
    _divides("vocab_size", cfg.vocab_size, model)
    return [
        (r"embed_tokens/embedding$", P(MODEL, None)),
        (r"lm_head/kernel$", P(None, MODEL)),
        (r"value_head/(kernel|bias)$", P()),  # the critic's hidden -> 1 head (jtree.objectives.critic)
        # MTP's [embedding; hidden] -> hidden and its input norms (jtree.models.mtp)
        (r"^mtp/(fc/kernel|pre_fc_norm_(embedding|hidden)/weight)$", P()),
        (r"(norm|layernorm)/weight$", P()),
    ]


def _attention_rules(cfg: Any, model: int) -> Rules:
    """Query heads split (column-parallel q_proj, whose columns are whole heads, for Qwen3-Next
    each head's query and output gate), row-parallel o_proj. KV heads are split when the model
    axis divides them and replicated (each device keeps the head its queries read, see
    `jtree.models.layers.local_kv_heads`) when they divide the model axis."""
    _divides("num_attention_heads", cfg.num_attention_heads, model)
    if cfg.num_key_value_heads % model == 0:
        kv_kernel, kv_bias = P(None, MODEL), P(MODEL)
    elif model % cfg.num_key_value_heads == 0:
        kv_kernel, kv_bias = P(), P()
    else:
        raise ValueError(f"mesh.model={model} and num_key_value_heads "
                         f"({cfg.num_key_value_heads}) must divide one another")
    return [
        (r"self_attn/q_proj/kernel$", P(None, MODEL)),
        (r"self_attn/q_proj/bias$", P(MODEL)),
        (r"self_attn/[kv]_proj/kernel$", kv_kernel),
        (r"self_attn/[kv]_proj/bias$", kv_bias),
        (r"self_attn/o_proj/kernel$", P(MODEL, None)),
        (r"self_attn/o_proj/bias$", P()),
        (r"self_attn/sinks$", P(MODEL)),  # gpt-oss: one sink logit per query head
    ]


def _swiglu_rules(prefix: str) -> Rules:
    """Megatron SwiGLU: column-parallel gate/up (their biases, Llama's `mlp_bias`, split with
    the columns), row-parallel down (its bias replicated, added once after the sum)."""
    return [
        (rf"{prefix}/(gate|up)_proj/kernel$", P(None, MODEL)),
        (rf"{prefix}/(gate|up)_proj/bias$", P(MODEL)),
        (rf"{prefix}/down_proj/kernel$", P(MODEL, None)),
        (rf"{prefix}/down_proj/bias$", P()),
    ]


def _dense_mlp_rules(cfg: Any, model: int) -> Rules:
    _divides("intermediate_size", cfg.intermediate_size, model)
    return _swiglu_rules("mlp")


def _moe_rules(cfg: Any, model: int) -> Rules:
    """Expert parallel: each device holds num_experts / model whole experts (HF layout, split on
    the expert axis; gpt-oss's expert biases with them) and the router (with gpt-oss's bias) is
    replicated (`jtree.models.moe`)."""
    _divides("num_experts", cfg.num_experts, model)
    return [
        (r"mlp/gate/(weight|bias)$", P()),
        (r"mlp/experts/(gate_up_proj|up_proj|down_proj)$", P(MODEL, None, None)),
        (r"mlp/experts/(gate_up_proj|down_proj)_bias$", P(MODEL, None)),
    ]


def _shared_expert_moe_rules(cfg: Any, model: int) -> Rules:
    """Qwen3-Next's MoE block: expert parallel, and its shared expert a Megatron SwiGLU whose
    scalar gate is replicated."""
    _divides("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, model)
    return (_moe_rules(cfg, model) + [(r"mlp/shared_expert_gate/kernel$", P())]
            + _swiglu_rules("mlp/shared_expert"))


def _mla_rules(cfg: Any, model: int) -> Rules:
    """MLA (`jtree.models.mla`): heads split, q_b_proj (or q_proj) and kv_b_proj column-parallel
    in whole heads, o_proj row-parallel; the bottleneck projections (and their norms, by the
    norm rule) replicated."""
    _divides("num_attention_heads", cfg.num_attention_heads, model)
    return [
        (r"self_attn/(q_b_proj|q_proj|kv_b_proj)/kernel$", P(None, MODEL)),
        (r"self_attn/(q_a_proj|kv_a_proj_with_mqa)/(kernel|bias)$", P()),
        (r"self_attn/o_proj/kernel$", P(MODEL, None)),
        (r"self_attn/o_proj/bias$", P()),
    ]


def _deepseek_moe_rules(cfg: Any, model: int) -> Rules:
    """DeepSeekMoE: expert parallel with a replicated router (weight and selection bias), its
    ungated shared experts a Megatron SwiGLU. Nemotron 3's MoE ("relu2_moe") alike: its
    squared-ReLU experts (`up_proj`, no gate) split on the expert axis, its shared expert a
    Megatron up/down pair (the SwiGLU's rules without a gate)."""
    _divides("the shared experts' intermediate size", cfg.shared_expert_intermediate_size,
             model)
    return (_moe_rules(cfg, model) + [(r"mlp/gate/e_score_correction_bias$", P())]
            + _swiglu_rules("mlp/shared_expert"))


def _gated_deltanet_rules(cfg: Any, model: int) -> Rules:
    """Key heads split (with their value heads): the input projections of either layout
    (Qwen3-Next's in_proj_qkvz / in_proj_ba, Qwen3.5's in_proj_qkv / _z / _b / _a) are held grouped
    per key head, so a column split hands each device whole groups; per-value-head dt_bias and A_log
    split alike; out_proj row-parallel. The depthwise conv weight is stored [q | k | v] channels of
    all heads, which no single split matches: it is replicated and each device uses its heads'
    channels (`jtree.models.gated_deltanet.local_conv_channels`)."""
    _divides("linear_num_key_heads", cfg.linear_num_key_heads, model)
    return [
        (r"linear_attn/in_proj_(qkvz|ba|qkv|z|b|a)/kernel$", P(None, MODEL)),
        (r"linear_attn/(dt_bias|A_log)$", P(MODEL)),
        (r"linear_attn/conv1d/weight$", P()),
        (r"linear_attn/out_proj/kernel$", P(MODEL, None)),
    ]


def _mamba2_rules(cfg: Any, model: int) -> Rules:
    """B/C groups split, each with its heads (`jtree.models.mamba2`): in_proj and the conv are
    held grouped (per group: [z | x | B | C | dt] columns, [x | B | C] channels), so a
    contiguous split of their columns, channels and biases is whole groups of every component;
    the per-head dt_bias, A_log, D and the per-group gated norm's weight split alike; out_proj
    row-parallel (its bias added once after the sum)."""
    if cfg.n_groups % model:
        raise ValueError(f"mesh.model={model} must divide the Mamba2 n_groups ({cfg.n_groups}; "
                         f"mamba_num_heads {cfg.mamba_num_heads}): tensor parallelism splits "
                         "whole B/C groups with their heads")
    return [(r"mixer/in_proj/kernel$", P(None, MODEL)),
            (r"mixer/in_proj/bias$", P(MODEL)),
            (r"mixer/conv1d/weight$", P(MODEL, None, None)),
            (r"mixer/conv1d/bias$", P(MODEL)),
            (r"mixer/(dt_bias|A_log|D|norm/weight)$", P(MODEL)),
            (r"mixer/out_proj/kernel$", P(MODEL, None)),
            (r"mixer/out_proj/bias$", P())]


def _kda_rules(cfg: Any, model: int) -> Rules:
    """Kimi Delta Attention (`jtree.models.kda`, HF's `self_attn` like MLA's): heads split,
    q/k/v_proj, b_proj, f_b_proj and g_b_proj column-parallel in whole heads, dt_bias (per
    channel) and A_log (per head) split alike, o_proj row-parallel; the rank-`head_dim`
    f_a_proj and g_a_proj replicated, and the conv weight ([q | k | v] channels of all heads:
    `local_conv_channels`)."""
    _divides("linear_num_heads", cfg.linear_num_heads, model)
    return [
        (r"self_attn/([qkv]_proj|b_proj|g_b_proj|forget_gate/f_b_proj)/kernel$", P(None, MODEL)),
        (r"self_attn/(g_a_proj|forget_gate/f_a_proj)/kernel$", P()),
        (r"self_attn/forget_gate/(dt_bias|A_log)$", P(MODEL)),
        (r"self_attn/conv1d/weight$", P()),
        (r"self_attn/o_proj/kernel$", P(MODEL, None)),
    ]


# The rules of each layer kind (`jtree.config.architectures.MIXERS`, `FEED_FORWARDS`); the gated
# attention's q_proj columns are [query, gate] per head, so the query-head split keeps each
# head's gate with it.
LAYER_KIND_RULES: dict[str, Callable[[Any, int], Rules]] = {
    "attention": _attention_rules,
    "sliding_attention": _attention_rules,
    "gated_attention": _attention_rules,
    "gated_deltanet": _gated_deltanet_rules,
    "mla": _mla_rules,
    "mamba2": _mamba2_rules,
    "kda": _kda_rules,
    "none": lambda cfg, model: [],  # the missing half of a single-block layer (Nemotron-H)
    "mlp": _dense_mlp_rules,
    "relu2_mlp": _dense_mlp_rules,  # up/down split as the SwiGLU's (there is no gate)
    "moe": _moe_rules,
    "moe_shared": _shared_expert_moe_rules,
    "deepseek_moe": _deepseek_moe_rules,
    "relu2_moe": _deepseek_moe_rules,
}


def param_rules(cfg: Any, model: int, critic: Any = None) -> Rules:
    """The rule list of the model of architecture config `cfg` for a tensor-parallel degree of
    `model`: vocab-parallel embedding and head, replicated norms, and the rules of every layer
    kind `cfg.decoder()` uses (a size only has to divide where some layer has that kind); raises
    when a split is impossible. `critic`: the architecture config of PPO's separate critic
    (`jtree.objectives.critic`), whose parameters (under `critic/`) follow its own architecture's rules."""
    rules = []
    for kind in sorted(cfg.decoder().kinds(), key=list(LAYER_KIND_RULES).index):
        rules += LAYER_KIND_RULES[kind](cfg, model)
    rules += _embedding_rules(cfg, model)
    # The critic's rules come first: the policy's patterns are searched anywhere in a path.
    first = [] if critic is None else [
        ("^critic/.*" + pattern, spec) for pattern, spec in param_rules(critic, model)]
    return first + rules


def param_path(path: tuple[Any, ...]) -> str:
    """'model/layers/0/self_attn/q_proj/kernel' for a flattened nnx.State key path."""
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        if name != "value":  # nnx.Variable's own leaf
            parts.append(str(name))
    return "/".join(parts)


def partition_spec(name: str, shape: Sequence[int], rules: Rules,
                   mesh_shape: Mapping[str, int]) -> P:
    """The PartitionSpec of the parameter at '/'-joined path `name`: the first rule whose pattern
    is found in it, checked against the shape and the mesh, plus the `fsdp` axis where the mesh
    has one of size > 1 (`fsdp_spec`). No match is an error. The rules describe one layer's
    parameter; a scanned model's stacked layer axes (`jtree.parallel.layer_stack.stacked_axes`) come
    first and are split by neither a rule nor FSDP."""
    spec = next((s for pattern, s in rules if re.search(pattern, name)), None)
    if spec is None:
        raise ValueError(f"{name}: no sharding rule matches this parameter")
    leading = stacked_axes(name)
    spec = P(*(None,) * leading, *spec)
    if len(spec) > len(shape):
        raise ValueError(f"{name}: spec {spec} has more axes than shape {tuple(shape)}")
    for dim, axis in zip(shape, spec):
        if axis is None:
            continue
        if axis not in mesh_shape:
            raise ValueError(f"{name}: the mesh (axes {tuple(mesh_shape)}) has no axis {axis!r}")
        if dim % mesh_shape[axis]:
            raise ValueError(f"{name}: dimension {dim} is not divisible by mesh.{axis}="
                             f"{mesh_shape[axis]}")
    return fsdp_spec(spec, shape, mesh_shape.get(FSDP, 1), leading=leading, name=name)


def fsdp_spec(spec: P, shape: Sequence[int], fsdp_size: int, *, leading: int = 0,
              name: str = "parameter") -> P:
    """`spec` (a tensor-parallel rule's) with the `fsdp` axis added on one more dimension.

    The dimension is the first one at or after `leading` (a stacked layer axis is never split)
    that `spec` leaves whole and that `fsdp_size` divides: for a column-parallel kernel [in, out]
    that is `in`, for a row-parallel one `out`, for an expert tensor its first feature dimension.
    Tensors of at most one dimension (norm weights, biases, per-head `A_log` / `dt_bias`) stay
    replicated over `fsdp`: they are a vanishing share of the bytes, and gathering each would
    add a collective per layer for nothing. A larger tensor with no such dimension is an error
    naming the parameter, not a silent replica. `fsdp_size` 1 returns `spec` unchanged.
    """
    if fsdp_size == 1 or len(shape) - leading <= 1:
        return spec
    axes = tuple(spec) + (None,) * (len(shape) - len(spec))
    for dim in range(leading, len(shape)):
        if axes[dim] is None and shape[dim] % fsdp_size == 0:
            return P(*axes[:dim], FSDP, *axes[dim + 1:])
    raise ValueError(f"{name}: no dimension of shape {tuple(shape)} that spec {spec} leaves "
                     f"whole is divisible by mesh.fsdp={fsdp_size}")


def param_specs(params: Any, rules: Rules, mesh: Mesh) -> Any:
    """A PartitionSpec for every parameter (same tree as `params`), checked against the mesh."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: partition_spec(param_path(path), leaf.shape, rules, mesh.shape), params)


def named(mesh: Mesh, specs: Any) -> Any:
    """NamedShardings for a tree of PartitionSpecs."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def token_spec() -> P:
    """Per-token step arrays [micro_batches, rows, S]: rows split over `data` and `fsdp`, the
    tokens of each row over `context`."""
    return P(None, ROWS, CONTEXT)


def batch_specs(inputs: DeviceBatch) -> DeviceBatch:
    """The PartitionSpec of every field of step inputs [micro_batches, rows, ...] (the same
    pytree as `inputs`, for shard_map's in_specs or the batch's shardings): rows over `ROWS`,
    the axes `CONTEXT_SPLIT` names over `context`, every other axis whole; `router_load` (no
    row axis) replicated."""
    def spec(name: str, x: Any) -> P:
        if name.startswith("router_load"):
            return P(*([None] * x.ndim))
        axes = field_axes(name)
        return P(None, ROWS, *(CONTEXT if a in CONTEXT_SPLIT else None for a in axes))

    return jax.tree_util.tree_map_with_path(
        lambda path, x: spec(field_name(path), x), inputs)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes a value inside shard_map varies over (its manual axis type: a parameter
    sharded over `fsdp` or `model` varies over them, a replicated one over none)."""
    return jax.typeof(x).mat.varying


def vary_over(tree: Any, axes: str | Sequence[str]) -> Any:
    """Mark values as varying over `axes` inside shard_map (those they do not vary over yet), so
    that gradients with respect to them stay per-device (summed explicitly once, after
    accumulating micro-batches) instead of being all-reduced on every micro-batch."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def one(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(one, tree)
