"""estimate-difficulty: a killed and resumed job writes what one run does; the offline filter
reads its output with N per ability; rows keep the form of their difficulty table."""

import contextlib
import io
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from magic_jax.data.rows import DataError, offline_filter, parse_row
from magic_jax.data.sources import read_rows
from magic_jax.jobs.cli import main
from magic_jax.jobs.difficulty import with_difficulty


def _row(i, a, b, **extra):
    return {
        "data_source": "sums",
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "math",
        "reward_model": {"ground_truth": str(a + b), "style": "rule"},
        "extra_info": {"index": i, **extra},
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from helpers import save_sums_model

    root = tmp_path_factory.mktemp("difficulty")
    save_sums_model(root / "model", seed=1)
    rng = np.random.default_rng(1)
    pairs = [tuple(int(x) for x in rng.integers(0, 2, 2)) for _ in range(10)]
    rows = [_row(i, a, b) for i, (a, b) in enumerate(pairs[:6])]
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Parquet rows as the public data stores them: the table as a JSON string
    other = json.dumps({"other-model": 7})
    rows = [_row(10 + i, a, b, model_difficulty=other) for i, (a, b) in enumerate(pairs[6:])]
    pq.write_table(pa.Table.from_pylist(rows), root / "b.parquet")
    return root


def _run(files, out):
    args = ["estimate-difficulty", str(files / "model"), str(files / "a.jsonl"),
            str(files / "b.parquet"), "--out", str(out), "--model-name", "tiny",
            "--samples", "math=4", "--chunk", "3", "--max-response-length", "3",
            "--max-prompt-length", "16", "--workers", "1",
            "--set", "rollout.max_concurrent_decodes=8",
            "--set", "rollout.decode_steps=4"]  # fmt: skip
    err, out_text = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out_text):
        code = main(args)
    assert code == 0, err.getvalue()
    return out_text.getvalue()


def _outputs(out):
    names = ["records.jsonl", "histogram.json", "rated/a.jsonl", "rated/b.parquet",
             "filtered/a.jsonl", "filtered/b.parquet"]  # fmt: skip
    return {n: (out / n).read_bytes() for n in names}


@pytest.mark.slow  # ~8-21 s of compiles and a subprocess; the slow target runs it
def test_killed_and_resumed_equals_one_run_and_feeds_the_offline_filter(files, tmp_path):
    one = tmp_path / "one"
    _run(files, one)
    rated = read_rows([one / "rated" / "a.jsonl", one / "rated" / "b.parquet"])
    counts = [r.difficulty("tiny") for r in rated]
    assert len(counts) == 10 and all(0 <= c <= 4 for c in counts)
    assert [r.difficulty("other-model") for r in rated] == [None] * 6 + [7] * 4
    # the Parquet table stays a JSON string; the JSON-lines one is a mapping
    raw_b = pq.read_table(one / "rated" / "b.parquet").to_pylist()
    assert json.loads(raw_b[0]["extra_info"]["model_difficulty"]) == {
        "other-model": 7,
        "tiny": counts[6],
    }
    raw_a = json.loads((one / "rated" / "a.jsonl").read_text().splitlines()[0])
    assert raw_a["extra_info"]["model_difficulty"] == {"tiny": counts[0]}
    hist = json.loads((one / "histogram.json").read_text())
    assert hist["math"] == {"samples": 4, "counts": [counts.count(c) for c in range(5)]}
    # the filtered set is exactly what the trainer's offline filter keeps (N = 4 here)
    filtered = read_rows([one / "filtered" / "a.jsonl", one / "filtered" / "b.parquet"])
    kept = [r.uid for r in rated if 0 < r.difficulty("tiny") < 4]
    assert [r.uid for r in filtered] == kept
    assert [r.uid for r in offline_filter(rated, "tiny", 4)] == kept
    assert [r.uid for r in offline_filter(rated, "tiny", {"math": 4})] == kept
    assert 0 < len(kept) < 10  # some prompts dropped, some kept: the filter is exercised

    # killed after the first chunk, in the middle of writing the second
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(one / "difficulty.json", two / "difficulty.json")
    lines = (one / "records.jsonl").read_bytes().splitlines(keepends=True)
    (two / "records.jsonl").write_bytes(b"".join(lines[:3]) + lines[3][:20])
    log = _run(files, two)
    assert "resuming: 3 of 10 prompts" in log  # the first chunk is not sampled again
    assert _outputs(two) == _outputs(one)


def test_offline_filter_n_per_ability_and_unrated_rows():
    def row(i, ability, table):
        extra = {"index": i} | ({"model_difficulty": table} if table is not None else {})
        raw = _row(i, 0, 1) | {"data_source": "s", "ability": ability, "extra_info": extra}
        return parse_row(raw, f"t:{i}", f"t:{i}")

    rows = [
        row(0, "math", {"m": 8}),  # 8/16: kept
        row(1, "code", {"m": 8}),  # 8/8: dropped
        row(2, "code", json.dumps({"m": 4})),  # 4/8, stored as JSON: kept
        row(3, "math", {"m": 0}),  # 0/16: dropped
        row(4, "math", {"other": 3}),  # no entry for m
        row(5, "math", None),  # no table at all
    ]
    n = {"math": 16, "code": 8}
    assert [r.uid for r in offline_filter(rows, "m", n)] == ["s:0", "s:2", "s:4", "s:5"]
    assert [r.uid for r in offline_filter(rows, "m", n, keep_unrated=False)] == ["s:0", "s:2"]
    assert [r.uid for r in offline_filter(rows, "m", 8)] == ["s:2", "s:4", "s:5"]
    with pytest.raises(DataError, match="ability 'code'"):
        offline_filter(rows, "m", {"math": 16})


def test_with_difficulty_keeps_the_stored_forms():
    raw = _row(0, 1, 1)
    assert with_difficulty(raw, "x", 3, parquet=False)["extra_info"]["model_difficulty"] == {"x": 3}
    assert with_difficulty(raw, "x", 3, parquet=True)["extra_info"]["model_difficulty"] == (
        '{"x": 3}'
    )
    as_text = raw | {"extra_info": json.dumps({"model_difficulty": {"y": 1}})}
    back = json.loads(with_difficulty(as_text, "x", 2, parquet=False)["extra_info"])
    assert back["model_difficulty"] == {"x": 2, "y": 1}
    assert raw["extra_info"] == {"index": 0}  # the input row is not changed
