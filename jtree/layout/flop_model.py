"""Work model of a training step: what tree mode saves, in FLOPs (docs/design.md section 8).

A step's work has three parts that scale differently:
- per computed token: the projections and MLP of every layer (q, k, v, o, gate, up, down; the
  experts a token visits in MoE layers; Gated DeltaNet projections and state updates);
- per visible (query, key) pair: attention scores and the weighted sum of values;
- per scored token (a token with a non-zero loss coefficient): the output projection to the
  vocabulary and its softmax. Both modes score exactly the tokens that carry a loss coefficient
  (`jtree.objectives.logprobs.scored_logprobs`), so this is the minimum loss work, not one per position.

Sharing saves tokens, scored tokens and pairs in different proportions: a query of a branch still
sees every key of the shared prefix, so pairs shrink less than tokens. The ideal speedup
FLOPs_baseline / FLOPs_tree is therefore at most the token bound N_flat / N_computed and equals it
when attention is negligible.

Training FLOPs per unit are the forward matmul FLOPs times the number of matmul passes the
implementation makes: 3 for projections (forward, input and weight gradients), 3.5 for attention
(the flash-style backward recomputes the scores: 2 forward + 5 backward matmuls) and 4 for the
loss (forward logits, recomputed logits, hidden and weight gradients).

`layout_cost` prices a concrete layout instead of the ideal: every position of the padded
[rows, S] arrays pays the per-token work and attention is priced by the blocks a block-sparse
kernel computes. It is what the automatic mode choice (`choose_mode`) compares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jtree.config.architectures import LayerKind
from jtree.layout.linearize import TreeBatch
from jtree.trees.tree import TrajectoryTree

PROJECTION_PASSES = 3.0
ATTENTION_PASSES = 3.5
LOSS_PASSES = 4.0


@dataclasses.dataclass(frozen=True)
class FlopModel:
    """Training FLOPs per computed token, per visible attention pair, per scored token.

    `per_window_token`: the sliding-window attention layers' (gpt-oss) work per computed token,
    priced as a full window of keys each: exact for every token at path position W - 1 or later,
    an upper bound for the first W - 1 of a path (the window along the path is then shorter).
    Their pairs are not in `per_pair`, which counts the layers that see every ancestor."""

    per_token: float
    per_pair: float
    per_scored: float
    per_window_token: float = 0.0

    @classmethod
    def for_config(cls, cfg: Any) -> FlopModel:
        """From an architecture config (`jtree.models.architectures`): the layer kinds its
        `decoder()` chooses, each counted by `_layer_macs`, and the output projection."""
        per_token = per_pair = per_window_pair = 0.0
        spec = cfg.decoder()
        for kind in spec.layers:
            token, pair = _layer_macs(cfg, kind)
            per_token += token
            if kind.mixer == "sliding_attention":
                per_window_pair += pair
            else:
                per_pair += pair
        window = spec.sliding_window or 0
        return cls(per_token=PROJECTION_PASSES * 2.0 * per_token,
                   per_pair=ATTENTION_PASSES * per_pair,
                   per_scored=LOSS_PASSES * 2.0 * cfg.hidden_size * cfg.vocab_size,
                   per_window_token=ATTENTION_PASSES * per_window_pair * window)

    def flops(self, work: Work) -> float:
        return ((self.per_token + self.per_window_token) * work.tokens
                + self.per_pair * work.pairs + self.per_scored * work.scored)

    def shares(self, work: Work) -> dict[str, float]:
        """Fraction of the FLOPs spent per token, per pair (attention, the windowed layers'
        included) and per scored token."""
        total = self.flops(work)
        return {"tokens": self.per_token * work.tokens / total,
                "attention": (self.per_pair * work.pairs
                              + self.per_window_token * work.tokens) / total,
                "loss": self.per_scored * work.scored / total}


def _layer_macs(cfg: Any, kind: LayerKind) -> tuple[float, float]:
    """Multiply-adds of one decoder layer per computed token and per visible attention pair.

    Attention: q/k/v/o (the gated form's q_proj is twice as wide) and 4 x query width per pair
    (for a sliding-window layer, per pair inside the window: `FlopModel.per_window_token`).
    Gated DeltaNet and Kimi Delta Attention: their projections and the per-token state update,
    no pairs. Mamba2: in_proj, out_proj and the state update and read-out (2 x heads x state x
    head dim), no pairs. Dense SwiGLU: gate/up/down; squared-ReLU MLP: up/down. MoE: the router
    and the `num_experts_per_tok` experts a token visits, plus the shared expert and its gate
    (Nemotron 3's squared-ReLU experts and shared expert: up/down, no gates). A "none"
    half (Nemotron-H's single-block layers) costs nothing.
    """
    d = cfg.hidden_size
    if kind.mixer == "gated_deltanet":
        hk = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        hv = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        token = d * (2 * hk + 2 * hv + 2 * cfg.linear_num_value_heads) + hv * d + 4 * state
        pair = 0.0
    elif kind.mixer == "mla":
        token, pair = _mla_macs(cfg)
    elif kind.mixer == "mamba2":
        heads, state = cfg.mamba_num_heads, cfg.ssm_state_size
        inner = heads * cfg.mamba_head_dim
        token = d * (2 * inner + 2 * cfg.n_groups * state + heads) + inner * d
        token += 2 * heads * state * cfg.mamba_head_dim
        pair = 0.0
    elif kind.mixer == "kda":
        token = _kda_macs(cfg)
        pair = 0.0
    elif kind.mixer == "none":
        token = pair = 0.0
    else:
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        token = d * q * (2 if kind.mixer == "gated_attention" else 1) + 2 * d * kv + q * d
        pair = 4.0 * q
    if kind.ffn == "none":
        return token, pair
    if kind.ffn == "mlp":
        return token + 3.0 * d * cfg.intermediate_size, pair
    if kind.ffn == "relu2_mlp":
        return token + 2.0 * d * cfg.intermediate_size, pair
    if kind.ffn == "relu2_moe":  # up/down experts and shared expert, no gates
        token += d * cfg.num_experts + 2.0 * d * (
            cfg.num_experts_per_tok * cfg.moe_intermediate_size
            + cfg.shared_expert_intermediate_size)
        return token, pair
    token += d * cfg.num_experts + cfg.num_experts_per_tok * 3.0 * d * cfg.moe_intermediate_size
    if kind.ffn == "moe_shared":
        token += 3.0 * d * cfg.shared_expert_intermediate_size + d
    if kind.ffn == "deepseek_moe":
        token += 3.0 * d * cfg.shared_expert_intermediate_size
    return token, pair


def _kda_macs(cfg: Any) -> float:
    """Kimi Delta Attention (`jtree.models.kda`) per token: q/k/v/o projections of H heads of d,
    b_proj, the rank-d forget-gate and output-gate projections (each hidden -> d -> H d), and
    the state update and read-out (4 H d^2, as the Gated DeltaNet's)."""
    d, h, dk = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    return 4.0 * d * h * dk + d * h + 2.0 * (d * dk + dk * h * dk) + 4.0 * h * dk * dk


def _mla_macs(cfg: Any) -> tuple[float, float]:
    """MLA (`jtree.models.mla`) per token: the query path (through the `q_lora_rank`
    bottleneck or one q_proj), the latent and shared RoPE key, the latent's expansion into every
    head's key part and value, o_proj; per pair H (qk_head_dim + v_head_dim) (scores and the
    weighted values; the expanded keys, not the absorbed-latent form)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    q = h * cfg.qk_head_dim
    query = d * q if cfg.q_lora_rank is None else cfg.q_lora_rank * (d + q)
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (
        cfg.qk_nope_head_dim + cfg.v_head_dim)
    return query + kv + h * cfg.v_head_dim * d, 2.0 * h * (cfg.qk_head_dim + cfg.v_head_dim)


@dataclasses.dataclass(frozen=True)
class Work:
    """Units of work of one step: computed tokens, visible (query, key) pairs, scored tokens."""

    tokens: int
    pairs: int
    scored: int

    def __add__(self, other: Work) -> Work:
        return Work(self.tokens + other.tokens, self.pairs + other.pairs,
                    self.scored + other.scored)


def batch_work(batch: TreeBatch) -> Work:
    """The work a linearized batch (tree or baseline) really needs, padding excluded: a token at
    path position p sees p + 1 keys (its ancestors and itself), whatever the layout."""
    inputs = batch.inputs
    valid = inputs.valid
    return Work(tokens=int(valid.sum()),
                pairs=int((inputs.pos[valid].astype(np.int64) + 1).sum()),
                scored=int(np.count_nonzero(inputs.score_index >= 0)))


def tree_work(trees: Sequence[TrajectoryTree]) -> tuple[Work, Work]:
    """(tree-mode work, baseline work) of whole trees, from the trees alone (no layout).

    A token is scored in a path when its loss mask is 1, it is not the path's first token and the
    path's weight is positive; a tree token is scored when some path through it scores it.
    """
    tree, base = Work(0, 0, 0), Work(0, 0, 0)
    for t in trees:
        lengths = t.path_lengths
        masks = np.concatenate(t.loss_masks)
        firsts = np.cumsum(lengths) - lengths
        masks[firsts] = 0.0
        masks *= np.repeat(t.weights > 0, lengths)
        on = masks != 0
        pos = t.token_arrays["pos"].astype(np.int64)
        tree = tree + Work(t.n_tree_tokens, int((pos + 1).sum()),
                           int(np.unique(t.flat_token_index[on]).size))
        base = base + Work(int(lengths.sum()), int((lengths * (lengths + 1) // 2).sum()),
                           int(on.sum()))
    return tree, base


def ideal_speedup(model: FlopModel, tree: Work, base: Work) -> float:
    """FLOPs_baseline / FLOPs_tree (docs/design.md section 8)."""
    return model.flops(base) / model.flops(tree)


def token_bound(tree: Work, base: Work) -> float:
    """N_flat / N_computed (the seeds' bound, 1 / (1 - POR) when every tree fits a row)."""
    return base.tokens / tree.tokens


# ---------------------------------------------------------------------- layouts and mode choice


def layout_cost(model: FlopModel, padded_tokens: int, blocks: int, block_area: int,
                scored: int) -> float:
    """FLOPs of a concrete layout: every padded position pays the per-token work, attention pays
    for `blocks` computed blocks of `block_area` pairs."""
    return ((model.per_token + model.per_window_token) * padded_tokens
            + model.per_pair * blocks * block_area + model.per_scored * scored)


def estimated_blocks(work: Work, block: int) -> int:
    """Blocks a block-sparse kernel computes for `work.pairs` pairs, when the layout is not built:
    the pairs spread over blocks of `block` x `block`, plus one partial diagonal block per
    `block` tokens."""
    return -(-work.pairs // (block * block)) + -(-work.tokens // block)


@dataclasses.dataclass(frozen=True)
class ModeChoice:
    """Which mode to train a batch in, the predicted gain of tree mode and why."""

    mode: str
    predicted_gain: float
    reason: str


def choose_mode(model: FlopModel, trees: Sequence[TrajectoryTree], *, tree_tokens: int,
                baseline_tokens: int, min_gain: float, block: int = 64) -> ModeChoice:
    """Tree mode when its predicted gain over the baseline is at least `min_gain`, else baseline.

    `tree_tokens` / `baseline_tokens` are the padded positions each mode's layout computes (rows x
    row length of the step shapes). Attention is priced by `estimated_blocks`; the loss by scored
    tokens. Both modes give the same loss and gradients, so the choice only affects speed.
    """
    tree, base = tree_work(trees)
    cost_tree = layout_cost(model, tree_tokens, estimated_blocks(tree, block), block * block,
                            tree.scored)
    cost_base = layout_cost(model, baseline_tokens, estimated_blocks(base, block),
                            block * block, base.scored)
    gain = cost_base / cost_tree
    por = 1.0 - tree.tokens / base.tokens
    if gain >= min_gain:
        return ModeChoice("tree", gain, f"predicted gain {gain:.2f}x >= {min_gain:.2f} "
                                        f"(POR {por:.3f})")
    return ModeChoice("baseline", gain, f"predicted gain {gain:.2f}x < {min_gain:.2f} "
                                        f"(POR {por:.3f}): sharing too low to pay")
