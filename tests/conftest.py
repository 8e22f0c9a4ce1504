"""Setup shared by the test files.

Fixtures (here): what several test files set up the same way.
- hypothesis runs without a per-example deadline (the first examples of a test compile jax
  functions); each test still sets its own `max_examples`.
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
