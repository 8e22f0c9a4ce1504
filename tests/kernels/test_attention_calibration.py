"""`auto` on CPU by measurement: the choice logic with fake timings (the faster wins, ties go to
the earlier candidate, a kernel that cannot run the call is never a candidate), one measurement
and one log line per shape class, the on-disk store (first writer wins, keyed by machine, a stored
decision is used without measuring, an unwritable store falls back to the process's own), and
the measurement itself at a tiny size (structure only, no timing asserted)."""

import importlib
import logging

import jax.numpy as jnp
import numpy as np
import pytest

from jtree.kernels.attention import calibration as attention_calibration
from jtree.kernels.attention import cpu as attention_cpu
from jtree.kernels.attention.calibration import (
    MAX_TOKENS,
    MIN_TOKENS,
    STORE_ENV,
    Decision,
    ShapeClass,
    decision_file,
    machine_signature,
    pick_fastest,
    read_decision,
    store_decision,
    synthetic_end,
)
from jtree.kernels.tree_attention import calibrated_cpu_impl, cpu_candidates, resolve_impl

LOGGER = "jtree.kernels.tree_attention"
# the module (the package exports its function of the same name)
dispatch = importlib.import_module(LOGGER)
BIG = (4, 4096, 8, 4)  # rows, S, q heads, kv heads: large enough to be measured


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """No decision in the process nor in the store (an empty one of the test's own)."""
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    dispatch._auto_on_cpu.cache_clear()
    calibrated_cpu_impl.cache_clear()
    yield
    dispatch._auto_on_cpu.cache_clear()
    calibrated_cpu_impl.cache_clear()


@pytest.fixture
def fake_timings(monkeypatch):
    """Replace the measurement by given timings; records every measured class."""
    calls = []

    def install(times):
        def measure(shape, candidates, run, repeats=3):
            calls.append((shape, tuple(candidates)))
            return {name: times[name] for name in candidates}
        monkeypatch.setattr(attention_calibration, "measure", measure)
        return calls
    return install


def test_pick_fastest():
    assert pick_fastest({"cpu": 2.0, "xla": 1.0}, ("cpu", "xla")) == "xla"
    assert pick_fastest({"cpu": 1.0, "xla": 2.0}, ("cpu", "xla")) == "cpu"
    # a tie goes to the earlier candidate, whatever the dict order
    assert pick_fastest({"xla": 1.0, "cpu": 1.0}, ("cpu", "xla")) == "cpu"
    assert pick_fastest({"xla": 1.0, "cpu": 1.0}, ("xla", "cpu")) == "xla"
    # a timing for a name that is not a candidate is never picked
    assert pick_fastest({"cpu": 5.0, "reference": 0.1}, ("cpu",)) == "cpu"
    with pytest.raises(ValueError, match="no timings"):
        pick_fastest({}, ("cpu", "xla"))


@pytest.mark.parametrize("times, chosen", [({"cpu": 0.3, "xla": 0.2}, "xla"),
                                           ({"cpu": 0.2, "xla": 0.3}, "cpu"),
                                           ({"cpu": 0.2, "xla": 0.2}, "cpu")])
def test_auto_runs_the_faster_once_per_shape_class(times, chosen, fresh_choices, fake_timings,
                                                   caplog):
    calls = fake_timings(times)
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(3):
        assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=32, shape=BIG) == chosen
    # the same class (rows and S round up to the same powers of two): no new measurement
    assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=32,
                        shape=(3, 4000, 8, 4)) == chosen
    assert len(calls) == 1 and calls[0][1] == ("cpu", "xla")
    said = [r.getMessage() for r in caplog.records if r.name == LOGGER and "'auto' runs" in
            r.getMessage() and "forward+backward" in r.getMessage()]
    assert len(said) == 1 and f"'auto' runs {chosen!r}" in said[0] and "measured now" in said[0]
    # another class is measured on its own
    resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=64, shape=BIG)
    assert len(calls) == 2 and calls[1][0].head_dim == 64


def test_auto_never_picks_a_kernel_that_cannot_run(fresh_choices, fake_timings, monkeypatch):
    calls = fake_timings({"cpu": 0.0, "xla": 1.0})  # `cpu` would win any measurement
    # a soft-cap: the C++ kernel refuses it, so it is not a candidate and nothing is measured
    assert cpu_candidates(30.0) == ("xla",)
    assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=32, shape=BIG,
                        softcap=30.0) == "xla"
    # the C++ kernel does not build here
    monkeypatch.setattr(attention_cpu, "build_error", lambda: "no compiler")
    dispatch._auto_on_cpu.cache_clear()
    assert cpu_candidates(None) == ("xla",)
    assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=32, shape=BIG) == "xla"
    assert calls == []


def test_small_calls_and_calls_without_a_shape_keep_the_static_rule(fresh_choices,
                                                                   fake_timings):
    calls = fake_timings({"cpu": 1.0, "xla": 0.0})
    small = (1, MIN_TOKENS // 2, 8, 4)
    assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=32, shape=small) == "cpu"
    assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=32) == "cpu"
    assert resolve_impl("xla", "cpu", dtype=jnp.float32, head_dim=32, shape=BIG) == "xla"
    assert calls == []


def test_store_keeps_the_first_decision_per_shape_class_and_machine(tmp_path):
    shape = ShapeClass.of("cpu", jnp.float32, 1, 1280, 4, 2, 32)
    here = machine_signature(("cpu", "xla"))
    path = decision_file(tmp_path, shape, here)
    assert path != decision_file(tmp_path, shape, {**here, "cpu": "another CPU model"})
    assert path != decision_file(tmp_path, shape, {**here, "cpus": here["cpus"] + 1})
    changed = machine_signature(("cpu", "xla"), {"cpu": "another build of the C++ kernel"})
    assert path != decision_file(tmp_path, shape, changed)
    assert read_decision(path, ("cpu", "xla")) is None
    # two processes measured the class at once and each stores its own: both run the first
    first = store_decision(path, Decision("xla", {"cpu": 2.0, "xla": 1.0}, "measured now"), {},
                           ("cpu", "xla"))
    second = store_decision(path, Decision("cpu", {"cpu": 1.0, "xla": 2.0}, "measured now"), {},
                            ("cpu", "xla"))
    assert first.choice == second.choice == read_decision(path, ("cpu", "xla")).choice == "xla"
    assert "another process stored its decision first" in second.origin
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


def test_a_stored_decision_is_used_without_measuring(fresh_choices, fake_timings, monkeypatch,
                                                     caplog):
    fake_timings({"cpu": 0.3, "xla": 0.2})
    assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=32, shape=BIG) == "xla"
    # a later process (a resume, a second run) on this machine: reads it, measures nothing
    calibrated_cpu_impl.cache_clear()

    def measure(*args, **kwargs):
        raise AssertionError("measured although a decision is stored")
    monkeypatch.setattr(attention_calibration, "measure", measure)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=32, shape=BIG) == "xla"
    assert any("'auto' runs 'xla'" in r.getMessage() and "read from" in r.getMessage()
               for r in caplog.records if r.name == LOGGER)


def test_an_unwritable_store_warns_once_and_keeps_the_process_decision(fresh_choices,
                                                                       fake_timings, tmp_path,
                                                                       monkeypatch, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(STORE_ENV, str(blocker / "store"))  # below a file: cannot be made
    calls = fake_timings({"cpu": 0.3, "xla": 0.2})
    caplog.set_level(logging.INFO)
    for head_dim in (32, 64):
        assert resolve_impl("auto", "cpu", dtype=jnp.float32, head_dim=head_dim,
                            shape=BIG) == "xla"
    assert len(calls) == 2
    assert len([r for r in caplog.records if "cannot store decisions" in r.getMessage()]) == 1


def test_shape_classes_and_their_representative_call():
    a = ShapeClass.of("cpu", jnp.float32, 3, 4000, 8, 4, 32)
    assert (a.rows, a.seq) == (4, 4096)
    assert a == ShapeClass.of("cpu", np.float32, 4, 4096, 8, 4, 32)
    assert a != ShapeClass.of("cpu", jnp.float32, 4, 4097, 8, 4, 32)
    assert ShapeClass.of("cpu", jnp.float32, 1, 10, 1, 1, 16).seq == 64
    for rows, seq in [(16, 16384), (1, 65536), (4, 4096), (1, 64)]:
        r, s = ShapeClass.of("cpu", jnp.float32, rows, seq, 8, 4, 32).representative()
        assert r * s <= max(MAX_TOKENS, 64) and r <= rows and s <= seq


@pytest.mark.parametrize("seq", [64, 100, 4096])
def test_synthetic_end_is_a_tree_mask(seq):
    end = synthetic_end(2, seq)
    j = np.arange(seq)
    assert end.shape == (2, seq) and (end > j).all() and (end <= seq).all()
    assert (end[:, : max(1, seq // 8)] == seq).all()  # the shared prefix is seen by every query


def test_measure_times_every_candidate(fresh_choices):
    shape = ShapeClass.of("cpu", jnp.float32, 1, 128, 2, 1, 16)
    seen = []

    def run(name, q, k, v, end):
        seen.append(name)
        return dispatch.tree_attention(q, k, v, dispatch.TreeMask(end), impl=name)

    times = attention_calibration.measure(shape, ("xla", "reference"), run, repeats=2)
    assert set(times) == {"xla", "reference"} and all(t > 0 for t in times.values())
    assert set(seen) == {"xla", "reference"}
