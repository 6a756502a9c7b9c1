"""Loading a run's policy and tokenizer from a Hugging Face or magic_jax checkpoint directory,
and exporting the trained policy as a Hugging Face checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from magic_jax import storage
from magic_jax.rollout.protocols import Tokenizer
from magic_jax.run.config import ConfigError

if TYPE_CHECKING:
    from flax import nnx
    from jax.sharding import Mesh

    from magic_jax.model.qwen2 import Qwen2
    from magic_jax.rollout.protocols import Params
    from magic_jax.run.config import TrainConfig

log = logging.getLogger(__name__)


def load_policy(
    path: str | os.PathLike, dtype: str, mesh: Mesh | None, *, option: str = "model"
) -> Qwen2:
    """A ``Qwen2`` model from a checkpoint directory, placed on ``mesh`` (or one device).

    Args:
      path: a Hugging Face checkpoint (``config.json`` + safetensors), a
        magic_jax orbax checkpoint (``model_config.json`` + ``state/``), a
        training checkpoint or a run directory (its newest good checkpoint's
        policy): ``checkpoint.checkpoint_kind``.
      dtype: parameter dtype of a Hugging Face checkpoint (``float32`` / ``bfloat16``);
        an orbax checkpoint keeps its stored dtype.
      mesh: the training mesh (parameters are sharded with the training rules), or None.
      option: the config option that named ``path``, for error messages.

    Raises:
      ConfigError: ``path`` is not a directory or holds no kind of checkpoint.
    """
    import jax
    import jax.numpy as jnp

    from magic_jax.model.convert import load_hf
    from magic_jax.run.checkpoint import checkpoint_kind, load_model

    try:
        kind, p = checkpoint_kind(path, option=option)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if kind == "hf":
        if storage.is_gcs(p) and jax.process_count() > 1:
            log.warning(
                "%s %s: a Hugging Face directory is copied whole to every host; `magic-jax "
                "convert %s gs://BUCKET/models/NAME` stages it once, and each host then reads "
                "only its own shards",
                option,
                p,
                p,
            )
        # safetensors are read with plain file reads: a gs:// checkpoint is copied to the
        # local cache first (once per machine)
        return load_hf(storage.local_copy(p, what=option), dtype=jnp.dtype(dtype), mesh=mesh)
    # orbax reads gs:// itself: each process only the chunks of its own shards (see
    # jobs/convert.py for the chunking that makes that a host's share), and checks a
    # run's manifest first
    return load_model(p, mesh=mesh)


class RunTokenizer(Tokenizer, Protocol):
    """The run's tokenizer (a Hugging Face one): the rollout's ``Tokenizer``, its padding
    id, and saved beside an export."""

    @property
    def pad_token_id(self) -> int | None: ...

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> object: ...


def load_tokenizer(path: str | os.PathLike) -> RunTokenizer:
    """A Hugging Face tokenizer from a local or ``gs://`` directory.

    A directory whose ``tokenizer_config.json`` names the generic fast class
    (``PreTrainedTokenizerFast`` / ``TokenizersBackend``, as custom tokenizers
    are saved) is read as exactly its ``tokenizer.json``: ``AutoTokenizer``
    would pick the model type's tokenizer class instead (``Qwen2Tokenizer``
    beside a Qwen2 ``config.json``) and rebuild its pre-tokenizer.

    Raises:
      ConfigError: no tokenizer can be read from ``path``.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # a gs:// tokenizer: a local copy of the directory's top-level files, not its weights
    path = storage.local_copy(
        path, what="tokenizer", only=lambda rel: "/" not in rel and not rel.endswith(".safetensors")
    )
    cfg_path = Path(path) / "tokenizer_config.json"
    try:
        cls = json.loads(cfg_path.read_text()).get("tokenizer_class") if cfg_path.exists() else None
        if cls in ("PreTrainedTokenizerFast", "TokenizersBackend"):
            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer: cannot load a tokenizer from {path}: {e}") from None


def reference_params(config: TrainConfig, params: Params, mesh: Mesh | None) -> Params | None:
    """The frozen reference policy of the KL term, or None when no stage uses KL.

    Args:
      config: the run (``TrainConfig``).
      params: the policy's initial parameters (``nnx.State`` of ``nnx.Param``),
        before any update or resume.
      mesh: the training mesh, or None.

    Returns:
      None when ``kl_beta`` is 0 in every stage (no reference is held and no
      reference forward runs). Else a copy of ``params`` (the run's initial
      weights; new buffers, so the updates that donate the policy's never touch
      it) or the parameters of ``loss.kl_reference``, loaded with the policy's
      shardings. Either is only read: it is passed to each update beside the
      train state, never to the optimizer, and never checkpointed.

    Raises:
      ConfigError: ``loss.kl_reference`` is unusable or does not match the policy.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if not config.uses_kl:
        return None
    path = config.loss.kl_reference
    if path is None:
        return jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    model = load_policy(path, config.param_dtype, mesh, option="loss.kl_reference")
    _, ref = nnx.split(model, nnx.Param)
    shapes = [x.shape for x in jax.tree.leaves(params)]
    # jaxlib ships no type stubs for PyTreeDef (mypy cannot resolve it to compare)
    same_tree = jax.tree.structure(ref) == jax.tree.structure(params)  # type: ignore[operator]
    if not same_tree or shapes != [x.shape for x in jax.tree.leaves(ref)]:
        raise ConfigError(
            f"loss.kl_reference: {path} does not have the policy's parameter names and shapes"
        )
    # the policy's dtypes (fp32 master weights): one compute path for both forwards
    return jax.tree.map(lambda r, p: r.astype(p.dtype), ref, params)


@dataclasses.dataclass
class LoadedModel:
    """A model to sample from, with where it came from.

    Attributes:
      model: the ``Qwen2`` module.
      tokenizer_dir: where its tokenizer is (None: not known; pass one).
      source: ``"hf"``, ``"orbax"`` (a ``save_model`` directory) or ``"run"``
        (a training checkpoint).
      checkpoint: the directory the weights were read from.
      step: the training step of a run checkpoint (None otherwise).
    """

    model: Qwen2
    tokenizer_dir: str | None
    source: str
    checkpoint: str
    step: int | None = None


def load_model_any(
    path: str | os.PathLike, *, dtype: str = "float32", mesh: Mesh | None = None
) -> LoadedModel:
    """Loads a Hugging Face directory, a magic_jax model, or a run's (newest) checkpoint.

    Args:
      path: see ``checkpoint.checkpoint_kind``.
      dtype: parameter dtype of a Hugging Face checkpoint.
      mesh: place the parameters on this mesh (default: one device).
    """
    from magic_jax.run.checkpoint import checkpoint_kind, load_model, read_trainer_state

    source, ckpt = checkpoint_kind(path)
    if source == "hf":
        return LoadedModel(load_policy(ckpt, dtype, mesh), str(ckpt), source, str(ckpt))
    model = load_model(ckpt, mesh=mesh)
    if source == "orbax":
        tok = str(ckpt) if (ckpt / "tokenizer.json").exists() else None
        return LoadedModel(model, tok, source, str(ckpt))
    step = read_trainer_state(ckpt)["next_step"]
    run_config = ckpt.parent.parent / "config.yaml"
    tok = None
    if run_config.exists():
        import yaml

        cfg = yaml.safe_load(run_config.read_text()) or {}
        tok = cfg.get("tokenizer") or cfg.get("model")
    return LoadedModel(model, tok, source, str(ckpt), step)


def export_policy(
    out: Path,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokenizer: RunTokenizer,
    dtype: str,
) -> None:
    """The policy as a Hugging Face checkpoint in ``out`` (replacing an earlier export), with
    its tokenizer. Every process gathers the weights tensor by tensor; process 0 writes them.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from magic_jax import interrupt
    from magic_jax.model.convert import save_hf
    from magic_jax.run import runlock

    primary = jax.process_index() == 0
    if primary:
        runlock.check_fence(out.name, server=True)  # before the old export goes
        storage.remove_tree(out)  # this run's own earlier export
    mid_upload = functools.partial(interrupt.kill_point, "upload")
    with storage.staged(out, upload=primary, between=mid_upload) as local:
        save_hf(nnx.merge(graphdef, params), local, dtype=jnp.dtype(dtype))
        interrupt.kill_point("export")  # the weights written, the tokenizer not yet
        if primary:
            tokenizer.save_pretrained(local)
            runlock.check_fence(out.name, server=True)  # the upload follows
