"""The DP step as a strategy: the interface :class:`~hf_dp.DPTrainer` calls, and the pieces a strategy receives.

One logical DP-SGD step (Abadi et al. 2016, Alg. 1) arrives as ``gradient_accumulation_steps`` chunks; for each, the
trainer calls :meth:`DPStep.training_step`, which clips every example's gradient into the step's sum; at the last
chunk the strategy privatizes the sum once (noise, division by the expected batch size), writes ``.grad`` and records
the step with the accountant. Two strategies exist, chosen once when the trainer builds its clipping machinery:

* :class:`~hf_dp.clipping.local.LocalDPStep` — one process or DDP, whole parameters on each rank: book-keeping
  clipping with flat or per-layer/group thresholds fused into back-propagation (``clipping/engine.py``);
* :class:`~hf_dp.clipping.fsdp.FSDPFlatClipping` — FSDP2: two-pass flat ghost clipping, noise on the local shards.

A strategy never sees the trainer: it gets :class:`StepPieces` — the engine, the group clipper, the arguments, and
the few trainer callables it needs as plain functions. The callables look the trainer's method up when called, so a
subclass's override (``DPSFTTrainer._segment_ids``, ``_micro_batches``, ``_self_check``, ...) takes effect.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..accounting import PrivacyAccountant
from ..guarantee import StepGradientGuard
from ..noise import NoiseGenerator
from .engine import ClippingEngine
from .modes import GroupClipper

__all__ = ["DPStep", "INDEX_KEY", "StepPieces", "UNIT_KEY", "slice_batch"]

UNIT_KEY = "_hf_dp_unit"
"""The batch key under which the trainer's loader carries each row's privacy-unit (user) id (user-level DP)."""
INDEX_KEY = "_hf_dp_index"
"""The batch key under which the trainer's loader carries each row's index in the training set (popped by the trainer
before the DP step; the first-step counterfactual check re-reads those rows' raw features: ``hf_dp/counterfactual.py``).
"""


def slice_batch(inputs: dict, sl: Any, batch: int) -> dict:
    """The rows ``sl`` of every tensor in ``inputs`` whose first axis is the batch (``batch`` rows); others as is."""
    return {k: v[sl] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v
            for k, v in inputs.items()}


@dataclass
class StepPieces:
    """What a DP step strategy is given by the trainer. Never the trainer itself.

    Values that change during a run (σ is calibrated at train start, the accountant is replaced on resume and by
    ``model_init``, the noise generator is made with the train loader, the arguments may be edited between runs) are
    given as zero-argument callables read at each use; ``args`` is the run's ``DPTrainingArguments``, read live.
    """

    engine: ClippingEngine
    group_clipper: GroupClipper | None
    args: Any
    grad_guard: StepGradientGuard
    # the mechanism, read live
    accountant: Callable[[], PrivacyAccountant]
    noise: Callable[[], NoiseGenerator]
    noise_multiplier: Callable[[], float]
    sample_rate: Callable[[], float]
    expected_batch_size: Callable[[], int]
    noise_stds: Callable[[], float | dict[str, float]]
    quantile_noise: Callable[[], tuple[float, float]]
    budget_allows: Callable[[int], bool]
    stop_for_budget: Callable[[], None]
    # the Trainer's machinery and the trainer's overridable hooks
    prepare_inputs: Callable[[dict], dict]
    loss_context: Callable[[], Any]
    per_example_loss: Callable[..., torch.Tensor]
    model_inputs: Callable[[nn.Module, dict, torch.Tensor], dict]
    micro_batches: Callable[..., list]
    segment_ids: Callable[[dict], torch.Tensor | None]
    self_check: Callable[[nn.Module, dict, torch.Tensor], None]
    check_batch: Callable[[], tuple[dict, torch.Tensor] | None]
    unwrap_model: Callable[[nn.Module], nn.Module]
    sync_gradients: Callable[[], bool]
    optimizer: Callable[[], Any]


class DPStep(abc.ABC):
    """One DP step strategy. The trainer calls :meth:`training_step` once per chunk of a logical step.

    State shared by all strategies: :attr:`self_checked` (the first-step checks ran this run),
    :attr:`nonfinite_in_step` (examples of the current step given clipping factor 0 for a non-finite loss or norm,
    collected by the trainer's report), and the chunk count (:attr:`at_step_boundary`).
    """

    def __init__(self, pieces: StepPieces):
        self.pieces = pieces
        self.engine = pieces.engine
        self.self_checked = False
        self.nonfinite_in_step: torch.Tensor | int = 0
        self._chunk_in_step = 0

    @property
    def at_step_boundary(self) -> bool:
        """The next chunk is the first of a logical step."""
        return self._chunk_in_step == 0

    def pop_nonfinite(self) -> int:
        """Examples of the last step with a non-finite loss or gradient norm; the count restarts."""
        count = int(self.nonfinite_in_step)
        self.nonfinite_in_step = 0
        return count

    def reset(self) -> None:
        """At ``train()``: the next chunk starts a logical step; a half-done step is dropped."""
        self._chunk_in_step = 0
        self.nonfinite_in_step = 0

    def _begin_chunk(self, model: nn.Module) -> None:
        model.train()
        optimizer = self.pieces.optimizer()
        if hasattr(optimizer, "train") and callable(optimizer.train):
            optimizer.train()  # schedule-free optimizers keep train/eval weights
        self._chunk_in_step += 1

    def _local_expected(self) -> int:
        """This rank's expected batch per step: the logged loss is ``Σ_i L_i`` over it (summed over the chunks, the
        step's mean loss)."""
        args = self.pieces.args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps

    @abc.abstractmethod
    def training_step(self, model: nn.Module, inputs: dict | None) -> torch.Tensor:
        """One chunk of a logical step (``inputs=None``: this rank's Poisson chunk is empty). Returns the logged
        loss; at the step's last chunk, calls :meth:`finish_step`."""

    @abc.abstractmethod
    def finish_step(self, model: nn.Module) -> None:
        """Privatize the step's clipped sum once, write ``.grad``, record the step with the accountant — or, when
        one more step would exceed the budget, release nothing and stop training."""
