"""prepare-data: verl rows -> an array_record tfds dataset, read back without TensorFlow."""

import json
import subprocess
import sys
from collections.abc import Sequence

import pytest

from magic_jax.data.rows import prompt_batches
from magic_jax.data.sources import read_rows
from magic_jax.data.tfds import TfdsRows, is_tfds_dir
from magic_jax.jobs.cli import main


def _row(i, with_index=True):
    return {
        "data_source": "sums",
        "prompt": [{"role": "user", "content": f"{i}+{i}="}],
        "ability": "math",
        "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
        "extra_info": {"index": i, "model_difficulty": json.dumps({"m": i % 17})}
        if with_index
        else {},
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A Parquet file and a JSON-lines file (rows without extra_info.index: file-based uids)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("tfds")
    rows = [_row(i) for i in range(10)]
    pq.write_table(
        pa.Table.from_pylist([{**r, "extra_info": json.dumps(r["extra_info"])} for r in rows]),
        root / "a.parquet",
    )
    (root / "b.jsonl").write_text(
        "".join(json.dumps(_row(i, with_index=False)) + "\n" for i in range(10, 17))
    )
    return root, [str(root / "a.parquet"), str(root / "b.jsonl")]


@pytest.fixture(scope="module")
def prepared(sources):
    """prepare-data run in a fresh interpreter, which must never import TensorFlow."""
    root, files = sources
    out = root / "prepared"
    code = (
        "import sys\n"
        "from magic_jax.jobs.cli import main\n"
        f"assert main(['prepare-data', *{files!r}, '--out', {str(out)!r}]) == 0\n"
        "from magic_jax.data.sources import read_rows\n"
        f"assert len(read_rows({str(out)!r})) == 17\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert is_tfds_dir(out) and (out / "verl_rows" / "1.0.0").is_dir()
    return out


def test_same_rows_same_batches_as_the_parquet_path(sources, prepared):
    _, files = sources
    want = read_rows(files)
    got = read_rows(prepared)
    assert got == want  # uids (file-based ones included), messages, answers, extra_info
    lazy = TfdsRows(prepared)
    assert len(lazy) == 17 and lazy[-1] == want[-1] and lazy[3:5] == want[3:5]
    # the same grain pipeline: step k's prompts for any k (a resumed run asks for its k)
    a = prompt_batches(want, 4, seed=3)
    b = prompt_batches(lazy, 4, seed=3)
    for k in (0, 1, 4, 9, 25):
        assert [r.uid for r in a[k]] == [r.uid for r in b[k]]


class _Counting(Sequence):
    """A row sequence that records which rows were read."""

    def __init__(self, rows):
        self.rows, self.read = rows, []

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        self.read.append(i)
        return self.rows[i]


def test_two_hosts_together_see_the_one_host_batch(prepared):
    rows = TfdsRows(prepared)
    one = prompt_batches(rows, 6, seed=1)
    hosts = [_Counting(rows) for _ in range(2)]
    parts = [
        prompt_batches(h, 6, seed=1, process_index=i, process_count=2) for i, h in enumerate(hosts)
    ]
    for k in range(6):  # two epochs and more
        together = parts[0][k] + parts[1][k]
        assert [r.uid for r in together] == [r.uid for r in one[k]]
    # each host materialised only its half of each step's prompts
    assert len(hosts[0].read) == len(hosts[1].read) == 6 * 3
    with pytest.raises(ValueError, match="cannot share a batch of 6"):
        prompt_batches(rows, 6, seed=1, process_index=0, process_count=4)


def test_prepare_data_errors(sources, prepared, tmp_path, capsys):
    _, files = sources
    assert main(["prepare-data", *files, "--out", str(prepared)]) == 2
    assert "already holds a verl_rows dataset" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_row(1)) + "\n" + '{"prompt": []}\n')
    assert main(["prepare-data", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "bad.jsonl" in capsys.readouterr().err
    assert not is_tfds_dir(tmp_path / "x")
