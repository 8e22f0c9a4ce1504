"""Per-token log-probabilities on a linearized batch, scored through the `pred` row.

Token i is scored by the logits at row pred(i): the previous token of its path, which for the first
token of a node is the last token of the parent node. The log-sum-exp over the vocabulary is
computed once per row in chunks under `jax.checkpoint`, so neither the forward nor the backward
holds a [rows, S, vocab] logits tensor; the target logit is a d-length dot product per token.

`scored_logprobs` is the training loss's fused cross-entropy: it scores only the tokens listed in
`score_index` (those with a loss coefficient), each chunk of them forming its logits once for both
the log-sum-exp and the target logit under `jax.checkpoint`. Prompt, tool and padding positions
never reach the vocabulary projection, and nothing of size rows x S x vocab exists in the forward
or the backward.

Vocab-parallel (`vocab_axis`, inside `shard_map`): `w_out` holds this device's contiguous slice of
the vocabulary columns; the log-sum-exp combines per-device sums under a shared max, and the target
logit is taken on the device that owns the token and summed over the axis.

Temperature T (`objective.temperature`): every logit is divided by T before the log-softmax, so the
log-probs and entropies are those of the tempered distribution a rollout engine sampled from and
reports (docs/rl.md, "Sampling temperature"). The division happens on the float32 logits (and
target logits), so T = 1 leaves every value bit for bit as it was.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jtree.kernels.precision import accumulation_dtype
from jtree.layout.batch import DeviceBatch
from jtree.parallel.context import scoring_view

DEFAULT_CHUNK = 1024


def _chunked(x: jax.Array, chunk: int) -> jax.Array:
    """x [N, ...] as [n_chunks, size, ...]: the fewest chunks of at most `chunk` rows, all of one
    size (a multiple of 8 unless N is smaller), zero-padded at the end. Balancing the chunks
    bounds the padding by 8 rows per chunk; cutting N = 1408 into chunks of 1024 would compute
    2048 rows of logits, 45% of them padding."""
    n = x.shape[0]
    n_chunks = -(-n // max(1, min(chunk, n)))
    size = -(-n // n_chunks)
    if n_chunks > 1:
        size = min(-(-size // 8) * 8, chunk) if chunk >= 8 else size
    n_chunks = -(-n // size)
    pad = [(0, n_chunks * size - n)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad).reshape(n_chunks, size, *x.shape[1:])


def _logits(h: jax.Array, w_out: jax.Array, temperature: float) -> jax.Array:
    """The tempered logits h @ w_out / T, accumulated in float32 (or wider) so that dividing by T
    costs no precision."""
    logits = jnp.dot(h, w_out, preferred_element_type=accumulation_dtype(h.dtype, w_out.dtype))
    return logits / temperature


def _logsumexp_entropy(logits: jax.Array, with_entropy: bool, vocab_axis: str | None
                       ) -> tuple[jax.Array, jax.Array]:
    """log-sum-exp of each row of `logits` [n, V] (V this device's slice of the vocabulary when
    `vocab_axis` is set) and the entropy of its softmax (zeros unless `with_entropy`)."""
    if vocab_axis is None:
        lse = jax.nn.logsumexp(logits, axis=-1)
    else:  # the max only stabilizes the exponent, so it carries no gradient
        top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), vocab_axis)
        total = jax.lax.psum(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1), vocab_axis)
        lse = top + jnp.log(total)
    if not with_entropy:
        return lse, jnp.zeros_like(lse)
    expected = jnp.sum(jnp.exp(logits - lse[:, None]) * logits, axis=-1)
    if vocab_axis is not None:
        expected = jax.lax.psum(expected, vocab_axis)
    return lse, lse - expected


def _row_logsumexp(h: jax.Array, w_out: jax.Array, chunk: int, with_entropy: bool,
                   vocab_axis: str | None, temperature: float):
    """log-sum-exp (and entropy) of the tempered logits of each row of h [N, d], chunk rows at a
    time."""
    n = h.shape[0]
    padded = _chunked(h, chunk)

    @jax.checkpoint
    def one(hc: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _logsumexp_entropy(_logits(hc, w_out, temperature), with_entropy, vocab_axis)

    lse, ent = jax.lax.map(one, padded)
    return lse.reshape(-1)[:n], ent.reshape(-1)[:n]


def logprobs_from_hidden(
    hidden: jax.Array,
    w_out: jax.Array,
    tokens: jax.Array,
    pred: jax.Array,
    *,
    chunk: int = DEFAULT_CHUNK,
    with_entropy: bool = False,
    vocab_axis: str | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array | None]:
    """log p(tokens | path context) [rows, S] (0 where pred < 0), and optionally the entropy of
    the distribution that scores each token, both at `temperature`. `vocab_axis`: see the module
    docstring."""
    rows, s, d = hidden.shape
    lse, ent = _row_logsumexp(hidden.reshape(rows * s, d), w_out, chunk, with_entropy, vocab_axis,
                              temperature)
    lse, ent = lse.reshape(rows, s), ent.reshape(rows, s)
    has_pred = pred >= 0
    src = jnp.where(has_pred, pred, 0)
    h_src = jnp.take_along_axis(hidden, src[..., None], axis=1)
    target = jnp.einsum(
        "rsd,rsd->rs", h_src, _target_columns(w_out, tokens, vocab_axis),
        preferred_element_type=accumulation_dtype(hidden.dtype, w_out.dtype),
    )
    target = target / temperature
    if vocab_axis is not None:
        target = jax.lax.psum(target, vocab_axis)
    logp = jnp.where(has_pred, target - jnp.take_along_axis(lse, src, axis=1), 0.0)
    entropy = jnp.where(has_pred, jnp.take_along_axis(ent, src, axis=1), 0.0) if with_entropy else None
    return logp, entropy


def scored_logprobs(
    hidden: jax.Array,
    w_out: jax.Array,
    tokens: jax.Array,
    pred: jax.Array,
    score_index: jax.Array,
    *,
    chunk: int = DEFAULT_CHUNK,
    with_entropy: bool = False,
    vocab_axis: str | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array | None]:
    """log p of the tokens at `score_index` [rows, K] (row-local positions, -1 = empty slot):
    [rows, K] float32, 0 on empty slots and for tokens without a scoring row; optionally their
    entropies; both at `temperature`. Same values as `logprobs_from_hidden` gathered at
    `score_index`."""
    rows, _, d = hidden.shape
    k = score_index.shape[1]
    at, live, h = scoring_hidden(hidden, pred, score_index)
    tok = jnp.take_along_axis(tokens, at, axis=1)
    n = rows * k
    h_chunks, tok_chunks = _chunked(h.reshape(n, d), chunk), _chunked(tok.reshape(n), chunk)

    @jax.checkpoint
    def one(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        hc, tc = args
        logits = _logits(hc, w_out, temperature)
        lse, ent = _logsumexp_entropy(logits, with_entropy, vocab_axis)
        if vocab_axis is None:
            target = jnp.take_along_axis(logits, tc[:, None], axis=1)[:, 0]
        else:
            cols = logits.shape[1]
            local = tc - jax.lax.axis_index(vocab_axis) * cols
            inside = (local >= 0) & (local < cols)
            picked = jnp.take_along_axis(logits, jnp.where(inside, local, 0)[:, None], axis=1)
            target = jax.lax.psum(jnp.where(inside, picked[:, 0], 0.0), vocab_axis)
        return target - lse, ent

    logp, ent = jax.lax.map(one, (h_chunks, tok_chunks))
    logp = jnp.where(live, logp.reshape(-1)[:n].reshape(rows, k), 0.0)
    entropy = jnp.where(live, ent.reshape(-1)[:n].reshape(rows, k), 0.0) if with_entropy else None
    return logp, entropy


def scoring_hidden(hidden: jax.Array, pred: jax.Array, index: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For the tokens at `index` [rows, K] (row-local positions, -1 = empty slot): the positions
    clamped to 0 on empty slots, whether each slot is scored (`live`: a token with a scoring
    row), and the hidden state that scores it [rows, K, d] (row `pred` of the token)."""
    at = jnp.where(index >= 0, index, 0)
    src = jnp.take_along_axis(pred, at, axis=1)
    live = (index >= 0) & (src >= 0)
    return at, live, jnp.take_along_axis(hidden, jnp.where(live, src, 0)[..., None], axis=1)


def _log_softmax(logits: jax.Array, vocab_axis: str | None) -> jax.Array:
    """The log-softmax of each row of `logits` [n, V] (V this device's slice of the vocabulary
    when `vocab_axis` is set: the normalizer is the whole vocabulary's)."""
    lse, _ = _logsumexp_entropy(logits, False, vocab_axis)
    return logits - lse[:, None]


def token_distributions(model: Any, inputs: DeviceBatch, *, temperature: float = 1.0,
                        vocab_axis: str | None = None) -> jax.Array:
    """For every token of `inputs`, the whole log-softmax at `temperature` of the distribution
    that scores it (the logits at its row `pred`): [rows, S, vocab] float32 (with `vocab_axis`,
    this device's slice of the vocabulary), 0 where a token has no scoring row. What a
    distillation teacher gives for the full-vocabulary KL (`full_reverse_kl`); one vocabulary
    row per token, so it is for rows short enough to hold it."""
    hidden, pred = model(inputs).hidden, inputs.pred
    rows, s = pred.shape
    index = jnp.broadcast_to(jnp.arange(s, dtype=pred.dtype), (rows, s))
    _, live, h = scoring_hidden(hidden, pred, index)
    logits = _logits(h.reshape(rows * s, h.shape[-1]), model.output_embedding(), temperature)
    logp = _log_softmax(logits, vocab_axis).reshape(rows, s, -1)
    return jnp.where(live[..., None], logp, 0.0)


def full_reverse_kl(hidden: jax.Array, w_out: jax.Array, pred: jax.Array, teacher: jax.Array,
                    index: jax.Array, *, chunk: int = DEFAULT_CHUNK, temperature: float = 1.0,
                    vocab_axis: str | None = None) -> jax.Array:
    """KL(p || p_teacher) = sum_v p(v) (log p(v) - log p_teacher(v)) of each token at `index`
    [rows, K] (-1 = empty slot): p the tempered softmax of the distribution scoring it (row
    `pred` of `hidden` through `w_out`), `teacher` [rows, S, vocab] the teacher's log-softmax
    over the whole vocabulary for every token (`token_distributions`). [rows, K] float32, 0 on
    empty slots. The tokens' logits form `chunk` tokens at a time under `jax.checkpoint`, as in
    `scored_logprobs`; with `vocab_axis` each device sums over its slice of the vocabulary and
    the sums are added over the axis."""
    rows, k = index.shape
    at, live, h = scoring_hidden(hidden, pred, index)
    vocab = teacher.shape[-1]
    t = jnp.take_along_axis(teacher, at[..., None], axis=1)
    n = rows * k
    h_chunks = _chunked(h.reshape(n, h.shape[-1]), chunk)
    t_chunks = _chunked(t.reshape(n, vocab), chunk)

    @jax.checkpoint
    def one(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        hc, tc = args
        logp = _log_softmax(_logits(hc, w_out, temperature), vocab_axis)
        if vocab_axis is None:
            return jnp.sum(jnp.exp(logp) * (logp - tc), axis=-1)
        cols = logp.shape[1]
        tc = jax.lax.dynamic_slice_in_dim(tc, jax.lax.axis_index(vocab_axis) * cols, cols, 1)
        return jax.lax.psum(jnp.sum(jnp.exp(logp) * (logp - tc), axis=-1), vocab_axis)

    kl = jax.lax.map(one, (h_chunks, t_chunks))
    return jnp.where(live, kl.reshape(-1)[:n].reshape(rows, k), 0.0)


def _target_columns(w_out: jax.Array, tokens: jax.Array, vocab_axis: str | None) -> jax.Array:
    """The output-embedding column of every token [rows, S, d] (zero off this device's slice)."""
    if vocab_axis is None:
        return jnp.take(w_out.T, tokens, axis=0)
    cols = w_out.shape[1]
    local = tokens - jax.lax.axis_index(vocab_axis) * cols
    inside = (local >= 0) & (local < cols)
    w = jnp.take(w_out.T, jnp.where(inside, local, 0), axis=0)
    return jnp.where(inside[..., None], w, jnp.zeros_like(w))


def token_logprobs(
    model: Any,
    inputs: DeviceBatch,
    *,
    chunk: int = DEFAULT_CHUNK,
    with_entropy: bool = False,
    vocab_axis: str | None = None,
    temperature: float = 1.0,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """For every token of `inputs`, log p(token | its path context) at `temperature`: a
    [rows, S] float32 array.

    Positions with no scoring row (a sequence's first token, padding) hold 0. With
    `with_entropy=True` also returns the entropy of each token's predictive distribution. Under
    context parallelism (`model.runtime.context_axis`) `inputs` is this device's slice of the
    rows, scored through the halo (`jtree.parallel.context.scoring_view`).
    """
    hidden, pred = model(inputs).hidden, inputs.pred
    if model.runtime.context_axis is not None:
        hidden, pred, _ = scoring_view(hidden, pred, inputs.halo, None,
                                       model.runtime.context_axis)
    logp, entropy = logprobs_from_hidden(
        hidden, model.output_embedding(), inputs.tokens, pred, chunk=chunk,
        with_entropy=with_entropy, vocab_axis=vocab_axis, temperature=temperature,
    )
    return (logp, entropy) if with_entropy else logp
