"""The training loop on a tiny model: stages, metrics, checkpoints, exact resume, config errors."""

import contextlib
import json

import numpy as np
import pytest
import yaml

from magic_jax.jobs.cli import main
from magic_jax.run.checkpoint import latest_good_checkpoint as latest_checkpoint
from magic_jax.run.config import ConfigError, load_config
from magic_jax.run.inputs import load_inputs
from magic_jax.run.trainer import Trainer

# The model is a tiny one over one-digit sums (tests/helpers.py, save_sums_model).


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from conftest import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("trainer"))


def _config(files, out, *overrides):
    # run.yaml's paths are relative: they are read against the working directory
    with contextlib.chdir(files):
        return load_config("run.yaml", [f"output_dir={out}", *overrides])


def _metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _params(path):
    from safetensors.numpy import load_file

    return load_file(str(path / "hf_final" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(files):
    """An uninterrupted run of both stages."""
    trainer = Trainer(_config(files, "straight"), log=lambda s: None)
    summary = trainer.run()
    assert trainer.ref_params is None  # kl_beta 0 in every stage: no reference held
    return files / "straight", summary


def test_run_goes_through_both_stages(straight):
    out, summary = straight
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["stage"] for r in rows] == [0, 0, 1, 1]
    assert [r["max_response_length"] for r in rows] == [3, 3, 5, 5]
    assert all(r["response_length_max"] <= r["max_response_length"] for r in rows)
    for r in rows:
        for key in (
            "entropy",
            "alpha",
            "reward",
            "kept_group_fraction",
            "grad_norm",
            "clipfrac_low",
            "clipfrac_high",
            "approx_kl",
            "truncated_fraction",
            "t_rollout_s",
            "t_update_s",
            "t_other_s",
        ):
            assert np.isfinite(r[key]), key
    # the rollout/trainer mismatch, measured at each step's first optimizer step: the
    # engine's fp32 decode and the trainer's forward give the same log-probs here
    trained = [r for r in rows if r["sgd_steps"] > 0]
    assert trained and all(abs(r["sampler_ratio_mean"] - 1) < 1e-3 for r in trained)
    assert all(0 <= r["sampler_kl"] < 1e-5 for r in trained)
    # entropy above a target of 5 nats never happens with 20 tokens: c_k grows by delta
    assert [r["alpha"] for r in rows] == pytest.approx([0.0, 0.01, 0.02, 0.03])
    assert summary["entropy_coef"] == pytest.approx(0.04)
    assert summary["optimizer_steps"] == sum(r["sgd_steps"] for r in rows) > 0
    # the two newest checkpoints are kept; the final policy is exported with its tokenizer
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000003", "step_00000004"]
    assert (out / "hf_final" / "config.json").exists()
    assert (out / "hf_final" / "tokenizer.json").exists()
    assert yaml.safe_load((out / "config.yaml").read_text())["stages"][1]["name"] == "longer"


def test_resume_reproduces_the_uninterrupted_run(files, straight):
    out, _ = straight
    cfg = _config(files, "resumed")
    first = Trainer(cfg, log=lambda s: None).run(stop_after=1)
    assert first["steps"] == 1 and latest_checkpoint(files / "resumed").name == "step_00000001"
    assert not (files / "resumed" / "hf_final").exists()
    logs = []
    Trainer(cfg, log=logs.append).run()
    assert any("[resume]" in line and "step 1" in line for line in logs)
    a, b = _metrics(out), _metrics(files / "resumed")
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("reward", "entropy", "alpha", "loss", "grad_norm", "response_length_mean"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    pa, pb = _params(out), _params(files / "resumed")
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_online_filter_drops_prompts_solved_in_the_previous_stage(files, tmp_path):
    from magic_jax.data.rows import AccuracyTracker
    from magic_jax.data.sources import read_rows
    from magic_jax.run.stages import excluded_after

    cfg = _config(files, tmp_path / "x")
    rows = read_rows(files / "train.jsonl")
    tracker = AccuracyTracker()
    tracker.record(rows[0].uid, [1, 1, 1, 1])
    tracker.record(rows[1].uid, [1, 0, 1, 1])
    assert excluded_after(cfg, ["other:9"], tracker) == sorted(["other:9", rows[0].uid])
    trainer = Trainer(cfg, log=lambda s: None)
    trainer.inputs, _ = load_inputs(cfg, log=lambda s: None)
    stage = trainer._stage(1, excluded_after(cfg, [], tracker))
    assert [r.uid for r in stage.rows] == [r.uid for r in rows[1:]]
    assert stage.config.max_response_length == 5 and stage.updater.config.mini_batch_groups == 4
    off = _config(files, tmp_path / "x", "data.online_filter=false")
    assert excluded_after(off, ["other:9"], tracker) == ["other:9"]


def test_config_errors_name_the_option(files):
    with pytest.raises(ConfigError, match=r"stages\[0\]\.group_sise: unknown option"):
        _config(files, "e", "stages.0.group_sise=3")
    with pytest.raises(ConfigError, match=r"optimizer\.learning_rate: expected a number"):
        _config(files, "e", "optimizer.learning_rate=fast")
    with pytest.raises(ConfigError, match=r"stages\[1\]: group_size must be >= 2"):
        _config(files, "e", "stages.1.group_size=1")
    with pytest.raises(ConfigError, match="run.yaml"):
        _config(files, "e", "loss.aggregation=mean")
    with pytest.raises(ConfigError, match="not valid YAML"):
        bad = files / "bad.yaml"
        bad.write_text("stages: [\n")
        load_config(bad)
    # one temperature for sampler and loss
    cfg = _config(files, "e", "sampling.temperature=0.6")
    assert cfg.loss.temperature == 0.6


def test_cli_reports_bad_config_and_bad_data(files, capsys, monkeypatch):
    monkeypatch.chdir(files)
    assert main(["train", str(files / "run.yaml"), "--set", "stages.0.steps=0"]) == 2
    assert "steps must be positive" in capsys.readouterr().err
    for option, message in (
        ("stages.0.until={eval_patience: 2}", "stages[0].until.eval_patience needs an eval"),
        ("loss.kl_reference=no/such/dir", "loss.kl_reference: "),
        ("rollout.refill_max_rounds=0", "rollout.refill_max_rounds: must be >= 1"),
    ):
        assert main(["train", str(files / "run.yaml"), "--set", option]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    (files / "broken.jsonl").write_text('{"prompt": []}\n')
    code = main(
        [
            "train",
            str(files / "run.yaml"),
            "--set",
            f"data.train=[{files / 'broken.jsonl'}]",
            "--set",
            f"output_dir={files / 'broken_run'}",
        ]
    )
    assert code == 2
    assert "broken.jsonl:1:" in capsys.readouterr().err


def test_train_command_with_relative_paths_checkpoints_and_resumes(files, monkeypatch, capsys):
    """As a user types it: a relative config, a relative output_dir (orbax needs absolute)."""
    monkeypatch.chdir(files)
    args = ["train", "run.yaml", "--set", "output_dir=runs/rel", "--set", "export_hf=false"]
    assert main([*args, "--stop-after", "1"]) == 0
    assert latest_checkpoint(files / "runs" / "rel").name == "step_00000001"
    assert main([*args, "--stop-after", "2"]) == 0
    assert [r["step"] for r in _metrics(files / "runs" / "rel")] == [0, 1]
    assert "continuing at step 1" in capsys.readouterr().out


def test_kl_against_the_frozen_reference_per_stage(files):
    """kl_beta in stage 0 only; the reference (loss.kl_reference, relative) never changes."""
    import jax
    from flax import nnx

    from magic_jax.run.policy import load_policy

    cfg = _config(files, "kl", "stages.0.kl_beta=0.5", "loss.kl_reference=model", "export_hf=false")
    assert cfg.loss.kl_reference == str(files / "model")
    trainer = Trainer(cfg, log=lambda s: None)
    trainer.run(stop_after=3)
    rows = _metrics(files / "kl")
    assert [r["kl_beta"] for r in rows] == [0.5, 0.5, 0.0]
    # once the policy has moved (an optimizer step before), k3 to the reference is > 0
    assert sum(r["sgd_steps"] for r in rows[:2]) > 1 and max(r["ref_kl"] for r in rows[:2]) > 0
    assert rows[2]["ref_kl"] == 0.0  # stage 1: beta 0, no reference forward
    _, initial = nnx.split(load_policy(files / "model", "float32", None), nnx.Param)
    for a, b in zip(jax.tree.leaves(trainer.ref_params), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reference_defaults_to_a_copy_of_the_initial_weights(files, tmp_path):
    import jax.numpy as jnp

    from magic_jax.run.policy import reference_params

    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    assert reference_params(_config(files, tmp_path), params, None) is None
    ref = reference_params(_config(files, tmp_path, "loss.kl_beta=0.01"), params, None)
    for k in params:
        np.testing.assert_array_equal(ref[k], params[k])
        assert ref[k].unsafe_buffer_pointer() != params[k].unsafe_buffer_pointer()
    bad = _config(files, tmp_path, "stages.1.kl_beta=0.01", "loss.kl_reference=.")
    with pytest.raises(ConfigError, match="loss.kl_reference: .* holds no Hugging Face checkpoint"):
        reference_params(bad, params, None)


@pytest.mark.slow  # ~8-21 s of compiles and a subprocess; the slow target runs it
def test_until_rule_switch_survives_resume_with_refill(files):
    """Stage 0 ends on its truncation rule after one step; the resumed run starts stage 1."""
    args = (
        "stages.0.until={truncated_below: 1.0, truncated_steps: 1}",
        "rollout.refill=true",
        "rollout.refill_max_rounds=1",
        "loss.tis_cap=2",
    )
    cfg = _config(files, "until", *args)
    Trainer(cfg, log=lambda s: None).run(stop_after=1)
    meta = json.loads((latest_checkpoint(files / "until") / "trainer.json").read_text())
    assert meta["schedule"]["index"] == 1 and meta["schedule"]["start"] == 1
    assert meta["schedule"]["switches"][0]["step"] == 1
    logs = []
    summary = Trainer(cfg, log=logs.append).run()
    rows = _metrics(files / "until")
    where = [(r["step"], r["stage"], r["stage_step"]) for r in rows]
    assert where == [(0, 0, 0), (1, 1, 0), (2, 1, 1)]
    assert "truncated fraction under 1.0 " in rows[0]["stage_end"]
    assert "budget" in rows[2]["stage_end"] and "stage_end" not in rows[1]
    assert summary["finished"] and (files / "until" / "hf_final").exists()
    for r in rows:
        assert r["refill_rounds"] in (0, 1)
        assert r["extra_rollouts"] == r["refill_rounds"] * 4 * 8
        assert r["prompts"] == 4 * (1 + r["refill_rounds"])
        # a full batch of mixed groups whenever enough were found
        assert r["kept_group_fraction"] == min(r["mixed_groups"], 4) / 4
        # TIS: the trainer's pi_old over the sampler's: ~1 in fp32, never above the cap
        assert r["sgd_steps"] == 0 or 0.99 < r["tis_weight_mean"] < 1.01


def test_evaluation_samples_at_its_own_temperature(files, tmp_path):
    # rollouts at 0.5; the evaluation at the report's protocol (1.0) unless eval.temperature says
    evals = "eval={data: [train.jsonl], every: 1, num_samples: 1, max_response_length: 5}"
    temp = ("sampling.temperature=0.5", "loss.temperature=0.5", evals)
    trainer = Trainer(_config(files, tmp_path / "t", *temp), log=lambda s: None)
    trainer.run(stop_after=1)
    assert trainer.stage.driver.engine.config.sampling.temperature == 0.5  # the rollouts
    assert trainer.evaluator.driver.engine.config.sampling.temperature == 1.0
    assert _config(files, tmp_path / "u", *temp, "eval.temperature=0.7").eval.temperature == 0.7
    with pytest.raises(ConfigError, match="eval.*temperature must be > 0"):
        _config(files, tmp_path / "bad", evals, "eval.temperature=0")
    with pytest.raises(ConfigError, match=r"eval.*extra_temperatures must all be > 0, got \[0.0\]"):
        _config(files, tmp_path / "bad", evals, "eval.extra_temperatures=[0.6, 0]")


def test_evaluation_also_at_extra_temperatures(files, tmp_path):
    evals = (
        "eval={data: [train.jsonl], every: 1, num_samples: 2, max_response_length: 5, "
        "extra_temperatures: [0.6, 1.0]}"
    )
    out = tmp_path / "x"
    trainer = Trainer(_config(files, out, evals), log=lambda s: None)
    trainer.run(stop_after=1)
    temps = {
        t: d.engine.config.sampling.temperature for t, d in trainer.evaluator.extra_drivers.items()
    }
    assert temps == {0.6: 0.6, 1.0: 1.0}
    # one engine's programs and one KV cache for every temperature
    main = trainer.evaluator.driver
    assert all(d._states is main._states for d in trainer.evaluator.extra_drivers.values())
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert sorted(r["by_temperature"]) == ["0.6", "1"]
        at1 = r["by_temperature"]["1"]
        # the same problems, samples, seed and step at the same temperature: the same numbers
        assert at1["accuracy"] == r["accuracy"] and at1["pass_at_n"] == r["pass_at_n"]
        assert 0 <= r["by_temperature"]["0.6"]["accuracy"] <= 1
