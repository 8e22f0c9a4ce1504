"""LoRA: low-rank adapters on the model's linear kernels, trained while the base stays frozen.

A LoRA run's parameters are a `LoraParams`: the frozen base (the model's own parameter state,
stored in `base_dtype` if asked) and, for every targeted kernel W [..., in, out], adapters
A [..., in, r] and B [..., r, out]. The model itself is not changed: every forward runs it on
the merged weights W' = W + (alpha / r) A B (`model_params`), so the model a step trains is by
construction the model `jtree export-hf --merge-lora` writes, every layout (tree, baseline,
redundancy-free parts), the tensor-parallel and the FSDP model need nothing LoRA-specific, and the
sharding of A and B follows the kernel's (`lora_specs`: the step reads A split like W's input
axis and B like its output axis, FSDP included, so the local A B is the local block of W).
Gradients are taken with respect to the adapters only
(`trainable`), so the optimizer holds state for the adapters alone. The price of merging over
adding x A B beside x W: each targeted kernel gets a weight-sized merged copy and a weight-sized
cotangent per micro-batch (contracted to dA, dB right away); no optimizer state, no gradient
accumulator and no update for the base.

Targets are regular expressions searched in the '/'-joined parameter path of a kernel
('model/layers/0/self_attn/q_proj/kernel'), as `jtree.parallel.sharding` rules are; a target that matches
no linear kernel is an error naming it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jtree.config.model import LoraConfig
from jtree.parallel.sharding import FSDP, MODEL, Rules, param_path, param_specs

KERNEL = "kernel"
ADAPTERS = ("lora_a", "lora_b")


@dataclasses.dataclass
class LoraParams:
    """The parameters of a LoRA run: the frozen `base` (an nnx.State of the model), the trained
    `adapters` ({'lora_a', 'lora_b'} under each targeted kernel's path, nested dicts), the
    adapters' `scale` and the dtypes the model's parameters have (static, one per base leaf in
    flattening order: a base stored in `base_dtype` is cast back to them when merged)."""

    base: Any
    adapters: Any
    scale: float
    dtypes: tuple[str, ...]


jax.tree_util.register_dataclass(LoraParams, data_fields=["base", "adapters"],
                                 meta_fields=["scale", "dtypes"])


def kernel_names(params: Any) -> list[str]:
    """The '/'-joined paths of the linear kernels of a model's parameters (leaves named `kernel`
    with an [..., in, out] shape), the parameters LoRA can target."""
    return [name for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
            if (name := param_path(path)).endswith("/" + KERNEL) and leaf.ndim >= 2]


def select_targets(params: Any, cfg: LoraConfig) -> list[str]:
    """The kernels `cfg.targets` select, in parameter order; a target that selects none is an
    error naming it (`model.lora.targets[i]`) with the kernels there are."""
    names = kernel_names(params)
    chosen = set()
    for i, target in enumerate(cfg.targets):
        hits = [n for n in names if re.search(target, n)]
        if not hits:
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(f"model.lora.targets[{i}]: {target!r} matches no linear kernel "
                             f"(kernels: {shown})")
        chosen.update(hits)
    return [n for n in names if n in chosen]


def attach(params: Any, cfg: LoraConfig, key: jax.Array) -> LoraParams:
    """Adapters for the kernels `cfg` targets, next to `params` as the frozen base: A from He
    uniform init (as `nnx.LoRA`), B zero, so the merged model starts equal to the base."""
    targets = select_targets(params, cfg)
    kernels = {param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    adapters: dict[str, Any] = {}
    init_a = nnx.initializers.he_uniform()
    for name, k in zip(targets, jax.random.split(key, len(targets))):
        w = kernels[name]
        lead, (din, dout) = w.shape[:-2], w.shape[-2:]
        node = adapters
        for part in name.split("/")[:-1]:
            node = node.setdefault(part, {})
        node["lora_a"] = init_a(k, (*lead, din, cfg.rank), w.dtype)
        node["lora_b"] = jnp.zeros((*lead, cfg.rank, dout), w.dtype)
    dtypes = tuple(jnp.dtype(x.dtype).name for x in jax.tree_util.tree_leaves(params))
    base = params if cfg.base_dtype is None else jax.tree_util.tree_map(
        lambda x: x.astype(cfg.base_dtype), params)
    return LoraParams(base, adapters, cfg.scale, dtypes)


def with_lora(params: Any, cfg: LoraConfig | None, seed: int) -> Any:
    """`params` as a run with `model.lora = cfg` trains them: unchanged without LoRA."""
    return params if cfg is None else attach(params, cfg, jax.random.key(seed))


def model_params(params: Any) -> Any:
    """The parameters the model runs on: the merged W + scale A B for a `LoraParams` (every base
    parameter in the model's dtype), `params` itself otherwise."""
    if not isinstance(params, LoraParams):
        return params
    pairs: dict[str, dict[str, jax.Array]] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params.adapters)[0]:
        stem, _, which = param_path(path).rpartition("/")
        pairs.setdefault(stem + "/" + KERNEL, {})[which] = x

    leaves, treedef = jax.tree_util.tree_flatten_with_path(params.base)
    out = []
    for (path, w), dtype in zip(leaves, params.dtypes, strict=True):
        w = w.astype(dtype)
        ab = pairs.get(param_path(path))
        if ab is not None:
            w = w + (params.scale * jnp.matmul(ab["lora_a"], ab["lora_b"])).astype(dtype)
        out.append(w)
    return jax.tree_util.tree_unflatten(treedef, out)


def trainable(params: Any) -> Any:
    """What gradients and the optimizer cover: the adapters of a LoRA run, else every parameter."""
    return params.adapters if isinstance(params, LoraParams) else params


def with_trainable(params: Any, values: Any) -> Any:
    """`params` with its trainable part (`trainable`) replaced by `values`."""
    if isinstance(params, LoraParams):
        return dataclasses.replace(params, adapters=values)
    return values


def trainable_grads(params: Any, model_grads: Any) -> Any:
    """Gradients with respect to the trainable part from gradients with respect to the model's
    parameters (`model_params`): the chain rule through the merge, for steps that differentiate
    the model's parameters themselves (`jtree.partitioning.redundancy_free`)."""
    if not isinstance(params, LoraParams):
        return model_grads
    _, pullback = jax.vjp(lambda t: model_params(with_trainable(params, t)), trainable(params))
    return pullback(model_grads)[0]


def lora_specs(params: Any, rules: Rules, mesh: Mesh) -> tuple[Any, Any]:
    """(stored, step): the PartitionSpecs the parameters of a run (`params`, a `LoraParams` or
    the model's own) are kept in, with their optimizer state, and those the step reads them in
    (shard_map's in_specs, and its gradients' out_specs). Without LoRA both are
    `jtree.parallel.sharding.param_specs`; the frozen base is laid out as the model's parameters are.

    The step reads A [..., in, r] split like its kernel's input axis and B [..., r, out] like its
    output axis, each taking the kernel's whole spec there (tensor parallel and FSDP), so every
    device's A B is exactly its block of the kernel and the merge W + s A B runs on the shards,
    before the layer gathers W' over FSDP (`jtree.models.layers.call_layer`). Of A and B, the one
    whose axis the kernel's FSDP split does not cut is then whole over `fsdp`, and A of a
    column-parallel kernel (B of a row-parallel one) whole over `model`: each is stored with its
    feature axis split over those axes too (when the sizes divide), so no device keeps a whole
    adapter or its optimizer moments, and the step's jit gathers it (r x in or r x out numbers,
    once per step) and slices its gradient back.
    Docs: docs/lora.md."""
    if not isinstance(params, LoraParams):
        specs = param_specs(params, rules, mesh)
        return specs, specs
    base = param_specs(params.base, rules, mesh)
    kernels = {param_path(path): tuple(spec) for path, spec in
               jax.tree_util.tree_flatten_with_path(base, is_leaf=lambda x: isinstance(x, P))[0]}

    def read(path: tuple[Any, ...], x: Any) -> P:
        stem, _, which = param_path(path).rpartition("/")
        w = kernels[stem + "/" + KERNEL]
        w = w + (None,) * (x.ndim - len(w))
        return P(*w[:-2], w[-2], None) if which == "lora_a" else P(*w[:-2], None, w[-1])

    def keep(path: tuple[Any, ...], x: Any, spec: P) -> P:
        # The feature axis (A's in, B's out) further split over every mesh axis the step's
        # layout leaves it whole over (within the split it has), when the sizes divide.
        axes = list(tuple(spec) + (None,) * (x.ndim - len(spec)))
        used = {a for entry in axes if entry is not None
                for a in (entry if isinstance(entry, tuple) else (entry,))}
        extra = tuple(a for a in (FSDP, MODEL) if mesh.shape.get(a, 1) > 1 and a not in used)
        if not extra:
            return spec
        dim = x.ndim - (2 if param_path(path).endswith("lora_a") else 1)
        have = () if axes[dim] is None else (axes[dim],)
        if x.shape[dim] % math.prod(mesh.shape[a] for a in have + extra):
            return spec
        axes[dim] = have + extra if have or len(extra) > 1 else extra[0]
        return P(*axes)

    step = jax.tree_util.tree_map_with_path(read, params.adapters)
    stored = jax.tree_util.tree_map_with_path(keep, params.adapters, step)
    return (dataclasses.replace(params, base=base, adapters=stored),
            dataclasses.replace(params, base=base, adapters=step))
