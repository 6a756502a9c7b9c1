"""A step's finished, scored groups kept on disk as they finish, so a stopped step resumes.

A long chain-of-thought step spends most of its time in the rollout (tens of
minutes for 7B at T = 16K); a stop in the middle of it must not throw that work
away. While the rollout runs, each group whose G responses have all been
verified is written at once to the run directory, next to the checkpoints:

    <output_dir>/rollouts/step_<k>/round_<r>/group_<p>.npz

(token ids, behaviour and sampling log-probs, entropies, truncation, rewards and
verifier statuses; a few KB a group). A run that resumes at step k loads the
groups found there and decodes only the others. Sample j of prompt p draws token
t with ``fold_in(seed, step, p, j, t)`` whichever lane, slot or batch decodes it
(``RolloutDriver.run``'s ``prompt_indices`` keep p the prompt's index in the
whole step), so the resumed groups draw what the uninterrupted step drew.

Files are written whole or not at all (a temporary name and a rename locally,
one upload on Cloud Storage), by the thread that waits for the group's rewards
(``scoring._Saver``), so the decode loop does not wait on storage. Each records
its prompt's uid, G and response limit; a file that does not match the step's
prompt, or cannot be read, is decoded again (and said so). The trainer keeps the
groups of the step its newest checkpoint resumes at, and of the one before until
that checkpoint is whole (``prune``).
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from magic_jax import storage

if TYPE_CHECKING:
    from etils import epath

    from magic_jax.rewards import RewardResult
    from magic_jax.rollout.samples import Sample

# a saved group: (its samples, their verifier results, the decoded texts or None)
SavedGroup = tuple[list["Sample"], list["RewardResult"], list[str] | None]
# a place in the run directory: a local path or a ``storage`` path on Cloud Storage
Location = str | os.PathLike[str]

logger = logging.getLogger(__name__)

ROLLOUTS = "rollouts"
_FIELDS = ("logprobs", "entropies", "sampling_logprobs")


def step_dir(output_dir: Location, step: int) -> Path | epath.Path:
    return storage.path(output_dir) / ROLLOUTS / f"step_{step:08d}"


def prune(output_dir: Location, keep: Sequence[int]) -> list[int]:
    """Removes the saved rollouts of every step not in ``keep``; returns the steps removed."""
    root = storage.path(output_dir) / ROLLOUTS
    if not root.exists():
        return []
    gone = []
    for d in sorted(root.iterdir()):
        name = d.name
        if not name.startswith("step_") or not name[5:].isdigit() or int(name[5:]) in keep:
            continue
        storage.remove_tree(d)
        gone.append(int(name[5:]))
    return gone


def _write_bytes(p: Path | epath.Path, data: bytes) -> None:
    if storage.is_gcs(p):
        storage.path(p).write_bytes(data)
        return
    p = Path(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, p)


def encode_group(
    uid: str,
    limit: int,
    samples: Sequence[Sample],
    results: Sequence[RewardResult],
    texts: Sequence[str] | None = None,
) -> bytes:
    """One group (its samples in sample order and their verifier results) as npz bytes."""
    meta = {
        "uid": uid,
        "group_size": len(samples),
        "limit": int(limit),
        "status": [r.status.value for r in results],
        "reward": [float(r.reward) for r in results],
        "detail": [r.detail for r in results],
        "elapsed_s": [float(r.elapsed_s) for r in results],
        "finish_reason": [s.finish_reason for s in samples],
        "truncated": [bool(s.truncated) for s in samples],
        "texts": None if texts is None else list(texts),
    }
    arrays: dict[str, np.ndarray] = {
        "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
        "prompt_tokens": np.asarray(samples[0].prompt_tokens, np.int32),
        "lengths": np.asarray([s.length for s in samples], np.int32),
        "tokens": np.concatenate([np.asarray(s.tokens, np.int32) for s in samples]),
    }
    for f in _FIELDS:
        arrays[f] = np.concatenate([np.asarray(getattr(s, f), np.float32) for s in samples])
    if all(s.versions is not None for s in samples):  # overlap mode: each token's version
        arrays["versions"] = np.concatenate([np.asarray(s.versions, np.int32) for s in samples])
    buf = io.BytesIO()
    # numpy's stubs take a ** dict's values for savez's own allow_pickle: bool
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def decode_group(
    data: bytes, prompt: int
) -> tuple[dict[str, object], list[Sample], list[RewardResult]]:
    """(meta, samples, results) of ``encode_group``'s bytes, the samples numbered ``prompt``
    (meta: the JSON header ``encode_group`` wrote)."""
    from magic_jax.rewards import RewardResult, RewardStatus
    from magic_jax.rollout.samples import Sample

    with np.load(io.BytesIO(data)) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes().decode())
    ends = np.cumsum(arrays["lengths"])
    starts = ends - arrays["lengths"]
    samples = [
        Sample(
            prompt_index=prompt,
            sample_index=j,
            prompt_tokens=arrays["prompt_tokens"],
            tokens=arrays["tokens"][a:b],
            **{f: arrays[f][a:b] for f in _FIELDS},
            truncated=meta["truncated"][j],
            length=int(b - a),
            finish_reason=meta["finish_reason"][j],
            versions=arrays["versions"][a:b] if "versions" in arrays else None,
        )
        for j, (a, b) in enumerate(zip(starts, ends))
    ]
    results = [
        RewardResult(reward=r, status=RewardStatus(st), detail=detail, elapsed_s=elapsed)
        for st, r, detail, elapsed in zip(
            meta["status"], meta["reward"], meta["detail"], meta["elapsed_s"]
        )
    ]
    return meta, samples, results


class StepStore:
    """Where one step's rounds keep their groups: ``round(r)`` is round r's ``RoundStore``.

    Args:
      output_dir: the run directory.
      step: the global step.
      limit: the step's response limit T (a saved group of another T is not reused).
      log: where a resume's counts and problems are said.
      fence: called with a file's name before it is written; raises when this process
        may no longer write into the run directory (``runlock.check_fence``).
    """

    def __init__(
        self,
        output_dir: Location,
        step: int,
        *,
        limit: int,
        log: Callable[[str], None] | None = None,
        fence: Callable[[str], None] | None = None,
    ):
        self.root = step_dir(output_dir, step)
        self.limit = int(limit)
        self.log = log
        self.fence = fence

    def round(self, r: int) -> RoundStore:
        return RoundStore(
            self.root / f"round_{r}", limit=self.limit, log=self.log, fence=self.fence
        )


class RoundStore:
    """The saved groups of one rollout round of one step, and the writer of new ones.

    Example:
      store = RoundStore(step_dir(out, step) / "round_0", limit=T)
      done = store.load(uids, group_size=G)   # {prompt index: (samples, results, texts)}
      store.put(p, uid, samples, results)     # written now, whole or not at all
      store.close()                           # says what could not be written
    """

    def __init__(
        self,
        root: Path | epath.Path,
        *,
        limit: int,
        log: Callable[[str], None] | None = None,
        fence: Callable[[str], None] | None = None,
    ):
        self.root = root
        self.fence = fence
        self.limit = int(limit)
        self.log = log or logger.info
        self.errors: list[BaseException] = []
        self.written = 0

    def path(self, prompt: int) -> Path | epath.Path:
        return self.root / f"group_{prompt:06d}.npz"

    def load(self, uids: Sequence[str], *, group_size: int) -> dict[int, SavedGroup]:
        """The saved groups of this round whose prompt (uid), G and limit match, by index."""
        found: dict[int, SavedGroup] = {}
        if not self.root.exists():
            return found
        names = {f.name for f in self.root.iterdir()}
        for p, uid in enumerate(uids):
            f = self.path(p)
            if f.name not in names:
                continue
            try:
                meta, samples, results = decode_group(f.read_bytes(), p)
            except Exception as e:  # a damaged file: decode the group again
                self.log(f"[resume] {f}: unreadable ({type(e).__name__}: {e}); decoding it again")
                continue
            want = (uid, group_size, self.limit)
            got = (meta["uid"], meta["group_size"], meta["limit"])
            if got != want:
                self.log(f"[resume] {f}: holds {got}, this step needs {want}; decoding it again")
                continue
            texts = meta.get("texts")  # encode_group's: a list of str, or None
            found[p] = (samples, results, texts if isinstance(texts, list) else None)
        if found:
            self.log(
                f"[resume] {self.root}: {len(found)} of {len(uids)} groups finished before; "
                f"decoding the other {len(uids) - len(found)}"
            )
        return found

    def put(
        self,
        prompt: int,
        uid: str,
        samples: Sequence[Sample],
        results: Sequence[RewardResult],
        texts: Sequence[str] | None = None,
    ) -> None:
        """Writes one finished, verified group (whole or not at all). A write that fails
        is counted, not raised: the run goes on and a resume decodes that group again."""
        try:
            if self.fence is not None:
                self.fence(self.path(prompt).name)
            data = encode_group(uid, self.limit, samples, results, texts)
            _write_bytes(self.path(prompt), data)
            self.written += 1
        except Exception as e:
            self.errors.append(e)

    def close(self) -> None:
        """Says once, if some groups could not be written, how many and why."""
        if self.errors:
            e = self.errors[0]
            self.log(
                f"[rollouts] {len(self.errors)} finished group(s) not saved under {self.root} "
                f"({type(e).__name__}: {e}); a resume decodes them again"
            )
            self.errors.clear()
