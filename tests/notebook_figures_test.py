"""What a notebook does for its reader: figures saved and shown, the checkout's results found
from anywhere, no training without being asked, and progress while it trains."""

import ast
import json
import os
import select
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from magic_jax.experiments import ablations, figures, progress, results

ROOT = Path(__file__).resolve().parents[1]
CENTRAL = ROOT / "notebooks" / "00_central.py"


def _env(**extra):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=path, **extra)
    for k in (ablations.STEPS_ENV, ablations.RESULTS_ENV, progress.YES_ENV):
        if k not in extra:
            env.pop(k, None)
    return env


def test_a_notebook_run_as_a_script_writes_its_figure_and_trains_nothing():
    # about 7 s on 2 cores: the notebook reads every committed run of its claim
    png = ROOT / "notebooks" / "figures" / "central.png"
    before = png.read_bytes()
    proc = subprocess.run(
        [sys.executable, "notebooks/00_central.py"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"figure: {png}" in proc.stdout and "training in" not in proc.stdout
    # the committed figure, redrawn byte for byte
    assert png.read_bytes() == before


@pytest.mark.heavy  # about 7 s on 2 busy cores, like the one above: one in the default suite
def test_a_notebook_run_from_elsewhere_reads_the_checkouts_results(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(CENTRAL)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"results: {ROOT / 'notebooks' / 'results'}" in proc.stdout
    assert "training in" not in proc.stdout and not list(tmp_path.iterdir())


def test_a_notebook_with_runs_missing_stops_with_one_line_and_trains_nothing(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(CENTRAL)],
        cwd=tmp_path,
        env=_env(**{ablations.RESULTS_ENV: str(tmp_path / "results")}),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "25 runs to train" in proc.stderr and f"{progress.YES_ENV}=1" in proc.stderr
    assert "--yes" in proc.stderr and not (tmp_path / "results" / "raw").exists()


def test_results_are_the_packages_checkouts_or_one_line_naming_where(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ablations.RESULTS_ENV, raising=False)
    monkeypatch.delenv(ablations.STEPS_ENV, raising=False)
    assert ablations.results_dir() == ROOT / "notebooks" / "results"
    monkeypatch.setattr(results, "CHECKOUT", tmp_path / "site-packages")
    with pytest.raises(SystemExit, match="no results folder at .*site-packages/notebooks/results"):
        ablations.results_dir()
    monkeypatch.setenv(ablations.RESULTS_ENV, str(tmp_path))
    assert ablations.results_dir() == tmp_path.resolve()


def test_more_than_a_few_runs_start_only_when_told(monkeypatch, tmp_path):
    monkeypatch.delenv(progress.YES_ENV, raising=False)
    monkeypatch.delenv(ablations.STEPS_ENV, raising=False)
    monkeypatch.setattr(sys, "stdin", None)
    progress.confirm(progress.FEW, 1.0, tmp_path)  # a few: no question
    with pytest.raises(SystemExit, match=r"5 runs to train in .*, about 9 min.*--yes"):
        progress.confirm(5, 9.0, tmp_path)
    progress.confirm(5, 9.0, tmp_path, yes=True)
    tty = types.SimpleNamespace(isatty=lambda: True)
    monkeypatch.setattr(sys, "stdin", tty)
    monkeypatch.setattr("builtins.input", lambda _: "y")
    progress.confirm(5, 9.0, tmp_path)
    monkeypatch.setattr("builtins.input", lambda _: "")
    with pytest.raises(SystemExit, match="nothing trained"):
        progress.confirm(5, 9.0, tmp_path)
    monkeypatch.setattr(sys, "stdin", None)
    monkeypatch.setenv(progress.YES_ENV, "1")
    progress.confirm(5, 9.0, tmp_path)
    monkeypatch.delenv(progress.YES_ENV)
    # the runner and its command line: the whole central claim is 25 runs, about 88 min
    logs = []
    with pytest.raises(SystemExit, match="25 runs to train"):
        ablations.ensure(["central"], results=tmp_path, log=logs.append)
    assert logs == [f"[ablations] 25 run(s) to do in {tmp_path}, about 88 min"]
    with pytest.raises(SystemExit, match="25 runs"):
        ablations.main(["run", "--ablation", "central", "--results", str(tmp_path)])
    assert not (tmp_path / "raw").exists()


def _fake_raw(raw: Path, steps: int) -> None:
    raw.mkdir(parents=True)
    (raw / "config.yaml").write_text("stages:\n- steps: 5\n- steps: 5\n")
    rows = [{"step": s, "entropy": 0.5 - 0.01 * s} for s in range(steps)]
    (raw / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"st')
    (raw / "eval.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.25}) + "\n")


def test_a_runs_progress_line(tmp_path):
    assert progress.progress_line(tmp_path, 1.0) is None
    _fake_raw(tmp_path / "r", 4)
    line = progress.progress_line(tmp_path / "r", 60.0)
    # 4 of 10 steps in a minute: 1.5 min left; the half-written last line is skipped
    assert line == "step 4/10, entropy 0.470, accuracy 0.250 (step 0), about 1.5 min left"
    _fake_raw(tmp_path / "end", 10)
    line = progress.progress_line(tmp_path / "end", 60.0)
    done = "steps done, finishing (the last evaluation and checkpoint)"
    assert line == f"step 10/10, entropy 0.410, accuracy 0.250 (step 0), {done}"


def test_watch_logs_progress_while_the_run_trains(tmp_path):
    raw = tmp_path / "raw"
    _fake_raw(raw, 2)
    logs = []
    cmd = [sys.executable, "-c", "import time; print('hello'); time.sleep(0.5)"]
    rc = progress.watch(cmd, raw, tmp_path / "seed0.log", "x/arm seed 0", logs.append, 0.1)
    assert rc == 0 and "hello" in (tmp_path / "seed0.log").read_text()
    assert logs and logs[0].startswith("[ablations] x/arm seed 0: step 2/10, entropy 0.490")


def test_at_a_terminal_a_run_is_one_line_rewritten_in_place(tmp_path, capsys):
    raw = tmp_path / "raw"
    _fake_raw(raw, 2)
    logs = []
    cmd = [sys.executable, "-c", "import time; time.sleep(0.5)"]
    log = tmp_path / "seed0.log"
    assert progress.watch(cmd, raw, log, "x/arm seed 0", logs.append, 0.1, live=True) == 0
    out = capsys.readouterr().out
    assert not logs and "\n" not in out  # no new line: the same one, rewritten, then erased
    rewrites = out.split(progress.CLEAR)
    assert rewrites[0] == "" and rewrites[-1] == "" and len(rewrites) >= 3
    assert rewrites[1].startswith("[ablations] x/arm seed 0: step 2/10, entropy 0.490")
    # where nothing was shown (a run ending within the period) nothing is erased
    assert progress.watch([*cmd[:2], "pass"], raw, log, "x", logs.append, 5.0, live=True) == 0
    assert capsys.readouterr().out == "" and not logs


def _figure(data: bool):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2), dpi=40)
    ax = fig.subplots()
    if data:
        ax.plot([0, 1], [1, 0])
    return fig


def test_show_saves_prints_and_displays_in_a_kernel(tmp_path, monkeypatch, capsys):
    figures.show(_figure(False), "empty", tmp_path)
    assert not (tmp_path / "figures").exists()
    figures.show(_figure(True), "x", tmp_path)
    png = tmp_path / "figures" / "x.png"
    assert png.read_bytes().startswith(b"\x89PNG")
    assert f"figure: {png}" in capsys.readouterr().out
    # the committed results' figures go beside the notebooks, as ``ablations figures`` puts them
    assert figures.figures_dir(ROOT / "notebooks" / "results") == ROOT / "notebooks" / "figures"
    # in a Jupyter kernel the image itself is displayed (a bare Figure would only print its repr)
    shown = _fake_kernel(monkeypatch)
    figures.show(_figure(True), "x", tmp_path)
    assert shown == [("image", "png", png.read_bytes())]


def _fake_kernel(monkeypatch) -> list:
    """IPython as a Jupyter kernel has it (a shell with a kernel, ``display``), without
    Jupyter; returns the list every displayed object is appended to."""
    shown: list = []
    shell = types.SimpleNamespace(kernel=object())
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: shell
    ipython.version_info = (9, 0, 0)  # matplotlib reads it when it makes a canvas
    display = types.ModuleType("IPython.display")
    display.Image = lambda data, format: ("image", format, data)
    display.display = shown.append
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    return shown


def test_a_script_opens_each_figure_in_a_window_where_one_can_open(tmp_path, monkeypatch):
    import atexit

    import matplotlib
    import matplotlib.pyplot as plt

    plt.switch_backend("agg")  # no real window, even where the tests run with a display
    monkeypatch.setattr(matplotlib, "get_backend", lambda **_: "agg")  # no display
    assert not figures.windows()  # a file, no window
    calls = []
    monkeypatch.setattr(matplotlib, "get_backend", lambda **_: "TkAgg")  # as with a display
    monkeypatch.setattr(plt, "show", lambda **kw: calls.append(("show", kw)))
    monkeypatch.setattr(plt, "pause", lambda s: calls.append(("pause", s)))
    monkeypatch.setattr(atexit, "register", lambda fn: calls.append(("at exit", fn)))
    assert figures.windows()
    try:
        first, again = _figure(True), _figure(True)
        figures.show(first, "x", tmp_path)
        # pyplot manages the very figure drawn (its window), and the script's end waits on it
        assert plt.get_figlabels() == ["x"] and plt.figure("x") is first
        assert calls == [("show", {"block": False}), ("pause", 0.001), ("at exit", plt.show)]
        figures.show(again, "x", tmp_path)  # drawn again: the new figure replaces the window
        assert plt.get_figlabels() == ["x"] and plt.figure("x") is again
        assert [c[0] for c in calls].count("at exit") == 1
        figures.show(_figure(False), "empty", tmp_path)  # nothing drawn: no window
        assert plt.get_figlabels() == ["x"]
    finally:
        plt.close("all")


SHOW_IN_A_WINDOW = """
import sys
import matplotlib
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from magic_jax.experiments import figures
fig = Figure()
fig.subplots().plot([0, 1])
figures.show(fig, "central", sys.argv[1])
print(matplotlib.get_backend(), fig.canvas.manager.get_window_title(), type(fig.canvas).__name__)
plt.close("all")  # the script's end then has no window to wait for
"""


def test_under_a_real_display_a_script_opens_a_window(tmp_path):
    """On an X display (Xvfb, where installed) with matplotlib choosing its own backend."""
    xvfb = shutil.which("Xvfb")
    if xvfb is None:
        pytest.skip("no Xvfb here (apt-get install xvfb)")
    pytest.importorskip("tkinter")
    read, write = os.pipe()
    server = subprocess.Popen(
        [xvfb, "-displayfd", str(write), "-screen", "0", "640x480x24", "-nolisten", "tcp"],
        pass_fds=(write,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write)
    try:
        # the display number, written once the server accepts clients (a server that
        # cannot start closes the pipe; one that hangs is given 30 s)
        ready, _, _ = select.select([read], [], [], 30)
        assert ready, "Xvfb gave no display number in 30 s"
        with os.fdopen(read) as f:
            number = f.readline().strip()
        assert number.isdigit(), f"Xvfb did not start (it wrote {number!r})"
        display = f":{number}"
        env = _env(DISPLAY=display)
        env.pop("MPLBACKEND")
        proc = subprocess.run(
            [sys.executable, "-c", SHOW_IN_A_WINDOW, str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.terminate()
        server.wait()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "tkagg central FigureCanvasTkAgg"
    assert (tmp_path / "figures" / "central.png").exists()


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


def _code_cells(path: Path) -> list[str]:
    """The code cells of a jupytext percent notebook, in order."""
    cells, current = [], None
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("# %%"):
            if current is not None:
                cells.append("".join(current))
            current = None if "[markdown]" in line else []
        elif current is not None:
            current.append(line)
    if current is not None:
        cells.append("".join(current))
    return cells


def _top_level_calls(tree: ast.Module, test) -> int:
    """Calls in a cell outside its function definitions whose callee's name passes ``test``."""
    count, todo = 0, list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            f = node.func
            count += test(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
        todo.extend(ast.iter_child_nodes(node))
    return count


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_cell_shows_its_figure_and_ends_in_no_bare_figure(path):
    """Read, not run: each figure a cell draws (a ``*_figure(...)`` call) goes to
    ``figures.show``, and no cell ends in a bare name, which Jupyter would display as its
    value (a figure only as ``<Figure size ...>``, or twice beside the shown image)."""
    cells = _code_cells(path)
    assert cells, path
    drawn = 0
    for source in cells:
        tree = ast.parse(source)
        last = tree.body[-1] if tree.body else None
        assert not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Name)), source
        draws = _top_level_calls(tree, lambda name: name.endswith("_figure"))
        shows = _top_level_calls(tree, lambda name: name == "show")
        assert draws == shows, f"{path.name}: {draws} figures drawn, {shows} shown in\n{source}"
        drawn += draws
    assert drawn, f"{path.name} draws no figure"


@pytest.mark.heavy  # 8-12 s each on 2 cores: the notebook reads every committed run of its claim
@pytest.mark.parametrize("name", ["08_central_lockout", "11_staleness"])
def test_a_kernel_running_the_notebook_shows_every_figure_it_draws(name, monkeypatch, capsys):
    """The notebook's cells run one by one as a Jupyter kernel runs them (its last expression
    displayed); every figure a cell draws with data is displayed as a PNG image in that cell."""
    from matplotlib.figure import Figure

    for k in (ablations.STEPS_ENV, ablations.RESULTS_ENV, progress.YES_ENV):
        monkeypatch.delenv(k, raising=False)
    shown = _fake_kernel(monkeypatch)
    made: list = []
    init = Figure.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Figure, "__init__", counted)
    scope: dict = {"__name__": "__main__"}
    images = 0
    for i, source in enumerate(_code_cells(ROOT / "notebooks" / f"{name}.py")):
        made.clear()
        shown.clear()
        tree = ast.parse(source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, f"{name} cell {i}", "exec"), scope)
        if last is not None:  # what Jupyter displays after the cell: it must be no figure
            value = eval(compile(ast.Expression(last.value), f"{name} cell {i}", "eval"), scope)
            assert not isinstance(value, Figure), f"cell {i} ends in a bare figure"
        with_data = [f for f in made if any(ax.has_data() for ax in f.axes)]
        assert [s[:2] for s in shown] == [("image", "png")] * len(with_data), (i, source)
        images += len(with_data)
    assert "training in" not in capsys.readouterr().out
    assert images == {"08_central_lockout": 5, "11_staleness": 4}[name]


def test_a_new_arm_from_a_committed_one(tmp_path, monkeypatch, capsys):
    from magic_jax.experiments import derived

    monkeypatch.delenv(ablations.STEPS_ENV, raising=False)
    made = []

    def run_one(ab, arm, seed, where, *, budget, world, log):
        made.append((ab, arm, seed, world))
        dest = ablations.summary_dir(where, arm, seed)
        dest.mkdir(parents=True)
        (dest / "run.json").write_text(json.dumps({"rerun": "wrong"}))
        return dest

    monkeypatch.setattr(ablations, "run_one", run_one)
    argv = ["run", "--from", "carry-clip-0.1", "--name", "clip-0.4", "--set"]
    argv += ["loss.eps_high=0.4", "--seeds", "0-1", "3", "--results", str(tmp_path)]
    assert ablations.main(argv) == 0
    (ab, arm, _, world), seeds = made[0], [m[2] for m in made]
    assert (ab, world, seeds) == ("clip_higher", "carry", [0, 1, 3])
    base = derived.find_arm("carry-clip-0.1")[1]
    assert arm.overrides == (*base.overrides, "loss.eps_high=0.4") and arm.stages == base.stages
    rec = json.loads((tmp_path / "derived/runs/clip-0.4/seed3/run.json").read_text())
    assert rec["rerun"] == derived.command("carry-clip-0.1", "clip-0.4", ["loss.eps_high=0.4"], 3)
    assert rec["derived_from"] == "carry-clip-0.1"
    # the runs' config as the runner would train it: the changed option applied last
    cmd = ablations.train_command(arm, 0, tmp_path, world="carry")
    assert cmd[-4:] == ["--set", "seed=0", "--set", f"output_dir={tmp_path}"]
    assert "loss.eps_high=0.4" in cmd and cmd.index("loss.eps_high=0.4") > cmd.index(
        "loss.eps_high=0.1"
    )
    # done seeds are skipped; a name keeps its definition; a bad option stops before any run
    assert ablations.main(argv) == 0 and len(made) == 3
    other = [*argv[:6], "loss.eps_high=0.5", *argv[7:]]
    assert ablations.main(other) == 2
    assert "already holds runs of" in capsys.readouterr().err
    bad = [*argv[:4], "x", "--set", "loss.eps_hi=1", "--results", str(tmp_path)]
    assert ablations.main(bad) == 2 and "loss.eps_hi: unknown option" in capsys.readouterr().err
    assert ablations.main([*argv[:4], "carry-none", *argv[5:]]) == 2
    assert "already a committed arm" in capsys.readouterr().err and len(made) == 3


def test_budget_mode_hints_name_the_budget_folder(monkeypatch):
    arm = ablations.ABLATIONS["kl"].arms[0]
    monkeypatch.delenv(ablations.RESULTS_ENV, raising=False)
    monkeypatch.delenv(ablations.STEPS_ENV, raising=False)
    assert results.runs_folder_name() == "notebooks/results/runs"
    assert ablations.rerun_command("kl", arm, 0).startswith("python -m ")
    monkeypatch.setenv(ablations.STEPS_ENV, "1")
    assert results.runs_folder_name() == "notebooks/results/budget-1/runs"
    cmd = ablations.rerun_command("kl", arm, 0)
    assert cmd.startswith(f"{ablations.STEPS_ENV}=1 python -m magic_jax.experiments.ablations")


@pytest.mark.heavy  # about 15 s: a Jupyter kernel executes the notebook (the notebooks extra)
def test_jupyter_shows_the_figure_cells_image(tmp_path):
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = jupytext.read(CENTRAL)
    env = _env()
    old = dict(os.environ)
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(
            nb, timeout=300, resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    figure_cells = [c for c in nb.cells if c.cell_type == "code" and "figures.show(" in c.source]
    assert figure_cells
    for cell in figure_cells:
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.source


def test_supervised_baselines_beyond_a_few_start_only_when_told(tmp_path, monkeypatch):
    import magic_jax.jobs.carry_world as carry_world

    for k in (progress.YES_ENV, ablations.STEPS_ENV, ablations.RESULTS_ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(sys, "stdin", None)
    arm = ablations.ABLATIONS["central"].arm("carry-adaptive-0.08")
    for seed in range(5):  # five finished runs of 120 s of steps each, no baseline yet
        d = ablations.summary_dir(tmp_path, arm, seed)
        d.mkdir(parents=True)
        (d / "run.json").write_text("{}")
        row = {"step": 0, "t_rollout_s": 100.0, "t_update_s": 20.0, "t_eval_s": 50.0}
        (d / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    made = []

    def sft_continuation(seconds, *, seed, num_samples):
        made.append((seed, seconds))
        return {"after": {"accuracy": 0.2}}

    monkeypatch.setattr(carry_world, "sft_continuation", sft_continuation)
    logs = []
    opts = {"results": tmp_path, "log": logs.append}
    with pytest.raises(SystemExit, match=r"^\[ablations\] 5 runs to train in .*, about 15 min"):
        ablations.ensure_sft("central", "carry-adaptive-0.08", **opts)
    assert not made and not (tmp_path / "sft").exists()
    assert logs == ["[ablations] 5 SFT continuation(s) of carry-adaptive-0.08 to do, about 15 min"]
    out = ablations.ensure_sft("central", "carry-adaptive-0.08", yes=True, **opts)
    assert made == [(s, 120.0) for s in range(5)] and sorted(out) == list(range(5))
    # made once: asked again, nothing to train and nothing asked; a few start unasked
    assert ablations.ensure_sft("central", "carry-adaptive-0.08", **opts) == out
    (tmp_path / "sft" / arm.key / "seed4.json").unlink()
    ablations.ensure_sft("central", "carry-adaptive-0.08", **opts)
    assert len(made) == 6
