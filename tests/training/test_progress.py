import time

from jtree.training.compile_log import CompileWatch
from jtree.training.report import eta_seconds, progress, progress_line, warmup_notice


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
