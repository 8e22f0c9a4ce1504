"""Every numeric setting of a run config declares its domain beside its field, and a value outside
it is refused when the config is loaded, naming the key and where the value came from."""

import dataclasses
import typing

import pytest
import yaml

from jtree.config import ARCHITECTURE_CONFIGS, TrainConfig, load_config
from jtree.config.schema import DOMAIN, DomainError


def _settings(cls: type, prefix: str):
    """(dotted key, field, section class) of every field under `cls`, nested sections walked."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        sections = [a for a in typing.get_args(hints[field.name]) or (hints[field.name],)
                    if dataclasses.is_dataclass(a)]
        if sections:
            yield from _settings(sections[0], f"{key}.")
        else:
            yield key, field, cls, hints[field.name]


def _is_numeric(hint) -> bool:
    return any(a in (int, float) for a in typing.get_args(hint) or (hint,))


# The run config's sections, and the model section's fields of every architecture.
ROOTS = [(TrainConfig, ""),
         *((cls, f"model[{name}].") for name, cls in ARCHITECTURE_CONFIGS.items())]
SETTINGS = [(key, field, cls) for root, prefix in ROOTS
            for key, field, cls, hint in _settings(root, prefix) if _is_numeric(hint)]


def test_every_numeric_setting_declares_a_domain_its_default_lies_in():
    assert len(SETTINGS) > 150  # every section and architecture, nested ones included
    missing = [key for key, field, _ in SETTINGS if DOMAIN not in field.metadata]
    assert missing == []
    for key, field, _ in SETTINGS:
        values = field.default if isinstance(field.default, tuple) else [field.default]
        assert all(field.metadata[DOMAIN].holds(v) for v in values if v is not None), key


@pytest.mark.parametrize("key, field, cls", SETTINGS, ids=[k for k, _, _ in SETTINGS])
def test_a_section_refuses_a_value_outside_the_domain(key, field, cls):
    domain = field.metadata[DOMAIN]
    outside = domain.low - 1 if domain.low is not None else domain.high + 1
    if isinstance(field.default, tuple):  # a list setting: each entry in the domain
        outside = (outside,)
    with pytest.raises(DomainError, match=rf"^{field.name}(\[0\])?: "):
        cls(**{field.name: outside})


@pytest.mark.parametrize("override, message", [
    ("optim.learning_rate=-1e-2", "optim.learning_rate=-0.01 (override): must be > 0"),
    ("optim.learning_rate=0", "optim.learning_rate=0.0 (override): must be > 0"),
    ("objective.clip_low=-0.2", "objective.clip_low=-0.2 (override): must be >= 0"),
    ("objective.clip_high=-0.1", "objective.clip_high=-0.1 (override): must be >= 0"),
    ("optim.warmup_steps=-5", "optim.warmup_steps=-5 (override): must be >= 0"),
    ("optim.b2=1", "optim.b2=1.0 (override): must be in [0, 1)"),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio=1.5 (override): must be in [0, 1]"),
    ("data.seq_len=0", "data.seq_len=0 (override): must be >= 1"),
    ("mesh.data=0", "mesh.data=0 (override): must be >= 1 or -1"),
    ("objective.kl_coef=-1", "objective.kl_coef=-1.0 (override): must be >= 0"),
    ("objective.critic={gamma: 1.5}", "objective.critic.gamma=1.5 (override): must be in [0, 1]"),
    ("model.lora={rank: 0, targets: [q_proj]}", "model.lora.rank=0 (override): must be >= 1"),
    ("model.num_hidden_layers=0", "model.num_hidden_layers=0 (override): must be >= 1"),
    ("model.rms_norm_eps=-1e-6", "model.rms_norm_eps=-1e-06 (override): must be > 0"),
])
def test_a_bad_override_names_key_value_and_source(override, message):
    with pytest.raises(ValueError) as e:
        load_config("configs/tiny.yaml", [override])
    assert str(e.value) == message


def test_wandb_settings_need_the_project():
    with pytest.raises(ValueError, match=r"run: wandb_name: 'x' is a setting of the W&B run, "
                                         r"which wandb_project turns on \(it is not set\)$"):
        load_config("configs/tiny.yaml", ["run.wandb_name=x"])
    with pytest.raises(ValueError, match=r"run.wandb_mode: 'foo' is not one of"):
        load_config("configs/tiny.yaml", ["run.wandb_project=p", "run.wandb_mode=foo"])
    run = load_config("configs/tiny.yaml", ["run.wandb_project=p", "run.wandb_mode=offline"]).run
    assert (run.wandb_project, run.wandb_mode, run.wandb_id) == ("p", "offline", None)


def test_a_bad_yaml_value_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"optim": {"learning_rate": -0.01, "warmup_steps": 2}}))
    with pytest.raises(ValueError) as e:
        load_config(path)
    assert str(e.value) == "optim.learning_rate=-0.01 (run.yaml): must be > 0"
    cfg = load_config(path, ["optim.learning_rate=0.001"])  # the override wins: in the domain
    assert cfg.optim.learning_rate == 0.001 and cfg.optim.warmup_steps == 2


def test_chat_data_from_a_checkpoint_needs_its_tokenizer():
    """The byte tokenizer is the chat default; with a checkpoint its ids would fit the
    vocabulary and train silently on the wrong tokens."""
    with pytest.raises(ValueError, match=r"data.tokenizer: 'bytes' \(the default\) with "
                                         r"model.init_from=/models/Qwen3-0.6B"):
        load_config(None, ["data.format=chat", "model.init_from=/models/Qwen3-0.6B"])
    cfg = load_config(None, ["data.format=chat", "model.init_from=/models/Qwen3-0.6B",
                             "data.tokenizer=/models/Qwen3-0.6B"])
    assert cfg.data.tokenizer == "/models/Qwen3-0.6B"
