"""JetStream adapter: requests served by JetStream's orchestrator Driver equal our greedy output."""

import asyncio
import threading

import numpy as np
import pytest
from flax import nnx

pytest.importorskip("jetstream")
pytest.importorskip("grpc")

from magic_jax.model.config import ModelConfig
from magic_jax.model.qwen2 import Qwen2
from magic_jax.rollout import jetstream_adapter
from magic_jax.rollout.driver import RolloutDriver
from magic_jax.rollout.engine import Engine, EngineConfig
from magic_jax.rollout.sampling import SamplingConfig

BOS, EOS = 1, 2
CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
PROMPTS = [[5, 9, 13, 7], [17, 4], [8, 8, 30, 41, 12, 3], [60]]


@pytest.fixture(scope="module")
def setup():
    model = Qwen2(CFG, rngs=nnx.Rngs(3))
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 40.0
    config = EngineConfig(
        max_concurrent_decodes=2,
        max_prefill_length=16,
        max_decode_length=12,
        cache_bucket=0,
        compact_batch=False,
        sampling=SamplingConfig(greedy=True),
    )
    engine = Engine(model, config)
    return engine, engine.load_params(model)


async def _serve(driver, prompt, max_tokens):
    pb2 = jetstream_adapter.orchestrator.jetstream_pb2
    client = jetstream_adapter.orchestrator.LLMOrchestrator(driver=driver)
    request = pb2.DecodeRequest(
        token_content=pb2.DecodeRequest.TokenContent(token_ids=prompt), max_tokens=max_tokens
    )
    out = []
    async for resp in client.Decode(request):
        out.extend(resp.stream_content.samples[0].token_ids)
    return out


def test_driver_serves_our_greedy_tokens(setup, monkeypatch):
    from jetstream.core import orchestrator

    # JetStream's threads SIGKILL the whole process on an exception (a server's choice):
    # record them instead, so that a failure fails this test and not the test run.
    errors, stopping = [], []

    def run(thread):
        try:
            threading.Thread.run(thread)
        except Exception as e:
            errors.append((bool(stopping), f"{thread.name}: {e!r}"))

    monkeypatch.setattr(orchestrator.JetThread, "run", run)
    engine, params = setup
    # JetStream prepends BOS to every prompt; four requests share two slots.
    ours, _ = RolloutDriver(engine).run(params, [np.array([BOS, *p]) for p in PROMPTS])
    want = []
    for s in ours:
        cut = s.tokens[:-1] if s.finish_reason == "eos" else s.tokens  # JetStream drops EOS
        want.append(list(cut[:10]))
    adapter = jetstream_adapter.JetStreamEngine(engine, params)
    driver = jetstream_adapter.make_driver(adapter)
    try:

        async def main():
            return await asyncio.gather(*(_serve(driver, p, 10) for p in PROMPTS))

        got = asyncio.run(main())
    finally:
        stopping.append(True)
        driver.stop()
    # an error while serving fails; one while JetStream tears its threads down is its own
    assert [e for during_stop, e in errors if not during_stop] == []
    assert got == want
    assert any(len(g) == 10 for g in got)


def test_shim_restores_tree_map_and_stubs_seqio():
    import jax

    assert jax.tree_map is jax.tree.map or callable(jax.tree_map)
    from jetstream.engine import token_utils

    padded, n = token_utils.pad_tokens(
        np.array([5, 6]), BOS, 0, is_bos=True, max_prefill_length=16, jax_padding=False
    )
    assert n == 3 and padded.tolist()[:4] == [BOS, 5, 6, 0]


def test_rejects_prefill_length_jetstream_cannot_pad(setup):
    _, params = setup
    bad = Engine(Qwen2(CFG, rngs=nnx.Rngs(0)), EngineConfig(max_prefill_length=24))
    with pytest.raises(ValueError, match="max_prefill_length"):
        jetstream_adapter.JetStreamEngine(bad, params)
