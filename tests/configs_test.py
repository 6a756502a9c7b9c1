"""The shipped recipes load and match the released stage tables."""

from pathlib import Path

import pytest

from magic_jax.run.config import load_config

CONFIGS = Path(__file__).parent.parent / "configs"

# (steps, T, D_R, D_T, G) per stage, from the released tables
RELEASED = {
    "skywork-or1-7b": [(660, 16384, 256, 256, 16), (660, 32768, 160, 160, 32)],
    "skywork-or1-32b": [(760, 16384, 256, 256, 16), (370, 24576, 160, 160, 32)],
    "skywork-or1-math-7b": [
        (740, 8192, 256, 128, 16),
        (1000, 16384, 256, 128, 16),
        (340, 32768, 256, 128, 16),
        (80, 32768, 128, 64, 64),
    ],
    "ablation-7b": [(1000, 16384, 64, 64, 16)],
}


def test_every_config_is_covered():
    # default.yaml, carry.yaml, lockout.yaml and decision.yaml are the shipped tiny runs
    # (tests/demo_test.py, tests/notebooks_test.py, tests/lockout_world_test.py,
    # tests/decision_world_test.py), not released recipes
    shipped = {"default", "carry", "lockout", "decision"}
    found = sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem not in shipped)
    assert found == sorted(RELEASED)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_recipe_loads_with_the_released_schedule(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    got = [
        (s.steps, s.max_response_length, s.prompts_per_step, s.mini_batch_groups, s.group_size)
        for s in cfg.stages
    ]
    assert got == RELEASED[name]
    # the released hyper-parameters
    assert cfg.optimizer.learning_rate == 1e-6 and cfg.optimizer.weight_decay == 0.01
    assert cfg.loss.eps_low == cfg.loss.eps_high == 0.2 and cfg.loss.kl_beta == 0
    assert cfg.sampling.temperature == cfg.loss.temperature == 1.0
    assert (cfg.entropy.mode, cfg.entropy.target, cfg.entropy.delta) == ("adaptive", 0.2, 0.005)
    assert cfg.update.num_reuse == 1 and cfg.advantage.mask == "none"
    # the update's memory options (docs/tpu.md, "Will a stage fit?"): every mini-batch splits
    assert (cfg.update.remat, cfg.update.compute_dtype) == ("full", "bfloat16")
    # rollouts sample in bf16 (weights and KV cache); master weights stay fp32
    assert (cfg.rollout.dtype, cfg.param_dtype) == ("bfloat16", "float32")
    micro = cfg.update.micro_batch_size
    assert all(s.mini_batch_groups * s.group_size % micro == 0 for s in cfg.stages)
    if cfg.data.offline_filter_model:  # the report's N: 16 samples per math prompt, 8 per code
        assert cfg.data.offline_filter_samples == {"math": 16, "code": 8}


def test_offline_filter_options_reach_the_filter(tmp_path):
    from magic_jax.data.rows import offline_filter, parse_row
    from magic_jax.run.config import ConfigError

    cfg = load_config(CONFIGS / "skywork-or1-7b.yaml", ["data.offline_filter_keep_unrated=false"])
    assert cfg.data.offline_filter_keep_unrated is False
    one_n = load_config(CONFIGS / "skywork-or1-7b.yaml", ["data.offline_filter_samples=8"])
    assert one_n.data.offline_filter_samples == 8
    with pytest.raises(ConfigError, match=r"data\.offline_filter_samples\.code: expected an int"):
        load_config(CONFIGS / "skywork-or1-7b.yaml", ["data.offline_filter_samples={code: x}"])
    with pytest.raises(ConfigError, match=r"offline_filter_samples\[math\] must be positive"):
        load_config(CONFIGS / "skywork-or1-7b.yaml", ["data.offline_filter_samples={math: 0}"])

    def row(ability, solved):
        extra = {} if solved is None else {"model_difficulty": {"m": solved}}
        raw = {
            "prompt": [{"role": "user", "content": "q"}],
            "ability": ability,
            "reward_model": {"ground_truth": "1", "style": "rule"},
            "extra_info": extra,
        }
        return parse_row(raw, "t", f"{ability}{solved}")

    rows = [row("math", 8), row("math", 16), row("code", 8), row("code", 4), row("math", None)]
    d = cfg.data
    kept = offline_filter(rows, "m", d.offline_filter_samples, keep_unrated=False)
    assert [r.uid for r in kept] == ["math8", "code4"]  # 8/8 of code is solved every time


def test_rollout_dtype_is_checked_and_reaches_the_engine(tmp_path):
    from magic_jax.run.config import ConfigError
    from magic_jax.run.inputs import load_inputs
    from magic_jax.run.stages import build_stage

    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(CONFIGS / "default.yaml", ["rollout.dtype=float16"])
    with pytest.raises(ConfigError, match="rollout.kv_dtype"):
        load_config(CONFIGS / "default.yaml", ["rollout.kv_dtype=int4"])
    with pytest.raises(ConfigError, match="rollout.decode_attention"):
        load_config(CONFIGS / "default.yaml", ["rollout.decode_attention=paged"])
    ragged = load_config(
        CONFIGS / "default.yaml", ["rollout.decode_attention=ragged", "rollout.kv_dtype=int8"]
    )
    assert (ragged.rollout.decode_attention, ragged.rollout.kv_dtype) == ("ragged", "int8")
    cfg = load_config(
        CONFIGS / "default.yaml",
        ["rollout.dtype=bfloat16", "rollout.kv_dtype=int8", f"output_dir={tmp_path / 'run'}"],
    )
    inputs, _ = load_inputs(cfg)
    engine = build_stage(cfg, 0, inputs, []).driver.engine  # the stage's rollouts
    assert engine.config.dtype == "bfloat16" and engine.model_config.dtype == "bfloat16"
    assert engine.config.kv_dtype == "int8"
    assert engine.config.decode_attention is None and engine.ragged_spec is None  # CPU


@pytest.mark.parametrize(
    "old, new",
    [
        ("micro_batch_size", "update.micro_batch_size"),
        ("num_reuse", "update.num_reuse"),
        ("mini_batch_split", "update.mini_batch_split"),
        ("remat", "update.remat"),
        ("compute_dtype", "update.compute_dtype"),
        ("attention_chunk", "update.attention_chunk"),
        ("update_layer_unroll", "update.layer_unroll"),
        ("update_mlp_kernel", "update.mlp_kernel"),
    ],
)
def test_moved_update_options_are_refused_with_their_new_key(tmp_path, old, new):
    import yaml

    from magic_jax.run.config import MOVED_OPTIONS, ConfigError

    assert MOVED_OPTIONS[old] == new
    values = {"mini_batch_split": "even", "remat": "full", "compute_dtype": "bfloat16"}
    value = values.get(old, False if old == "update_mlp_kernel" else 1)
    message = f"{old} moved: use {new}"
    with pytest.raises(ConfigError, match=message):  # on the command line
        load_config(CONFIGS / "default.yaml", [f"{old}={value}"])
    raw = yaml.safe_load((CONFIGS / "default.yaml").read_text()) | {old: value}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=f"old.yaml: {message}"):  # in a file
        load_config(path)
    section, key = new.split(".")
    cfg = load_config(CONFIGS / "default.yaml", [f"{new}={value}"])
    assert getattr(getattr(cfg, section), key) == value


def test_engine_options_are_the_rollout_sections(tmp_path):
    """The run's ``rollout`` section is the engine's options plus the loop's own, and the
    trainer's engine takes every one of them (none copied by hand)."""
    import dataclasses

    from magic_jax.rollout.engine_config import EngineConfig, EngineOptions
    from magic_jax.run.config import RolloutConfig

    engine = {f.name for f in dataclasses.fields(EngineOptions)}
    rollout = {f.name for f in dataclasses.fields(RolloutConfig)}
    loop = {"truncation", "refill", "refill_max_rounds"}
    assert rollout - engine == loop | {
        "mode",
        "max_staleness",
        "publish_chunks",
        "publish_cache",
        "devices",
        "hosts",
    }
    sets = ["rollout.cache_bucket=32", "rollout.layer_unroll=2", "rollout.decode_steps=8"]
    cfg = load_config(CONFIGS / "default.yaml", sets)
    config = EngineConfig.of(cfg.rollout, max_prefill_length=16, max_decode_length=8)
    assert (config.cache_bucket, config.layer_unroll, config.decode_steps) == (32, 2, 8)
    assert EngineOptions().max_concurrent_decodes == RolloutConfig().max_concurrent_decodes


def test_the_embedded_default_is_named_as_help_names_it(capsys):
    """With no config the error names ``configs/default.yaml`` (as ``--help`` does), not
    the package's copy of it, whichever path the run takes."""
    from magic_jax.jobs.cli import main

    for argv in (["train"], ["train", "--stop-after", "1"]):
        assert main([*argv, "--set", "loss.bogus=1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("magic-jax train: error: configs/default.yaml: loss.bogus:"), err
