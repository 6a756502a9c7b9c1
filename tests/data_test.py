"""Prompt data: verl rows from Parquet / JSON lines, checks, R1 prompts, filtering, batches."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import make_char_tokenizer

from magic_jax.data.rows import (
    AccuracyTracker,
    DataError,
    encode_prompts,
    offline_filter,
    online_filter,
    prompt_batches,
    render_r1,
)
from magic_jax.data.sources import read_rows
from magic_jax.rewards import RewardItem, RewardStatus, compute_reward

DATA = Path(__file__).parent / "data"


def _row(i, **kw):
    row = {
        "data_source": "train-math",
        "prompt": [{"role": "user", "content": f"what is {i}+{i}?"}],
        "ability": "math",
        "reward_model": {"ground_truth": json.dumps([str(2 * i)]), "style": "rule"},
        "extra_info": {"index": i, "model_difficulty": json.dumps({"r1-7b": i % 17})},
    }
    return row | kw


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reads_the_real_aime_sets():
    rows = read_rows(DATA)
    assert len(rows) == 60
    assert {r.data_source for r in rows} == {"test-math-aime24", "test-math-aime25"}
    assert len({r.uid for r in rows}) == 60
    first = rows[0]
    assert first.ability == "math" and first.ground_truth == "204"
    assert first.messages[0]["role"] == "user" and "Aya" in first.messages[0]["content"]
    assert any(r.ground_truth == "025" for r in rows)  # leading zeros kept as strings
    # a correct boxed answer scores through the verl row
    item = RewardItem.from_row(first.as_verl_row(), "</think>So \\boxed{204}.")
    assert compute_reward(item).status is RewardStatus.CORRECT


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    raw = [_row(i) for i in range(5)]
    a = read_rows(_jsonl(tmp_path / "a.jsonl", raw))
    pq.write_table(pa.Table.from_pylist(raw), tmp_path / "b.parquet")
    b = read_rows(tmp_path / "b.parquet")
    assert a == b
    assert a[3].uid == "train-math:3" and a[3].difficulty("r1-7b") == 3
    assert a[3].difficulty("other") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(prompt=None), "missing field 'prompt'"),
        (dict(prompt=[]), "non-empty list"),
        (dict(prompt=[{"role": "user"}]), r"prompt\[0\] must have 'role' and 'content'"),
        (dict(prompt=[{"role": "bot", "content": "x"}]), r"prompt\[0\].role 'bot'"),
        (dict(prompt=[{"role": "system", "content": "x"}]), "no user message"),
        (dict(ability=""), "'ability'"),
        (dict(reward_model={"style": "rule"}), "reward_model.ground_truth"),
        (dict(extra_info="{not json"), "'extra_info' is a string but not JSON"),
    ],
)
def test_bad_row_is_named_with_file_row_and_field(tmp_path, change, message):
    path = _jsonl(tmp_path / "d.jsonl", [_row(0), _row(1, **change)])
    with pytest.raises(DataError, match=message) as e:
        read_rows(path)
    assert f"{path}:2:" in str(e.value)  # the file's second line, counted from 1


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_rows(tmp_path / "missing.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        read_rows(tmp_path / "x.csv")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_rows(tmp_path / "bad.parquet")
    (tmp_path / "bad.jsonl").write_text(json.dumps(_row(0)) + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a JSON line"):
        read_rows(tmp_path / "bad.jsonl")
    _jsonl(tmp_path / "dup.jsonl", [_row(4), _row(4)])
    with pytest.raises(DataError, match="uid 'train-math:4' repeats"):
        read_rows(tmp_path / "dup.jsonl")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no .parquet or .jsonl files"):
        read_rows(empty)


def test_line_numbers_non_utf8_empty_files_and_abilities_without_verifier(tmp_path):
    # blank lines count: the error names the file's own line number
    path = tmp_path / "gaps.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n\n\n" + json.dumps(_row(1, prompt=[])) + "\n")
    with pytest.raises(DataError, match=r"gaps.jsonl:4: field 'prompt'"):
        read_rows(path)
    raw = tmp_path / "latin1.jsonl"
    raw.write_bytes(json.dumps(_row(0)).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text"):
        read_rows(raw)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty.jsonl: holds no rows"):
        read_rows(tmp_path / "empty.jsonl")
    # a row whose ability has no verifier would score every response as an error
    _jsonl(tmp_path / "phys.jsonl", [_row(0), _row(1, ability="physics")])
    with pytest.raises(DataError, match=r"phys.jsonl:2: ability 'physics' has no verifier"):
        read_rows(tmp_path / "phys.jsonl")
    assert len(read_rows(_jsonl(tmp_path / "ok.jsonl", [_row(0, ability="Math")]))) == 1


def test_render_r1_matches_the_released_format():
    msgs = [{"role": "user", "content": "1+1?"}]
    assert render_r1(msgs) == "<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜><think>\n"
    multi = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_r1(multi, think=False) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>a<｜Assistant｜>b<｜end▁of▁sentence｜>"
        "<｜User｜>c<｜Assistant｜>"
    )


def test_encode_prompts_with_a_tokenizer_drops_overlong(tmp_path):
    tok = make_char_tokenizer()
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [_row(1), _row(123456)]))
    ids, kept = encode_prompts(rows, tok, max_prompt_length=20)
    assert kept == [0]
    text = render_r1(rows[0].messages)
    np.testing.assert_array_equal(ids[0], tok.encode(text, add_special_tokens=False))
    assert tok.decode(ids[0]).replace(" ", "") == text.replace(" ", "")
    assert ids[0].dtype == np.int32 and ids[0][0] == tok.bos_token_id
    # a plain callable works too
    ids2, kept2 = encode_prompts(rows, lambda s: [ord(c) for c in s], max_prompt_length=10**6)
    assert kept2 == [0, 1] and len(ids2[1]) == len(render_r1(rows[1].messages))


def test_offline_filter_drops_all_and_none_solved(tmp_path):
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [_row(i) for i in range(20)]))
    kept = offline_filter(rows, "r1-7b", 16)
    assert [r.difficulty("r1-7b") for r in kept] == [*range(1, 16), 1, 2]
    assert offline_filter(rows, "unknown-model", 16) == rows


def test_accuracy_tracker_and_online_filter(tmp_path):
    rows = read_rows(_jsonl(tmp_path / "d.jsonl", [_row(i) for i in range(4)]))
    acc = AccuracyTracker()
    acc.record(rows[0].uid, [1, 1, 1])
    acc.record(rows[0].uid, [1])
    acc.record(rows[1].uid, [1, 0])
    acc.record(rows[2].uid, [0, 0])
    assert acc.accuracy(rows[1].uid) == 0.5 and acc.accuracy(rows[3].uid) is None
    assert acc.solved() == {rows[0].uid}
    again = AccuracyTracker.from_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert again == acc
    assert online_filter(rows, again.solved()) == rows[1:]
    acc.reset()
    assert acc.solved() == set()


def test_prompt_batches_are_random_access_and_cover_each_epoch():
    rows = read_rows(DATA / "aime24.parquet")
    ds = prompt_batches(rows, 6, seed=3)
    epoch = [r.uid for k in range(5) for r in ds[k]]
    assert sorted(epoch) == sorted(r.uid for r in rows)  # 30 rows = 5 steps
    # step k is a function of k alone: a resumed run sees the same prompts
    again = prompt_batches(rows, 6, seed=3)
    assert [r.uid for r in again[7]] == [r.uid for r in ds[7]]
    assert [r.uid for r in ds[5]] != [r.uid for r in ds[0]]  # reshuffled per epoch
    other = prompt_batches(rows, 6, seed=4)
    assert [r.uid for r in other[0]] != [r.uid for r in ds[0]]
    with pytest.raises(DataError, match="fewer than the 64"):
        prompt_batches(rows, 64, seed=0)
