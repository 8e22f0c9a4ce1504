"""Off-policy correction (docs/rl.md, "Off-policy correction"): TIS / MIS and their sequence-level
forms on branching trees equal a float64 per-path computation written here from the paths alone,
including paths that disagree on a shared token's behavior log-prob; config errors; the metrics."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.config.objective import NORMALIZATIONS, CriticConfig, Objective, OffPolicyConfig
from jtree.config.schema import from_dict
from jtree.layout.linearize import linearize
from jtree.layout.off_policy import off_policy_metrics, path_weights
from jtree.objectives.losses import gspo_loss, ppo_loss
from jtree.trees.tree import TrajectoryTree
from tests.strategies import random_forest

CONFIGS = {
    "tis": OffPolicyConfig(kind="tis", cap=1.2),
    "mis": OffPolicyConfig(kind="mis", low=0.8, high=1.25),
    "seq_tis": OffPolicyConfig(kind="seq_tis", cap=1.05),
    "seq_mis": OffPolicyConfig(kind="seq_mis", low=0.9, high=1.1),
    "seq_mask": OffPolicyConfig(kind="seq_mask", low=0.9, high=1.1),
}
CLIP_LOW, CLIP_HIGH = 0.1, 0.15


def engine_tree(rng: np.random.Generator, shared_mask: bool) -> tuple[TrajectoryTree, np.ndarray]:
    """A random multi-level tree (paths ending inside it, duplicates) whose paths each carry
    their own behavior log-probs mu (one engine value per tree token, moved per path by engine
    noise, so paths disagree on shared tokens), and the trainer's pi_old per tree token."""
    shape = TrajectoryTree.from_nodes(**random_forest(rng, with_rl=False, max_nodes=9,
                                                      extra_paths=4))
    base = -rng.uniform(0.5, 3.0, size=shape.n_tree_tokens)
    paths = [shape.path_token_index(p) for p in range(shape.n_paths)]
    mask = (rng.random(shape.n_tree_tokens) < 0.75).astype(int)
    masks = ([mask[i] for i in paths] if shared_mask else
             [(rng.random(len(i)) < 0.75).astype(int) for i in paths])
    advantages = (rng.normal(size=shape.n_paths).tolist() if shared_mask else
                  [rng.normal(size=len(i)) if rng.random() < 0.5 else float(rng.normal())
                   for i in paths])
    tree = TrajectoryTree.from_nodes(
        shape.parents.tolist(), list(shape.segments), path_nodes=shape.path_nodes.tolist(),
        loss_masks=masks, advantages=advantages,
        old_logprobs=[np.minimum(base[i] + rng.normal(0, 0.15, len(i)), 0.0) for i in paths],
        weights=rng.uniform(0.5, 2.0, size=shape.n_paths).tolist())
    return tree, base + rng.normal(0, 0.15, shape.n_tree_tokens)


def reference_paths(trees, normalization):
    """(k, token index, scored mask, c[p,t], A[p,t], mu_p) per path, c from the normalization's
    formula (design.md section 2) written out here."""
    rows = []
    for k, t in enumerate(trees):
        for p in range(t.n_paths):
            m = t.loss_masks[p].astype(np.float64).copy()
            m[0] = 0.0
            rows.append([k, t.path_token_index(p), m, float(t.weights[p]),
                         t.advantages[p].astype(np.float64), t.old_logprobs[p].astype(np.float64)])
    w_sum = sum(r[3] for r in rows)
    wn_sum = sum(r[3] * r[2].sum() for r in rows)
    out = []
    for k, idx, m, w, a, mu in rows:
        n = m.sum()
        c = {"seq_mean_token_mean": w * m / (w_sum * max(n, 1.0)),
             "seq_mean_token_sum": w * m / w_sum, "token_mean": w * m / wn_sum}[normalization]
        out.append((k, idx, m, c, a, mu))
    return out


def reference_weight(kind, cfg, log_ratio, m):
    """The per-token importance weights of one path from its log-ratios pi_old - mu."""
    n = m.sum()
    r = np.exp(log_ratio) if not kind.startswith("seq_") else \
        np.full(m.shape, np.exp(np.sum(m * log_ratio) / n) if n else 1.0)
    if kind.endswith("tis"):
        return np.minimum(r, cfg.cap), r > cfg.cap
    outside = (r < cfg.low) | (r > cfg.high)
    return np.where(outside, 0.0, 1.0 if kind == "seq_mask" else r), outside


def reference_loss(trees, logp, pi_old, normalization, kind, sequence):
    """Per-path PPO (token ratios) or GSPO (`sequence`: one ratio per path) with the off-policy
    weights, float64: (loss, d loss / d logp per tree token of each tree, corrected fraction)."""
    cfg = CONFIGS[kind]
    loss, grads = 0.0, [np.zeros(t.n_tree_tokens) for t in trees]
    corrected = []
    for k, idx, m, c, a, mu in reference_paths(trees, normalization):
        w, hit = reference_weight(kind, cfg, pi_old[k][idx] - mu, m)
        corrected.append(hit[m > 0])
        if not sequence:
            rho = np.exp(logp[k][idx] - pi_old[k][idx])
            clip = np.clip(rho, 1 - CLIP_LOW, 1 + CLIP_HIGH)
            loss -= np.sum(c * w * np.minimum(rho * a, clip * a))
            np.add.at(grads[k], idx, np.where(rho * a <= clip * a, -c * w * a * rho, 0.0))
            continue
        n = m.sum()
        if n == 0:
            continue
        s = np.exp(np.sum(m * (logp[k][idx] - pi_old[k][idx])) / n)
        clip = min(max(s, 1 - CLIP_LOW), 1 + CLIP_HIGH)
        cp, wp, ap = c.sum(), w[m > 0][0], a[0]
        loss -= cp * wp * min(s * ap, clip * ap)
        if s * ap <= clip * ap:
            np.add.at(grads[k], idx, -cp * wp * ap * s * m / n)
    return loss, grads, np.concatenate(corrected).mean()


def tree_loss(trees, pi_old, logp_tokens, normalization, kind, sequence, seq_len=112):
    """The tree side: weights folded on the host, the device loss on the linearized batch."""
    cfg = CONFIGS[kind]
    weights = [path_weights(t, o, cfg) for t, o in zip(trees, pi_old)]
    batch = linearize(trees, seq_len, normalization=normalization, path_weights=weights)
    old = np.zeros(batch.shape, np.float32)
    logp = np.zeros(batch.shape, np.float32)
    spans = list(zip(batch.layout.rows, batch.layout.offsets, [t.n_tree_tokens for t in trees]))
    for (r, o, n), po, lp in zip(spans, pi_old, logp_tokens):
        old[r, o:o + n], logp[r, o:o + n] = po, lp
    coefficients = batch.inputs.with_coefficients(old_logprobs=old).coefficients
    end = jnp.asarray(batch.inputs.mask.end)

    def loss_fn(lp):
        if sequence:
            return gspo_loss(lp, coefficients, end, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)[0]
        return ppo_loss(lp, coefficients, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)[0]

    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
    grad = np.asarray(grad)
    return float(loss), [grad[r, o:o + n] for r, o, n in spans]


def check_case(seed, normalization, kind, objective):
    rng = np.random.default_rng(seed)
    sequence = objective == "gspo"
    made = [engine_tree(rng, shared_mask=sequence) for _ in range(4)]
    trees, pi_old = [m[0] for m in made], [m[1] for m in made]
    assert max(int(t.node_levels.max()) for t in trees) >= 2
    assert any(set(t.parents.tolist()) & set(t.path_nodes.tolist()) for t in trees)
    logp = [(o + rng.normal(0, 0.2, o.shape)).astype(np.float32) for o in pi_old]
    pi_old = [o.astype(np.float32) for o in pi_old]
    got_loss, got_grads = tree_loss(trees, pi_old, logp, normalization, kind, sequence)
    want_loss, want_grads, corrected = reference_loss(
        trees, [x.astype(np.float64) for x in logp], [x.astype(np.float64) for x in pi_old],
        normalization, kind, sequence)
    assert 0 < corrected < 1  # the correction really truncates or masks some tokens, not all
    assert abs(got_loss - want_loss) <= 1e-5 * max(abs(want_loss), 1e-3)
    flat_got, flat_want = np.concatenate(got_grads), np.concatenate(want_grads)
    assert np.linalg.norm(flat_got - flat_want) <= 1e-5 * np.linalg.norm(flat_want)


@pytest.mark.parametrize("kind", ["tis", "mis", "seq_tis", "seq_mis", "seq_mask"])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_ppo_with_off_policy_weights_equals_per_path_reference(kind, normalization):
    check_case(3, normalization, kind, "ppo")


@pytest.mark.parametrize("kind", ["seq_tis", "seq_mis", "seq_mask"])
@pytest.mark.parametrize("seed", [1, 2])
def test_gspo_with_off_policy_weights_equals_per_path_reference(kind, seed):
    check_case(seed, "seq_mean_token_mean", kind, "gspo")


def test_paths_disagree_on_shared_behavior_logprobs():
    """The cases above really have paths whose mu differs on a token both train, and shared
    tokens whose weights differ per path."""
    rng = np.random.default_rng(3)
    tree, pi_old = engine_tree(rng, shared_mask=False)
    weights = path_weights(tree, pi_old, CONFIGS["tis"])
    per_token = {}
    for p in range(tree.n_paths):
        for j, t in enumerate(tree.path_token_index(p)):
            if tree.loss_masks[p][j] and j > 0:
                per_token.setdefault(int(t), set()).add(float(weights[p][j]))
    assert any(len(v) > 1 for v in per_token.values())


def test_metrics_equal_numpy_over_pairs():
    rng = np.random.default_rng(5)
    made = [engine_tree(rng, shared_mask=False) for _ in range(3)]
    trees, pi_old = [m[0] for m in made], [m[1] for m in made]
    for kind, cfg in CONFIGS.items():
        got = off_policy_metrics(trees, pi_old, cfg)
        deltas, hits, gap = [], [], 0.0
        for k, idx, m, _, _, mu in reference_paths(trees, "seq_mean_token_sum"):
            x = pi_old[k][idx] - mu
            deltas.append(x[m > 0])
            hits.append(reference_weight(kind, cfg, x, m)[1][m > 0])
        for t in trees:  # every pair of paths, every token both train
            for p, q in itertools.combinations(range(t.n_paths), 2):
                ip, iq = t.path_token_index(p), t.path_token_index(q)
                for j, a in enumerate(ip):
                    for i, b in enumerate(iq):
                        if a == b and j > 0 and i > 0 and t.loss_masks[p][j] and \
                                t.loss_masks[q][i]:
                            gap = max(gap, abs(t.old_logprobs[p][j] - t.old_logprobs[q][i]))
        x = np.concatenate(deltas)
        assert gap > 0
        assert got["offpolicy_kl_k1"] == pytest.approx(np.mean(-x), rel=1e-9)
        assert got["offpolicy_kl_k3"] == pytest.approx(np.mean(np.exp(x) - 1 - x), rel=1e-9)
        assert got["offpolicy_corrected_frac"] == pytest.approx(np.concatenate(hits).mean())
        assert got["offpolicy_behavior_disagreement"] == pytest.approx(gap, rel=1e-6)


def test_kind_none_weighs_nothing():
    rng = np.random.default_rng(0)
    tree, pi_old = engine_tree(rng, shared_mask=False)
    assert all(np.all(w == 1.0) for w in path_weights(tree, pi_old, OffPolicyConfig()))
    with pytest.raises(ValueError, match="kl_mask_delta: the KL sequence mask is formed in "
                                         "the step"):
        path_weights(tree, pi_old, OffPolicyConfig(kl_mask_delta=0.1))
    with pytest.raises(ValueError, match="one old log-prob per tree token"):
        path_weights(tree, pi_old[:-1], CONFIGS["tis"])


@pytest.mark.parametrize("fields, message", [
    ({"kind": "is"}, "kind: 'is' is not one of"),
    ({"kind": "tis"}, "cap: needed by kind 'tis'"),
    ({"kind": "tis", "cap": 0.0}, "cap: 0.0 must be > 0"),
    ({"kind": "tis", "cap": 2.0, "high": 3.0}, "high: not read by kind 'tis'"),
    ({"kind": "mis", "high": 2.0}, "low: needed by kind 'mis'"),
    ({"kind": "seq_mis", "low": 2.0, "high": 1.0}, "must satisfy 0 <= low < high"),
    ({"kind": "mis", "low": 0.5, "high": 2.0, "cap": 2.0}, "cap: not read by kind 'mis'"),
    ({"cap": 2.0}, "cap: not read by kind 'none'"),
    ({"kind": "seq_mask", "low": 0.5}, "high: needed by kind 'seq_mask'"),
    ({"kind": "seq_mask", "low": 0.5, "high": 2.0, "cap": 2.0},
     "cap: not read by kind 'seq_mask'"),
    ({"kl_mask_delta": -0.1}, "kl_mask_delta: -0.1 must be >= 0"),
])
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        OffPolicyConfig(**fields)


def test_objective_refuses_what_the_weights_cannot_fold_into():
    tis = OffPolicyConfig(kind="tis", cap=2.0)
    with pytest.raises(ValueError, match="'sft' has none"):
        Objective(kind="sft", off_policy=tis)
    with pytest.raises(ValueError, match="use seq_tis, seq_mis or seq_mask"):
        Objective(kind="gspo", off_policy=tis)
    with pytest.raises(ValueError, match="with a critic"):
        Objective(kind="ppo", critic=CriticConfig(), off_policy=tis)
    kl_mask = OffPolicyConfig(kl_mask_delta=0.01)
    assert kl_mask.enabled
    Objective(kind="gspo", off_policy=kl_mask)  # a per-path mask: no token ratio to refuse
    with pytest.raises(ValueError, match="off_policy.kl_mask_delta=0.01 weighs a policy-gradient"):
        Objective(kind="sft", off_policy=kl_mask)
    read = from_dict(Objective, {"kind": "gspo", "off_policy": {"kind": "seq_mis", "low": 0.5,
                                                                 "high": 2.0}})
    assert read.off_policy == OffPolicyConfig(kind="seq_mis", low=0.5, high=2.0)
    with pytest.raises(ValueError, match="cap"):
        from_dict(Objective, {"kind": "ppo", "off_policy": {"kind": "tis", "capp": 2.0}})

