"""How a model runs, as opposed to what it is: kernels, dtypes, rematerialization, mesh axes.

An architecture config (`jtree.config.architectures`) holds only what a Hugging Face config.json
holds; everything here can change between runs of the same checkpoint without changing the
math beyond rounding, and is never written to or read from config.json.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jtree.config.schema import Domain, check_domains, within
from jtree.kernels import available_impls
from jtree.kernels.gdn.delta_rule import GDN_SCANS
from jtree.kernels.grouped_matmul import GROUPED_MATMULS

# "float64" is for checking numerics, not for training: the tests run a single-device step in
# float64 as the exact value their float32 comparisons measure rounding against (the kernels
# accumulate in `jtree.kernels.precision.accumulation_dtype`, float64 for float64 operands). It
# needs jax_enable_x64 (without it jax makes float64 arrays float32) and the `reference`
# attention (the other attention kernels compute in float32).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "float64": jnp.float64}


# Activation rematerialization policies by name (`jtree.models.layers.REMAT_POLICIES` maps them
# to jax checkpoint policies).
REMAT_POLICY_NAMES = ("none", "full", "dots", "dots_no_batch")


EXPERT_DISPATCHES = ("psum", "all_to_all")


# CUDA compute capabilities as jax-triton takes them: major * 10 + minor (80, 90, 100).
_COMPUTE_CAPABILITY = Domain(low=10)

@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """`attention_impl` selects the `jtree.kernels.tree_attention` implementation; `dtype` is the
    compute dtype and `param_dtype` the storage dtype of the weights. `remat` is the activation
    rematerialization policy of each decoder layer (`REMAT_POLICIES`, or "none"). `gdn_scan` is how
    the Gated DeltaNet layers route states over the tree's chunks (`jtree.kernels.gdn.delta_rule.pick_scan`:
    "sequential", "parallel", or "auto" to pick by the documented rule). `scan_layers` stacks the
    decoder layers and runs each repeated block of them with one `jax.lax.scan`
    (`jtree.parallel.layer_stack`), so compile time and program size do not grow with depth; the math is
    the same, and checkpoints convert between the two layouts when loaded. It lives here, not
    in the model config, because it does not change the model.

    `tensor_parallel_axis` and `data_parallel_axis` are set by
    `jtree.step.train_step.sharded_graphdef` for the copy of the model that runs inside
    `shard_map`: weights are then this device's shard and partial sums are reduced over the
    tensor-parallel axis, and batch statistics (the MoE router loss) are pooled over the
    data-parallel axes (every axis the rows are split over: `data` and `fsdp`). Leave them unset
    everywhere else. (Which weights FSDP gathers is per parameter: Variable metadata, see
    `jtree.models.layers.fsdp_gathered`.)

    `context_axis` is set by the same function when the mesh splits rows' tokens over its
    `context` axis (context parallelism, `jtree.parallel.context`): each device then holds a
    contiguous slice of every row, attention gathers keys and values over the axis, and the
    data-parallel axes above include it (router statistics are token sums). Token mixers that
    cannot run on a slice refuse it by name.

    `expert_dispatch` chooses how a MoE block runs its experts under tensor parallelism
    (`jtree.models.moe`): "psum" routes every token on every device of the model group and sums
    the partial outputs; "all_to_all" splits the tokens over the group and exchanges the
    (token, expert) assignments with the devices owning the experts. Same math either way; it
    changes nothing on one device. `expert_matmul` is how the experts multiply their sorted
    assignments (`jtree.kernels.grouped_matmul.pick_grouped_matmul`): "ragged_dot", "tiled" (a
    loop over row tiles, what GPUs run: XLA:GPU expands `ragged_dot` densely), or "auto".

    `gpu_compute_capability` (e.g. 80, 90, 100) is the CUDA target of the kernels that are compiled
    while the step is lowered rather than by XLA (`triton_lang`: Triton compiles them inside
    jax-triton's lowering): None reads GPU 0's, which only a GPU host has; `jtree.launch.compile`
    sets it from its target's devices so that the step lowers on a host without one.
    """

    attention_impl: str = "auto"
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    gdn_scan: str = "auto"
    scan_layers: bool = False
    tensor_parallel_axis: str | None = None
    data_parallel_axis: str | tuple[str, ...] | None = None
    context_axis: str | None = None
    expert_dispatch: str = "psum"
    expert_matmul: str = "auto"
    gpu_compute_capability: int | None = within(_COMPUTE_CAPABILITY, None)

    def __post_init__(self) -> None:
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field}: {getattr(self, field)!r} is not one of {tuple(DTYPES)}")
        if self.remat not in REMAT_POLICY_NAMES:
            raise ValueError(f"remat: {self.remat!r} is not one of {REMAT_POLICY_NAMES}")
        if self.expert_dispatch not in EXPERT_DISPATCHES:
            raise ValueError(f"expert_dispatch: {self.expert_dispatch!r} is not one of "
                             f"{EXPERT_DISPATCHES}")
        if self.expert_matmul not in GROUPED_MATMULS:
            raise ValueError(f"expert_matmul: {self.expert_matmul!r} is not one of "
                             f"{GROUPED_MATMULS}")
        if self.gpu_compute_capability is not None and (
                isinstance(self.gpu_compute_capability, bool)
                or not isinstance(self.gpu_compute_capability, int)):
            raise ValueError(f"gpu_compute_capability: {self.gpu_compute_capability!r} is not a "
                             "CUDA compute capability as an int (e.g. 80, 90, 100) or None")
        check_domains(self)
        if self.gdn_scan not in GDN_SCANS:
            raise ValueError(f"gdn_scan: {self.gdn_scan!r} is not one of {GDN_SCANS}")
        if self.attention_impl not in available_impls():
            raise ValueError(f"attention_impl: {self.attention_impl!r} is not one of "
                             f"{available_impls()}")
        if "float64" in (self.dtype, self.param_dtype) and self.attention_impl != "reference":
            raise ValueError(f"dtype float64 runs the 'reference' attention only, not "
                             f"{self.attention_impl!r} (it computes in float32)")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _enabled(DTYPES[self.dtype])

    @property
    def weight_dtype(self) -> jnp.dtype:
        return _enabled(DTYPES[self.param_dtype])


def _enabled(dtype: jnp.dtype) -> jnp.dtype:
    """`dtype`, refused if it is float64 while jax_enable_x64 is off (jax would silently make
    its arrays float32, and a float64 reference with them would not be one)."""
    if jnp.dtype(dtype) == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("dtype float64 needs jax_enable_x64 (`with jax.enable_x64(True):`)")
    return dtype
