"""Compare the token-dispatch MoE block on meshes of 8 forced host devices with one device.

Run in a subprocess (`tests/models/test_moe_dispatch.py`); importing `tests.mesh_worker` first sets
its XLA flags (8 host devices), and train-step cases are that module's. A layer case is
`layer:KIND:ROUTING:SHARDS[:DISPATCH[:MATMUL]]`: KIND `moe` (Qwen3-MoE block), `shared` (Qwen3-Next's, with the
Megatron-split shared expert) or `gptoss` (gpt-oss's: biased router and experts, clamped
SwiGLU), ROUTING `random`, `uneven` (the router biased so that almost
every assignment goes to the first expert shard) or `replay` (routing replay: random engine
experts given for two tokens in three, the others routed by the router), on a ('data', 'model') mesh of 8 / SHARDS x
SHARDS devices with the block's experts split over `model` and run with
`expert_dispatch` DISPATCH (default "all_to_all") and `expert_matmul` MATMUL (default "auto"; the
single-device block always runs `ragged_dot`). The loss is a fixed projection of the output plus the router
load-balancing loss (token-weighted, pooled over the data shards); 7 tokens per row, so 14 tokens
per data shard, which 4 expert shards split with padding. Prints one JSON line per case: the
largest relative differences of the output, router probabilities, loss, and every gradient
(parameters and input) to the single-device block, the routed experts' equality and the share of
assignments that went to the first shard.
"""

from __future__ import annotations

import json
import sys

from tests import mesh_worker  # noqa: F401  (sets XLA_FLAGS before jax starts its backend)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jtree.models.decoder import feed_forward
from jtree.models.moe import load_balancing_loss
from jtree.parallel.sharding import DATA, LAYER_KIND_RULES, MODEL, make_mesh, param_specs
from jtree.config.run import MeshConfig
from tests.models_util import (  # noqa: E402
    perturbed,
    rel_l2,
    tiny_gpt_oss_config,
    tiny_moe_config,
    tiny_next_config,
    tiny_runtime,
)

ROWS_PER_SHARD, S = 2, 7


class Layer(nnx.Module):
    """Holds the block as `mlp`, the name the sharding rules match in a decoder layer."""

    def __init__(self, cfg, runtime, ffn: str):
        self.mlp = feed_forward(cfg, runtime, ffn, cfg.decoder(), rngs=nnx.Rngs(0))


def layer_case(case: str) -> dict:
    _, kind, routing, shards, *how = case.split(":")
    dispatch = how[0] if how else "all_to_all"
    matmul = how[1] if len(how) > 1 else "auto"
    shards = int(shards)
    ffn = {"moe": "moe", "shared": "moe_shared", "gptoss": "moe"}[kind]
    cfg = {"moe": tiny_moe_config, "shared": tiny_next_config,
           "gptoss": tiny_gpt_oss_config}[kind]()
    experts, hidden = cfg.num_experts, cfg.hidden_size
    graphdef, params = nnx.split(Layer(cfg, tiny_runtime(), ffn))
    params = perturbed(params, scale=0.5)
    data = 8 // shards
    keys = jax.random.split(jax.random.key(5), 3)
    shape = (data * ROWS_PER_SHARD, S, hidden)
    x = jax.random.normal(keys[0], shape)
    if routing == "uneven":  # the first shard's experts win for almost every token
        x = x.at[..., 0].add(4.0)
        params["mlp"]["gate"]["weight"].value = (
            params["mlp"]["gate"]["weight"][...].at[:experts // shards, 0].add(4.0))
    ct = jax.random.normal(keys[1], shape)
    weight = jax.random.randint(keys[2], shape[:2], 0, 3).astype(jnp.float32)
    # The replayed experts (-1 throughout: every token routed by the router).
    replay = np.full((*shape[:2], cfg.num_experts_per_tok), -1, np.int32)
    if routing == "replay":
        rng = np.random.default_rng(0)
        for idx in np.ndindex(*shape[:2]):
            if rng.random() < 2 / 3:
                replay[idx] = rng.choice(experts, cfg.num_experts_per_tok, replace=False)

    def loss_fn(graph, data_axis):
        """Loss and, as aux, the block's output and routing."""
        def loss(p, x, ct, weight, replay):
            out, stats = nnx.merge(graph, p).mlp(x, replay)
            total = jnp.sum(out * ct) + load_balancing_loss([stats], weight, experts, data_axis)
            if data_axis is not None:
                total = jax.lax.psum(total, data_axis)
            return total, (out, stats.probs, stats.top_experts)
        return loss

    def value_and_grad(loss):
        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))

    args = (params, x, ct, weight, jnp.asarray(replay))
    (want_loss, want_fwd), want_grads = value_and_grad(loss_fn(graphdef, None))(*args)

    mesh = make_mesh(MeshConfig(data=data, model=shards))
    specs = param_specs(params, LAYER_KIND_RULES[ffn](cfg, shards), mesh)
    runtime = tiny_runtime(tensor_parallel_axis=MODEL, data_parallel_axis=DATA,
                           expert_dispatch=dispatch, expert_matmul=matmul)
    tp_graph = nnx.split(nnx.eval_shape(lambda: Layer(cfg, runtime, ffn)))[0]
    rows = P(DATA)
    sharded_loss = jax.shard_map(loss_fn(tp_graph, DATA), mesh=mesh,
                                 in_specs=(specs, rows, rows, rows, rows),
                                 out_specs=(P(), (rows, rows, rows)))
    (got_loss, got_fwd), got_grads = value_and_grad(sharded_loss)(*args)

    top = np.asarray(want_fwd[2])
    leaves = jax.tree_util.tree_leaves
    return {
        "case": case,
        "out_rel_l2": rel_l2(got_fwd[0], want_fwd[0]),
        "probs_rel_l2": rel_l2(got_fwd[1], want_fwd[1]),
        "same_experts": bool(np.array_equal(np.asarray(got_fwd[2]), top)),
        "loss_rel": abs(float(got_loss) - float(want_loss)) / abs(float(want_loss)),
        "grads_rel_l2": max(rel_l2(a, b) for a, b in zip(leaves(got_grads), leaves(want_grads))),
        "first_shard_share": float(np.mean(top < experts // shards)),
        "sharded_leaves": int(sum(not s.is_fully_replicated for s in leaves(jax.tree.map(
            lambda a: a.sharding, got_grads[0])))),
    }


def main(cases: list[str]) -> None:
    layers = [c for c in cases if c.startswith("layer:")]
    for case in layers:
        print(json.dumps(layer_case(case)), flush=True)
    mesh_worker.main([c for c in cases if c not in layers])


if __name__ == "__main__":
    main(sys.argv[1:])
