"""``magic-jax convert``: a Hub repo id (from a filled Hugging Face cache, offline), a local
or ``gs://`` directory, staged with its tokenizer and its origin; what it refuses.

The two-process run that reads a converted model per host: tests/staging_multihost_test.py.
"""

import json

import numpy as np
import pytest
from conftest import GcsEmulator
from flax import nnx
from helpers import save_sums_model

from magic_jax import storage
from magic_jax.jobs import cli
from magic_jax.model.convert import load_hf
from magic_jax.run.checkpoint import checkpoint_kind
from magic_jax.run.policy import load_policy, load_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"
REPO = "tiny-org/Tiny-Qwen2"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("staging")
    return save_sums_model(root / "a", seed=0), save_sums_model(root / "b", seed=1)


@pytest.fixture
def hub(models, tmp_path, monkeypatch):
    """A Hugging Face cache as the Hub client leaves it (blobs, snapshots of symlinks,
    refs): ``REPO`` at ``main`` is model a (``COMMIT``), at tag ``v2`` model b (``OTHER``);
    offline, so the real ``snapshot_download`` reads only it."""
    import hashlib

    from huggingface_hub import constants

    cache = tmp_path / "hub"
    base = cache / ("models--" + REPO.replace("/", "--"))
    for src, commit, ref in ((models[0], COMMIT, "main"), (models[1], OTHER, "v2")):
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in src.iterdir():
            data = f.read_bytes()
            blob = base / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            blob.write_bytes(data)
            (snap / f.name).symlink_to(f"../../blobs/{blob.name}")
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # read when huggingface_hub is imported (by transformers, long before this test)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _params(model) -> dict:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _same_model(out, src) -> None:
    got, want = _params(load_policy(out, "float32", None)), _params(load_hf(src))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def _same_tokenizer(out, src) -> None:
    text = "1+1=2 "
    assert load_tokenizer(out).encode(text) == load_tokenizer(src).encode(text)


def test_a_hub_repo_id_from_the_cache_is_staged_with_its_tokenizer_and_commit(
    hub, models, tmp_path, capsys
):
    out = tmp_path / "staged"
    assert cli.main(["convert", REPO, str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{REPO} (revision main, commit {COMMIT})" in printed, printed
    source = json.loads((out / "source.json").read_text())
    assert source["repo_id"] == REPO and source["revision"] == "main"
    assert source["commit"] == COMMIT and source["parameters"] > 0
    assert checkpoint_kind(out)[0] == "orbax"  # no config.json beside it: not read as HF
    assert not (out / "config.json").exists()
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    _same_model(out, models[0])
    _same_tokenizer(out, models[0])
    # a tag resolves to its own commit
    assert cli.main(["convert", REPO, str(tmp_path / "v2"), "--revision", "v2"]) == 0
    assert json.loads((tmp_path / "v2" / "source.json").read_text())["commit"] == OTHER
    _same_model(tmp_path / "v2", models[1])


def _one_line_error(argv, capsys) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("magic-jax convert: error: ") and "\n" not in err, err
    return err


def test_bad_sources_are_one_line_naming_what_is_wrong(hub, models, tmp_path, capsys):
    out = str(tmp_path / "out")
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((models[0] / name).read_bytes())
    broken = tmp_path / "broken_tokenizer"
    broken.mkdir()
    for f in models[0].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text("{not json")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    for f in models[0].iterdir():
        if f.suffix != ".safetensors":
            (weightless / f.name).write_bytes(f.read_bytes())
    (tmp_path / "a_file").write_text("x")
    cases = [
        (["tiny-org/absent"], "source tiny-org/absent: not in the Hugging Face cache"),
        ([REPO, "--revision", "v9"], f"source {REPO} (revision v9): not in the Hugging Face"),
        (["./no/such/dir"], "source ./no/such/dir: no such directory, and not a Hub repo id"),
        ([str(tmp_path / "a_file")], "a_file: not a directory"),
        ([str(models[0]), "--revision", "v2"], "--revision v2: applies to a Hub repo id"),
        ([str(bare)], f"source {bare}: no tokenizer (tokenizer.json or tokenizer_config.json"),
        ([str(broken)], f"source {broken}: its tokenizer does not load"),
        ([str(weightless)], "neither model.safetensors nor model.safetensors.index.json"),
        ([str(models[0]), "--chunk-mb", "0"], "--chunk-mb 0.0: must be a positive"),
    ]
    for argv, want in cases:
        err = _one_line_error(["convert", argv[0], out, *argv[1:]], capsys)
        assert want in err, (argv, err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_model_already_there_is_kept_unless_overwrite(models, tmp_path, capsys):
    a, b = (str(m) for m in models)
    out = tmp_path / "m"
    assert cli.main(["convert", a, str(out)]) == 0
    err = _one_line_error(["convert", b, str(out)], capsys)
    assert f"holds a model converted from {a}; refusing to overwrite it" in err
    _same_model(out, models[0])  # untouched
    assert cli.main(["convert", b, str(out), "--overwrite"]) == 0
    _same_model(out, models[1])
    assert json.loads((out / "source.json").read_text())["path"] == b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing left beside it
    # a directory of other files is never replaced; the source is never the destination
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    for extra in ([], ["--overwrite"]):
        err = _one_line_error(["convert", a, str(tmp_path / "notes"), *extra], capsys)
        assert "not empty (mine.txt) and not a model; refusing to overwrite it" in err
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep"
    err = _one_line_error(["convert", a, a, "--overwrite"], capsys)
    assert "is the source" in err
    (tmp_path / "file").write_text("x")
    assert "is a file" in _one_line_error(["convert", a, str(tmp_path / "file" / "m")], capsys)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    root = tmp_path_factory.mktemp("staging_gcs")
    with GcsEmulator(root / "emulator.log").in_env(MAGIC_JAX_GCS_CACHE=str(root / "cache")) as e:
        e.cache = root / "cache"
        yield e


def test_staged_on_the_bucket_a_run_reads_policy_and_tokenizer_from_it(gcs, models, capsys):
    a, b = models
    hf = gcs.uri("hf")
    fs = storage.gcs_fs()
    for f in b.iterdir():
        fs.put_file(str(f), f"{hf}/{f.name}")
    out = gcs.uri("models/tiny")
    assert cli.main(["convert", str(a), out]) == 0
    names = storage.listing(out)
    assert "model_config.json" in names and "tokenizer.json" in names
    assert any(n.startswith("state/") for n in names) and "config.json" not in names
    assert checkpoint_kind(out)[0] == "orbax"
    _same_model(out, a)
    _same_tokenizer(out, a)
    # the tokenizer's files were copied to this machine, none of the arrays
    cached = [p.relative_to(gcs.cache).as_posix() for p in gcs.cache.rglob("*") if p.is_file()]
    assert cached and not [p for p in cached if "/state/" in p], cached

    # a gs:// Hugging Face directory as the source, replacing the model there
    err = _one_line_error(["convert", hf, out], capsys)
    assert f"holds a model converted from {a}" in err
    assert cli.main(["convert", hf, out, "--overwrite"]) == 0
    assert json.loads(storage.path(out + "/source.json").read_text())["path"] == hf
    _same_model(out, b)
    siblings = {p.rsplit("/", 1)[-1] for p in fs.ls(out.rsplit("/", 1)[0])}
    assert siblings == {out.rsplit("/", 1)[-1]}, siblings  # no .partial or .replaced left
    # nothing at the source; a destination bucket that does not exist
    absent = gcs.uri("absent")
    assert f"source {absent}: nothing there" in _one_line_error(
        ["convert", absent, gcs.uri("x")], capsys
    )
    nowhere = f"gs://{gcs.BUCKET}-missing/m"
    err = _one_line_error(["convert", str(a), nowhere], capsys)
    assert f"out {nowhere}: the bucket {gcs.BUCKET}-missing does not exist" in err
