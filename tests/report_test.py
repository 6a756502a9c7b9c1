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


def test_report_groups_seeds_and_draws_only_what_it_names(tmp_path):
    """Runs in ``<arm>/seed<k>`` are one arm: one legend entry with the seed count, the mean
    thick over each seed thin; the summary gives mean +- std; entropy spanning decades goes
    on a log axis; a reference line or style not drawn gets no legend entry."""
    from magic_jax.jobs.report import _summary_rows, load_run, make_figures

    for k in range(3):
        (tmp_path / "clip").mkdir(exist_ok=True)
        _write_run(tmp_path / "clip" / f"seed{k}", k)
    _write_run(tmp_path / "fixed", 9, stage_steps=(5, 6))
    cfg = tmp_path / "fixed" / "config.yaml"
    cfg.write_text(yaml.safe_dump({"entropy": {"mode": "fixed", "coef": 0.0}}))
    rows = [json.loads(x) for x in (tmp_path / "fixed" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("accuracy_not_truncated")
    (tmp_path / "fixed" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [load_run(tmp_path / "clip" / f"seed{k}") for k in range(3)]
    runs.append(load_run(tmp_path / "fixed"))
    assert [r.name for r in runs] == ["clip", "clip", "clip", "fixed"]
    figs = make_figures(runs)
    ax = figs["reward"].axes[0]
    _handles, labels = ax.get_legend_handles_labels()
    assert labels == ["clip (n=3)", "fixed"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["clip (n=3)", "fixed", "all responses", "untruncated"]
    solid = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]
    assert len(solid) == 1 + 3 + 1  # clip's mean and 3 seeds, fixed's one line
    mean = next(ln for ln in solid if ln.get_label() == "clip (n=3)")
    seeds = [r.series("reward") for r in runs[:3]]
    assert np.allclose(mean.get_ydata(), np.mean([s[1] for s in seeds], axis=0))
    ent = figs["entropy"].axes[0]
    assert ent.get_yscale() == "log"  # 1 down to 1/11: more than a decade
    assert {t.get_text() for t in ent.get_legend().get_texts()} >= {"target"}
    only_fixed = make_figures(runs[3:])["entropy"].axes[0]
    assert "target" not in [t.get_text() for t in only_fixed.get_legend().get_texts()]
    assert make_figures(runs[:1])["entropy"].axes[0].get_yscale() == "linear"  # 1 to 0.2
    (clip, fixed) = _summary_rows(runs)
    last = [r.metrics[-1]["reward"] for r in runs[:3]]
    assert clip[:3] == ["clip", "3", "5"] and clip[3] == (
        f"{np.mean(last):.3f} +- {np.std(last, ddof=1):.3f}"
    )
    assert fixed[:3] == ["fixed", "1", "11"] and "+-" not in fixed[3]
