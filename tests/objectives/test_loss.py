"""Loss coefficients and the PPO identity checked against per-path brute force (no model)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jtree.config.objective import NORMALIZATIONS
from jtree.layout.coefficients import batch_normalizer, token_coefficients
from jtree.layout.linearize import linearize
from jtree.objectives.losses import ppo_loss, sft_loss
from tests.strategies import forests


def _per_path_c(trees, normalization):
    """c[p, t] straight from the docs/design.md formulas, one Python loop per token."""
    paths = [(t, p) for t in trees for p in range(t.n_paths)]
    n = {(id(t), p): sum(t.loss_masks[p][1:]) for t, p in paths}
    k_w = sum(float(t.weights[p]) for t, p in paths)
    tok_norm = sum(float(t.weights[p]) * n[(id(t), p)] for t, p in paths)
    out = {}
    for t, p in paths:
        w, m = float(t.weights[p]), t.loss_masks[p]
        c = []
        for i in range(len(m)):
            mi = m[i] if i > 0 else 0.0
            if normalization == "seq_mean_token_mean":
                c.append(w * mi / (k_w * n[(id(t), p)]) if n[(id(t), p)] else 0.0)
            elif normalization == "seq_mean_token_sum":
                c.append(w * mi / k_w)
            else:
                c.append(w * mi / tok_norm if tok_norm else 0.0)
        out[(id(t), p)] = np.array(c)
    return out


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@settings(max_examples=25)
@given(trees=forests(n_trees=(1, 3)))
def test_coefficients_match_per_path_sums(trees, normalization):
    c = _per_path_c(trees, normalization)
    norm = batch_normalizer(trees, normalization)
    for t in trees:
        got = token_coefficients(t, normalization, norm)
        want_w = np.zeros(t.n_tree_tokens)
        want_p = np.zeros(t.n_tree_tokens)
        want_n = np.zeros(t.n_tree_tokens)
        for p in range(t.n_paths):
            cp = c[(id(t), p)]
            adv = t.advantages[p]
            for i, tok in enumerate(t.path_token_index(p)):
                want_w[tok] += cp[i]
                if cp[i] * adv[i] >= 0:
                    want_p[tok] += cp[i] * adv[i]
                else:
                    want_n[tok] += cp[i] * adv[i]
        np.testing.assert_allclose(got["weight"], want_w, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(got["adv_pos"], want_p, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(got["adv_neg"], want_n, rtol=1e-6, atol=1e-9)


@settings(max_examples=25)
@given(trees=forests(n_trees=(1, 3)))
def test_tree_losses_equal_per_path_losses(trees):
    """With log-probs that depend only on the tree token (as a model's do), the tree SFT and
    clipped-PPO losses equal the per-path sums, whatever the advantages of sharing paths."""
    rng = np.random.default_rng(0)
    batch = linearize(trees, 48, normalization="seq_mean_token_mean")
    logp = np.where(batch.inputs.valid, -rng.uniform(0.1, 5.0, batch.shape), 0.0).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, batch.shape)).astype(np.float32)  # ratios beyond the clip
    ref = (logp + rng.normal(0, 0.3, batch.shape)).astype(np.float32)
    ent = rng.uniform(0, 3, batch.shape).astype(np.float32)
    coefficients = jax.tree_util.tree_map(jnp.asarray, batch.inputs.coefficients)
    tree_sft = float(sft_loss(jnp.asarray(logp), coefficients))
    coefficients = dataclasses.replace(coefficients, old_logprobs=jnp.asarray(old),
                                       ref_logprobs=jnp.asarray(ref))
    tree_ppo, _ = ppo_loss(jnp.asarray(logp), coefficients, clip_low=0.2, clip_high=0.28,
                           kl_coef=0.1, entropy=jnp.asarray(ent), entropy_coef=0.01)

    c = _per_path_c(trees, "seq_mean_token_mean")
    want_sft = want_ppo = 0.0
    for t, r, off in zip(trees, batch.layout.rows, batch.layout.offsets):
        for p in range(t.n_paths):
            idx = t.path_token_index(p) + off
            cp, adv = c[(id(t), p)], t.advantages[p]
            lp, o, rf, e = logp[r, idx], old[r, idx], ref[r, idx], ent[r, idx]
            ratio = np.exp(lp - o)
            surr = np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.28) * adv)
            kl = np.exp(rf - lp) - (rf - lp) - 1
            want_sft += -np.sum(cp * lp)
            want_ppo += np.sum(cp * (-surr + 0.1 * kl - 0.01 * e))
    assert tree_sft == pytest.approx(want_sft, rel=1e-5, abs=1e-7)
    assert float(tree_ppo) == pytest.approx(want_ppo, rel=1e-5, abs=1e-7)
