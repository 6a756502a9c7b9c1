"""The lock-out world: its task (a full carry chain or no carry, nothing after the answer),
the lock-out probe against an independent teacher-forced computation, its config and
its shipped base."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from magic_jax.data.tasks import carry, lockout
from magic_jax.rewards import math_reward

REPO = Path(__file__).resolve().parents[1]


def _length(tok, text):
    return len(tok.encode(text, add_special_tokens=False))


def test_half_the_problems_need_every_column_checked_and_half_none():
    rng = np.random.default_rng(0)
    problems = lockout.LockoutTask().problems(400, rng)
    chains = [p for p in problems if lockout.is_chain(*p)]
    assert all(lockout.is_plain(*p) for p in problems if not lockout.is_chain(*p))
    assert 0.4 < len(chains) / len(problems) < 0.6
    for a, b in problems:
        assert 1000 <= a < 10000 and 1000 <= b < 10000
        chain = lockout.is_chain(a, b)
        for checks in itertools.product((False, True), repeat=lockout.DIGITS):
            text = lockout.solution(a, b, list(checks))
            right = math_reward(text, str(a + b)).reward == 1.0
            # a chain is right only with every column checked; a problem with no carry always
            assert right == (all(checks) or not chain), (a, b, checks)
            assert carry.read_checks(text) == list(checks)
    with pytest.raises(ValueError, match="chain_share"):
        lockout.LockoutTask(chain_share=1.5)


def test_the_answer_ends_the_response_and_the_stage_limits_split_the_strategies():
    tok = lockout.tokenizer()
    unk = tok.convert_tokens_to_ids("<unk>")
    rng = np.random.default_rng(1)
    hurried, checked = [], []
    for a, b in lockout.LockoutTask().problems(300, rng):
        for checks in itertools.product((False, True), repeat=lockout.DIGITS):
            text = lockout.solution(a, b, list(checks))
            ids = tok.encode(text, add_special_tokens=False)
            assert unk not in ids
            # the stop character is the response's last and only closing brace
            assert text.index(lockout.STOP) == len(text) - 1
            (checked if any(checks) else hurried).append(len(ids))
    assert min(hurried) >= 20 and max(hurried) == 22
    # stage 1 fits every hurried response and no response with a checked line
    assert max(hurried) <= lockout.STAGE1_T < min(checked)
    assert max(checked) == lockout.LONGEST <= lockout.STAGE2_T
    # the full check of a chain is the probe's target; a problem with no carry has none
    (a, b), row = (5678, 4567), lockout.verl_rows(1, seed=0)[0]
    lines = "8+7=15\n7+6+1=14\n6+5+1=12\n5+4+1=10\n"
    assert lockout.full_check(a, b) == lines + "</think>\n\\boxed{10245}"
    assert _length(tok, lockout.full_check(a, b)) == lockout.LONGEST
    chain = lockout.is_chain(*lockout.row_problem(row))
    assert (lockout.probe_target(row) is not None) == chain == row["extra_info"]["chain"]
    assert row["data_source"] == ("lockout-chain" if chain else "lockout-plain")


def _tiny_policy(seed=0):
    from flax import nnx

    from magic_jax.model.config import ModelConfig
    from magic_jax.model.qwen2 import Qwen2

    tok = lockout.tokenizer()
    eos = (tok.eos_token_id, tok.convert_tokens_to_ids(lockout.STOP))
    cfg = ModelConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e4,
    )
    model = Qwen2(cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    return tok, model, graphdef, params


def _reference_logp(forward, prompt, response, temperature):
    """sum log p(response | prompt): one unpadded forward per pair, log-softmax in numpy."""
    ids = np.concatenate([prompt, response]).astype(np.int32)[None]
    logits = np.asarray(forward(ids), np.float64)[0] / temperature
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    n = len(prompt)
    return sum(logits[n + j - 1, t] - logz[n + j - 1] for j, t in enumerate(response))


def test_lockout_probe_is_the_exact_probability_of_the_full_check():
    import jax

    from magic_jax.data.rows import parse_row, tokenize_rows
    from magic_jax.rollout.probes import ProbeContext, get_probe, sequence_logprobs

    tok, model, graphdef, params = _tiny_policy()
    forward = jax.jit(lambda ids: model(ids))  # the logits of one unpadded sequence
    rows = lockout.verl_rows(10, seed=3)
    parsed = [parse_row(r, "t", f"h{i}") for i, r in enumerate(rows)]
    parsed, _ = tokenize_rows(parsed, tok, max_prompt_length=16)
    eos = model.config.eos_ids
    for temperature in (1.0, 0.7):
        ctx = ProbeContext(
            graphdef=graphdef,
            params=params,
            rows=parsed,
            tokenizer=tok,
            eos_ids=eos,
            temperature=temperature,
            samples_per_step=128,
        )
        got = get_probe("lockout")(ctx)
        chains = [r for r in parsed if lockout.is_chain(*lockout.row_problem(r.as_verl_row()))]
        want = [
            _reference_logp(
                forward,
                r.token_ids,
                tok.encode(lockout.full_check(*lockout.row_problem(r.as_verl_row()))),
                temperature,
            )
            for r in chains
        ]
        assert got["problems"] == len(chains) > 0
        np.testing.assert_allclose(got["log10_p_mean"], np.mean(want) / np.log(10), rtol=1e-4)
        np.testing.assert_allclose(got["p_mean"], np.mean(np.exp(want)), rtol=1e-3)
        share = len(chains) / len(parsed)
        assert got["chain_share"] == share
        np.testing.assert_allclose(got["expected_per_step"], 128 * share * got["p_mean"])
    # mixed lengths in one padded batch, and a response without a stop token gets an EOS
    prompts = [parsed[0].token_ids, parsed[1].token_ids[:5]]
    responses = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    got = sequence_logprobs(graphdef, params, prompts, responses, temperature=1.0)
    want = [_reference_logp(forward, p, r, 1.0) for p, r in zip(prompts, responses)]
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_probes_are_registered_by_name_and_eval_probe_is_checked():
    from magic_jax.rollout import probes
    from magic_jax.run.config import ConfigError, load_config

    assert "lockout" in probes.probe_names()
    with pytest.raises(ValueError, match="unknown probe 'nope'; registered: lockout"):
        probes.get_probe("nope")
    with pytest.raises(ValueError, match="built in"):
        probes.register_probe("lockout", lambda ctx: {})

    def mine(ctx):
        return {"rows": len(ctx.rows)}

    probes.register_probe("test-rows", mine)
    assert probes.get_probe("test-rows") is mine
    with pytest.raises(ValueError, match="already registered"):
        probes.register_probe("test-rows", lambda ctx: {})
    # no chain among the rows: nothing to probe, NaN figures
    tok, _, graphdef, params = _tiny_policy()
    from magic_jax.data.rows import parse_row, tokenize_rows

    plain = [r for r in lockout.verl_rows(8, seed=0) if not r["extra_info"]["chain"]][:2]
    parsed, _ = tokenize_rows([parse_row(r, "t", "p") for r in plain], tok, max_prompt_length=16)
    ctx = probes.ProbeContext(
        graphdef=graphdef, params=params, rows=parsed, tokenizer=tok, eos_ids=(2,)
    )
    got = probes.lockout_probe(ctx)
    assert got["problems"] == 0 and np.isnan(got["p_mean"])
    cfg = load_config(REPO / "configs/lockout.yaml")
    assert cfg.eval.probe == "lockout"
    with pytest.raises(ConfigError, match="unknown probe"):
        load_config(REPO / "configs/lockout.yaml", ["eval.probe=nope"])


def test_the_config_runs_the_world_as_designed():
    from magic_jax.run.config import load_config

    cfg = load_config(REPO / "configs/lockout.yaml")
    assert [s.max_response_length for s in cfg.stages] == [lockout.STAGE1_T, lockout.STAGE2_T]
    assert cfg.eval.max_response_length == lockout.STAGE2_T
    shipped = REPO / "magic_jax/assets/lockout/lockout.yaml"
    assert shipped.read_text() == (REPO / "configs/lockout.yaml").read_text()


@pytest.mark.slow  # ~10 s: a 2-step build and its statistics (engine compilation)
def test_the_world_builder_makes_the_stop_character_an_end_of_sequence(tmp_path):
    from magic_jax.jobs.lockout_world import LOCKOUT, LockoutBuildConfig
    from magic_jax.jobs.worlds import build_world

    config = LockoutBuildConfig(
        sft_steps=2, eval_every=2, train_problems=8, heldout_problems=8, eval_problems=2
    )
    info = build_world(LOCKOUT, tmp_path, config, log=lambda s: None)
    hf = json.loads((tmp_path / "model" / "config.json").read_text())
    tok = lockout.tokenizer()
    assert hf["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("}")]
    st = info["statistics"]
    assert st["samples"] == 64 and 0 < st["probe"]["p_mean"] < 1
    rows = [json.loads(x) for x in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert st["probe"]["problems"] == sum(r["extra_info"]["chain"] for r in rows)
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert not {lockout.row_problem(r) for r in rows} & {lockout.row_problem(r) for r in train}


def test_the_central_claims_arms_are_runs_of_the_world_of_equal_length(tmp_path):
    from magic_jax.experiments import arms
    from magic_jax.experiments.ablations import overrides_for
    from magic_jax.experiments.results import train_config
    from magic_jax.run.config import ConfigError, load_config

    ab = arms.LOCKOUT_CENTRAL
    assert ab.world == "lockout" and ab.seeds == tuple(range(8))
    cfgs = {}
    for arm in ab.arms:
        sets = [*overrides_for(arm, 3, world="lockout"), f"output_dir={tmp_path}"]
        if arm.key == "lockout-fixed-mean" and arms.LOCKOUT_FIXED_ALPHA is None:
            # its coefficient comes from the adaptive arm's runs: it cannot run before
            with pytest.raises(ConfigError, match="init_coef"):
                load_config(train_config("lockout"), sets)
            continue
        cfgs[arm.key] = cfg = load_config(train_config("lockout"), sets)
        assert cfg.total_steps == 300 and cfg.seed == 3 and cfg.eval.probe == "lockout"
    assert (cfgs["lockout-adaptive"].entropy.mode, cfgs["lockout-none"].entropy.init_coef) == (
        "adaptive",
        0.0,
    )
    assert [s.max_response_length for s in cfgs["lockout-long-T"].stages] == [lockout.STAGE2_T]
    assert [s.max_response_length for s in cfgs["lockout-none"].stages] == [23, 52]


def test_the_shipped_base_stops_at_the_answer_and_its_build_measured_the_probe():
    from magic_jax.jobs.lockout_world import LOCKOUT_ASSETS, LOCKOUT_BUILD

    tok = lockout.tokenizer()
    hf = json.loads((LOCKOUT_ASSETS / "model" / "config.json").read_text())
    assert hf["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids(lockout.STOP)]
    build = json.loads(LOCKOUT_BUILD.read_text())
    st = build["statistics"]
    assert st["samples"] == 8 * build["build"]["heldout_problems"]
    assert 0 < st["probe"]["p_mean"] < 1 and st["probe"]["problems"] > 100
    rows = [json.loads(x) for x in (LOCKOUT_ASSETS / "heldout.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (LOCKOUT_ASSETS / "train.jsonl").read_text().splitlines()]
    assert not {lockout.row_problem(r) for r in rows} & {lockout.row_problem(r) for r in train}


@pytest.mark.slow  # ~20 s: 4 steps of configs/lockout.yaml on the shipped base
def test_a_lockout_run_records_the_probe_at_every_evaluation(tmp_path):
    from magic_jax.run.config import load_config
    from magic_jax.run.trainer import Trainer

    sets = ["stages.0.steps=2", "stages.1.steps=2", "eval.every=2", "export_hf=false"]
    cfg = load_config(REPO / "configs/lockout.yaml", [*sets, f"output_dir={tmp_path}"])
    Trainer(cfg).run()
    evals = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4]
    for e in evals:
        p = e["probe"]
        assert p["problems"] > 100 and 0 < p["p_mean"] < 1
        assert p["expected_per_step"] == pytest.approx(16 * 8 * p["chain_share"] * p["p_mean"])
        assert set(e["by_source"]) == {"heldout-chain", "heldout-plain"}


def test_token_classes_split_choices_digits_format_and_text_after_the_answer():
    from magic_jax.data.tasks import carry

    tok = lockout.tokenizer()

    def classes(text):
        pieces = [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]
        return "".join(c[0] for c in carry.token_classes(pieces))

    # "8+7=15\n" checks: the line's first digit is the choice; "5\n" hurries
    assert classes("8+7=15\n5\n</think>\n\\boxed{55}") == "cfdfddfcfff" + "ffffff" + "f" + "ddf"
    assert classes("5\n</think>\n\\boxed{5} ok 7") == "cfff" + "ffffff" + "f" + "df" + "aaaaa"
    assert classes("8+7=1") == "cfdfd"  # truncated: as far as it goes
    assert carry.token_classes([]) == []


def test_lockout_probe_measures_the_evaluations_own_samples(monkeypatch):
    from magic_jax.data.rows import parse_row, tokenize_rows
    from magic_jax.data.tasks import carry
    from magic_jax.jobs.worlds import world_driver
    from magic_jax.rollout import probes
    from magic_jax.rollout.evaluate import evaluate

    tok, model, graphdef, params = _tiny_policy(seed=1)
    rows = lockout.verl_rows(6, seed=5)
    parsed, _ = tokenize_rows(
        [parse_row(r, "t", f"h{i}") for i, r in enumerate(rows)], tok, max_prompt_length=16
    )
    driver = world_driver(model, 1.0, lockout.STAGE2_T)
    dparams = driver.load_params(params)
    kw = dict(graphdef=graphdef, params=params, rows=parsed, tokenizer=tok,
              eos_ids=model.config.eos_ids, driver=driver, driver_params=dparams,
              num_samples=4, seed=2, step=3)  # fmt: skip
    got = probes.lockout_probe(probes.ProbeContext(**kw))["sampled"]
    # the evaluation's own samples: the same keys give the same accuracy per half
    ev = evaluate(driver, dparams, parsed, tok, num_samples=4, max_prompt_length=16, seed=2,
                  step=3)  # fmt: skip
    assert sorted(ev["by_source"]) == ["lockout-chain", "lockout-plain"]
    for half in ("chain", "plain"):
        assert got[f"pass_at_k_{half}"]["1"] == pytest.approx(ev["by_source"][f"lockout-{half}"])
    assert got["samples"] == 24 and len(got["examples"]) <= 2 * probes.EXAMPLES
    n_tokens = sum(got["tokens_by_class"].values())
    assert n_tokens > 0 and len(got["entropy_by_position"]) <= lockout.STAGE2_T
    mean_by_class = sum(
        got["entropy_by_class"][c] * k for c, k in got["tokens_by_class"].items() if k
    )
    by_pos = got["entropy_by_position"]
    assert np.isfinite(mean_by_class) and all(np.isfinite(by_pos))
    assert set(got["entropy_by_class"]) == set(carry.TOKEN_CLASSES)
    assert list(got["pass_at_k_chain"]) == ["1", "2", "4"]
    assert 0 <= got["pass_at_k_chain"]["1"] <= got["pass_at_k_chain"]["4"] <= 1
    # the last evaluation draws FINAL_SAMPLES per problem: pass@k up to it
    monkeypatch.setattr(probes, "FINAL_SAMPLES", 8)
    last = probes.lockout_probe(probes.ProbeContext(**kw, final=True))["sampled"]
    assert last["samples"] == 48 and list(last["pass_at_k_plain"]) == ["1", "2", "4", "8"]
    # without a driver the probe only teacher-forces
    assert "sampled" not in probes.lockout_probe(probes.ProbeContext(**{**kw, "driver": None}))


def test_the_fixed_mean_arms_alpha_is_the_adaptive_arms_mean_over_its_8_seeds():
    """The pre-registered rule (notebooks/prereg/central-lockout.yaml): the mean alpha over
    every training step of the adaptive arm's 8 seeds, to 2 significant figures, set only
    once all 8 are committed."""
    from magic_jax.experiments import arms
    from magic_jax.jobs.report import load_run

    done = sorted((REPO / "notebooks/results/runs/lockout-adaptive").glob("seed*/run.json"))
    if len(done) < len(arms.SEEDS_LOCKOUT):
        assert arms.LOCKOUT_FIXED_ALPHA is None
        return
    alphas = [m["alpha"] for p in done for m in load_run(p.parent).metrics]
    assert len(alphas) == 8 * 300
    assert float(f"{np.mean(alphas):.2g}") == arms.LOCKOUT_FIXED_ALPHA
