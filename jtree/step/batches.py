"""Host-side batch assembly for a step: trees laid out in tree or baseline mode and stacked into
micro-batches, and the policy for when PPO's old log-probs must be recomputed rather than read
from the data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from jtree.config.objective import Objective
from jtree.layout.baseline import linearize_baseline
from jtree.layout.batch import DeviceBatch, stack
from jtree.layout.linearize import TreeBatch, linearize
from jtree.layout.microbatches import same_score_len
from jtree.trees.tree import TrajectoryTree


def build_batch(trees: Sequence[TrajectoryTree], seq_len: int, *,
                mode: Literal["tree", "baseline"], **options: Any) -> TreeBatch:
    """Linearize `trees` in tree mode or as the per-path baseline (`options`:
    `jtree.layout.linearize.RowOptions`' fields).

    Pass `normalizer` (from `jtree.layout.coefficients.batch_normalizer` over the whole step) when
    `trees` is one micro-batch of a larger step, so the micro-batch losses sum to the step loss.
    Models with linear-attention layers need `gdn_chunk_size` (chunk tables) and, for
    micro-batches that must stack, one `gdn_chunks` for all of them (see
    `jtree.layout.gdn_tables.default_chunk_count`).
    """
    fn = {"tree": linearize, "baseline": linearize_baseline}.get(mode)
    if fn is None:
        raise ValueError(f"mode: {mode!r} is not 'tree' or 'baseline'")
    return fn(trees, seq_len, **options)


def stack_microbatches(batches: Sequence[TreeBatch]) -> DeviceBatch:
    """Stack equally shaped batches into [M, rows, S] step inputs (one `score_index` width)."""
    shapes = {b.shape for b in batches}
    if len(shapes) != 1:
        raise ValueError(f"micro-batches must share one shape, got {sorted(shapes)}")
    return stack([b.inputs for b in same_score_len(batches)])


def needs_old_logprobs(batch: TreeBatch, objective: Objective) -> bool:
    """Whether the PPO step must recompute old log-probs on the tree before the update.

    Per-path old log-probs from a rollout engine can disagree on shared tokens; then the clipped
    surrogate is no longer a function of one ratio per tree token, and the documented policy is to
    recompute them with the current (pre-update) parameters on the tree. With
    `objective.off_policy` they are always recomputed: the data's old log-probs are then the
    behavior log-probs mu, and the weights compare them with the trainer's own pi_old.
    """
    return old_logprobs_stale(batch.has_old_logprobs, batch.old_logprob_disagreement, objective)


def old_logprobs_stale(has_old: bool, disagreement: float, objective: Objective) -> bool:
    """`needs_old_logprobs` from a batch's flags (missing, or disagreeing beyond tolerance, or
    the off-policy weights' pi_old)."""
    if objective.kind == "sft":
        return False
    return (not has_old or disagreement > objective.old_logprob_tolerance
            or objective.off_policy.enabled)
