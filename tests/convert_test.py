"""HF <-> Flax conversion: round trips through transformers, sharded files, errors, streaming."""

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import TINY_CONFIGS, make_char_tokenizer, torch_logits
from transformers import AutoModelForCausalLM

from magic_jax.jobs import cli
from magic_jax.model.convert import (
    INDEX_FILE,
    CheckpointError,
    SafetensorsFile,
    load_hf,
    save_hf,
    write_safetensors,
)
from magic_jax.testing import make_hf_model, save_hf_model

IDS = np.random.RandomState(0).randint(3, 128, (2, 9))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random model with a tokenizer beside it, as `magic-jax convert` needs."""
    hf = make_hf_model(seed=1, **TINY_CONFIGS["gqa_untied"])
    path = save_hf_model(hf, tmp_path_factory.mktemp("hf"))
    make_char_tokenizer().save_pretrained(path)
    return hf, path


@pytest.mark.parametrize(
    "name,scan_layers", [("gqa_untied", True), ("mha_tied", True), ("gqa_untied", False)]
)
def test_save_hf_reloads_in_transformers_with_same_logits(name, scan_layers, tmp_path):
    hf = make_hf_model(seed=2, **TINY_CONFIGS[name])
    model = load_hf(save_hf_model(hf, tmp_path / "in"), overrides={"scan_layers": scan_layers})
    assert model.config.scan_layers == scan_layers
    out = save_hf(model, tmp_path / "out", dtype=jnp.float32)
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_array_equal(torch_logits(again, IDS), torch_logits(hf, IDS))
    assert again.config.tie_word_embeddings == hf.config.tie_word_embeddings


def test_bf16_index_checkpoint_round_trips_bit_exact(tmp_path):
    hf = make_hf_model(seed=4, dtype="bfloat16", **TINY_CONFIGS["gqa_untied"])
    src = save_hf_model(hf, tmp_path / "src", max_shard_size="20KB")
    assert (src / INDEX_FILE).exists()
    model = load_hf(src, dtype=jnp.bfloat16)
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    out = save_hf(model, tmp_path / "out", dtype=jnp.bfloat16, max_shard_bytes=20_000)
    index = json.loads((out / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    src_map = json.loads((src / INDEX_FILE).read_text())["weight_map"]
    assert set(index["weight_map"]) == set(src_map)
    for name, fname in index["weight_map"].items():
        a = SafetensorsFile(out / fname).read(name)
        b = SafetensorsFile(src / src_map[name]).read(name)
        assert a.dtype == b.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=name)
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    assert str(again.dtype) == "torch.bfloat16"  # config.json carries the stored dtype
    # compare with the source loaded the same way (a bf16-cast module keeps bf16 rope buffers)
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    np.testing.assert_array_equal(torch_logits(again, IDS), torch_logits(source, IDS))


def _rewrite(path, drop=None, replace=None):
    f = SafetensorsFile(path / "model.safetensors")
    tensors = [
        (k, replace.get(k, f.read(k)) if replace else f.read(k)) for k in f.keys() if k != drop
    ]
    write_safetensors(path / "model.safetensors", tensors)


def test_missing_tensor_is_named(hf_dir, tmp_path):
    _, src = hf_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    _rewrite(bad, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(bad)


def test_wrong_shape_is_named_with_file(hf_dir, tmp_path):
    _, src = hf_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    _rewrite(bad, replace={"model.layers.0.self_attn.k_proj.bias": np.zeros(7, np.float32)})
    with pytest.raises(CheckpointError, match=r"k_proj\.bias.*\(7,\).*expected \(32,\)") as e:
        load_hf(bad)
    assert "model.safetensors" in str(e.value)


def test_extra_tensor_truncated_file_and_bad_dirs(hf_dir, tmp_path):
    _, src = hf_dir
    bad = tmp_path / "extra"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    f = SafetensorsFile(bad / "model.safetensors")
    write_safetensors(
        bad / "model.safetensors",
        [(k, f.read(k)) for k in f.keys()] + [("model.vision.weight", np.ones(3))],
    )
    with pytest.raises(CheckpointError, match="model.vision.weight"):
        load_hf(bad)
    load_hf(bad, strict=False)  # a warning only

    raw = (src / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_hf(bad)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path)
    cfg = json.loads((src / "config.json").read_text()) | {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(raw)
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_hf(bad)


def test_cli_convert_export_round_trip(hf_dir, tmp_path, capsys):
    hf, src = hf_dir
    assert cli.main(["convert", str(src), str(tmp_path / "ckpt")]) == 0
    assert (
        cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "float32"])
        == 0
    )
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    np.testing.assert_array_equal(torch_logits(again, IDS), torch_logits(hf, IDS))
    # refusing to overwrite keeps the existing checkpoint intact
    assert cli.main(["convert", str(src), str(tmp_path / "ckpt")]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf2")]) == 0


def test_loaded_model_matches_hf_weights_directly(hf_dir):
    hf, src = hf_dir
    model = load_hf(src)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    # stacked layers: [L, ...] with the layer axis named for the sharding rules
    q = model.layers.self_attn.q_proj.kernel
    assert q.shape[0] == hf.config.num_hidden_layers
    assert q.get_metadata()["out_sharding"] == ("layers", "embed", "q_heads")
    np.testing.assert_array_equal(q[1], sd["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(
        model.layers.post_attention_layernorm.scale[0],
        sd["model.layers.0.post_attention_layernorm.weight"],
    )
    assert isinstance(model.layers.mlp.down_proj.kernel, nnx.Param)
    loop = load_hf(src, overrides={"scan_layers": False})
    np.testing.assert_array_equal(loop.layers[1].self_attn.q_proj.kernel[...], q[1])


# Streaming: about 240 MB of bf16 in 8 layers; the largest tensor (the embedding)
# is 33.5 MB in fp32. Loading must stay within 2x that plus a fixed allowance on
# top of the parameters themselves (which live in host memory on the CPU backend).
ALLOWANCE_MB = 64
_STREAM_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from magic_jax.model.convert import load_hf
    from magic_jax.model.qwen2 import count_params
    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()
    base = rss("VmRSS")
    model = load_hf(sys.argv[1], dtype=jnp.float32)
    peak = rss("VmHWM")
    print(json.dumps({"growth": peak - base, "params": count_params(model) * 4}))
""")


def _write_big_checkpoint(path):
    from magic_jax.model.config import ModelConfig
    from magic_jax.model.convert import hf_names
    from magic_jax.model.qwen2 import abstract_model

    cfg = ModelConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2816,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
    )
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    tensors = []
    rng = np.random.default_rng(0)
    for p, var in nnx.to_flat_state(nnx.state(abstract_model(cfg))):
        for layer, name, transpose in hf_names(".".join(map(str, p)), cfg.num_layers):
            shape = tuple(var.shape) if layer is None else tuple(var.shape[1:])
            shape = shape[::-1] if transpose else shape
            make = lambda s=shape: rng.standard_normal(s, np.float32).astype(ml_dtypes.bfloat16)
            tensors.append((name, (make, shape, ml_dtypes.bfloat16)))
    write_safetensors(path / "model.safetensors", tensors)
    return 8192 * 1024 * 4


@pytest.mark.heavy  # 10-16 s on 2 cores
def test_streaming_load_peak_memory(tmp_path):
    largest = _write_big_checkpoint(tmp_path / "big")
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    assert 200e6 < size < 300e6
    out = subprocess.run(
        [sys.executable, "-c", _STREAM_SCRIPT, str(tmp_path / "big")],
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    overhead = got["growth"] - got["params"]
    assert overhead < 2 * largest + ALLOWANCE_MB * 2**20, (
        f"transient host memory {overhead / 2**20:.0f} MB beyond the {got['params'] / 2**20:.0f}"
        f" MB of parameters; bound {(2 * largest) / 2**20 + ALLOWANCE_MB:.0f} MB"
    )


def test_orbax_checkpoints_of_both_layouts_load(hf_dir, tmp_path):
    """A stacked save loads stacked and a loop-model save as the loop model; a config
    without ``scan_layers`` (an older layout) is refused with a message."""
    from magic_jax.run.checkpoint import CONFIG_FILE, load_model, save_model

    hf, src = hf_dir
    want = torch_logits(hf, IDS)
    stacked = load_model(save_model(load_hf(src), tmp_path / "new"))
    assert stacked.config.scan_layers
    old = save_model(load_hf(src, overrides={"scan_layers": False}), tmp_path / "old")
    loop = load_model(old)
    assert not loop.config.scan_layers
    for m in (stacked, loop):
        np.testing.assert_allclose(np.asarray(m(jnp.asarray(IDS))), want, atol=1e-4)
    raw = json.loads((old / CONFIG_FILE).read_text())
    del raw["scan_layers"]
    (old / CONFIG_FILE).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="no scan_layers; written by an older layout"):
        load_model(old)
