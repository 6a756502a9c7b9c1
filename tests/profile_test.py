"""``profile_steps``: a jax.profiler trace of steps A to B-1, on the local disk and on
``gs://`` (a real GCS emulator), and the "A:B" check naming the option."""

import gzip
import json
import os
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GcsEmulator

from magic_jax import storage
from magic_jax.run.config import load_config
from magic_jax.run.config_dict import ConfigError
from magic_jax.run.profile import StepProfiler, parse_profile_steps

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


@jax.jit
def _step(x):
    return jnp.tanh(x @ x) * 0.5


def _train(profiler, steps, stop_at=None):
    """A few jitted steps, with the profiler around each as the trainer calls it."""
    x = jnp.ones((64, 64), jnp.float32)
    with profiler:
        for step in range(steps):
            if step == stop_at:
                break  # a stop signal: close() writes what was traced
            profiler.before(step)
            x = _step(x)
            profiler.after(step, x)
    return x


def _traced_steps(trace_json_gz):
    events = json.loads(gzip.decompress(trace_json_gz))["traceEvents"]
    return sorted({int(e["args"]["step_num"]) for e in events if e.get("name") == "train"})


def test_local_trace_of_steps_a_to_b_minus_1(tmp_path):
    lines = []
    _train(StepProfiler(tmp_path / "run", "1:3", log=lines.append), steps=5)
    run = tmp_path / "run" / "profile" / "plugins" / "profile" / "steps_1-2"
    host = socket.gethostname()
    assert sorted(p.name for p in run.iterdir()) == [f"{host}.trace.json.gz", f"{host}.xplane.pb"]
    assert (run / f"{host}.xplane.pb").stat().st_size > 1000
    assert _traced_steps((run / f"{host}.trace.json.gz").read_bytes()) == [1, 2]
    assert list((tmp_path / "run" / "profile" / "plugins" / "profile").iterdir()) == [run]
    assert len(lines) == 1
    assert f"tensorboard --logdir {tmp_path / 'run'}/profile" in lines[0]
    assert "tensorboard-plugin-profile" in lines[0] and "steps 1-2" in lines[0]


def test_a_run_that_stops_inside_the_range_keeps_its_steps(tmp_path):
    _train(StepProfiler(str(tmp_path), "2:10", log=lambda s: None), steps=10, stop_at=4)
    run = tmp_path / "profile" / "plugins" / "profile" / "steps_2-3"
    trace = next(run.glob("*.trace.json.gz")).read_bytes()
    assert _traced_steps(trace) == [2, 3]
    assert list(run.glob("*.xplane.pb"))


def test_a_resumed_run_starts_inside_the_range(tmp_path):
    p = StepProfiler(tmp_path, "1:4", log=lambda s: None)
    x = jnp.ones((8, 8))
    for step in range(2, 6):  # resumed at step 2
        with p.step(step):
            x = _step(x)
    p.close()
    runs = (tmp_path / "profile" / "plugins" / "profile").iterdir()
    assert [r.name for r in runs] == ["steps_2-3"]


def test_no_spec_and_a_range_past_the_run_trace_nothing(tmp_path):
    _train(StepProfiler(tmp_path / "a", None), steps=3)
    _train(StepProfiler(tmp_path / "b", "7:9"), steps=3)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_each_process_writes_its_own_file(tmp_path, monkeypatch):
    # several processes may share a host (SLURM, one per GPU): the index joins the host
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(jax, "process_index", lambda: 3)
    _train(StepProfiler(tmp_path, "0:1", log=lambda s: None), steps=1)
    run = tmp_path / "profile" / "plugins" / "profile" / "steps_0-0"
    assert [p.name for p in run.glob("*.xplane.pb")] == [
        f"{socket.gethostname()}-process3.xplane.pb"
    ]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with GcsEmulator(tmp_path_factory.mktemp("gcs") / "emulator.log").in_env() as emulator:
        yield emulator


def test_gcs_trace_is_uploaded(gcs):
    out = gcs.uri("run")
    lines = []
    x = _train(StepProfiler(storage.path(out), "0:2", log=lines.append), steps=3)
    np.testing.assert_array_equal(x, _step(_step(_step(jnp.ones((64, 64))))))
    objects = storage.listing(f"{out}/profile")
    host = socket.gethostname()
    assert sorted(objects) == [
        f"plugins/profile/steps_0-1/{host}.trace.json.gz",
        f"plugins/profile/steps_0-1/{host}.xplane.pb",
    ]
    assert objects[f"plugins/profile/steps_0-1/{host}.xplane.pb"]["size"] > 1000
    trace = storage.gcs_fs().cat_file(
        f"{out}/profile/plugins/profile/steps_0-1/{host}.trace.json.gz"
    )
    assert _traced_steps(trace) == [0, 1]
    assert f"tensorboard --logdir {out}/profile" in lines[0]


@pytest.mark.parametrize("spec", ["3", "5:2", "a:b", "3:3", "-1:2", "1:2:3", ""])
def test_bad_specs_name_profile_steps(spec, tmp_path):
    with pytest.raises(ValueError, match='profile_steps must be "A:B"'):
        parse_profile_steps(spec)
    with pytest.raises(ValueError, match="profile_steps"):
        StepProfiler(tmp_path, spec)


def test_the_config_checks_profile_steps():
    default = os.path.join(CONFIGS, "default.yaml")
    with pytest.raises(ConfigError, match=r"profile_steps must be \"A:B\".*got '5:2'"):
        load_config(default, ['profile_steps="5:2"'])
    assert load_config(default, ['profile_steps="10:12"']).profile_steps == "10:12"
    assert parse_profile_steps("3:5") == (3, 5)
    assert parse_profile_steps(" 0 : 1 ") == (0, 1)
