"""Supervised fine-tuning on (prompt, response) pairs: the warm-up before RL.

The loss is the mean negative log-likelihood of the response tokens (EOS
included), computed from hidden states with the same chunked projection as
the RL loss, so the [B, T, V] logits are never materialised. One jitted,
donated step per batch; AdamW with global-norm clipping and a linear warm-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from magic_jax.model.logprobs import token_logprobs_and_entropy


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Optimiser of the warm-up.

    Attributes:
      learning_rate: peak learning rate (after warm-up; constant afterwards,
        unless ``decay_steps`` is set).
      warmup_steps: linear warm-up from 0.
      decay_steps: if set, a cosine decay over this many steps after warm-up,
        to ``final_fraction`` of the peak (then constant).
      final_fraction: the decay's end, as a fraction of ``learning_rate``.
      weight_decay: AdamW decoupled weight decay.
      max_grad_norm: global-norm clip (None: off).
      logit_chunk: sequence positions per chunk of the output projection.
    """

    learning_rate: float = 2e-3
    warmup_steps: int = 20
    decay_steps: int | None = None
    final_fraction: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    logit_chunk: int = 256

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


def pack_sft(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    *,
    length: int | None = None,
    bucket: int = 32,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Right-padded [B, L] token rows with the mask of the response targets.

    Args:
      prompts / responses: token ids per example (the response with its EOS).
      length: fixed L (must fit every example); default the longest rounded
        up to a multiple of ``bucket``.
      pad_id: id of padding slots.

    Returns:
      ``tokens``, ``positions``, ``attention_mask`` [B, L] int32 and
      ``loss_mask`` [B, L - 1] float32 (1 where position t predicts a response
      token t + 1).
    """
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"pack_sft: {len(prompts)} prompts and {len(responses)} responses")
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    L = length or -(-longest // bucket) * bucket
    if longest > L:
        raise ValueError(f"pack_sft: an example has {longest} tokens > length {L}")
    B = len(prompts)
    tokens = np.full((B, L), pad_id, np.int32)
    attn = np.zeros((B, L), np.int32)
    loss = np.zeros((B, L - 1), np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        tokens[i, :n] = np.concatenate([p, r])
        attn[i, :n] = 1
        loss[i, len(p) - 1 : n - 1] = 1.0
    positions = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()
    return {"tokens": tokens, "positions": positions, "attention_mask": attn, "loss_mask": loss}


def sft_loss(
    params: Any, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef, chunk: int = 256
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean negative log-likelihood of the response tokens."""
    model = nnx.merge(graphdef, params)
    hidden = model(
        batch["tokens"],
        positions=batch["positions"],
        attention_mask=batch["attention_mask"],
        return_hidden=True,
    )
    logp, _ = token_logprobs_and_entropy(
        hidden[:, :-1],
        model.unembedding(),
        batch["tokens"][:, 1:],
        chunk_size=chunk,
        compute_dtype=model.config.dtype,
    )
    mask = batch["loss_mask"]
    n = jnp.maximum(mask.sum(), 1.0)
    loss = -(logp * mask).sum() / n
    return loss, {"loss": loss, "tokens": mask.sum()}


class SFTTrainer:
    """A jitted, donated SFT step over a parameter state.

    Example:
      graphdef, params = nnx.split(model, nnx.Param)
      sft = SFTTrainer(graphdef, params, SFTConfig())
      metrics = sft.step(pack_sft(prompts, responses))
      model = nnx.merge(graphdef, sft.params)
    """

    def __init__(self, graphdef: nnx.GraphDef, params: Any, config: SFTConfig):
        self.graphdef = graphdef
        self.config = config
        warmup = max(config.warmup_steps, 1)
        schedule = optax.linear_schedule(0.0, config.learning_rate, warmup)
        if config.decay_steps:
            decay = optax.cosine_decay_schedule(
                config.learning_rate, config.decay_steps, alpha=config.final_fraction
            )
            schedule = optax.join_schedules([schedule, decay], [warmup])
        tx = optax.adamw(schedule, weight_decay=config.weight_decay)
        if config.max_grad_norm is not None:
            tx = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), tx)
        self._state = (params, tx.init(params))

        def step(state, batch):
            params, opt_state = state
            (_, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(
                params, batch, graphdef=graphdef, chunk=config.logit_chunk
            )
            updates, opt_state = tx.update(grads, opt_state, params)
            metrics["grad_norm"] = optax.tree.norm(grads)
            return (optax.apply_updates(params, updates), opt_state), metrics

        self._step = jax.jit(step, donate_argnums=0)

    @property
    def params(self) -> Any:
        return self._state[0]

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One optimizer step; returns its metrics as floats."""
        self._state, metrics = self._step(self._state, batch)
        return {k: float(v) for k, v in metrics.items()}


def train_sft(
    sft: SFTTrainer,
    make_batch: Callable[[int], dict[str, np.ndarray]],
    *,
    steps: int | None = None,
    seconds: float | None = None,
    evaluate: Callable[[Any, int], float | dict[str, float]] | None = None,
    eval_every: int = 100,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs SFT steps until ``steps`` or ``seconds`` (wall, evaluations excluded) run out.

    Args:
      sft: the trainer (its parameters advance in place).
      make_batch: step index -> a ``pack_sft`` batch.
      steps / seconds: budgets; at least one must be given; the first reached ends.
      evaluate: (params, step) -> held-out accuracy (or a dict of figures with
        ``accuracy``), called every ``eval_every`` steps and at the end.
      log: progress lines.

    Returns:
      ``steps``, ``train_s`` (wall seconds of training steps), ``loss`` (last),
      ``evals`` (a list of {step, train_s, accuracy, ...}).
    """
    import time

    if steps is None and seconds is None:
        raise ValueError("train_sft: give steps or seconds")
    step, train_s, loss, evals = 0, 0.0, float("nan"), []

    def run_eval():
        got = evaluate(sft.params, step)
        got = got if isinstance(got, dict) else {"accuracy": got}
        evals.append({"step": step, "train_s": train_s, **got})
        extra = "".join(f"  {k} {v:.3f}" for k, v in got.items() if k != "accuracy")
        log(
            f"[sft step {step}] loss {loss:.4f}  held-out {got['accuracy']:.3f}{extra}  "
            f"({train_s:.0f}s training)"
        )

    while (steps is None or step < steps) and (seconds is None or train_s < seconds):
        batch = make_batch(step)
        t0 = time.perf_counter()
        loss = sft.step(batch)["loss"]
        train_s += time.perf_counter() - t0
        step += 1
        if evaluate is not None and step % eval_every == 0:
            run_eval()
    if evaluate is not None and (not evals or evals[-1]["step"] != step):
        run_eval()
    return {"steps": step, "train_s": train_s, "loss": loss, "evals": evals}
