"""The memory plan's depth rule (`jtree.memory.plan`) against an actual compile: the plan fitted
through compiles at fewer layers predicts the activations and temporaries XLA assigns at the
model's own depth, within `TOLERANCE`. Shared by tests/memory/test_memory_plan.py and the
architectures' plan tests (tests/models/test_nemotron_h.py); run as a module, it checks the
unrolled rule in a process of its own (`check_unrolled_rule`)."""

from __future__ import annotations

import json
import sys

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


def check_unrolled_rule(overrides: list[str]) -> None:
    """The plan of configs/tiny.yaml with `overrides`, fitted through 1 and 2 unrolled layers,
    predicts the compile at 3; its parameter, gradient and optimizer terms are AdamW's. Run in a
    process of its own by tests/memory/test_memory_plan.py (`python -m tests.memory_plan_checks
    OVERRIDES_JSON`), at the code generation the process was started with."""
    from jtree.config import load_config  # noqa: PLC0415 (jax's flags are the process's)
    from jtree.memory.plan import activations_and_temps, memory_plan  # noqa: PLC0415

    plan = memory_plan("configs/tiny.yaml", overrides, depth_blocks=(1, 2))
    actual = activations_and_temps(
        load_config("configs/tiny.yaml", [*overrides, "model.num_hidden_layers=3"]), rows=1)
    assert not plan.scanned
    assert_rule_predicts(plan, actual)
    assert plan.grads == plan.params  # AdamW: mu and nu like the parameters, plus scalar counts
    assert 2 * plan.params < plan.opt_state < 2 * plan.params + 64
    assert plan.fits(1.0) and not plan.fits(plan.total / 2**30 / 2)


if __name__ == "__main__":
    check_unrolled_rule(json.loads(sys.argv[1]))
