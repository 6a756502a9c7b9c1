"""Monitor (metric lines, TensorBoard event files, progress) and the report of two runs."""

import base64
import io
import json
import math

import numpy as np
import pytest
import yaml

from magic_jax.jobs.cli import main
from magic_jax.run.monitor import Monitor, Progress


def _row(step, stage, k, rng):
    """A metrics row with the trainer's fields."""
    t = 8 * 2**stage
    return {
        "step": step, "stage": stage, "stage_step": k, "max_response_length": t,
        "prompts": 4, "reward": float(rng.random()), "accuracy_not_truncated": float(rng.random()),
        "truncated_fraction": float(rng.random()), "response_length_mean": t * 0.6,
        "response_length_max": t, "entropy": 1.0 / (1 + step), "alpha": 0.005 * step,
        "entropy_coef_next": 0.0, "kept_group_fraction": 0.5, "sgd_steps": 1, "loss": 0.1,
        "clipfrac_low": 0.01, "clipfrac_high": 0.02, "ratio_max": 1.1, "approx_kl": 1e-4,
        "grad_norm": 1.0 + step, "skipped_updates": 0,
        "reward_status": {"correct": step, "wrong": 3}, "rollout_tokens_per_s": 100.0,
        "t_rollout_s": 2.0, "t_update_s": 1.0, "t_other_s": 0.5,
    }  # fmt: skip


def _write_run(path, seed, stage_steps=(3, 2), target=0.2):
    rng = np.random.default_rng(seed)
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump({"entropy": {"target": target}}))
    lines = []
    with Monitor(path, stage_steps=stage_steps, log=lines.append, bar=False) as mon:
        step = 0
        for stage, n in enumerate(stage_steps):
            for k in range(n):
                mon.step(_row(step, stage, k, rng), f"[step {step}]")
                if step % 2 == 0:
                    ev = {"step": step, "accuracy": 0.1 * step, "num_samples": 4,
                          "pass_at_k": {"1": 0.1 * step, "2": 0.2}}  # fmt: skip
                    mon.eval(ev, f"[eval step {step}]")
                step += 1
    return lines


def _scalars(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_monitor_writes_lines_and_event_files_tensorboard_reads(tmp_path):
    run = tmp_path / "run"
    lines = _write_run(run, 0)
    assert lines[:3] == ["[step 0]", "[eval step 0]", "[step 1]"]  # plain lines off a terminal
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4]
    tb = _scalars(run)
    assert [s for s, _ in tb["train/reward"]] == [0, 1, 2, 3, 4]
    assert [v for _, v in tb["train/reward"]] == pytest.approx([m["reward"] for m in metrics])
    assert tb["train/reward_status/correct"] == [(s, float(s)) for s in range(5)]
    assert [s for s, _ in tb["eval/accuracy"]] == [0, 2, 4]
    assert tb["eval/pass_at_k/2"] == [(0, pytest.approx(0.2)), (2, pytest.approx(0.2)),
                                      (4, pytest.approx(0.2))]  # fmt: skip
    # a resumed run from step 3: TensorBoard shows the new steps, not the lost ones
    with Monitor(run, stage_steps=(3, 2), start_step=3, log=lambda s: None, bar=False) as mon:
        mon.step(_row(3, 1, 0, np.random.default_rng(9)) | {"grad_norm": 100.0}, "")
    assert _scalars(run)["train/grad_norm"][-2:] == [(2, 3.0), (3, 100.0)]


def test_progress_prints_plain_lines_with_eta():
    lines = []
    with Progress(4, desc="eval", unit="problem", initial=1, log=lines.append, bar=False) as p:
        assert math.isinf(p.eta_s())
        p.update(2, postfix={"avg@4": 0.25})
    assert len(lines) == 1
    assert lines[0].startswith("[eval] 3/4 problems") and "ETA" in lines[0]
    assert "avg@4 0.25" in lines[0]


def test_report_of_two_runs(tmp_path):
    from PIL import Image

    from magic_jax.jobs.report import PANELS, load_run, make_figures

    _write_run(tmp_path / "a", 0)
    _write_run(tmp_path / "b", 1, stage_steps=(2, 2), target=0.3)
    html = tmp_path / "out" / "report.html"
    html.parent.mkdir()
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(html),
                 "--name", "base", "--name", "clip-higher"]) == 0  # fmt: skip
    page = html.read_text()
    images = page.split('src="data:image/png;base64,')[1:]
    assert len(images) == len(PANELS) and "clip-higher" in page
    for (stem, *_), encoded in zip(PANELS, images):
        png = (tmp_path / "out" / "report_png" / f"{stem}.png").read_bytes()
        assert base64.b64decode(encoded.split('"')[0]) == png  # the page holds the files
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
        assert pixels.shape == (360, 640), stem
        assert pixels.std() > 10, stem  # drawn, not blank
    runs = [load_run(tmp_path / "a", "base"), load_run(tmp_path / "b", "clip-higher")]
    figures = make_figures(runs)
    for stem in ("alpha", "grad_norm", "entropy", "reward", "eval"):
        ax = figures[stem].axes[0]
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels.count("base") == 1 and labels.count("clip-higher") == 1, (stem, labels)
        assert ax.get_xlabel() == "training step" and ax.get_ylabel()
    # target lines of the entropy panel, stage boundaries at steps 3 (a) and 2 (b)
    entropy = figures["entropy"].axes[0]
    flat = {tuple(line.get_ydata()) for line in entropy.get_lines() if len(line.get_ydata()) == 2}
    assert {(0.2, 0.2), (0.3, 0.3)} <= flat
    xs = {line.get_xdata()[0] for line in figures["alpha"].axes[0].get_lines()
          if line.get_linestyle() == ":"}  # fmt: skip
    assert xs == {2, 3}
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "x.html")]) == 2
