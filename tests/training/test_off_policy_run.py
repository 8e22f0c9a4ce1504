"""`objective.off_policy` in a training run (docs/rl.md, "Off-policy correction")."""

import pytest

from jtree.config import load_config
from jtree.training.trainer import check_off_policy


def test_training_runs_refuse_off_policy_until_wired():
    """A run computes pi_old on the device after the host has summed P / N, so it cannot fold
    the weights yet: it refuses the key instead of training without them."""
    cfg = load_config("configs/tiny.yaml", ["objective.kind=ppo", "objective.off_policy.kind=tis",
                                            "objective.off_policy.cap=2.0"])
    with pytest.raises(ValueError, match="objective.off_policy.kind=tis: not applied"):
        check_off_policy(cfg)
    check_off_policy(load_config("configs/tiny.yaml", ["objective.kind=ppo"]))
