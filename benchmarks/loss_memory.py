"""Compiled memory of the chunked log-prob/entropy loss, and update throughput against PyTorch.

Part 1 compiles (never runs) log-prob + entropy + MAGIC loss, forward and backward
with respect to the hidden states and the unembedding, for the 7B shape
(D 3584, V 152064, batch 1) at several T, once chunked over the sequence and once
materialising the full logits, and reads XLA's memory analysis (temp + argument +
output bytes).

Part 2 times the full update step (Qwen2 forward + backward, clipped token loss
with entropy bonus, grad-norm clip, AdamW) on a small Qwen2-shaped model in JAX
and the same computation in PyTorch (transformers ``Qwen2ForCausalLM``, same
weights), on this machine's CPU, in the same run.

    .venv/bin/python benchmarks/loss_memory.py            # both parts
    .venv/bin/python benchmarks/loss_memory.py --quick    # a small model, fewer steps
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from magic_jax.model.logprobs import logprob_entropy_lse, token_logprobs_and_entropy
from magic_jax.update.buffer import RolloutBuffer
from magic_jax.update.config import UpdateConfig
from magic_jax.update.losses import LossConfig, policy_loss
from magic_jax.update.optim import OptimizerConfig
from magic_jax.update.updater import PolicyUpdater

GIB = 2**30


# --------------------------------------------------------------------------- part 1: memory


def token_logprobs_and_entropy_naive(h_BTD, w_DV, tgt_BT):
    """The unchunked reference: the full [B, T, V] logits, autodiff's backward pass."""
    z_BTV = jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32)
    logp_BT, ent_BT, _ = logprob_entropy_lse(z_BTV, tgt_BT)
    return logp_BT, ent_BT


def _loss_grad(chunk: int | None):
    cfg = LossConfig()

    def loss(h_BTD, w_DV, tgt_BT, old_BT, adv_B, mask_BT):
        if chunk is None:
            logp, ent = token_logprobs_and_entropy_naive(h_BTD, w_DV, tgt_BT)
        else:
            logp, ent = token_logprobs_and_entropy(h_BTD, w_DV, tgt_BT, chunk_size=chunk)
        out, _ = policy_loss(
            logp, old_BT, adv_B, mask_BT, ent, alpha=0.005, config=cfg, num_tokens=mask_BT.sum()
        )
        return out

    return jax.grad(loss, argnums=(0, 1))


def compiled_bytes(t: int, chunk: int | None, d: int, v: int, dtype) -> int:
    """temp + argument + output bytes of the compiled forward+backward (nothing allocated)."""
    f32, i32 = jnp.float32, jnp.int32
    args = (
        jax.ShapeDtypeStruct((1, t, d), dtype),
        jax.ShapeDtypeStruct((d, v), dtype),
        jax.ShapeDtypeStruct((1, t), i32),
        jax.ShapeDtypeStruct((1, t), f32),
        jax.ShapeDtypeStruct((1,), f32),
        jax.ShapeDtypeStruct((1, t), f32),
    )
    m = jax.jit(_loss_grad(chunk)).lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def memory_table(seq_lens, chunk: int, d: int, v: int, dtype) -> list[str]:
    rows = [
        f"Compiled memory, log-prob + entropy + loss, fwd+bwd w.r.t. hidden and unembedding "
        f"(D {d}, V {v}, batch 1, {jnp.dtype(dtype).name}; temp + args + outputs)",
        f"| T | chunked (C={chunk}) GiB | naive GiB | naive / chunked | full fp32 logits GiB |",
        "|---|---|---|---|---|",
    ]
    for t in seq_lens:
        c = compiled_bytes(t, chunk, d, v, dtype)
        n = compiled_bytes(t, None, d, v, dtype)
        rows.append(
            f"| {t} | {c / GIB:.2f} | {n / GIB:.2f} | {n / c:.1f}x | {t * v * 4 / GIB:.2f} |"
        )
    return rows


# --------------------------------------------------------------------------- part 2: throughput


def _batch(b: int, p: int, r: int, v: int, seed: int = 0) -> RolloutBuffer:
    rng = np.random.default_rng(seed)
    length = p + r
    return RolloutBuffer(
        tokens=rng.integers(3, v, (b, length)).astype(np.int32),
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),
        attention_mask=np.ones((b, length), np.int32),
        response_mask=np.ones((b, r), np.float32),
        old_logprobs=(-np.log(v) + rng.uniform(-0.3, 0.3, (b, r))).astype(np.float32),
        entropies=np.zeros((b, r), np.float32),
        rewards=np.zeros((b,), np.float32),
        truncated=np.zeros((b,), bool),
        group_ids=np.zeros((b,), np.int32),
        advantages=rng.choice([-1.0, 1.0], b).astype(np.float32)
        * rng.uniform(0.5, 2.0, b).astype(np.float32),
        keep=np.ones((b,), bool),
        valid=np.ones((b,), bool),
        group_size=b,
    )


def _time(fn, steps: int) -> tuple[float, float]:
    """Runs one warm-up call (compile), then ``steps`` timed calls; returns (s/step, first loss)."""
    first = fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps, first


def jax_update(
    model_dir: str, batch: RolloutBuffer, loss_cfg: LossConfig, alpha: float, steps: int
):
    from flax import nnx

    from magic_jax.model.convert import load_hf

    model = load_hf(model_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    cfg = UpdateConfig(mini_batch_groups=1, loss=loss_cfg, optimizer=OptimizerConfig())
    updater = PolicyUpdater(graphdef, cfg)
    box = {"state": updater.init_state(params)}

    def step():
        box["state"], m = updater.train_step(box["state"], batch, alpha)
        return float(m["loss"])  # blocks until the step is done

    return _time(step, steps)


def torch_update(
    model_dir: str, batch: RolloutBuffer, loss_cfg: LossConfig, alpha: float, steps: int
):
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.train()
    o = OptimizerConfig()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.learning_rate,
        betas=(o.b1, o.b2),
        eps=o.eps,
        weight_decay=o.weight_decay,
    )
    p0 = batch.prompt_len
    ids = torch.as_tensor(batch.tokens, dtype=torch.long)
    pos = torch.as_tensor(batch.positions, dtype=torch.long)
    attn = torch.as_tensor(batch.attention_mask, dtype=torch.long)
    tgt = ids[:, p0:]
    old = torch.as_tensor(batch.old_logprobs)
    adv = torch.as_tensor(batch.advantages)[:, None]
    mask = torch.as_tensor(batch.loss_mask())

    def step():
        hidden = model.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
        logits = model.lm_head(hidden[:, p0 - 1 : -1]).float() / loss_cfg.temperature
        logq = torch.log_softmax(logits, -1)
        logp = logq.gather(-1, tgt[..., None])[..., 0]
        ent = -(logq.exp() * logq).sum(-1)
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(1 - loss_cfg.eps_low, 1 + loss_cfg.eps_high)
        surr = torch.minimum(ratio * adv, clipped * adv)
        loss = ((-surr - alpha * ent) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        opt.step()
        return loss.item()

    return _time(step, steps)


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    batch: int
    prompt: int
    response: int


PEER = Shape(32768, 512, 1536, 8, 8, 2, 8, 64, 448)  # the notes' peer benchmark: 58M, 8 x 512
QUICK = Shape(4096, 128, 352, 2, 4, 2, 4, 32, 96)


def throughput_table(shape: Shape, steps: int, skip_torch: bool) -> list[str]:
    import torch

    from magic_jax.testing import make_hf_model, save_hf_model

    hf = make_hf_model(
        seed=0,
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    n_params = sum(p.numel() for p in hf.parameters())
    batch = _batch(shape.batch, shape.prompt, shape.response, shape.vocab)
    loss_cfg = LossConfig(eps_high=0.28)
    alpha = 0.005
    tokens = shape.batch * (shape.prompt + shape.response)
    with tempfile.TemporaryDirectory() as d:
        save_hf_model(hf, d)
        del hf
        j_s, j_loss = jax_update(d, batch, loss_cfg, alpha, steps)
        t_s, t_loss = (None, None) if skip_torch else torch_update(d, batch, loss_cfg, alpha, steps)
    rows = [
        f"Update step (fwd + bwd + clip + AdamW), Qwen2 V {shape.vocab} D {shape.hidden} "
        f"F {shape.mlp} L {shape.layers} heads {shape.heads}/{shape.kv_heads}, "
        f"{n_params / 1e6:.0f}M params fp32, batch {shape.batch} x {shape.prompt + shape.response} "
        f"tokens, CPU ({jax.device_count()} JAX devices, torch threads {torch.get_num_threads()}), "
        f"{steps} timed steps after one warm-up",
        "| implementation | s / step | tokens / s | vs PyTorch | first-step loss |",
        "|---|---|---|---|---|",
    ]
    if t_s is not None:
        rows.append(
            f"| PyTorch (transformers) | {t_s:.2f} | {tokens / t_s:.0f} | 1.00x | {t_loss:.6f} |"
        )
    ratio = f"{t_s / j_s:.2f}x" if t_s else "-"
    rows.append(
        f"| magic_jax train_step | {j_s:.2f} | {tokens / j_s:.0f} | {ratio} | {j_loss:.6f} |"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--chunk", type=int, default=1024, help="sequence positions per logit chunk")
    ap.add_argument(
        "--bf16", action="store_true", help="bf16 hidden states and unembedding in part 1"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed update steps per framework")
    ap.add_argument("--quick", action="store_true", help="small model for part 2")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()
    out: list[str] = []
    if not args.skip_memory:
        dtype = jnp.bfloat16 if args.bf16 else jnp.float32
        out += memory_table(args.seq_lens, args.chunk, 3584, 152064, dtype)
        print("\n".join(out), flush=True)
    if not args.skip_throughput:
        rows = throughput_table(QUICK if args.quick else PEER, args.steps, args.skip_torch)
        print("\n" + "\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
