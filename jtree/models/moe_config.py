"""Configurations of Qwen3-MoE and Qwen3-Next (field names and defaults follow Hugging Face's
`Qwen3MoeConfig` / `Qwen3NextConfig`, so `config.json` maps one to one; RoPE's `rope_theta` and
`partial_rotary_factor` are flat fields here instead of HF's `rope_parameters` dict)."""

from __future__ import annotations

import dataclasses

from jtree.models.config import Qwen3Config

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3 with sparse MoE feed-forward layers.

    The router load-balancing loss is added to the objective (times `router_aux_loss_coef`) only
    when `output_router_logits` is true, as in HF's `*ForCausalLM.forward`.
    `data_parallel_axis` is set by `jtree.train_step.tensor_parallel_graphdef` next to
    `tensor_parallel_axis`: the mesh axis the batch rows are split over inside `shard_map`, over
    which that loss pools its batch statistics (leave it unset everywhere else).
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    # How to run it (not a Hugging Face field):
    data_parallel_axis: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if not 1 <= self.num_experts_per_tok <= max(self.num_experts, 1):
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(Qwen3MoeConfig):
    """Qwen3-Next: Gated DeltaNet layers interleaved with gated full attention (partial RoPE), MoE
    with a gated shared expert. `layer_types` defaults to every `full_attention_interval`-th
    layer being full attention, the rest linear attention (HF's default)."""

    norm_topk_prob: bool = True
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    shared_expert_intermediate_size: int = 64
    full_attention_interval: int = 4
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            types = tuple("full_attention" if (i + 1) % self.full_attention_interval == 0
                          else "linear_attention" for i in range(self.num_hidden_layers))
        else:
            types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: {len(types)} entries for num_hidden_layers="
                             f"{self.num_hidden_layers}")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}]: {t!r} is not one of {LAYER_TYPES}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_key_heads ({self.linear_num_key_heads}) must divide "
                             f"linear_num_value_heads ({self.linear_num_value_heads})")
        if self.linear_conv_kernel_dim < 1:
            raise ValueError(f"linear_conv_kernel_dim must be >= 1, got {self.linear_conv_kernel_dim}")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"partial_rotary_factor ({self.partial_rotary_factor}) x head_dim "
                             f"({self.head_dim}) must give an even rotary dimension >= 2")

    @property
    def needs_gdn_tables(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)
