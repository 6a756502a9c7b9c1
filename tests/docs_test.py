"""README.md and docs/*.md: the marked code blocks run, the marked commands exist, every
relative link resolves, and the README stays short.

Markers (docs/testing.md, "The code blocks of these pages"): an HTML comment on the line
before a fenced block.

- ``<!-- test: run -->`` before a ``python`` block: the block is imported as a module in a
  fresh Python process from the checkout root, on one CPU device, and must not raise.
- ``<!-- test: cli -->`` before a ``bash`` block: every command in it is checked without
  running a job: ``make T`` (T is a target of the Makefile), ``magic-jax ...`` (parsed by
  the CLI's own argparse; a config and its ``--set`` overrides are loaded and checked),
  ``tpu_scripts/launch.sh ...`` (run with ``--dry-run``: every gcloud command printed,
  none run; the command after ``--`` checked as above), ``python -m magic_jax.experiments.ablations
  SUB ...`` (its options appear in ``SUB --help``), ``python FILE`` and ``pytest FILE...``
  (the files exist). Any other command in a marked block fails the test.
- ``<!-- test: pod -->`` before a ``bash`` block: the README's pod walkthrough. Its
  commands are checked as above (``gcloud storage ...`` and ``tensorboard --logdir``
  allowed too), and tests/walkthrough_test.py runs every one of them: against a stub
  ``gcloud`` and the Cloud Storage emulator, or with ``--dry-run``.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 12_500
# docs/*.md together: a reference a newcomer reads through (90,000 until the packed update,
# the two-process seam's threat model and the planner's hand-counted costs came in)
DOCS_MAX_BYTES = 96_000
MARKER = re.compile(r"^<!-- test: (\w+) -->$")
FENCE = re.compile(r"^(`{3,})(\S*)")


def _blocks(page: Path):
    """(kind, info string, first line number, code) of every marked fenced block."""
    lines = page.read_text(encoding="utf-8").split("\n")
    out, i = [], 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        assert fence, f"{page.name}:{i + 1}: a test marker must sit on the line before a fence"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith(fence.group(1)))
        out.append((m.group(1), fence.group(2), i + 3, "\n".join(lines[i + 2 : end]) + "\n"))
        i = end + 1
    return out


BLOCKS = [(p, *b) for p in PAGES for b in _blocks(p)]


def _ids(kind):
    return [f"{p.relative_to(ROOT)}:{line}" for p, k, _, line, _ in BLOCKS if k == kind]


def _of(kind):
    return [(p, info, code) for p, k, info, _, code in BLOCKS if k == kind]


def test_markers_are_known_and_blocks_exist():
    kinds = {k for _, k, *_ in BLOCKS}
    assert kinds <= {"run", "cli", "pod"}, kinds
    for page, kind, info, line, _ in BLOCKS:
        want = "python" if kind == "run" else "bash"
        assert info == want, f"{page.name}:{line}: a '{kind}' block must be {want}, got {info!r}"
    readme = [b for b in BLOCKS if b[0].name == "README.md"]
    assert any(k == "run" for _, k, *_ in readme), "the README's laptop snippet is not marked"


# --------------------------------------------------------------------------- python blocks


def _cpu_env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    # one CPU device, as on a laptop (tests/conftest.py asks for eight)
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env["XLA_FLAGS"] = flags.strip()
    return env


def _python(args: list[str], *, timeout: int) -> subprocess.CompletedProcess:
    """This interpreter on ``args`` from the checkout root, on one CPU device."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=_cpu_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _run_params():
    """The README's blocks in the default suite; the docs/ pages' (which load the
    shipped model, decode and start verifier workers: ~40 s together) in the slow one."""
    return [
        pytest.param(p, info, code, marks=() if p == ROOT / "README.md" else pytest.mark.slow)
        for p, info, code in _of("run")
    ]


@pytest.mark.parametrize(("page", "info", "code"), _run_params(), ids=_ids("run"))
def test_python_block_runs(page, info, code, tmp_path):
    # imported as a module (not run as __main__), as a page's extension module is: a
    # registered reward must live where the verifier workers can import it
    (tmp_path / "block.py").write_text(code)
    env = _cpu_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-c", "import block"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_readme_loss_snippet_is_jitted_with_a_gradient():
    (code,) = [c for p, _, c in _of("run") if p.name == "README.md"]
    assert "jax.jit" in code and "policy_loss" in code and "grad" in code


# --------------------------------------------------------------------------- commands


def _commands(code: str):
    """The commands of a bash block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", code)
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Z_]+=", words[0]):  # leading VAR=value
            words = words[1:]
        if words:
            yield words


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M))


def _check_magic_jax(args: list[str]) -> None:
    from magic_jax.jobs.cli import build_parser
    from magic_jax.run.config import load_config

    try:
        ns = build_parser().parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"magic-jax {shlex.join(args)}: argparse refused it") from e
    if ns.command in ("train", "plan", "demo"):
        config = getattr(ns, "config", None) or str(ROOT / "configs" / "default.yaml")
        load_config(ROOT / config, ns.set or ())


def _check_launch(args: list[str], tmp_path: Path) -> None:
    script = ROOT / "tpu_scripts" / "launch.sh"
    env = dict(os.environ, DRY_RUN="1", TMPDIR=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(script), "--dry-run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"launch.sh {shlex.join(args)}: {proc.stderr[-2000:]}"
    if "--" in args:
        inner = args[args.index("--") + 1 :]
        assert inner[0] == "magic-jax", inner
        _check_magic_jax(inner[1:])
        assert "gcloud compute tpus tpu-vm ssh" in proc.stdout


def _check_ablations(args: list[str]) -> None:
    sub = args[0]
    proc = _python(["-m", "magic_jax.experiments.ablations", sub, "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in (a for a in args[1:] if a.startswith("--")):
        found = re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", proc.stdout)
        assert found, f"python -m magic_jax.experiments.ablations {sub}: no {flag}"


def _check_command(words: list[str], tmp_path: Path) -> None:
    cmd, args = words[0], words[1:]
    name = Path(cmd).name
    if cmd == "make":
        missing = set(args) - _make_targets()
        assert not missing, f"make: no target {sorted(missing)}"
    elif name == "magic-jax":
        _check_magic_jax(args)
    elif cmd.endswith("tpu_scripts/launch.sh"):
        _check_launch(args, tmp_path)
    elif cmd == "bash" and args and args[0].endswith("tpu_scripts/launch.sh"):
        _check_launch(args[1:], tmp_path)
    elif name.startswith("python") and args[:2] == ["-m", "magic_jax.experiments.ablations"]:
        _check_ablations(args[2:])
    elif name.startswith("python") and args[:1] == ["-m"] and args[1].startswith("magic_jax."):
        module = ROOT / (args[1].replace(".", "/") + ".py")
        assert module.exists(), f"{shlex.join(words)}: no {module.relative_to(ROOT)}"
    elif cmd == "gcloud" and args[:1] == ["storage"]:  # run by tests/walkthrough_test.py
        assert args[1] in ("buckets", "cp"), shlex.join(words)
    elif cmd == "tensorboard":  # run by tests/walkthrough_test.py
        assert args[:1] == ["--logdir"] and len(args) == 2, shlex.join(words)
    elif name.startswith("python") or name == "pytest":
        files = [a for a in args if not a.startswith("-")]
        assert files, shlex.join(words)
        for f in files:
            assert (ROOT / f.split("::")[0]).exists(), f"{shlex.join(words)}: no {f}"
    else:
        raise AssertionError(f"no check for the command {shlex.join(words)!r}")


@pytest.mark.parametrize(
    ("page", "info", "code"), _of("cli") + _of("pod"), ids=_ids("cli") + _ids("pod")
)
def test_commands_exist(page, info, code, tmp_path):
    commands = list(_commands(code))
    assert commands
    for words in commands:
        _check_command(words, tmp_path)


def test_first_readme_command_is_make_demo():
    """tests/demo_test.py runs the README's first command as written."""
    _, _, code = next(b for b in _of("cli") if b[0].name == "README.md")
    first = next(_commands(code))
    assert first == ["make", "demo"]


# --------------------------------------------------------------------------- links and size


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6} (.+)$", line)
        if m:
            base = _slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(page: Path):
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    links = _links(page)
    assert page.name != "README.md" or links
    for link in links:
        if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} -> {target} does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{page.name}: no heading #{anchor} in {path}"


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, size


def test_docs_stay_under_their_budget():
    sizes = {p.name: len(p.read_bytes()) for p in sorted((ROOT / "docs").glob("*.md"))}
    assert sum(sizes.values()) <= DOCS_MAX_BYTES, sizes


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in PAGES:
        if page.parent.name == "docs" and page.name != "README.md":
            assert f"]({page.name}" in index, page.name
