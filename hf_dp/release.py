"""What leaves the machine with a model: its card next to the weights, and redacted copies of the Trainer's records
for ``push_to_hub``.

The card (``hf_dp/cards.py``) is rendered from the run's :class:`~hf_dp.record.PrivacyRecord` and the plain data of
:func:`card_inputs` (tags, :func:`card_hyperparameters`, public evaluation metrics, the task); ``DPTrainer`` calls
:func:`write_model_card` from ``save_model`` (every checkpoint) and ``create_model_card`` (``push_to_hub``), and
:func:`checkpoint_push` from ``_push_from_checkpoint``. Nothing here reads the trainer except :func:`release_notes`
(its callbacks and arguments).

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .cards import create_model_card
from .record import PrivacyRecord, describe_optimizer, latest_eval_metrics, plain

__all__ = [
    "DP_STATE_NAME",
    "PRIVATE_DIR",
    "PUBLIC_KEYS",
    "PUBLIC_PREFIXES",
    "STAGING_DIR",
    "card_hyperparameters",
    "card_inputs",
    "checkpoint_push",
    "redact_log_record",
    "redact_output_dir",
    "redact_trainer_state",
    "release_notes",
    "stage_checkpoint",
    "write_model_card",
]

logger = logging.getLogger(__name__)

DP_STATE_NAME = "dp_state.json"
"""The privacy record saved next to the weights (``PrivacyRecord.save``), in every checkpoint."""
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


# ------------------------------------------------------------------------------------------------- the card
def card_hyperparameters(args: Any, optimizer: Any, expected_batch_size: int, steps: int) -> list[tuple[str, Any]]:
    """The Trainer's training hyperparameters for the card (public settings; never a metric computed on the data)."""
    a = args
    hp: list[tuple[str, Any]] = [
        ("learning_rate", a.learning_rate),
        ("optimizer", describe_optimizer(optimizer, a.optim) + f", args.optim={plain(a.optim)}"),
    ]
    if "adam" in str(plain(a.optim)).lower():
        hp.append(("adam_betas", (a.adam_beta1, a.adam_beta2)))
        hp.append(("adam_epsilon", a.adam_epsilon))
    hp += [
        ("weight_decay", a.weight_decay),
        ("lr_scheduler_type", plain(a.lr_scheduler_type)),
        ("warmup_steps", getattr(a, "warmup_steps", 0)),
        ("per_device_train_batch_size (memory bound of a micro-batch)", a.per_device_train_batch_size),
        ("gradient_accumulation_steps", a.gradient_accumulation_steps),
        ("num_processes", a.world_size),
        ("expected_batch_size", expected_batch_size),
        ("training_steps", steps),
        ("per_sample_max_grad_norm", a.per_sample_max_grad_norm),
        ("max_grad_norm (clipping of the already-noised gradient)", a.max_grad_norm),
        # what the Accelerator ran with: also from ACCELERATE_MIXED_PRECISION (`accelerate launch --mixed_precision`)
        ("mixed_precision", getattr(a, "mixed_precision", None) or ("bf16" if a.bf16 else "fp16" if a.fp16 else "no")),
        ("seed (model initialisation and Trainer RNG; not the DP seed)", a.seed),
    ]
    if a.clipping_function != "clip":  # only when not the default, so default cards stay as they were
        hp.append(("clipping_function (Bu et al. 2023: C/(‖g‖+γ))", a.clipping_function))
        hp.append(("automatic_clipping_gamma", a.automatic_clipping_gamma))
    if a.dp_adam_bias_correction:
        hp.append(("dp_adam_bias_correction (Tang et al. 2024)", True))
        hp.append(("dp_adam_bc_epsilon", a.dp_adam_bc_epsilon))
    return hp


def card_inputs(tags: Any, model_tags: Any, hyperparameters: list[tuple[str, Any]], log_history: Any,
                task: str) -> dict[str, Any]:
    """What a model card needs besides the record, as plain data: the tags (``tags`` and the model's own, e.g.
    trl's), the training hyperparameters, the latest evaluation metrics (published only when the evaluation data is
    declared public) and the task."""
    merged: list[str] = []
    for group in (tags, model_tags):
        for t in [group] if isinstance(group, str) else group or []:
            if t and t not in merged:
                merged.append(str(t))
    return {"tags": merged or None, "hyperparameters": hyperparameters,
            "eval_metrics": latest_eval_metrics(log_history), "task": task}


def write_model_card(record: PrivacyRecord, output_dir: str, inputs: dict[str, Any], **kwargs: Any) -> Any:
    """``hf_dp.cards.create_model_card`` with the run's record and :func:`card_inputs` (``kwargs`` win)."""
    return create_model_card(record, output_dir, **{**inputs, **kwargs})


def checkpoint_push(checkpoint_folder: str, output_dir: str, steps: int, rewrite_card: Callable[[], Any],
                    eval_public: bool, clean: bool) -> Path:
    """What a checkpoint push uploads (``DPTrainer._push_from_checkpoint``); returns the folder to hand the Trainer.

    With ``push_to_hub`` and ``hub_strategy`` ``"every_save"``/``"checkpoint"``/``"all_checkpoints"``, the Trainer
    copies only a fixed list of files (weights, config, adapter files) from the new checkpoint into ``output_dir``,
    re-saves the tokenizer and training arguments there, and uploads ``output_dir``; with
    ``"checkpoint"``/``"all_checkpoints"`` it also uploads the checkpoint folder (``trainer_state.json`` included).
    Here:

    * the card (``README.md``) and ``dp_state.json`` of the checkpoint go into ``output_dir`` too, so the Hub never
      shows weights without (or with a stale) privacy guarantee: the card is re-rendered there (``rewrite_card()``,
      keeping metadata set on an existing README, merging into one hf_dp did not write) when the accountant is at
      the checkpoint's step (``steps``), as it is when ``_save_checkpoint`` pushes; otherwise the checkpoint's own
      card is copied;
    * the Trainer is handed a copy of the checkpoint (``output_dir/_hf_dp_push/checkpoint-N``, hard links,
      :func:`stage_checkpoint`; ``clean``: earlier staged copies removed) whose ``trainer_state.json`` carries no
      training loss, ``grad_norm``, ``total_flos``, ``num_input_tokens_seen`` nor (unless ``eval_public``)
      evaluation metrics; the local checkpoint, which ``resume_from_checkpoint`` reads, keeps everything.
      ``trainer_state.json``/``*results.json`` in ``output_dir`` are redacted the same way
      (:func:`redact_output_dir`; originals kept in ``output_dir/_hf_dp_private/``).
    """
    os.makedirs(output_dir, exist_ok=True)
    state_path = os.path.join(checkpoint_folder, DP_STATE_NAME)
    if os.path.isfile(state_path):
        checkpoint_steps = PrivacyRecord.load(state_path).steps
        card_path = os.path.join(checkpoint_folder, "README.md")
        target = os.path.join(output_dir, "README.md")
        if checkpoint_steps == steps and os.path.isfile(target):
            rewrite_card()
        elif os.path.isfile(card_path):
            shutil.copy(card_path, target)
        else:
            raise FileNotFoundError(
                f"{checkpoint_folder} holds {DP_STATE_NAME} but no README.md: refusing to push weights to the "
                "Hub without their privacy card."
            )
        shutil.copy(state_path, os.path.join(output_dir, DP_STATE_NAME))
    redact_output_dir(output_dir, eval_public)
    return stage_checkpoint(checkpoint_folder, output_dir, eval_public, clean=clean)
