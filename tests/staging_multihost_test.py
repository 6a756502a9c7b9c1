"""A model converted once onto the bucket, read per host: 2 processes x 4 CPU devices.

``magic-jax convert`` stages a tiny random Qwen2 (with the sums tokenizer) on the Cloud
Storage emulator; ``magic-jax train`` with ``model=gs://...`` then runs on two processes
over a (fsdp 4, tensor 2) mesh, which splits every parameter's ``embed`` axis between
the processes. Each process counts what TensorStore fetched from the bucket
(tests/staging_worker.py); the run's records equal those of the same two-process run
from the local Hugging Face directory.
"""

import json
import os
import sys

import pytest
from conftest import GcsEmulator
from multihost_test import HERE, _records, free_port, launch

WORKER = HERE / "staging_worker.py"
# Chunks of 2 MiB: each [2, 1024, 1024] array is stored as 2 x 2 chunks, halved along
# its embed axis as the processes split it. (orbax merges reads less than 1 MB apart into
# one: chunks much smaller than that would be read with their neighbours.)
CHUNK_MB = 2


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    """A random Qwen2 of 50 MB (d 1024, F 1024, 2 layers) with the sums tokenizer, the
    sums prompts, and a one-step run of it on a (fsdp 4, tensor 2) mesh."""
    import yaml
    from conftest import write_sums_run
    from helpers import SUMS_CHARS, make_char_tokenizer

    from magic_jax.testing import make_hf_model, save_hf_model

    root = write_sums_run(tmp_path_factory.mktemp("staging"))
    tok = make_char_tokenizer(chars=SUMS_CHARS)
    hf = make_hf_model(seed=3, vocab_size=len(tok), hidden_size=1024, intermediate_size=1024,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                       tie_word_embeddings=True)  # fmt: skip
    tok.save_pretrained(save_hf_model(hf, root / "wide"))
    raw = {
        "model": str(root / "wide"),
        "data": {"train": [str(root / "train.jsonl")], "max_prompt_length": 16},
        "stages": [{"steps": 1, "max_response_length": 3, "prompts_per_step": 4,
                    "mini_batch_groups": 2, "group_size": 8}],
        "mesh": {"fsdp": 4, "tensor": 2},
        "rollout": {"max_concurrent_decodes": 32, "decode_steps": 8},
        "optimizer": {"learning_rate": 1e-2, "eps": 1e-4},
        "entropy": {"target": 5.0, "delta": 0.01},
        "rewards": {"num_workers": 1},
        "export_dtype": "float32",
    }  # fmt: skip
    (root / "run.yaml").write_text(yaml.safe_dump(raw))
    return root


def _train(root, out, port, metrics, *more):
    """argv_of for ``launch``: process i of ``magic-jax train`` on 2 processes, through the
    worker that records process i's reads in ``metrics``-i.json."""

    def argv(i):
        env = [f"MAGIC_JAX_COORDINATOR=localhost:{port}", "MAGIC_JAX_NUM_PROCESSES=2",
               f"MAGIC_JAX_PROCESS_ID={i}"]  # fmt: skip
        return ["env", *env, sys.executable, str(WORKER), f"{metrics}-{i}.json", "train",
                str(root / "run.yaml"), "--set", f"output_dir={out}", *more]  # fmt: skip

    return argv


@pytest.mark.slow  # ~2 min: two two-process runs
def test_each_host_reads_its_own_shards_of_a_converted_model(run_files, tmp_path, monkeypatch):
    from magic_jax import storage
    from magic_jax.jobs import cli

    emulator = GcsEmulator(tmp_path / "emulator.log")
    try:
        for k, v in emulator.env.items():
            monkeypatch.setenv(k, v)
        model = emulator.uri("models/wide")
        assert cli.main(["convert", str(run_files / "wide"), model,
                         "--chunk-mb", str(CHUNK_MB)]) == 0  # fmt: skip
        stored = storage.listing(model)
        total = sum(v["size"] for k, v in stored.items() if k.startswith("state/"))
        params = json.loads(storage.path(model + "/source.json").read_text())["parameters"]
        assert params * 4 * 0.9 < total < params * 4 * 1.1, (params, total)  # fp32, stored

        cache = tmp_path / "gcs_cache"
        env = dict(os.environ, MAGIC_JAX_COMPILATION_CACHE=str(tmp_path / "jax_cache"),
                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                   **{storage.CACHE_ENV: str(cache)})  # fmt: skip
        local, staged = tmp_path / "local", tmp_path / "staged"
        launch(_train(run_files, local, free_port(), tmp_path / "local"), 2, 4, env=env)
        launch(_train(run_files, staged, free_port(), tmp_path / "staged", "--set",
                      f"model={model}"), 2, 4, env=env)  # fmt: skip

        # (a) each process fetched about its half of the stored arrays, and no process
        # holds a local copy of them (the tokenizer's few files are copied, nothing more)
        got = [json.loads((tmp_path / f"staged-{i}.json").read_text()) for i in range(2)]
        share = [g["bytes_read"] / total for g in got]
        print(f"stored arrays {total} B; read per process {[g['bytes_read'] for g in got]} B "
              f"({', '.join(f'{s:.2f}' for s in share)} of the total) in "
              f"{[g['read'] for g in got]} reads")  # fmt: skip
        assert all(0.45 < s < 0.6 for s in share), share
        assert not [p for p in cache.rglob("*") if "state" in p.parts]
        assert (cache / emulator.BUCKET).is_dir()  # the tokenizer did come from the bucket
        # the run from the local directory read nothing from the bucket
        assert all(
            json.loads((tmp_path / f"local-{i}.json").read_text()).get("bytes_read", 0) == 0
            for i in range(2)
        )
        # (b) the same run: equal records
        want, have = _records(local), _records(staged)
        assert [r["step"] for r in have] == [0] and want[0]["sgd_steps"] > 0
        assert have == want
    finally:
        emulator.stop()
