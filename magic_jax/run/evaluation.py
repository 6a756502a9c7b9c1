"""A run's held-out evaluation (the ``eval:`` section): avg@n at ``eval.temperature``,
again at each of ``eval.extra_temperatures``, and ``eval.probe``'s figures.

Evaluation keeps its own sampling protocol (temperature and top-p, the report's 1 and
1 by default) whatever the run trains with, and one engine and KV cache serve every
temperature (they run one after another). The engine is built at the first
evaluation, from the run's rollout options.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from magic_jax.data.rows import tokenize_rows
from magic_jax.data.sources import read_rows
from magic_jax.rollout.sampling import SamplingConfig
from magic_jax.run.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from magic_jax.data.rows import PromptRow
    from magic_jax.rollout.driver import RolloutDriver
    from magic_jax.rollout.protocols import Params, Tokenizer, Verifiers
    from magic_jax.run.inputs import RunInputs
    from magic_jax.run.rundir import JSON


def tokenize_logged(
    rows: list[PromptRow],
    tokenizer: Tokenizer,
    limit: int,
    name: str,
    log: Callable[[str], None],
) -> tuple[list[PromptRow], int]:
    """``rows`` with their token ids, those longer than ``limit`` tokens left out (and
    said, naming the option ``name`` they came from); returns (kept, how many left out)."""
    kept, _ = tokenize_rows(rows, tokenizer, max_prompt_length=limit)
    if len(kept) < len(rows):
        log(
            f"[data] {name}: {len(rows) - len(kept)} of {len(rows)} prompts are longer "
            f"than data.max_prompt_length ({limit} tokens) and are left out"
        )
    return kept, len(rows) - len(kept)


class Evaluator:
    """The evaluations of one run (``TrainConfig.eval``, which must be set).

    Attributes:
      driver: the driver at ``eval.temperature`` (None before the first evaluation).
      extra_drivers: one per ``eval.extra_temperatures``, on ``driver``'s engine.
    """

    def __init__(
        self, config: TrainConfig, inputs: RunInputs, *, log: Callable[[str], None] = print
    ):
        if config.eval is None:
            raise ValueError("Evaluator: the config has no eval section")
        self.eval = config.eval
        self.config = config
        self.model = inputs.model
        self.graphdef = inputs.graphdef
        self.tokenizer = inputs.tokenizer
        self.mesh = inputs.mesh
        self.log = log
        self.driver: RolloutDriver | None = None
        self.extra_drivers: dict[float, RolloutDriver] = {}
        self.rows: list[PromptRow] = []
        self.skipped = 0

    def _open(self) -> RolloutDriver:
        from magic_jax.rollout.driver import make_driver

        cfg, ev = self.config, self.eval
        if self.driver is None:
            limit = cfg.data.max_prompt_length
            rows = read_rows(ev.data)
            self.rows, self.skipped = tokenize_logged(
                rows, self.tokenizer, limit, "eval.data", self.log
            )
            if not self.rows:
                raise ConfigError("eval.data: no problem fits data.max_prompt_length")
            longest = ev.max_response_length or max(s.max_response_length for s in cfg.stages)
            self.driver = make_driver(
                self.model,
                cfg.rollout,
                max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=longest,
                sampling=self.sampling_at(ev.temperature),
                mesh=self.mesh,
            )
            self.extra_drivers = {
                t: self.driver.with_sampling(self.sampling_at(t)) for t in ev.extra_temperatures
            }
        return self.driver

    def sampling_at(self, temperature: float) -> SamplingConfig:
        """The evaluation's own protocol at ``temperature``."""
        return SamplingConfig(temperature=temperature, top_p=self.eval.top_p)

    def __call__(self, params: Params, step: int, pool: Verifiers) -> JSON:
        """The evaluation row of the policy ``params`` after ``step`` updates (``step``,
        the figures, ``by_temperature``, ``probe``, ``t_eval_s``)."""
        from magic_jax.rollout.evaluate import evaluate

        cfg, ev = self.config, self.eval
        main = self._open()
        t0 = time.perf_counter()

        def run(driver: RolloutDriver) -> JSON:
            return evaluate(
                driver,
                driver.load_params(params),
                self.rows,
                self.tokenizer,
                num_samples=ev.num_samples,
                seed=cfg.seed,
                step=step,
                max_prompt_length=cfg.data.max_prompt_length,
                pool=pool,
            )

        row = run(main)
        if self.extra_drivers:
            row["by_temperature"] = {
                f"{t:g}": {k: v for k, v in run(d).items() if isinstance(v, int | float)}
                for t, d in self.extra_drivers.items()
            }
        row["skipped_long_prompts"] = self.skipped
        if ev.probe is not None:  # a probe of the policy itself (rollout/probes.py)
            row["probe"] = self.probe(params, step, pool)
        return {"step": step, **row, "t_eval_s": time.perf_counter() - t0}

    def probe(self, params: Params, step: int, pool: Verifiers) -> dict[str, object]:
        """``eval.probe`` of the policy ``params`` after ``step`` updates."""
        from magic_jax.rollout.probes import ProbeContext, get_probe
        from magic_jax.run.stages import planned_stage

        cfg, st, d = self.config, planned_stage(self.config, step), self._open()
        ctx = ProbeContext(
            graphdef=self.graphdef,
            params=params,
            rows=self.rows,
            tokenizer=self.tokenizer,
            eos_ids=self.model.config.eos_ids,
            temperature=cfg.sampling.temperature,
            samples_per_step=st.prompts_per_step * st.group_size,
            driver=d,
            driver_params=d.load_params(params),
            pool=pool,
            num_samples=self.eval.num_samples,
            seed=cfg.seed,
            step=step,
            final=step >= cfg.total_steps,
        )
        assert self.eval.probe is not None, "asked only when eval.probe names one"
        return get_probe(self.eval.probe)(ctx)
