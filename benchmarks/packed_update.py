"""The update on packed rows against padded rows, and against PyTorch's token-balanced update.

One training step's update (forward, backward, grad clip, AdamW over one mini-batch of
``--groups`` x 8 responses) on a Qwen2-shaped model, the responses' lengths drawn from the
planner's length shapes (``tail``: lognormal with mean 0.35 T, 3% reaching T; ``early``:
mean 0.7 T, 40% at T; ``magic-jax plan --lengths``) and prompts of 32 to 128 tokens:

- ``padded``: ``update.packing: false``, every row at the step's longest prompt and
  response (P + T), micro-batches of 8 rows;
- ``packed``: ``update.packing: true``, rows laid end to end in bins of P + T slots, 8
  bins per micro-batch (the same activation memory), only the micro-batches that hold
  rows run;
- ``torch``: transformers' ``Qwen2ForCausalLM`` on the same weights, as the reference
  code runs its update (``use_dynamic_bsz``): rows balanced by tokens into micro-batches
  of at most 8 x (P + T) tokens, each padded to its own longest row (PyTorch on a CPU
  has no kernel for packed rows), gradients accumulated with the global token mean.

Each figure is the median of ``--reps`` timed updates (the compile is done first and not
timed), the three run alternately in one process; ratios are of medians from this run, of
wall time and of the process's CPU seconds (every thread; what compares on a loaded machine).

    .venv/bin/python benchmarks/packed_update.py                  # tail and early, T 2048
    .venv/bin/python benchmarks/packed_update.py --quick          # a smaller case
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from magic_jax.jobs.schedule_plan import SHAPES, LengthShape
from magic_jax.testing import Sample
from magic_jax.update.buffer import RolloutBuffer, pack_rollouts
from magic_jax.update.config import UpdateConfig
from magic_jax.update.losses import LossConfig
from magic_jax.update.packing import pack_rows
from magic_jax.update.updater import PolicyUpdater

G = 8  # responses per prompt
MICRO = 8  # rows (padded) or bins (packed) per micro-batch


@dataclasses.dataclass(frozen=True)
class Model:
    vocab: int
    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int


MODELS = {
    "tiny": Model(4096, 128, 352, 2, 4, 2),  # 1.4M parameters: minutes per case on 2 cores
    "small": Model(8192, 256, 768, 4, 4, 2),  # 5.8M
    "peer": Model(32768, 512, 1536, 8, 8, 2),  # loss_memory.py's 58M: hours on 2 cores
}


def rollouts(groups: int, t: int, shape: str, vocab: int, seed: int = 0) -> RolloutBuffer:
    """``groups`` x G responses with lengths of ``shape`` at T = ``t``, kept groups only."""
    rng = np.random.default_rng(seed)
    mean, clipped = SHAPES[shape]
    lengths = LengthShape(shape, mean, clipped).draw(groups * G, t, seed)
    samples, rewards = [], []
    for p in range(groups):
        prompt = rng.integers(3, vocab, int(rng.integers(32, 129))).astype(np.int32)
        for s in range(G):
            n = int(lengths[p * G + s])
            samples.append(
                Sample(
                    prompt_index=p,
                    sample_index=s,
                    prompt_tokens=prompt,
                    tokens=rng.integers(3, vocab, n).astype(np.int32),
                    logprobs=(-np.log(vocab) + rng.uniform(-0.3, 0.3, n)).astype(np.float32),
                    entropies=np.zeros(n, np.float32),
                    truncated=n == t,
                    length=n,
                )
            )
            rewards.append(float(s % 2))  # every group kept
    return pack_rollouts(samples, np.array(rewards, np.float32), prompt_bucket=64)


def jax_updater(graphdef, params, groups: int, packing: bool):
    cfg = UpdateConfig(
        mini_batch_groups=groups,
        micro_batch_size=MICRO,
        packing=packing,
        loss=LossConfig(eps_high=0.28),
    )
    updater = PolicyUpdater(graphdef, cfg)
    box = {"state": updater.init_state(jax.tree.map(jnp.copy, params))}
    return updater, box


def compile_only(updater: PolicyUpdater, box: dict, buf: RolloutBuffer) -> None:
    """Compiles the step the update will run by running it over no micro-batch."""
    batch = buf.take_groups(np.arange(buf.num_groups))
    if updater.config.packing:
        packed, _ = pack_rows(batch, updater.packed_bins(G, batch.tokens.shape[1]))
        box["state"], m = updater.train_step(box["state"], batch, 0.0, packed=packed, live_micro=0)
    else:
        micro = updater.live_micro_rows(G)
        box["state"], m = updater.train_step(
            box["state"], batch, 0.0, micro_rows=micro, live_micro=0
        )
    jax.block_until_ready(m)


def clocks() -> tuple[float, float]:
    """(wall, this process's CPU seconds, every thread): on a loaded machine the CPU
    seconds still compare the work done."""
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    t1 = clocks()
    return t1[0] - t0[0], t1[1] - t0[1]


def jax_step(updater: PolicyUpdater, box: dict, buf: RolloutBuffer) -> tuple[tuple, float]:
    t0 = clocks()
    box["state"], m = updater.update(box["state"], buf, jax.random.key(0))
    loss = float(m["loss"][0])
    box["alpha"] = float(m["alpha"])  # the entropy bonus's coefficient, for the peer
    return since(t0), loss


def balanced_micro_batches(lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """verl's dynamic batch size: rows into ceil(tokens / budget) micro-batches of balanced
    token counts (largest first onto the lightest), each at most ``budget`` tokens (more
    micro-batches when one would not fit)."""
    n = max(1, -(-int(lengths.sum()) // budget))
    while True:
        load, parts = np.zeros(n), [[] for _ in range(n)]
        for i in np.argsort(-lengths, kind="stable"):
            j = int(np.argmin(load))
            parts[j].append(i)
            load[j] += lengths[i]
        if load.max() <= budget:
            return [np.array(sorted(p)) for p in parts if p]
        n += 1


def torch_step_fn(model_dir: str, buf: RolloutBuffer, budget: int, alpha: dict):
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    lcfg = LossConfig(eps_high=0.28)
    attn = np.asarray(buf.attention_mask).astype(bool)
    p_len = buf.prompt_len
    rows = [np.asarray(buf.tokens)[r][attn[r]] for r in range(buf.num_rows)]
    plen = attn[:, :p_len].sum(-1)
    rlen = np.asarray(buf.response_mask).sum(-1).astype(int)
    lengths = np.array([len(r) for r in rows])
    total_tokens = float(rlen.sum())

    def micro(idx):
        width = int(lengths[idx].max())
        ids = np.zeros((len(idx), width), np.int64)
        mask = np.zeros((len(idx), width), np.int64)
        resp = np.zeros((len(idx), width), np.float32)  # 1 where the position predicts a token
        old = np.zeros((len(idx), width), np.float32)
        for k, r in enumerate(idx):
            ids[k, : lengths[r]] = rows[r]
            mask[k, : lengths[r]] = 1
            resp[k, plen[r] - 1 : plen[r] - 1 + rlen[r]] = 1.0
            old[k, plen[r] - 1 : plen[r] - 1 + rlen[r]] = buf.old_logprobs[r, : rlen[r]]
        adv = np.asarray(buf.advantages)[idx][:, None]
        t = torch.as_tensor
        return t(ids), t(mask), t(resp), t(old), t(adv)

    def step():
        t0 = clocks()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for idx in balanced_micro_batches(lengths, budget):
            ids, mask, resp, old, adv = micro(idx)
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            logits = logits / lcfg.temperature
            logq = torch.log_softmax(logits[:, :-1], -1)
            logp = logq.gather(-1, ids[:, 1:, None])[..., 0]
            ent = -(logq.exp() * logq).sum(-1)
            m, old_ = resp[:, :-1], old[:, :-1]
            ratio = torch.exp((logp - old_) * m)
            clipped = ratio.clamp(1 - lcfg.eps_low, 1 + lcfg.eps_high)
            surr = torch.minimum(ratio * adv, clipped * adv)
            loss = ((-surr - alpha["alpha"] * ent) * m).sum() / total_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return since(t0), total

    return step


def case(model: Model, groups: int, t: int, shape: str, reps: int, skip_torch: bool) -> list:
    from flax import nnx

    from magic_jax.model.convert import load_hf
    from magic_jax.testing import make_hf_model, save_hf_model

    hf = make_hf_model(
        seed=0,
        vocab_size=model.vocab,
        hidden_size=model.hidden,
        intermediate_size=model.mlp,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        max_position_embeddings=max(4096, 2 * t),
        tie_word_embeddings=False,
    )
    n_params = sum(p.numel() for p in hf.parameters())
    buf = rollouts(groups, t, shape, model.vocab)
    attn = np.asarray(buf.attention_mask)
    real = int(attn.sum())
    with tempfile.TemporaryDirectory() as d:
        save_hf_model(hf, d)
        del hf
        graphdef, params = nnx.split(load_hf(d), nnx.Param)
        runs = {}
        for packing in (False, True):
            updater, box = jax_updater(graphdef, params, groups, packing)
            t0 = time.perf_counter()
            compile_only(updater, box, buf)
            runs["packed" if packing else "padded"] = (updater, box, time.perf_counter() - t0)
        length = buf.tokens.shape[1]
        alpha = runs["padded"][1]  # holds the coefficient once the padded update has run
        torch_step = None if skip_torch else torch_step_fn(d, buf, MICRO * length, alpha)
        times: dict[str, list[tuple]] = {k: [] for k in ("padded", "packed", "torch")}
        losses = {}
        for _ in range(reps):
            for name, (updater, box, _) in runs.items():
                # the same starting weights each time: a fresh state from the parameters
                box["state"] = updater.init_state(jax.tree.map(jnp.copy, params))
                s, loss = jax_step(updater, box, buf)
                times[name].append(s)
                losses.setdefault(name, loss)  # the first update of the same weights
            if torch_step is not None:
                s, loss = torch_step()
                times["torch"].append(s)
                losses.setdefault("torch", loss)  # before its own optimizer steps
    _, n_live = pack_rows(buf, MICRO)
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items() if v}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items() if v}
    padded_slots = buf.num_rows * length
    packed_slots = n_live * MICRO * length
    head = (
        f"{shape} at T {t}: {groups} x {G} responses (mean {buf.response_mask.sum(-1).mean():.0f} "
        f"tokens, {(buf.response_mask.sum(-1) == t).mean() * 100:.0f}% at T), prompts 32-128, "
        f"rows of {length} slots; real tokens {real / padded_slots * 100:.0f}% of the padded "
        f"slots, {real / packed_slots * 100:.0f}% of the packed ({n_live} of "
        f"{buf.num_rows // MICRO} micro-batches); Qwen2 {n_params / 1e6:.1f}M fp32, "
        f"{reps} timed updates each (compile: padded {runs['padded'][2]:.0f} s, packed "
        f"{runs['packed'][2]:.0f} s)"
    )
    rows = [
        head,
        "| update | wall s (median; min-max) | CPU s (median) | vs padded wall / CPU "
        "| vs PyTorch wall / CPU | first loss |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("torch", "padded", "packed"):
        if name not in med:
            continue
        v = [w for w, _ in times[name]]
        vs_pad = f"{med['padded'] / med[name]:.2f}x / {cpu['padded'] / cpu[name]:.2f}x"
        vs_t = "-"
        if "torch" in med:
            vs_t = f"{med['torch'] / med[name]:.2f}x / {cpu['torch'] / cpu[name]:.2f}x"
        label = {
            "torch": "PyTorch, token-balanced micro-batches",
            "padded": "magic_jax, packing off",
            "packed": "magic_jax, packing on",
        }[name]
        rows.append(
            f"| {label} | {med[name]:.2f} ({min(v):.2f}-{max(v):.2f}) | {cpu[name]:.2f} "
            f"| {vs_pad} | {vs_t} | {losses[name]:.6f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--groups", type=int, default=16, help="prompts per mini-batch")
    ap.add_argument("--T", type=int, default=2048, help="the response length limit")
    ap.add_argument("--shapes", nargs="+", default=["tail", "early"], choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 x 8 responses at T 512")
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()
    model, groups, t = MODELS[args.model], args.groups, args.T
    if args.quick:
        groups, t = 4, 512
    for shape in args.shapes:
        rows = case(model, groups, t, shape, args.reps, args.skip_torch)
        print("\n".join(rows) + "\n", flush=True)


if __name__ == "__main__":
    main()
