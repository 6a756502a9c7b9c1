"""The decision world: its task (one decision token per line, stage limits that split the
strategies), its token classes, the decision probe against a numpy forward of a tiny
Qwen2, its build and the pilot harness."""

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from magic_jax.data.tasks import carry, decision
from magic_jax.rewards import math_reward


@pytest.mark.parametrize("digits", [2, 3, 4])
def test_every_line_opens_with_a_decision_and_only_a_chain_needs_them_all(digits):
    tok = decision.tokenizer()
    unk = tok.convert_tokens_to_ids("<unk>")
    task = decision.DecisionTask(digits=digits)
    skipped, checked, full = [], [], []
    for a, b in task.problems(300, np.random.default_rng(digits)):
        assert 10 ** (digits - 1) <= min(a, b) and max(a, b) < 10**digits
        chain = decision.is_chain(a, b)
        assert chain or decision.is_plain(a, b)
        for checks in itertools.product((False, True), repeat=digits):
            text = decision.solution(a, b, list(checks))
            right = math_reward(text, str(a + b)).reward == 1.0
            assert right == (all(checks) or not chain), (a, b, checks)
            assert decision.read_decisions(text) == list(checks)
            ids = tok.encode(text, add_special_tokens=False)
            assert unk not in ids and len(ids) == decision.response_tokens(text)
            # one decision token per line, the line's first token
            pieces = [tok.decode([i]) for i in ids]
            starts = [0, *[j + 1 for j, p in enumerate(pieces) if p == "\n"][: digits - 1]]
            assert [pieces[j] for j in starts] == [
                decision.CHECK if c else decision.SKIP for c in checks
            ]
            assert text.index(decision.STOP) == len(text) - 1
            (checked if any(checks) else skipped).append(len(ids))
            if chain and all(checks):
                full.append(len(ids))
    # stage 1 fits every all-skip response and no response with a checked line
    assert max(skipped) == decision.stage1_limit(digits) < min(checked)
    assert max(full) == max(checked) == decision.stage2_limit(digits)  # stage 2 fits all


def test_the_task_and_its_limits_reject_bad_settings_by_name():
    for kw, name in (
        ({"digits": 5}, "digits"),
        ({"digits": 1}, "digits"),
        ({"chain_share": 0.0}, "chain_share"),
        ({"chain_share": 1.2}, "chain_share"),
        ({"check_rate": 1.0}, "check_rate"),
        ({"check_rate": 0.0}, "check_rate"),
    ):
        with pytest.raises(ValueError, match=name):
            decision.DecisionTask(**kw)
    with pytest.raises(ValueError, match="digits"):
        decision.stage1_limit(6)
    rows = decision.verl_rows(40, seed=0, task=decision.DecisionTask(chain_share=1.0))
    assert all(r["extra_info"]["chain"] and r["data_source"] == "decision-chain" for r in rows)
    assert decision.read_decisions("5\n</think>\n\\boxed{5}") is None  # a line without one
    assert decision.read_decisions("<check>5+") is None  # truncated


def test_token_classes_put_the_decision_tokens_in_a_class_of_their_own():
    from magic_jax.update.token_classes import TokenMask, parse_token_selection

    tok = decision.tokenizer()
    text = decision.solution(5678, 4567, [True, False, True, True]) + "junk"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    classes = decision.token_classes(pieces)
    assert [p for p, c in zip(pieces, classes) if c == "decision"] == [
        "<check>",
        "<skip>",
        "<check>",
        "<check>",
    ]
    assert pieces[1] == "8" and classes[1] == "digit"  # a line's first digit does not choose
    end = pieces.index("}")
    assert set(classes[end + 1 :]) == {"after_answer"} and classes[end] == "format"
    assert set(classes) == set(decision.TOKEN_CLASSES)
    assert parse_token_selection("decision:decision") == ("decision", frozenset({"decision"}))
    mask = TokenMask("decision:decision", tok.decode)(ids)
    assert mask.sum() == 4 and all(mask[i] == (classes[i] == "decision") for i in range(len(ids)))
    with pytest.raises(ValueError, match="unknown class 'choice' of token classifier 'decision'"):
        parse_token_selection("decision:choice")
    # in the carry task's classes a decision token is not a choice
    assert "choice" not in [
        c for p, c in zip(pieces, carry.token_classes(pieces)) if p in decision.DECISIONS
    ]


def _tiny_policy(seed=0):
    from flax import nnx

    from magic_jax.model.config import ModelConfig
    from magic_jax.model.qwen2 import Qwen2

    tok = decision.tokenizer()
    cfg = ModelConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=(tok.eos_token_id, tok.convert_tokens_to_ids(decision.STOP)),
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


def _numpy_logits(w, cfg, ids):
    """[L, V] float64 logits of one unpadded sequence: Qwen2 written out in numpy from its
    Hugging Face tensors (RMSNorm, half-split rotary, grouped-query causal attention with
    q/k/v biases, SwiGLU, tied output embedding)."""

    def rms(x, g):
        return g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)

    def rope(x):  # [L, heads, H]
        h = x.shape[-1]
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, h, 2) / h)
        ang = np.arange(x.shape[0])[:, None, None] * inv
        x1, x2 = x[..., : h // 2], x[..., h // 2 :]
        return np.concatenate(
            [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1
        )

    n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    hd = d // n
    length = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((length, length), bool))
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        h = rms(x, w[pre + "input_layernorm.weight"])

        def proj(name, h=h, pre=pre):
            return h @ w[pre + f"self_attn.{name}.weight"].T + w[pre + f"self_attn.{name}.bias"]

        q = rope(proj("q_proj").reshape(length, n, hd))
        kk = rope(proj("k_proj").reshape(length, k, hd))
        v = proj("v_proj").reshape(length, k, hd)
        group = n // k
        heads = []
        for j in range(n):
            s = q[:, j] @ kk[:, j // group].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            heads.append((a / a.sum(-1, keepdims=True)) @ v[:, j // group])
        x = x + np.concatenate(heads, -1) @ w[pre + "self_attn.o_proj.weight"].T
        h = rms(x, w[pre + "post_attention_layernorm.weight"])
        gate = h @ w[pre + "mlp.gate_proj.weight"].T
        up = h @ w[pre + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[pre + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


def test_decision_probe_is_the_exact_probability_of_check_by_a_numpy_forward(tmp_path):
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from magic_jax.data.rows import parse_row, tokenize_rows
    from magic_jax.model.convert import save_hf
    from magic_jax.rollout.probes import ProbeContext, get_probe

    tok, model, graphdef, params = _tiny_policy()
    save_hf(model, tmp_path, dtype=jnp.float32)
    w = {k: v.astype(np.float64) for k, v in load_file(tmp_path / "model.safetensors").items()}
    rows = decision.verl_rows(6, seed=3)
    parsed = [parse_row(r, "t", f"h{i}") for i, r in enumerate(rows)]
    parsed, _ = tokenize_rows(parsed, tok, max_prompt_length=16)
    check = tok.convert_tokens_to_ids(decision.CHECK)
    for temperature in (1.0, 0.7):
        ctx = ProbeContext(
            graphdef=graphdef,
            params=params,
            rows=parsed,
            tokenizer=tok,
            eos_ids=model.config.eos_ids,
            temperature=temperature,
            samples_per_step=128,
        )
        got = get_probe("decision")(ctx)
        per_line, whole = [], []
        for r in parsed:
            ab = decision.row_problem(r.as_verl_row())
            if not decision.is_chain(*ab):
                continue
            resp = tok.encode(decision.full_check(*ab), add_special_tokens=False)
            assert resp[-1] in model.config.eos_ids  # "}" ends the response as sampled
            ids = np.asarray([*r.token_ids, *resp])
            logits = _numpy_logits(w, model.config, ids) / temperature
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            n = len(r.token_ids)
            steps = [logp[n + j - 1, t] for j, t in enumerate(resp)]
            per_line.append([np.exp(steps[j]) for j, t in enumerate(resp) if t == check])
            whole.append(np.exp(sum(steps)))
        per_line = np.asarray(per_line)
        assert per_line.shape == (got["problems"], decision.DIGITS) and got["problems"] > 0
        full = per_line.prod(axis=1)
        np.testing.assert_allclose(got["p_mean"], full.mean(), rtol=1e-4)
        np.testing.assert_allclose(got["p_min"], full.min(), rtol=1e-4)
        np.testing.assert_allclose(got["log10_p_mean"], np.log10(full).mean(), rtol=1e-4)
        np.testing.assert_allclose(got["p_check_first"], per_line[:, 0].mean(), rtol=1e-4)
        np.testing.assert_allclose(got["p_check_line"], per_line.mean(), rtol=1e-4)
        np.testing.assert_allclose(got["p_sequence_mean"], np.mean(whole), rtol=1e-3)
        share = got["problems"] / len(parsed)
        assert got["chain_share"] == share
        np.testing.assert_allclose(got["expected_per_step"], 128 * share * got["p_mean"])
    # no chain: NaN figures; a tokenizer without the decision tokens: a clear error
    plain = [r for r in parsed if not decision.is_chain(*decision.row_problem(r.as_verl_row()))]
    got = get_probe("decision")(
        ProbeContext(graphdef=graphdef, params=params, rows=plain, tokenizer=tok, eos_ids=(2,))
    )
    assert got["problems"] == 0 and np.isnan(got["p_mean"])
    with pytest.raises(ValueError, match="not one token"):
        get_probe("decision")(
            ProbeContext(
                graphdef=graphdef,
                params=params,
                rows=parsed,
                tokenizer=carry.tokenizer(),
                eos_ids=(2,),
            )
        )


def _fake_base(path, digits=decision.DIGITS):
    """A base directory whose build is recorded (the pilot does not build it again)."""
    path.mkdir(parents=True)
    (path / "model").mkdir()
    (path / "build.json").write_text("{}\n")
    for name, seed in (("train", 1), ("heldout", 2)):
        rows = decision.verl_rows(20, seed, decision.DecisionTask(digits=digits))
        (path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_pilot_records_p_at_stage_1_end_per_arm_and_whether_stage_2_learned(tmp_path):
    from magic_jax.jobs.decision_pilots import Pilot, PilotArm, run_pilot

    pilot = Pilot(
        name="tiny",
        seeds=(0, 1),
        stage1_steps=4,
        stage2_steps=2,
        eval_every=2,
        arms=(
            PilotArm(name="none", overrides=("entropy.mode=fixed", "entropy.init_coef=0.0")),
            PilotArm(name="held", overrides=("entropy.tokens=decision:decision",)),
        ),
    )
    _fake_base(tmp_path / "base")
    trained = []

    def train(cfg):  # stands in for a run: its evaluations as the trainer writes them
        held = cfg.entropy.tokens == "decision:decision"
        trained.append((held, cfg.seed, [s.max_response_length for s in cfg.stages]))
        p = {0: 0.06, 2: 0.02, 4: (0.03 if held else 1e-6) * (1 + cfg.seed), 6: 0.1}
        acc = {6: 0.6 if held else 0.0 + 0.1 * cfg.seed}
        lines = [
            {
                "step": s,
                "probe": {"p_mean": v, "expected_per_step": 64 * v},
                "by_source": {"heldout-chain": acc.get(s, 0.0), "heldout-plain": 1.0},
            }
            for s, v in p.items()
        ]
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    got = run_pilot(pilot, tmp_path, log=lambda s: None, train=train)
    limits = [decision.stage1_limit(), decision.stage2_limit()]
    assert trained == [(False, 0, limits), (False, 1, limits), (True, 0, limits), (True, 1, limits)]
    runs = {(r["arm"], r["seed"]): r for r in got["runs"]}
    assert runs["none", 1]["p_stage1_end"] == 2e-6 and runs["none", 1]["locked_out"]
    assert runs["held", 1]["p_stage1_end"] == 0.06 and runs["held", 1]["learnable"]
    assert runs["held", 0]["learned"] and not runs["none", 1]["learned"]
    assert runs["none", 0]["p_by_step"] == {"0": 0.06, "2": 0.02, "4": 1e-6, "6": 0.1}
    summary = {s["arm"]: s for s in got["summary"]}
    assert summary["none"]["locked_out"] == 2 and summary["none"]["learned"] == 0
    assert summary["held"]["p_stage1_end_median"] == pytest.approx(0.045)
    assert summary["held"]["learnable"] == 2 and summary["held"]["learned"] == 2
    table = (tmp_path / "pilots.md").read_text()
    assert "| held | 2 | 0.045 [0.03, 0.06] | 0/2 | 2/2 | 2/2 |" in table
    assert json.loads((tmp_path / "pilots.json").read_text()) == json.loads(json.dumps(got))
    # finished runs are read back, not run again
    trained.clear()
    run_pilot(pilot, tmp_path, log=lambda s: None, train=train)
    assert trained == []


def test_a_pilot_declaration_is_checked_with_errors_naming_what_is_wrong(tmp_path):
    from magic_jax.jobs.decision_pilots import Pilot, load_pilot

    path = tmp_path / "p.yaml"
    path.write_text(
        "name: p1\nseeds: [0, 1, 2]\nchain_share: 0.75\nstage1_steps: 50\n"
        "arms: [{name: none, overrides: [entropy.mode=fixed, entropy.init_coef=0.0]}]\n"
    )
    p = load_pilot(path)
    assert p.seeds == (0, 1, 2) and p.chain_share == 0.75 and p.arms[0].name == "none"
    assert p.build_config().chain_share == 0.75
    for text, match in (
        ("name: p\nseeds: [0]\nsteps: 3\n", "unknown key 'steps'"),
        ("name: p\nseeds: [0]\nchain_share: 0\n", "chain_share"),
        ("name: p\nseeds: [0]\ncheck_rate: 1.5\n", "check_rate"),
        ("name: p\nseeds: [0]\ndigits: 5\n", "digits"),
        ("name: p\nseeds: [0, 0]\n", "seeds"),
        ("name: p\nseeds: []\n", "seeds"),
        ("name: p\nseeds: [0]\nstage1_steps: 30\n", "eval_every"),
        ("name: p\nseeds: [0]\nlearnable_above: 0.00001\n", "locked_out_below"),
        ("name: p\nseeds: [0]\nlearnable_above: 1e-6\n", "a number, got '1e-6'"),
        ("name: 'a b'\nseeds: [0]\n", "pilot name"),
        ("name: p\nseeds: [0]\narms: [{overrides: []}]\n", "name"),
        ("name: p\nseeds: [0]\nbuild: {nope: 1}\n", "nope"),
        ("[1, 2]\n", "mapping"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=match) as e:
            load_pilot(path)
        assert str(path) in str(e.value)
    with pytest.raises(ValueError, match="learned_above"):
        Pilot(name="p", seeds=(0,), learned_above=0.0)
    # the module's example declaration loads
    from magic_jax.jobs import decision_pilots

    path.write_text(decision_pilots.__doc__.split("A declaration::", 1)[1])
    example = load_pilot(path)
    assert example.name == "dose-a" and [a.name for a in example.arms] == ["none", "held"]


@pytest.mark.slow  # ~1 min on 2 cores: a 2-step build, then 2 arms x 1 seed x 4 RL steps
def test_a_tiny_pilot_runs_end_to_end(tmp_path):
    from magic_jax.jobs.decision_pilots import Pilot, run_pilot

    build = dict(eval_every=2, train_problems=32, heldout_problems=8, eval_problems=2, batch=8)
    pilot = Pilot(
        name="smoke",
        seeds=(0,),
        sft_steps=2,
        build=build,
        stage1_steps=2,
        stage2_steps=2,
        eval_every=2,
    )
    got = run_pilot(pilot, tmp_path, log=lambda s: None)
    hf = json.loads((tmp_path / "base" / "model" / "config.json").read_text())
    tok = decision.tokenizer()
    assert hf["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids(decision.STOP)]
    st = json.loads((tmp_path / "base" / "build.json").read_text())["statistics"]
    assert st["samples"] == 64 and 0 < st["probe"]["p_mean"] < 1
    assert [(r["arm"], r["seed"]) for r in got["runs"]] == [("none", 0), ("adaptive-decision", 0)]
    for r in got["runs"]:
        assert 0 < r["p_stage1_end"] < 1 and 0 <= r["chain_accuracy_final"] <= 1
    assert "| adaptive-decision | 1 |" in (tmp_path / "pilots.md").read_text()


def test_build_world_builds_the_decision_world_and_the_pilot_command_checks_its_file(
    tmp_path, monkeypatch, capsys
):
    from magic_jax.jobs import cli, decision_pilots, decision_world

    built = []
    monkeypatch.setattr(
        decision_world, "build_decision_world", lambda out, config: built.append((out, config))
    )
    args = cli.build_parser().parse_args(
        ["build-world", "--world", "decision", "--out", str(tmp_path), "--seed", "3"]
    )
    assert args.func(args) == 0
    assert built == [(str(tmp_path), decision_world.DecisionBuildConfig(seed=3))]
    (tmp_path / "p.yaml").write_text("name: p\nseeds: [0]\ndigits: 7\n")
    with pytest.raises(SystemExit):
        decision_pilots.main([str(tmp_path / "p.yaml"), "--out", str(tmp_path / "o")])
    assert "digits must be an integer in [2, 4], got 7" in capsys.readouterr().err
    with pytest.raises(ValueError, match="sft_steps"):
        decision_world.DecisionBuildConfig(sft_steps=0)


def test_the_run_config_trains_the_world_as_designed_and_names_bad_overrides(tmp_path):
    from magic_jax.jobs.decision_pilots import DECISION_ADAPTIVE
    from magic_jax.jobs.decision_world import run_config
    from magic_jax.run.config import ConfigError

    _fake_base(tmp_path / "base", digits=3)
    kw = dict(digits=3, stage1_steps=10, stage2_steps=20, eval_every=5, seed=4)
    cfg = run_config(tmp_path / "base", output_dir=tmp_path / "r", **kw)
    assert [(s.steps, s.max_response_length) for s in cfg.stages] == [(10, 22), (20, 42)]
    assert cfg.eval.probe == "decision" and cfg.eval.max_response_length == 42
    assert cfg.seed == 4 and cfg.entropy.mode == "adaptive" and cfg.entropy.tokens is None
    held = run_config(
        tmp_path / "base", output_dir=tmp_path / "r", overrides=DECISION_ADAPTIVE, **kw
    )
    assert held.entropy.tokens == "decision:decision" and held.entropy.target == 0.5
    # a positive control: stage 1 without the punishment (the full check fits throughout)
    ctrl = run_config(
        tmp_path / "base",
        output_dir=tmp_path / "r",
        overrides=["stages.0.max_response_length=42"],
        **kw,
    )
    assert [s.max_response_length for s in ctrl.stages] == [42, 42]
    with pytest.raises(ConfigError, match="entropy.tokens"):
        run_config(
            tmp_path / "base",
            output_dir=tmp_path / "r",
            overrides=["entropy.tokens=decision:x"],
            **kw,
        )


def test_pilot_jobs_run_each_arm_and_seed_in_a_child_and_name_the_ones_that_failed(
    tmp_path, capsys
):
    from magic_jax.jobs import decision_pilots

    pilot_file = tmp_path / "p.yaml"
    pilot_file.write_text("name: p\nseeds: [0, 1]\ndigits: 3\n")
    pilot = decision_pilots.load_pilot(pilot_file)
    with pytest.raises(SystemExit):
        decision_pilots.main([str(pilot_file), "--out", str(tmp_path), "--only", "held-s0"])
    err = capsys.readouterr().err
    assert "--only held-s0: not a run of pilot p (none-s0, none-s1, adaptive-decision-s0" in err
    with pytest.raises(SystemExit):
        decision_pilots.main([str(pilot_file), "--out", str(tmp_path), "--jobs", "0"])
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs the pilot's file"):
        _fake_base(tmp_path / "o" / "base", digits=3)
        decision_pilots.run_pilot(pilot, tmp_path / "o", jobs=2, log=lambda s: None)
    # each child runs one arm x seed: here without a base, so each fails and is named
    pending = [(pilot.arms[0], 0), (pilot.arms[0], 1), (pilot.arms[1], 0)]
    said = []
    with pytest.raises(RuntimeError) as e:
        decision_pilots._run_children(pending, pilot_file, tmp_path / "x", 2, said.append)
    assert str(e.value).startswith("pilot runs failed: ")
    for label in ("none-s0", "none-s1", "adaptive-decision-s0"):
        assert f"{label} (exit 2, log {tmp_path / 'x' / 'runs' / label}.log)" in str(e.value)
    assert "no base under" in (tmp_path / "x" / "runs" / "none-s1.log").read_text()
    assert [s.split()[1] for s in said] == ["none-s0", "none-s1", "adaptive-decision-s0"]


def test_the_shipped_config_runs_the_shipped_world_as_the_pilots_ran_it():
    from magic_jax.jobs.decision_world import DecisionBuildConfig, run_config
    from magic_jax.run.config import load_config

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs/decision.yaml")
    shipped = repo / "magic_jax/assets/decision"
    assert (shipped / "decision.yaml").read_text() == (repo / "configs/decision.yaml").read_text()
    limits = [decision.stage1_limit(), decision.stage2_limit()]
    assert [s.max_response_length for s in cfg.stages] == limits == [22, 42]
    assert cfg.eval.max_response_length == limits[1] and cfg.eval.probe == "decision"
    assert cfg.entropy.tokens == "decision:decision" and cfg.entropy.target < math.log(2)
    # the shipped base is what `magic-jax build-world --world decision --seed 0` builds
    build = json.loads((shipped / "build.json").read_text())
    assert build["build"] == dataclasses.asdict(DecisionBuildConfig(seed=0))
    assert 0.05 < build["statistics"]["probe"]["p_mean"] < 0.3
    # the pilots' runs of that base train what the config trains, but for the entropy settings
    piloted = run_config(
        shipped, digits=3, stage1_steps=100, stage2_steps=200, eval_every=25, seed=0,
        output_dir=cfg.output_dir,
    )  # fmt: skip
    for field in ("stages", "loss", "optimizer", "sampling", "rollout"):
        assert getattr(piloted, field) == getattr(cfg, field), field
    assert piloted.eval.probe == cfg.eval.probe and piloted.eval.every == cfg.eval.every
