"""The claims' tables: one row per claim (``notebooks/README.md`` holds it verbatim), every
prediction with its raw and Holm-adjusted p-values (``figures/effects.md``), the measures
chosen after the runs under both measures, where each run's code came from
(``figures/runs.md``), and the noise of one arm against itself (``figures/self_noise.md``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from magic_jax.experiments import prereg
from magic_jax.experiments.corrected import (
    Row,
    detectable_effect,
    headline,
    judge_all,
    label,
    primary_verdict,
)
from magic_jax.experiments.pairing import twin_table
from magic_jax.experiments.results import results_dir
from magic_jax.experiments.verdicts import mean_of


def fmt_p(p: float) -> str:
    """A p-value for a table ("-" for none)."""
    if math.isnan(p):
        return "-"
    return f"{p:.2g}" if p >= 1e-3 else "< 0.001"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (a ``|`` inside a cell escaped)."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    lines = [line(header), "|" + "---|" * len(header)]
    lines += [line(r) for r in rows]
    return "\n".join(lines)


def _short(sha: str | None) -> str:
    return sha[:7] if sha else "-"


def registration(pre: prereg.Prereg) -> str:
    """ "retrospective" or the pre-registration commit (``not committed`` before it is)."""
    if pre.status == "retrospective":
        return "retrospective"
    sha = prereg.added_in(pre.path)
    return f"prospective, {_short(sha)}" if sha else "prospective, not committed"


def _pair(r: Row) -> str:
    a, b = r.prediction.arms
    return f"{a} vs {b or '0'}"


def _ps(r: Row) -> str:
    return f"{fmt_p(r.p)} / {fmt_p(r.p_claim)} / {fmt_p(r.p_table)}"


def summary_rows(
    pres: Mapping[str, prereg.Prereg],
    rows: Mapping[str, Sequence[Row]],
    first: Mapping[str, Sequence[Row]],
) -> list[list[str]]:
    """Per claim: name, pre-registration, seeds, primary endpoint with its p-values, verdict,
    verdict by measure, and the measures chosen after the runs with both results."""
    out = []
    for name, pre in pres.items():
        rs = rows.get(name, [])
        prim = next((r for r in rs if r.primary), None)
        endpoint = "no runs yet"
        if prim is not None:
            endpoint = (
                f"{prim.measure}, {_pair(prim)} ({prim.prediction.direction}): "
                f"diff {prim.effect.diff:+.3f}, p {_ps(prim)}"
            )
        changes = []
        for c in pre.measure_changes:
            if c.measure == c.first_declared:  # the same measure, its code changed
                changes.append(f"{c.measure}: its code changed in {c.commit} ({c.note})")
                continue
            now = [r for r in rs if r.measure == c.measure]
            then = [r for r in first.get(name, []) if r.measure == c.first_declared]
            changes += [
                f"{c.first_declared} -> {c.measure} ({c.commit}), {_pair(n)}: first declared "
                f"diff {t.effect.diff:+.3f}, p {_ps(t)} ({t.verdict}); now diff "
                f"{n.effect.diff:+.3f}, p {_ps(n)} ({n.verdict})"
                for n, t in zip(now, then)
            ]
        out.append(
            [
                name,
                registration(pre),
                f"{len(prim.effect.arm)}/{len(prim.effect.reference)}" if prim else "0",
                endpoint,
                _detectable(prim),
                primary_verdict(rs),
                label(rs) or "-",
                "<br>".join(changes) or "none recorded",
            ]
        )
    return out


def _detectable(prim: Row | None) -> str:
    """The primary endpoint's smallest detectable |difference| (``detectable_effect``)."""
    if prim is None or prim.prediction.direction == "same":
        return "-"
    d = detectable_effect(prim.effect)
    return "-" if math.isnan(d) else f"{d:.3f}"


SUMMARY_HEADER = (
    "claim",
    "pre-registered",
    "seeds",
    "primary endpoint (p: raw / Holm in claim / Holm in table)",
    "detectable at 80% power",
    "verdict (primary, Holm in claim)",
    "verdict by measure (Holm in claim)",
    "measures chosen after the runs",
)


def tables(results: str | Path | None = None, where: str | Path | None = None) -> dict[str, str]:
    """``{"summary": ..., "effects": ..., "runs": ...}``: the Markdown tables of every
    pre-registered claim (``where``: the pre-registration directory)."""
    # a claim whose runs have begun and not all finished joins every table when they have
    # (its notebook shows the partial runs as such)
    pres = {k: v for k, v in prereg.load_all(where).items() if not in_progress(v, results)}
    rows = judge_all(pres, results)
    first = judge_all(pres, results, first_declared=True)
    # a claim without runs has no row (its file's commit is all there is to show)
    ran = {k: v for k, v in pres.items() if rows.get(k)}
    summary = format_table(SUMMARY_HEADER, summary_rows(ran, rows, first))
    return {
        "summary": summary,
        "effects": effects_table(rows, first, pres),
        "runs": runs_table(pres, results),
    }


def in_progress(pre: prereg.Prereg, results: str | Path | None = None) -> bool:
    """Whether some of the claim's (arm, seed) runs are finished and others are not."""
    where = results_dir(results)
    done = [
        (where / "runs" / a / f"seed{s}" / "run.json").exists() for a in pre.arms for s in pre.seeds
    ]
    return any(done) and not all(done)


def summary_table(results: str | Path | None = None, where: str | Path | None = None) -> str:
    """The one-row-per-claim table (``notebooks/README.md`` holds it verbatim)."""
    return tables(results, where)["summary"]


def _effect_row(r: Row) -> list[str]:
    e = r.effect
    ci = "-" if math.isnan(e.low) else f"[{e.low:+.3f}, {e.high:+.3f}]"
    return [
        r.claim,
        r.measure + (" (primary)" if r.primary else ""),
        _pair(r),
        r.prediction.direction,
        f"{mean_of(e.arm):.3f} / {mean_of(e.reference):.3f}",
        f"{e.diff:+.3f} {ci}",
        f"{len(e.arm)}/{len(e.reference)}",
        r.test,
        fmt_p(r.p_welch),
        fmt_p(r.p_rank),
        fmt_p(r.p_claim),
        fmt_p(r.p_table),
        r.verdict,
        r.verdict_table,
    ]


EFFECT_HEADER = (
    "claim",
    "measure",
    "arms (a vs b)",
    "predicted a - b",
    "means a / b",
    "diff [95% CI]",
    "seeds",
    "declared test",
    "Welch p",
    "Mann-Whitney p (exact)",
    "Holm in claim",
    "Holm in table",
    "verdict (Holm in claim)",
    "verdict (Holm in table)",
)


def effects_table(
    rows: Mapping[str, Sequence[Row]],
    first: Mapping[str, Sequence[Row]],
    pres: Mapping[str, prereg.Prereg],
) -> str:
    """The headline counts (all claims, retrospective, pre-registered; each prediction at
    its declared test), every prediction as now measured, then the changed ones as first
    declared (their Holm families recomputed with the first-declared measures)."""
    now = [_effect_row(r) for rs in rows.values() for r in rs]
    changed = {(r.claim, r.measure) for rs in first.values() for r in rs} - {
        (r.claim, r.measure) for rs in rows.values() for r in rs
    }
    then = [_effect_row(r) for rs in first.values() for r in rs if (r.claim, r.measure) in changed]
    counts = []
    for status in (None, "retrospective", "prospective"):
        claims = [c for c in rows if status is None or pres[c].status == status]
        total, raw, n, m = headline(rows, claims)
        counts.append(
            f"{status or 'all'}: {total} predictions; reproduced at the declared test's raw "
            f"p < 0.05: {raw}; after Holm within each claim: {n}; across the table: {m}."
        )
    return "\n".join(
        [
            *counts,
            "",
            format_table(EFFECT_HEADER, now),
            "",
            "Under the measures first declared (each family recomputed with them):",
            "",
            format_table(EFFECT_HEADER, then),
        ]
    )


def runs_table(pres: Mapping[str, prereg.Prereg], results: str | Path | None = None) -> str:
    """Every run of every claim: when it finished, the commit it ran at (recorded, or the
    newest commit before it started), and the commit that added its ``run.json``."""
    where = results_dir(results)
    seen, rows = set(), []
    for pre in pres.values():
        for arm in pre.arms:
            for seed in pre.seeds:
                d = where / "runs" / arm / f"seed{seed}"
                if (arm, seed) in seen or not (d / "run.json").exists():
                    continue
                seen.add((arm, seed))
                o = prereg.run_origin(d)
                fin = json.loads((d / "run.json").read_text()).get("finished", "-")
                rows.append(
                    [
                        arm,
                        str(seed),
                        fin,
                        _short(o.commit) + ("" if o.recorded else " (derived)"),
                        "-" if o.dirty is None else str(o.dirty).lower(),
                        _short(o.committed_in),
                    ]
                )
    header = ["arm", "seed", "finished", "ran at", "uncommitted changes", "run.json added in"]
    return format_table(header, rows)


def write_tables(results: str | Path | None, out: str | Path) -> dict[str, Path]:
    """``summary.md``, ``effects.md``, ``runs.md`` and ``self_noise.md`` under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t = tables(results)
    t["self_noise"] = twin_table(results)
    paths = {}
    for key, text in t.items():
        paths[key] = out / f"{key}.md"
        paths[key].write_text(text + "\n")
    return paths
