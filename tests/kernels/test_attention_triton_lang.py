"""The Triton-language kernels of `triton_lang`, checked without a GPU:

- numerics in Triton's CPU interpreter (the `@triton.jit` functions run by
  `triton.runtime.interpreter.InterpretedFunction` on torch CPU tensors, driven here as
  `triton_lang` drives them through jax-triton): forward output and q/k/v gradients against the
  dense `attention_reference` (float32, on the same rounded inputs) on branching multi-row
  forests, GQA, a prefix (rectangular queries), soft-cap, a sliding window, MLA head dims;
  tolerances those of the `pallas_triton` tests (relative to each array's largest reference
  magnitude: 1e-5 float32, 4 units of rounding for bf16);
- the forward kernel compiles with Triton's own compiler for sm_80 (no GPU needed);
- forward + backward lower for CUDA through `jax_triton.triton_call` (needs jax's CUDA plugin on
  the path: skipped with the reason otherwise);
- the entry point refuses what the implementation does not run, naming it.
"""

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels import TreeMask, tree_attention
from jtree.kernels.attention import triton_lang
from jtree.kernels.attention.reference import attention_reference
from jtree.kernels.block_tables import block_tables
from tests.attention_cases import qkv, tree_end
from tests.window_cases import tree_end_pos

pytest.importorskip("triton", reason="the `gpu` extra (triton) is not installed")

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 4 * 2.0 ** -8, jnp.float16: 4 * 2.0 ** -11}


def interpreter_call(q, k, v, end, d_out, *, scale, q_pos=None, softcap=None, window=None,
                     key_pos=None, block_q=16, block_kv=16) -> dict:
    """One call of `tests/triton_interpreter.py`: the inputs and launches `triton_lang` gives the
    three kernels for these operands (block tables, positions, `launch_specs`)."""
    rows, sq = q.shape[:2]
    tables = block_tables(end, block_q, block_kv, q_pos=q_pos, window=window, key_pos=key_pos)
    if q_pos is None:
        q_pos = np.broadcast_to(np.arange(sq, dtype=np.int32), (rows, sq))
    k_path = np.zeros(end.shape, np.int32) if window is None else np.asarray(key_pos, np.int32)
    q_path = q_pos if window is None else np.take_along_axis(k_path, q_pos, axis=1)
    cfg = triton_lang.Config(scale, softcap, block_q, block_kv, window, 4, 2, None)
    specs = triton_lang.launch_specs(q.shape, k.shape, v.shape[3], q.dtype, cfg,
                                     tables.kv_blocks.shape[2], tables.q_blocks.shape[2])
    arrays = dict(q=q, k=k, v=v, do=jnp.asarray(d_out, q.dtype), end=end, q_pos=q_pos,
                  q_path=q_path, k_path=k_path, kv_blocks=tables.kv_blocks,
                  kv_count=tables.kv_count, q_blocks=tables.q_blocks, q_count=tables.q_count)
    return dict(kernels_file=kernels_file(), dtype=jnp.dtype(q.dtype).name,
                specs={name: (spec.grid, spec.constants) for name, spec in specs.items()},
                arrays={name: np.asarray(jnp.asarray(x).astype(
                    jnp.float32 if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
                    else jnp.int32)) for name, x in arrays.items()})


def kernels_file() -> str:
    spec = importlib.util.find_spec("jtree.kernels.attention.triton_lang_kernels")
    return spec.origin


def interpret(calls: list[dict], tmp_path) -> list[dict]:
    """Run `calls` in one interpreter process (TRITON_INTERPRET=1; see tests/triton_interpreter.py)
    and return their (out, dq, dk, dv)."""
    inputs, outputs = tmp_path / "calls.pkl", tmp_path / "results.pkl"
    inputs.write_bytes(pickle.dumps(calls))
    worker = Path(__file__).parents[1] / "triton_interpreter.py"
    done = subprocess.run([sys.executable, str(worker), str(inputs), str(outputs)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return pickle.loads(outputs.read_bytes())


def reference(q, k, v, end, d_out, *, scale, q_pos=None, softcap=None, window=None,
              key_pos=None):
    """(out, dq, dk, dv) of the dense reference in float32 on the same (rounded) inputs."""
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    out, vjp = jax.vjp(lambda q, k, v: attention_reference(
        q, k, v, jnp.asarray(end), scale=scale, softcap=softcap, q_pos=q_pos, window=window,
        key_pos=key_pos), *f32)
    return [np.asarray(x) for x in (out, *vjp(jnp.asarray(d_out, jnp.float32)))]


def case(end, hq, hkv, d, dtype, *, dv=None, prefix=0, queries=None, softcap=None, window=None,
         key_pos=None, **blocks) -> tuple[dict, list[np.ndarray], float]:
    """(interpreter call, reference (out, dq, dk, dv), tolerance) of the own queries (after
    `prefix` cached keys) of the layout `end`; with `queries`, only that many from `prefix` on
    (context parallelism's window: keys after the last query too)."""
    rows, s = end.shape
    assert rows >= 2 and (np.diff(end, axis=1) < 0).any()  # several rows, real branching
    q, k, v = qkv(d + hq, rows, s, hq, hkv, d, dtype, dv=dv)
    q_pos = None
    if prefix or queries:
        stop = s if queries is None else prefix + queries
        q = q[:, prefix:stop]
        q_pos = np.broadcast_to(np.arange(prefix, stop, dtype=np.int32), (rows, stop - prefix))
    d_out = np.random.default_rng(1).normal(size=(*q.shape[:3], v.shape[3])).astype(np.float32)
    kw = dict(scale=d ** -0.5, q_pos=q_pos, softcap=softcap, window=window, key_pos=key_pos)
    return (interpreter_call(q, k, v, end, d_out, **kw, **blocks),
            reference(q, k, v, end, d_out, **kw), TOLERANCE[dtype])


def check(cases: list, tmp_path) -> None:
    """Every case's kernel results within its tolerance of the reference (relative to each
    array's largest reference magnitude)."""
    results = interpret([call for call, _, _ in cases], tmp_path)
    for (call, want, tolerance), got in zip(cases, results):
        errors = [float(np.max(np.abs(got[n] - w)) / np.max(np.abs(w)))
                  for n, w in zip(("out", "dq", "dk", "dv"), want)]
        assert max(errors) <= tolerance, (call["dtype"], errors)


def test_interpreter_matches_reference(tmp_path):
    """Branching forests in several rows (and a padding row), blocks of 16: GQA 2 with a soft-cap
    in float32; GQA 2 in bf16 with queries after 16 cached prefix keys (rectangular block tables)
    and key blocks of 32; GQA 2 over 2 kv heads with a window of 9 path tokens; a context-parallel
    window (queries 16-47 of 64 keys: keys before and after them) in float32."""
    end, pos = tree_end_pos(5, 64)
    check([case(tree_end(seed=6, s=64, max_nodes=8, max_seg=10), 2, 1, 16, jnp.float32,
                softcap=20.0),
           case(end, 2, 1, 16, jnp.bfloat16, prefix=16, block_kv=32),
           case(end, 4, 2, 16, jnp.float32, window=9, key_pos=pos),
           case(end, 2, 1, 16, jnp.float32, prefix=16, queries=32)], tmp_path)


@pytest.mark.slow
def test_interpreter_sweep(tmp_path):
    """Larger head dims, Dv != Dk (MLA-shaped), float16 with a soft-cap, GQA 4 in bf16, 8 q
    heads, S = 96."""
    end = tree_end(seed=9, s=96, max_nodes=10, max_seg=12)
    check([case(end, 2, 1, 64, jnp.float16, dv=32, softcap=30.0),
           case(end, 4, 1, 32, jnp.bfloat16),
           case(end, 8, 2, 64, jnp.float32, block_q=32, block_kv=16)], tmp_path)


def test_forward_compiles_for_sm80():
    """Triton's own compiler, deviceless, for an explicit sm_80 target (bf16, head dim 64): PTX
    with tensor-core matmuls, a cubin from Triton's ptxas, and its register count."""
    pytest.importorskip("triton.backends.nvidia.compiler",
                        reason="this triton has no NVIDIA backend to compile with")
    from jtree.launch.bench.triton_lang_compile import compile_one

    usage = compile_one("forward", 64, "bfloat16", 64, 64, num_warps=4, num_stages=2,
                        capability=80)
    assert usage["arch"] == "sm_80" and 0 < usage["registers"] <= 255
    assert 0 < usage["shared_bytes"] <= 164 * 1024  # an A100 SM's shared memory


def test_forward_and_backward_lower_for_cuda(tmp_path):
    """Forward + backward of `tree_attention(impl="triton_lang")` (GQA, soft-cap, window, sinks; MLA
    192/128 with a prefix; inside `shard_map`) lower for CUDA through jax_triton.triton_call from
    this host: three Triton kernel calls (forward, dQ, dK/dV), each compiled to PTX for sm_80 while
    lowering; and at a traced query offset (context parallelism). Runs in a worker with jax's CUDA plugin on its path: jax-triton does not import
    without it."""
    from jtree.launch.compile import PLUGINS_ABSENT, in_worker

    out = tmp_path / "lowered.json"
    rc = in_worker("jtree.launch.bench.triton_lang_compile", ["--lower", "80", "--out", str(out)],
                   "gpu-a100x8", tmp_path / "worker.log", timeout=600)
    if rc == PLUGINS_ABSENT:
        pytest.skip("jax's CUDA plugin is not installed (make aot-plugins)")
    assert rc == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert json.loads(out.read_text())["triton_calls"] == {
        "window+sinks": 3, "mla 192/128 + prefix": 3, "shard_map": 3, "context offset": 3}


@pytest.mark.parametrize("options, match", [
    (dict(head_dim=24), "head_dim=24 must be a power of two"),
    (dict(block_q=8), "block_q=8 must be a power of two >= 16"),
    (dict(dtype=jnp.int8), "float32, bfloat16 or float16"),
])
def test_refusals_name_the_limit(options, match):
    d = options.pop("head_dim", 32)
    dtype = options.pop("dtype", jnp.float32)
    q, k, v = (jnp.zeros((1, 64, 2, d), dtype) for _ in range(3))
    end = np.arange(1, 65, dtype=np.int32)[None]
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, TreeMask(end), impl="triton_lang", **options)


def test_without_jax_triton_the_call_names_the_extra(monkeypatch):
    """No silent fallback when jax-triton cannot be imported (not installed, or a jax without
    CUDA support): the call raises naming the `gpu` extra."""
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # makes `import jax_triton` fail
    q, k, v = (jnp.zeros((1, 64, 2, 32)) for _ in range(3))
    with pytest.raises(ValueError, match=r"'triton_lang' needs jax-triton .* 'jtree\[gpu\]'"):
        tree_attention(q, k, v, TreeMask(np.arange(1, 65, dtype=np.int32)[None]),
                       impl="triton_lang")
