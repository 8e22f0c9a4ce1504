"""Benchmark capacity partitioning, balancing and packing: `python -m jtree.launch.bench.partition`.

1. Quality: heuristic and dp_single N_computed against the dp_multi optimum on random trees small
   enough for the exact program (random-attachment trees and small agent-rollout trees), at random
   capacities between the longest path and the tree size.
2. Scaling: heuristic run time against tree size on agent-like trees up to millions of tokens
   (planning alone, and planning plus building the part trees), with the log-log slope.
3. ERR against capacity on one large tree (heuristic, dp_single, and the POR ceiling).
4. Balancing and packing: largest rank load over the lower bound on random workloads, the optimal
   DFS-contiguous split of a large tree over 8 ranks, and the padding of packed parts.

Writes bench_out/bench_partition.json, .md and .png (`jtree.launch.bench.harness`; `--out` picks the
folder). `--quick`: small trees, a smoke run.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jtree.launch.bench.harness import (
    Column,
    Output,
    alternate,
    bench_parser,
    figure,
    markdown_table,
    run_info,
)
from jtree.layout.balance import assign_to_ranks, split_contiguous
from jtree.layout.planner import plan_rows
from jtree.partitioning.exact_dp import TooLargeForExactDP
from jtree.partitioning.partition import partition, plan_groups
from jtree.trees.synthetic import AgentShape, agent_rollout_group
from jtree.trees.tree import TrajectoryTree

SCALING_COLUMNS = (
    Column("tree tokens", "tree_tokens"), Column("nodes", "nodes"), Column("paths", "paths"),
    Column("plan s", "heuristic_plan", "{:.3f}"),
    Column("plan + parts s", "heuristic_partition", "{:.3f}"),
    Column("dp_single plan s", "dp_single_plan", "{:.3f}"),
    Column("heuristic ERR", "heuristic_err", "{:.3f}"), Column("POR", "por", "{:.3f}"),
    Column("dp_single ERR", "dp_single_err", "{:.3f}"),
)


def random_attachment_tree(rng: np.random.Generator, n_leaves: int) -> TrajectoryTree:
    """Each new node hangs under a uniformly random earlier node, until `n_leaves` leaves."""
    parents, n_children = [-1], [0]
    while n_children.count(0) < n_leaves:
        p = int(rng.integers(0, len(parents)))
        n_children[p] += 1
        parents.append(p)
        n_children.append(0)
    segs = [rng.integers(1, 1000, size=int(rng.integers(1, 200))) for _ in parents]
    return TrajectoryTree.from_nodes(parents, segs)


def agent_like_tree(rng: np.random.Generator, n_tokens: int, max_depth_tokens: int = 24_000
                    ) -> TrajectoryTree:
    """A large rollout tree: a 2k-token prompt, turns of ~400 tokens that fork into 1-3
    continuations, paths ending at leaves and at some internal turns, until `n_tokens` tokens."""
    parents, lengths, depth = [-1], [2000], [2000]
    frontier = [0]
    total = 2000
    while total < n_tokens:
        recent = rng.random() < 0.7  # mostly extend recent turns (depth), sometimes fork early
        u = frontier[int(rng.integers(max(0, len(frontier) - 64) if recent else 0, len(frontier)))]
        for _ in range(int(rng.choice([1, 1, 2, 3]))):
            n = int(np.clip(rng.lognormal(np.log(400), 0.8), 8, 4000))
            if depth[u] + n > max_depth_tokens:
                continue
            parents.append(u)
            lengths.append(n)
            depth.append(depth[u] + n)
            frontier.append(len(parents) - 1)
            total += n
    n_children = np.bincount(np.asarray(parents[1:]), minlength=len(parents))
    leaves = np.flatnonzero(n_children == 0)
    inner = np.flatnonzero(n_children > 0)
    ends = np.concatenate([leaves, rng.choice(inner, size=len(inner) // 8, replace=False)])
    segs = [rng.integers(1, 50_000, size=n) for n in lengths]
    return TrajectoryTree.from_nodes(parents, segs, path_nodes=ends.tolist())


def quality(rng: np.random.Generator, n_trees: int) -> dict:
    """Gap of heuristic and dp_single to the dp_multi optimum, per generator."""
    shape = AgentShape(system_len=300, task_len=60, turns=3, rollouts=8, assistant_len=120,
                       tool_len=90, think_len=60)
    generators = {
        "random_attachment": lambda: random_attachment_tree(rng, int(rng.integers(3, 10))),
        "agent_rollouts": lambda: agent_rollout_group(rng, shape),
    }
    out = {}
    for name, make in generators.items():
        gaps = {"heuristic": [], "dp_single": []}
        errs = {"heuristic": [], "dp_single": [], "dp_multi": [], "por": []}
        refused = 0
        seconds = {"heuristic": 0.0, "dp_single": 0.0, "dp_multi": 0.0}
        while len(gaps["heuristic"]) < n_trees:
            tree = make()
            lo, hi = int(tree.path_lengths.max()), tree.n_tree_tokens - 1
            if hi <= lo:
                continue
            cap = int(rng.integers(lo, hi + 1))
            res = {}
            try:
                for m in ("dp_multi", "heuristic", "dp_single"):
                    t0 = time.perf_counter()
                    res[m] = partition(tree, cap, m)
                    seconds[m] += time.perf_counter() - t0
            except TooLargeForExactDP:
                refused += 1
                continue
            best = res["dp_multi"].n_computed
            for m in gaps:
                gaps[m].append(res[m].n_computed / best - 1)
            for m in res:
                errs[m].append(res[m].err)
            errs["por"].append(res["dp_multi"].por)
        out[name] = {
            "trees": n_trees, "dp_multi_refused": refused,
            **{f"{m}_gap_mean": float(np.mean(g)) for m, g in gaps.items()},
            **{f"{m}_gap_p95": float(np.quantile(g, 0.95)) for m, g in gaps.items()},
            **{f"{m}_gap_max": float(np.max(g)) for m, g in gaps.items()},
            **{f"{m}_optimal_fraction": float(np.mean(np.asarray(g) <= 1e-12))
               for m, g in gaps.items()},
            **{f"{m}_err_mean": float(np.mean(e)) for m, e in errs.items()},
            **{f"{m}_seconds_total": s for m, s in seconds.items()},
            "gaps": {m: [float(x) for x in g] for m, g in gaps.items()},
        }
    return out


def scaling(rng: np.random.Generator, sizes: list[int], capacity: int, repeats: int) -> dict:
    """Heuristic (and dp_single) run time against tree size."""
    rows = []
    for n in sizes:
        tree = agent_like_tree(rng, n)
        timings = alternate({
            "heuristic_plan": lambda: plan_groups(tree, capacity, "heuristic"),
            "heuristic_partition": lambda: partition(tree, capacity, "heuristic"),
            "dp_single_plan": lambda: plan_groups(tree, capacity, "dp_single"),
        }, repeats, warmup=0)
        result = partition(tree, capacity, "heuristic")
        single = partition(tree, capacity, "dp_single")
        row = {"tree_tokens": tree.n_tree_tokens, "flat_tokens": result.n_flat_tokens,
               "nodes": tree.n_nodes, "paths": tree.n_paths, "por": result.por,
               "heuristic_parts": result.n_parts, "heuristic_err": result.err,
               "dp_single_parts": single.n_parts, "dp_single_err": single.err,
               **{k: timings.median(k) for k in timings.wall}}
        rows.append(row)
        print(f"  {row['tree_tokens']:>9d} tokens {row['nodes']:>6d} nodes {row['paths']:>5d} paths: "
              f"plan {row['heuristic_plan']:.3f}s, with parts {row['heuristic_partition']:.3f}s, "
              f"ERR {row['heuristic_err']:.3f} (POR {row['por']:.3f}, dp_single ERR "
              f"{row['dp_single_err']:.3f})", flush=True)
    x = np.log([r["tree_tokens"] for r in rows])
    slopes = {k: float(np.polyfit(x, np.log([r[k] for r in rows]), 1)[0])
              for k in ("heuristic_plan", "heuristic_partition")}
    return {"capacity": capacity, "rows": rows, "loglog_slope": slopes}


def err_vs_capacity(rng: np.random.Generator, n_tokens: int) -> dict:
    tree = agent_like_tree(rng, n_tokens)
    lo = int(tree.path_lengths.max())
    caps = np.unique(np.geomspace(lo, tree.n_tree_tokens, 12).astype(int))
    rows = []
    for c in caps:
        h, s = partition(tree, int(c), "heuristic"), partition(tree, int(c), "dp_single")
        rows.append({"capacity": int(c), "heuristic_err": h.err, "heuristic_parts": h.n_parts,
                     "dp_single_err": s.err, "dp_single_parts": s.n_parts})
    return {"tree_tokens": tree.n_tree_tokens, "por": tree.stats().por, "rows": rows}


def balancing_and_packing(rng: np.random.Generator, n_tokens: int) -> dict:
    """Rank imbalance on random costs; the contiguous split of an `n_tokens` tree over 8 ranks;
    the padding of the parts of 8 trees of `n_tokens` / 5 packed into rows of 32768."""
    imbalance = []
    for trial in range(60):
        n = int(rng.integers(2, 17))
        k = n * int(rng.integers(6, 13))
        costs = (rng.lognormal(0, 1, k), rng.uniform(1, 100, k), rng.pareto(2, k) + 1)[trial % 3]
        imbalance.append(assign_to_ranks(costs, n).imbalance)
    tree = agent_like_tree(rng, n_tokens)
    split = split_contiguous(tree, 8)
    computed = sum(p.n_tree_tokens for p in split.parts if p is not None)
    parts = [p for _ in range(8)
             for p in partition(agent_like_tree(rng, n_tokens // 5), 32_768).parts]
    plan = plan_rows([p.n_tree_tokens for p in parts], 32_768,
                     len_buckets=[8_192, 16_384, 24_576, 32_768])
    return {
        "rank_imbalance_mean": float(np.mean(imbalance)),
        "rank_imbalance_max": float(np.max(imbalance)),
        "contiguous_split_8": {
            "tree_tokens": tree.n_tree_tokens, "max_rank_tokens": split.max_cost,
            "ideal_rank_tokens": tree.n_tree_tokens / 8,
            "max_over_ideal": split.max_cost / (tree.n_tree_tokens / 8),
            "duplicated_fraction": computed / tree.n_tree_tokens - 1},
        "packing": {"parts": len(parts), **plan.as_dict()},
    }


def plot(report: dict) -> Any:
    fig, axes = figure(3, (16, 4.6))
    ax = axes[0]
    for name, q in report["quality"].items():
        for m, style in (("heuristic", "-"), ("dp_single", "--")):
            g = np.sort(np.asarray(q["gaps"][m]) * 100)
            ax.plot(g, np.arange(1, len(g) + 1) / len(g), style, label=f"{m}, {name}")
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel("N_computed above the dp_multi optimum (%)")
    ax.set_ylabel("fraction of trees")
    ax.set_title("quality on DP-tractable random trees")
    ax.legend(fontsize=7)
    ax = axes[1]
    rows = report["scaling"]["rows"]
    tok = np.array([r["tree_tokens"] for r in rows])
    for k, label in (("heuristic_plan", "heuristic plan"),
                     ("heuristic_partition", "plan + build part trees"),
                     ("dp_single_plan", "dp_single plan")):
        ax.loglog(tok, [r[k] for r in rows], "o-", label=label)
    ref = np.array([r["heuristic_partition"] for r in rows])
    ax.loglog(tok, ref[-1] * tok / tok[-1], ":", color="0.5", label="linear")
    ax.set_xlabel("tree tokens")
    ax.set_ylabel("seconds")
    ax.set_title(f"run time, capacity {report['scaling']['capacity']}")
    ax.legend(fontsize=7)
    ax = axes[2]
    e = report["err_vs_capacity"]
    caps = [r["capacity"] for r in e["rows"]]
    ax.semilogx(caps, [r["heuristic_err"] for r in e["rows"]], "o-", label="heuristic")
    ax.semilogx(caps, [r["dp_single_err"] for r in e["rows"]], "s--", label="dp_single")
    ax.axhline(e["por"], color="0.5", ls=":", label=f"POR {e['por']:.3f}")
    ax.set_xlabel("capacity (tree tokens per part)")
    ax.set_ylabel("ERR")
    ax.set_title(f"ERR vs capacity, {e['tree_tokens']}-token tree")
    ax.legend(fontsize=7)
    return fig


def main(argv=None) -> int:
    parser = bench_parser(__doc__, repeats=3, quick="5 gap trees, trees of 10k-30k tokens, "
                          "one repeat (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gap-trees", type=int, default=150)
    parser.add_argument("--sizes", default="10000,30000,100000,300000,1000000,3000000")
    parser.add_argument("--capacity", type=int, default=32_768)
    parser.add_argument("--large-tokens", type=int, default=300_000,
                        help="tokens of the tree of ERR vs capacity and of the contiguous split")
    args = parser.parse_args(argv)
    if args.quick:
        args.gap_trees, args.sizes, args.repeats, args.large_tokens = 5, "10000,30000", 1, 30_000
    rng = np.random.default_rng(args.seed)
    report: dict = {}
    print("quality (N_computed / dp_multi optimum - 1):", flush=True)
    report["quality"] = quality(rng, args.gap_trees)
    for name, q in report["quality"].items():
        print(f"  {name:>17}: heuristic mean {q['heuristic_gap_mean']:.2%} p95 "
              f"{q['heuristic_gap_p95']:.2%} max {q['heuristic_gap_max']:.2%} optimal "
              f"{q['heuristic_optimal_fraction']:.0%} | dp_single mean {q['dp_single_gap_mean']:.2%}"
              f" max {q['dp_single_gap_max']:.2%} optimal {q['dp_single_optimal_fraction']:.0%}"
              f" | dp_multi refused {q['dp_multi_refused']}", flush=True)
    print("scaling:", flush=True)
    report["scaling"] = scaling(rng, [int(float(s)) for s in args.sizes.split(",")],
                                args.capacity, args.repeats)
    print(f"  log-log slope: {report['scaling']['loglog_slope']}")
    report["err_vs_capacity"] = err_vs_capacity(rng, args.large_tokens)
    report["balancing_packing"] = bp = balancing_and_packing(rng, args.large_tokens)
    cs = bp["contiguous_split_8"]
    print(f"balancing: rank max/lower bound - 1: mean {bp['rank_imbalance_mean']:.3%} max "
          f"{bp['rank_imbalance_max']:.3%}; contiguous split of a {cs['tree_tokens']}-token tree "
          f"over 8 ranks: max rank {cs['max_over_ideal']:.3f}x ideal, "
          f"{cs['duplicated_fraction']:.2%} tokens duplicated")
    pk = bp["packing"]
    print(f"packing: {pk['parts']} parts into {pk['rows']} rows of {pk['row_len']}: padding "
          f"{pk['padding_fraction']:.2%}")
    table = (f"scaling, capacity {args.capacity}:\n\n"
             + markdown_table(report["scaling"]["rows"], SCALING_COLUMNS))
    print(table)
    written = Output.from_args(args, "bench_partition").write(
        {**run_info(args), **report}, table=table, fig=plot(report), dpi=72)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
