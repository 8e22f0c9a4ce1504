import pytest

from jtree.config import TrainConfig, apply_overrides, load_config


def test_tiny_config_loads_with_overrides():
    cfg = load_config("configs/tiny.yaml", ["run.steps=3", "objective.kind=ppo", "model.dtype=bfloat16"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.run.steps == 3 and cfg.objective.kind == "ppo" and cfg.model.dtype == "bfloat16"
    assert cfg.data.seq_len == 1280


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.hidden_sise=3"], r"model\.hidden_sise: unknown config key"),
        (["run.steps=ten"], r"run\.steps: expected an integer, got 'ten'"),
        (["run.steps=1.5"], r"run\.steps: expected an integer"),
        (["objective.kind=dpo"], r"objective\.kind: 'dpo' is not one of"),
        (["optim.learning_rate=true"], r"optim\.learning_rate: expected a number"),
        (["model.num_key_value_heads=3"], r"model: num_key_value_heads \(3\) must divide"),
        (["nonsense"], "expected key.path=value"),
    ],
)
def test_bad_config_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config("configs/tiny.yaml", overrides)


def test_overrides_create_nested_sections():
    assert apply_overrides({}, ["a.b.c=[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}
