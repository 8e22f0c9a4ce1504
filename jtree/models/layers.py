"""Building blocks of the decoder stack, with Hugging Face numerics."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.config.architectures import Llama3RopeScaling, YarnRopeScaling
from jtree.kernels.flat_tokens import normalized_last_axis, scale_channels
from jtree.kernels.precision import accumulation_dtype
from jtree.kernels.weight_grad import linear_dot_general

# `runtime.remat` names (`jtree.config.runtime.REMAT_POLICY_NAMES`, besides "none") -> jax policies.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

M = TypeVar("M", bound=nnx.Module)


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32 (every norm of the family normalizes so), over
    one flat token axis (`jtree.kernels.flat_tokens`: its backward on one long tree row)."""
    return normalized_last_axis(x, eps, mean=True)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, normalized in float32 and cast back before the scale (as in HF)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return scale_channels(rms_normalized(x, self.eps).astype(x.dtype),
                              self.weight[...].astype(x.dtype))


class OffsetRMSNorm(nnx.Module):
    """x / rms(x) * (1 + weight) in float32, cast back after the scale (HF `Qwen3NextRMSNorm`;
    zero-initialized weight)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = 1.0 + self.weight[...].astype(accumulation_dtype(x.dtype))
        return scale_channels(rms_normalized(x, self.eps), scale).astype(x.dtype)


class RMSNormScaledInFloat32(nnx.Module):
    """x / rms(x) * weight, scaled in float32 and cast back after the scale (HF `GptOssRMSNorm`,
    whose weights transformers keeps in float32); the same values as `RMSNorm` in float32."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.weight[...].astype(accumulation_dtype(x.dtype))
        return scale_channels(rms_normalized(x, self.eps), scale).astype(x.dtype)


NORMS = {"rms": RMSNorm, "offset_rms": OffsetRMSNorm, "rms_f32_scale": RMSNormScaledInFloat32}


def linear(
    din: int, dout: int, *, bias: bool, init_std: float, dtype: jnp.dtype, param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
) -> nnx.Linear:
    """A Linear layer with HF's normal(0, initializer_range) init; kernel is [in, out]. Its product
    is `linear_dot_general` (on CPU the weight gradient runs in a C++ kernel, no transposed copy
    of the input)."""
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.initializers.normal(init_std),
        bias_init=nnx.initializers.zeros_init(),
        dot_general=linear_dot_general,
        rngs=rngs,
    )


def rope_inverse_frequencies(rotary_dim: int, theta: float,
                             scaling: Llama3RopeScaling | YarnRopeScaling | None = None
                             ) -> jax.Array:
    """RoPE's rotation speeds [rotary_dim / 2] in float32, op for op as transformers computes
    them, so tables (and the logits after them) match HF to float32 rounding.

    With Llama 3's `scaling`, a frequency is judged by its wavelength 2 pi / f in positions
    against the original context length L = original_max_position_embeddings: one that turns less
    than `low_freq_factor` times over L is slowed down by `factor` (it never saw longer contexts
    in pretraining), one that turns more than `high_freq_factor` times is kept (it encodes local
    order), and in between the two are blended with weight s = (L / wavelength - low) / (high -
    low) on the kept one. YaRN's scaling: `yarn_inverse_frequencies`."""
    if isinstance(scaling, YarnRopeScaling):
        return yarn_inverse_frequencies(rotary_dim, theta, scaling)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    if scaling is None:
        return inv_freq
    context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    slow = wavelength > context / low
    fast = wavelength < context / high
    scaled = jnp.where(slow, inv_freq / scaling.factor, inv_freq)
    s = (context / wavelength - low) / (high - low)
    blended = (1 - s) * scaled / scaling.factor + s * scaled
    return jnp.where(~slow & ~fast, blended, scaled)


def yarn_inverse_frequencies(rotary_dim: int, theta: float,
                             scaling: YarnRopeScaling) -> jax.Array:
    """YaRN's rotation speeds, the float32 ops of transformers' `_compute_yarn_parameters` (equal
    to its values within an ulp or two: XLA's pow and constant division round differently from
    torch's on some elements): dimension
    pair i keeps its frequency (extrapolation) below the correction range [low, high] and takes
    it divided by `factor` (interpolation) above it, linearly blended in between; the range is
    where a frequency turns `beta_fast` ... `beta_slow` times over the original context."""
    dim, factor = rotary_dim, scaling.factor

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rope_attention_factor(scaling: Llama3RopeScaling | YarnRopeScaling | None) -> float:
    """The factor on RoPE's cos and sin tables: YaRN's attention factor (given, or from
    `factor` and the optional `mscale` / `mscale_all_dim` as transformers derives it), else 1."""
    if not isinstance(scaling, YarnRopeScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale)
                     / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


def rope_cos_sin(pos: jax.Array, inv_freq: jax.Array,
                 attention_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [..., 2 * len(inv_freq)] for integer positions (a token's index along its
    path, so every path sees the positions it would alone), in float32 (as HF computes them),
    times `attention_factor` (YaRN's; `rope_attention_factor`) when it is not 1."""
    freqs = pos.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first cos.shape[-1] features of x [rows, S, heads, head_dim]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)), with biases on all three when `bias` (Llama's `mlp_bias`).
    Under tensor parallelism (`tp_axis`), gate/up are column shards and down is the matching row
    shard, so the output is reduced over `tp_axis` (down's bias added once, after the sum)."""

    def __init__(self, hidden: int, intermediate: int, *, init_std: float, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs, tp_axis: str | None = None,
                 bias: bool = False):
        kw = dict(bias=bias, init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = linear(hidden, intermediate, **kw)
        self.up_proj = linear(hidden, intermediate, **kw)
        self.down_proj = linear(intermediate, hidden, **kw)
        self.tp_axis = tp_axis

    def __call__(self, x: jax.Array) -> jax.Array:
        return row_parallel(self.down_proj, self._hidden(x), self.tp_axis)

    def unreduced(self, x: jax.Array) -> jax.Array:
        """This device's partial output, before the sum over `tp_axis` (the full output without
        tensor parallelism), for callers that fold it into a larger sum (the MoE block)."""
        return self.down_proj(self._hidden(x))

    def _hidden(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)


class ReluSquaredMLP(nnx.Module):
    """down(relu(up(x))^2), with biases on both when `bias` (Nemotron-H's non-gated MLP, HF
    `NemotronHMLP` with `mlp_hidden_act: relu2`). Under tensor parallelism (`tp_axis`) up is a
    column shard and down the matching row shard, as in `SwiGLU`."""

    def __init__(self, hidden: int, intermediate: int, *, init_std: float, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs, tp_axis: str | None = None,
                 bias: bool = False):
        kw = dict(bias=bias, init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.up_proj = linear(hidden, intermediate, **kw)
        self.down_proj = linear(intermediate, hidden, **kw)
        self.tp_axis = tp_axis

    def __call__(self, x: jax.Array) -> jax.Array:
        return row_parallel(self.down_proj, self._hidden(x), self.tp_axis)

    def unreduced(self, x: jax.Array) -> jax.Array:
        """This device's partial output, before the sum over `tp_axis` (as `SwiGLU.unreduced`:
        Nemotron 3's shared expert inside the MoE block's sum)."""
        return self.down_proj(self._hidden(x))

    def _hidden(self, x: jax.Array) -> jax.Array:
        return jnp.square(jax.nn.relu(self.up_proj(x)))


# ---------------------------------------------------------------------- tensor-parallel hooks
# Megatron-style tensor parallelism inside `shard_map` (jtree.parallel.sharding decides the splits): the
# model sees only its shard of each weight. Column-parallel projections (q/k/v, gate/up) need no
# change; these three helpers are the only places that communicate. With `axis=None` (no tensor
# parallelism) each is exactly the plain single-device computation.


def row_parallel(layer: nnx.Linear, x: jax.Array, axis: str | None) -> jax.Array:
    """`layer(x)` for a row-parallel projection whose kernel holds this device's input rows: the
    partial products are summed over `axis`, then the bias (if any) is added once."""
    if axis is None:
        return layer(x)
    kernel = layer.kernel[...]
    bias = layer.bias[...] if layer.bias is not None else None
    x, kernel, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
    y = jax.lax.psum(jnp.dot(x, kernel), axis)
    return y if bias is None else y + bias


def vocab_parallel_embed(embed: nnx.Embed, tokens: jax.Array, axis: str | None) -> jax.Array:
    """Embedding lookup when the table's rows (the vocabulary) are split over `axis`: each device
    looks up the tokens in its range, zeros elsewhere, and the results are summed."""
    if axis is None:
        return embed(tokens)
    (table,) = embed.promote_dtype((embed.embedding[...],), dtype=embed.dtype, inexact=False)
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(axis) * rows
    inside = (local >= 0) & (local < rows)
    x = jnp.take(table, jnp.where(inside, local, 0), axis=0)
    return jax.lax.psum(jnp.where(inside[..., None], x, jnp.zeros_like(x)), axis)


def local_kv_heads(kv: jax.Array, q_heads_local: int, q_heads: int, kv_heads: int,
                   axis: str | None) -> jax.Array:
    """The kv heads [rows, S, h, D] read by this device's query heads.

    When kv heads divide the tensor-parallel degree they are split like the query heads and
    nothing changes. With fewer kv heads than devices, k/v projections are replicated and each
    device keeps the single kv head that its contiguous block of query heads reads (GQA).
    """
    if axis is None or kv.shape[2] != kv_heads or q_heads_local == q_heads:
        return kv
    group = q_heads // kv_heads
    first = jax.lax.axis_index(axis) * q_heads_local // group
    return jax.lax.dynamic_slice_in_dim(kv, first, 1, axis=2)


# ---------------------------------------------------------------------- FSDP hooks
# Fully sharded data parallelism inside `shard_map` (jtree.parallel.sharding decides the splits;
# docs/training.md, "Fully sharded data parallel"): a parameter sharded over the FSDP axis
# carries the Variable metadata `FSDP_GATHER` = (mesh axis, dimension counted from the end),
# set by `jtree.step.train_step.sharded_graphdef`. Counting from the end keeps the dimension right when
# layers are stacked along leading axes. Without the metadata (one device, or a parameter
# replicated over the axis) nothing is gathered.

FSDP_GATHER = "fsdp_gather"


def fsdp_sharded(module: nnx.Module) -> bool:
    """Whether some parameter of `module` is sharded over an FSDP axis."""
    return any(isinstance(v, nnx.Variable) and v.get_metadata(FSDP_GATHER, None) is not None
               for _, v in nnx.iter_graph(module))


def fsdp_gathered(module: M, skip: Any = nnx.Nothing) -> M:
    """A copy of `module` whose FSDP-sharded parameters are all-gathered over their axis (each
    device then holds its tensor-parallel shard of the whole weight), except those at paths
    `skip` (an nnx filter) matches. The transpose of the gather is a reduce-scatter, so the
    gradients arrive sharded like the parameters."""
    if not fsdp_sharded(module):
        return module
    copy = nnx.clone(module)
    skipped = nnx.filterlib.to_predicate(skip)
    for path, var in nnx.iter_graph(copy):
        gather = (var.get_metadata(FSDP_GATHER, None) if isinstance(var, nnx.Variable)
                  else None)
        if gather is None or skipped(path, var):
            continue
        axis, dim = gather
        value = var.get_value()
        var.set_value(jax.lax.all_gather(value, axis, axis=value.ndim + dim, tiled=True))
        var.set_metadata(FSDP_GATHER, None)
    return copy


# ---------------------------------------------------------------------- rematerialization

def call_layer(layer: nnx.Module, *args: Any, remat: str) -> Any:
    """`layer(*args)`, recomputing its activations in the backward pass under policy `remat`
    ("none" keeps them; "full" saves nothing; "dots" saves matmul outputs). Arguments and results
    may be pytrees of arrays (MoE layers also return router statistics).

    Under FSDP the layer's sharded weights are gathered first, inside the rematerialized
    function, and never saved for the backward whatever the policy: the backward gathers them
    again, so only the running layer's whole weights are live (ZeRO-3), at the price of a
    second all-gather per layer; with remat "none" everything else is kept as without FSDP."""
    if fsdp_sharded(layer):
        policy = REMAT_POLICIES.get(remat, jax.checkpoint_policies.everything_saveable)
        return nnx.remat(lambda m, *a: fsdp_gathered(m)(*a),
                         policy=unless_gathered(policy))(layer, *args)
    if remat == "none":
        return layer(*args)
    return nnx.remat(lambda m, *a: m(*a), policy=REMAT_POLICIES[remat])(layer, *args)


def unless_gathered(policy: Callable[..., bool]) -> Callable[..., bool]:
    """`policy`, except that the output of an all-gather (the whole weights FSDP gathers; no
    layer gathers anything else) is never saved: the backward gathers again from the shard,
    which is saved as the layer's input. (Naming the gathered value would not do: under a
    policy that saves everything, the all-gather's own output would be kept in its place.)"""

    def decide(prim: Any, *args: Any, **params: Any) -> bool:
        return prim.name != "all_gather" and policy(prim, *args, **params)

    return decide
