"""Train-state checkpoints: manifests, verification of every file, fallback, retention."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magic_jax.run.checkpoint import (
    BAD_CHECKPOINTS,
    MANIFEST,
    TRAINER_STATE,
    TrainCheckpoints,
    latest_good_checkpoint,
    read_trainer_state,
    step_dirs,
    verify_checkpoint,
    write_manifest,
)
from magic_jax.run.rundir import RunDirError


def _state(step):
    k = jax.random.key(step)
    return {
        "params": {"w": jax.random.normal(k, (16, 8)), "b": jnp.full((8,), float(step))},
        "opt": {"mu": jnp.zeros((16, 8)) + step},
        "step": jnp.int32(step),
    }


def _meta(step):
    schedule = {"index": 0, "start": 0, "switches": []}
    return {
        "next_step": step,
        "stage": 0,
        "excluded": [],
        "tracker": {"counts": {}},
        "schedule": schedule,
    }


def _save_steps(out, steps, keep=2):
    ckpts = TrainCheckpoints(out, keep=keep)
    for s in steps:
        ckpts.save(s, _state(s), _meta(s))
    ckpts.close()


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """A run directory with good checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("ckpt")
    _save_steps(out, [1, 2])
    return out


def _files(path):
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )


def test_save_writes_a_manifest_of_every_file_and_restores_exactly(run2):
    assert [s for s, _ in step_dirs(run2)] == [1, 2]
    path = run2 / "checkpoints" / "step_00000002"
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(manifest) == [f for f in _files(path) if f != MANIFEST]
    assert TRAINER_STATE in manifest and any(f.startswith("state/") for f in manifest)
    assert verify_checkpoint(path) is None
    got = TrainCheckpoints(run2, keep=2).restore(_state(0), path)
    assert _equal(got, _state(2))


def _damage(file, how):
    data = file.read_bytes()
    if how == "garbage":  # same size, other bytes (4 KiB at most, as a bad disk write)
        n = min(len(data), 4096)
        file.write_bytes(bytes(b ^ 0xA5 for b in data[:n]) + data[n:])
    elif how == "truncated":
        file.write_bytes(data[: len(data) // 2])
    else:
        file.unlink()


@pytest.mark.parametrize("how", ["garbage", "truncated", "deleted"])
def test_any_damaged_file_is_named_and_the_previous_checkpoint_is_used(run2, tmp_path, how):
    import shutil

    names = _files(run2 / "checkpoints" / "step_00000002")
    assert len(names) > 8
    for name in names:
        out = tmp_path / f"{how}-{name.replace('/', '_')}"
        shutil.copytree(run2, out)
        newest = out / "checkpoints" / "step_00000002"
        _damage(newest / name, how)
        lines = []
        found = latest_good_checkpoint(out, log=lines.append, set_aside=True)
        assert found == out / "checkpoints" / "step_00000001", (how, name)
        assert len(lines) == 1 and "\n" not in lines[0], (how, name, lines)
        assert str(newest) in lines[0] and "moved to" in lines[0]
        if name != MANIFEST:
            assert name in lines[0] or (how != "deleted" and MANIFEST in lines[0]), lines[0]
        # set aside, not deleted: the damaged files are still there to look at
        assert (out / BAD_CHECKPOINTS / "step_00000002").is_dir() and not newest.exists()
        got = TrainCheckpoints(out, keep=2).restore(_state(0), found)
        assert _equal(got, _state(1))


def test_no_usable_checkpoint_stops_and_moves_nothing(run2, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run2, out)
    for _, path in step_dirs(out):
        (path / TRAINER_STATE).write_text("{}")
    with pytest.raises(RunDirError) as e:
        latest_good_checkpoint(out, log=lambda s: None, set_aside=True)
    msg = str(e.value)
    assert "no usable checkpoint" in msg and "step_00000002 (trainer.json" in msg
    assert "\n" not in msg
    assert [s for s, _ in step_dirs(out)] == [1, 2] and not (out / BAD_CHECKPOINTS).exists()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"{}", "missing field 'next_step'"),
        (b"\x00\x9f\x92\x96binary", "not a JSON trainer state"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"next_step": "3", "stage": 0, "excluded": [], "tracker": {"counts": {}}}', "next_step"),
        (
            b'{"next_step": 3, "stage": 0, "excluded": [], "tracker": {"counts": {}}}',
            "missing field 'schedule'",
        ),
    ],
)
def test_bad_trainer_state_is_named_even_with_a_matching_manifest(run2, tmp_path, content, reason):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run2, out)
    path = out / "checkpoints" / "step_00000002"
    (path / TRAINER_STATE).write_bytes(content)
    write_manifest(path)  # checksums agree: only the content check can catch it
    assert reason in verify_checkpoint(path)
    with pytest.raises(RunDirError, match=reason):
        read_trainer_state(path)


def test_an_interrupted_save_is_set_aside_and_retention_keeps_a_verified_one(tmp_path):
    ckpts = TrainCheckpoints(tmp_path, keep=1)
    ckpts.save(1, _state(1), _meta(1))
    ckpts.save(2, _state(2), _meta(2))
    ckpts.wait()  # saves are asynchronous: the manifest is written once orbax commits
    # as if killed between orbax's commit and the manifest
    (tmp_path / "checkpoints" / "step_00000002" / MANIFEST).unlink()
    ckpts.save(3, _state(3), _meta(3))
    ckpts.wait()
    # keep=1 counts the newest (3, its manifest written after this choice); the newest
    # verified one (1: 2 has no manifest) stays until a newer one is verified
    assert [s for s, _ in step_dirs(tmp_path)] == [1, 3]
    ckpts.save(4, _state(4), _meta(4))
    ckpts.wait()
    assert [s for s, _ in step_dirs(tmp_path)] == [3, 4]
    ckpts.close()
    out = tmp_path / "b"
    ckpts = TrainCheckpoints(out, keep=1)
    ckpts.save(1, _state(1), _meta(1))
    ckpts.save(2, _state(2), _meta(2))
    ckpts.wait()
    (out / "checkpoints" / "step_00000002" / MANIFEST).unlink()
    lines = []
    assert latest_good_checkpoint(out, log=lines.append, set_aside=True).name == "step_00000001"
    assert "no manifest.json" in lines[0]
    ckpts.close()


def test_retention_keeps_the_newest(tmp_path):
    _save_steps(tmp_path, [1, 2, 3, 4], keep=2)
    assert [s for s, _ in step_dirs(tmp_path)] == [3, 4]
    assert all(verify_checkpoint(p) is None for _, p in step_dirs(tmp_path))
