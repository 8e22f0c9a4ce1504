"""Gated DeltaNet and its path conv1d on rows split over a `context` mesh axis of 2, 4 or 8
forced host devices, against the single-device kernels on the same trees (forward and
gradients). Run in a subprocess (`tests/kernels/test_gdn_context.py`): the device count is fixed
when jax starts.

Each case lays trees out in one row per tree set (DFS order), then spreads the row over the
c device slices with gaps (padding in the middle of the row: each slice holds a random number of
the row's tokens). The reference runs the sequential chunk scan and the conv on the row without
gaps, in float32 and in float64 (the exact values). Prints one JSON line per (case, devices) with
the relative differences to the float32 reference, the largest value on a gap token (`leak`) and,
per kernel, the result farthest past the error model against float64
(`tests.models_util.worst_rounding`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from flax import nnx  # noqa: E402

from jtree.layout.batch import GdnTables  # noqa: E402
from jtree.layout.context_gdn_tables import (  # noqa: E402
    context_chunk_tables, context_gdn_tables, conv_halo_positions,
)
from jtree.kernels.gdn.delta_rule import tree_gated_delta_rule  # noqa: E402
from jtree.kernels.gdn.context import (  # noqa: E402
    context_conv_index, context_conv_source, context_gated_delta_rule,
)
from jtree.kernels.tree_conv import path_context, tree_causal_conv1d  # noqa: E402
from jtree.layout.linearize import linearize  # noqa: E402
from jtree.models.gated_deltanet import GatedDeltaNet, gdn_routing  # noqa: E402
from jtree.trees.tree import TrajectoryTree  # noqa: E402
from tests.models_util import (  # noqa: E402
    rel_l2, tiny_next_config, tiny_runtime, worst_rounding,
)
from tests.strategies import explicit_tree, random_forest  # noqa: E402

S, CHUNK, KERNEL, AXIS = 64, 4, 4, "context"
HK, HV, DK, DV, D = 2, 4, 8, 8, 6


def _chain(n: int) -> list[TrajectoryTree]:
    """A chain of n nodes of 1-5 tokens with a one-token leaf under every third node: its chunks
    cross every device boundary."""
    parents, segments = [], []
    last = -1
    for i in range(n):
        parents.append(last)
        segments.append([1 + i % 7] * (1 + (3 * i) % 5))
        last = len(parents) - 1
        if i % 3 == 1:
            parents.append(last)
            segments.append([9])
    return [TrajectoryTree.from_nodes(parents, segments)]


def _two_back() -> list[TrajectoryTree]:
    """A root with a long first child (it fills the slices after the root's) and a second
    child after it: on 4 or more devices the second child's parent is two or more devices back."""
    return [TrajectoryTree.from_nodes([-1, 0, 1, 0, 3], [[1, 2], [3] * 30, [4] * 9, [5, 6, 7],
                                                         [8] * 4])]


def _flat() -> list[TrajectoryTree]:
    """Depth 1: single-node trees."""
    return [TrajectoryTree.from_nodes([-1], [[t] * (1 + t % 4)]) for t in range(1, 19)]


def _random(seed: int) -> list[TrajectoryTree]:
    rng = np.random.default_rng(seed)
    trees, total = [], 0
    while True:
        t = explicit_tree(random_forest(rng, max_nodes=12, max_seg=6, with_rl=False))
        if total + t.n_tree_tokens > 48:
            return trees or [t]
        trees.append(t)
        total += t.n_tree_tokens


CASES = {"chain": lambda: _chain(16), "two_back": _two_back, "flat": _flat,
         "random0": lambda: _random(0), "random1": lambda: _random(1),
         "random2": lambda: _random(2)}


def _spread(n_real: int, context: int, rng: np.random.Generator) -> np.ndarray:
    """Where each of the row's n_real tokens goes in a row of S split over `context` slices,
    every slice holding a random share (at least one token, at most L) in its first positions."""
    length = S // context
    counts = np.ones(context, np.int64)
    for _ in range(n_real - context):
        k = rng.choice(np.flatnonzero(counts < length))
        counts[k] += 1
    return np.concatenate([k * length + np.arange(c) for k, c in enumerate(counts)])


def _gapped_row(trees: list[TrajectoryTree], context: int, rng: np.random.Generator):
    """(the linearized row without gaps, its n_real tokens' positions in the gapped row, the
    gapped row's node and pred)."""
    batch = linearize(trees, S, gdn_chunk_size=CHUNK, gdn_chunks=S, n_rows=1).inputs
    n_real = int(np.asarray(batch.valid)[0].sum())
    assert n_real >= context and not np.asarray(batch.valid)[0, n_real:].any()
    where = _spread(n_real, context, rng)
    pred0, node0 = np.asarray(batch.pred)[0, :n_real], np.asarray(batch.node)[0, :n_real]
    pred = np.full((1, S), -1, np.int32)
    node = np.full((1, S), -1, np.int32)
    pred[0, where] = np.where(pred0 >= 0, where[np.maximum(pred0, 0)], -1)
    node[0, where] = node0
    return batch, where, node, pred


def _layer_case(trees: list[TrajectoryTree], context: int, seed: int) -> dict:
    """The Qwen3-Next GatedDeltaNet layer with `RuntimeConfig.context_axis` inside shard_map
    against the layer on one device: output and every parameter's gradient."""
    rng = np.random.default_rng(seed)
    batch, where, node, pred = _gapped_row(trees, context, rng)
    n_real = len(where)
    cfg = tiny_next_config()
    tables = context_gdn_tables(node, pred, context, CHUNK, cfg.linear_conv_kernel_dim)
    layer = GatedDeltaNet(cfg, tiny_runtime(), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    with jax.enable_x64(True):
        graphdef_64 = nnx.split(GatedDeltaNet(cfg, tiny_runtime(dtype="float64",
                                                                param_dtype="float64"),
                                              rngs=nnx.Rngs(0)))[0]
    graphdef_cp, _ = nnx.split(GatedDeltaNet(cfg, tiny_runtime(context_axis=AXIS),
                                             rngs=nnx.Rngs(0)))
    x = rng.normal(size=(1, S, cfg.hidden_size)).astype(np.float32)
    # A positive loss (sum of weighted squares), so that its relative difference is well defined.
    target = rng.uniform(0.5, 2.0, size=(1, S, cfg.hidden_size)).astype(np.float32)
    real = np.zeros(S, bool)
    real[where] = True
    target[:, ~real] = 0.0
    x_ref = np.zeros_like(x)
    x_ref[:, :n_real] = x[:, where]
    t_ref = np.zeros_like(target)
    t_ref[:, :n_real] = target[:, where]

    def ref_of(graphdef):
        def ref(params, x):
            routing = gdn_routing(jnp.asarray(batch.pred), batch.gdn, cfg.linear_conv_kernel_dim)
            out, _ = nnx.merge(graphdef, params)(x, routing)
            return jnp.sum(jnp.square(out) * t_ref), out
        return ref

    mesh = Mesh(np.array(jax.devices()[:context]), (AXIS,))
    tok = P(None, AXIS)

    def cp(params, x):
        def local(params, x, tgt, pr, ct, cs, ts, ex, halo):
            routing = gdn_routing(pr, GdnTables(ct, cs, ts, context_exports=ex, conv_halo=halo),
                                  cfg.linear_conv_kernel_dim, context_axis=AXIS)
            out, _ = nnx.merge(graphdef_cp, params)(x, routing)
            return jax.lax.psum(jnp.sum(jnp.square(out) * tgt), AXIS), out
        specs = (jax.tree.map(lambda _: P(), params),) + (tok,) * 8
        run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), tok))
        return run(params, x, target, pred, tables.chunk_tokens, tables.chunk_src,
                   tables.token_slot, tables.context_exports, tables.conv_halo)

    (l_ref, o_ref), (gp_ref, gx_ref) = jax.value_and_grad(
        ref_of(graphdef), argnums=(0, 1), has_aux=True)(params, x_ref)
    (l_cp, o_cp), (gp_cp, gx_cp) = jax.jit(jax.value_and_grad(cp, argnums=(0, 1), has_aux=True))(
        params, x)
    with jax.enable_x64(True):
        as_64 = functools.partial(jax.tree_util.tree_map, lambda a: np.asarray(a, np.float64))
        (l_64, o_64), (gp_64, gx_64) = jax.jit(jax.value_and_grad(
            ref_of(graphdef_64), argnums=(0, 1), has_aux=True))(as_64(params), as_64(x_ref))
    gx_cp = np.asarray(gx_cp)

    def named(loss, out, grad_x, grad_params) -> dict[str, Any]:
        """The layer's results by name, on the tokens of the row without gaps."""
        return {"layer_loss": loss, "layer_out": out, "layer_grad_x": grad_x, **{
            "layer_grad_" + jax.tree_util.keystr(path, simple=True, separator="."): g
            for path, g in jax.tree_util.tree_leaves_with_path(grad_params)}}

    got = named(l_cp, np.asarray(o_cp)[:, where], gx_cp[:, where], gp_cp)
    want, exact = (named(loss, np.asarray(out)[:, :n_real], np.asarray(gx)[:, :n_real], gp)
                   for loss, out, gx, gp in ((l_ref, o_ref, gx_ref, gp_ref),
                                             (l_64, o_64, gx_64, gp_64)))
    # The loss sums every output feature of every token: the longest sum.
    return {**{k: rel_l2(got[k], want[k]) for k in want},
            "leak": float(np.abs(gx_cp[:, ~real]).max(initial=0.0)),
            "rounding": {"layer": worst_rounding(got, want, exact, int(np.size(o_64)))}}


def _case(trees: list[TrajectoryTree], context: int, seed: int, per_channel: bool = False) -> dict:
    """The kernels on CASE's trees; `per_channel`: KDA's log decay per key channel, g [1, S, Hv,
    dk], instead of one per head."""
    rng = np.random.default_rng(seed)
    batch, where, node, pred = _gapped_row(trees, context, rng)
    n_real = len(where)
    tables = context_chunk_tables(node, pred, context, CHUNK)
    halo = conv_halo_positions(pred, context, KERNEL - 1)

    f32 = np.float32
    gdn_in = (rng.normal(size=(1, S, HK, DK)).astype(f32),
              rng.normal(size=(1, S, HK, DK)).astype(f32),
              rng.normal(size=(1, S, HV, DV)).astype(f32),
              -rng.uniform(0.0, 1.5, size=(1, S, HV) + (DK,) * per_channel).astype(f32),
              rng.uniform(size=(1, S, HV)).astype(f32))
    target = rng.normal(size=(1, S, HV, DV)).astype(f32)
    x = rng.normal(size=(1, S, D)).astype(f32)
    weight = rng.normal(size=(D, KERNEL)).astype(f32)
    x_target = rng.normal(size=(1, S, D)).astype(f32)

    # Reference: the rows without gaps, the sequential scan.
    ref_tables = batch.gdn
    real = np.zeros(S, bool)
    real[where] = True
    x_target[:, ~real] = 0.0  # a gap token's own conv output is never read (like padding's)

    def ungapped(a):
        out = np.zeros((1, S) + a.shape[2:], a.dtype)
        out[:, :n_real] = a[:, where]
        return out

    def ref_gdn(q, k, v, g, beta):
        o, _ = tree_gated_delta_rule(q, k, v, g, beta, chunk_tokens=ref_tables.chunk_tokens,
                                     chunk_src=ref_tables.chunk_src,
                                     token_slot=ref_tables.token_slot, scan="sequential")
        return jnp.sum(o * ungapped(target)), o

    (l_ref, o_ref), g_ref = jax.value_and_grad(ref_gdn, argnums=range(5), has_aux=True)(
        *(ungapped(a) for a in gdn_in))

    mesh = Mesh(np.array(jax.devices()[:context]), (AXIS,))
    tok = P(None, AXIS)

    def cp_gdn(q, k, v, g, beta):
        def local(q, k, v, g, beta, tgt, ct, cs, ts, ex):
            o = context_gated_delta_rule(q, k, v, g, beta, chunk_tokens=ct, chunk_src=cs,
                                         token_slot=ts, context_exports=ex, axis=AXIS)
            return jax.lax.psum(jnp.sum(o * tgt), AXIS), o
        run = jax.shard_map(local, mesh=mesh, in_specs=(tok,) * 10, out_specs=(P(), tok))
        return run(q, k, v, g, beta, target, tables.chunk_tokens, tables.chunk_src,
                   tables.token_slot, tables.context_exports)

    (l_cp, o_cp), g_cp = jax.jit(jax.value_and_grad(cp_gdn, argnums=range(5), has_aux=True))(
        *gdn_in)

    def ref_conv(x, w):
        out = tree_causal_conv1d(x, w, path_context(jnp.asarray(batch.pred), KERNEL - 1))
        return jnp.sum(out * ungapped(x_target))

    lc_ref, gc_ref = jax.value_and_grad(ref_conv, argnums=(0, 1))(ungapped(x), weight)

    def cp_conv(x, w):
        def local(x, w, tgt, pr, h):
            idx = context_conv_index(pr, h, KERNEL - 1, AXIS)
            out = tree_causal_conv1d(x, w, idx, context_conv_source(x, h, AXIS))
            return jax.lax.psum(jnp.sum(out * tgt), AXIS)
        run = jax.shard_map(local, mesh=mesh, in_specs=(tok, P(), tok, tok, tok), out_specs=P())
        return run(x, w, x_target, pred, halo)

    lc_cp, gc_cp = jax.jit(jax.value_and_grad(cp_conv, argnums=(0, 1)))(x, weight)
    # The float64 values of the single-device kernels.
    with jax.enable_x64(True):
        (l_64, o_64), g_64 = jax.jit(jax.value_and_grad(ref_gdn, argnums=range(5),
                                                        has_aux=True))(
            *(ungapped(a).astype(np.float64) for a in gdn_in))
        lc_64, gc_64 = jax.jit(jax.value_and_grad(ref_conv, argnums=(0, 1)))(
            ungapped(x).astype(np.float64), weight.astype(np.float64))

    names = ("q", "k", "v", "g", "beta")

    def named(gdn_loss, o, grads, conv_loss, conv_grads, gapped: bool) -> dict[str, Any]:
        """The kernels' results by name, on the tokens of the row without gaps (`gapped`: picked
        from the gapped row)."""
        def tokens(a):
            return np.asarray(a)[:, where] if gapped else np.asarray(a)[:, :n_real]
        return {"gdn_loss": gdn_loss, "gdn_out": tokens(o),
                **{f"gdn_grad_{n}": tokens(g) for n, g in zip(names, grads)},
                "conv_loss": conv_loss, "conv_grad_x": tokens(conv_grads[0]),
                "conv_grad_w": conv_grads[1]}

    got = named(l_cp, o_cp, g_cp, lc_cp, gc_cp, True)
    want, exact = (named(*r, False) for r in ((l_ref, o_ref, g_ref, lc_ref, gc_ref),
                                              (l_64, o_64, g_64, lc_64, gc_64)))
    # Each kernel's loss sums every output feature of every token: its longest sum.
    rounding = {kernel: worst_rounding(*({k: v for k, v in d.items() if k.startswith(kernel)}
                                         for d in (got, want, exact)), n)
                for kernel, n in (("gdn", np.size(o_64)), ("conv", np.size(x)))}
    ncl = tables.chunk_src.shape[1] // context
    src = np.asarray(tables.chunk_src)[0]
    linked = src > 0
    chunk_dev = np.arange(len(src))[linked] // ncl
    parent_dev = (src[linked] - 1) // ncl
    return {
        # How far back the farthest parent chunk lives, and how many devices start a chunk
        # from another device's state: what the case exercises.
        "parent_distance": int((chunk_dev - parent_dev).max(initial=0)),
        "crossing_devices": len(np.unique(chunk_dev[chunk_dev != parent_dev])),
        "chunks_per_device": int(ncl),
        "exports_per_device": int(tables.context_exports.shape[1] // context),
        "halo_per_device": int(halo.shape[1] // context),
        # The direct differences to the single-device float32 kernels (the old 1e-5 checks).
        **{k: rel_l2(got[k], want[k]) for k in want},
        # Gap tokens are no tokens: their outputs and gradients are zeros.
        "leak": max(float(np.abs(np.asarray(a)[:, ~real]).max(initial=0.0))
                    for a in (o_cp, *g_cp, gc_cp[0])),
        "rounding": rounding,
    }


def main(args: list[str]) -> None:
    """Arguments: CASE:DEVICES ... (e.g. chain:8 random0:2; layer_CASE:DEVICES runs the
    GatedDeltaNet layer on CASE's trees, kda_CASE:DEVICES the kernels with KDA's per-channel
    decays)."""
    for arg in args:
        name, devices = arg.split(":")
        if name.startswith("layer_"):
            run = _layer_case
        else:
            run = functools.partial(_case, per_channel=name.startswith("kda_"))
        trees = CASES[name.removeprefix("layer_").removeprefix("kda_")]()
        result = run(trees, int(devices), seed=int(devices))
        print(json.dumps({"case": name, "devices": int(devices), **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
