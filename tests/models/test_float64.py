"""`runtime.dtype = "float64"`: the tests' exact reference (`tests.models_util.rounding_bound`)
is float64 end to end, and is refused where it would silently not be.

A float32 result's rounding error is measured against this run; one float32 cast inside it (a
norm, a softmax, a matmul's accumulator) would make the reference itself float32-accurate at that
point, so no traced operation may turn a float64 operand into a float32 result.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import source_info_util  # private: only to name a demotion's line

from jtree.config.objective import CriticConfig, Objective
from jtree.config.runtime import RuntimeConfig
from jtree.layout.batch import stack
from jtree.layout.linearize import linearize
from jtree.models import create_model
from jtree.objectives.pairs import with_pairs
from jtree.step.train_step import make_grad_fn
from tests.models_util import tiny_config, tiny_gpt_oss_config, tiny_next_config
from tests.strategies import explicit_tree, random_forest

FLOAT64 = {"dtype": "float64", "param_dtype": "float64", "attention_impl": "reference"}
MODELS = {"next": ("qwen3_next", tiny_next_config()),
          "gpt_oss": ("gpt_oss", tiny_gpt_oss_config()), "dense": ("qwen3", tiny_config())}


def demotions(jaxpr: jax.extend.core.Jaxpr) -> list[str]:
    """The operations of `jaxpr` (and of the jaxprs inside it) that take a float64 array and give
    a float32 result: the primitive and its source line. (Python numbers are weakly typed float64
    under x64 and take the other operand's dtype: not counted.)"""
    found = []
    for eqn in jaxpr.eqns:
        subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
        for sub in subs:
            found += demotions(sub)
        ins = {str(v.aval.dtype) for v in eqn.invars
               if hasattr(v.aval, "dtype") and not getattr(v.aval, "weak_type", False)}
        outs = {str(getattr(v.aval, "dtype", "")) for v in eqn.outvars}
        if not subs and "float64" in ins and "float32" in outs:
            frame = source_info_util.user_frame(eqn.source_info.traceback)
            found.append(f"{eqn.primitive} at {frame.file_name}:{frame.start_line}")
    return found


@pytest.mark.parametrize("kind", ["next", "gpt_oss", "dense"])
def test_a_float64_step_computes_in_float64(kind):
    # Qwen3-Next (Gated DeltaNet, MoE router, gated norms), gpt-oss (sinks, windows, YaRN) and
    # Qwen3 with a value head (PPO's critic): the gradient of the loss, traced only.
    arch, cfg = MODELS[kind]
    critic = CriticConfig(gamma=0.95, lam=0.9) if kind == "dense" else None
    objective = Objective(kind="ppo", normalization="token_mean", critic=critic)
    rng = np.random.default_rng(0)
    forests = [random_forest(rng, max_nodes=6) for _ in range(4)]
    for f in forests:
        f["rewards"] = rng.normal(size=len(f["path_nodes"])).tolist()
    chunk = 4 if cfg.decoder().needs_gdn_tables else None
    batch = linearize([explicit_tree(f) for f in forests], 64, gdn_chunk_size=chunk,
                      gdn_chunks=64 if chunk else None)
    inputs = stack([with_pairs(batch, 64, critic=True).inputs if critic else batch.inputs])
    with jax.enable_x64(True):
        runtime = RuntimeConfig(**FLOAT64)
        graphdef, params = nnx.split(create_model(arch, cfg, runtime, seed=0,
                                                  value_head=critic is not None))
        assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype("float64")}
        grad_fn = make_grad_fn(graphdef, objective)
        assert not demotions(jax.make_jaxpr(grad_fn)(params, inputs).jaxpr)
        loss, _, grads = jax.eval_shape(grad_fn, params, inputs)
    assert {x.dtype for x in [loss, *jax.tree_util.tree_leaves(grads)]} == {np.dtype(np.float64)}


def test_float64_is_refused_where_it_would_be_float32():
    with pytest.raises(ValueError, match=r"dtype float64 runs the 'reference' attention only"):
        RuntimeConfig(dtype="float64", attention_impl="xla")
    runtime = RuntimeConfig(**FLOAT64)
    with pytest.raises(ValueError, match=r"dtype float64 needs jax_enable_x64"):
        _ = runtime.compute_dtype
    with jax.enable_x64(True):
        assert np.dtype(runtime.compute_dtype) == np.float64
