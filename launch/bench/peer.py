"""jtree's tree step against an outside peer: transformers (PyTorch, CPU) training every path on
its own, on the same trees, the same model and weights, the same loss (not a test).

Workload (the shape of issue 36's measurement, scaled to keep a run short): multi-turn chat
conversations with tool calls and think-mode turns (`jtree.trees.synthetic.chat_record`, byte
tokenizer, every assistant turn a path; POR about 0.77, token bound about 4.3), a 4-layer Qwen3
(hidden 256, MLP 768, 8 q / 4 kv heads of 32, vocabulary = the byte tokenizer's 260), float32.

- jtree: the trainer's tree step (`jtree.launch.bench.workloads.prepare`: the trainer's own builder) with
  each CPU attention kernel (`cpu`, `xla`) and with what `auto` resolves to;
- peer: the model exported to a Hugging Face directory (`jtree.hf.load_save.save`) and loaded by
  transformers (`sdpa` attention, `torch.set_num_threads(cores)`); one step = every path forward
  and backward on its own (batch 1, no padding) with the per-path loss -sum_t c[p,t] log p_t
  (`jtree.layout.coefficients.path_coefficients`, SFT, `token_mean`), gradients accumulated over
  the paths, then gradient clipping at 1.0 and AdamW (the jtree step's optimizer settings);
- a plain matmul at the step's dominant shape in jax (`jtree.training.utilization`), the MFU
  ceiling.

All variants run in the same alternating rounds (`jtree.launch.bench.harness.alternate`: shuffled order,
medians; a speedup is the median of same-round ratios with a bootstrap interval). The first
(warm-up) call of both sides runs at the same initial weights: their losses are printed and must
agree (same loss function). Reported: speedup of the tree step over the peer, speedup / token
bound, MFU of each jtree variant against the same rounds' matmul, per-token throughput of the peer.
`--ops` adds the tree step's XLA op time by kind (`jtree.launch.bench.split.op_profile`) and the
model FLOP/s of its matmul kinds.

`--ceiling` asks what XLA:CPU itself reaches on the step's two halves, in the same rounds and
against the same matmul: (a) the tree step with attention stubbed out (`attention_stubbed`: an
elementwise stand-in, so projections, MLP, norms, loss and optimizer run as in the step and
attention costs nothing), MFU over its model FLOPs without the attention pairs; (b) each CPU
kernel's attention forward + backward alone on the step's layout
(`jtree.launch.bench.split.attention_grad_fn`, one layer's call, times the layer count), MFU over
the attention pairs' model FLOPs. If (a) stays far below the matmul, the projections' own
layout work (the weight gradients' transposed copies) bounds the step whatever attention does.

    python -m jtree.launch.bench.peer                 # ~4 min on 2 cores
    python -m jtree.launch.bench.peer --ops           # + the tree step's op kinds
    python -m jtree.launch.bench.peer --ceiling       # + each half's MFU
    python -m jtree.launch.bench.peer --quick         # a tiny smoke run

Writes bench_out/bench_peer.json and .md (`--out` picks the folder).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtree.config.architectures import Qwen3Config
from jtree.config.objective import Objective
from jtree.config.runtime import RuntimeConfig
from jtree.hf.load_save import save
from jtree.launch.bench.harness import (
    Column,
    Output,
    Timings,
    add_host_malloc_flag,
    alternate,
    apply_host_malloc,
    bench_parser,
    markdown_table,
    run_info,
)
from jtree.launch.bench.split import attention_grad_fn, op_profile, ops_line
from jtree.launch.bench.step import StepLoop, auto_check, step_auto_attention, step_of
from jtree.launch.bench.workloads import CPU_IMPLS, prepare
from jtree.layout.coefficients import batch_normalizer, path_coefficients
from jtree.layout.flop_model import FlopModel, Work, tree_work
from jtree.models import CausalLM
from jtree.training.utilization import (
    MatmulShape,
    device_peak,
    dominant_shape,
    matmul_call,
    mfu_from_rounds,
    model_flops,
)
from jtree.trees.chat import ByteTokenizer, conversation_tree
from jtree.trees.synthetic import chat_record
from jtree.trees.tree import TrajectoryTree

NORMALIZATION = "token_mean"
OBJECTIVE = Objective(kind="sft", normalization=NORMALIZATION)


def model_config(quick: bool = False) -> Qwen3Config:
    vocab = ByteTokenizer().vocab_size
    if quick:
        return Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8)
    return Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=32)


def chat_trees(quick: bool = False) -> list[TrajectoryTree]:
    """Two conversations (17 paths, 6760 tree tokens, POR 0.77); `quick`: one short one."""
    rng = np.random.default_rng(11)
    tok = ByteTokenizer()
    kw = (dict(system_words=10, turns=2, user_words=5, assistant_words=5, tool_words=5,
               reasoning_words=5) if quick else
          dict(system_words=80, turns=6, user_words=15, assistant_words=25, tool_words=30,
               reasoning_words=30))
    return [conversation_tree(chat_record(rng, **kw), tok, where=f"chat {i}",
                              vocab_size=tok.vocab_size) for i in range(1 if quick else 2)]


# ----------------------------------------------------------------------------- the peer


class TorchPaths:
    """transformers training every path on its own: one call = one optimizer step over all
    paths of `trees` (gradients accumulated path by path), the loss the jtree step computes."""

    def __init__(self, directory: Path, trees: Sequence[TrajectoryTree]):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        normalizer = batch_normalizer(trees, NORMALIZATION)
        self.paths = []
        for t in trees:
            coeffs = path_coefficients(t, NORMALIZATION, normalizer)
            for p in range(t.n_paths):
                ids = torch.as_tensor(np.asarray(t.path_tokens(p), np.int64))[None]
                self.paths.append((ids, torch.as_tensor(np.asarray(coeffs[p], np.float32)[1:])))
        # jtree's AdamW: learning rate 1e-4 (`jtree.launch.bench.step.step_of`), OptimConfig's
        # betas, eps, no weight decay, clipping at global norm 1.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                           eps=1e-8, weight_decay=0.0)

    @property
    def tokens(self) -> int:
        return sum(int(ids.shape[1]) for ids, _ in self.paths)

    def step(self, threads: int) -> float:
        """One optimizer step over every path with `threads` intra-op threads."""
        torch = self.torch
        torch.set_num_threads(threads)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for ids, c in self.paths:
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            loss = -(c * logp).sum()
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return total


# ----------------------------------------------------------------------------- measurement


@contextlib.contextmanager
def attention_stubbed() -> Any:
    """While a step is traced, the model's attention (`jtree.models.attention.attend`) is an
    elementwise stand-in of the same shapes: out = q + (k + v) repeated over each kv head's
    query heads. It keeps q, k and v live (their projections still run and get gradients) and
    costs next to nothing, so the traced step is the tree step's projections, MLP, norms, loss
    and optimizer alone (`--ceiling`). Only for timing: its loss is not the model's."""
    from jtree.models import attention

    original = attention.attend

    def stand_in(q: jax.Array, k: jax.Array, v: jax.Array, *_args: Any, **_kw: Any
                 ) -> jax.Array:
        return q + jnp.repeat(k + v, q.shape[2] // k.shape[2], axis=2)

    attention.attend = stand_in
    try:
        yield
    finally:
        attention.attend = original


def measure(quick: bool, repeats: int, ops: bool, seq_len: int,
            ceiling: bool = False) -> dict[str, Any]:
    cfg = model_config(quick)
    trees = chat_trees(quick)
    stats = sum((t.stats() for t in trees[1:]), trees[0].stats())
    prep = prepare(trees, "tree", seq_len, normalization=NORMALIZATION)
    tree_w, base_w = tree_work(trees)
    fm = FlopModel.for_config(cfg)
    flops = model_flops(fm, prep.work)
    # What `auto` runs in this step's attention calls: measured now for this shape class
    # (jtree.kernels.attention.calibration, one log line).
    auto = step_auto_attention(cfg, prep.plan)
    model = CausalLM(cfg, RuntimeConfig(attention_impl=CPU_IMPLS[0]), rngs=nnx.Rngs(0))
    runs: dict[str, Callable[[], Any]] = {}
    with tempfile.TemporaryDirectory() as d:
        save(model, cfg, d)
        peer = TorchPaths(Path(d), trees)
    # The peer with every core and with one: on a machine whose cores other jobs share, a
    # thread pool that waits at a barrier for a descheduled thread loses far more than one
    # thread does; the faster of the two is the peer's time in each round.
    threads = sorted({os.cpu_count() or 1, 1}, reverse=True)
    for n in threads:
        runs[f"transformers paths, {n} thread(s)"] = lambda n=n: peer.step(n)
    for impl in CPU_IMPLS:
        # The same initial weights as the exported `model` (same seed), this kernel.
        step, state = step_of(CausalLM(cfg, RuntimeConfig(attention_impl=impl),
                                       rngs=nnx.Rngs(0)), OBJECTIVE)
        loop = StepLoop(state)
        runs[f"tree {impl}"] = loop.run(step.lower(state, prep.inputs).compile(), prep.inputs)
    if ceiling:
        step, state = step_of(CausalLM(cfg, RuntimeConfig(attention_impl="xla"),
                                       rngs=nnx.Rngs(0)), OBJECTIVE)
        with attention_stubbed():
            compiled = step.lower(state, prep.inputs).compile()
        runs["tree, attention stubbed"] = StepLoop(state).run(compiled, prep.inputs)
        for impl in CPU_IMPLS:
            runs[f"attention {impl}"] = attention_grad_fn(prep.end, cfg, impl)
    matmul = dominant_shape(prep.plan.n_rows * prep.plan.row_len, cfg)
    runs["matmul"] = matmul_call(matmul)
    t0 = time.perf_counter()
    timings = alternate(runs, repeats)
    peer_names = [f"transformers paths, {n} thread(s)" for n in threads]
    # the peer's time in each round: its faster thread count in that round
    peer_times = np.min([timings.wall[n] for n in peer_names], axis=0)
    timings.wall["transformers paths"] = list(peer_times)
    peer_loss = float(timings.first_result[peer_names[0]])
    row: dict[str, Any] = {
        "n_trees": len(trees), "n_paths": stats.n_paths, "por": stats.por,
        "n_tree_tokens": tree_w.tokens, "n_flat_tokens": base_w.tokens,
        "token_bound": base_w.tokens / tree_w.tokens, "rows": prep.plan.n_rows,
        "row_len": prep.plan.row_len, "model_flops": flops,
        "peer_loss_first": peer_loss, "peer_tokens": peer.tokens,
        "matmul_shape": matmul.describe(),
        "matmul_flops_per_s": matmul.flops / timings.median("matmul"),
        "peer_s": timings.median("transformers paths"),
        "peer_tokens_per_s": peer.tokens / timings.median("transformers paths"),
        "peer_s_by_threads": {n: timings.median(f"transformers paths, {n} thread(s)")
                              for n in threads},
        "rounds": timings.rounds, "timed_s": time.perf_counter() - t0,
        "peak_flops_per_s": device_peak("float32"), "impls": {},
    }
    for impl in CPU_IMPLS:
        name = f"tree {impl}"
        speedup = timings.ratio("transformers paths", name)
        row["impls"][impl] = {
            "step_s": timings.median(name),
            "loss_first": float(timings.first_result[name]["loss"]),
            "speedup_vs_peer": speedup,
            "speedup_interval": timings.ratio_interval("transformers paths", name),
            "speedup_over_token_bound": speedup / row["token_bound"],
            "flops_per_s": flops / timings.median(name),
            "mfu": mfu_from_rounds(flops, np.asarray(timings.wall[name]), matmul,
                                   np.asarray(timings.wall["matmul"])),
        }
    row.update(auto_check(timings, auto, {impl: f"tree {impl}" for impl in CPU_IMPLS}))
    if ceiling:
        row["ceiling"] = ceiling_fields(timings, fm, prep.work, cfg.num_hidden_layers, matmul)
    if ops:
        row["ops"] = {impl: op_profile(runs[f"tree {impl}"], max(1, repeats // 2))
                      for impl in CPU_IMPLS}
    return row


def ceiling_fields(timings: Timings, fm: FlopModel, work: Work, layers: int,
                   matmul: MatmulShape) -> dict[str, dict[str, float]]:
    """`--ceiling`'s pieces: seconds per step (an attention call's times `layers`), model
    FLOPs (the step's without the attention pairs; the pairs' alone), FLOP/s and MFU against the
    same rounds' matmul."""
    pieces = {"tree, attention stubbed": (Work(work.tokens, 0, work.scored), 1)}
    pieces.update({f"attention {impl}": (Work(0, work.pairs, 0), layers) for impl in CPU_IMPLS})
    out = {}
    for name, (w, times) in pieces.items():
        flops = model_flops(fm, w)
        step_times = times * np.asarray(timings.wall[name])
        out[name] = {"step_s": float(np.median(step_times)), "model_flops": flops,
                     "flops_per_s": flops / float(np.median(step_times)),
                     "mfu": mfu_from_rounds(flops, step_times, matmul,
                                            np.asarray(timings.wall["matmul"]))}
    return out


CEILING_COLUMNS = (
    Column("piece", "piece"), Column("s per step", "step_s", "{:.2f}"),
    Column("model GFLOP", "model_flops", cell=lambda r: f"{r['model_flops'] / 1e9:.1f}"),
    Column("GFLOP/s", "flops_per_s", cell=lambda r: f"{r['flops_per_s'] / 1e9:.1f}"),
    Column("MFU", "mfu", "{:.1%}"),
)

COLUMNS = (
    Column("attention", "impl"), Column("POR", "por", "{:.2f}"),
    Column("token bound", "token_bound", "{:.2f}"),
    Column("tree s", "step_s", "{:.2f}"), Column("transformers paths s", "peer_s", "{:.2f}"),
    Column("speedup", "speedup_vs_peer", "{:.2f}"),
    Column("95% interval", "speedup_interval", "{0[0]:.2f}-{0[1]:.2f}"),
    Column("speedup / token bound", "speedup_over_token_bound", "{:.2f}"),
    Column("tree GFLOP/s", "flops_per_s", cell=lambda r: f"{r['flops_per_s'] / 1e9:.1f}"),
    Column("matmul GFLOP/s", "matmul_flops_per_s",
           cell=lambda r: f"{r['matmul_flops_per_s'] / 1e9:.1f}"),
    Column("MFU", "mfu", "{:.1%}"),
)


def report(row: dict[str, Any]) -> str:
    rows = [dict(row, impl=impl + (" (auto)" if impl == row["auto_attention"] else ""), **v)
            for impl, v in row["impls"].items()]
    lines = [f"{row['n_trees']} chat trees, {row['n_paths']} paths, {row['n_tree_tokens']} tree "
             f"tokens ({row['rows']} x {row['row_len']}), {row['n_flat_tokens']} path tokens; "
             f"model {row['model_flops'] / 1e9:.1f} GFLOP/step; plain matmul "
             f"{row['matmul_shape']}; transformers {row['peer_tokens_per_s']:.0f} tokens/s ("
             + ", ".join(f"{n} thread(s) {t:.1f} s" for n, t in row["peer_s_by_threads"].items())
             + "); "
             f"first-step loss: transformers {row['peer_loss_first']:.6f}, jtree "
             + ", ".join(f"{i} {v['loss_first']:.6f}" for i, v in row["impls"].items())
             + f"; {row['rounds']} rounds", "", markdown_table(rows, COLUMNS), "",
             f"auto resolves to {row['auto_attention']}; the faster here: "
             f"{row['faster_attention']} (cpu / xla time {row['cpu_over_xla']:.2f}, "
             f"{row['attention_verdict']})"]
    if "ceiling" in row:
        lines += ["", "What XLA:CPU reaches on each half of the step (same rounds, same matmul; "
                  "attention: one layer's call x the layer count):", "",
                  markdown_table([dict(v, piece=k) for k, v in row["ceiling"].items()],
                                 CEILING_COLUMNS)]
    lines += [ops_line(f"tree {impl}", kinds, top=10) for impl, kinds in row.get("ops", {}).items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=5, quick="a one-layer model on one short conversation")
    parser.add_argument("--ops", action="store_true",
                        help="also the tree step's XLA op time by kind (profiler)")
    parser.add_argument("--seq-len", type=int, default=4096,
                        help="row capacity of the tree step (default 4096)")
    parser.add_argument("--ceiling", action="store_true",
                        help="also time the step with attention stubbed out and attention alone "
                             "(each half's MFU against the same matmul)")
    add_host_malloc_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.seq_len = min(args.repeats, 2), 512
    apply_host_malloc(args)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jtree.kernels.tree_attention").setLevel(logging.INFO)
    row = measure(args.quick, args.repeats, args.ops, args.seq_len, args.ceiling)
    text = report(row)
    print(text, flush=True)
    written = Output.from_args(args, "bench_peer").write({**run_info(args), "result": row},
                                                         table=text)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
