"""The README's pod walkthrough (``<!-- test: pod -->`` blocks), every command run.

From creating the bucket to deleting the slice, in the README's order, each command
runs where it can here:

- ``gcloud storage ...``: a stub ``gcloud`` that does the same against the Cloud
  Storage emulator (fake-gcs-server): ``buckets create`` creates the bucket,
  ``cp`` uploads through gcsfs.
- ``magic-jax convert REPO_ID gs://...``: as typed, with the Hub's cache filled
  beforehand (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``): the tiny test model stands
  under the repo id, so the real ``snapshot_download`` path runs, offline.
- ``tpu_scripts/launch.sh ... -- CMD``: with ``--dry-run`` (every gcloud command
  printed, none run); then CMD itself runs here on the emulator, with the tiny
  run's config in place of the 7B one and size options added to ``eval`` (the
  README's own ``--set`` overrides and paths kept); ``--delete`` in a dry run.
- ``magic-jax plan``: parsed with its config (compiling needs libtpu:
  tests/plan_test.py); ``make T``: the target exists.
- ``magic-jax status / report / export`` on the bucket: as typed.
- ``tensorboard --logdir gs://...``: the TensorBoard server, started on the
  emulator's bucket, lists the run's scalars (with ``--load_fast=false``: its
  Python reader goes through gcsfs; the default Rust reader has its own GCS client,
  which cannot be pointed at an emulator).
"""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import GcsEmulator
from trainer_test import files as files  # a fixture, used by name

from magic_jax import storage

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
BUCKET = "walk-bucket"

# gcloud storage, against the emulator the environment points gcsfs at
GCLOUD = f"""#!{sys.executable}
import json, os, sys, urllib.request
import gcsfs

args = [a for a in sys.argv[1:] if not a.startswith("--location")]
with open(os.environ["STUB_CALLS"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if args[:3] == ["storage", "buckets", "create"]:
    name = args[3].removeprefix("gs://")
    req = urllib.request.Request(
        os.environ["STORAGE_EMULATOR_HOST"] + "/storage/v1/b",
        data=json.dumps({{"name": name}}).encode(),
        headers={{"Content-Type": "application/json"}}, method="POST")
    urllib.request.urlopen(req, timeout=10).read()
elif args[:2] == ["storage", "cp"]:
    rest = [a for a in args[2:] if a not in ("-r", "--recursive")]
    *srcs, dest = rest
    fs = gcsfs.GCSFileSystem()
    for src in srcs:
        name = os.path.basename(src.rstrip("/"))
        fs.put_file(src, dest.rstrip("/") + "/" + name)
else:
    sys.exit("stub gcloud: no stub for " + " ".join(sys.argv[1:]))
"""


def pod_commands() -> list[list[str]]:
    """The commands of the README's pod blocks, in order (continuations joined)."""
    from docs_test import BLOCKS, _commands

    blocks = [
        code for page, kind, _, _, code in BLOCKS if page.name == "README.md" and kind == "pod"
    ]
    return [words for code in blocks for words in _commands(code)]


def _fill_hub_cache(hub: Path, repo: str, model: Path) -> None:
    """The Hub cache's layout for ``repo`` at ``main``, holding the tiny model's files."""
    base = hub / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / HUB_COMMIT
    snap.mkdir(parents=True)
    for f in model.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(HUB_COMMIT)


@pytest.fixture(scope="module")
def walk(files, tmp_path_factory):
    root = tmp_path_factory.mktemp("walk")
    stub = root / "bin"
    stub.mkdir()
    (stub / "gcloud").write_text(GCLOUD)
    (stub / "gcloud").chmod(0o755)
    work = root / "work"
    work.mkdir()
    with GcsEmulator(root / "emulator.log").in_env() as gcs:
        env = dict(
            os.environ,
            **gcs.env,
            PATH=f"{stub}:{BIN}:{os.environ['PATH']}",
            STUB_CALLS=str(root / "calls"),
            HF_HUB_CACHE=str(root / "hub"),
            HF_HUB_OFFLINE="1",
            TMPDIR=str(root),
        )
        yield {"root": root, "work": work, "env": env, "files": files}


def _run(words, cwd, env, timeout=600):
    proc = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{shlex.join(words)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _inner(words, files):
    """The command after ``--`` of a launch, made to run here: the tiny run's config in
    place of a released one, and ``eval`` sized for the tiny model."""
    if words[1] == "train":
        cfg = next(i for i, w in enumerate(words) if w.endswith(".yaml"))
        return [*words[:cfg], str(files / "run.yaml"), *words[cfg + 1 :]]
    if words[1] == "eval":
        run, *rest = words[2:]
        data = [w for w in rest if w.endswith(".parquet")]
        rest = [w for w in rest if w not in data]
        if "--mesh" in rest:  # one host's CPU devices here
            i = rest.index("--mesh")
            del rest[i : i + 2]
        return [
            "magic-jax",
            "eval",
            run,
            str(files / "train.jsonl"),
            *rest,
            "--tokenizer",
            str(files / "model"),
            "--n",
            "2",
            "--max-response-length",
            "3",
            "--max-prompt-length",
            "16",
        ]
    return words


def _tensorboard(words, cwd, env):
    """Starts the TensorBoard server as typed (on a free port) and waits until it lists
    the run's scalar tags from the bucket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # --load_fast=false: TensorBoard's Python reader (fsspec, so gcsfs and the emulator);
    # its default Rust data server reads gs:// with its own client, which knows no emulator
    cmd = [
        *words,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--reload_interval",
        "1",
        "--load_fast=false",
    ]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline, tags = time.monotonic() + 120, None
        while True:
            try:
                url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
                tags = json.loads(urllib.request.urlopen(url, timeout=5).read())
                if tags and any("entropy" in t for run in tags.values() for t in run):
                    return tags
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            if time.monotonic() > deadline:
                proc.terminate()
                raise AssertionError(f"TensorBoard listed {tags}: {proc.communicate()[0][-3000:]}")
            time.sleep(1)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.slow  # ~2 min: convert, a 4-step run, eval, report and export on the bucket
def test_the_readme_pod_walkthrough_runs(walk):
    from docs_test import _check_launch, _check_magic_jax, _make_targets

    commands = [[w.replace("BUCKET", BUCKET) for w in c] for c in pod_commands()]
    assert commands, "the README has no pod block"
    work, env, files = walk["work"], walk["env"], walk["files"]
    seen = []
    for words in commands:
        name = words[0]
        if name == "gcloud":
            if words[1:3] == ["storage", "cp"]:  # the prompts: the tiny run's rows
                src = next(w for w in words[3:] if not w.startswith("-"))
                (work / src).mkdir(parents=True, exist_ok=True)
                (work / src / "train.jsonl").write_bytes((files / "train.jsonl").read_bytes())
                words = [w if w != src else str(work / src / "train.jsonl") for w in words]
            _run(words, work, env)
        elif name == "make":
            assert set(words[1:]) <= _make_targets(), words
        elif Path(name).name == "magic-jax" and words[1] == "plan":
            _check_magic_jax(words[1:])
        elif name == "magic-jax" and words[1] == "convert":
            repo = words[2]
            _fill_hub_cache(Path(env["HF_HUB_CACHE"]), repo, files / "model")
            out = _run(words, work, env)
            assert HUB_COMMIT in out.stdout + out.stderr  # where the model came from
        elif name.endswith("tpu_scripts/launch.sh"):
            _check_launch(words[1:], work)
            if "--" in words:
                _run(_inner(words[words.index("--") + 1 :], files), work, env)
        elif name == "tensorboard":
            tags = _tensorboard(words, work, env)
            assert tags
        elif name == "magic-jax":
            _run(words, work, env)
        else:
            raise AssertionError(f"no way to run {shlex.join(words)!r} here")
        seen.append(words[1] if name in ("magic-jax", "gcloud") else Path(name).name)
    calls = [json.loads(x) for x in Path(walk["root"], "calls").read_text().splitlines()]
    assert calls[0][:3] == ["storage", "buckets", "create"]
    fs = storage.gcs_fs()
    runs = [p for p in fs.ls(f"gs://{BUCKET}/runs")]
    assert runs, "the run wrote nothing to the bucket"
    assert any(re.search(r"events\.out\.tfevents", p) for r in runs for p in fs.ls(r))
    assert {"convert", "status", "report", "export"} <= set(seen), seen
