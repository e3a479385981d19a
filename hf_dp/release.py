"""What leaves the machine with a model: redacted copies of the Trainer's records for ``push_to_hub``.

The Hugging Face ``Trainer`` uploads more than weights (transformers 5.23, ``trainer.py``):

* ``push_to_hub()`` and every checkpoint push (``_push_from_checkpoint``, ``hub_strategy`` ``"every_save"``,
  ``"checkpoint"``, ``"all_checkpoints"``) upload the whole ``output_dir`` except ``_*`` and ``checkpoint-*``: the
  ``trainer_state.json`` and ``*_results.json`` that ``save_state()`` / ``save_metrics()`` write there, and
  TensorBoard's event files (``output_dir/runs/`` by default).
* ``hub_strategy="checkpoint"`` / ``"all_checkpoints"`` also upload the checkpoint folder itself (as
  ``last-checkpoint/`` or ``checkpoint-N/``), with its ``trainer_state.json``.

``trainer_state.json`` holds the per-step training loss (un-noised, a statistic of exactly the examples sampled at
that step), ``grad_norm``, ``total_flos`` and ``num_input_tokens_seen`` (both sums over the realised, Poisson-sampled
batches: they almost give away each step's batch size, a function of who was sampled), evaluation metrics and
``best_metric`` (computed on evaluation data that may be private), and audit results on private members. None of it
is covered by the DP guarantee. hf_dp uploads **redacted copies** instead and keeps the originals locally:

* a pushed checkpoint is a copy of the checkpoint (hard links: no extra disk) in ``output_dir/_hf_dp_push/`` with a
  redacted ``trainer_state.json``; the local checkpoint, which ``resume_from_checkpoint`` reads, is untouched, and
  the pushed copy still resumes (``global_step``, epochs, callbacks' states are kept);
* ``trainer_state.json`` and ``*results.json`` in ``output_dir`` are replaced by redacted versions before a push; the
  originals move to ``output_dir/_hf_dp_private/`` (never uploaded: the Trainer ignores ``_*``).

Redaction keeps, in each ``log_history`` record, only quantities that are public or privatized (:data:`PUBLIC_KEYS`
and :data:`PUBLIC_PREFIXES`: step, epoch, learning rate, ε/δ, hf_dp's noised clipping statistics) and the evaluation
metrics only when ``eval_data_is_public=True``; ``total_flos`` and ``num_input_tokens_seen`` become 0.

What cannot be redacted is recorded in ``dp_guarantee`` (:func:`release_notes`): TensorBoard event files written
inside ``output_dir`` while pushing to the Hub.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "PRIVATE_DIR",
    "PUBLIC_KEYS",
    "PUBLIC_PREFIXES",
    "STAGING_DIR",
    "redact_log_record",
    "redact_output_dir",
    "redact_trainer_state",
    "release_notes",
    "stage_checkpoint",
]

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
STAGING_DIR = "_hf_dp_push"
"""Sub-directory of ``output_dir`` holding the redacted copy of the checkpoint being pushed (not uploaded itself)."""
PRIVATE_DIR = "_hf_dp_private"
"""Sub-directory of ``output_dir`` where the un-redacted originals of uploaded records are kept (never uploaded)."""

PUBLIC_KEYS = frozenset({"step", "epoch", "learning_rate", "epsilon", "delta"})
"""``log_history`` keys kept in every pushed record: public settings, the schedule, and the privacy spent."""
PUBLIC_PREFIXES = ("epsilon", "delta", "clip_threshold", "clipped_fraction", "dp_", "dp/")
"""Prefixes of kept keys: ε/δ variants, hf_dp's privatized clipping statistics (noised in the DP step), and the
privacy budget block (``dp_*``: settings and the privacy spent)."""
_EVAL_PREFIX = "eval_"
_ZEROED = ("total_flos", "num_input_tokens_seen")


def _is_public_key(key: str, eval_public: bool) -> bool:
    if key in PUBLIC_KEYS or key.startswith(PUBLIC_PREFIXES):
        return True
    return eval_public and key.startswith(_EVAL_PREFIX)


def redact_log_record(record: Mapping[str, Any], eval_public: bool = False) -> dict[str, Any]:
    """One ``log_history`` record (or a ``*_results.json`` mapping) without its private keys."""
    return {k: v for k, v in record.items() if _is_public_key(str(k), eval_public)}


def redact_trainer_state(state: Mapping[str, Any], eval_public: bool = False) -> dict[str, Any]:
    """A ``TrainerState`` JSON mapping fit for upload (see the module docstring); loads with
    ``TrainerState.load_from_json`` (no key is added or removed at the top level)."""
    out = dict(state)
    out["log_history"] = [r for r in (redact_log_record(r, eval_public) for r in state.get("log_history") or [])
                          if set(r) - {"step", "epoch"}]
    for key in _ZEROED:
        if key in out:
            out[key] = 0
    if not eval_public and "best_metric" in out:
        out["best_metric"] = None
    return out


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)  # same file system: no extra disk; the Trainer never rewrites a saved checkpoint file
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _write_json(path: Path, data: Any) -> None:
    if path.exists():
        path.unlink()  # never write through a hard link into the original checkpoint
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def stage_checkpoint(checkpoint: str | os.PathLike, output_dir: str | os.PathLike, eval_public: bool = False,
                     clean: bool = True) -> Path:
    """A copy of ``checkpoint`` for upload: ``output_dir/_hf_dp_push/<checkpoint name>`` (hard links), with a
    redacted ``trainer_state.json``. ``clean``: remove earlier staged copies first (no upload is reading them)."""
    checkpoint = Path(checkpoint)
    root = Path(output_dir) / STAGING_DIR
    if clean:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    staged = root / checkpoint.name
    if staged.exists():
        shutil.rmtree(staged)
    shutil.copytree(checkpoint, staged, copy_function=_link_or_copy)
    state_path = staged / TRAINER_STATE_NAME
    if state_path.is_file():
        _write_json(state_path, redact_trainer_state(json.loads(state_path.read_text()), eval_public))
    return staged


def redact_output_dir(output_dir: str | os.PathLike, eval_public: bool = False) -> list[str]:
    """Replaces ``trainer_state.json`` and ``*results.json`` in ``output_dir`` by redacted versions before an upload;
    originals go to ``output_dir/_hf_dp_private/``. Idempotent. Returns the names of the files redacted now."""
    out = Path(output_dir)
    done = []
    for path in sorted(out.glob("*.json")):
        name = path.name
        if name != TRAINER_STATE_NAME and not name.endswith("results.json"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        redacted = (redact_trainer_state(data, eval_public) if name == TRAINER_STATE_NAME
                    else redact_log_record(data, eval_public))
        if redacted == data:
            continue
        private = out / PRIVATE_DIR
        private.mkdir(exist_ok=True)
        shutil.move(str(path), str(private / name))
        _write_json(path, redacted)
        done.append(name)
    if done:
        logger.warning("hf_dp: %s in %s hold un-noised statistics of the private data (training loss, flos, ...): "
                       "the upload gets redacted copies; the originals are in %s (never uploaded).",
                       ", ".join(done), out, out / PRIVATE_DIR)
    return done


def _tensorboard_dirs(trainer: Any) -> list[Path]:
    """Directories TensorBoard writes to during this run (the Trainer's TensorBoardCallback)."""
    from transformers.integrations import TensorBoardCallback

    dirs = []
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TensorBoardCallback):
            d = getattr(cb, "logging_dir", None) or os.path.join(trainer.args.output_dir, "runs")
            dirs.append(Path(d))
    return dirs


def _uploaded_with(path: Path, output_dir: Path) -> bool:
    """Whether ``path`` lies inside ``output_dir`` and is not skipped by the Trainer's ``ignore_patterns``."""
    try:
        rel = path.resolve().relative_to(output_dir.resolve())
    except ValueError:
        return False
    first = rel.parts[0] if rel.parts else ""
    return not (first.startswith("_") or first.startswith("checkpoint-"))


def release_notes(trainer: Any) -> list[str]:
    """Uploads that cannot be redacted, as ``dp_guarantee`` notes (empty when nothing private is pushed)."""
    args = trainer.args
    if not getattr(args, "push_to_hub", False):
        return []
    out = Path(args.output_dir)
    notes = []
    if any(_uploaded_with(d, out) for d in _tensorboard_dirs(trainer)):
        notes.append("TensorBoard logs (per-step training loss, not noised) are written inside output_dir and "
                     "uploaded by push_to_hub; set TENSORBOARD_LOGGING_DIR outside output_dir or drop 'tensorboard' "
                     "from report_to")
    return notes
