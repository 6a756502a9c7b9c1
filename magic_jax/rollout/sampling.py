"""Next-token sampling with log-probs and entropy: the temperature-scaled distribution,
restricted by a sampling method (greedy, top-k / top-p, or one registered by name)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from magic_jax.model.logprobs import logprob_entropy_lse
from magic_jax.registry import Registry

# Inverse-CDF sampling works on blocks of this many vocabulary entries: a cumulative
# sum over the whole vocabulary is several times slower on CPU than two short ones.
_BLOCK = 256


@runtime_checkable
class SamplingMethod(Protocol):
    """One way of choosing the next token: which tokens of the temperature-scaled
    distribution may be sampled. The sampler then draws from the renormalised survivors.

    A method is a small frozen dataclass (hashable: it is a static argument of the
    compiled decode step), built from a config's ``sampling.options`` and registered by
    name with ``register_sampling``. ``restrict`` runs inside ``jit`` on [B, V] float32.
    """

    def restrict(self, z_BV: jax.Array) -> jax.Array:
        """``z_BV`` (temperature-scaled logits) with the tokens that may not be sampled set
        to -inf; at least one token per row must stay finite."""
        ...


@dataclasses.dataclass(frozen=True)
class Full:
    """Samples the whole temperature-scaled distribution."""

    def restrict(self, z_BV: jax.Array) -> jax.Array:
        return z_BV


@dataclasses.dataclass(frozen=True)
class Greedy:
    """Takes the arg-max token (the first of tied maxima): no randomness."""

    def restrict(self, z_BV: jax.Array) -> jax.Array:
        first_B = jnp.argmax(z_BV, axis=-1)
        keep_BV = jnp.arange(z_BV.shape[-1])[None, :] == first_B[:, None]
        return jnp.where(keep_BV, z_BV, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class TopKTopP:
    """Top-k, then nucleus (top-p) on the renormalised survivors, as Hugging Face's
    warpers (``truncate``).

    Attributes:
      top_k: keep the ``top_k`` most probable tokens (0 keeps everything).
      top_p: keep the most probable tokens whose mass reaches ``top_p`` (1 keeps all).
    """

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def restrict(self, z_BV: jax.Array) -> jax.Array:
        return truncate(z_BV, top_k=self.top_k, top_p=self.top_p)


_METHODS: Registry[type] = Registry(
    "sampling method", {"full": Full, "greedy": Greedy, "top-k-top-p": TopKTopP}
)


def register_sampling(name: str, method: type, *, replace: bool = False) -> None:
    """Registers ``method`` (a frozen dataclass with ``restrict``: a ``SamplingMethod``) as
    ``sampling.method: name``; a run builds it as ``method(**sampling.options)``.

    Raises:
      ValueError: an empty or built-in name, a class without ``restrict``, or a name
        another class holds (unless ``replace``).
    """
    if not isinstance(method, type) or not callable(getattr(method, "restrict", None)):
        raise ValueError(f"sampling method {name!r}: {method!r} is not a class with restrict()")
    _METHODS.add(name, method, replace=replace)


def get_sampling(name: str) -> type:
    """The class registered as ``name``.

    Raises:
      ValueError: one line naming ``name`` and the registered methods.
    """
    return _METHODS.get(name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is chosen from the model's logits.

    Attributes:
      temperature: logits are divided by it before everything else (> 0). The
        reported log-probs and entropies are those of this temperature-scaled
        full distribution, which is what the trainer recomputes.
      top_p / top_k / greedy: the built-in methods in short (verl's names):
        ``greedy`` takes the arg-max (``Greedy``); ``top_k`` > 0 or ``top_p`` < 1
        truncate (``TopKTopP``: top-k first, then the nucleus); otherwise the whole
        distribution is sampled (``Full``).
      method: a registered ``SamplingMethod`` by name (``register_sampling``), built
        from ``options``; None: the shorthand above chooses. Not together with it.
      options: the method's parameters (``{p: 0.05}``).
      strategy: the ``SamplingMethod`` these resolve to (derived).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    method: str | None = None
    options: dict[str, bool | int | float | str] = dataclasses.field(
        default_factory=dict, compare=False
    )
    strategy: SamplingMethod = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "strategy", self._resolve())

    def _resolve(self) -> SamplingMethod:
        if self.method is None:
            if self.options:
                raise ValueError(f"options: {self.options} given but no sampling method named")
            if self.greedy:
                return Greedy()
            if self.top_k > 0 or self.top_p < 1.0:
                return TopKTopP(self.top_k, self.top_p)
            return Full()
        if self.greedy or self.top_k > 0 or self.top_p < 1.0:
            raise ValueError(
                f"method: {self.method!r} is named, so greedy, top_k and top_p must keep "
                "their defaults (give the method's own options instead)"
            )
        try:
            cls = get_sampling(self.method)
        except ValueError as e:
            raise ValueError(f"method: {e}") from None
        try:
            strategy = cls(**self.options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"options: sampling method {self.method!r}: {e}") from None
        try:
            hash(strategy)
        except TypeError:
            raise ValueError(
                f"method: {self.method!r} builds an unhashable {type(strategy).__name__} "
                "(make it a frozen dataclass: it is a static argument of the decode step)"
            ) from None
        return strategy

    @property
    def name(self) -> str:
        """The method in use by its registered name (the shorthand's built-in when none is
        named): what the run's first log line and every ``metrics.jsonl`` row record."""
        if self.method is not None:
            return self.method
        builtin = {Greedy: "greedy", TopKTopP: "top-k-top-p"}
        return builtin.get(type(self.strategy), "full")

    def describe(self) -> str:
        """One line: the method, its options and the temperature."""
        names: list[str] = []
        if dataclasses.is_dataclass(self.strategy):  # as extending.md asks; hashable suffices
            names = [f.name for f in dataclasses.fields(self.strategy)]
        given = ", ".join(f"{n}={getattr(self.strategy, n)}" for n in names)
        return f"{self.name}{f' ({given})' if given else ''} at temperature {self.temperature:g}"

    @property
    def truncates(self) -> bool:
        """Whether the method can remove tokens from the distribution (not greedy)."""
        return not isinstance(self.strategy, Full | Greedy)


class Draw(NamedTuple):
    """One sampled token per row and its statistics (all [B]).

    Attributes:
      tokens: int32 chosen ids.
      logprobs: float32 log-prob of the token under the temperature-scaled full
        distribution.
      entropies: float32 entropy of the temperature-scaled full distribution.
      sampling_logprobs: float32 log-prob under the distribution actually sampled
        from (the method's survivors, renormalised; 0 for greedy).
    """

    tokens: jax.Array
    logprobs: jax.Array
    entropies: jax.Array
    sampling_logprobs: jax.Array


def sample_key(
    seed: int | jax.Array, step: int | jax.Array, prompt: int | jax.Array, sample: int | jax.Array
) -> jax.Array:
    """The base key of one sample: ``fold_in(seed, step, prompt, sample)``.

    Token ``t`` of the sample is drawn with ``fold_in(base, t)``, so a sample's
    randomness never depends on the decode slot or batch it ran in.
    """
    if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        key = seed
    else:
        key = jax.random.key(seed)  # an int, possibly traced (inside jit)
    for x in (step, prompt, sample):
        key = jax.random.fold_in(key, x)
    return key


def logprobs_and_entropy(
    logits_BV: jax.Array, tokens_B: jax.Array, temperature: float
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``tokens_B`` and entropy under softmax(logits / temperature), fp32.

    The trainer's formula (``model.logprobs.logprob_entropy_lse``), so the behaviour
    log-probs the sampler records are those the trainer recomputes.
    """
    logp_B, ent_B, _ = logprob_entropy_lse(logits_BV.astype(jnp.float32) / temperature, tokens_B)
    return logp_B, ent_B


def _order_keys(z_BV: jax.Array) -> jax.Array:
    """uint32 keys whose unsigned order is the float order of ``z_BV`` (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(z_BV, jnp.uint32)
    sign = bits >> 31
    return jnp.where(sign == 1, ~bits, bits | jnp.uint32(0x80000000))


def _threshold_mask(z_BV: jax.Array, weight_BV: jax.Array, need_B: jax.Array) -> jax.Array:
    """Keeps the largest-``z`` entries whose summed ``weight`` first reaches ``need``.

    Finds, per row, the largest t with sum(weight[z >= t]) >= need by bisection on
    the order-preserving integer image of the floats: 32 masked sums instead of a
    full sort (a [32, 32768] sort costs ~0.24 s on CPU). Exact; entries tied with
    the threshold are all kept.
    """
    key_BV = _order_keys(z_BV)
    lo_B = jnp.min(key_BV, axis=-1)  # sum(weight[key >= lo]) = total >= need
    hi_B = jnp.max(key_BV, axis=-1)

    def mass(t_B):
        return jnp.sum(jnp.where(key_BV >= t_B[:, None], weight_BV, 0), axis=-1)

    # Invariant: mass(lo) >= need; mass(hi + 1) < need (hi is the largest key).
    def body(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo + 1) // 2
        ok = (mass(mid) >= need_B) & (hi > lo)
        return jnp.where(ok, mid, lo), jnp.where(ok | (hi <= lo), hi, mid - 1)

    lo_B, _ = jax.lax.fori_loop(0, 32, body, (lo_B, hi_B))
    return key_BV >= lo_B[:, None]


def truncate(z_BV: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Sets logits outside the top-k, then outside the top-p nucleus, to -inf.

    As Hugging Face's warpers: top-k first, then top-p on the renormalised
    survivors, keeping tokens whose more-probable mass is below ``top_p`` (so at
    least one token survives). Ties at either threshold are kept.
    """
    neg_inf = jnp.float32(-jnp.inf)
    if top_k > 0 and top_k < z_BV.shape[-1]:
        need = jnp.full(z_BV.shape[:1], top_k, jnp.float32)
        keep = _threshold_mask(z_BV, jnp.ones_like(z_BV), need)
        z_BV = jnp.where(keep, z_BV, neg_inf)
    if top_p < 1.0:
        w_BV = jnp.exp(z_BV - jnp.max(z_BV, axis=-1, keepdims=True))
        need = top_p * jnp.sum(w_BV, axis=-1)
        keep = _threshold_mask(z_BV, w_BV, need)
        z_BV = jnp.where(keep, z_BV, neg_inf)
    return z_BV


def _inverse_cdf(z_BV: jax.Array, u_B: jax.Array) -> jax.Array:
    """Token whose cumulative probability first exceeds ``u`` (u in [0, 1)), per row."""
    b, v = z_BV.shape
    pad = (-v) % _BLOCK
    w_BV = jnp.exp(z_BV - jnp.max(z_BV, axis=-1, keepdims=True))
    w_BNC = jnp.pad(w_BV, ((0, 0), (0, pad))).reshape(b, -1, _BLOCK)
    block_BN = jnp.sum(w_BNC, axis=-1)
    cum_BN = jnp.cumsum(block_BN, axis=-1)
    total_B = cum_BN[:, -1]
    # Clamp below the total so some entry always exceeds it: the chosen entry then
    # has positive weight, never a masked one.
    target_B = jnp.minimum(u_B * total_B, jnp.nextafter(total_B, 0.0))
    blk_B = jnp.argmax(cum_BN > target_B[:, None], axis=-1)
    before_B = jnp.take_along_axis(cum_BN - block_BN, blk_B[:, None], axis=-1)[:, 0]
    row_BC = jnp.take_along_axis(w_BNC, blk_B[:, None, None], axis=1)[:, 0]
    cum_BC = jnp.cumsum(row_BC, axis=-1)
    rest_B = jnp.clip(target_B - before_B, 0.0, jnp.nextafter(cum_BC[:, -1], 0.0))
    within_B = jnp.argmax(cum_BC > rest_B[:, None], axis=-1)
    return (blk_B * _BLOCK + within_B).astype(jnp.int32)


def draw(logits_BV: jax.Array, keys_B: jax.Array, config: SamplingConfig) -> Draw:
    """Samples one token per row.

    Args:
      logits_BV: [B, V] raw logits (any float dtype; computed in fp32).
      keys_B: [B] typed PRNG keys, one per row (ignored when greedy).
      config: the temperature and sampling method (static).

    Returns:
      A ``Draw`` of [B] arrays.
    """
    z_BV = logits_BV.astype(jnp.float32) / config.temperature
    if isinstance(config.strategy, Greedy):  # its one survivor, without drawing
        tokens_B = jnp.argmax(z_BV, axis=-1).astype(jnp.int32)
        logp_B, ent_B = logprobs_and_entropy(z_BV, tokens_B, 1.0)
        return Draw(tokens_B, logp_B, ent_B, jnp.zeros_like(logp_B))
    zt_BV = config.strategy.restrict(z_BV) if config.truncates else z_BV
    if zt_BV.shape != z_BV.shape:
        name = type(config.strategy).__name__
        raise ValueError(f"sampling method {name}: restrict gave {zt_BV.shape}, not {z_BV.shape}")
    u_B = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_B)
    tokens_B = _inverse_cdf(zt_BV, u_B)
    logp_B, ent_B = logprobs_and_entropy(z_BV, tokens_B, 1.0)
    if config.truncates:
        slp_B, _ = logprobs_and_entropy(zt_BV, tokens_B, 1.0)
    else:
        slp_B = logp_B
    return Draw(tokens_B, logp_B, ent_B, slp_B)
