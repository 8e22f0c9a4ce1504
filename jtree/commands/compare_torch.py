"""`jtree compare-torch --hf-dir DIR --data FILE`: jtree on trees vs transformers on paths.

Loads the checkpoint in jtree and in transformers (CPU, float32), builds trees from a JSONL file
(`jtree.commands.data_file`: `--format chat` with `--tokenizer` for conversations),
and prints per block type (full / linear attention, MoE / dense MLP) and overall: max |logit
difference| on every path position, max |log-prob difference| between the tree and each path run
alone, and the relative gradient difference per tensor between the tree loss in jtree and the
per-path loss in PyTorch (with the router load-balancing loss when the checkpoint turns it on).
Exits 1 when a number is above its tolerance (docs/design.md section 9).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from jtree.commands.data_file import add_data_arguments, read_data
from jtree.config.objective import NORMALIZATIONS

# docs/design.md section 9 (see jtree.hf.compare.Tolerances).
DEFAULT_TOL = 1e-4


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare-torch",
                       help="numerics of a HF checkpoint: jtree on trees vs PyTorch on paths")
    p.add_argument("--hf-dir", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--data", required=True, help="JSONL file of sequence groups, trees or chats")
    add_data_arguments(p)
    p.add_argument("--max-trees", type=int, default=None, help="use only the first N trees")
    p.add_argument("--normalization", choices=NORMALIZATIONS, default="seq_mean_token_mean")
    p.add_argument("--attention-impl", default="auto", help="jtree tree_attention implementation")
    p.add_argument("--gdn-chunk-size", type=int, default=64,
                   help="chunk length of the gated delta rule on trees (linear-attention layers)")
    p.add_argument("--logit-tol", type=float, default=DEFAULT_TOL)
    p.add_argument("--logprob-tol", type=float, default=DEFAULT_TOL)
    p.add_argument("--grad-tol", type=float, default=DEFAULT_TOL,
                   help="relative L2 gradient difference per tensor")
    p.add_argument("--json", dest="json_out", default=None, help="write the numbers here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so other commands start without jax models, torch or transformers.
    import jtree.hf
    from jtree.config.runtime import RuntimeConfig
    from jtree.hf.compare import Tolerances, compare
    from jtree.hf.torch_reference import load_torch_model

    config, model = jtree.hf.load(args.hf_dir, RuntimeConfig(attention_impl=args.attention_impl))
    trees = read_data(args.data, args, vocab_size=config.vocab_size)
    if args.max_trees is not None:
        if args.max_trees < 1:
            raise ValueError(f"--max-trees: must be >= 1, got {args.max_trees}")
        trees = trees[: args.max_trees]
    result = compare(model, config, load_torch_model(args.hf_dir), trees,
                     normalization=args.normalization, gdn_chunk_size=args.gdn_chunk_size)
    tol = Tolerances(args.logit_tol, args.logprob_tol, args.grad_tol)
    print_report(result, tol)
    failures = result.failures(tol)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(result.as_dict(), failures=failures), f, indent=1)
    for line in failures:
        print(f"FAIL: {line}")
    return 1 if failures else 0


def print_report(r: Any, tol: Any) -> None:
    """Print a `jtree.hf.compare.Comparison` against its `Tolerances`."""
    print(f"{r.paths} paths, {r.tokens} path tokens; loss: tree {r.tree_loss:.6f}, "
          f"per-path (PyTorch) {r.path_loss:.6f}")
    if r.tree_aux_loss or r.path_aux_loss:
        print(f"router aux loss (coef x load balancing): tree {r.tree_aux_loss:.6f}, "
              f"all paths batched (PyTorch) {r.path_aux_loss:.6f}")
    print(f"{'block type':<18} {'layers':>6} {'tensors':>7} {'max|dout|':>12} "
          f"{'max rel dgrad':>13}  worst tensor")
    for name, g in r.groups.items():
        output = f"{g.max_abs_output:12.3e}" if g.layers else f"{'-':>12}"
        print(f"{name:<18} {g.layers:6d} {g.tensors:7d} {output} {g.max_rel_grad:13.3e}  "
              f"{g.worst_tensor}")
    print(f"overall: max |logit diff| on paths {r.max_abs_logits:.3e} (tol {tol.logits:.0e}), "
          f"max |log-prob diff| tree vs path {r.max_abs_logprobs:.3e} (tol {tol.logprobs:.0e}), "
          f"max relative grad diff {r.max_rel_grad:.3e} (tol {tol.grads:.0e}, {r.worst_tensor})")
