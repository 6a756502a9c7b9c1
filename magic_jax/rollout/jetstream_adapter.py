"""JetStream (google-jetstream 0.2.2) Engine adapter over our engine, with its compat shim."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magic_jax.rollout.decode import DecodeState, Prefix, decode_step
from magic_jax.rollout.engine import Engine
from magic_jax.rollout.sampling import SamplingConfig, sample_key

if TYPE_CHECKING:
    from magic_jax.rollout.protocols import Tokenizer

# ----------------------------------------------------------------------------- shim
# google-jetstream 0.2.2 (its last release) predates current jax and imports seqio
# (and through it TensorFlow) only for its SentencePiece tokenizer, which this
# adapter replaces. Everything it needs from outside is patched here, once.


def _install_shim() -> None:
    if not hasattr(jax, "tree_map"):
        # Removed from jax; the orchestrator still calls it.
        jax.tree_map = jax.tree.map  # type: ignore[attr-defined]
    try:
        import seqio.vocabularies
    except ImportError:
        vocabularies = types.ModuleType("seqio.vocabularies")

        class Vocabulary:  # names token_utils imports; never used through this adapter
            pass

        class SentencePieceVocabulary(Vocabulary):
            def __init__(self, *args: object, **kwargs: object):
                raise ImportError("seqio is not installed; magic_jax supplies its own tokenizer")

        vocabularies.__dict__.update(
            Vocabulary=Vocabulary, SentencePieceVocabulary=SentencePieceVocabulary
        )
        seqio = types.ModuleType("seqio")
        seqio.__dict__["vocabularies"] = vocabularies
        sys.modules.setdefault("seqio", seqio)
        sys.modules.setdefault("seqio.vocabularies", vocabularies)


@contextlib.contextmanager
def _root_logger_kept() -> Iterator[None]:
    """Importing the orchestrator sets the root logger to DEBUG with a stdout handler:
    undone on the way out."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield
    finally:
        root.setLevel(level)
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)


_install_shim()
with _root_logger_kept():
    from jetstream.core import orchestrator
    from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2


# ----------------------------------------------------------------------------- tokenizer


class TokenIdTokenizer(tokenizer_api.Tokenizer):
    """JetStream tokenizer over token ids, optionally wrapping a Hugging Face tokenizer.

    Stop tokens are the EOS ids only: id 0 (JetStream's default pad, and a real
    token in Qwen2's vocabulary) does not end a response.
    """

    def __init__(
        self,
        *,
        bos_id: int,
        eos_ids: tuple[int, ...],
        pad_id: int = 0,
        hf: Tokenizer | None = None,
    ):
        self._bos = bos_id
        self._eos = tuple(eos_ids)
        self._pad = pad_id
        self.hf = hf

    def encode(self, s: str, **kwargs: object) -> tuple[jax.Array | np.ndarray, int]:
        if self.hf is None:
            raise ValueError("no Hugging Face tokenizer given: send token_content requests")
        ids = np.asarray(self.hf.encode(s, add_special_tokens=False), np.int32)
        return token_utils.pad_tokens(
            ids,
            self._bos,
            self._pad,
            is_bos=kwargs.get("is_bos", True),
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", True),
        )

    def decode(self, token_ids: list[int], **kwargs: object) -> str:
        if self.hf is None:
            return " ".join(map(str, token_ids))
        return self.hf.decode(token_ids)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos[0] if self._eos else -1

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._eos)


# ----------------------------------------------------------------------------- engine


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Request:
    prefix: Prefix
    key: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdapterState:
    """Our ``DecodeState`` plus, per slot, whether its last token is yet to be emitted.

    JetStream 0.2.2 streams only what ``generate`` returns, so the token sampled at
    insert (and each one after) is emitted by the next ``generate``.
    """

    decode: DecodeState
    pending: jax.Array


def _emit_step(graphdef, params, state: AdapterState, eos_E, *, sampling: SamplingConfig):
    fed_B, steps_B, pending_B = state.decode.tokens, state.decode.steps, state.pending
    live_B = ~state.decode.done
    decode, _ = decode_step(graphdef, params, state.decode, eos_E, sampling=sampling)
    data_B3 = jnp.stack([fed_B, pending_B.astype(jnp.int32), steps_B], axis=-1)
    return AdapterState(decode=decode, pending=live_B), data_B3


def _mark_pending(state: AdapterState, slot):
    return dataclasses.replace(state, pending=state.pending.at[slot].set(True))


class JetStreamEngine(engine_api.Engine):
    """``jetstream.engine.engine_api.Engine`` over a magic_jax ``Engine``.

    One sample per slot. Request ``r`` (in prefill order) samples with key
    ``sample_key(seed, 0, r, 0)``. The engine's ``max_prefill_length`` must be one
    of JetStream's padding lengths (a power of two from 16).
    """

    def __init__(
        self,
        engine: Engine,
        params: nnx.State,
        *,
        seed: int = 0,
        bos_id: int | None = None,
        hf_tokenizer: Tokenizer | None = None,
    ):
        n = engine.max_prefill_length
        if n < 16 or n & (n - 1):
            raise ValueError(
                f"EngineConfig.max_prefill_length must be a power of two >= 16 for JetStream's "
                f"padding, got {n}"
            )
        self.engine = engine
        self._params = params
        self._seed = seed
        self._requests = 0
        bos = bos_id if bos_id is not None else engine.model_config.bos_token_id
        self._bos = 0 if bos is None else int(bos)
        self._hf = hf_tokenizer
        sampling = engine.config.sampling
        self._step = jax.jit(
            functools.partial(_emit_step, engine.graphdef, sampling=sampling), donate_argnums=1
        )
        self._mark = jax.jit(_mark_pending, donate_argnums=0)

    def load_params(self, *args: object, **kwargs: object) -> nnx.State:
        return self._params

    def prefill(
        self,
        *,
        params: nnx.State,
        existing_prefix: _Request | None = None,
        padded_tokens: jax.Array | np.ndarray,
        true_length: int,
    ) -> _Request:
        if existing_prefix is not None:
            raise NotImplementedError("prefix continuation is not supported")
        prefix = self.engine.prefill(params, np.asarray(padded_tokens), true_length=true_length)
        key = sample_key(self._seed, 0, self._requests, 0)
        self._requests += 1
        return _Request(prefix=prefix, key=key)

    def insert(self, prefix: _Request, decode_state: AdapterState, slot: int) -> AdapterState:
        decode, _ = self.engine.insert(prefix.prefix, decode_state.decode, slot, key=prefix.key)
        return self._mark(AdapterState(decode=decode, pending=decode_state.pending), slot)

    def generate(
        self, params: nnx.State, decode_state: AdapterState
    ) -> tuple[AdapterState, engine_api.ResultTokens]:
        state, data = self._step(params, decode_state, self.engine.eos_array)
        return state, engine_api.ResultTokens(
            data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
        )

    def init_decode_state(self, *args: object, **kwargs: object) -> AdapterState:
        b = self.engine.max_concurrent_decodes
        return AdapterState(decode=self.engine.init_decode_state(), pending=jnp.zeros((b,), bool))

    def get_prefix_destination_sharding(self) -> jax.sharding.Sharding:
        mesh = self.engine.mesh
        if mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="magic_jax", extra_ids=0)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenIdTokenizer:
        return TokenIdTokenizer(bos_id=self._bos, eos_ids=self.engine.eos_ids, hf=self._hf)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        if self.engine.mesh is not None:
            return self.engine.mesh
        return jax.sharding.Mesh(
            np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor")
        )

    @property
    def colocated_cpus(self) -> None:
        return None


def make_driver(engine: JetStreamEngine) -> orchestrator.Driver:
    """JetStream's in-process orchestrator ``Driver`` with ``engine`` for prefill and generate."""
    params = engine.load_params()
    return orchestrator.Driver(
        prefill_engines=[engine],
        generate_engines=[engine],
        prefill_params=[params],
        generate_params=[params],
    )
