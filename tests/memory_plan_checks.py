"""The memory plan's depth rule (`jtree.memory.plan`) against an actual compile: the plan fitted
through compiles at fewer layers predicts the activations and temporaries XLA assigns at the
model's own depth, within `TOLERANCE`. Shared by tests/memory/test_memory_plan.py and the
architectures' plan tests (tests/models/test_nemotron_h.py)."""

from __future__ import annotations

from jtree.memory.plan import Compiled, MemoryPlan

# XLA's buffer assignment is not exactly affine in depth (fusion and buffer reuse shift by a few
# buffers): the stated tolerance of the rule, relative to the compiled temporaries.
TOLERANCE = 0.05


def assert_predicts(predicted: float, actual: Compiled) -> None:
    """`predicted` activations and temporaries within TOLERANCE of the compile `actual`."""
    error = abs(predicted - actual.activations_and_temps) / actual.activations_and_temps
    assert error <= TOLERANCE, (predicted, actual)


def assert_rule_predicts(plan: MemoryPlan, actual: Compiled) -> None:
    """The plan's a + b * layers at the depth of `actual` is within TOLERANCE of its compile."""
    a = plan.largest_temporary
    b = plan.activations / (plan.layers - plan.leading)
    predicted = a + (actual.layers - plan.leading) * b
    assert b > 0 and a > 0
    assert_predicts(predicted, actual)
