from pathlib import Path

import pytest
import yaml

from jtree.config import TrainConfig, apply_overrides, load_config
from jtree.config.architectures import Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig
from jtree.models import ARCHITECTURES
from jtree.parallel.sharding import param_rules

CONFIGS = sorted(Path("configs").glob("*.yaml"))


def test_tiny_config_loads_with_overrides():
    cfg = load_config("configs/tiny.yaml", ["run.steps=3", "objective.kind=ppo",
                                            "runtime.dtype=bfloat16", "mesh.model=2"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.run.steps == 3 and cfg.objective.kind == "ppo"
    assert cfg.model.architecture == "qwen3" and isinstance(cfg.model.config, Qwen3Config)
    assert cfg.runtime.dtype == "bfloat16" and cfg.mesh.model == 2
    assert cfg.data.seq_len == 1280


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_validates_and_shards(path):
    """Every shipped config loads into its architecture's config class, and its model splits over
    its mesh.model (the sharding rules raise on a head, expert or vocabulary count that does not
    divide)."""
    arch = yaml.safe_load(path.read_text())["model"]["architecture"]
    cfg = load_config(path)
    assert cfg.model.architecture == arch
    assert isinstance(cfg.model.config, ARCHITECTURES[arch].config_class)
    assert param_rules(cfg.model.config, cfg.mesh.model)


def test_moe_and_next_sections_validate_with_their_key_paths():
    cfg = load_config("configs/qwen3_30b_a3b.yaml", ["model.num_experts=64", "data.gdn_chunks=48"])
    assert isinstance(cfg.model.config, Qwen3MoeConfig) and cfg.model.config.num_experts == 64
    assert cfg.data.gdn_chunks == 48 and not cfg.model.config.decoder().needs_gdn_tables
    nxt = load_config("configs/qwen3_next_80b_a3b.yaml", ["model.num_hidden_layers=8"])
    assert isinstance(nxt.model.config, Qwen3NextConfig) and nxt.model.config.decoder().needs_gdn_tables
    assert nxt.model.config.layer_types.count("full_attention") == 2
    for overrides, match in [
        (["model.num_expert=4"], r"model\.num_expert: unknown config key"),
        (["model.mlp_only_layers=3"], r"model\.mlp_only_layers: expected a list"),
        (["model.num_experts_per_tok=200"], r"model: num_experts_per_tok \(200\) must be in"),
        (["data.gdn_chunks=0"], r"^data\.gdn_chunks=0 \(override\): must be >= 1$"),
        (["data.gdn_chunk_size=0"], r"^data\.gdn_chunk_size=0 \(override\): must be >= 1$"),
        (["objective.routing_replay=true"],
         r"objective\.routing_replay: needs data\.format 'traces' \(routed_experts"),
        (["objective.routing_replay=true", "data.format=traces", "run.mode=redundancy_free"],
         r"objective\.routing_replay: not available with run\.mode=redundancy_free"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_config("configs/qwen3_30b_a3b.yaml", overrides)
    replay = load_config("configs/qwen3_30b_a3b.yaml",
                         ["objective.routing_replay=true", "data.format=traces"])
    assert replay.objective.routing_replay  # a MoE model on traces, in tree mode: accepted
    with pytest.raises(ValueError, match=r"model\.layer_types\[1\]: expected a string"):
        load_config("configs/qwen3_next_80b_a3b.yaml",
                    ["model.num_hidden_layers=2", "model.layer_types=[full_attention, 3]"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.hidden_sise=3"], r"model\.hidden_sise: unknown config key"),
        (["model.architecture=gpt2"], r"model\.architecture: 'gpt2' is not one of"),
        (["run.steps=ten"], r"run\.steps: expected an integer, got 'ten'"),
        (["run.steps=1.5"], r"run\.steps: expected an integer"),
        (["objective.kind=dpo"], r"objective\.kind: 'dpo' is not one of"),
        (["optim.learning_rate=true"], r"optim\.learning_rate: expected a number"),
        (["model.num_key_value_heads=3"], r"model: num_key_value_heads \(3\) must divide"),
        (["runtime.remat=some"], r"runtime: remat: 'some' is not one of"),
        (["runtime.gdn_scan=tree"], r"runtime: gdn_scan: 'tree' is not one of"),
        (["data.format=csv"], r"data\.format: 'csv' is not one of"),
        (["data.on_bad_record=ignore"], r"data\.on_bad_record: 'ignore' is not one of"),
        (["data.micro_batches=0"], r"^data\.micro_batches=0 \(override\): must be >= 1$"),
        (["mesh.model=0"], r"^mesh\.model=0 \(override\): must be >= 1$"),
        (["mesh.fsdp=0"], r"^mesh\.fsdp=0 \(override\): must be >= 1$"),
        (["mesh.pipeline=2"], r"mesh\.pipeline: unknown config key"),
        (["checkpoint.every=0"], r"^checkpoint\.every=0 \(override\): must be >= 1$"),
        (["checkpoint.dir=[1]"], r"checkpoint\.dir: "),
        (["objective.routing_replay=true"],
         r"objective\.routing_replay: model\.architecture 'qwen3' has no MoE layers"),
        (["nonsense"], "expected key.path=value"),
    ],
)
def test_bad_config_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config("configs/tiny.yaml", overrides)


def test_exponent_without_a_dot_is_a_number():
    cfg = load_config("configs/tiny.yaml", ["optim.learning_rate=1e-4", "model.rms_norm_eps=1E-5"])
    assert cfg.optim.learning_rate == 1e-4 and cfg.model.config.rms_norm_eps == 1e-5
    with pytest.raises(ValueError, match=r"optim\.learning_rate: expected a number, got 'fast'"):
        load_config("configs/tiny.yaml", ["optim.learning_rate=fast"])


def test_overrides_create_nested_sections():
    assert apply_overrides({}, ["a.b.c=[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}


def test_runtime_section_is_its_own_and_not_a_model_field():
    cfg = load_config("configs/tiny.yaml", ["runtime.remat=full", "runtime.attention_impl=xla"])
    assert (cfg.runtime.remat, cfg.runtime.attention_impl) == ("full", "xla")
    with pytest.raises(ValueError, match=r"runtime\.dtypes: unknown config key"):
        load_config("configs/tiny.yaml", ["runtime.dtypes=bfloat16"])
    with pytest.raises(ValueError, match=r"model\.remat: unknown config key"):
        load_config("configs/tiny.yaml", ["model.remat=full"])
