"""The DP step as a strategy: the interface :class:`~hf_dp.DPTrainer` calls, and the pieces a strategy receives.

One logical DP-SGD step (Abadi et al. 2016, Alg. 1) arrives as ``gradient_accumulation_steps`` chunks; for each, the
trainer calls :meth:`DPStep.training_step`, which clips every example's gradient into the step's sum; at the last
chunk the strategy privatizes the sum once (noise, division by the expected batch size), writes ``.grad`` and records
the step with the accountant. Two strategies exist, chosen once when the trainer builds its clipping machinery:

* :class:`~hf_dp.clipping.local.LocalDPStep` — one process or DDP, whole parameters on each rank: book-keeping
  clipping with flat or per-layer/group thresholds fused into back-propagation (``clipping/engine.py``);
* :class:`~hf_dp.clipping.fsdp.FSDPFlatClipping` — FSDP2: two-pass flat ghost clipping, noise on the local shards.

A strategy never sees the trainer: it gets :class:`StepPieces` — the engine, the group clipper, the arguments, the
run's mechanism (:class:`StepMechanism`: σ, q, the expected batch, the accountant, the noise, the budget;
``hf_dp/mechanism.py``) and the trainer's hooks (:class:`StepHooks`: the Trainer's machinery and the overridable
per-batch functions, each looked up when called, so a subclass's override — ``DPSFTTrainer._segment_ids``,
``_micro_batches``, ``_self_check`` — takes effect). The first-step checks are one hook
(:meth:`StepHooks.first_step_check`), called once per run before the first update; the strategy marks them done.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..accounting import PrivacyAccountant
from ..guarantee import StepGradientGuard, check_no_gradient_hooks
from ..noise import NoiseGenerator
from .engine import ClippingEngine
from .modes import GroupClipper

__all__ = ["DPStep", "INDEX_KEY", "RealisedLoss", "StepHooks", "StepMechanism", "StepPieces", "UNIT_KEY",
           "micro_batch_bounds", "slice_batch"]

logger = logging.getLogger(__name__)

UNIT_KEY = "_hf_dp_unit"
"""The batch key under which the trainer's loader carries each row's privacy-unit (user) id (user-level DP)."""
INDEX_KEY = "_hf_dp_index"
"""The batch key under which the trainer's loader carries each row's index in the training set (popped by the trainer
before the DP step; the first-step counterfactual check re-reads those rows' raw features: ``hf_dp/counterfactual.py``).
"""


def micro_batch_bounds(n: int, size: int, units: torch.Tensor | None = None) -> list[int]:
    """Bounds ``[0, ..., n]`` splitting ``n`` examples into micro-batches of at most ``size`` (memory only). With
    ``units`` (each example's privacy unit, a unit's examples contiguous) a unit is never split: a micro-batch holds
    whole units, and a unit larger than ``size`` gets a micro-batch of its own."""
    if units is None:
        return list(range(0, n, size)) + [n]
    changes = (units[1:] != units[:-1]).nonzero().flatten() + 1
    edges = [0, *changes.tolist(), n]
    bounds = [0]
    for start, end in zip(edges[:-1], edges[1:]):
        if end - bounds[-1] > size and start > bounds[-1]:
            bounds.append(start)  # close the micro-batch before this unit
    bounds.append(n)
    return bounds


def slice_batch(inputs: dict, sl: Any, batch: int) -> dict:
    """The rows ``sl`` of every tensor in ``inputs`` whose first axis is the batch (``batch`` rows); others as is."""
    return {k: v[sl] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v
            for k, v in inputs.items()}


class RealisedLoss:
    """The logged training loss: the mean of the per-example losses over the examples of the *released* steps.

    Each released step adds its ``(Σ_i L_i, n)`` (summed over the ranks, examples with a non-finite loss left out);
    :meth:`pop_window` gives the mean since the last logged loss, :meth:`run_mean` the mean over the run (the final
    ``train_loss``). A step that is discarded (DESIGN invariant 11) adds nothing, and an empty Poisson step adds no
    example, so neither pulls the mean towards 0; the realised batch size does not scale it (it is not divided by
    the expected batch). Like the plain Trainer's loss, it is computed from the private data without noise: it is
    **not** covered by the DP guarantee (never published by hf_dp: the card omits it, pushed records are redacted).
    Totals stay on the device; they are read (one synchronisation) only when a loss is logged.
    """

    def __init__(self) -> None:
        self._window: torch.Tensor | None = None
        self._run: torch.Tensor | None = None

    def reset_run(self) -> None:
        """At train start: a new run, a new window."""
        self._window = self._run = None

    def add(self, totals: torch.Tensor) -> None:
        """One released step's ``[Σ_i L_i, n]`` (float64, already summed over the ranks)."""
        self._window = totals if self._window is None else self._window + totals
        self._run = totals if self._run is None else self._run + totals

    @staticmethod
    def _mean(totals: torch.Tensor | None) -> float | None:
        if totals is None:
            return None
        loss_sum, count = totals.tolist()
        return loss_sum / count if count > 0 else None

    def pop_window(self) -> float | None:
        """The mean over the examples of the steps released since the last call (None: no example in them)."""
        mean, self._window = self._mean(self._window), None
        return mean

    def run_mean(self) -> float | None:
        """The mean over the examples of every step released since :meth:`reset_run` (None: no example)."""
        return self._mean(self._run)


class StepMechanism(Protocol):
    """What a step reads of the run's DP mechanism (:class:`hf_dp.mechanism.Mechanism`), at each release: the
    accountant (replaced on resume and for a new model), σ (calibrated at train start), the noise generator (made
    with the train loader), q, the expected batch, the noise stds and the budget."""

    accountant: PrivacyAccountant
    noise: NoiseGenerator | None
    noise_multiplier: float | None
    sample_rate: float
    expected_batch_size: int

    def noise_stds(self) -> float | dict[str, float]:
        """Noise std on each parameter's summed clipped gradient (σ·C, or per group)."""

    def quantile_noise(self) -> tuple[float, float]:
        """``(σ of the gradient, σ_b of the clip counts)`` (adaptive clipping; ``(σ, 0)`` otherwise)."""

    def budget_allows(self, n: int) -> bool:
        """Whether ``n`` more steps stay within the privacy budget."""

    def stop_for_budget(self) -> None:
        """A step released nothing because the budget is spent."""


class StepHooks(Protocol):
    """What a step calls of the trainer: the Trainer's machinery and the trainer's overridable hooks."""

    def prepare_inputs(self, inputs: dict) -> dict:
        """The Trainer's ``_prepare_inputs`` (inputs on the device)."""

    def loss_context(self) -> Any:
        """The Trainer's ``compute_loss_context_manager()`` (autocast)."""

    def per_example_loss(self, outputs: Any, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Each example's own loss, ``Tensor[B]`` (``losses.py``)."""

    def model_inputs(self, model: nn.Module, inputs: dict, labels: torch.Tensor) -> dict:
        """The model's inputs for a micro-batch."""

    def example_losses(self, net: nn.Module, inputs: dict, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Each example's own loss on a micro-batch, ``Tensor[B]``: the model's forward on :meth:`model_inputs`, then
        :meth:`per_example_loss` (``kwargs``: ``segments=`` for packed rows) — or, with ``lm_loss_chunk_size``, the
        backbone's forward and the LM head in chunks of positions (``hf_dp/chunked_loss.py``). The one place a DP
        step's forward runs."""

    def micro_batches(self, inputs: dict, labels: torch.Tensor, units: torch.Tensor | None = None) -> list:
        """A chunk split into ``(inputs, labels, units)`` micro-batches (memory only; a unit is never split)."""

    def segment_ids(self, inputs: dict) -> torch.Tensor | None:
        """Each token's example in a padding-free packed micro-batch; ``None`` when every row is one example."""

    def first_step_check(self, net: nn.Module, micro: dict, labels: torch.Tensor) -> None:
        """Once per run, before the first update: the first-step checks on the real model and micro-batch."""

    def check_batch(self) -> tuple[dict, torch.Tensor] | None:
        """Two training examples collated on the device (first-step checks of a one-example micro-batch)."""

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The model without accelerate's wrappers."""

    def sync_gradients(self) -> bool:
        """Whether this chunk is the last of its logical step."""

    def optimizer(self) -> Any:
        """The Trainer's optimizer."""

    def check_release(self) -> None:
        """Called first thing when a step releases (or, at a budget stop, releases nothing): the released-state
        check (``guarantee.ReleasedStateGuard``)."""

    def check_step_mechanism(self) -> None:
        """Before a step releases: its q and C are those the accountant records (``Mechanism.check_step``); called by
        :meth:`check_release`, and by the FSDP step, which has no released-state check."""


@dataclass
class StepPieces:
    """What a DP step strategy is given by the trainer. Never the trainer itself.

    ``args`` is the run's ``DPTrainingArguments`` and ``mechanism`` the run's DP mechanism, both read live at each
    use; ``hooks`` are the trainer's functions the step calls.
    """

    engine: ClippingEngine
    group_clipper: GroupClipper | None
    args: Any
    grad_guard: StepGradientGuard
    mechanism: StepMechanism
    hooks: StepHooks
    # where released steps' losses go (the logged loss); the trainer keeps one across rebuilt strategies
    realised_loss: RealisedLoss = field(default_factory=RealisedLoss)
    # ``units -> (local unit ids, weights)`` for a micro-batch whose model rows are not one example each (the two
    # sequences of a preference pair, ``hf_dp/preference.py``); None: ``local.unit_layout`` with user_contribution
    unit_layout: Callable[[torch.Tensor | None], tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
    # model rows per example, laid out as [first rows of the examples; second rows; ...] (a preference pair: 2, its
    # chosen sequence at i and its rejected one at B + i): the logged loss and the non-finite count go per example
    rows_per_example: int = 1


class DPStep(abc.ABC):
    """One DP step strategy. The trainer calls :meth:`run_chunk` once per chunk of a logical step.

    State shared by all strategies: :attr:`self_checked` (the first-step checks ran this run),
    :attr:`nonfinite_in_step` (examples of the current step given clipping factor 0 for a non-finite loss or norm,
    collected by the trainer's report), and the chunk count (:attr:`at_step_boundary`).

    **A step is atomic** (DESIGN invariant 11). Everything a step accumulates before its release — the engine's
    clipped sums (:attr:`ClippingEngine.summed_grads`), the group clipper's clip counts, the non-finite count, the
    chunk count, the per-example losses of the logged loss, and (under FSDP) the pass-2 gradients in ``.grad`` — goes
    out whole with that step's noise in :meth:`finish_step`, or is discarded by :meth:`discard_step`. Every way into
    a step goes through here: :meth:`begin_step` when the trainer fetches a new step's chunks, :meth:`run_chunk`
    (an exception escaping a chunk discards the step before it propagates), :meth:`reset` at ``train()`` and at
    every train start (``on_train_begin``, also when accelerate's ``find_executable_batch_size`` re-runs the loop
    after running out of memory). A discarded step released nothing and the accountant did not count it; the step
    that replaces it is drawn as the same DP step (the trainer's Poisson draw of DP step ``k`` depends only on the
    run's seed and ``k``), so a retry never picks a new draw.
    """

    def __init__(self, pieces: StepPieces):
        self.pieces = pieces
        self.engine = pieces.engine
        self.self_checked = False
        self.nonfinite_in_step: torch.Tensor | int = 0
        self._chunk_in_step = 0
        self._step_losses: tuple | None = None  # (Σ_i L_i, n) of this step's chunks on this rank
        self._step_model: nn.Module | None = None  # the model the open step's chunks ran on

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
        """At ``train()`` and at every train start: the next chunk starts a logical step; a half-done step (an
        interrupted ``train()``, a retry after running out of memory) is discarded, with a logged warning."""
        self.discard_step("training started again after a run that stopped inside the step")
        self.nonfinite_in_step = 0

    # ------------------------------------------------------------------ the step's state (DESIGN invariant 11)
    def begin_step(self) -> None:
        """A new logical step begins (the trainer fetches its chunks): the step state must be empty. A step left
        half done — a callback that ended the epoch or the run between two chunks, an epoch that ended inside a
        step — is discarded here, with a logged warning, so its clipped sum is never added to this one's."""
        self.discard_step("a new step began before it was released (a callback ended the epoch or the run, or the "
                          "epoch ended, between two of its gradient accumulation chunks)")

    def run_chunk(self, model: nn.Module, inputs: dict | None) -> torch.Tensor:
        """One chunk of a logical step (:meth:`training_step`), the one way the trainer runs the strategy: an
        exception escaping it (``KeyboardInterrupt``, running out of memory, a refusal) discards the step first."""
        if self._chunk_in_step == 0 and self.has_partial_step():
            self.discard_step("the state of an earlier step was still held when a step began")
        if self._chunk_in_step == 0:  # a gradient hook added since train start (a callback's on_train_begin /
            # on_step_end) would see this step's clipped sum before the noise (two-pass; FSDP2's post-accumulate hooks)
            check_no_gradient_hooks(model, "at this step's start; nothing of it computed")
        try:
            return self.training_step(model, inputs)
        except BaseException as err:
            self.discard_step(f"{type(err).__name__} escaped the DP step", force=True)
            raise

    def has_partial_step(self) -> bool:
        """Whether a step has begun and not been released: a chunk ran, or clipped sums are held."""
        return self._chunk_in_step > 0 or bool(self.engine.summed_grads)

    def discard_step(self, reason: str, force: bool = False) -> bool:
        """Drop the open step's whole state; nothing of it is released, counted or logged. Logs a warning when there
        was one (``force``: treat the step as open, e.g. an exception inside :meth:`finish_step`). Returns whether
        a step was discarded."""
        chunks = self._chunk_in_step
        gc = self.pieces.group_clipper
        counts = gc.pop_counts() if gc is not None else None
        partial = force or self.has_partial_step() or (counts is not None and bool(counts.any()))
        self._chunk_in_step = 0
        self._step_losses = None
        if not partial:
            return False
        self.engine.summed_grads = {}
        self.engine.clear()
        self.nonfinite_in_step = 0
        self._discard_partial()
        self._step_model = None
        logger.warning(
            "hf_dp: a DP step left half done (%d of %d chunk(s) run) was discarded: %s. Its clipped sums, clip "
            "counts and non-finite count are dropped; nothing of it was released, counted by the accountant or "
            "logged. The step is drawn again as the same DP step (same Poisson draw).",
            chunks, self.pieces.args.gradient_accumulation_steps, reason)
        return True

    def _discard_partial(self) -> None:
        """Strategy-specific state of a discarded step (FSDP: the pass-2 gradients). By default the ``.grad`` of the
        clipped parameters, which a step writes only in :meth:`finish_step`."""
        for p in self.engine.params.values():
            p.grad = None

    def _add_losses(self, loss_sum: torch.Tensor, count: torch.Tensor | int) -> None:
        """Add a micro-batch's ``Σ_i L_i`` over ``count`` examples (finite losses only) to the step's logged loss
        (kept as they come, on their devices: no copy and no synchronisation per micro-batch)."""
        if self._step_losses is None:
            self._step_losses = (loss_sum.detach(), count)
        else:
            total, n = self._step_losses
            self._step_losses = (total + loss_sum.detach(), n + count)

    def _step_released(self, released: bool = True) -> None:
        """End of :meth:`finish_step`: the step went out (``released``: its losses join the logged loss, summed over
        the ranks) or released nothing (budget stop). Either way the step state is now empty."""
        if released:
            device = self.pieces.args.device
            if self._step_losses is None:
                totals = torch.zeros(2, dtype=torch.float64, device=device)
            else:
                total, n = self._step_losses
                totals = torch.stack([total.to(device=device, dtype=torch.float64).reshape(()),
                                      torch.as_tensor(n, dtype=torch.float64).to(device).reshape(())])
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(totals)  # every rank finishes every step (empty chunks included)
            self.pieces.realised_loss.add(totals)
        gc = self.pieces.group_clipper
        if gc is not None:
            gc.pop_counts()  # released with the gradient (adaptive clipping) or, with nothing released, dropped
        self._step_losses = None
        self._chunk_in_step = 0
        self._step_model = None

    def _begin_chunk(self, model: nn.Module) -> None:
        self._step_model = model
        model.train()
        optimizer = self.pieces.hooks.optimizer()
        if hasattr(optimizer, "train") and callable(optimizer.train):
            optimizer.train()  # schedule-free optimizers keep train/eval weights
        self._chunk_in_step += 1

    def _local_expected(self) -> int:
        """This rank's expected batch per step: each chunk returns ``Σ_i L_i`` over it to the Trainer's own loss
        accumulator (summed over the chunks, about the step's mean loss). The loss the trainer logs is not that one:
        it is the realised mean over the examples of the released steps (:class:`RealisedLoss`)."""
        args = self.pieces.args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps

    @abc.abstractmethod
    def training_step(self, model: nn.Module, inputs: dict | None) -> torch.Tensor:
        """One chunk of a logical step (``inputs=None``: this rank's Poisson chunk is empty); called through
        :meth:`run_chunk`. Adds each example's finite loss to the step's logged loss (:meth:`_add_losses`) and returns
        the chunk's ``Σ_i L_i / expected batch`` for the Trainer's accumulator; at the step's last chunk, calls
        :meth:`finish_step`."""

    @abc.abstractmethod
    def finish_step(self, model: nn.Module) -> None:
        """Privatize the step's clipped sum once, write ``.grad``, record the step with the accountant — or, when
        one more step would exceed the budget, release nothing and stop training. Ends with
        :meth:`_step_released`."""
