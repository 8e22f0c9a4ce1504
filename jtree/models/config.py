"""Model configuration shared by the Qwen3 family (field names follow Hugging Face configs)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jtree.models.layers import REMAT_POLICIES
from jtree.kernels import available_impls

REMAT_POLICY_NAMES = ("none", *REMAT_POLICIES)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture of a Qwen3 dense model plus how to run it.

    Architecture fields carry the Hugging Face names so that `config.json` maps one to one.
    `attention_impl` selects the `jtree.kernels.tree_attention` implementation; `dtype` is the compute
    dtype and `param_dtype` the storage dtype of the weights. `remat` is the activation
    rematerialization policy of each decoder layer (`jtree.models.layers.REMAT_POLICIES`).
    `tensor_parallel_axis` is set by `jtree.train_step.tensor_parallel_graphdef` for the copy of the
    model that runs inside `shard_map` (weights are then this device's shard and partial sums are
    reduced over that mesh axis); leave it unset everywhere else.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    attention_impl: str = "auto"
    dtype: str = "float32"
    param_dtype: str = "float32"
    # How to run it (not Hugging Face fields):
    remat: str = "none"
    tensor_parallel_axis: str | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field}: {getattr(self, field)!r} is not one of {tuple(DTYPES)}")
        if self.remat not in REMAT_POLICY_NAMES:
            raise ValueError(f"remat: {self.remat!r} is not one of {REMAT_POLICY_NAMES}")
        if self.attention_impl not in available_impls():
            raise ValueError(f"attention_impl: {self.attention_impl!r} is not one of "
                             f"{available_impls()}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")

    @property
    def needs_gdn_tables(self) -> bool:
        """Whether batches need the gated-delta-rule chunk tables (`linearize(gdn_chunk_size=)`):
        only models with linear-attention layers read them."""
        return False

    @property
    def compute_dtype(self) -> jnp.dtype:
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self) -> jnp.dtype:
        return DTYPES[self.param_dtype]
