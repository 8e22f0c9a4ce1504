"""The gradient of an SFT + MTP objective (`jtree.models.mtp`, depth 2) over a (data, fsdp,
model) = (2, 2, 2) mesh of 8 forced host devices against one device, held to the error model of
`tests.models_util.worst_rounding` (each float32 result against the float64 single-device one).

Run in a subprocess (`tests/models/test_mtp.py`): XLA_FLAGS must be set before jax creates its CPU
backend. Prints one JSON line: the worst loss, MTP loss and gradient results past their bounds.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import dataclasses
import json

import jax
import numpy as np
from flax import nnx

from jtree.config.objective import Objective
from jtree.config.run import MeshConfig
from jtree.layout.batch import stack
from jtree.layout.linearize import linearize
from jtree.models import CausalLM
from jtree.parallel.sharding import make_mesh, named, param_rules, param_specs
from jtree.step.train_step import make_grad_fn, make_sharded_grad_fn, sharded_graphdef
from tests.models_util import perturbed, tiny_config, tiny_runtime, worst_rounding
from tests.strategies import seeded_forests

S, ROWS, DEPTH = 64, 8, 2
CONFIG = tiny_config(vocab_size=64)
OBJECTIVE = Objective(kind="sft", mtp_weight=0.7, mtp_depth=DEPTH)


def grads(runtime, params, inputs):
    graphdef = nnx.split(CausalLM(CONFIG, runtime, rngs=nnx.Rngs(0), mtp_depth=DEPTH))[0]
    loss, metrics, g = jax.jit(make_grad_fn(graphdef, OBJECTIVE))(params, inputs)
    return loss, metrics, g


def named_leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def main() -> None:
    model = CausalLM(CONFIG, tiny_runtime(), rngs=nnx.Rngs(3), mtp_depth=DEPTH)
    params = perturbed(nnx.split(model)[1], scale=0.2)
    trees = seeded_forests(6, seed=7, max_nodes=8, max_seg=5, vocab=CONFIG.vocab_size)
    inputs = stack([linearize(trees, S, n_rows=ROWS).inputs])
    loss, metrics, g = grads(tiny_runtime(), params, inputs)
    with jax.enable_x64(True):
        runtime64 = dataclasses.replace(tiny_runtime(), dtype="float64", param_dtype="float64")
        params64 = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
        exact = jax.tree_util.tree_map(np.asarray, grads(runtime64, params64, inputs))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, context=1, model=2), jax.devices()[:8])
    specs = param_specs(params, param_rules(CONFIG, 2), mesh)
    graphdef = sharded_graphdef(model, specs, mesh)
    m_loss, m_metrics, m_g = jax.jit(make_sharded_grad_fn(graphdef, OBJECTIVE, mesh, specs))(
        jax.device_put(params, named(mesh, specs)), inputs)
    n = int(np.prod(inputs.shape))
    scalars = [{"loss": a, "mtp_nll": b["mtp_nll"]} for a, b in
               ((m_loss, m_metrics), (loss, metrics), (exact[0], exact[1]))]
    print(json.dumps({
        "mtp_nll": float(m_metrics["mtp_nll"]),
        "scalars": worst_rounding(*scalars, n),
        "grads": worst_rounding(named_leaves(m_g), named_leaves(g), named_leaves(exact[2]), n),
    }, default=float))


if __name__ == "__main__":
    main()
