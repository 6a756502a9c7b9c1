"""Evaluation: pass@k against its closed form, the summary table by hand, the eval command
(AIME files, resumable output, protocol check) and parity with the trainer's evaluation."""

import contextlib
import io
import json
import math
import shutil
from fractions import Fraction

import numpy as np
import pytest

from magic_jax.jobs.cli import main
from magic_jax.rollout.evaluate import ProblemResult, k_values, pass_at_k, summarize

AIME = ["tests/data/aime24.parquet", "tests/data/aime25.parquet"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from helpers import save_sums_model, sums_rows

    root = tmp_path_factory.mktemp("eval")
    save_sums_model(root / "model", seed=0)
    rows = sums_rows(6, seed=0)
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _closed_form(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_matches_the_closed_form():
    for n in (1, 2, 5, 16, 32):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_closed_form(n, c, k)), abs=1e-12)
    # large n: the binomials overflow floats, the product form does not
    assert pass_at_k(2000, 3, 1000) == pytest.approx(float(_closed_form(2000, 3, 1000)), rel=1e-9)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the mean accuracy
    assert k_values(32) == [1, 2, 4, 8, 16, 32] and k_values(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_summary_table_by_hand():
    def problem(i, rewards, lengths, truncated, statuses):
        return ProblemResult(index=i, uid=f"u{i}", data_source="s", rewards=rewards,
                             statuses=statuses, lengths=lengths, truncated=truncated)  # fmt: skip

    problems = [
        problem(0, (1.0, 1.0, 0.0, 0.0), (10, 20, 30, 40), (False,) * 4,
                ("correct", "correct", "wrong", "wrong")),
        problem(1, (0.0, 0.0, 0.0, 1.0), (5, 5, 64, 64), (False, False, True, False),
                ("wrong", "no_answer", "no_answer", "correct")),
        problem(2, (0.0,) * 4, (64, 64, 64, 64), (True,) * 4, ("no_answer",) * 4),
    ]  # fmt: skip
    t = summarize(problems)
    assert t["problems"] == 3 and t["num_samples"] == 4
    assert t["accuracy"] == pytest.approx(3 / 12)
    # per-problem accuracies 0.5, 0.25, 0: sample std 0.25, over sqrt(3)
    assert t["accuracy_stderr"] == pytest.approx(0.25 / math.sqrt(3))
    # pass@2: 1 - C(2,2)/C(4,2) = 5/6 for c = 2; 1 - C(3,2)/C(4,2) = 1/2 for c = 1; 0
    assert t["pass_at_k"] == pytest.approx({"1": 0.25, "2": (5 / 6 + 1 / 2) / 3, "4": 2 / 3})
    assert t["response_length_mean"] == pytest.approx(
        (10 + 20 + 30 + 40 + 5 + 5 + 64 + 64 + 4 * 64) / 12
    )
    assert t["response_length_max"] == 64
    assert t["truncated_fraction"] == pytest.approx(5 / 12)
    assert t["reward_status"] == {
        "correct": 3, "wrong": 3, "no_answer": 6, "timeout": 0, "error": 0
    }  # fmt: skip
    with pytest.raises(ValueError, match="same n"):
        summarize([problems[0], problem(3, (1.0,), (1,), (False,), ("correct",))])


def _eval(out, *args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["eval", *args, "--out", str(out)])
    return code, err.getvalue()


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _by_hand(problems):
    """The table of one data set recomputed from its per-problem lines."""
    samples = [s for p in problems for s in p["samples"]]
    n = problems[0]["n"]
    return {
        "accuracy": sum(s["reward"] for s in samples) / len(samples),
        "pass_at_k": {
            str(k): float(np.mean([float(_closed_form(n, p["correct"], k)) for p in problems]))
            for k in k_values(n)
        },
        "response_length_mean": float(np.mean([s["length"] for s in samples])),
        "truncated_fraction": float(np.mean([s["truncated"] for s in samples])),
        "correct": sum(s["status"] == "correct" for s in samples),
    }


@pytest.mark.heavy
def test_eval_on_the_aime_files_resumes_and_checks_its_protocol(files, tmp_path):
    opts = ["--n", "aime24=4", "--n", "2", "--limit", "5", "--max-response-length", "4",
            "--max-prompt-length", "256", "--chunk", "2", "--workers", "1",
            "--set", "rollout.max_concurrent_decodes=8",
            "--set", "rollout.decode_steps=4"]  # fmt: skip
    out = tmp_path / "out"
    code, err = _eval(out, str(files / "model"), *AIME, *opts)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"aime24", "aime25"}
    for name, n in (("aime24", 4), ("aime25", 2)):
        problems = _lines(out / f"{name}.jsonl")
        t = summary[name]
        # prompts over 256 tokens are left out and counted
        assert t["problems"] == len(problems) and t["skipped_long_prompts"] == 5 - len(problems)
        assert t["skipped_long_prompts"] > 0 and t["num_samples"] == n
        assert [len(p["samples"]) for p in problems] == [n] * len(problems)
        assert all(s["length"] <= 4 for p in problems for s in p["samples"])
        hand = _by_hand(problems)
        for key in ("accuracy", "response_length_mean", "truncated_fraction"):
            assert t[key] == pytest.approx(hand[key]), key
        assert t["pass_at_k"] == pytest.approx(hand["pass_at_k"])
        assert t["reward_status"]["correct"] == hand["correct"]
    assert "| aime24 |" in (out / "summary.md").read_text()

    # killed after the first chunk of aime25, in the middle of writing the next one
    straight = {n: (out / f"{n}.jsonl").read_bytes() for n in ("aime24", "aime25")}
    first = straight["aime25"].splitlines(keepends=True)
    assert len(first) > 2
    (out / "aime25.jsonl").write_bytes(b"".join(first[:2]) + first[2][:25])
    (out / "summary.json").unlink()
    code, err = _eval(out, str(files / "model"), *AIME, *opts)
    assert code == 0, err
    assert {n: (out / f"{n}.jsonl").read_bytes() for n in straight} == straight
    assert json.loads((out / "summary.json").read_text()) == summary

    # another protocol in the same directory is refused, naming what differs
    code, err = _eval(out, str(files / "model"), *AIME, *opts[2:], "--n", "3")
    assert code == 2 and "num_samples" in err
    assert {n: (out / f"{n}.jsonl").read_bytes() for n in straight} == straight


@pytest.mark.heavy  # 10-16 s on 2 cores
def test_eval_command_reports_what_the_trainers_evaluation_does(files, tmp_path):
    """``evaluate`` (the trainer's in-run call) and the command give one table."""
    from magic_jax.data.sources import prepare_dataset, read_rows
    from magic_jax.jobs.eval import EvalOptions, run_eval
    from magic_jax.rollout.driver import make_driver
    from magic_jax.rollout.engine_config import EngineOptions
    from magic_jax.rollout.evaluate import evaluate
    from magic_jax.rollout.sampling import SamplingConfig
    from magic_jax.run.policy import load_model_any, load_tokenizer

    engine = EngineOptions(max_concurrent_decodes=8, decode_steps=4)
    limits = {"max_prompt_length": 16, "max_response_length": 3}
    opts = EvalOptions(default_num_samples=8, chunk=100, seed=3, workers=1, engine=engine, **limits)
    data = [str(files / "sums.jsonl")]
    prepare_dataset(data, tmp_path / "sums_ar")  # the same rows as array_record
    sets = [*data, str(tmp_path / "sums_ar")]
    tables = run_eval(str(files / "model"), sets, tmp_path / "o", opts, log=lambda s: None)
    assert tables["sums_ar"] == tables["sums"]
    loaded = load_model_any(files / "model")
    driver = make_driver(loaded.model, engine, sampling=SamplingConfig(), **limits)
    params = driver.engine.load_params(loaded.model)
    tok = load_tokenizer(files / "model")
    rows = read_rows(data)
    row = evaluate(driver, params, rows, tok, num_samples=8, max_prompt_length=16, seed=3)
    table = tables["sums"]
    assert 0 < table["accuracy"] < 1  # a table worth comparing
    for key in ("accuracy", "pass_at_k", "response_length_mean", "truncated_fraction",
                "reward_status", "problems"):  # fmt: skip
        assert row[key] == table[key], key


def test_eval_errors_name_the_problem(files, tmp_path):
    code, err = _eval(tmp_path / "o", str(tmp_path), str(files / "sums.jsonl"))
    assert code == 2 and "no Hugging Face checkpoint" in err
    code, err = _eval(tmp_path / "o", str(files / "model"), str(files / "sums.jsonl"), "--n", "x=4")
    assert code == 2 and "'x'" in err
    code, err = _eval(tmp_path / "o", str(files / "model"), str(tmp_path / "none.jsonl"))
    assert code == 2 and "none.jsonl" in err


def test_eval_runs_the_shipped_model_in_bf16_with_an_int8_cache(tmp_path, capsys):
    """The command as a user types it, engine options included: the engine it builds holds
    bfloat16 weights and an int8 KV cache (read from the engine, not the options)."""
    from magic_jax.jobs.default_world import HELDOUT_FILE, MODEL_DIR

    args = ["eval", str(MODEL_DIR), str(HELDOUT_FILE), "--set", "rollout.dtype=bfloat16",
            "--set", "rollout.kv_dtype=int8", "--n", "2", "--limit", "4",
            "--max-prompt-length", "16", "--max-response-length", "64", "--workers", "1",
            "--set", "rollout.lanes=1", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "engine: bfloat16 weights, int8 KV cache, dense attention" in printed
    protocol = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert protocol["engine"] == {"dtype": "bfloat16", "kv_dtype": "int8", "decode_attention": None}
    table = json.loads((tmp_path / "o" / "summary.json").read_text())["heldout"]
    assert table["problems"] == 4 and table["accuracy"] > 0  # the shipped model adds


def test_engine_options_are_checked_naming_the_key(files, tmp_path, monkeypatch):
    model, data = str(files / "model"), str(files / "sums.jsonl")
    code, err = _eval(tmp_path / "o", model, data, "--set", "rollout.kv_dtyp=int8")
    assert code == 2 and "rollout.kv_dtyp: unknown option" in err
    code, err = _eval(tmp_path / "o", model, data, "--set", "rollout.kv_dtype=int4")
    assert code == 2 and "rollout.kv_dtype" in err and "int4" in err
    code, err = _eval(tmp_path / "o", model, data, "--set", "loss.eps_high=0.3")
    assert code == 2 and "rollout.KEY=VALUE" in err
    attention = "rollout.decode_attention=eval_test_attention"
    code, err = _eval(tmp_path / "o", model, data, "--set", attention)
    assert code == 2 and "rollout.decode_attention" in err and "eval_test_attention" in err
    # an extension module registers an attention the options may then name
    (tmp_path / "eval_test_attention.py").write_text(
        "from magic_jax.rollout.attention import register_attention\n"
        "def attend(*args, **kwargs):\n"
        "    raise NotImplementedError\n"
        "register_attention('eval_test_attention', attend)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from magic_jax.jobs.scoring_job import engine_options

    options = engine_options([attention], ["eval_test_attention"])
    assert options.decode_attention == "eval_test_attention"
    code, err = _eval(tmp_path / "o", model, data, "--extensions", "no_such_module_x")
    assert code == 2 and "no_such_module_x" in err


@pytest.mark.slow
def test_eval_of_a_run_directory_matches_the_trainers_evaluation(files, tmp_path):
    """A real run: its step-0 evaluation equals the command's on the base model, and the
    command reads the run's newest checkpoint; the run's event files load in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from magic_jax.run.config import load_config
    from magic_jax.run.trainer import Trainer

    raw = {
        "model": str(files / "model"),
        "output_dir": str(tmp_path / "run"),
        "seed": 5,
        "data": {"train": [str(files / "sums.jsonl")], "max_prompt_length": 16},
        "stages": [
            {
                "steps": 1,
                "max_response_length": 3,
                "prompts_per_step": 4,
                "mini_batch_groups": 4,
                "group_size": 4,
            }
        ],
        "rollout": {"max_concurrent_decodes": 8, "decode_steps": 4},
        "rewards": {"num_workers": 1},
        "eval": {"data": [str(files / "sums.jsonl")], "every": 1, "num_samples": 8},
    }
    Trainer(load_config(raw=raw), log=lambda s: None).run()
    step0 = _lines(tmp_path / "run" / "eval.jsonl")[0]
    common = ["--n", "8", "--max-response-length", "3", "--max-prompt-length", "16",
              "--chunk", "100", "--seed", "5", "--workers", "1",
              "--set", "rollout.max_concurrent_decodes=8",
              "--set", "rollout.decode_steps=4"]  # fmt: skip
    code, err = _eval(tmp_path / "base", str(files / "model"), str(files / "sums.jsonl"), *common)
    assert code == 0, err
    table = json.loads((tmp_path / "base" / "summary.json").read_text())["sums"]
    for key in ("accuracy", "pass_at_k", "response_length_mean", "truncated_fraction"):
        assert step0[key] == table[key], key
    code, err = _eval(tmp_path / "ckpt", str(tmp_path / "run"), str(files / "sums.jsonl"), *common)
    assert code == 0, err
    protocol = json.loads((tmp_path / "ckpt" / "eval.json").read_text())
    assert protocol["step"] == 1 and protocol["checkpoint"].endswith("step_00000001")
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/reward")] == [0]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 1]
    shutil.rmtree(tmp_path / "run")


def test_eval_on_a_multi_host_job_without_a_mesh_is_refused_in_one_line(files, tmp_path, capsys,
                                                                         monkeypatch):  # fmt: skip
    # process 1 of 2 (as launch.sh starts it on a 2-host slice) with no --mesh: every host
    # would evaluate everything on one chip and write the same --out
    monkeypatch.setenv("MAGIC_JAX_COORDINATOR", "10.0.0.2:8476")
    monkeypatch.setenv("MAGIC_JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("MAGIC_JAX_PROCESS_ID", "1")
    code = main(["eval", str(files / "model"), str(files / "sums.jsonl"), "--out",
                 str(tmp_path / "out")])  # fmt: skip
    assert code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err.strip() == (
        "magic-jax eval: error: this is one process of a multi-host job (MAGIC_JAX_COORDINATOR): "
        "pass --mesh over all its devices (e.g. --mesh fsdp=-1) so that the hosts score "
        "together and process 0 alone writes --out"
    )
