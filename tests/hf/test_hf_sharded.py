"""Loading onto a device mesh (8 host CPU devices), and jtree.hf working without torch, for Qwen3
and Qwen3-Next (whose table covers Qwen3-MoE's experts too).

XLA_FLAGS must be set before jax creates its CPU client, which in a full pytest run has already
happened, so the check runs in a fresh interpreter.
"""

import os
import subprocess
import sys

from tests.run_util import WORKTREE, xla_flags

# The train step's rules (jtree/parallel/sharding.py), written out independently, for Qwen3 and Qwen3-Next
# (MoE experts, Gated DeltaNet, gated attention, shared expert). The tiny models have 2 kv heads,
# fewer than the 4-way model axis, so k/v are replicated (each device keeps the head it reads).
MESH_CHECKS = r'''
import sys, tempfile
import jax, numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jtree.hf
from jtree.layout.linearize import linearize
from jtree.trees.tree import TrajectoryTree
from tests.models_util import tiny_config, tiny_lm, tiny_runtime

assert jax.device_count() == 8, jax.devices()

def expected_spec(name):
    leaf = name.split(".")
    if leaf[-2] == "experts":
        return P("model", None, None)  # whole experts per device
    if leaf[-2] in ("in_proj_qkvz", "in_proj_ba"):
        return P(None, "model")
    if leaf[-1] in ("dt_bias", "A_log"):
        return P("model")
    if leaf[-2] == "out_proj":
        return P("model", None)
    if name == "model.embed_tokens.embedding":
        return P("model", None)
    if name == "lm_head.kernel":
        return P(None, "model")
    if leaf[-2] in ("k_proj", "v_proj"):
        return P()
    if leaf[-2] in ("q_proj", "gate_proj", "up_proj"):
        return P(None, "model") if leaf[-1] == "kernel" else P("model")
    if leaf[-2] in ("o_proj", "down_proj") and leaf[-1] == "kernel":
        return P("model", None)
    return P()  # norms, conv1d, router, shared-expert gate

def params(model):
    return {".".join(map(str, p)): v.get_value()
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
'''

SCRIPT = MESH_CHECKS + r'''
cfg = tiny_config(tie_word_embeddings=False, attention_bias=True)
with tempfile.TemporaryDirectory() as d:
    jtree.hf.save(tiny_lm(cfg, 0), cfg, d)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    _, plain = jtree.hf.load(d, tiny_runtime())
    _, sharded = jtree.hf.load(d, tiny_runtime(), mesh=mesh)
    n_split = 0
    for name, value in params(sharded).items():
        want = NamedSharding(mesh, expected_spec(name))
        assert value.sharding.is_equivalent_to(want, value.ndim), (name, value.sharding)
        n_split += any(a is not None for a in expected_spec(name))
        np.testing.assert_array_equal(np.asarray(value), np.asarray(params(plain)[name]))
    assert n_split == 2 * 5 + 2 + 2 * 1, n_split  # per layer: 5 kernels, q bias; embed + head

    # The sharded model computes what the unsharded one does.
    batch = linearize([TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])], 16).inputs
    def hidden(model):
        g, p = nnx.split(model)
        return np.asarray(jax.jit(lambda p, x: nnx.merge(g, p)(x).hidden)(p, batch))
    np.testing.assert_allclose(hidden(sharded), hidden(plain), atol=1e-5, rtol=0)

    # Any sharding per parameter.
    replicated = NamedSharding(mesh, P())
    _, rep = jtree.hf.load(d, shardings=lambda name, shape: replicated)
    assert all(v.sharding.is_fully_replicated for v in params(rep).values())

    # An FSDP mesh: the same rules, every parameter of 2+ dimensions also split over `fsdp`.
    fsdp_mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "model"))
    _, fsdp = jtree.hf.load(d, tiny_runtime(), mesh=fsdp_mesh)
    for name, value in params(fsdp).items():
        assert (value.ndim >= 2) == ("fsdp" in value.sharding.spec), (name, value.sharding)
        np.testing.assert_array_equal(np.asarray(value), np.asarray(params(plain)[name]))

    # Errors name the parameter or the axis.
    try:
        jtree.hf.load(d, mesh=Mesh(np.array(jax.devices()).reshape(8), ("data",)))
        raise AssertionError("no error")
    except ValueError as e:
        assert "lm_head/kernel" in str(e) and "no axis 'model'" in str(e), e
with tempfile.TemporaryDirectory() as d:
    odd = tiny_config(vocab_size=90, tie_word_embeddings=True)
    jtree.hf.save(tiny_lm(odd, 0), odd, d)
    try:
        jtree.hf.load(d, mesh=mesh)
        raise AssertionError("no error")
    except ValueError as e:
        assert "must divide vocab_size (90)" in str(e), e

# Load and save never needed torch or transformers.
assert "torch" not in sys.modules and "transformers" not in sys.modules
print("OK")
'''


# Qwen3-Next with a dense MLP layer: the 4 GDN key heads split one per device (the rules refuse
# a split that would cut a key head's group of columns).
SCRIPT_NEXT = MESH_CHECKS + r'''
from jtree.models import Qwen3NextConfig

cfg = Qwen3NextConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,),
                      layer_types=("linear_attention", "full_attention", "linear_attention"),
                      linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=4,
                      linear_num_value_heads=8, shared_expert_intermediate_size=24,
                      tie_word_embeddings=False)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

with tempfile.TemporaryDirectory() as d:
    jtree.hf.save(tiny_lm(cfg, 0), cfg, d)
    _, plain = jtree.hf.load(d, tiny_runtime())
    _, sharded = jtree.hf.load(d, tiny_runtime(), mesh=mesh)
splits = {}
for name, value in params(sharded).items():
    want = NamedSharding(mesh, expected_spec(name))
    assert value.sharding.is_equivalent_to(want, value.ndim), (name, value.sharding)
    splits[name.split(".")[-2]] = any(a is not None for a in expected_spec(name))
    np.testing.assert_array_equal(np.asarray(value), np.asarray(params(plain)[name]))
assert splits["experts"] and splits["in_proj_qkvz"] and splits["q_proj"], splits

# The sharded model computes what the unsharded one does.
trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [1, 7]])]
batch = linearize(trees, 16, gdn_chunk_size=4).inputs
def hidden(model):
    g, p = nnx.split(model)
    return np.asarray(jax.jit(lambda p, x: nnx.merge(g, p)(x).hidden)(p, batch))
np.testing.assert_allclose(hidden(sharded), hidden(plain), atol=1e-5, rtol=0)
assert "torch" not in sys.modules and "transformers" not in sys.modules
print("OK")
'''


def _run_on_8_devices(script: str) -> None:
    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(WORKTREE))
    proc = subprocess.run([sys.executable, "-c", script], cwd=WORKTREE, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_load_places_parameters_on_a_mesh_without_torch():
    _run_on_8_devices(SCRIPT)


def test_load_places_qwen3_next_experts_and_gdn_on_a_mesh():
    _run_on_8_devices(SCRIPT_NEXT)
