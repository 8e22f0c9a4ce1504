"""Damaged checkpoints: each way a step directory can be damaged (a lost array chunk, a lost
state or run metadata file, a missing commit marker) is logged in one line naming the step and
the reason, and resuming falls back to the newest intact checkpoint, giving exactly what
restoring that checkpoint directly gives; the damaged step is set aside so it can be saved again.
A checkpoint of another model is not damage and stops the resume."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtree.training.checkpoint import Checkpointer, CorruptCheckpoint
from tests.checkpoint_damage import damage

# A read of a damaged checkpoint fails inside Orbax's event loop, which leaves the aborted reads'
# coroutines to be collected later (reported as unraisable exceptions, harmless).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(step: int) -> dict:
    return {"w": jnp.arange(512.0) * step, "b": jnp.full((3,), float(step)),
            "step": jnp.array(step, jnp.int32)}


def _abstract(state: dict) -> dict:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def _saved(directory: Path, steps=(1, 2, 3)) -> Checkpointer:
    ckpt = Checkpointer(directory, keep=5, async_save=False)
    for s in steps:
        ckpt.save(s, _state(s), {"next": s}, {"seed": 0})
    ckpt.wait()
    return ckpt


@pytest.mark.parametrize("how", ["chunk", "state_metadata", "meta_metadata", "commit"])
def test_damaged_latest_falls_back_to_the_newest_intact_checkpoint(tmp_path, how):
    ckpt = _saved(tmp_path / "ck")
    expected = ckpt.restore(2, _abstract(_state(0)))
    ckpt.close()
    reason = damage(tmp_path / "ck" / "3", how)

    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    assert ckpt.latest_step() == 3  # Orbax alone would resume from the damaged step
    lines: list[str] = []
    restored = ckpt.restore_latest(_abstract(_state(0)), log=lines.append)
    assert restored.step == 2 and restored.data_state == expected.data_state == {"next": 2}
    assert restored.meta == expected.meta
    for a, b in zip(jax.tree_util.tree_leaves(restored.state),
                    jax.tree_util.tree_leaves(expected.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(lines) == 1 and f"{tmp_path / 'ck'}/3:" in lines[0] and reason in lines[0], lines
    assert "\n" not in lines[0] and len(lines[0]) < 600
    # set aside, so the resumed run saves step 3 again
    assert (tmp_path / "ck" / "3.corrupt").is_dir() and ckpt.latest_step() == 2
    ckpt.save(3, _state(30), {"next": 3}, {"seed": 0})
    ckpt.wait()
    again = ckpt.restore_latest(_abstract(_state(0)), log=lines.append)
    assert again.step == 3 and float(again.state["b"][0]) == 30.0 and len(lines) == 1
    ckpt.close()


def test_on_corrupt_raise_names_the_step_and_restores_nothing(tmp_path):
    _saved(tmp_path / "ck").close()
    damage(tmp_path / "ck" / "3", "commit")
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    with pytest.raises(CorruptCheckpoint, match=r"/3: not committed.*on_corrupt=fallback"):
        ckpt.restore_latest(_abstract(_state(0)), on_corrupt="raise")
    assert (tmp_path / "ck" / "3").is_dir()  # left as it was


def test_no_intact_checkpoint_stops_the_resume(tmp_path):
    _saved(tmp_path / "ck", steps=(1, 2)).close()
    damage(tmp_path / "ck" / "1", "chunk")
    damage(tmp_path / "ck" / "2", "meta_metadata")
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    lines: list[str] = []
    with pytest.raises(CorruptCheckpoint, match=r"no intact checkpoint \(damaged steps \[1, 2\]\)"):
        ckpt.restore_latest(_abstract(_state(0)), log=lines.append)
    assert len(lines) == 2


def test_a_checkpoint_of_another_model_is_notdamage(tmp_path):
    ckpt = _saved(tmp_path / "ck")
    other = dict(_state(0), w=jnp.zeros(256))
    mismatch = r"/3: does not match the model .*w has shape \(512,\)"
    with pytest.raises(ValueError, match=mismatch) as e:
        ckpt.restore_latest(_abstract(other), log=pytest.fail)
    assert not isinstance(e.value, CorruptCheckpoint)

    def other_run(meta: dict, where: str) -> None:
        raise ValueError(f"{where}: written with seed={meta['seed']}")

    with pytest.raises(ValueError, match=r"/3: written with seed=0"):
        ckpt.restore_latest(_abstract(_state(0)), log=pytest.fail, check_meta=other_run)
    assert ckpt.latest_step() == 3


def test_empty_directory_restores_nothing(tmp_path):
    assert Checkpointer(tmp_path / "ck").restore_latest(_abstract(_state(0))) is None
