"""Architecture configs: what a Hugging Face config.json holds, and the layer choice it implies.

One frozen dataclass per architecture (field names are Hugging Face's, so config.json maps one to
one), each with `decoder()`: the kind of every decoder layer (`LayerKind`: token mixer and
feed-forward) as a `DecoderSpec`. They live with the configs, not with the model code, so that a
run config is read, the FLOP model counted and the sharding rules chosen without building a model;
`jtree.models.architectures` pairs each with its module code and Hugging Face name tables.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from jtree.config.schema import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Domain,
    check_domains,
    within,
)

Mixer = Literal["attention", "sliding_attention", "gated_attention", "gated_deltanet", "mla",
                "mamba2", "kda", "none"]


GdnProjections = Literal["qkvz_ba", "qkv_z_b_a"]


FeedForward = Literal["mlp", "moe", "moe_shared", "deepseek_moe", "relu2_mlp", "relu2_moe",
                      "none"]


MIXERS: tuple[Mixer, ...] = ("attention", "sliding_attention", "gated_attention",
                             "gated_deltanet", "mla", "mamba2", "kda", "none")


FEED_FORWARDS: tuple[FeedForward, ...] = ("mlp", "moe", "moe_shared", "deepseek_moe", "relu2_mlp",
                                          "relu2_moe", "none")


# The feed-forwards that route tokens to experts (router statistics, routing replay).
MOE_FEED_FORWARDS: tuple[FeedForward, ...] = ("moe", "moe_shared", "deepseek_moe", "relu2_moe")

def attention_head_dims(cfg: Any) -> tuple[int, int]:
    """(query/key, value) head dims of the attention layers of architecture config `cfg`, what
    `auto` resolves its kernel on: MLA's differ (`qk_head_dim`, `v_head_dim`); the others'
    are one `head_dim` (or hidden_size / heads where the config has none)."""
    if hasattr(cfg, "qk_head_dim"):
        return cfg.qk_head_dim, cfg.v_head_dim
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return d, d


# The token mixers that attend under the tree mask (what an MTP layer may be, `jtree.models.mtp`).
ATTENTION_MIXERS: tuple[Mixer, ...] = ("attention", "sliding_attention", "gated_attention", "mla")

# The token mixers whose recurrence runs on the chunk tables of `jtree.layout.linearize`
# (`gdn_chunk_size`), with the short path convolution in front.
RECURRENT_MIXERS: tuple[Mixer, ...] = ("gated_deltanet", "mamba2", "kda")


# The share of a head's dimensions that partial RoPE rotates.
_FRACTION = Domain(low=0, high=1, low_open=True)


class LayerKind(NamedTuple):
    """What one decoder layer is made of: its token mixer and its feed-forward. One of them may
    be "none" (Nemotron-H: every layer is a single Mamba2, attention or MLP block): the layer is
    then one pre-norm residual branch with a single norm."""

    mixer: Mixer
    ffn: FeedForward


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The layer choice of an architecture config: one `LayerKind` per decoder layer, the norm
    of every layer, head and final output (`jtree.models.layers.NORMS`: Qwen3's RMSNorm,
    Qwen3-Next's (1 + weight) form or gpt-oss's scale in float32), how many features of each
    head RoPE rotates and how its frequencies are scaled (`rope_scaling`: Llama 3's or YaRN;
    None: plain RoPE).

    The attention's details that leave its shapes, sharding and FLOPs as they are, so they are
    flags here rather than layer kinds: `qk_norm` (Qwen3's per-head q/k norm; Llama and Qwen2
    have none), biases on the q/k/v projections (`qkv_bias`) and on o_proj (`o_bias`) (Qwen2
    has the first without the second) and on the dense MLP's projections (`mlp_bias`). Likewise
    the Gated DeltaNet's input projections (`gdn_projections`), whose widths are the same either
    way: Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` ("qkvz_ba") or Qwen3.5's separate
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` ("qkv_z_b_a").

    gpt-oss's details are flags too: learned per-head attention sinks (`attention_sinks`, an
    extra logit in each head's softmax denominator), the key window of its "sliding_attention"
    layers (`sliding_window`, counted along the path: query i sees key j iff
    pos[i] - pos[j] < sliding_window), a bias on the router (`router_bias`) and on every
    expert's projections (`expert_bias`), and the experts' clamped SwiGLU (`swiglu_clamp` =
    (alpha, limit): (clip(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit);
    None: silu(gate) * up)."""

    layers: tuple[LayerKind, ...]
    norm: Literal["rms", "offset_rms", "rms_f32_scale"]
    rotary_dim: int
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None = None
    qk_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    gdn_projections: GdnProjections = "qkvz_ba"
    attention_sinks: bool = False
    sliding_window: int | None = None
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_clamp: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for i, kind in enumerate(self.layers):
            if kind.mixer not in MIXERS or kind.ffn not in FEED_FORWARDS:
                raise ValueError(f"layer {i}: {kind} is not a (mixer in {MIXERS}, feed-forward "
                                 f"in {FEED_FORWARDS}) pair")
            if kind.mixer == "none" and kind.ffn == "none":
                raise ValueError(f"layer {i}: a layer needs a mixer or a feed-forward")
            if kind.mixer == "sliding_attention" and self.sliding_window is None:
                raise ValueError(f"layer {i}: a sliding_attention layer needs sliding_window")

    @property
    def needs_gdn_tables(self) -> bool:
        """Whether batches need the gated-delta-rule chunk tables (`linearize(gdn_chunk_size=)`):
        only the recurrent layers (Gated DeltaNet, Mamba2) read them."""
        return any(kind.mixer in RECURRENT_MIXERS for kind in self.layers)

    def kinds(self) -> set[str]:
        """Every mixer and feed-forward kind some layer uses."""
        return {kind.mixer for kind in self.layers} | {kind.ffn for kind in self.layers}


def fill_layer_types(cfg: Any, allowed: tuple[str, ...], default: Callable[[int], str]) -> None:
    """Set `cfg.layer_types` (a frozen config's, in `__post_init__`) to a tuple: as given, or
    `default(i)` for every layer i (HF's default pattern); checks its length and entries."""
    n = cfg.num_hidden_layers
    types = tuple(default(i) for i in range(n)) if cfg.layer_types is None else tuple(
        cfg.layer_types)
    object.__setattr__(cfg, "layer_types", types)
    if len(types) != n:
        raise ValueError(f"layer_types: {len(types)} entries for num_hidden_layers={n}")
    for i, t in enumerate(types):
        if t not in allowed:
            raise ValueError(f"layer_types[{i}]: {t!r} is not one of {allowed}")


def is_moe_layer(layer: int, num_experts: int, decoder_sparse_step: int,
                 mlp_only_layers: tuple[int, ...]) -> bool:
    """HF's rule for which decoder layers get a sparse MoE block instead of a dense MLP."""
    return (layer not in mlp_only_layers and num_experts > 0
            and (layer + 1) % decoder_sparse_step == 0)


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """The fields and checks shared by the decoders with attention and a dense SwiGLU in every
    layer (Qwen3, Qwen2, Llama), which differ only in attention details (`DecoderSpec`'s flags).
    Field names are Hugging Face's, so that `config.json` maps one to one; how to run the model is
    `jtree.config.runtime.RuntimeConfig`."""

    vocab_size: int = within(AT_LEAST_ONE, 512)
    hidden_size: int = within(AT_LEAST_ONE, 128)
    intermediate_size: int = within(AT_LEAST_ONE, 256)
    num_hidden_layers: int = within(AT_LEAST_ONE, 2)
    num_attention_heads: int = within(AT_LEAST_ONE, 4)
    num_key_value_heads: int = within(AT_LEAST_ONE, 2)
    head_dim: int = within(AT_LEAST_ONE, 32)
    rms_norm_eps: float = within(POSITIVE, 1e-6)
    rope_theta: float = within(POSITIVE, 1_000_000.0)
    tie_word_embeddings: bool = True
    max_position_embeddings: int = within(AT_LEAST_ONE, 40960)
    initializer_range: float = within(POSITIVE, 0.02)

    def __post_init__(self) -> None:
        check_domains(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")

    def decoder(self) -> DecoderSpec:
        return DecoderSpec((LayerKind("attention", "mlp"),) * self.num_hidden_layers, "rms",
                           self.head_dim, qk_norm=False)


@dataclasses.dataclass(frozen=True)
class Qwen3Config(DenseConfig):
    """Architecture of a Qwen3 dense model: per-head q/k RMSNorm, and `attention_bias` on q/k/v
    and o alike."""

    attention_bias: bool = False

    def decoder(self) -> DecoderSpec:
        return dataclasses.replace(super().decoder(), qk_norm=True, qkv_bias=self.attention_bias,
                                   o_bias=self.attention_bias)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3's RoPE frequency scaling (HF `rope_scaling` with `rope_type: llama3`): slow
    frequencies (wavelength above `original_max_position_embeddings / low_freq_factor`) are
    divided by `factor`, fast ones (wavelength below `... / high_freq_factor`) kept, and those in
    between interpolated (`jtree.models.layers.rope_inverse_frequencies`)."""

    factor: float = within(POSITIVE, 8.0)
    low_freq_factor: float = within(POSITIVE, 1.0)
    high_freq_factor: float = within(POSITIVE, 4.0)
    original_max_position_embeddings: int = within(AT_LEAST_ONE, 8192)

    def __post_init__(self) -> None:
        check_domains(self)
        if not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling: need 0 < low_freq_factor ({self.low_freq_factor}) "
                             f"< high_freq_factor ({self.high_freq_factor})")


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN's RoPE frequency scaling (HF `rope_parameters` / `rope_scaling` with `rope_type:
    yarn`; gpt-oss): each frequency is a blend of the original one (kept where it turns more than
    `beta_fast` times over `original_max_position_embeddings`) and the one divided by `factor`
    (where it turns fewer than `beta_slow` times), with a linear ramp over the dimensions in
    between (`truncate`: the ramp's ends rounded to whole dimensions); cos and sin are multiplied
    by `attention_factor` (None: 0.1 ln(factor) + 1, or the ratio of the `mscale` /
    `mscale_all_dim` forms when both are given), as transformers computes them
    (`jtree.models.layers.rope_inverse_frequencies`, `rope_attention_factor`)."""

    factor: float = within(POSITIVE, 32.0)
    original_max_position_embeddings: int = within(AT_LEAST_ONE, 4096)
    beta_fast: float = within(POSITIVE, 32.0)
    beta_slow: float = within(POSITIVE, 1.0)
    truncate: bool = True
    attention_factor: float | None = within(POSITIVE, None)
    mscale: float | None = within(NON_NEGATIVE, None)
    mscale_all_dim: float | None = within(NON_NEGATIVE, None)

    def __post_init__(self) -> None:
        check_domains(self)


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DenseConfig):
    """Llama (HF `LlamaForCausalLM`, Llama 3 included): no q/k norm, `attention_bias` on q/k/v and
    o alike, `mlp_bias` on the MLP's three projections, and Llama 3's `rope_scaling` (None: plain
    RoPE)."""

    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: Llama3RopeScaling | None = None

    def decoder(self) -> DecoderSpec:
        return dataclasses.replace(super().decoder(), qkv_bias=self.attention_bias,
                                   o_bias=self.attention_bias, mlp_bias=self.mlp_bias,
                                   rope_scaling=self.rope_scaling)


@dataclasses.dataclass(frozen=True)
class Qwen2Config(DenseConfig):
    """Qwen2 / Qwen2.5 (HF `Qwen2ForCausalLM`): no q/k norm, biases on q/k/v but not on o_proj,
    fixed as in HF (whose Qwen2 config has no bias field)."""

    def decoder(self) -> DecoderSpec:
        return dataclasses.replace(super().decoder(), qkv_bias=True)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3 with sparse MoE feed-forward layers.

    The router load-balancing loss is added to the objective (times `router_aux_loss_coef`) only
    when `output_router_logits` is true, as in HF's `*ForCausalLM.forward`.
    """

    num_experts: int = within(NON_NEGATIVE, 8)
    num_experts_per_tok: int = within(AT_LEAST_ONE, 2)
    moe_intermediate_size: int = within(AT_LEAST_ONE, 64)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = within(AT_LEAST_ONE, 1)
    mlp_only_layers: tuple[int, ...] = within(NON_NEGATIVE, ())
    router_aux_loss_coef: float = within(NON_NEGATIVE, 0.001)
    output_router_logits: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if not 1 <= self.num_experts_per_tok <= max(self.num_experts, 1):
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_experts={self.num_experts}]")

    def sparse_layers(self) -> list[bool]:
        """Which decoder layers get a MoE block instead of a dense MLP (HF's rule)."""
        return [is_moe_layer(i, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)
                for i in range(self.num_hidden_layers)]

    def decoder(self) -> DecoderSpec:
        return dataclasses.replace(super().decoder(), layers=tuple(
            LayerKind("attention", "moe" if sparse else "mlp") for sparse in self.sparse_layers()))


@dataclasses.dataclass(frozen=True)
class HybridFields:
    """The fields and checks of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): the linear
    attention's shapes, partial RoPE on the gated attention, and which layers are which.
    `layer_types` defaults to every `full_attention_interval`-th layer being full attention, the
    rest linear attention (HF's default); given, it wins. Mixed into an architecture config that
    holds `num_hidden_layers` and `head_dim`."""

    partial_rotary_factor: float = within(_FRACTION, 0.25)
    linear_conv_kernel_dim: int = within(AT_LEAST_ONE, 4)
    linear_key_head_dim: int = within(AT_LEAST_ONE, 16)
    linear_value_head_dim: int = within(AT_LEAST_ONE, 16)
    linear_num_key_heads: int = within(AT_LEAST_ONE, 2)
    linear_num_value_heads: int = within(AT_LEAST_ONE, 4)
    full_attention_interval: int = within(AT_LEAST_ONE, 4)
    layer_types: tuple[str, ...] | None = None

    def check_hybrid(self) -> None:
        """Fill in `layer_types` and check the hybrid fields (called by `__post_init__`)."""
        fill_layer_types(self, LAYER_TYPES, lambda i: "full_attention" if (
            i + 1) % self.full_attention_interval == 0 else "linear_attention")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_key_heads ({self.linear_num_key_heads}) must divide "
                             f"linear_num_value_heads ({self.linear_num_value_heads})")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"partial_rotary_factor ({self.partial_rotary_factor}) x head_dim "
                             f"({self.head_dim}) must give an even rotary dimension >= 2")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def hybrid_decoder(self, base: DecoderSpec, ffns: Sequence[FeedForward],
                       projections: GdnProjections) -> DecoderSpec:
        """`base` with the hybrid's layers (mixer from `layer_types`, feed-forward `ffns[i]`),
        its (1 + weight) norms, partial RoPE and Gated DeltaNet projections."""
        return dataclasses.replace(
            base, norm="offset_rms", rotary_dim=self.rotary_dim, gdn_projections=projections,
            layers=tuple(LayerKind(_MIXERS[t], ffn) for t, ffn in zip(self.layer_types, ffns)))


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(Qwen3MoeConfig, HybridFields):
    """Qwen3-Next: the hybrid layers (`HybridFields`), sparse MoE blocks with a gated shared
    expert (a dense SwiGLU where HF's rule says, as in Qwen3-MoE), fused GDN projections."""

    norm_topk_prob: bool = True
    head_dim: int = within(AT_LEAST_ONE, 32)
    shared_expert_intermediate_size: int = within(AT_LEAST_ONE, 64)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_hybrid()

    def decoder(self) -> DecoderSpec:
        ffns = ["moe_shared" if sparse else "mlp" for sparse in self.sparse_layers()]
        return self.hybrid_decoder(super().decoder(), ffns, "qkvz_ba")


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config(Qwen3Config, HybridFields):
    """Qwen3.5, dense (HF `Qwen3_5ForCausalLM`, text config `Qwen3_5TextConfig`): Qwen3-Next's
    hybrid layers with a dense SwiGLU in every layer and separate GDN projections. Its RoPE is
    transformers' multimodal (mrope) form, which for text is 1-D RoPE (`jtree.models.
    architectures.qwen3_5`)."""

    head_dim: int = within(AT_LEAST_ONE, 32)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_hybrid()

    def decoder(self) -> DecoderSpec:
        return self.hybrid_decoder(super().decoder(), ["mlp"] * self.num_hidden_layers,
                                   "qkv_z_b_a")


@dataclasses.dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3NextConfig):
    """Qwen3.5-MoE (HF `Qwen3_5MoeForCausalLM`, text config `Qwen3_5MoeTextConfig`): Qwen3-Next
    with separate GDN projections and a MoE block with shared expert in every layer. HF's
    Qwen3.5-MoE has no `decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob` or
    `intermediate_size` (its router always renormalizes the top-k weights); the fields inherited
    from Qwen3-Next must keep those fixed values (`intermediate_size` is read by no layer)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, fixed in (("decoder_sparse_step", 1), ("mlp_only_layers", ()),
                            ("norm_topk_prob", True)):
            if getattr(self, name) != fixed:
                raise ValueError(f"{name} = {getattr(self, name)!r}: Qwen3.5-MoE has a MoE block "
                                 f"in every layer with renormalized top-k weights ({name} is "
                                 f"{fixed!r})")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")

    def decoder(self) -> DecoderSpec:
        return dataclasses.replace(super().decoder(), gdn_projections="qkv_z_b_a")


@dataclasses.dataclass(frozen=True)
class GptOssConfig(DenseConfig):
    """gpt-oss (HF `GptOssForCausalLM`, model_type `gpt_oss`): attention with biases on q/k/v/o,
    no q/k norm, learned per-head sinks, "sliding_attention" layers (a key window of
    `sliding_window` path positions) and "full_attention" layers as `layer_types` says (HF's
    default: alternating, sliding first), YaRN-scaled RoPE (`rope_scaling`), and a MoE block in
    every layer: a router with a bias whose top-k logits are softmaxed (the same weights as
    renormalizing the top-k of the full softmax, so the router is Qwen3-MoE's with
    `norm_topk_prob`), experts with biases and the clamped SwiGLU (`swiglu_alpha`,
    `swiglu_limit`; `DecoderSpec.swiglu_clamp`). `intermediate_size` is each expert's width
    (`moe_intermediate_size` reads it); `num_experts` is HF's `num_local_experts`."""

    vocab_size: int = within(AT_LEAST_ONE, 512)
    hidden_size: int = within(AT_LEAST_ONE, 64)
    intermediate_size: int = within(AT_LEAST_ONE, 32)
    num_hidden_layers: int = within(AT_LEAST_ONE, 2)
    head_dim: int = within(AT_LEAST_ONE, 16)
    rms_norm_eps: float = within(POSITIVE, 1e-5)
    rope_theta: float = within(POSITIVE, 150000.0)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = within(AT_LEAST_ONE, 131072)
    attention_bias: bool = True
    num_experts: int = within(NON_NEGATIVE, 4)
    num_experts_per_tok: int = within(AT_LEAST_ONE, 2)
    router_aux_loss_coef: float = within(NON_NEGATIVE, 0.001)
    output_router_logits: bool = False
    swiglu_alpha: float = within(POSITIVE, 1.702)
    swiglu_limit: float = within(POSITIVE, 7.0)
    sliding_window: int = within(AT_LEAST_ONE, 128)
    layer_types: tuple[str, ...] | None = None
    # transformers' default for gpt-oss (the released models' scaling); None: plain RoPE
    rope_scaling: YarnRopeScaling | None = dataclasses.field(
        default_factory=lambda: YarnRopeScaling(factor=32.0, original_max_position_embeddings=4096,
                                                truncate=False))

    def __post_init__(self) -> None:
        super().__post_init__()
        fill_layer_types(self, GPT_OSS_LAYER_TYPES, lambda i: "sliding_attention" if (
            i + 1) % 2 else "full_attention")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_experts={self.num_experts}]")

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def norm_topk_prob(self) -> bool:
        return True

    def decoder(self) -> DecoderSpec:
        return dataclasses.replace(
            super().decoder(), qkv_bias=self.attention_bias, o_bias=self.attention_bias,
            norm="rms_f32_scale", rope_scaling=self.rope_scaling, attention_sinks=True,
            sliding_window=self.sliding_window, router_bias=True, expert_bias=True,
            swiglu_clamp=(self.swiglu_alpha, self.swiglu_limit),
            layers=tuple(LayerKind("sliding_attention" if t == "sliding_attention"
                                   else "attention", "moe") for t in self.layer_types))


class WithoutRouterLoss:
    """The MoE architectures whose transformers model adds no router loss (DeepSeek-V3 balances
    with its selection bias; Nemotron 3 and Kimi-Linear likewise): `output_router_logits` is
    always false."""

    @property
    def output_router_logits(self) -> bool:
        return False

    @property
    def router_aux_loss_coef(self) -> float:
        return 0.0


class MlaMoeFields(WithoutRouterLoss):
    """The derived fields of the MLA + DeepSeekMoE configs (DeepSeek-V3, Kimi-Linear), mixed into
    a config holding their HF fields."""

    @property
    def qk_head_dim(self) -> int:
        """The width of a query or key head: its RoPE-free and RoPE (or, without RoPE,
        shared) features."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size


def check_mla_and_group_routing(cfg: Any) -> None:
    """The checks shared by the MLA + DeepSeekMoE configs (DeepSeek-V3, Kimi-Linear): one key
    and value head per query head, and `check_group_limited_routing`."""
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ValueError(f"num_key_value_heads ({cfg.num_key_value_heads}) must equal "
                         f"num_attention_heads ({cfg.num_attention_heads}): MLA expands "
                         "its latent into one key and value per query head")
    check_group_limited_routing(cfg)


def check_group_limited_routing(cfg: Any) -> None:
    """The group-limited router's fields (`jtree.models.moe.GroupLimitedRouter`: DeepSeek-V3's,
    Kimi-Linear's, Nemotron 3's) fit their expert count."""
    if cfg.num_experts % cfg.n_group or cfg.num_experts // cfg.n_group < 2:
        raise ValueError(f"n_group ({cfg.n_group}) must divide n_routed_experts "
                         f"({cfg.num_experts}) into groups of at least 2 experts (a "
                         "group's score is the sum of its two best)")
    if not 1 <= cfg.topk_group <= cfg.n_group:
        raise ValueError(f"topk_group ({cfg.topk_group}) must be in [1, n_group={cfg.n_group}]")
    eligible = cfg.topk_group * (cfg.num_experts // cfg.n_group)
    if not 1 <= cfg.num_experts_per_tok <= eligible:
        raise ValueError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) must be in [1, "
                         f"{eligible}] (the experts of topk_group groups)")


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(MlaMoeFields):
    """DeepSeek-V3 (HF `DeepseekV3ForCausalLM`; Kimi-K2 has the same architecture): multi-head
    latent attention ("mla", `jtree.models.mla`) in every layer, a dense SwiGLU of
    `intermediate_size` in the first `first_k_dense_replace` layers and DeepSeekMoE
    ("deepseek_moe", `jtree.models.moe`) in the others.

    MLA: queries through a low-rank `q_lora_rank` bottleneck (None: one `q_proj`), keys and
    values from a `kv_lora_rank` latent, per-head q/k of `qk_nope_head_dim` + `qk_rope_head_dim`
    features whose RoPE part of the key is one vector shared by all heads, values of
    `v_head_dim`; `rope_interleave` says the RoPE features are stored as interleaved pairs (HF's
    default). YaRN's `mscale_all_dim` also scales the softmax (`softmax_scale`).

    DeepSeekMoE: sigmoid router scores, `num_experts` (HF `n_routed_experts`) split into
    `n_group` groups of which the `topk_group` best (by the sum of their two best scores plus
    the selection bias `e_score_correction_bias`) are eligible, top-`num_experts_per_tok` among
    those, weights = the chosen scores (renormalized when `norm_topk_prob`) times
    `routed_scaling_factor`, plus `n_shared_experts` always-on experts (one SwiGLU of
    `n_shared_experts * moe_intermediate_size`, no gate). There is no router loss (HF computes
    none; DeepSeek balances with the selection bias), so `output_router_logits` is always
    false."""

    vocab_size: int = within(AT_LEAST_ONE, 512)
    hidden_size: int = within(AT_LEAST_ONE, 64)
    intermediate_size: int = within(AT_LEAST_ONE, 128)
    moe_intermediate_size: int = within(AT_LEAST_ONE, 32)
    num_hidden_layers: int = within(AT_LEAST_ONE, 3)
    num_attention_heads: int = within(AT_LEAST_ONE, 4)
    num_key_value_heads: int = within(AT_LEAST_ONE, 4)
    n_shared_experts: int = within(AT_LEAST_ONE, 1)
    num_experts: int = within(AT_LEAST_ONE, 8)
    routed_scaling_factor: float = within(POSITIVE, 2.5)
    kv_lora_rank: int = within(AT_LEAST_ONE, 32)
    q_lora_rank: int | None = within(AT_LEAST_ONE, 48)
    qk_rope_head_dim: int = within(AT_LEAST_ONE, 8)
    v_head_dim: int = within(AT_LEAST_ONE, 16)
    qk_nope_head_dim: int = within(AT_LEAST_ONE, 16)
    n_group: int = within(AT_LEAST_ONE, 4)
    topk_group: int = within(AT_LEAST_ONE, 2)
    num_experts_per_tok: int = within(AT_LEAST_ONE, 2)
    first_k_dense_replace: int = within(NON_NEGATIVE, 1)
    norm_topk_prob: bool = True
    rms_norm_eps: float = within(POSITIVE, 1e-6)
    rope_theta: float = within(POSITIVE, 10000.0)
    rope_scaling: YarnRopeScaling | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = within(AT_LEAST_ONE, 4096)
    initializer_range: float = within(POSITIVE, 0.02)

    def __post_init__(self) -> None:
        check_domains(self)
        check_mla_and_group_routing(self)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when the
        scaling gives `mscale_all_dim` (transformers' `yarn_apply_mscale`)."""
        scale = self.qk_head_dim ** -0.5
        scaling = self.rope_scaling
        if scaling is not None and scaling.mscale_all_dim and scaling.factor > 1:
            m = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
            scale = scale * m * m
        return scale


    def decoder(self) -> DecoderSpec:
        return DecoderSpec(
            tuple(LayerKind("mla", "mlp" if i < self.first_k_dense_replace else "deepseek_moe")
                  for i in range(self.num_hidden_layers)),
            "rms", self.qk_rope_head_dim, rope_scaling=self.rope_scaling, qk_norm=False,
            qkv_bias=self.attention_bias, o_bias=self.attention_bias)


# Nemotron-H's layer types (transformers 5 `layers_block_type`; the Hub's older
# `hybrid_override_pattern` letters M, *, -, E in `jtree.models.architectures.nemotron_h`) and
# their layer kinds.
NEMOTRON_H_LAYER_KINDS: dict[str, LayerKind] = {
    "linear_attention": LayerKind("mamba2", "none"),
    "full_attention": LayerKind("attention", "none"),
    "mlp": LayerKind("none", "relu2_mlp"),
    "moe": LayerKind("none", "relu2_moe"),
}


@dataclasses.dataclass(frozen=True)
class NemotronHConfig(WithoutRouterLoss):
    """Nemotron-H (HF `NemotronHForCausalLM`): a stack of single-block layers, each one RMSNorm
    and one residual branch of a Mamba2 mixer (`jtree.models.mamba2`), GQA attention without
    RoPE, biases or q/k norm, a non-gated MLP with squared-ReLU, or (Nemotron 3) a MoE block
    ("relu2_moe", `jtree.models.moe`) (`layers_block_type`). Field names are HF's but for
    `num_experts` (HF `n_routed_experts`); `num_hidden_layers` is the length of
    `layers_block_type`, as in transformers 5.

    The MoE block is DeepSeekMoE's routing (`GroupLimitedRouter`: sigmoid scores, the selection
    bias `e_score_correction_bias`, `n_group` / `topk_group`, `norm_topk_prob`,
    `routed_scaling_factor`) over squared-ReLU experts without a gate (up, down), plus one
    always-on squared-ReLU shared expert of `moe_shared_expert_intermediate_size`. transformers
    computes no router loss for it, so `output_router_logits` is always false."""

    vocab_size: int = within(AT_LEAST_ONE, 512)
    hidden_size: int = within(AT_LEAST_ONE, 64)
    layers_block_type: tuple[str, ...] = ("linear_attention", "full_attention", "mlp")
    num_attention_heads: int = within(AT_LEAST_ONE, 4)
    num_key_value_heads: int = within(AT_LEAST_ONE, 2)
    head_dim: int = within(AT_LEAST_ONE, 16)
    intermediate_size: int = within(AT_LEAST_ONE, 128)
    mlp_bias: bool = False
    ssm_state_size: int = within(AT_LEAST_ONE, 16)
    mamba_num_heads: int = within(AT_LEAST_ONE, 4)
    mamba_head_dim: int = within(AT_LEAST_ONE, 16)
    n_groups: int = within(AT_LEAST_ONE, 2)
    conv_kernel: int = within(AT_LEAST_ONE, 4)
    time_step_min: float = within(NON_NEGATIVE, 0.001)
    use_conv_bias: bool = True
    use_bias: bool = False
    layer_norm_epsilon: float = within(POSITIVE, 1e-5)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = within(AT_LEAST_ONE, 4096)
    initializer_range: float = within(POSITIVE, 0.02)
    # transformers' chunk length of its Mamba2 scan: it changes transformers' rounding, not the
    # math, so jtree keeps it only to write it back (its own chunks: `gdn_chunk_size`)
    chunk_size: int = within(AT_LEAST_ONE, 128)
    # the MoE layers' (read only where layers_block_type has "moe")
    num_experts: int = within(AT_LEAST_ONE, 8)
    num_experts_per_tok: int = within(AT_LEAST_ONE, 2)
    moe_intermediate_size: int = within(AT_LEAST_ONE, 32)
    moe_shared_expert_intermediate_size: int = within(AT_LEAST_ONE, 32)
    n_group: int = within(AT_LEAST_ONE, 1)
    topk_group: int = within(AT_LEAST_ONE, 1)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = within(POSITIVE, 1.0)

    def __post_init__(self) -> None:
        check_domains(self)
        object.__setattr__(self, "layers_block_type", tuple(self.layers_block_type))
        if not self.layers_block_type:
            raise ValueError("layers_block_type: needs at least one layer")
        for i, t in enumerate(self.layers_block_type):
            if t not in NEMOTRON_H_LAYER_KINDS:
                raise ValueError(f"layers_block_type[{i}]: {t!r} is not one of "
                                 f"{tuple(NEMOTRON_H_LAYER_KINDS)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"n_groups ({self.n_groups}) must divide mamba_num_heads "
                             f"({self.mamba_num_heads})")
        if "moe" in self.layers_block_type:
            check_group_limited_routing(self)
            if self.mlp_bias:
                raise ValueError("mlp_bias: the MoE layers' shared expert takes no biases in "
                                 "jtree (only without MoE layers)")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The shared expert's width under the name the MoE block reads."""
        return self.moe_shared_expert_intermediate_size

    @property
    def layer_types(self) -> tuple[str, ...]:
        """`layers_block_type` under transformers' alias (what the memory plan's layer block
        reads, `jtree.memory.plan.layer_block`)."""
        return self.layers_block_type

    @property
    def rms_norm_eps(self) -> float:
        """`layer_norm_epsilon` under the name the shared decoder's norms read."""
        return self.layer_norm_epsilon

    @property
    def linear_conv_kernel_dim(self) -> int:
        """`conv_kernel` under the name the shared recurrent routing reads (`gdn_routing`)."""
        return self.conv_kernel

    @property
    def rope_theta(self) -> float:
        """Never used: the attention has no RoPE (`DecoderSpec.rotary_dim` 0 rotates nothing)."""
        return 1.0

    def decoder(self) -> DecoderSpec:
        return DecoderSpec(tuple(NEMOTRON_H_LAYER_KINDS[t] for t in self.layers_block_type),
                           "rms_f32_scale", 0, qk_norm=False, mlp_bias=self.mlp_bias)


# Kimi-Linear's `layer_types` and `mlp_layer_types` (transformers' names) and their layer kinds.
KIMI_LINEAR_MIXERS: dict[str, Mixer] = {"linear_attention": "kda", "full_attention": "mla"}
KIMI_LINEAR_FFNS: dict[str, FeedForward] = {"dense": "mlp", "sparse": "deepseek_moe"}


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig(MlaMoeFields):
    """Kimi-Linear (HF `KimiLinearForCausalLM`): Kimi Delta Attention ("kda",
    `jtree.models.kda`) on the "linear_attention" layers of `layer_types` and MLA without RoPE
    ("mla" with `DecoderSpec.rotary_dim` 0: the shared key part is used as it is, the softmax
    scale is qk_head_dim ** -0.5) on the "full_attention" ones; a dense SwiGLU on the "dense"
    layers of `mlp_layer_types` and DeepSeekMoE ("deepseek_moe", as in DeepSeek-V3) on the
    "sparse" ones.

    KDA: `linear_num_heads` heads of `linear_head_dim` for q, k and v alike, a short path conv
    of `linear_conv_kernel_dim` over [q | k | v], and the gated delta rule with one log decay
    per key channel. Field names are transformers' in-memory ones (`num_experts` is its
    `num_local_experts`); `layer_types` defaults to transformers' pattern (layers 4, 8, ... are
    full attention), `mlp_layer_types` to a dense first layer and sparse ones after (HF's
    `first_k_dense_replace` of 1). No router loss (as DeepSeek-V3's)."""

    vocab_size: int = within(AT_LEAST_ONE, 512)
    hidden_size: int = within(AT_LEAST_ONE, 64)
    intermediate_size: int = within(AT_LEAST_ONE, 128)
    moe_intermediate_size: int = within(AT_LEAST_ONE, 32)
    num_hidden_layers: int = within(AT_LEAST_ONE, 4)
    num_attention_heads: int = within(AT_LEAST_ONE, 4)
    num_key_value_heads: int = within(AT_LEAST_ONE, 4)
    n_shared_experts: int = within(AT_LEAST_ONE, 1)
    num_experts: int = within(AT_LEAST_ONE, 8)
    routed_scaling_factor: float = within(POSITIVE, 2.446)
    kv_lora_rank: int = within(AT_LEAST_ONE, 32)
    q_lora_rank: int | None = within(AT_LEAST_ONE, None)
    qk_rope_head_dim: int = within(AT_LEAST_ONE, 8)
    v_head_dim: int = within(AT_LEAST_ONE, 16)
    qk_nope_head_dim: int = within(AT_LEAST_ONE, 16)
    n_group: int = within(AT_LEAST_ONE, 1)
    topk_group: int = within(AT_LEAST_ONE, 1)
    num_experts_per_tok: int = within(AT_LEAST_ONE, 2)
    norm_topk_prob: bool = True
    rms_norm_eps: float = within(POSITIVE, 1e-5)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = within(AT_LEAST_ONE, 1048576)
    initializer_range: float = within(POSITIVE, 0.02)
    linear_head_dim: int = within(AT_LEAST_ONE, 16)
    linear_num_heads: int = within(AT_LEAST_ONE, 2)
    linear_conv_kernel_dim: int = within(AT_LEAST_ONE, 4)
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_domains(self)
        check_mla_and_group_routing(self)
        fill_layer_types(self, tuple(KIMI_LINEAR_MIXERS), lambda i: "full_attention" if (
            i and i % 4 == 0) else "linear_attention")
        n = self.num_hidden_layers
        mlp = tuple(("dense",) + ("sparse",) * (n - 1) if self.mlp_layer_types is None
                    else self.mlp_layer_types)
        object.__setattr__(self, "mlp_layer_types", mlp)
        if len(mlp) != n:
            raise ValueError(f"mlp_layer_types: {len(mlp)} entries for num_hidden_layers={n}")
        for i, t in enumerate(mlp):
            if t not in KIMI_LINEAR_FFNS:
                raise ValueError(f"mlp_layer_types[{i}]: {t!r} is not one of "
                                 f"{tuple(KIMI_LINEAR_FFNS)}")

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5


    @property
    def rope_theta(self) -> float:
        """Never used: no layer has RoPE (`DecoderSpec.rotary_dim` 0 rotates nothing)."""
        return 1.0

    def decoder(self) -> DecoderSpec:
        return DecoderSpec(
            tuple(LayerKind(KIMI_LINEAR_MIXERS[t], KIMI_LINEAR_FFNS[f])
                  for t, f in zip(self.layer_types, self.mlp_layer_types)),
            "rms", 0, qk_norm=False, qkv_bias=self.attention_bias, o_bias=self.attention_bias)


GPT_OSS_LAYER_TYPES = ("sliding_attention", "full_attention")


LAYER_TYPES = ("linear_attention", "full_attention")


# The `model.architecture` names of run configs and checkpoints, with their config classes
# (`jtree.models.architectures` adds each one's model code and Hugging Face name tables).
ARCHITECTURE_CONFIGS: dict[str, type] = {
    "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig, "qwen3_next": Qwen3NextConfig,
    "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_5": Qwen3_5Config,
    "qwen3_5_moe": Qwen3_5MoeConfig, "gpt_oss": GptOssConfig, "deepseek_v3": DeepseekV3Config,
    "nemotron_h": NemotronHConfig, "kimi_linear": KimiLinearConfig}


def architecture_config(name: str) -> type:
    """The config class of architecture `name`."""
    if name not in ARCHITECTURE_CONFIGS:
        raise ValueError(f"architecture: {name!r} is not one of {sorted(ARCHITECTURE_CONFIGS)}")
    return ARCHITECTURE_CONFIGS[name]


_MIXERS = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}
