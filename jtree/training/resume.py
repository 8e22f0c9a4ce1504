"""What a resumed run may change: the config keys that may differ from the checkpoint's (said in one
line each), and those refused because they change the model, the objective or the data order."""

from __future__ import annotations

from typing import Any

from jtree.training.report import say

# Config keys a resumed run may change although they are part of a fixed section (`model.`,
# `data.`): where the weights first came from, how many workers read data. How the model runs
# (`runtime.*`) is not a fixed section.
RESUME_MAY_CHANGE = ("model.init_from", "data.worker_count")


def resume_refusal(key: str) -> str | None:
    """Why a resumed run must keep `key` as the checkpoint has it, or None when it may change:
    the model (its shapes and initialization) and the data order (which trees each step trains
    on, and how they are laid out) are what makes a resumed run continue the one that was
    stopped. Optimizer, objective, run length, logging, mesh and checkpoint settings may
    change."""
    if key in RESUME_MAY_CHANGE:
        return None
    if key.startswith("model."):
        return "it changes the model"
    if key.startswith("data.") or key in ("run.mode", "run.seed"):
        return "it changes the data order or the initialization"
    return None


def critic_resume_refusal(saved: dict[str, Any] | None, config: dict[str, Any] | None
                          ) -> str | None:
    """Why a resumed run may not change `objective.critic` from `saved` to `config` (their
    `config_values`), or None: adding or removing the critic, or changing where its values
    come from (head or separate model, the separate network) or whether it has a learning rate
    of its own, changes the parameters or the optimizer state the checkpoint holds. GAE and the
    value loss's settings, the learning rate's value and `init_from` may change."""
    if (saved is None) != (config is None):
        return "it adds or removes the value head or the separate critic (its settings may change)"
    if saved is None:
        return None
    for field, what in (("model", "where the values come from"),
                        ("network", "the critic's network")):
        if saved.get(field) != config.get(field):
            return f"it changes {what} ({field})"
    if (saved.get("learning_rate") is None) != (config.get("learning_rate") is None):
        return ("it adds or removes the critic's learning rate (a step of the optimizer, whose "
                "state the checkpoint holds)")
    return None


def check_resumable(meta: dict[str, Any], config: dict[str, Any], where: str) -> None:
    """Say which keys of `config` (this run's `config_values`) differ from those of the
    checkpoint's run meta, each with its old and new value, and refuse the checkpoint when one
    of them may not change (`resume_refusal`), naming the key."""
    if "config" not in meta:
        raise ValueError(f"{where}: its run meta holds no config ({sorted(meta)}), so this run "
                         "cannot check it continues the same run")
    saved = meta["config"]
    changed = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
    refused = []
    for key in changed:
        why = resume_refusal(key)
        if key == "objective.critic":
            why = critic_resume_refusal(saved.get(key), config.get(key))
        say(f"--resume: {key} changed from {saved.get(key)!r} to {config.get(key)!r}"
            + (f": refused, {why}" if why else ": allowed"))
        if why:
            refused.append(f"{key} ({saved.get(key)!r} -> {config.get(key)!r}): {why}")
    if refused:
        raise ValueError(f"{where}: {'; '.join(refused)}; set it back to resume this "
                         "checkpoint, or train into a new checkpoint.dir")
