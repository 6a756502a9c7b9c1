"""Training-run configuration: typed dataclasses read from YAML, with named errors.

A run is described by one YAML file (see ``configs/``): the model, data,
stages of the multi-stage schedule (SPEC item 9) and every option of the
objective, sampler, verifier pool and mesh. ``load_config`` checks it against
the dataclasses below: an unknown key, a wrong type or a bad value raises
``ConfigError`` naming its dotted path (``stages[1].max_response_length``).
``--set key.path=value`` overrides apply to the raw YAML before the check.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from magic_jax.model.sharding import MeshConfig
from magic_jax.rewards.pool import RewardsConfig
from magic_jax.rollout.engine_config import EngineOptions
from magic_jax.rollout.probes import get_probe
from magic_jax.rollout.sampling import SamplingConfig
from magic_jax.run.config_dict import ConfigError, apply_override, from_dict, import_extensions
from magic_jax.update.advantages import AdvantageConfig
from magic_jax.update.config import UpdateOptions
from magic_jax.update.entropy_control import EntropyControlConfig
from magic_jax.update.losses import LossConfig
from magic_jax.update.optim import OptimizerConfig

if TYPE_CHECKING:
    from magic_jax.run.rundir import JSON


@dataclasses.dataclass(frozen=True, kw_only=True)
class UntilConfig:
    """Rules that end a stage before its step budget (``steps`` stays the cap).

    Either rule set ends the stage when it holds; the switch is logged in the
    metrics (``stage_end``) and kept in checkpoints, so a resumed run switches
    at the same step.

    Attributes:
      truncated_below: end once the truncated fraction of the rollouts stays
        under this for ``truncated_steps`` consecutive steps (the report moves
        to a longer context when few responses hit the limit, or the reverse).
      truncated_steps: k of that rule.
      eval_patience: end after this many evaluations in a row with no gain in
        avg@n over the best of the stage so far (needs ``eval``).
      eval_min_gain: a gain under this does not count.
    """

    truncated_below: float | None = None
    truncated_steps: int = 1
    eval_patience: int | None = None
    eval_min_gain: float = 0.0

    def __post_init__(self):
        if self.truncated_below is None and self.eval_patience is None:
            raise ValueError("set truncated_below or eval_patience (or drop until)")
        if self.truncated_below is not None and not 0 < self.truncated_below <= 1:
            raise ValueError(f"truncated_below must be in (0, 1], got {self.truncated_below}")
        if self.truncated_steps < 1:
            raise ValueError(f"truncated_steps must be >= 1, got {self.truncated_steps}")
        if self.eval_patience is not None and self.eval_patience < 1:
            raise ValueError(f"eval_patience must be >= 1, got {self.eval_patience}")
        if self.eval_min_gain < 0:
            raise ValueError(f"eval_min_gain must be >= 0, got {self.eval_min_gain}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageConfig:
    """One stage of the multi-stage schedule (SPEC item 9).

    Attributes:
      steps: training steps in this stage (its budget).
      max_response_length: T, the response limit of this stage's rollouts.
      prompts_per_step: D_R, prompts sampled per training step.
      mini_batch_groups: D_T, prompts per optimizer step (N_SGD = D_R / D_T * N_reuse).
      group_size: G, responses per prompt.
      name: a label for logs.
      kl_beta: this stage's KL weight; None = ``loss.kl_beta`` (the report's
        ablation runs one stage with KL and the next without).
      until: rules that end the stage early (``steps`` is then the cap).
    """

    steps: int
    max_response_length: int
    prompts_per_step: int
    mini_batch_groups: int
    group_size: int
    name: str = ""
    kl_beta: float | None = None
    until: UntilConfig | None = None

    def __post_init__(self):
        for f in ("steps", "max_response_length", "prompts_per_step", "mini_batch_groups"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (group advantages), got {self.group_size}")
        if self.kl_beta is not None and self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.mini_batch_groups > self.prompts_per_step:
            raise ValueError(
                f"mini_batch_groups ({self.mini_batch_groups}) exceeds prompts_per_step "
                f"({self.prompts_per_step})"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training prompts.

    Attributes:
      train: files or directories of verl rows (``.parquet`` / ``.jsonl``).
      max_prompt_length: longer prompts are dropped (counted in the log).
      offline_filter_model: with ``offline_filter_samples``, drop prompts this
        model solved 0 or N of N times (``extra_info.model_difficulty``, as
        ``magic-jax estimate-difficulty`` writes it).
      offline_filter_samples: N of the difficulty table per ``ability``
        (``{math: 16, code: 8}``, the report's), or one N for every ability.
      offline_filter_keep_unrated: keep (default) or drop prompts that have no
        entry for ``offline_filter_model``.
      online_filter: at each new stage, drop prompts whose accuracy in the
        previous stage was 1 (SPEC item 10).
    """

    train: tuple[str, ...]
    max_prompt_length: int = 1024
    offline_filter_model: str | None = None
    offline_filter_samples: int | dict[str, int] = dataclasses.field(
        default_factory=lambda: {"math": 16, "code": 8}
    )
    offline_filter_keep_unrated: bool = True
    online_filter: bool = True

    def __post_init__(self):
        if not self.train:
            raise ValueError("train must name at least one file or directory")
        n = self.offline_filter_samples
        for ability, v in n.items() if isinstance(n, dict) else [("", n)]:
            if v <= 0:
                where = f"[{ability}]" if ability else ""
                raise ValueError(f"offline_filter_samples{where} must be positive, got {v}")
        if self.max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {self.max_prompt_length}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig(EngineOptions):
    """The rollouts: the decode engine's options (``EngineOptions``: slots, dtypes,
    attention, lanes; the sampling distribution itself is ``sampling``) and the
    rollout loop's own.

    Attributes:
      truncation: ``"no_eos"`` (report) or ``"length"`` (reference code).
      refill: DAPO's dynamic sampling: while fewer than D_R groups have mixed
        rewards, sample another D_R prompts (up to ``refill_max_rounds`` extra
        rounds) and train on D_R mixed groups. Off by default, as in the report
        (rejection sampling without refill).
      refill_max_rounds: cap of extra rounds per step.
      mode: ``sync`` generates step k's responses with the policy after k updates,
        then updates; ``overlap`` generates ahead in a second thread while the
        update runs (``run/overlap.py``, docs/training.md#overlap).
      max_staleness: with ``overlap``, s: step k's rollout starts under the policy
        after ``max(0, k - s)`` updates (0 is sync's schedule, in the overlap code).
      publish_chunks: with ``overlap``, partial rollouts: every this many decode
        chunks (per lane) the responses in flight move to the next policy version,
        up to the newest the step may use (k); null: a rollout keeps the version it
        started with.
      publish_cache: with ``publish_chunks``, what the responses in flight keep at a
        version change: ``keep`` their KV cache (written by the older version, as
        PipelineRL), or ``reprefill`` it (prompt and response so far prefilled again
        under the new version, as AReaL: each token is then exactly its version's).
      devices: with ``overlap`` and a ``mesh``, the first this many devices generate
        (their own mesh, weights resharded to it when published) and the others
        update (``mesh`` over them); null: both share every device.
      hosts: with ``overlap``, the job's first this many processes generate and the
        others update, as two JAX runtimes with the weights pulled across at each
        version (``run/remote.py``); 1 for now, in a job of 2 processes.
    """

    truncation: Literal["no_eos", "length"] = "no_eos"
    refill: bool = False
    refill_max_rounds: int = 4
    mode: Literal["sync", "overlap"] = "sync"
    max_staleness: int = 1
    publish_chunks: int | None = None
    publish_cache: Literal["keep", "reprefill"] = "keep"
    devices: int | None = None
    hosts: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.truncation not in ("no_eos", "length"):
            raise ValueError(f"truncation: must be 'no_eos' or 'length', got {self.truncation!r}")
        if self.refill_max_rounds < 1:
            raise ValueError(f"refill_max_rounds: must be >= 1, got {self.refill_max_rounds}")
        if self.mode not in ("sync", "overlap"):
            raise ValueError(f"mode: must be 'sync' or 'overlap', got {self.mode!r}")
        for name, low in (
            ("max_staleness", 0),
            ("publish_chunks", 1),
            ("devices", 1),
            ("hosts", 1),
        ):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"{name}: must be an integer >= {low}, got {v!r}")
        if self.max_staleness is None:
            raise ValueError("max_staleness: must be an integer >= 0, got None")
        if self.mode == "sync" and (self.publish_chunks, self.devices, self.hosts) != (None,) * 3:
            raise ValueError("publish_chunks, devices and hosts: need mode: overlap")
        if self.hosts is not None and self.devices is not None:
            raise ValueError("hosts and devices: split by processes or by devices, not both")
        if self.publish_cache not in ("keep", "reprefill"):
            raise ValueError(
                f"publish_cache: must be 'keep' or 'reprefill', got {self.publish_cache!r}"
            )
        if self.publish_cache == "reprefill" and self.publish_chunks is None:
            raise ValueError("publish_cache: reprefill needs publish_chunks (partial rollouts)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """avg@n evaluation during training (SPEC item 13).

    Attributes:
      data: files or directories of verl rows.
      every: steps between evaluations (also before the first and after the last).
      num_samples: n of avg@n.
      max_response_length: response limit; default the longest stage T.
      temperature / top_p: the evaluation's sampling, the report's protocol (1 and 1) by
        default whatever the rollouts use, so that runs with different rollout
        temperatures are measured alike.
      extra_temperatures: each evaluation is also run at these temperatures (same
        problems, samples and top_p), recorded under ``by_temperature`` in
        ``eval.jsonl`` (the report evaluates its temperature arms at 0.6 as well).
      probe: a probe of ``magic_jax.rollout.probes`` run at each evaluation (``lockout``:
        the lock-out world's), its figures under ``probe`` in ``eval.jsonl``; None: none.
    """

    data: tuple[str, ...]
    every: int = 50
    num_samples: int = 4
    max_response_length: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    extra_temperatures: tuple[float, ...] = ()
    probe: str | None = None

    def __post_init__(self):
        if self.probe is not None:
            get_probe(self.probe)  # a ValueError names the registered probes
        if not self.data:
            raise ValueError("data must name at least one file or directory")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"temperature must be > 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )
        if self.every <= 0 or self.num_samples <= 0:
            raise ValueError("every and num_samples must be positive")
        bad = [t for t in self.extra_temperatures if not t > 0]
        if bad:
            raise ValueError(f"extra_temperatures must all be > 0, got {bad}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A whole training run.

    Attributes:
      model: a Hugging Face checkpoint directory (config.json + safetensors) or
        a magic_jax orbax checkpoint (``model_config.json`` + ``state/``).
      tokenizer: directory of a Hugging Face tokenizer; default ``model``.
      output_dir: checkpoints, ``metrics.jsonl``, the resolved config and the
        final Hugging Face export go here; a run in a directory with
        checkpoints resumes from the newest.
      stages: the multi-stage schedule, in order.
      data, rollout, sampling, advantage, loss, entropy, optimizer, rewards, mesh, eval:
        the options of each part (see their classes).
      update: how the update runs (``UpdateOptions``: mini-batch split, micro-batches,
        N_reuse, remat, compute dtype, attention chunk, layer unroll, MLP kernel).
      param_dtype: ``float32`` master weights (default) or ``bfloat16``.
      seed: data order and sampling randomness.
      checkpoint_every: steps between checkpoints (and at each stage's end).
      keep_checkpoints: newest checkpoints kept.
      watchdog_s: seconds without progress (no decode chunk, update micro-batch or
        checkpoint completed) after which the step watchdog writes every thread's
        stack to the run directory and ends the process (nonzero); null: off.
      profile_steps: ``"A:B"``: a ``jax.profiler`` trace of global steps A to B-1,
        written to ``<output_dir>/profile`` (``gs://`` included); null: none.
      export_hf: write the final policy as a Hugging Face checkpoint.
      export_dtype: its dtype (bf16, as released checkpoints; fp32 for tiny models).
      extensions: modules ``load_config`` imports before it checks the config, so that
        the rewards, advantage estimators and decode attentions they register can be
        named in it (``[my_pkg.my_rewards]``; docs/extending.md).
    """

    model: str
    output_dir: str
    stages: tuple[StageConfig, ...]
    data: DataConfig
    tokenizer: str | None = None
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    entropy: EntropyControlConfig = dataclasses.field(default_factory=EntropyControlConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    rewards: RewardsConfig = dataclasses.field(default_factory=RewardsConfig)
    mesh: MeshConfig | None = None
    eval: EvalConfig | None = None
    update: UpdateOptions = dataclasses.field(default_factory=UpdateOptions)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    watchdog_s: float | None = None
    profile_steps: str | None = None
    export_hf: bool = True
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    extensions: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.stages:
            raise ValueError("stages must list at least one stage")
        if self.loss.temperature != self.sampling.temperature:
            raise ValueError(
                f"loss.temperature ({self.loss.temperature}) must equal sampling.temperature "
                f"({self.sampling.temperature}): the trainer recomputes the sampler's log-probs"
            )
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"param_dtype must be float32 or bfloat16, got {self.param_dtype!r}")
        if self.checkpoint_every <= 0 or self.keep_checkpoints <= 0:
            raise ValueError("checkpoint_every and keep_checkpoints must be positive")
        if self.watchdog_s is not None and (
            isinstance(self.watchdog_s, bool) or not self.watchdog_s > 0
        ):
            raise ValueError(
                f"watchdog_s must be a positive number of seconds or null, got {self.watchdog_s!r}"
            )
        if self.rollout.devices is not None and self.mesh is None:
            raise ValueError("rollout.devices: splitting the devices needs a mesh (set mesh)")
        if self.profile_steps is not None:
            from magic_jax.run.profile import parse_profile_steps

            parse_profile_steps(self.profile_steps)  # "A:B", named profile_steps
        even = self.update.mini_batch_split == "even"
        for i, st in enumerate(self.stages):
            if even and st.prompts_per_step % st.mini_batch_groups:
                raise ValueError(
                    f"stages[{i}]: prompts_per_step ({st.prompts_per_step}) must be a multiple "
                    f"of mini_batch_groups ({st.mini_batch_groups}) with update.mini_batch_split "
                    "'even' (or set update.mini_batch_split: fixed-size)"
                )
            if st.until is not None and st.until.eval_patience is not None and self.eval is None:
                raise ValueError(f"stages[{i}].until.eval_patience needs an eval section")
        ref = self.loss.kl_reference
        if ref is not None and not str(ref).startswith("gs://") and not os.path.isdir(ref):
            raise ValueError(f"loss.kl_reference: {ref} is not a directory")

    def kl_beta(self, stage: int) -> float:
        """The KL weight of stage ``stage`` (its own, else ``loss.kl_beta``)."""
        st = self.stages[stage]
        return self.loss.kl_beta if st.kl_beta is None else st.kl_beta

    @property
    def uses_kl(self) -> bool:
        """Whether some stage has a KL term (and so the run needs a reference policy)."""
        return any(self.kl_beta(i) > 0 for i in range(len(self.stages)))

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def stage_at(self, step: int) -> tuple[int, int]:
        """(stage index, step within the stage) of global step ``step``."""
        for i, s in enumerate(self.stages):
            if step < s.steps:
                return i, step
            step -= s.steps
        return len(self.stages), 0


# --------------------------------------------------------------------------- files and overrides


# A path option starting with this names a file shipped inside the magic_jax package
# (the default run's model and data), so the default config runs from any directory.
PACKAGE_PREFIX = "package:"

# Options that moved into a section: a config naming the old key is refused with the new.
MOVED_OPTIONS = {
    "micro_batch_size": "update.micro_batch_size",
    "num_reuse": "update.num_reuse",
    "mini_batch_split": "update.mini_batch_split",
    "remat": "update.remat",
    "compute_dtype": "update.compute_dtype",
    "attention_chunk": "update.attention_chunk",
    "update_layer_unroll": "update.layer_unroll",
    "update_mlp_kernel": "update.mlp_kernel",
}

# Every option that names a file or directory, as dotted paths into the raw config.
PATH_OPTIONS = ("model", "tokenizer", "output_dir", "data.train", "eval.data", "loss.kl_reference")


def _resolve_path_option(raw: JSON, dotted: str) -> None:
    """Makes the option at ``dotted`` absolute (relative to the working directory);
    ``gs://`` URIs stay as they are."""

    def absolute(p: object) -> object:
        if isinstance(p, str) and p.startswith(PACKAGE_PREFIX):
            return str(Path(__file__).resolve().parents[1] / p[len(PACKAGE_PREFIX) :])
        if isinstance(p, str) and p.startswith("gs://"):
            return p.rstrip("/")  # a Cloud Storage URI stays as given
        if isinstance(p, (str, os.PathLike)) and str(p):
            return os.path.abspath(os.path.expanduser(os.fspath(p)))
        return p

    *parents, last = dotted.split(".")
    node: object = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        return
    v = node[last]
    node[last] = [absolute(t) for t in v] if isinstance(v, (list, tuple)) else absolute(v)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    raw: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> TrainConfig:
    """Reads a YAML run configuration (or a raw mapping), applies overrides, checks it;
    errors name the file ``name`` (default: its path; the embedded default's is
    ``configs/default.yaml``, as ``--help`` says, wherever the package is installed).

    Every path option (``model``, ``tokenizer``, ``output_dir``, ``data.train``,
    ``eval.data``) is resolved once, here, to an absolute path: a relative one
    is taken relative to the working directory, as paths typed on a command
    line are (orbax and the worker processes need absolute paths); one that
    starts with ``package:`` relative to the installed ``magic_jax`` package.

    Raises:
      ConfigError: an unreadable file or a bad option (named by its path).
    """
    import copy

    import yaml

    shown = name or (str(path) if path is not None else None)
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except OSError as e:
            raise ConfigError(f"{shown}: cannot read the config: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{shown}: not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(
                f"{shown}: the top level must be a mapping of options, "
                f"got a {type(loaded).__name__}"
            )
        raw = loaded
    raw = copy.deepcopy(dict(raw or {}))
    for o in overrides:
        apply_override(raw, o)
    moved = [k for k in MOVED_OPTIONS if k in raw]
    if moved:
        where = f"{shown}: " if shown is not None else ""
        raise ConfigError(f"{where}{moved[0]} moved: use {MOVED_OPTIONS[moved[0]]}")
    import_extensions(raw.get("extensions"), near=path.parent if path is not None else None)
    # The trainer recomputes the sampler's log-probs: one temperature for both.
    sampling = raw.get("sampling")
    if isinstance(sampling, dict) and "temperature" in sampling:
        loss = raw.setdefault("loss", {}) or {}
        raw["loss"] = loss
        loss.setdefault("temperature", sampling["temperature"])

    for key in PATH_OPTIONS:
        _resolve_path_option(raw, key)
    try:
        return from_dict(TrainConfig, raw)
    except ConfigError as e:
        raise ConfigError(f"{shown}: {e}" if shown is not None else str(e)) from None
