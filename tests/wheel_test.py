"""The package as a user installs it: a wheel and an sdist built from the tracked files,
each installed into a fresh venv from the package registry (slow: downloads and installs).

- the core wheel alone (``pip install magic-jax``): how many packages it resolves
  (printed; at most 15), quick start 3 as the README has it, the tests of the losses,
  advantages and entropy control, and the one-line errors that name a missing extra;
- the wheel with ``[train]``: ``magic-jax train`` runs the shipped default to its end,
  reading the model and data shipped inside the wheel;
- the sdist installs like the wheel (same files).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# the core's packages, magic-jax included (jax, jaxlib, numpy, optax and their deps: 9 today)
CORE_MAX_PACKAGES = 15
# the tests a core install runs: they import only jax, numpy, optax and the core modules
CORE_TESTS = ("losses_test.py", "advantages_test.py", "entropy_test.py")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("timeout", 1200)
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (
        f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The wheel and sdist, built (without build isolation, from this venv's setuptools)
    from a copy of the tracked files, so the checkout is left as it was."""
    src = tmp_path_factory.mktemp("src")
    files = _run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("dist")
    _run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--sdist",
            "--no-isolation",
            "--outdir",
            str(out),
            str(src),
        ]
    )
    wheel, sdist = next(out.glob("*.whl")), next(out.glob("*.tar.gz"))
    print(f"wheel {wheel.stat().st_size / 1e6:.1f} MB, sdist {sdist.stat().st_size / 1e6:.1f} MB")
    return {"wheel": wheel, "sdist": sdist}


def _venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin"


def _pip(bin_: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return _run([str(bin_ / "python"), "-m", "pip", *args], env=env, cwd=cwd)


def _quick_start_3() -> str:
    """The README's quick start 3 code block, as a user copies it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## 3. ") : text.index("## 4. ")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _clean_env() -> dict[str, str]:
    # nothing of this checkout or its venv on the path: the venv's own magic_jax only
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_the_core_wheel_alone_runs_quick_start_3_and_the_loss_tests(dist, tmp_path):
    bin_ = _venv(tmp_path / "venv")
    report = tmp_path / "report.json"
    _pip(
        bin_,
        "install",
        "-q",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        str(dist["wheel"]),
    )
    names = sorted(i["metadata"]["name"] for i in json.loads(report.read_text())["install"])
    print(f"pip install magic-jax resolves {len(names)} packages: {', '.join(names)}")
    assert len(names) <= CORE_MAX_PACKAGES, names
    assert not {"flax", "orbax-checkpoint", "transformers", "grain", "tensorflow-datasets"} & set(
        names
    )
    _pip(bin_, "install", "-q", "-c", str(ROOT / "constraints.txt"), str(dist["wheel"]), "pytest")
    work = tmp_path / "work"
    work.mkdir()
    (work / "quick_start_3.py").write_text(_quick_start_3())
    out = _run([str(bin_ / "python"), "quick_start_3.py"], cwd=work, env=_clean_env()).stdout
    assert re.search(
        r"loss -?\d\.\d{4}, clipped low \d\.\d\d, high \d\.\d\d, grad \(4, 16\)", out
    ), out
    # the tests of the loss functions, against the installed wheel (not this checkout)
    tests = work / "tests"
    tests.mkdir()
    for f in ("conftest.py", "helpers.py", *CORE_TESTS):
        shutil.copy2(ROOT / "tests" / f, tests / f)
    proc = _run(
        [str(bin_ / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=work,
        env=_clean_env(),
    )
    print(proc.stdout.splitlines()[-1])
    assert " passed" in proc.stdout and " failed" not in proc.stdout
    where = _run(
        [str(bin_ / "python"), "-c", "import magic_jax; print(magic_jax.__file__)"],
        cwd=work,
        env=_clean_env(),
    )
    assert str(tmp_path / "venv") in where.stdout
    # what needs an extra says which, in one line
    model = subprocess.run(
        [str(bin_ / "python"), "-c", "import magic_jax.model.qwen2"],
        capture_output=True, text=True, cwd=work, env=_clean_env(),
    )  # fmt: skip
    assert model.returncode == 1
    want = (
        "ModuleNotFoundError: No module named 'flax': magic_jax.model.qwen2 needs it; "
        "install the [model] extra: pip install 'magic-jax[model]'"
    )
    assert want in model.stderr, model.stderr[-2000:]
    train = subprocess.run(
        [str(bin_ / "magic-jax"), "train"],
        capture_output=True,
        text=True,
        cwd=work,
        env=_clean_env(),
    )
    assert train.returncode == 2, train.stderr
    line = train.stderr.strip()
    assert "\n" not in line and line.startswith("magic-jax train: error: No module named ")
    assert line.endswith("install the [train] extra: pip install 'magic-jax[train]'")


def test_the_wheel_with_train_runs_the_shipped_default_to_its_end(dist, tmp_path):
    bin_ = _venv(tmp_path / "venv")
    _pip(bin_, "install", "-q", "-c", str(ROOT / "constraints.txt"), f"{dist['wheel']}[train]")
    work = tmp_path / "work"
    work.mkdir()
    proc = _run(
        [str(bin_ / "magic-jax"), "train", "--set", "export_hf=false"],
        cwd=work,
        env={**_clean_env(), "MAGIC_JAX_COMPILATION_CACHE": str(tmp_path / "cache")},
        timeout=1800,
    )
    last = proc.stdout.strip().splitlines()[-1]
    print(last)
    assert last.startswith("[done] held-out avg@") and "wall time" in last, proc.stdout[-2000:]
    run = work / "runs" / "default"
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(60)) and (run / "summary.json").exists()


def test_the_sdist_holds_what_the_wheel_holds(dist, tmp_path):
    import tarfile
    import zipfile

    in_wheel = {n for n in zipfile.ZipFile(dist["wheel"]).namelist() if n.startswith("magic_jax/")}
    with tarfile.open(dist["sdist"]) as t:
        in_sdist = {
            n.split("/", 1)[1] for n in t.getnames() if "/magic_jax/" in n and not n.endswith("/")
        }
    assert in_wheel and in_wheel <= in_sdist
    assert {"magic_jax/assets/default/default.yaml", "magic_jax/extras.py"} <= in_wheel
