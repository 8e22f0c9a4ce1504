import time

from jtree.training.compile_log import CompileWatch
from jtree.training.report import progress


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
