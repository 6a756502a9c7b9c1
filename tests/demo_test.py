"""The README's first command: `magic-jax demo` runs every stage and exports a loadable model."""

import json

import numpy as np
from transformers import AutoModelForCausalLM

from magic_jax import cli
from magic_jax.demo import VOCAB, decode, encode


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert cli.main(["demo", "--workdir", str(tmp_path / "demo"), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "[step 1]" in out and "[export]" in out
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert [row["step"] for row in summary["history"]] == [0, 1]
    for row in summary["history"]:
        assert 0.0 <= row["reward"] <= 1.0
        assert row["entropy"] > 0
    hf = AutoModelForCausalLM.from_pretrained(summary["hf_export"])
    assert hf.config.vocab_size == len(VOCAB)


def test_demo_tokenizer_round_trip():
    ids = encode("3+4=")
    assert ids[0] == 1 and decode(ids) == "3+4="
    assert np.issubdtype(ids.dtype, np.integer)
