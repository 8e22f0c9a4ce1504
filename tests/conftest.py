"""Setup shared by the test files.

Fixtures (here): what several test files set up the same way.
- hypothesis runs without a per-example deadline (the first examples of a test compile jax
  functions); each test still sets its own `max_examples`.
- the files that run longest are collected first (`LONG_FILES_FIRST`), so that the two workers of
  `make test` finish together.
- `sample_groups`: the bundled sample data, data/sample_groups.jsonl.
- `groups_file`, `few_groups_file`: branching agent-rollout groups written for a tiny training
  run (12 groups: several steps; 4 groups: a step or two).

Helpers (modules named for their concept, imported by the tests; a test file imports these, never
another test file: no module imports a test file, a contract `lint-imports` checks,
tests/import_layers.py's `TestFilesAreLeaves`):
- tests/models_util.py: tiny configs and models, jitted log-prob and loss-and-gradient functions,
  tree-vs-baseline layouts, log-probs, loss and gradient comparison, the per-path inputs of dense
  references.
- tests/strategies.py: random trees and forests (hypothesis strategies), trees whose paths agree
  on shared tokens (`consistent_tree`, `gspo_tree`), and the fixed tree sets several files share.
- tests/attention_cases.py: random tree masks and q/k/v for the attention kernels, errors against
  the dense reference (with a cached prefix too).
- tests/window_cases.py: sliding-window and attention-sink cases and their dense oracle.
- tests/gdn_cases.py: the gated delta rule kernels' tree cases (shapes, the deep chain, paths
  gathered, tree kernel vs per-path recurrence as losses with gradients).
- tests/redundancy_free_checks.py: redundancy-free parts against the unpartitioned tree (loss,
  metrics, gradients, log-probs, the executor's schedule).
- tests/memory_plan_checks.py: the memory plan's depth rule against an actual compile.
- tests/run_util.py: training runs (launcher subprocess, tiny config overrides, groups files,
  metrics) and the repository root.
- tests/checkpoint_damage.py: the ways a saved checkpoint step can be damaged.
- tests/hf_util.py: HF checkpoints on the jtree side (random models, parameters by name, edited
  copies of a checkpoint, weights copied in by HF name); no torch.
- tests/torch_util.py: tiny transformers checkpoints and their logits (needs torch).
- tests/hf_path_checks.py: an architecture's tiny random transformers checkpoint (every parameter
  random; `write_deepseek_checkpoint`: the routers' selection biases too) against jtree
  path by path (compare-torch, log-probs, PPO gradients, save -> from_pretrained; needs torch).
- tests/mesh_worker.py: the subprocess that runs train steps on 8 forced host devices.
- tests/mtp_mesh_worker.py: the subprocess that runs an MTP objective's gradient on 8 forced
  host devices.
- tests/moe_dispatch_worker.py, tests/redundancy_free_mesh_worker.py, tests/gdn_context_worker.py:
  the subprocesses that compare the MoE dispatch, the redundancy-free step and Gated DeltaNet on
  forced host devices with one device.
- tests/triton_interpreter.py: the process that runs the `triton_lang` kernels in Triton's CPU
  interpreter.
- tests/import_layers.py: the import contracts `lint-imports` checks.
- tests/covering.py: covering designs (all pairs of factors) for the sweeps of slow tests.

Compiles are quick and shared: every test process compiles with `tests.run_util.CODEGEN_XLA_FLAGS`
(less of XLA's backend optimization: tiny programs compiled once spend more time compiling than
running), set here for the session and passed to subprocesses. A test session (and every subprocess
it starts: launcher runs, mesh workers) writes jax's persistent compilation cache into one fresh
directory, removed at the end, so that a program compiled by one test is loaded, not compiled again,
by the next test or subprocess that builds the same program. A cache hit returns the executable XLA
compiled for that program, so no result changes. `JAX_COMPILATION_CACHE_DIR` set before the session
(CI shares one across the default and the slow suite) is used as it is and left in place. Likewise
`auto`'s attention decisions on CPU go to one fresh store for the session
(`JTREE_ATTENTION_CALIBRATION_DIR`, unless set before): each shape class is measured once per
session, and the user's ~/.cache is left alone.

`--start-budget-s=N` (CI's slow suite, `.ci/run`): a test due to start more than N seconds after
its process began is skipped, and the summary counts those tests as not run for time, so that a
suite on a slow machine ends inside CI's limit rather than being killed there."""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import settings

from tests.run_util import CODEGEN_XLA_FLAGS, WORKTREE, write_groups

settings.register_profile("jtree", deadline=None)
settings.load_profile("jtree")

# the directories this process made, removed at its end
_OWN_DIRS = pytest.StashKey[list[str]]()
# when this process (the controller or an xdist worker) began, for `--start-budget-s`
_STARTED = pytest.StashKey[float]()
_BUDGET_REASON = "not started: past the suite's start budget"
# session-wide directories: jax's compilation cache and the store of `auto`'s attention decisions
# (`jtree.kernels.attention.calibration`: measured once per shape class in the session, never
# read from or written to the user's ~/.cache)
_SESSION_DIRS = {"JAX_COMPILATION_CACHE_DIR": "jtree-tests-jax-cache-",
                 "JTREE_ATTENTION_CALIBRATION_DIR": "jtree-tests-attention-calibration-"}
_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--start-budget-s", type=float, default=None,
                     help="skip every test due to start later than this many seconds after the "
                          "session began (CI's time limit); the summary counts them")


def pytest_configure(config: pytest.Config) -> None:
    """Point this session (the xdist controller, whose environment its workers and subprocesses
    inherit) at a shared compilation cache and attention calibration store; workers find the
    variables already set. A directory already set before the session is used as it is."""
    config.stash[_OWN_DIRS] = []
    config.stash[_STARTED] = time.monotonic()
    for key, prefix in _SESSION_DIRS.items():
        if key not in os.environ:
            os.environ[key] = tempfile.mkdtemp(prefix=prefix)
            config.stash[_OWN_DIRS].append(os.environ[key])
    for key, value in _CACHE_ENV.items():
        os.environ.setdefault(key, value)
    flags = os.environ.get("XLA_FLAGS", "")
    if CODEGEN_XLA_FLAGS not in flags:  # before any jax backend exists, here or in a worker
        os.environ["XLA_FLAGS"] = f"{flags} {CODEGEN_XLA_FLAGS}".strip()
    import jax  # noqa: PLC0415 (after the variables: a run without xdist imports jax here first)

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


@pytest.hookimpl(tryfirst=True)  # before any fixture of the test is set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    budget = item.config.getoption("--start-budget-s")
    if budget is not None and time.monotonic() - item.config.stash[_STARTED] > budget:
        pytest.skip(f"{_BUDGET_REASON} ({budget:.0f} s)")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """One line saying how many tests the start budget left out (none: no line)."""
    budget = config.getoption("--start-budget-s")
    if budget is None:
        return
    left_out = sum(_BUDGET_REASON in str(report.longrepr)
                   for report in terminalreporter.stats.get("skipped", []))
    if left_out:
        terminalreporter.write_line(f"{left_out} tests NOT run: they were due to start after "
                                    f"the start budget of {budget:.0f} s (--start-budget-s)")


def pytest_unconfigure(config: pytest.Config) -> None:
    for own in config.stash.get(_OWN_DIRS, []):
        shutil.rmtree(own, ignore_errors=True)


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
