"""What a run trains, read once: the policy, its tokenizer, the meshes and the training
prompts (``load_inputs``), in the trainer's process and in the rollout process alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from magic_jax.data.rows import offline_filter
from magic_jax.data.sources import read_rows
from magic_jax.run.config import ConfigError, TrainConfig
from magic_jax.run.evaluation import tokenize_logged
from magic_jax.run.policy import RunTokenizer, load_policy, load_tokenizer

if TYPE_CHECKING:
    from flax import nnx
    from jax.sharding import Mesh

    from magic_jax.data.rows import PromptRow
    from magic_jax.model.qwen2 import Qwen2
    from magic_jax.rollout.protocols import Params


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """What a run trains, read once (``load_inputs``).

    Attributes:
      model: the policy (its weights are split out as the train state's).
      graphdef: the policy's ``nnx`` graph, without weights.
      tokenizer: the run's tokenizer; ``pad_id`` its padding id.
      rows: the training prompts, tokenised once, offline filtering applied.
      mesh: the update's mesh (None: one device); ``rollout_mesh`` the rollout's
        when ``rollout.devices`` splits them (else None).
    """

    model: Qwen2
    graphdef: nnx.GraphDef
    tokenizer: RunTokenizer
    pad_id: int
    rows: list[PromptRow]
    mesh: Mesh | None
    rollout_mesh: Mesh | None


def load_inputs(
    cfg: TrainConfig,
    *,
    log: Callable[[str], None] = print,
    meshes: tuple[Mesh | None, Mesh | None] | None = None,
) -> tuple[RunInputs, Params]:
    """The run's policy, tokenizer, meshes and training prompts, and the initial weights.
    ``meshes``: (the update's, the rollout's) where not ``overlap.split_meshes``'.

    Raises:
      ConfigError: no prompt fits ``data.max_prompt_length``.
    """
    from flax import nnx

    from magic_jax.run.overlap import split_meshes

    log(f"[sampling] {cfg.sampling.describe()}")  # the run's first line names the method
    ro = cfg.rollout
    ov = ro.mode == "overlap"
    if meshes is None:
        meshes = split_meshes(cfg.mesh, ro.devices, overlap=ov, log=log)
    mesh, rollout_mesh = meshes
    model = load_policy(cfg.model, cfg.param_dtype, mesh)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    graphdef, params = nnx.split(model, nnx.Param)
    rows = read_rows(cfg.data.train)
    n_read = len(rows)
    if (d := cfg.data).offline_filter_model:
        keep = d.offline_filter_keep_unrated
        rows = offline_filter(
            rows, d.offline_filter_model, d.offline_filter_samples, keep_unrated=keep
        )
    # the one tokenisation of the run's prompts: the rollouts sample from row.token_ids
    kept, _ = tokenize_logged(rows, tokenizer, d.max_prompt_length, "data.train", log)
    if not kept:
        raise ConfigError(
            f"data.max_prompt_length: all {len(rows)} prompts are longer than "
            f"{d.max_prompt_length} tokens"
        )
    log(
        f"[data] {n_read} prompts read, {len(kept)} after filtering; "
        f"{len(cfg.stages)} stage(s), {cfg.total_steps} steps"
    )
    pad_id = tokenizer.pad_token_id or 0
    return RunInputs(model, graphdef, tokenizer, pad_id, kept, mesh, rollout_mesh), params
