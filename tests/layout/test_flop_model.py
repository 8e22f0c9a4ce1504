"""Work model (jtree.layout.flop_model), controlled-POR generators (jtree.trees.synthetic) and the mode choice."""

import numpy as np
import pytest

from jtree.config.architectures import Qwen3Config
from jtree.layout.baseline import linearize_baseline
from jtree.layout.flop_model import (
    FlopModel,
    Work,
    batch_work,
    choose_mode,
    ideal_speedup,
    token_bound,
    tree_work,
)
from jtree.layout.linearize import linearize
from jtree.trees.chat import ByteTokenizer, conversation_tree
from jtree.trees.synthetic import chat_record, por_forest, por_tree
from tests.strategies import explicit_tree, random_forest


@pytest.mark.parametrize("por", [0.0, 0.3, 0.5, 0.7, 0.9])
def test_por_tree_has_the_requested_size_paths_and_por(por):
    rng = np.random.default_rng(0)
    tree = por_tree(rng, 600, 12, por, vocab_size=50, trained_fraction=0.5)
    stats = tree.stats()
    assert (stats.n_tree_tokens, stats.n_paths) == (600, 12)
    assert stats.por == pytest.approx(por, abs=5e-3)  # P is rounded to a token
    if por == 0:
        assert stats.n_nodes == 12 and all(p < 0 for p in tree.parents)  # nothing shared
    else:
        assert stats.max_depth == 2 and len(set(tree.path_lengths.tolist())) > 1
    # Trained tokens are the tail of each branch: never the shared prefix.
    for p in range(tree.n_paths):
        mask = tree.loss_masks[p]
        assert mask[-1] == 1 and (por == 0 or mask[0] == 0)


def test_por_tree_rejects_impossible_requests():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="por"):
        por_tree(rng, 100, 4, 1.0)
    with pytest.raises(ValueError, match="no room"):
        por_tree(rng, 100, 3, 0.9)  # 3 paths share at most 2/3 of their tokens


def test_por_forest_keeps_flat_tokens_and_path_length_across_por():
    for por in (0.0, 0.3, 0.7, 0.9):
        trees = por_forest(np.random.default_rng(1), 20000, por, path_len=500,
                           max_tree_tokens=4000)
        stats = sum((t.stats() for t in trees[1:]), trees[0].stats())
        assert stats.n_flat_tokens == pytest.approx(20000, rel=0.01)
        assert stats.por == pytest.approx(por, abs=0.01)
        assert stats.n_flat_tokens / stats.n_paths == pytest.approx(500, rel=0.1)
        assert max(t.n_tree_tokens for t in trees) <= 4000


def _brute_pairs(batch):
    """Visible (query, key) pairs counted from the dense mask j <= i < end[j] on real tokens."""
    total = 0
    for r in range(batch.shape[0]):
        end, valid = batch.inputs.mask.end[r], batch.inputs.valid[r]
        i = np.arange(len(end))
        visible = (i[None, :] <= i[:, None]) & (i[:, None] < end[None, :])
        total += int(visible[valid][:, valid].sum())
    return total


def test_work_counts_match_the_layouts_and_a_brute_force_mask_count():
    rng = np.random.default_rng(3)
    trees = [explicit_tree(random_forest(rng, max_nodes=10, max_seg=6)) for _ in range(4)]
    tree_w, base_w = tree_work(trees)
    tb = linearize(trees, 128)
    bb = linearize_baseline(trees, 128)
    assert batch_work(tb) == tree_w and batch_work(bb) == base_w
    assert tree_w.pairs == _brute_pairs(tb) and base_w.pairs == _brute_pairs(bb)
    assert tree_w.scored == int((tb.inputs.coefficients.weight != 0).sum())
    assert base_w.scored == int((bb.inputs.coefficients.weight != 0).sum())
    assert base_w.tokens == sum(t.stats().n_flat_tokens for t in trees)


def test_flop_model_by_hand_and_ideal_between_one_and_the_token_bound():
    cfg = Qwen3Config(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    fm = FlopModel.for_config(cfg)
    proj = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k+v, o, gate/up/down
    assert fm.per_token == 3 * 2 * proj * 2
    assert fm.per_pair == 3.5 * 4 * 8 * 2
    assert fm.per_scored == 4 * 2 * 8 * 100
    tree, base = tree_work([por_tree(np.random.default_rng(0), 400, 8, 0.7)])
    ideal = ideal_speedup(fm, tree, base)
    assert 1.0 < ideal < token_bound(tree, base)
    no_attention = FlopModel(fm.per_token, 0.0, 0.0)
    assert ideal_speedup(no_attention, tree, base) == pytest.approx(token_bound(tree, base))
    shares = fm.shares(Work(10, 100, 5))
    assert sum(shares.values()) == pytest.approx(1.0)


def test_mode_choice_picks_baseline_without_sharing_and_tree_with_it():
    fm = FlopModel.for_config(Qwen3Config())
    flat = por_forest(np.random.default_rng(0), 3000, 0.0, path_len=300, max_tree_tokens=1000)
    n = sum(t.n_tree_tokens for t in flat)
    choice = choose_mode(fm, flat, tree_tokens=n, baseline_tokens=n, min_gain=1.05)
    assert choice.mode == "baseline" and choice.predicted_gain == pytest.approx(1.0)
    assert "too low" in choice.reason and "POR 0.000" in choice.reason
    shared = por_forest(np.random.default_rng(0), 3000, 0.7, path_len=300, max_tree_tokens=1000)
    n_tree = sum(t.n_tree_tokens for t in shared)
    choice = choose_mode(fm, shared, tree_tokens=n_tree, baseline_tokens=3000, min_gain=1.05)
    assert choice.mode == "tree" and choice.predicted_gain > 2
    # Padding counts: a tree layout padded to the baseline's size gains nothing per token.
    padded = choose_mode(fm, shared, tree_tokens=3000 * 4, baseline_tokens=3000, min_gain=1.05)
    assert padded.mode == "baseline"


def test_chat_records_become_trees_with_one_path_per_assistant_turn():
    rng = np.random.default_rng(5)
    record = chat_record(rng, turns=4, reasoning_prob=1.0, tool_prob=0.0)
    tree = conversation_tree(record, ByteTokenizer())
    n_assistant = sum(m["role"] == "assistant" for m in record["messages"])
    assert tree.n_paths == n_assistant == 4
    assert tree.stats().por > 0.3  # later turns re-read the conversation so far


def test_flop_model_counts_moe_experts_and_linear_attention_layers():
    from jtree.config.architectures import Qwen3MoeConfig, Qwen3NextConfig

    dense = FlopModel.for_config(Qwen3Config(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=2, head_dim=8))
    moe = FlopModel.for_config(Qwen3MoeConfig(hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=2, head_dim=8, num_experts=8,
                                              num_experts_per_tok=2, moe_intermediate_size=16,
                                              mlp_only_layers=(1,)))
    # Layer 0: router (16 x 8) + 2 experts of 3 x 16 x 16 instead of the dense 3 x 16 x 32.
    assert moe.per_token - dense.per_token == 6 * (16 * 8 + 2 * 3 * 16 * 16 - 3 * 16 * 32)
    assert moe.per_pair == dense.per_pair
    cfg = Qwen3NextConfig(num_hidden_layers=4, full_attention_interval=4)
    # One full-attention layer of four: pairs cost only there.
    assert FlopModel.for_config(cfg).per_pair == 3.5 * 4 * cfg.num_attention_heads * cfg.head_dim


def test_flop_model_counts_qwen3_5_layers_as_their_kernels():
    """Qwen3.5's separate GDN projections: per token, every layer kernel's weights once (3 passes
    of 2 FLOPs; the dense model uses all of its kernels) plus each GDN layer's state update,
    counted from the model's own parameters."""
    from flax import nnx

    from jtree.models import create_model
    from tests.models_util import tiny_qwen3_5_config

    cfg = tiny_qwen3_5_config()
    params = nnx.state(nnx.eval_shape(lambda: create_model("qwen3_5", cfg)), nnx.Param)
    kernels = sum(int(np.prod(v.shape)) for path, v in params.flat_state()
                  if path[0] == "model" and path[1] == "layers" and path[-1] == "kernel")
    gdn_layers = sum(kind.mixer == "gated_deltanet" for kind in cfg.decoder().layers)
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    assert gdn_layers == 1 and any("in_proj_qkv" in map(str, p) for p, _ in params.flat_state())
    assert FlopModel.for_config(cfg).per_token == 6 * (kernels + 4 * state * gdn_layers)


def test_flop_model_prices_gpt_oss_windows_per_token():
    """gpt-oss: every layer's projections and experts (router, top-k experts with their biases'
    negligible adds) per token; the full layers' attention per pair, the sliding layers' as a
    whole window of pairs per token."""
    from jtree.config.architectures import GptOssConfig

    cfg = GptOssConfig(num_hidden_layers=4, sliding_window=16)
    fm = FlopModel.for_config(cfg)
    d, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = (2 * d * q + 2 * d * kv + d * cfg.num_experts
             + cfg.num_experts_per_tok * 3 * d * cfg.intermediate_size)
    assert fm.per_token == 6 * 4 * layer
    assert fm.per_pair == 3.5 * 2 * 4 * q  # two full-attention layers of four
    assert fm.per_window_token == 3.5 * 2 * 4 * q * 16
    work = Work(tokens=10, pairs=40, scored=3)
    assert fm.flops(work) == (fm.per_token + fm.per_window_token) * 10 + fm.per_pair * 40 + \
        fm.per_scored * 3
    assert sum(fm.shares(work).values()) == pytest.approx(1.0)


def test_flop_model_counts_deepseek_v3_layers_as_their_kernels():
    """DeepSeek-V3: per token, every MLA and dense kernel's weights once, the router, the shared
    experts and top-k of the routed experts' weights (3 passes of 2 FLOPs), counted from the
    model's own parameters; per pair, the scores over q/k heads and the weighted value heads."""
    from flax import nnx

    from jtree.models import create_model
    from tests.models_util import tiny_deepseek_v3_config

    cfg = tiny_deepseek_v3_config()
    params = nnx.state(nnx.eval_shape(lambda: create_model("deepseek_v3", cfg)), nnx.Param)
    sizes = {".".join(map(str, p)): int(np.prod(v.shape)) for p, v in params.flat_state()
             if p[0] == "model" and p[1] == "layers"}
    kernels = sum(n for name, n in sizes.items() if name.endswith("kernel"))
    routers = sum(n for name, n in sizes.items() if name.endswith("gate.weight"))
    experts = sum(n for name, n in sizes.items() if ".experts." in name)
    per_token = kernels + routers + experts * cfg.num_experts_per_tok / cfg.num_experts
    assert any("kv_b_proj" in name for name in sizes) and experts > 0
    fm = FlopModel.for_config(cfg)
    assert fm.per_token == 6 * per_token
    h = cfg.num_attention_heads
    assert fm.per_pair == 3.5 * 3 * 2 * h * (cfg.qk_head_dim + cfg.v_head_dim)
