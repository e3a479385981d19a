"""Batch samplers whose batches match what the accountant assumes (DESIGN invariant 4).

:class:`PoissonBatchSampler` (default): at every logical step each example is included independently with
probability ``q`` — the Poisson subsampling that the subsampled-Gaussian PRV/RDP analyses assume (Li et al. 2022,
App. B; Abadi et al. 2016). Batches vary in size and may be empty. Under several processes each example belongs to
exactly one rank (``index % world_size``), so the union over ranks is one Poisson sample of the whole dataset.

:class:`ShuffledBatchSampler` (opt-in, ``poisson_sampling=False``): fixed-size batches of a shuffled epoch. Its
privacy is *not* what the Poisson accountant reports; the trainer says so in logs and in the model card.

Both yield, per logical step, exactly ``num_chunks`` (= gradient accumulation steps) index lists, so the Hugging Face
Trainer's accumulation loop sees the usual number of micro-batches. A chunk may be larger than the per-device batch
size (the trainer splits it further for memory: never truncated) or empty.

**The draw of a step is a function of (seed, DP step).** The Poisson draw of DP step ``k`` is made from a stream
derived from ``(seed, k, rank)`` alone (DESIGN invariant 11): a step drawn again after an abort (an interrupted
``train()``, a retry after running out of memory, an epoch ended by a callback) is the *same* draw, never a fresh one
that replaces it (an adversary, or a failure that depends on the batch, could otherwise choose among draws), and
steps with different ``k`` are independent draws. The trainer sets ``k`` at each epoch start
(:meth:`set_first_step`) to the model's DP step count (the accountant's steps, continuing across ``train()`` calls),
so a second ``train()`` on the same model never replays the first run's draws. :meth:`set_epoch` (standalone use)
starts epoch ``e`` at step ``e × steps_per_epoch``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["PoissonBatchSampler", "PoissonUserSampler", "ShuffledBatchSampler", "check_draw_is_current", "derive_seed"]


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (numpy ``SeedSequence``): independent streams per (seed, epoch, rank)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0] >> 1)


class _StepSampler(Sampler[list[int]]):
    def __init__(self, num_examples: int, steps_per_epoch: int, num_chunks: int, seed: int, rank: int,
                 world_size: int):
        if num_examples <= 0:
            raise ValueError("The training set is empty.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size}).")
        self.num_examples = num_examples
        self.steps_per_epoch = steps_per_epoch
        self.num_chunks = num_chunks
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.first_step = 0
        self._steps_set = False  # set_first_step was called: set_epoch no longer moves the draws
        #: the DP step whose draw was yielded last (the trainer checks it against the step it trains)
        self.last_step: int | None = None

    def set_epoch(self, epoch: int) -> None:
        """Standalone use: the next iteration draws steps ``epoch × steps_per_epoch``, ... . Once
        :meth:`set_first_step` has been called (the trainer does), only the epoch number is kept: transformers calls
        ``set_epoch`` on the sampler of a resumed run, and an epoch's first DP step is not ``epoch × steps per
        epoch`` once a run was cut or the model trained before."""
        self.epoch = epoch
        if not self._steps_set:
            self.first_step = epoch * self.steps_per_epoch

    def set_first_step(self, step: int) -> None:
        """The next iteration's first batch is the draw of DP step ``step`` (the trainer calls this at every epoch
        start: the model's DP step count, less the steps the Trainer skips when it resumes inside an epoch)."""
        if step < 0:
            raise ValueError(f"A DP step index is >= 0, got {step}.")
        self.first_step = int(step)
        self._steps_set = True

    def _step_generator(self, step: int) -> torch.Generator:
        """The random stream of DP step ``step`` on this rank (a function of the seed, the step and the rank only)."""
        self.last_step = step
        return torch.Generator().manual_seed(derive_seed(self.seed, step, self.rank))

    def __len__(self) -> int:
        return self.steps_per_epoch * self.num_chunks

    def _chunks(self, indices: np.ndarray) -> Iterator[list[int]]:
        for chunk in np.array_split(indices, self.num_chunks):
            yield chunk.tolist()


class PoissonBatchSampler(_StepSampler):
    """Poisson subsampling: each of this rank's examples is in a step's batch independently with probability ``q``.

    Args:
        num_examples: size ``N`` of the whole training set (all ranks).
        sample_rate: ``q``.
        steps_per_epoch: logical steps per epoch (the trainer uses ``ceil(1 / q)``).
        num_chunks: index lists yielded per step (gradient accumulation steps).
        seed: seed of this sampler's random stream (secret by default: see ``DPTrainingArguments.dp_seed``).
        rank, world_size: this process and the number of processes.
    """

    def __init__(self, num_examples: int, sample_rate: float, steps_per_epoch: int, num_chunks: int = 1,
                 seed: int = 0, rank: int = 0, world_size: int = 1):
        super().__init__(num_examples, steps_per_epoch, num_chunks, seed, rank, world_size)
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
        self.sample_rate = sample_rate
        self.shard = np.arange(rank, num_examples, world_size)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.first_step
        for j in range(self.steps_per_epoch):
            gen = self._step_generator(first + j)
            mask = torch.rand(len(self.shard), generator=gen, dtype=torch.float64).numpy() < self.sample_rate
            yield from self._chunks(self.shard[mask])


class ShuffledBatchSampler(_StepSampler):
    """Fixed-size batches of a shuffled epoch (NOT what the Poisson accountant analyses; opt-in only).

    Every rank draws the same permutation and takes its ``rank::world_size`` share of each global batch of
    ``batch_size`` examples; no example is repeated within an epoch. The permutation is drawn from
    ``(seed, first step of the epoch)``.
    """

    def __init__(self, num_examples: int, batch_size: int, num_chunks: int = 1, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        super().__init__(num_examples, math.ceil(num_examples / batch_size), num_chunks, seed, rank, world_size)
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        first = self.first_step
        gen = torch.Generator().manual_seed(derive_seed(self.seed, first))
        perm = torch.randperm(self.num_examples, generator=gen).numpy()
        for step in range(self.steps_per_epoch):
            self.last_step = first + step
            batch = perm[step * self.batch_size:(step + 1) * self.batch_size]
            yield from self._chunks(batch[self.rank::self.world_size])


class PoissonUserSampler(_StepSampler):
    """User-level Poisson sampling: each *user* is in a step's batch independently with probability ``q``.

    All of a sampled user's examples (or, with ``max_examples_per_user = k``, ``k`` of them drawn uniformly without
    replacement for this step) enter the batch, and a user's examples are never split across chunks, so the
    trainer can clip each user's total contribution as one unit. Users are sharded over ranks (``user % world``).

    Args:
        user_of_example: ``(N,)`` user index ``0..U-1`` of every example.
        sample_rate: ``q`` = expected users per step / ``U``.
    """

    def __init__(self, user_of_example: np.ndarray, sample_rate: float, steps_per_epoch: int, num_chunks: int = 1,
                 seed: int = 0, rank: int = 0, world_size: int = 1, max_examples_per_user: int | None = None):
        user_of_example = np.asarray(user_of_example, dtype=np.int64)
        super().__init__(len(user_of_example), steps_per_epoch, num_chunks, seed, rank, world_size)
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
        if max_examples_per_user is not None and max_examples_per_user < 1:
            raise ValueError(f"max_examples_per_user must be >= 1, got {max_examples_per_user}.")
        self.sample_rate = sample_rate
        self.max_examples_per_user = max_examples_per_user
        self.num_users = int(user_of_example.max()) + 1
        order = np.argsort(user_of_example, kind="stable")  # examples grouped by user (CSR layout)
        self._examples = order
        self._user_sorted = user_of_example[order]
        self.user_shard = np.arange(rank, self.num_users, world_size)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.first_step
        for j in range(self.steps_per_epoch):
            gen = self._step_generator(first + j)
            chosen = torch.rand(len(self.user_shard), generator=gen, dtype=torch.float64).numpy() < self.sample_rate
            users = self.user_shard[chosen]
            keep = np.isin(self._user_sorted, users)
            ex, owner = self._examples[keep], self._user_sorted[keep]
            priority = torch.rand(len(ex), generator=gen, dtype=torch.float64).numpy()
            if self.max_examples_per_user is not None and len(ex):
                order = np.lexsort((priority, owner))  # by user, then a random priority within each user
                ex, owner = ex[order], owner[order]
                starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
                rank_in_user = np.arange(len(ex)) - np.repeat(starts, np.diff(np.r_[starts, len(ex)]))
                within_cap = rank_in_user < self.max_examples_per_user
                ex, owner = ex[within_cap], owner[within_cap]
            yield from self._user_chunks(ex, owner)

    def _user_chunks(self, examples: np.ndarray, owner: np.ndarray) -> Iterator[list[int]]:
        users = np.unique(owner)
        for part in np.array_split(users, self.num_chunks):
            yield examples[np.isin(owner, part)].tolist()


def check_draw_is_current(sampler: Sampler | None, step: int, num_workers: int = 0) -> None:
    """A step's batch must be the draw of the DP step the accountant is at (``step``): checked exactly when the
    loader has no workers (``num_workers``), which would draw ahead; with workers, a draw of an earlier step is
    refused. Training a repeated (or skipped) draw is a mechanism the accountant does not model (DESIGN invariant
    11)."""
    drawn = getattr(sampler, "last_step", None)
    if drawn is None:
        return
    if drawn == step or (num_workers > 0 and drawn > step):
        return
    raise RuntimeError(
        f"hf_dp: this step's batch is the Poisson draw of DP step {drawn}, but the model is at DP step {step}: "
        "training it would repeat (or skip) a draw, which the accountant does not model. Nothing of this step "
        "was trained. This is a misalignment between hf_dp's sampler and the Trainer's loop (a Trainer loop "
        "changed by a subclass, or a transformers version whose resume logic differs); please report it. To "
        "continue now, resume from the last checkpoint with ignore_data_skip=True or start a new train()."
    )
