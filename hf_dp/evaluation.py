"""Evaluation data that hf_dp can see is training data (DESIGN invariant 7).

The DP guarantee covers the released parameters and what is computed from them. Evaluation metrics are computed
outside the mechanism, without noise: on private data they are a private release of their own, and every choice made
on them (``load_best_model_at_end``, ``save_strategy="best"``, ``EarlyStoppingCallback``, ``reduce_lr_on_plateau``)
is not covered. hf_dp cannot know in general whether the evaluation data is private, so by default evaluation results
never leave the machine and each such choice is a "not strict" note that says "not covered if the evaluation data is
private". When the evaluation set visibly holds rows of the training set (the same object, a ``select`` of it, rows
equal to training rows: at least half of the evaluation rows compared), that condition is known to hold:

* ``eval_data_is_public=True`` declares the opposite, and is the one gate through which evaluation results reach the
  model card (``model-index``) and the pushed ``trainer_state.json``: un-noised functions of training rows would be
  published under a card that says they are not. Refused (at construction, at train start and at every evaluation,
  before any metric is computed): the declaration is contradicted by what hf_dp sees.
* a choice made on evaluation metrics stays allowed (the data holder may keep such a model; the weights still carry
  the mechanism's noise) but its note in ``dp_guarantee`` becomes definite: it was made on training rows.

Plain evaluation on training rows without either is allowed: its metrics are private logs like the training loss
(uploads drop them, ``release.py``).

How rows are compared: up to :data:`SAMPLED_EVAL_ROWS` evenly spaced evaluation rows are fingerprinted and every
training row is looked up among them. A fingerprint holds the columns both sets have that the model consumes (its
forward's named arguments and the labels; every shared column if no input of the model but the labels is), each
value without the positions the row's ``attention_mask`` marks as padding (when both sets have one), numbers as
float64: a
row padded to another length, with ``1.0`` for the label ``1``, or beside an id column that differs, is the same
row. The
evaluation set is taken for training data when at least half of them are training rows (a held-out split that shares
a few duplicate rows with the training split is not: a public row's metric is computed from the released model and
public data). Columns that do not tell the sampled evaluation rows apart (fewer distinct fingerprints than half of them:
an evaluation set of raw text sharing only the label column with a tokenized training set) say nothing. Cost: one read
of the training set (as numpy arrays: 0.45 s CPU for 50,000 rows of 128 tokens), only when the answer matters
(``eval_data_is_public`` or a choice made on evaluation metrics), once per (training set, evaluation set) pair.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from transformers import EarlyStoppingCallback, TrainerCallback

from .guarantee import choices_on_eval_metrics

__all__ = ["training_rows_in", "check_eval_not_training_data", "EvalDataNotes", "EvalDataWiring"]

#: evaluation rows fingerprinted (evenly spaced, the first and last included)
SAMPLED_EVAL_ROWS = 64
_BATCH = 1024


def _plain(value: Any) -> Any:
    """A hashable form of a row's value, the same whatever its container (a ``torch`` or ``numpy`` formatted row
    equals the same row as lists) and its numeric type (a label ``1`` equals ``1.0``): a rectangular numeric value as
    its shape and its float64 bytes; anything else (ragged lists, strings, dicts) recursively as tuples."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, (list, tuple, np.ndarray, np.generic, bool, int, float)):
        try:
            array = np.asarray(value)
        except ValueError:  # ragged
            array = None
        if array is not None and array.dtype.kind in "biuf":
            return ("array", array.shape, array.astype(np.float64, copy=False).tobytes())
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _plain(v)) for k, v in value.items()))
    if isinstance(value, np.generic):
        return value.item()
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _row(dataset: Any, i: int) -> Any:
    return dataset[int(i)]


def _rows(dataset: Any) -> Iterator[tuple[int, Any]]:
    """``(index, row)`` for every row; an HF ``datasets.Dataset`` read in slices of :data:`_BATCH` rows."""
    n = len(dataset)
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, list) and hasattr(dataset, "select"):
        if getattr(dataset, "format", {}).get("type") is None and hasattr(dataset, "with_format"):
            dataset = dataset.with_format("numpy")  # read as arrays (the same rows; no custom transform is set)
        for start in range(0, n, _BATCH):
            batch = dataset[start:min(start + _BATCH, n)]
            if isinstance(batch, Mapping):
                keys = list(batch)
                for j, values in enumerate(zip(*(batch[k] for k in keys))):
                    yield start + j, dict(zip(keys, values))
                continue
            for j in range(start, min(start + _BATCH, n)):
                yield j, _row(dataset, j)
        return
    for i in range(n):
        yield i, _row(dataset, i)


def _unpadded(row: Mapping, key: str) -> Any:
    """``row[key]`` without the positions its row's ``attention_mask`` marks as padding (every 1-D value as long as
    the mask: the tokens, the labels and the mask itself), so that a row padded to another length, or not padded,
    is the same row."""
    value, mask = row[key], row.get("attention_mask")
    try:
        mask = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask)
        value_array = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value)
    except (ValueError, TypeError):  # ragged
        return value
    if mask.ndim != 1 or value_array.ndim != 1 or mask.shape != value_array.shape or mask.dtype.kind not in "biuf" \
            or value_array.dtype.kind not in "biuf":
        return value
    return value_array[mask != 0]


def _fingerprint(row: Any, keys: tuple[str, ...] | None) -> Any:
    if keys is None:
        return _plain(row)
    if "attention_mask" not in keys:  # one set without a mask: the values are compared as they are
        return tuple(_plain(row[k]) if k in row else None for k in keys)
    return tuple(_plain(_unpadded(row, k)) if k in row else None for k in keys)


LABEL_COLUMNS = frozenset({"label", "labels", "label_ids"})


def model_columns(model: Any) -> set[str] | None:
    """The columns ``model`` consumes: the named arguments of its forward (the base model's under PEFT, as the
    Trainer's ``remove_unused_columns`` reads them) and the label names; ``None`` when its forward cannot be read."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        parameters = inspect.signature(base.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return None
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in named} | LABEL_COLUMNS


def training_rows_in(train_dataset: Any, eval_dataset: Any, columns: set[str] | None = None) -> str | None:
    """How ``eval_dataset`` is seen to hold training rows (``"is the training set"``, ``"holds training rows
    (evaluation row j equals training row i)"``), or ``None``: not seen (see the module's docstring). ``columns``: the
    columns the model consumes (:func:`model_columns`); rows are compared on those both sets have (an id or a split
    name column that differs does not make a training row another one), else on every column both have."""
    if train_dataset is None or eval_dataset is None:
        return None
    if eval_dataset is train_dataset:
        return "is the training set"
    try:
        n_eval, n_train = len(eval_dataset), len(train_dataset)
    except TypeError:  # an iterable dataset: not read here
        return None
    if not n_eval or not n_train:
        return None
    first_eval, first_train = _row(eval_dataset, 0), _row(train_dataset, 0)
    keys = None
    if isinstance(first_eval, Mapping) and isinstance(first_train, Mapping):
        shared = set(first_eval) & set(first_train)
        inputs = shared & columns if columns else set()
        keys = tuple(sorted(inputs if inputs - LABEL_COLUMNS else shared))
        if not keys:
            return None
    picks = sorted({int(round(x)) for x in np.linspace(0, n_eval - 1, min(SAMPLED_EVAL_ROWS, n_eval))})
    sampled: dict[Any, list[int]] = {}
    for j in picks:
        sampled.setdefault(_fingerprint(_row(eval_dataset, j), keys), []).append(j)
    if 2 * len(sampled) < len(picks):  # the shared columns do not tell rows apart (e.g. only a label column)
        return None
    found: dict[int, int] = {}  # evaluation row -> a training row equal to it
    for i, row in _rows(train_dataset):
        for j in sampled.pop(_fingerprint(row, keys), ()):
            found[j] = i
        if not sampled:
            break
    if 2 * len(found) < len(picks):  # a few rows shared by a held-out split (duplicates) are not its training rows
        return None
    j = min(found)
    return (f"holds training rows ({len(found)} of the {len(picks)} evaluation rows compared are rows of the training "
            f"set, e.g. evaluation row {j} equals training row {found[j]})")


def _eval_sets(eval_dataset: Any) -> list[tuple[str, Any]]:
    """``[(name, dataset)]``: the Trainer's ``eval_dataset`` may be a dict of named sets."""
    if isinstance(eval_dataset, Mapping) and not hasattr(eval_dataset, "column_names"):
        return [(f"eval_dataset[{k!r}]", v) for k, v in eval_dataset.items()]
    return [("eval_dataset", eval_dataset)]


class _Overlap:
    """:func:`training_rows_in` for each evaluation set, remembered for the last (training set, evaluation set) pair
    seen (reading the training set once per pair); ``model``: a callable returning the model whose input columns
    the rows are compared on (:func:`model_columns`)."""

    def __init__(self, model: Any = None) -> None:
        self._seen: dict[tuple[int, int], tuple[Any, Any, str | None]] = {}
        self._model = model

    def of(self, train_dataset: Any, eval_dataset: Any) -> list[str]:
        found = []
        for name, data in _eval_sets(eval_dataset):
            key = (id(train_dataset), id(data))
            hit = self._seen.get(key)
            if hit is None or hit[0] is not train_dataset or hit[1] is not data:
                model = self._model() if self._model is not None else None
                columns = model_columns(model) if model is not None else None
                hit = (train_dataset, data, training_rows_in(train_dataset, data, columns))
                self._seen = {k: v for k, v in self._seen.items() if v[0] is train_dataset} | {key: hit}
            if hit[2] is not None:
                found.append(f"{name} {hit[2]}")
        return found


def check_eval_not_training_data(args: Any, train_dataset: Any, eval_dataset: Any, where: str,
                                 overlap: _Overlap | None = None) -> None:
    """Refuse ``eval_data_is_public=True`` when the evaluation set is seen to hold training rows (module docstring):
    its results would be published as not covered while they are computed on the data the guarantee protects."""
    if not getattr(args, "eval_data_is_public", False) or eval_dataset is None:
        return
    found = (overlap or _Overlap()).of(train_dataset, eval_dataset)
    if found:
        raise ValueError(
            f"eval_data_is_public=True, but {'; '.join(found)} ({where}). Evaluation results on training rows are "
            "computed from the private data without noise, and with eval_data_is_public=True they would go into the "
            "model card's model-index and the pushed trainer_state.json, declared public. Evaluate on held-out data, "
            "or set eval_data_is_public=False (evaluation results then stay in the local logs; choices made on them "
            "are named in dp_guarantee)."
        )


class EvalDataNotes(TrainerCallback):
    """A callback of every ``DPTrainer``: at train start, :func:`check_eval_not_training_data`; its
    ``dp_guarantee_notes()`` (collected by ``DPTrainer.dp_guarantee_notes``) names the choices made on evaluation
    metrics computed on training rows."""

    def __init__(self, trainer: Any):
        self._trainer = weakref.ref(trainer)
        self.overlap = _Overlap(lambda: getattr(self._trainer(), "model", None))

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            check_eval_not_training_data(args, trainer.train_dataset, trainer.eval_dataset, "at train start",
                                         self.overlap)

    def dp_guarantee_notes(self) -> list[str]:
        trainer = self._trainer()
        if trainer is None or trainer.eval_dataset is None:
            return []
        early_stopping = any(isinstance(cb, EarlyStoppingCallback) for cb in trainer.callback_handler.callbacks)
        choices = [what for what, _ in choices_on_eval_metrics(trainer.args, early_stopping)]
        if not choices:
            return []
        found = self.overlap.of(trainer.train_dataset, trainer.eval_dataset)
        if not found:
            return []
        return [f"evaluation on training rows: {'; '.join(found)}, and {', '.join(choices)} was chosen on its "
                "metrics, computed from the private training data without noise: not covered"]


class EvalDataWiring:
    """``DPTrainer``'s side of evaluation (a mixin before ``Trainer``): every evaluation passes through
    ``get_eval_dataloader``, where :func:`check_eval_not_training_data` runs before any metric is computed; the
    :class:`EvalDataNotes` callback is added at construction."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._eval_data_notes = EvalDataNotes(self)
        self.add_callback(self._eval_data_notes)
        check_eval_not_training_data(self.args, self.train_dataset, self.eval_dataset, "at construction",
                                     self._eval_data_notes.overlap)

    def get_eval_dataloader(self, eval_dataset: Any = None):
        data = eval_dataset
        if data is None or isinstance(data, str):
            data = self.eval_dataset if data is None else self.eval_dataset[data]
        check_eval_not_training_data(self.args, self.train_dataset, data, "at evaluation",
                                     self._eval_data_notes.overlap)
        return super().get_eval_dataloader(eval_dataset)
