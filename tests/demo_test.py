"""The embedded default: the shipped base model, configs/default.yaml and `magic-jax train`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from magic_jax.data.rows import R1_ASSISTANT, R1_BOS, R1_EOS, R1_USER
from magic_jax.jobs import cli
from magic_jax.jobs.default_world import (
    CONFIG_FILE,
    HELDOUT_FILE,
    MODEL_DIR,
    TRAIN_FILE,
    BuildConfig,
    build_default,
)
from magic_jax.jobs.worlds import read_rows_file
from magic_jax.run.config import load_config

REPO = Path(__file__).resolve().parent.parent


def test_default_config_is_the_shipped_recipe():
    assert (REPO / "configs" / "default.yaml").read_text() == CONFIG_FILE.read_text()
    cfg = load_config(REPO / "configs" / "default.yaml")
    assert Path(cfg.model) == MODEL_DIR and Path(cfg.data.train[0]) == TRAIN_FILE
    assert cfg.output_dir == os.path.abspath("runs/default")
    t = [s.max_response_length for s in cfg.stages]
    assert len(t) == 2 and t[0] < t[1]
    assert cfg.sampling.temperature == cfg.loss.temperature == 1.0
    assert cfg.entropy.mode == "adaptive" and cfg.loss.eps_high > cfg.loss.eps_low
    assert cfg.update.num_reuse == 1
    assert all(s.prompts_per_step == s.mini_batch_groups for s in cfg.stages)
    assert cfg.eval.num_samples == 8 and cfg.eval.every < cfg.total_steps
    # >= 200 held-out problems, none of them a training prompt
    held = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in read_rows_file(HELDOUT_FILE)}
    train = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in read_rows_file(TRAIN_FILE)}
    assert len(held) >= 200 and not held & train
    # --set works on it as on any config
    assert load_config(CONFIG_FILE, ["seed=3"]).seed == 3


def test_shipped_model_is_a_small_hf_checkpoint_with_r1_markers():
    from transformers import AutoModelForCausalLM

    from magic_jax.model.convert import load_hf
    from magic_jax.run.policy import load_tokenizer

    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert size <= 20 * 2**20
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    tok = load_tokenizer(MODEL_DIR)
    vocab = tok.get_vocab()
    assert all(m in vocab for m in (R1_BOS, R1_EOS, R1_USER, R1_ASSISTANT, "<think>", "</think>"))
    model = load_hf(MODEL_DIR)
    assert model.config.vocab_size == len(tok) == config["vocab_size"]
    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    assert hf.config.tie_word_embeddings


def _shortened(out: Path) -> list[str]:
    """Overrides that shrink the default run to seconds (same model, task and code path)."""
    return [
        f"output_dir={out}",
        "stages.0.steps=1",
        "stages.1.steps=1",
        "eval.every=2",
        "eval.num_samples=1",
        "rewards.num_workers=1",
    ]


def _sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


@pytest.mark.heavy
def test_train_without_a_config_runs_the_default_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", *_sets(_shortened(out))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("[done] held-out avg@1: ") and "wall time" in lines[-1]
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["problems"] >= 200
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    t = [s.max_response_length for s in load_config(CONFIG_FILE).stages]
    assert [m["max_response_length"] for m in metrics] == [t[0], t[1]]
    assert (out / "report.html").exists() and list((out / "report_png").glob("*.png"))
    assert list((out / "checkpoints").iterdir())


def test_demo_refuses_a_directory_it_did_not_create(tmp_path, capsys):
    work = tmp_path / "mine"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    assert cli.main(["demo", "--workdir", str(work)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(work) in err and "not empty" in err
    assert (work / "notes.txt").read_text() == "keep me" and len(list(work.iterdir())) == 1


def test_missing_or_corrupt_model_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--set", f"model={tmp_path / 'nowhere'}", "--set",
                     f"output_dir={out}"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err and "missing" in err
    bad = tmp_path / "bad"
    shutil.copytree(MODEL_DIR, bad)
    (bad / "model.safetensors").write_bytes(b"\0" * 100)
    assert cli.main(["train", "--set", f"model={bad}", "--set", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors" in err


def test_a_limit_no_answer_fits_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--set", "stages.0.max_response_length=8", "--set", f"output_dir={out}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stages[0].max_response_length" in err
    assert "shorter than any correct answer" in err


@pytest.mark.slow
def test_the_first_command_raises_accuracy(tmp_path):
    """The README's first command exactly as written: `make demo` in the checkout (as CI's
    clean clone has it: no runs/default yet). Where a run directory is already there (a
    working checkout), `magic-jax train` with no arguments in a fresh directory instead."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not (repo / "runs" / "default").exists() and shutil.which("make"):
        cmd, cwd = ["make", "demo"], repo
    else:
        cmd, cwd = [str(Path(sys.executable).with_name("magic-jax")), "train"], tmp_path
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = cwd / "runs" / "default"
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    before, after = evals[0]["accuracy"], evals[-1]["accuracy"]
    print(" ".join(cmd), "->", proc.stdout.splitlines()[-1])
    assert after >= before + 0.05, (before, after)
    assert (run / "report.html").exists()


@pytest.mark.slow  # ~20 s: a few supervised steps, then two held-out evaluations
def test_build_default_writes_a_loadable_model_and_its_curve(tmp_path):
    """``build-default`` at a few steps: the model, problem files and build.json, with the
    held-out evaluations scored through the rollout path (scoring.score_groups)."""
    from magic_jax.run.policy import load_policy

    cfg = BuildConfig(worked_steps=12, mixture_steps=12, batch=4, train_problems=16,
                           heldout_problems=8, eval_every=12, eval_samples=2,
                           eval_problems=4)  # fmt: skip
    info = build_default(tmp_path / "b", cfg, log=lambda s: None)
    assert {p.name for p in (tmp_path / "b").iterdir()} >= {
        "model", "train.jsonl", "heldout.jsonl", "build.json"}  # fmt: skip
    evals = info["evals"]
    assert len(evals) >= 2, evals  # every 12 steps of 24 (and at the end)
    for e in evals:
        assert 0.0 <= e["accuracy"] <= 1.0 and 0.0 <= e["worked_share"] <= 1.0
        assert e["entropy"] > 0.0  # a random-ish model samples with entropy
    load_policy(str(tmp_path / "b" / "model"), "float32", None)
