"""One process of tests/multihost_test.py: an update and a reshard over a global mesh.

Run as ``python multihost_worker.py OUT MODEL_DIR NUM_PROCESSES PROCESS_ID PORT``; the
number of CPU devices per process comes from XLA_FLAGS. With one process the same
program runs without jax.distributed (the reference). Process 0 writes OUT/result.npz.

``python multihost_worker.py loop OUT NUM_PROCESSES PROCESS_ID PORT WATCHDOG_S`` is one
process of tests/multihost_failure_test.py instead: steps of collectives with the
failure handling of ``magic-jax train`` (``loop``).
"""

import sys

import numpy as np

from magic_jax.testing import Sample


def samples(vocab: int, num_prompts: int = 4, group: int = 4, seed: int = 0):
    """Ragged random responses with mixed rewards in every group (all of them train)."""
    rng = np.random.default_rng(seed)
    out, rewards = [], []
    for p in range(num_prompts):
        prompt = rng.integers(3, vocab, rng.integers(2, 7)).astype(np.int32)
        for s in range(group):
            n = int(rng.integers(1, 11))
            out.append(
                Sample(
                    p,
                    s,
                    prompt,
                    rng.integers(3, vocab, n).astype(np.int32),
                    np.log(rng.uniform(0.05, 0.9, n)).astype(np.float32),
                    rng.uniform(0.0, 2.0, n).astype(np.float32),
                    n == 10,
                    n,
                )
            )
            rewards.append(float(s % 2))
    return out, np.asarray(rewards, np.float32)


def main(out: str, model_dir: str, num_processes: int, process_id: int, port: int) -> None:
    import jax

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}",
            num_processes=num_processes,
            process_id=process_id,
        )
    from flax import nnx
    from jax.experimental import multihost_utils

    from magic_jax import distributed
    from magic_jax.model.convert import load_hf
    from magic_jax.model.sharding import SAMPLE_RULES, MeshConfig, make_mesh, model_shardings
    from magic_jax.rollout.engine import Engine, EngineConfig
    from magic_jax.update.buffer import pack_rollouts
    from magic_jax.update.config import UpdateConfig
    from magic_jax.update.losses import LossConfig
    from magic_jax.update.optim import OptimizerConfig
    from magic_jax.update.updater import PolicyUpdater

    assert jax.device_count() == 8 and jax.process_count() == num_processes
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    # Each process reads only its own shards of the checkpoint (make_array_from_callback).
    model = load_hf(model_dir, mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    cfg = UpdateConfig(
        mini_batch_groups=2,
        micro_batch_size=4,
        loss=LossConfig(eps_high=0.28, logit_chunk=8),
        # eps = 1: the step is lr * g / (|g| + 1), near linear in the gradient, so equal
        # parameters mean equal gradients (the first step of eps = 1e-8 is sign(g)).
        optimizer=OptimizerConfig(learning_rate=1.0, eps=1.0, weight_decay=0.0),
    )
    updater = PolicyUpdater(graphdef, cfg, mesh=mesh)
    recs, rewards = samples(model.config.vocab_size)
    buffer = pack_rollouts(recs, rewards, prompt_bucket=8, response_bucket=8)
    state, metrics = updater.update(updater.init_state(params), buffer, jax.random.key(1))
    # the trainer -> engine move that rollouts use (all-gathers over fsdp, on device)
    engine = Engine(model, EngineConfig(max_concurrent_decodes=2, max_prefill_length=8,
                                        max_decode_length=8), mesh=mesh)  # fmt: skip
    engine_params = engine.load_params(state.params)
    want = model_shardings(state.params, mesh, SAMPLE_RULES)
    same_layout = all(
        a.sharding.is_equivalent_to(b.sharding if hasattr(b, "sharding") else b, a.ndim)
        for a, b in zip(jax.tree.leaves(engine_params), jax.tree.leaves(want))
    )
    # Host-side agreement (magic_jax.distributed): ragged lists of unequal lengths.
    me = jax.process_index()
    ragged = distributed.allgather_ragged(
        [np.arange(i + 1, dtype=np.int32) * (me + 1) for i in range(me + 1)], np.int32
    )
    strings = distributed.allgather_strings(["é" * me, f"p{me}"])
    largest = distributed.max_int(me * 7)
    chosen = distributed.on_primary(lambda: 11 + me)  # process 0's answer on all
    trained = multihost_utils.process_allgather(state.params, tiled=True)
    resharded = multihost_utils.process_allgather(engine_params, tiled=True)
    if jax.process_index() == 0:
        flat = {
            f"param/{jax.tree_util.keystr(k)}": np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(trained)[0]
        }
        flat |= {
            f"engine/{jax.tree_util.keystr(k)}": np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(resharded)[0]
        }
        flat |= {f"metric/{k}": np.asarray(v) for k, v in metrics.items()}
        flat["same_layout"] = np.asarray(same_layout)
        flat["process_count"] = np.asarray(jax.process_count())
        flat["ragged"] = np.concatenate(ragged)
        flat["ragged_sizes"] = np.asarray([len(a) for a in ragged])
        flat["strings"] = np.asarray(strings)
        flat["max_int"] = np.asarray(largest)
        flat["on_primary"] = np.asarray(chosen)
        np.savez(f"{out}/result.npz", **flat)


def loop(out: str, num_processes: int, process_id: int, port: int, watchdog_s: float) -> None:
    """200 steps of an all-gather (and a beat), failing as ``magic-jax train`` fails.

    The test hooks choose the fault: ``MAGIC_JAX_FAULT_AT=raise:loop:S`` / ``hang:loop:S``
    (``magic_jax.watchdog``) and ``MAGIC_JAX_KILL_AT=step:S`` (SIGKILL). ``watchdog_s`` 0:
    no watchdog. Reports go to OUT/logs.
    """
    import time
    import traceback

    import jax

    from magic_jax import distributed, interrupt, watchdog

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=num_processes,
        process_id=process_id,
        **distributed.initialize_options(),
    )
    from jax.experimental import multihost_utils

    distributed.watch_failures(lambda: f"{out}/logs")
    print(f"[loop] process {process_id} started at {time.time():.3f}", flush=True)
    try:
        with watchdog.Watchdog(watchdog_s or None, out):
            for step in range(200):
                interrupt.at(step)
                interrupt.kill_point("step", step)
                watchdog.beat("loop")
                got = multihost_utils.process_allgather(np.asarray([step], np.int32))
                assert list(got.reshape(-1)) == [step] * num_processes
                time.sleep(0.05)
    except Exception:  # as jobs/cli.py does for `magic-jax train`
        traceback.print_exc()
        name = f"{out}/logs/{distributed.report_name('failure')}"
        distributed.end_job(traceback.format_exc(), 1, log_file=name)


if __name__ == "__main__":
    if sys.argv[1] == "loop":
        o, n, i, port, wd = sys.argv[2:]
        loop(o, int(n), int(i), int(port), float(wd))
    else:
        o, m, n, i, port = sys.argv[1:]
        main(o, m, int(n), int(i), int(port))
