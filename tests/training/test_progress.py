import json
import re
import time

import numpy as np
import pytest

from jtree.config.objective import CriticConfig, Objective
from jtree.launch.train import main
from jtree.training.compile_log import CompileWatch
from jtree.training.report import (
    eta_seconds,
    learned_means,
    progress,
    progress_line,
    warmup_notice,
)
from tests.run_util import read_metrics, tiny_overrides


def test_progress_says_nothing_when_quick_and_ticks_when_slow(capsys):
    with progress("quick", after=5):
        pass
    assert capsys.readouterr().out == ""
    with progress("slow work", after=0.05, every=0.1):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert len([l for l in lines if l.startswith("slow work: ") and "so far" in l]) >= 2
    assert lines[-1].startswith("slow work: done in ")


def test_compile_watch_counts_each_compile_once():
    import jax
    import jax.numpy as jnp

    x3, x4 = jnp.ones(3), jnp.ones(4)
    f = jax.jit(lambda x: x * 2)
    with CompileWatch() as watch:
        f(x3)
        first = watch.total
        f(x3)
        assert watch.total == first  # a cache hit compiles nothing
        f(x4)
        assert (watch.total - first).n == 1 and (watch.total - first).seconds > 0
    assert first.n == 1
    f(jnp.ones(5))
    assert watch.total.n == 2  # not listening after the block


def test_nested_compiles_count_their_wall_time_once():
    """A step whose trace compiles and runs other programs (as `auto`'s attention calibration
    does, timing kernels while the step is traced) records their trace, lowering and compile
    events inside its own trace event: the durations add up to more than the call took, the
    covered wall time to less. A plain sum of the durations fails this (the cause of negative
    step times)."""
    import jax
    import jax.numpy as jnp

    def side_program(i: int) -> None:
        with jax.ensure_compile_time_eval():
            jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * i)(jnp.ones(8)))

    @jax.jit
    def outer(x):
        for i in range(10):
            side_program(i)
            x = jnp.cos(x) * i
        return x

    def note(event: str, duration: float, **_) -> None:
        summed.append(duration)

    summed: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(note)
    try:
        with CompileWatch() as watch:
            t0 = time.perf_counter()
            jax.block_until_ready(outer(jnp.ones(8)))
            wall = time.perf_counter() - t0
    finally:
        jax.monitoring.unregister_event_duration_listener(note)
    assert 0 < watch.total.seconds <= wall
    assert sum(summed) > wall  # the nesting this test is about really happened


def test_progress_line_reads_step_of_total_rl_metrics_and_eta():
    record = {"step": 3, "loss": 0.5, "grad_norm": 1.0, "tokens_per_s": 100.0,
              "tree_tokens_per_s": 40.0, "por": 0.6, "err": 0.6, "host_s": 0.01, "device_s": 0.2,
              "compiles": 0, "compile_s": 0.0, "clip_frac": 0.125, "entropy": 2.5}
    line = progress_line(record, 10, eta_seconds([record], 6))
    assert line.startswith("step    3/10  loss   0.5000")
    assert "clip 0.125" in line and "entropy 2.500" in line and "kl_ref" not in line
    assert line.endswith("eta 0m01s")  # 6 steps x 0.21 s


def test_warmup_notice_only_for_a_run_that_ends_inside_its_warmup():
    assert warmup_notice(5, 4) == ("note: optim.warmup_steps 5 > run.steps 4: the run ends inside "
                                   "its warmup, its last step at 80% of optim.learning_rate")
    assert warmup_notice(4, 4) == "" and warmup_notice(0, 0) == ""  # the last step at the peak


def test_only_what_the_objective_learns_from_is_recorded():
    """SFT records neither mean (its records may carry rewards and advantages it ignores); a
    critic's advantages come from the device, so the host's (the records') are not recorded."""
    assert learned_means(Objective()) == ()
    assert learned_means(Objective(kind="ppo")) == ("reward_mean", "advantage_mean")
    assert learned_means(Objective(kind="ppo", critic=CriticConfig())) == ("reward_mean",)


@pytest.mark.parametrize("normalization", ["seq_mean_token_mean", "token_mean"])
def test_rl_line_and_record_carry_the_objectives_reward_and_advantage_means(
        few_groups_file, tmp_path, capsys, normalization):
    """A PPO run on given advantages: every step's `reward_mean` and `advantage_mean` (record and
    console line) are the means over its paths' records weighted as the loss weighs them, written
    out here from the records: token t of path p by weight_p * mask_p[t] (position 0 never
    trained), divided by the path's trained tokens under seq_mean_token_mean; a path's reward by
    the sum of its tokens' weights. All 4 groups make every step, so every step has these means."""
    rng = np.random.default_rng(5)
    records = [json.loads(line) for line in few_groups_file.read_text().splitlines()]
    for r in records:  # weights, rewards and per-token advantages that make the weighting show
        r.update(weight=float(rng.uniform(0.5, 2.0)), reward=float(rng.normal()),
                 advantage=rng.normal(size=len(r["tokens"])).round(3).tolist())
    data = tmp_path / "groups.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    coefficients = []
    for r in records:
        mask = np.asarray(r["loss_mask"], float)
        mask[0] = 0.0
        c = r["weight"] * mask
        coefficients.append(c / mask.sum() if normalization == "seq_mean_token_mean" else c)
    total = sum(c.sum() for c in coefficients)
    want_reward = sum(c.sum() * r["reward"] for c, r in zip(coefficients, records)) / total
    want_adv = sum(c @ np.asarray(r["advantage"]) for c, r in zip(coefficients, records)) / total

    out = tmp_path / "metrics.jsonl"
    assert main(["--config", "configs/tiny.yaml", *tiny_overrides(
        data, **{"run.steps": 2, "objective.kind": "ppo", "objective.advantage": "given",
                 "objective.normalization": normalization, "run.metrics_jsonl": out})]) == 0
    records = read_metrics(out)
    assert len(records) == 2
    for record in records:
        assert record["reward_mean"] == pytest.approx(want_reward, rel=1e-6)
        assert record["advantage_mean"] == pytest.approx(want_adv, rel=1e-5, abs=1e-7)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2
    for line in lines:
        said = dict(re.findall(r"(reward|adv) (-?[0-9.]+)", line))
        assert float(said["reward"]) == pytest.approx(want_reward, abs=5e-4)
        assert float(said["adv"]) == pytest.approx(want_adv, abs=5e-4)
