"""Train on trees from JSONL: `python -m jtree.launch.train --config configs/tiny.yaml [--resume] [k=v]`.

One process or many (`jtree.distributed`: `launch/local_multihost.sh`, TPU pod and SLURM recipes
in launch/). The step runs over the ('data', 'model') mesh of the config: data parallel over rows,
tensor parallel inside shard_map. Prints one line per step (loss, baseline-equivalent and tree
tokens/s, POR, ERR, grad norm, host/device time; with `run.mode=auto` the mode each step
chose and why), writes metrics as JSONL (and TensorBoard),
checkpoints with Orbax (`--resume` continues from the latest one, data order included), and ends
with a summary. With `run.compare_baseline` it checks tree-vs-baseline log-prob equivalence with
the trained parameters and times the tree step against the per-path baseline step on the same
trees (alternating, medians).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtree.baseline import linearize_baseline, unlinearize_baseline
from jtree.checkpoint import Checkpointer, abstract_like
from jtree.config import TrainConfig, load_config
from jtree.cost import FlopModel
from jtree.data import (
    AutoStepBuilder, RfreeStepBuilder, RfreeStepConfig, StepBuilder, load_trees, make_pipeline,
    step_builder, step_indices,
)
from jtree.distributed import initialize_from_env
from jtree.host_allocator import configure_host_malloc
from jtree.linearize import linearize, unlinearize
from jtree.metrics import MetricsLog
from jtree.models import create_model
from jtree.planner import check_steps_per_octave
from jtree.rfree.execute import RedundancyFreeStep
from jtree.sharding import (
    DATA, MODEL, architecture_rules, batch_spec, make_mesh, named, param_path, param_specs,
)
from jtree.train_step import (
    TrainState, apply_gradients, make_optimizer, make_schedule, make_sharded_grad_fn,
    make_sharded_logprob_fn, make_train_step, old_logprobs_stale, state_shardings,
    tensor_parallel_graphdef,
)
from jtree.tree import TrajectoryTree


def say(*args: Any) -> None:
    """Print on process 0 only."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def host_data_shards(mesh: Mesh) -> tuple[int, ...]:
    """The data-axis indices whose devices live on this process (contiguous)."""
    pid = jax.process_index()
    shards = tuple(i for i in range(mesh.shape[DATA])
                   if any(d.process_index == pid for d in mesh.devices[i]))
    if not shards or shards != tuple(range(shards[0], shards[-1] + 1)):
        raise ValueError(f"process {pid}: its devices hold data shards {shards}; expected a "
                         "non-empty contiguous range (check the mesh/device order)")
    return shards


def to_global(mesh: Mesh, local: dict[str, np.ndarray], n_local_shards: int) -> dict[str, jax.Array]:
    """Host-local [M, rows_local, ...] arrays -> global arrays split over `data`."""
    out = {}
    for key, value in local.items():
        shape = (value.shape[0], value.shape[1] // n_local_shards * mesh.shape[DATA],
                 *value.shape[2:])
        sharding = NamedSharding(mesh, batch_spec(value.ndim))
        out[key] = jax.make_array_from_process_local_data(sharding, value, shape)
    return out


@dataclasses.dataclass
class Trainer:
    """Everything a run needs once the config is read: mesh, model graphs, jitted functions."""

    cfg: TrainConfig
    mesh: Mesh
    graphdef: Any
    specs: Any
    shardings: TrainState
    optimizer: Any
    step_fn: Any
    logprob_fn: Any
    init_fn: Any
    rfree_step: Any = None  # (state, RfreeProgram) -> (state, metrics), run.mode=redundancy_free

    @classmethod
    def build(cls, cfg: TrainConfig) -> Trainer:
        mesh = make_mesh(cfg.mesh)
        arch, mcfg = cfg.model.architecture, cfg.model.config
        abstract = nnx.eval_shape(lambda: create_model(arch, mcfg, seed=cfg.run.seed))
        _, abstract_params = nnx.split(abstract)
        try:
            rules = architecture_rules(arch, mcfg, mesh.shape[MODEL])
        except ValueError as e:
            raise ValueError(f"model ({arch}) on mesh.model={mesh.shape[MODEL]}: {e}") from None
        specs = param_specs(abstract_params, rules, mesh)
        graphdef = tensor_parallel_graphdef(abstract)
        optimizer = make_optimizer(cfg.optim)
        shardings = state_shardings(optimizer, abstract_params, named(mesh, specs), mesh)
        grad_fn = make_sharded_grad_fn(graphdef, cfg.objective, mesh, specs)
        step = make_train_step(graphdef, optimizer, cfg.objective, grad_fn=grad_fn)
        replicated = NamedSharding(mesh, P())
        step_fn = jax.jit(step, out_shardings=(shardings, replicated), donate_argnums=0)
        logprob_fn = jax.jit(make_sharded_logprob_fn(graphdef, mesh, specs,
                                                     cfg.objective.logprob_chunk))

        def init() -> TrainState:
            params = nnx.split(create_model(arch, mcfg, seed=cfg.run.seed))[1]
            return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))

        init_fn = jax.jit(init, out_shardings=shardings)
        rfree_step = None
        if cfg.run.mode == "redundancy_free":
            rfree_step = make_rfree_step(cfg, mesh, nnx.split(abstract)[0], optimizer)
        return cls(cfg, mesh, graphdef, specs, shardings, optimizer, step_fn, logprob_fn, init_fn,
                   rfree_step)

    def initial_state(self) -> TrainState:
        """A fresh TrainState: random init, or the weights of `model.init_from` placed directly
        onto the mesh (each host reads only what its devices hold)."""
        path = self.cfg.model.init_from
        if path is None:
            return self.init_fn()
        from jtree.hf import load

        mcfg = self.cfg.model.config
        by_name = {param_path(p).replace("/", "."): s for p, s in
                   jax.tree_util.tree_flatten_with_path(self.shardings.params)[0]}
        loaded, model = load(path, mcfg.param_dtype, compute_dtype=mcfg.dtype,
                             attention_impl=mcfg.attention_impl,
                             shardings=lambda name, shape: by_name[name])
        for field in dataclasses.fields(mcfg):
            ours, theirs = getattr(mcfg, field.name), getattr(loaded, field.name)
            if field.name not in RUNTIME_FIELDS and ours != theirs:
                raise ValueError(f"model.{field.name}: the config has {ours!r}, "
                                 f"{path}/config.json has {theirs!r}")
        params = nnx.split(model)[1]
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.shardings.opt_state)(params)
        return TrainState(params, opt_state,
                          jax.device_put(jnp.zeros((), jnp.int32), self.shardings.step))

    def run_meta(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this config."""
        c = self.cfg
        return {"architecture": c.model.architecture, "seed": c.run.seed,
                "shuffle_seed": c.data.shuffle_seed, "trees_per_step": c.data.trees_per_step,
                "mode": c.run.mode, "data_path": c.data.path}


def rfree_capacity(cfg: TrainConfig) -> int:
    """`run.capacity` (default `data.seq_len`), checked against the rows it must fit."""
    capacity = cfg.data.seq_len if cfg.run.capacity is None else cfg.run.capacity
    if not 1 <= capacity <= cfg.data.seq_len:
        raise ValueError(f"run.capacity={capacity}: must be in [1, data.seq_len={cfg.data.seq_len}]")
    return capacity


def make_rfree_step(cfg: TrainConfig, mesh: Mesh, graphdef: Any, optimizer: Any):
    """The `run.mode=redundancy_free` step: `jtree.rfree` gradients part by part, then the
    optimizer update. Single device: the parts run as separate calls, not over a mesh."""
    if mesh.devices.size != 1:
        raise ValueError(f"run.mode=redundancy_free: runs on one device, but the mesh has "
                         f"{mesh.devices.size} (mesh.data={mesh.shape[DATA]} x mesh.model="
                         f"{mesh.shape[MODEL]}); set mesh.data=1 mesh.model=1 or another run.mode")
    rfree_capacity(cfg)
    check_steps_per_octave(cfg.run.row_steps_per_octave, "run.row_steps_per_octave")
    grads_of = RedundancyFreeStep(graphdef, cfg.objective,
                                  prefix_backward=cfg.run.prefix_backward)
    update = jax.jit(apply_gradients(optimizer), donate_argnums=0)

    def step(state: TrainState, program) -> tuple[TrainState, dict[str, jax.Array]]:
        return update(state, *grads_of(state.params, program))

    return step


# Model-config fields that say how to run, not what the checkpoint holds.
RUNTIME_FIELDS = ("attention_impl", "dtype", "param_dtype", "remat", "tensor_parallel_axis",
                  "data_parallel_axis", "initializer_range")


def gdn_chunk_size(cfg: TrainConfig) -> int | None:
    """The GDN chunk size of the batches: `data.gdn_chunk_size` when the model has
    linear-attention layers, else None (no chunk tables)."""
    return cfg.data.gdn_chunk_size if cfg.model.config.needs_gdn_tables else None


def check_resumable(meta: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    for key, value in expected.items():
        if key in meta and meta[key] != value:
            raise ValueError(f"{where}: written with {key}={meta[key]!r}, but the config has "
                             f"{value!r}; resuming would not continue the same run")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in checkpoint.dir")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    args = parser.parse_args(argv)
    initialize_from_env()  # before anything touches a device
    cfg = load_config(args.config, args.overrides)
    if args.resume and cfg.checkpoint.dir is None:
        raise ValueError("--resume: checkpoint.dir is not set")
    d, mcfg = cfg.data, cfg.model.config
    if configure_host_malloc(cfg.run.host_malloc):  # before anything starts a jax backend
        say("host malloc: keeps freed memory (run.host_malloc; CPU steps reuse their temporaries)")

    trees, report = load_trees(d.path, d.format, vocab_size=mcfg.vocab_size,
                               on_bad_record=d.on_bad_record, tokenizer=d.tokenizer)
    total = sum((t.stats() for t in trees[1:]), trees[0].stats())
    say(f"data: {len(trees)} trees from {d.path} ({d.format}): {total.n_flat_tokens} flat tokens, "
        f"{total.n_tree_tokens} tree tokens, POR {total.por:.3f}"
        + (f"; skipped {report.n_bad} bad record(s), first: {report.first_errors[0]}"
           if report.n_bad else ""))

    trainer = Trainer.build(cfg)
    mesh = trainer.mesh
    shards = host_data_shards(mesh)
    modes = {"auto": ("tree", "baseline"), "redundancy_free": ()}.get(cfg.run.mode,
                                                                     (cfg.run.mode,))
    builders = {mode: step_builder(trees, d, mode, normalization=cfg.objective.normalization,
                                   n_shards=mesh.shape[DATA], shards=shards, steps=cfg.run.steps,
                                   gdn_chunk_size=gdn_chunk_size(cfg))
                for mode in modes}
    if cfg.run.mode == "redundancy_free":
        builder = RfreeStepBuilder(trees, RfreeStepConfig(
            cfg.objective.normalization, d.seq_len, rfree_capacity(cfg), d.trees_per_step,
            gdn_chunk_size(cfg), cfg.run.row_steps_per_octave))
        layout = (f"parts of <= {rfree_capacity(cfg)} tokens in rows fitted to them (at most "
                  f"{d.seq_len}), one device call per part")
    else:
        builder = (AutoStepBuilder(builders, FlopModel.for_config(mcfg), cfg.run.auto_min_gain)
                   if cfg.run.mode == "auto" else builders[cfg.run.mode])
        rows = "/".join(f"{builders[m].config.layout.rows}" for m in modes)
        length = (f"{d.seq_len}" if d.row_steps_per_octave is None else
                  f"<= {d.seq_len} ({d.row_steps_per_octave} lengths per octave)")
        layout = (f"{d.micro_batches} micro-batch(es) x {rows} rows ({'/'.join(modes)}) x "
                  f"{length} per data shard")
    pipeline = make_pipeline(builder, seed=d.shuffle_seed, worker_count=d.worker_count)
    iterator = iter(pipeline)

    state = None
    start = 0
    ckpt = None
    if cfg.checkpoint.dir is not None:
        ckpt = Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                            async_save=cfg.checkpoint.async_save)
        latest = ckpt.latest_step() if args.resume else None
        if latest is not None:
            where = f"checkpoint {ckpt.directory}/{latest}"
            check_resumable(ckpt.read_meta(latest), trainer.run_meta(), where)
            abstract = abstract_like(jax.eval_shape(trainer.init_fn), trainer.shardings)
            state, data_state, _ = ckpt.restore(latest, abstract)
            iterator.set_state(data_state)
            start = int(state.step)
            say(f"resumed from {where} (step {start})")
        elif args.resume:
            say(f"--resume: no checkpoint in {ckpt.directory}, starting from scratch")
    if state is None:
        state = trainer.initial_state()

    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    say(f"model: {cfg.model.architecture} {mcfg.num_hidden_layers} layers, hidden "
        f"{mcfg.hidden_size}, {n_params:,} parameters; mode {cfg.run.mode}, objective "
        f"{cfg.objective.kind}; mesh data={mesh.shape[DATA]} x model={mesh.shape[MODEL]} over "
        f"{jax.process_count()} process(es), backend {jax.default_backend()}; {layout}")

    metrics_log = MetricsLog(cfg.run.metrics_jsonl, cfg.run.tensorboard_dir, first_step=start,
                             enabled=jax.process_index() == 0)
    schedule = make_schedule(cfg.optim)
    history = []
    t_run = time.perf_counter()
    for step in range(start, cfg.run.steps):
        t0 = time.perf_counter()
        element = next(iterator)
        info = element["info"]
        stale = old_logprobs_stale(bool(info["has_old_logprobs"]),
                                   float(info["old_logprob_disagreement"]), cfg.objective)
        if "program" in element:  # run.mode=redundancy_free
            if stale:
                raise ValueError(f"run.mode=redundancy_free: objective.kind="
                                 f"{cfg.objective.kind} needs old log-probs that the trees of "
                                 f"step {step} do not carry (or that disagree on shared tokens)")
            t1 = time.perf_counter()
            state, metrics = trainer.rfree_step(state, element["program"])
        else:
            inputs = to_global(mesh, element["inputs"], len(shards))
            if stale:
                inputs["old_logprobs"] = trainer.logprob_fn(state.params, inputs)
            t1 = time.perf_counter()
            state, metrics = trainer.step_fn(state, inputs)
        metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
        t2 = time.perf_counter()
        record = step_record(step, metrics, info, t1 - t0, t2 - t1, float(schedule(step)))
        history.append(record)
        metrics_log.write(record)
        if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
            say(progress_line(record) + ("  (includes compile)" if step == start else ""))
            if "mode_reason" in info:
                say(f"           auto mode: {info['mode']} ({info['mode_reason']})")
        done = step + 1
        if ckpt is not None and (done % cfg.checkpoint.every == 0 or done == cfg.run.steps):
            ckpt.save(done, state, iterator.get_state(), trainer.run_meta())
            if cfg.run.kill_after_checkpoint == done:
                ckpt.wait()
                say(f"checkpoint {done} committed; fault injection: SIGKILL")
                os.kill(os.getpid(), signal.SIGKILL)
    if ckpt is not None:
        ckpt.wait()
    wall = time.perf_counter() - t_run
    metrics_log.close()
    say(summary(history, wall, report.n_bad, ckpt))
    if cfg.run.compare_baseline and history:
        if jax.process_count() == 1:
            compare_with_baseline(cfg, trees, trainer, state, builders)
        else:
            say("compare_baseline: skipped (single-process check)")
    if ckpt is not None:
        ckpt.close()
    return 0


def step_record(step: int, metrics: dict[str, float], info: dict[str, Any], host_s: float,
                device_s: float, lr: float) -> dict[str, Any]:
    """One JSONL record: step metrics plus throughput and sharing numbers of the global batch.
    POR counts the trees' sharing, ERR what was really computed (parts of trees larger than a
    row recompute their shared prefixes; the baseline computes every path)."""
    n_tree, n_flat = int(info["n_tree_tokens"]), int(info["n_flat_tokens"])
    n_computed = int(info["n_computed_tokens"])
    if "mode" in info:  # the automatic mode choice of this step
        metrics = dict(metrics, mode=str(info["mode"]),
                       predicted_gain=float(info["predicted_gain"]))
    return dict(
        metrics, step=step, learning_rate=lr, n_trees=int(info["n_trees"]),
        n_tree_tokens=n_tree, n_flat_tokens=n_flat, n_computed_tokens=n_computed,
        por=1 - n_tree / n_flat,
        err=1 - n_computed / n_flat, tokens_per_s=n_flat / device_s,
        tree_tokens_per_s=n_computed / device_s, host_s=host_s, device_s=device_s,
    )


def progress_line(r: dict[str, Any]) -> str:
    return (f"step {r['step']:4d}  loss {r['loss']:8.4f}  grad_norm {r['grad_norm']:7.3f}  "
            f"tokens/s {r['tokens_per_s']:9.0f} (baseline-equivalent)  "
            f"tree tokens/s {r['tree_tokens_per_s']:9.0f}  POR {r['por']:.3f}  ERR {r['err']:.3f}  "
            f"host {r['host_s'] * 1e3:6.1f} ms  device {r['device_s'] * 1e3:7.1f} ms")


def summary(history: list[dict[str, Any]], wall: float, n_bad: int,
            ckpt: Checkpointer | None) -> str:
    if not history:
        return "summary: no steps to run"
    steady = history[1:] or history
    return (f"summary: steps {history[0]['step']}-{history[-1]['step']} in {wall:.1f} s; final "
            f"loss {history[-1]['loss']:.4f}; median baseline-equivalent tokens/s "
            f"{np.median([r['tokens_per_s'] for r in steady]):.0f}, device "
            f"{np.median([r['device_s'] for r in steady]) * 1e3:.1f} ms/step, host "
            f"{np.median([r['host_s'] for r in steady]) * 1e3:.1f} ms/step (excluding the first "
            f"step); bad records skipped {n_bad}"
            + (f"; checkpoints in {ckpt.directory}" if ckpt is not None else ""))


def compare_with_baseline(cfg: TrainConfig, trees: Sequence[TrajectoryTree], trainer: Trainer,
                          state: TrainState, builders: dict[str, StepBuilder]) -> None:
    """Equivalence of log-probs and the speed of tree vs baseline steps, on step 0's trees. Each
    mode is timed on the batches it would train with (the trained modes' `builders`, so their
    step is not compiled again)."""
    d, mesh = cfg.data, trainer.mesh
    n_data = mesh.shape[DATA]
    chosen = [trees[int(i)] for i in step_indices(len(trees), d.trees_per_step,
                                                  d.shuffle_seed)[0]]
    chosen = [t for t in chosen if t.n_tree_tokens <= d.seq_len]  # the check packs whole trees

    def logprobs(batch) -> np.ndarray:
        arrays = {k: v[None] for k, v in batch.arrays().items()}
        return np.asarray(trainer.logprob_fn(state.params, to_global(mesh, arrays, n_data)))[0]

    def padded_rows(n: int) -> int:
        return -(-n // n_data) * n_data

    kw = dict(normalization=cfg.objective.normalization, gdn_chunk_size=gdn_chunk_size(cfg))
    tree_b = linearize(chosen, d.seq_len, **kw)
    tree_b = linearize(chosen, d.seq_len, n_rows=padded_rows(tree_b.shape[0]), **kw)
    base_b = linearize_baseline(chosen, d.seq_len, **kw)
    base_b = linearize_baseline(chosen, d.seq_len, n_rows=padded_rows(base_b.shape[0]), **kw)
    lp_tree = unlinearize(tree_b, logprobs(tree_b))
    lp_base = unlinearize_baseline(base_b, logprobs(base_b), chosen)
    diff = max(float(np.max(np.abs(a - b))) for ta, tb in zip(lp_tree, lp_base)
               for a, b in zip(ta, tb))
    say(f"equivalence: max |tree log-prob - baseline log-prob| over all path tokens = {diff:.2e}")

    inputs = {}
    for mode in ("tree", "baseline"):
        builder = builders.get(mode) or step_builder(
            trees, d, mode, normalization=cfg.objective.normalization, n_shards=n_data,
            shards=range(n_data), steps=cfg.run.steps, gdn_chunk_size=gdn_chunk_size(cfg))
        element = builder(step_indices(len(trees), d.trees_per_step, d.shuffle_seed)[0])
        inputs[mode] = to_global(mesh, element["inputs"], n_data)
    for mode in ("tree", "baseline"):  # compile both before timing
        state, metrics = trainer.step_fn(state, inputs[mode])
        jax.block_until_ready(metrics)
    times: dict[str, list[float]] = {"tree": [], "baseline": []}
    for _ in range(cfg.run.timing_repeats):
        for mode in ("tree", "baseline"):
            t0 = time.perf_counter()
            state, metrics = trainer.step_fn(state, inputs[mode])
            jax.block_until_ready(metrics)
            times[mode].append(time.perf_counter() - t0)
    t_tree, t_base = np.median(times["tree"]), np.median(times["baseline"])
    stats = sum((t.stats() for t in chosen[1:]), chosen[0].stats())
    shape = {m: "x".join(str(s) for s in inputs[m]["tokens"].shape) for m in inputs}
    say(f"speed: tree step {t_tree * 1e3:.1f} ms (micro-batches x rows x S = {shape['tree']}), "
        f"baseline step {t_base * 1e3:.1f} ms ({shape['baseline']}); speedup "
        f"{t_base / t_tree:.2f}x (token bound 1/(1-POR) = {1 / (1 - stats.por):.2f}x, "
        f"medians of {cfg.run.timing_repeats} alternating runs)")


if __name__ == "__main__":
    sys.exit(main())
