"""The DP train loader of ``DPTrainer``: the mechanism's batch sampler over the training set, never prepared by
Accelerate (PITFALLS 2: ``even_batches`` would pad or repeat examples and break the sampling analysis, DESIGN
invariant 4).

* :class:`TaggedDataset`: each row carries its index in the training set (read back by the first-step
  counterfactual check, ``counterfactual.py``) and, at the user level, its privacy unit id (``clipping/step.py``);
* :class:`EmptySafeCollator`: an empty Poisson chunk becomes a marker batch (:func:`is_empty`), the tags are
  collated into one tensor each (the user's collator never sees them), and every collated batch is checked to hold
  one row per sampled example (``check_rows``: ``guarantee.check_batch_rows``, or a subclass's);
* :func:`dp_train_loader`: the ``DataLoader`` of those, the collator probed on two rows first.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from .clipping.step import INDEX_KEY, UNIT_KEY

__all__ = ["EMPTY_KEY", "EmptySafeCollator", "TaggedDataset", "dp_train_loader", "is_empty", "shared_seed",
           "training_collator", "training_rows"]

EMPTY_KEY = "_hf_dp_empty_batch"
"""The key of the marker batch an empty Poisson chunk becomes."""


class EmptySafeCollator:
    """Wraps the data collator: an empty Poisson chunk becomes a marker batch instead of a collator error, the
    row indices and privacy-unit ids that :class:`TaggedDataset` attaches are collated into one tensor each (the user's
    collator never sees them), and every collated batch is checked to hold one row per sampled example
    (``check_rows``: ``DPTrainer._check_batch_rows``)."""

    def __init__(self, collator, check_rows=None):
        self.collator = collator
        self.check_rows = check_rows

    def __call__(self, features: list) -> dict:
        if len(features) == 0:
            return {EMPTY_KEY: True}
        tags = {}
        if isinstance(features[0], dict):
            tags = {key: torch.tensor([f[key] for f in features], dtype=torch.long) for key in (UNIT_KEY, INDEX_KEY)
                    if key in features[0]}
            if tags:
                features = [{k: v for k, v in f.items() if k not in tags} for f in features]
        batch = self.collator(features)
        if self.check_rows is not None:
            self.check_rows(len(features), batch)
        batch.update(tags)
        return batch


class TaggedDataset(torch.utils.data.Dataset):
    """The training set, each row tagged with its index (read back by the first-step counterfactual check) and, for
    user-level clipping, its privacy unit (user) id. ``dataset`` is the untagged set."""

    def __init__(self, dataset, unit_of_example=None):
        self.dataset = dataset
        self.unit_of_example = unit_of_example

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        row = self.dataset[i]
        if not isinstance(row, dict):
            return row
        tags = {INDEX_KEY: int(i)}
        if self.unit_of_example is not None:
            tags[UNIT_KEY] = int(self.unit_of_example[i])
        return {**row, **tags}


def is_empty(inputs: dict) -> bool:
    """Whether a collated chunk is the marker of an empty Poisson chunk."""
    return bool(inputs.get(EMPTY_KEY, False))


def dp_train_loader(dataset: Any, collator: Callable, sampler: Sampler, check_rows: Callable[[int, dict], None],
                    args: Any, unit_of_example: Any = None) -> DataLoader:
    """The DP train loader over ``dataset`` with the mechanism's ``sampler`` (``Mechanism.batch_sampler``); ``args``
    (``TrainingArguments``) give the workers and pinning. Deliberately not ``accelerator.prepare``\\ d: inputs are
    moved to the device in the DP step."""
    dataset = TaggedDataset(dataset, unit_of_example)
    collate = EmptySafeCollator(collator, check_rows)
    # Probe the collator on two rows now, so that one that packs, drops or merges rows fails before training
    # (the same check runs on every batch). The RNG is forked: a masking collator's draws are not shifted.
    with torch.random.fork_rng(devices=[]):
        collate([dataset[i] for i in range(min(2, len(dataset)))])
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
    )


def training_collator(loader: Any) -> Any:
    """The collator a DP train loader runs (the user's, with the Trainer's column removal), without the wrapper;
    ``None`` for another loader."""
    wrapper = getattr(loader, "collate_fn", None)
    return wrapper.collator if isinstance(wrapper, EmptySafeCollator) else None


def training_rows(loader: Any) -> Any:
    """The training set's raw rows (what the collator receives) of a DP train loader; ``None`` for another loader."""
    dataset = getattr(loader, "dataset", None)
    return dataset.dataset if isinstance(dataset, TaggedDataset) else None


def shared_seed(dp_seed: int | None) -> int:
    """The run's DP seed (``dp_seed`` or a secret one, ``secrets.randbits``), identical on every rank (rank 0's)."""
    seed = dp_seed if dp_seed is not None else secrets.randbits(63)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = box[0]
    return seed
