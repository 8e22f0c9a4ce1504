"""Setup shared by the test files.

Fixtures (here): what several test files set up the same way.
- hypothesis runs without a per-example deadline (the first examples of a test compile jax
  functions); each test still sets its own `max_examples`.
- the files that run longest are collected first (`LONG_FILES_FIRST`), so that the two workers of
  `make test` finish together.
- `sample_groups`: the bundled sample data, data/sample_groups.jsonl.
- `groups_file`, `few_groups_file`: branching agent-rollout groups written for a tiny training
  run (12 groups: several steps; 4 groups: a step or two).

Helpers (modules named for their concept, imported by the tests; no test file imports another):
- tests/models_util.py: tiny configs and models, jitted log-prob and loss-and-gradient functions,
  tree-vs-baseline loss and gradient comparison.
- tests/strategies.py: random trees and forests (hypothesis strategies) and the fixed tree sets
  several files share.
- tests/attention_cases.py: random tree masks and q/k/v for the attention kernels, errors against
  the dense reference.
- tests/run_util.py: training runs (launcher subprocess, tiny config overrides, groups files,
  metrics) and the repository root.
- tests/checkpoint_damage.py: the ways a saved checkpoint step can be damaged.
- tests/hf_util.py: HF checkpoints on the jtree side (random models, parameters by name, edited
  copies of a checkpoint, weights copied in by HF name); no torch.
- tests/torch_util.py: tiny transformers checkpoints and their logits (needs torch).
- tests/mesh_worker.py: the subprocess that runs train steps on 8 forced host devices.
"""

from pathlib import Path

import pytest
from hypothesis import settings

from tests.run_util import WORKTREE, write_groups

settings.register_profile("jtree", deadline=None)
settings.load_profile("jtree")


@pytest.fixture
def sample_groups() -> Path:
    return WORKTREE / "data" / "sample_groups.jsonl"


@pytest.fixture
def groups_file(tmp_path: Path) -> Path:
    return write_groups(tmp_path / "groups.jsonl")


@pytest.fixture
def few_groups_file(tmp_path: Path) -> Path:
    return write_groups(tmp_path / "groups.jsonl", n_groups=4)


# The files that run for a minute or more, longest first. `make test` runs two workers that take
# whole files (`--dist loadfile`) in collection order; a long file collected last (tests/training
# and tests/trees sort after the rest) would leave one worker running it alone at the end.
LONG_FILES_FIRST = (
    "tests/step/test_mesh.py", "tests/kernels/test_block_tables.py",
    "tests/e2e/test_device_check.py", "tests/e2e/test_launch_train.py",
    "tests/training/test_resume.py", "tests/partitioning/test_redundancy_free.py",
    "tests/parallel/test_context_parallel.py", "tests/training/test_multihost.py",
    "tests/models/test_hybrid_equivalence.py", "tests/e2e/test_entry_points.py",
    "tests/kernels/test_attention_mgpu.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
