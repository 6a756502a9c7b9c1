"""Curves of training runs: one PNG per quantity and a self-contained HTML page.

Runs with the same name are the seeds of one arm: one colour, their mean over the steps
every seed has as a thick line and each seed as a thin one (legend: the name and the
number of seeds). A run's name is its directory's, or for ``<arm>/seed<k>`` the arm's
(``--name`` gives others, and groups runs it names alike). Where a panel shows several
quantities, line styles tell them apart (second legend, only for what was drawn); dotted
vertical lines mark where an arm's stages change; entropy goes on a log axis where it
spans a decade or more. The plotting functions take matplotlib axes and a list of
``Run``, so notebooks can overlay runs their own way::

    from magic_jax.jobs import report
    runs = [report.load_run("runs/a"), report.load_run("runs/b", name="clip-higher")]
    fig, ax = plt.subplots()
    report.plot_metric(ax, runs, "entropy")
    report.mark_stages(ax, runs)
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.typing import LineStyleType

FIGSIZE = (6.4, 3.6)  # inches
DPI = 100  # so each PNG is 640 x 360 pixels


@dataclasses.dataclass
class Run:
    """A run directory's records.

    Attributes:
      name: legend label.
      path: the directory.
      metrics: ``metrics.jsonl`` rows (one per step), by step.
      evals: ``eval.jsonl`` rows, by step.
      config: ``config.yaml`` as a dict (empty if absent).
    """

    name: str
    path: Path
    metrics: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    config: dict[str, Any]

    def series(self, key: str, *, evals: bool = False) -> tuple[list[int], list[float]]:
        """(steps, values) of a numeric field, skipping rows that lack it."""
        rows = self.evals if evals else self.metrics
        pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), int | float)]
        return [p[0] for p in pts], [p[1] for p in pts]

    def stage_starts(self) -> list[tuple[int, int | None]]:
        """(step, stage) where each stage after the first begins (None: a row without)."""
        out: list[tuple[int, int | None]] = []
        last = None
        for r in self.metrics:
            stage = r.get("stage")
            if last is not None and stage != last:
                out.append((r["step"], stage))
            last = stage
        return out


def read_record_text(path: Any) -> str | None:
    """The text of a record file (``metrics.jsonl``, ``eval.jsonl``), or of its gzip-compressed
    copy (``metrics.jsonl.gz``: how committed run records are stored); None if neither exists."""
    if path.exists():
        return path.read_text()
    packed = path.with_name(path.name + ".gz")
    if packed.exists():
        import gzip

        return gzip.decompress(packed.read_bytes()).decode("utf-8")
    return None


def _read_lines(path: Any) -> list[dict[str, Any]]:
    text = read_record_text(path)
    if text is None:
        return []
    rows = []
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:
                break  # a torn last line from a killed run
            raise ValueError(f"{path}:{n + 1}: not a JSON line: {e}") from None
    by_step = {r["step"]: r for r in rows if "step" in r}  # a step written twice: the last
    return [by_step[s] for s in sorted(by_step)]


def load_run(path: str | os.PathLike, name: str | None = None) -> Run:
    """Reads a run directory's ``metrics.jsonl``, ``eval.jsonl`` (or their ``.gz`` copies)
    and ``config.yaml``.

    Raises:
      FileNotFoundError: ``path`` has neither metrics nor evaluations.
    """
    import yaml

    from magic_jax import storage

    storage.check(path, what="run")
    p = storage.path(path)
    metrics, evals = _read_lines(p / "metrics.jsonl"), _read_lines(p / "eval.jsonl")
    if not metrics and not evals:
        raise FileNotFoundError(f"{p}: no metrics.jsonl or eval.jsonl (not a run directory?)")
    cfg_path = p / "config.yaml"
    config = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.exists() else {}
    default = p.parent.name if re.fullmatch(r"seed\d+", p.name) and p.parent.name else p.name
    return Run(name or default, p, metrics, evals, config)


def group(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs by name, in order of first appearance: an arm's seeds."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.name, []).append(run)
    return out


def seed_mean(per: Sequence[Mapping[int, float]]) -> tuple[list[int], list[float]]:
    """The steps every seed has, and the seeds' mean at each: ``(steps, mean)``."""
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    return steps, [sum(p[s] for p in per) / len(per) for s in steps]


def colors(n: int) -> list[Any]:
    """One colour per run (matplotlib's default cycle, then tab20)."""
    import matplotlib.pyplot as plt

    base = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if n <= len(base):
        return base[:n]
    cmap = plt.get_cmap("tab20")
    return [cmap(i % 20) for i in range(n)]


def plot_metric(
    ax: Any,
    runs: Sequence[Run],
    key: str,
    *,
    evals: bool = False,
    style: LineStyleType = "-",
    marker: str | None = None,
    label: bool = True,
) -> int:
    """One line per arm (``group``) of ``key`` against steps: a lone run's values, or the
    seeds' mean (thick) with each seed (thin); returns how many arms had it.

    Args:
      ax: matplotlib axes.
      runs: the runs (colour i for arm i).
      key: a field of the metric (or, with ``evals``, evaluation) rows.
      style / marker: line style and marker.
      label: label lines with arm names and seed counts (for the legend).
    """
    arms = group(runs)
    found = 0
    for (name, seeds), color in zip(arms.items(), colors(len(arms))):
        per = [dict(zip(*r.series(key, evals=evals))) for r in seeds]
        per = [p for p in per if p]
        steps, mean = seed_mean(per)
        if not steps:
            continue
        found += 1
        many = len(per) > 1
        text = f"{name} (n={len(per)})" if many else name
        width = 2.0 if many else 1.4
        line = {"color": color, "marker": marker, "markersize": 4, "linewidth": width}
        ax.plot(steps, mean, style, label=text if label else None, zorder=3, **line)
        for p in per if many else []:
            xs = sorted(p)
            ax.plot(xs, [p[x] for x in xs], style, color=color, linewidth=0.7, alpha=0.35)
    return found


def mark_stages(ax: Any, runs: Sequence[Run]) -> None:
    """Dotted vertical lines where each arm's stages begin (its first run's), labelled."""
    arms = group(runs)
    for seeds, color in zip(arms.values(), colors(len(arms))):
        for step, stage in seeds[0].stage_starts():
            ax.axvline(step, color=color, linestyle=":", linewidth=1.0, alpha=0.8)
            ax.annotate(
                f"stage {stage}",
                (step, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -10),
                textcoords="offset points",
                fontsize=7,
                color=color,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5},
            )


def _styles_legend(ax: Any, entries: Sequence[tuple[LineStyleType, str]]) -> None:
    """Adds grey line-style entries (what each style means) to the run legend."""
    from matplotlib.lines import Line2D

    ax._magic_styles = [Line2D([], [], color="0.4", linestyle=s, label=d) for s, d in entries]


def legend(ax: Any) -> None:
    """One legend: the runs (colours), then what each line style means, where it fits best."""
    handles, labels = ax.get_legend_handles_labels()
    styles = getattr(ax, "_magic_styles", [])
    ax.legend(
        handles=[*handles, *styles],
        labels=[*labels, *(h.get_label() for h in styles)],
        loc="best",
        fontsize=7,
        framealpha=0.85,
    )


def legend_below(fig: Any, ax: Any, *, fontsize: float = 8, outside: bool = False) -> int:
    """One legend for the whole figure under its panels, off every curve: ``ax``'s labelled
    lines, up to 4 a row, no frame. ``outside``: the figure has the constrained layout, which
    makes room for it; else the caller leaves the returned number of rows free at the bottom
    (``tight_layout(rect=...)``). Returns the legend's rows (0: nothing labelled, no legend)."""
    handles, names = ax.get_legend_handles_labels()
    if not names:
        return 0
    ncol = max(1, min(len(names), 4))
    loc = "outside lower center" if outside else "lower center"
    fig.legend(handles, names, loc=loc, ncol=ncol, fontsize=fontsize, frameon=False)
    return -(-len(names) // ncol)


def _multi(
    keys: Sequence[tuple[str, LineStyleType, str]],
) -> Callable[[Any, Sequence[Run]], int]:
    """A panel of several fields: (key, style, description) each."""

    def plot(ax: Any, runs: Sequence[Run]) -> int:
        found = 0
        drawn: list[tuple[LineStyleType, str]] = []
        for key, style, what in keys:
            n = plot_metric(ax, runs, key, style=style, label=not drawn)
            if n:
                found, drawn = max(found, n), [*drawn, (style, what)]
        if found:
            _styles_legend(ax, drawn)
        return found

    return plot


def plot_entropy(ax: Any, runs: Sequence[Run]) -> int:
    """Token entropy e_k, with each adaptive arm's target tgt_ent as a dashed line; a log
    axis where the values span a decade or more."""
    found = plot_metric(ax, runs, "entropy")
    arms, targets = group(runs), 0
    for seeds, color in zip(arms.values(), colors(len(arms))):
        ent = seeds[0].config.get("entropy") or {}
        if found and ent.get("mode", "adaptive") == "adaptive" and "target" in ent:
            ax.axhline(float(ent["target"]), color=color, linestyle="--", linewidth=1.0)
            targets += 1
    if targets:
        _styles_legend(ax, [("-", "entropy"), ("--", "target")])
    values = [v for r in runs for v in r.series("entropy")[1] if v > 0]
    if values and max(values) >= 10 * min(values):
        ax.set_yscale("log")
    return found


def plot_eval(ax: Any, runs: Sequence[Run]) -> int:
    """Evaluation avg@n (markers at each evaluation)."""
    return plot_metric(ax, runs, "accuracy", evals=True, marker="o")


# (file stem, title, y label, plotter)
PANELS: list[tuple[str, str, str, Callable[[Any, Sequence[Run]], int]]] = [
    ("entropy", "Token entropy and target", "entropy (nats)", plot_entropy),
    ("alpha", "Entropy coefficient alpha_k", "alpha", lambda ax, r: plot_metric(ax, r, "alpha")),
    (
        "reward",
        "Reward and accuracy of untruncated responses",
        "mean reward",
        _multi([("reward", "-", "all responses"), ("accuracy_not_truncated", "--", "untruncated")]),
    ),
    ("eval", "Evaluation avg@n", "avg@n", plot_eval),
    (
        "length",
        "Response length",
        "tokens",
        _multi(
            [
                ("response_length_mean", "-", "mean"),
                ("response_length_max", "--", "max"),
                ("max_response_length", ":", "limit T"),
            ]
        ),
    ),
    (
        "truncated",
        "Truncated responses",
        "fraction",
        lambda ax, r: plot_metric(ax, r, "truncated_fraction"),
    ),
    (
        "kept_groups",
        "Groups kept by rejection sampling",
        "fraction",
        lambda ax, r: plot_metric(ax, r, "kept_group_fraction"),
    ),
    (
        "clip",
        "Policy clip fractions",
        "fraction of tokens",
        _multi(
            [
                ("clipfrac_low", "-", "clipped at 1 - eps_low"),
                ("clipfrac_high", "--", "at 1 + eps_high"),
            ]
        ),
    ),
    ("grad_norm", "Gradient norm", "norm", lambda ax, r: plot_metric(ax, r, "grad_norm")),
    (
        "sampler_mismatch",
        "Sampler / trainer mismatch (rollout.dtype)",
        "nats",
        _multi(
            [
                ("sampler_abs_log_ratio_mean", "-", "mean |log ratio|"),
                ("sampler_abs_log_ratio_max", "--", "max |log ratio|"),
                ("sampler_kl", ":", "KL(sampler || trainer), k3"),
            ]
        ),
    ),
    (
        "time",
        "Time per step: rollout t_R, update t_T, other t_O",
        "seconds",
        _multi(
            [
                ("t_rollout_s", "-", "t_R rollout"),
                ("t_update_s", "--", "t_T update"),
                ("t_other_s", ":", "t_O other"),
            ]
        ),
    ),
]


def make_figures(runs: Sequence[Run]) -> dict[str, Any]:
    """One matplotlib figure per panel of ``PANELS``: ``{stem: figure}`` (Agg backend)."""
    from matplotlib.figure import Figure

    figures = {}
    for stem, title, ylabel, plot in PANELS:
        fig = Figure(figsize=FIGSIZE, dpi=DPI)
        ax = fig.add_subplot()
        found = plot(ax, runs)
        if found:
            mark_stages(ax, runs)
            legend(ax)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        figures[stem] = fig
    return figures


def _spread(values: Sequence[float]) -> str:
    """``mean`` of one value, ``mean +- sample std`` of several, "" of none."""
    if not values:
        return ""
    m = sum(values) / len(values)
    if len(values) == 1:
        return f"{m:.3f}"
    return f"{m:.3f} +- {math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)):.3f}"


def _summary_rows(runs: Sequence[Run]) -> list[list[str]]:
    """One row per arm: seeds, steps, last reward, entropy and evaluation (seed mean +- std)."""
    rows = []
    for name, seeds in group(runs).items():
        last = [r.metrics[-1] for r in seeds if r.metrics]
        evs = [r.evals[-1] for r in seeds if r.evals and "accuracy" in r.evals[-1]]
        n = evs[0].get("num_samples", "n") if evs else "n"
        at = sorted({e["step"] for e in evs})
        rows.append(
            [
                name,
                str(len(seeds)),
                "/".join(sorted({str(len(r.metrics)) for r in seeds})),
                _spread([float(m["reward"]) for m in last if "reward" in m]),
                _spread([float(m["entropy"]) for m in last if "entropy" in m]),
                f"avg@{n} {_spread([float(e['accuracy']) for e in evs])} (step "
                f"{'/'.join(map(str, at))})"
                if evs
                else "",
            ]
        )
    return rows


def write_report(
    run_dirs: Sequence[str | os.PathLike],
    output: str | os.PathLike = "report.html",
    *,
    names: Sequence[str] | None = None,
) -> Path:
    """Writes one PNG per panel beside ``output`` and the HTML page with them embedded.

    Args:
      run_dirs: run directories.
      output: the HTML file; the PNGs go to ``<output stem>_png/``.
      names: legend names, one per run (default: the directory names).

    Returns:
      The HTML path.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    if names and len(names) != len(run_dirs):
        raise ValueError(f"--name given {len(names)} times for {len(run_dirs)} runs")
    from magic_jax import storage

    runs = [load_run(d, names[i] if names else None) for i, d in enumerate(run_dirs)]
    storage.check(output, what="output")
    out = storage.path(output)
    # the figures are drawn into a local directory; on gs:// it is uploaded beside the page
    with storage.staged(out.with_name(out.stem + "_png")) as png_dir:
        png_dir.mkdir(parents=True, exist_ok=True)
        images = {}
        for stem, fig in make_figures(runs).items():
            path = png_dir / f"{stem}.png"
            fig.savefig(path, dpi=DPI)
            images[stem] = path.read_bytes()
    storage.write_text(out, _html(runs, images))
    return out


def _html(runs: Sequence[Run], images: Mapping[str, bytes]) -> str:
    head = ["run", "seeds", "steps", "last reward", "last entropy", "last evaluation"]
    table = "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
    for row in _summary_rows(runs):
        table += "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
    figs = "".join(
        f'<figure><img alt="{stem}" src="data:image/png;base64,'
        f'{base64.b64encode(data).decode()}"></figure>'
        for stem, data in images.items()
    )
    paths = "".join(f"<li>{html.escape(r.name)}: {html.escape(str(r.path))}</li>" for r in runs)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>magic-jax report</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 0.5em; }}
figure {{ margin: 0; }}
</style></head><body>
<h1>Training report</h1>
<ul>{paths}</ul>
<table>{table}</table>
<div class="grid">{figs}</div>
</body></html>
"""
