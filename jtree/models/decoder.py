"""The decoder stack every architecture is built from: embedding, decoder layers, final norm and
an (optionally tied) head, on tree batches. Returns final hidden states, not logits.

Each layer's kind comes from the architecture config (`config.decoder()`, a `DecoderSpec`): its
token mixer is attention (Qwen3), sliding-window attention (gpt-oss), gated attention
(Qwen3-Next), multi-head latent attention (DeepSeek-V3, `jtree.models.mla`), a Gated
DeltaNet, Mamba2 or Kimi Delta Attention (Kimi-Linear, `jtree.models.kda`), its feed-forward a
dense SwiGLU, a sparse MoE block, a MoE block with a gated shared expert, DeepSeekMoE
(group-limited sigmoid router, ungated shared experts) or Nemotron 3's MoE (that router over
squared-ReLU experts without a gate). Module and
parameter names mirror Hugging Face's `*ForCausalLM` (`model.layers.N.self_attn.q_proj`,
`...linear_attn.in_proj_qkvz` or `in_proj_qkv`, `...mlp.experts.gate_up_proj`; NNX `kernel` is
HF `weight` transposed), so checkpoints map by name.

`CausalLM.__call__` is the only place that reads the batch (a `jtree.layout.batch.DeviceBatch`: tokens,
positions, the `TreeMask`, GDN tables, prefix layout, router-loss inputs): it builds the
per-forward `LayerInputs` every layer reads. Logits are never formed for the whole batch here:
`jtree.token_logprobs` combines the hidden states with `output_embedding()` only where a token is
scored.

With `RuntimeConfig.scan_layers` the layers are held stacked (`Decoder.blocks`, one stacked
`DecoderLayer` per position of each repeated block, `jtree.parallel.layer_stack`) and each block runs as
the body of a `jax.lax.scan`; prefix caches, exports and router statistics stay per layer.

Under tensor parallelism (`RuntimeConfig.tensor_parallel_axis`) attention splits query heads,
Gated DeltaNet key heads, dense MLPs their columns, MoE blocks whole experts and the embedding and
head the vocabulary (each module's docstring; the parameter layouts are `jtree.parallel.sharding`'s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.config.architectures import MOE_FEED_FORWARDS, DecoderSpec, FeedForward, LayerKind
from jtree.config.runtime import RuntimeConfig
from jtree.kernels import TreeMask
from jtree.kernels.precision import accumulation_dtype
from jtree.layout.batch import DeviceBatch
from jtree.models.attention import Attention
from jtree.models.gated_deltanet import GatedDeltaNet, GdnRouting, gdn_routing
from jtree.models.kda import KimiDeltaAttention
from jtree.models.layers import (
    NORMS,
    ReluSquaredMLP,
    SwiGLU,
    call_layer,
    linear,
    rope_attention_factor,
    rope_cos_sin,
    rope_inverse_frequencies,
    vocab_parallel_embed,
)
from jtree.models.mla import MultiHeadLatentAttention
from jtree.models.mamba2 import Mamba2
from jtree.models.moe import RouterStats, SparseMoeBlock, load_balancing_loss, router_load
from jtree.models.mtp import MultiTokenPredictor, mtp_layer_kind
from jtree.models.output import ModelOutput
from jtree.models.prefix import LayerCache, prefix_inputs
from jtree.parallel.context import context_mask
from jtree.parallel.layer_stack import layer_groups


class LayerInputs(NamedTuple):
    """What every decoder layer reads besides its hidden states, built once per forward: RoPE
    tables, the tree mask (with the prefix key ends of a part of a tree), and the Gated DeltaNet
    routing (None without linear-attention layers)."""

    cos: jax.Array
    sin: jax.Array
    mask: TreeMask
    routing: GdnRouting | None


def feed_forward(cfg: Any, runtime: RuntimeConfig, ffn: FeedForward, spec: DecoderSpec, *,
                 rngs: nnx.Rngs) -> SwiGLU | ReluSquaredMLP | SparseMoeBlock:
    """The feed-forward block of kind `ffn`, with the biases and activation `spec` says (Llama's
    `mlp_bias` on a dense MLP; gpt-oss's router and expert biases and clamped SwiGLU)."""
    kw = dict(init_std=cfg.initializer_range, dtype=runtime.compute_dtype,
              param_dtype=runtime.weight_dtype, rngs=rngs, tp_axis=runtime.tensor_parallel_axis)
    if ffn == "mlp":
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=spec.mlp_bias, **kw)
    if ffn == "relu2_mlp":
        return ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, bias=spec.mlp_bias, **kw)
    # DeepSeekMoE and Nemotron 3's: the group-limited router, the shared experts ungated
    deepseek = ffn in ("deepseek_moe", "relu2_moe")
    return SparseMoeBlock(
        cfg.hidden_size, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        moe_intermediate=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
        shared_intermediate=(cfg.shared_expert_intermediate_size
                             if ffn in ("moe_shared", "deepseek_moe", "relu2_moe") else None),
        expert_dispatch=runtime.expert_dispatch, expert_matmul=runtime.expert_matmul,
        router_bias=spec.router_bias,
        expert_bias=spec.expert_bias, clamp=spec.swiglu_clamp,
        grouped=(cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) if deepseek else None,
        shared_gate=not deepseek, relu2=ffn == "relu2_moe", **kw)


class DecoderLayer(nnx.Module):
    """Pre-norm residual layer: x + mixer(norm(x)), then + ffn(norm(x)). The mixer is
    `self_attn` (attention, gated or not, MLA, or Kimi-Linear's KDA), `linear_attn` (Gated
    DeltaNet) or `mixer` (Mamba2), as HF names them. A layer whose mixer or feed-forward is "none" (Nemotron-H's) is the one other
    branch after `input_layernorm` alone."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, kind: LayerKind, spec: DecoderSpec, *,
                 rngs: nnx.Rngs):
        if kind.mixer == "gated_deltanet":
            self.linear_attn = GatedDeltaNet(cfg, runtime, projections=spec.gdn_projections,
                                            rngs=rngs)
        elif kind.mixer == "mla":  # (Kimi-Linear's has no RoPE: rotary_dim 0)
            self.self_attn = MultiHeadLatentAttention(cfg, runtime, rngs=rngs,
                                                      rope=spec.rotary_dim > 0)
        elif kind.mixer == "kda":  # (HF names Kimi-Linear's KDA `self_attn` too)
            self.self_attn = KimiDeltaAttention(cfg, runtime, rngs=rngs)
        elif kind.mixer == "mamba2":
            self.mixer = Mamba2(cfg, runtime, rngs=rngs)
        elif kind.mixer != "none":
            self.self_attn = Attention(
                cfg, runtime, spec, gated=kind.mixer == "gated_attention",
                window=spec.sliding_window if kind.mixer == "sliding_attention" else None,
                rngs=rngs)
        if kind.ffn != "none":
            self.mlp = feed_forward(cfg, runtime, kind.ffn, spec, rngs=rngs)
        norm_cls = NORMS[spec.norm]
        self.input_layernorm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                        param_dtype=runtime.weight_dtype)
        if "none" not in kind:
            self.post_attention_layernorm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                                     param_dtype=runtime.weight_dtype)
        self.kind = kind

    def __call__(self, x: jax.Array, inputs: LayerInputs, prefix: LayerCache | None = None,
                 replay: jax.Array | None = None
                 ) -> tuple[jax.Array, RouterStats | None, LayerCache]:
        """Output, router statistics (MoE layers) and what later parts read (`ModelOutput`).
        `replay` [..., S, k]: a MoE layer's replayed experts (`SparseMoeBlock`)."""
        h = self.input_layernorm(x)
        if self.kind.mixer == "none":  # a feed-forward-only layer caches nothing
            y, stats = self._feed_forward(h, replay)
            return x + y, stats, None
        if self.kind.mixer == "gated_deltanet":
            h, cache = self.linear_attn(h, inputs.routing, prefix)
        elif self.kind.mixer == "mamba2":
            h, cache = self.mixer(h, inputs.routing, prefix)
        elif self.kind.mixer == "kda":
            h, cache = self.self_attn(h, inputs.routing, prefix)
        else:
            h, cache = self.self_attn(h, inputs.cos, inputs.sin, inputs.mask, prefix)
        x = x + h
        if self.kind.ffn == "none":
            return x, None, cache
        y, stats = self._feed_forward(self.post_attention_layernorm(x), replay)
        return x + y, stats, cache

    def _feed_forward(self, h: jax.Array, replay: jax.Array | None
                      ) -> tuple[jax.Array, RouterStats | None]:
        if self.kind.ffn in MOE_FEED_FORWARDS:
            return self.mlp(h, replay)
        return self.mlp(h), None


class Decoder(nnx.Module):
    """Embedding, decoder layers and final norm (HF `*Model`, the `model.` of parameter names)."""

    def __init__(self, cfg: Any, runtime: RuntimeConfig, spec: DecoderSpec, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=runtime.compute_dtype,
            param_dtype=runtime.weight_dtype,
            embedding_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)
        layers = [DecoderLayer(cfg, runtime, kind, spec, rngs=rngs) for kind in spec.layers]
        if runtime.scan_layers:
            self.groups = layer_groups(spec.layers)
            self.blocks = nnx.List([
                nnx.List([_stacked([layers[g.layer(r, j)] for r in range(g.repeats)])
                          for j in range(len(g.block))])
                for g in self.groups])
        else:
            self.layers = nnx.List(layers)
        self.norm = NORMS[spec.norm](cfg.hidden_size, eps=cfg.rms_norm_eps,
                                     param_dtype=runtime.weight_dtype)
        self.runtime = runtime

    def __call__(self, tokens: jax.Array, inputs: LayerInputs,
                 prefix: Sequence[LayerCache] | None = None,
                 replay: Sequence[jax.Array | None] | None = None
                 ) -> tuple[jax.Array, list[RouterStats], tuple[LayerCache, ...]]:
        """Final hidden states, the MoE layers' router statistics and every layer's exports.
        `replay`: per layer, the replayed experts [..., S, k] of a MoE layer (None elsewhere)."""
        x = vocab_parallel_embed(self.embed_tokens, tokens, self.runtime.tensor_parallel_axis)
        if self.runtime.scan_layers:
            x, outs = self._scanned(x, inputs, prefix, replay)
        else:
            outs = []
            for i, layer in enumerate(self.layers):
                x, stats, cache = call_layer(layer, x, inputs,
                                             None if prefix is None else prefix[i],
                                             None if replay is None else replay[i],
                                             remat=self.runtime.remat)
                outs.append((stats, cache))
        all_stats = [stats for stats, _ in outs if stats is not None]
        return self.norm(x), all_stats, tuple(cache for _, cache in outs)

    def _scanned(self, x: jax.Array, inputs: LayerInputs,
                 prefix: Sequence[LayerCache] | None,
                 replay: Sequence[jax.Array | None] | None
                 ) -> tuple[jax.Array, list[tuple[RouterStats | None, LayerCache]]]:
        """The layers group by group, each group's block as the body of one `jax.lax.scan` over
        its repeats (`call_layer` runs every layer, so remat applies inside the body). Prefix
        caches and replayed experts go in and exports and router statistics come out per layer,
        as unscanned."""
        outs: dict[int, tuple[RouterStats | None, LayerCache]] = {}

        def per_position(per_layer: Sequence[Any] | None, group: Any) -> list[Any] | None:
            """Each block position's per-layer values, stacked over the group's repeats."""
            return None if per_layer is None else [
                jax.tree.map(lambda *c: jnp.stack(c),
                             *(per_layer[group.layer(r, j)] for r in range(group.repeats)))
                for j in range(len(group.block))]

        for group, block in zip(self.groups, self.blocks):
            graphdef, params = nnx.split(block)
            repeats, width = group.repeats, len(group.block)
            caches, replays = per_position(prefix, group), per_position(replay, group)

            def body(x, xs, graphdef=graphdef):
                block_params, block_caches, block_replays = xs
                step = []
                for j, layer in enumerate(nnx.merge(graphdef, block_params)):
                    x, stats, cache = call_layer(
                        layer, x, inputs, None if block_caches is None else block_caches[j],
                        None if block_replays is None else block_replays[j],
                        remat=self.runtime.remat)
                    step.append((stats, cache))
                return x, step

            x, stacked = jax.lax.scan(body, x, (params, caches, replays))
            for r in range(repeats):
                for j in range(width):
                    outs[group.layer(r, j)] = jax.tree.map(lambda a: a[r], stacked[j])
        return x, [outs[i] for i in sorted(outs)]


def _stacked(layers: list[DecoderLayer]) -> DecoderLayer:
    """One layer whose parameters are those of `layers` (all of one kind) stacked on a leading
    axis: built from the per-layer modules, so a scanned model starts from the very weights of
    the unscanned one of the same seed."""
    graphdef, first = nnx.split(layers[0])
    states = [first, *(nnx.state(layer) for layer in layers[1:])]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class CausalLM(nnx.Module):
    """A causal LM of any architecture (HF `*ForCausalLM`): `config` is the architecture's
    config (`jtree.models.architectures`), `runtime` how to run it."""

    def __init__(self, config: Any, runtime: RuntimeConfig, *, rngs: nnx.Rngs,
                 value_head: bool = False, critic: Any = None, lm_head: bool = True,
                 mtp_depth: int = 0):
        """`value_head`: PPO's critic as a value head on this model's trunk; `critic`: PPO's
        critic as a model of its own, of that architecture config (a `CausalLM` with a value
        head and no LM head, built after this model's parameters, so the policy's initial
        weights do not depend on it); `lm_head=False` leaves out the untied LM head;
        `mtp_depth` > 0 adds multi-token-prediction modules of that depth
        (`jtree.models.mtp`, `objective.mtp_weight`), built after every other parameter."""
        self.config, self.runtime, self.spec = config, runtime, config.decoder()
        self.model = Decoder(config, runtime, self.spec, rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings or not lm_head else linear(
            config.hidden_size, config.vocab_size, bias=False,
            init_std=config.initializer_range, dtype=runtime.compute_dtype,
            param_dtype=runtime.weight_dtype, rngs=rngs)
        # PPO's critic on the policy trunk (`jtree.objectives.critic`): final hidden state -> value.
        self.value_head = linear(
            config.hidden_size, 1, bias=True, init_std=config.initializer_range,
            dtype=runtime.compute_dtype, param_dtype=runtime.weight_dtype,
            rngs=rngs) if value_head else None
        self.critic = None if critic is None else CausalLM(
            critic, runtime, rngs=rngs, value_head=True, lm_head=False)
        self.mtp = None if mtp_depth <= 0 else MultiTokenPredictor(
            config, runtime, self.spec,
            [DecoderLayer(config, runtime, mtp_layer_kind(self.spec), self.spec, rngs=rngs)
             for _ in range(mtp_depth)], rngs=rngs)

    def __call__(self, inputs: DeviceBatch,
                 prefix: Sequence[LayerCache] | None = None) -> ModelOutput:
        """`prefix`: per-layer caches of the tokens above a part (`jtree.models.prefix`)."""
        cfg, spec = self.config, self.spec
        mask, prefix_pred = prefix_inputs(inputs, prefix)
        if spec.sliding_window is not None:
            mask = self._with_positions(mask, inputs, prefix)
        if self.runtime.context_axis is not None:
            mask = context_mask(mask, self.runtime.context_axis)
        routing = None
        if spec.needs_gdn_tables:
            gdn = inputs.gdn
            if gdn is None:
                raise ValueError("inputs: 'gdn' missing; linear-attention layers need the chunk "
                                 "tables of jtree.layout.linearize (gdn_chunk_size)")
            routing = gdn_routing(inputs.pred, gdn, cfg.linear_conv_kernel_dim, prefix_pred,
                                  self.runtime.context_axis)
        cos, sin = rope_cos_sin(inputs.pos, rope_inverse_frequencies(
            spec.rotary_dim, cfg.rope_theta, spec.rope_scaling),
            rope_attention_factor(spec.rope_scaling))
        layer_inputs = LayerInputs(cos, sin, mask, routing)
        hidden, stats, exports = self.model(inputs.tokens, layer_inputs, prefix,
                                            self._replay(inputs.routed_experts))
        mtp = None if self.mtp is None else self.mtp(
            hidden, vocab_parallel_embed(self.model.embed_tokens, inputs.tokens,
                                         self.runtime.tensor_parallel_axis),
            inputs.pred, inputs.pos, layer_inputs)
        if not stats or not cfg.output_router_logits:
            return ModelOutput(hidden, jnp.zeros((), jnp.float32), exports, mtp=mtp)
        aux = cfg.router_aux_loss_coef * load_balancing_loss(
            stats, inputs.path_count, cfg.num_experts, self.runtime.data_parallel_axis,
            inputs.router_load)
        return ModelOutput(hidden, aux, exports,
                           router_load(stats, inputs.path_count, cfg.num_experts), mtp)

    def _with_positions(self, mask: TreeMask, inputs: DeviceBatch,
                        prefix: Sequence[LayerCache] | None) -> TreeMask:
        """`mask` with every key's path position (`TreeMask.positions`), which the windows of
        the sliding-attention layers count in: the batch's `pos` (under context parallelism
        this device's slice, which `context_mask` gathers like the key ends)."""
        if prefix is not None:
            raise ValueError("sliding-window attention layers with a redundancy-free prefix are "
                             "not supported (the prefix keys' path positions are not in its "
                             "layout); train this model in tree or baseline mode")
        pos = inputs.pos
        # (host arrays stay on the host, like `end`, so kernels can build block tables there)
        pos = pos.astype(np.int32) if isinstance(pos, np.ndarray) else jnp.asarray(pos, jnp.int32)
        return dataclasses.replace(mask, positions=pos)

    def _replay(self, routed: jax.Array | None) -> list[jax.Array | None] | None:
        """The batch's `routed_experts` [..., S, L, k] cut per layer: MoE layer m (in order)
        reads [..., S, k] slice m, other layers None. Refuses a batch whose L or k is not this
        model's."""
        if routed is None:
            return None
        moe = [kind.ffn in MOE_FEED_FORWARDS for kind in self.spec.layers]
        want = (sum(moe), getattr(self.config, "num_experts_per_tok", 0))
        if not want[0] or tuple(routed.shape[-2:]) != want:
            raise ValueError(f"inputs.routed_experts: [..., S, {routed.shape[-2]}, "
                             f"{routed.shape[-1]}], but the model has {want[0]} MoE layers of "
                             f"top-{want[1]} routing (routing replay, docs/rl.md)")
        m = np.cumsum(moe) - 1
        return [routed[..., m[i], :] if sparse else None for i, sparse in enumerate(moe)]

    def values(self, inputs: DeviceBatch, out: ModelOutput) -> tuple[jax.Array, jax.Array]:
        """PPO's per-token values [..., S] float32 (`accumulation_dtype`; the value of the state
        after each token) and the critic's auxiliary loss, given this model's output `out` on
        `inputs`: the value head on `out`'s hidden states, or the separate critic run on the same
        `inputs` (its hidden states, like the policy's, once per tree token)."""
        if self.critic is not None:
            # The engine's routed experts are the policy's: the critic routes itself.
            critic_out = self.critic(dataclasses.replace(inputs, routed_experts=None))
            return self.critic.values(inputs, critic_out)[0], critic_out.aux_loss
        if self.value_head is None:
            raise ValueError("model: no value head (build it with value_head=True or a "
                             "critic; objective.critic does)")
        values = self.value_head(out.hidden)[..., 0]
        return (values.astype(accumulation_dtype(values.dtype)),
                jnp.zeros((), jnp.float32))

    def output_embedding(self) -> jax.Array:
        """[hidden, vocab] matrix mapping final hidden states to logits (this device's vocabulary
        columns under tensor parallelism)."""
        if self.lm_head is None:
            w = self.model.embed_tokens.embedding[...].T
        else:
            w = self.lm_head.kernel[...]
        return w.astype(self.runtime.compute_dtype)
