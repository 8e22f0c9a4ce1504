"""Damaged checkpoints: each way a disk, a copy or a killed writer damages a step directory (a lost,
truncated or changed array file, a lost or changed metadata file, a missing commit marker or
manifest, a stray file) is logged in one line naming the step and the file, and resuming falls
back to the newest intact checkpoint, giving exactly what restoring that checkpoint directly gives;
the damaged step is set aside so it can be saved again. The manifest is written before the step
is committed, whether the save is asynchronous or not. A checkpoint of another model is not damage
and stops the resume."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtree.training.checkpoint
from jtree.training.checkpoint import Checkpointer, CorruptCheckpoint, write_manifest
from tests.checkpoint_damage import DAMAGES, damage

# A read of a damaged checkpoint fails inside Orbax's event loop, which leaves the aborted reads'
# coroutines to be collected later (reported as unraisable exceptions, harmless).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(step: int) -> dict:
    """Random weights (as trained ones are): Orbax stores them uncompressed, so changed bytes in
    them decode without an error (compressible ones often fail to decompress)."""
    return {"w": jax.random.normal(jax.random.key(step), (512,)), "b": jnp.full((3,), float(step)),
            "step": jnp.array(step, jnp.int32)}


def _abstract(state: dict) -> dict:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def _saved(directory: Path, steps=(1, 2, 3), async_save: bool = False) -> Checkpointer:
    ckpt = Checkpointer(directory, keep=5, async_save=async_save)
    for s in steps:
        ckpt.save(s, _state(s), {"next": s}, {"seed": 0})
    ckpt.wait()
    return ckpt


def _assert_same(a, b) -> None:
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """Steps 1-3 saved once (asynchronously, as training does); each case damages a copy."""
    directory = tmp_path_factory.mktemp("saved") / "ck"
    _saved(directory, async_save=True).close()
    return directory


def test_every_save_is_sealed_before_it_is_committed(tmp_path, monkeypatch):
    """Async and sync saves verify intact; a save whose manifest cannot be written is never
    committed (so no step counts as committed without its manifest)."""
    for async_save in (True, False):
        ckpt = _saved(tmp_path / str(async_save), async_save=async_save)
        for step in (1, 2, 3):
            ckpt.verify(step)
        ckpt.close()

    def fail(step_dir):
        raise OSError(f"disk full writing the manifest of {Path(step_dir).name}")

    monkeypatch.setattr(jtree.training.checkpoint, "write_manifest", fail)
    ckpt = Checkpointer(tmp_path / "failed", keep=5, async_save=True)
    ckpt.save(1, _state(1), {"next": 1}, {"seed": 0})
    with pytest.raises(OSError, match="disk full"):
        ckpt.wait()
    assert ckpt.latest_step() is None and not (tmp_path / "failed" / "1").exists()


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_latest_falls_back_to_the_newest_intact_checkpoint(saved_run, tmp_path, how):
    shutil.copytree(saved_run, tmp_path / "ck")
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    expected = ckpt.restore(2, _abstract(_state(0)))
    ckpt.close()
    reason = damage(tmp_path / "ck" / "3", how)

    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    assert ckpt.latest_step() == 3  # Orbax alone would resume from the damaged step
    lines: list[str] = []
    restored = ckpt.restore_latest(_abstract(_state(0)), log=lines.append)
    assert restored.step == 2 and restored.data_state == expected.data_state == {"next": 2}
    assert restored.meta == expected.meta
    _assert_same(restored.state, expected.state)
    assert len(lines) == 1 and f"{tmp_path / 'ck'}/3:" in lines[0] and reason in lines[0], lines
    assert "\n" not in lines[0] and len(lines[0]) < 600
    # set aside, so the resumed run saves step 3 again
    assert (tmp_path / "ck" / "3.corrupt").is_dir() and ckpt.latest_step() == 2
    ckpt.save(3, _state(30), {"next": 3}, {"seed": 0})
    ckpt.wait()
    again = ckpt.restore_latest(_abstract(_state(0)), log=lines.append)
    assert again.step == 3 and float(again.state["b"][0]) == 30.0 and len(lines) == 1
    ckpt.close()


def test_changed_array_bytes_raise_naming_the_file(saved_run, tmp_path):
    shutil.copytree(saved_run, tmp_path / "ck")
    reason = damage(tmp_path / "ck" / "3", "bitflip")
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    with pytest.raises(CorruptCheckpoint) as e:
        ckpt.restore_latest(_abstract(_state(0)), on_corrupt="raise", log=pytest.fail)
    assert f"/3: {reason}" in str(e.value) and "on_corrupt=fallback" in str(e.value)
    assert (tmp_path / "ck" / "3").is_dir()  # left as it was


def test_a_checkpoint_without_a_manifest_is_refused_until_adopted(saved_run, tmp_path):
    """One written by a jtree without checksums: damage (it cannot be told from a lost
    manifest), and nothing is renamed when no step is intact; `write_manifest` adopts it."""
    shutil.copytree(saved_run, tmp_path / "ck")
    for step in (1, 2, 3):
        damage(tmp_path / "ck" / str(step), "manifest")
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    lines: list[str] = []
    with pytest.raises(CorruptCheckpoint, match=r"no intact checkpoint"):
        ckpt.restore_latest(_abstract(_state(0)), log=lines.append)
    assert len(lines) == 3 and all("no jtree_checksums.json" in line for line in lines)
    write_manifest(tmp_path / "ck" / "3")
    restored = ckpt.restore_latest(_abstract(_state(0)), log=pytest.fail)
    assert restored.step == 3
    _assert_same(restored.state, _state(3))


def test_on_corrupt_raise_names_the_step_and_restores_nothing(saved_run, tmp_path):
    shutil.copytree(saved_run, tmp_path / "ck")
    damage(tmp_path / "ck" / "3", "commit")
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    with pytest.raises(CorruptCheckpoint, match=r"/3: not committed.*on_corrupt=fallback"):
        ckpt.restore_latest(_abstract(_state(0)), on_corrupt="raise", log=pytest.fail)
    assert (tmp_path / "ck" / "3").is_dir()  # left as it was


def test_no_intact_checkpoint_stops_the_resume(saved_run, tmp_path):
    shutil.copytree(saved_run, tmp_path / "ck")
    damage(tmp_path / "ck" / "1", "chunk")
    damage(tmp_path / "ck" / "2", "meta_metadata")
    damage(tmp_path / "ck" / "3", "bitflip")
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    lines: list[str] = []
    with pytest.raises(CorruptCheckpoint,
                       match=r"no intact checkpoint \(damaged steps \[1, 2, 3\]\)"):
        ckpt.restore_latest(_abstract(_state(0)), log=lines.append)
    assert len(lines) == 3


def test_a_checkpoint_of_another_model_is_notdamage(saved_run, tmp_path):
    shutil.copytree(saved_run, tmp_path / "ck")
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
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
