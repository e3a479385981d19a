"""The per-example gradient engine: hooks, per-example norms and clipped sums, without per-example gradients.

During :meth:`ClippingEngine.record`, every covered layer keeps its input ``a`` (forward hook) and the gradient
``g`` of its output (a tensor hook), and the trainable parameters are temporarily marked ``requires_grad=False``
so that autograd never computes the unclipped parameter gradients (which would be thrown away). One backward of
``Σ_i L_i`` then yields, per layer, the factors of every example's gradient (see ``rules/``). From them:

* :meth:`per_example_norms_sq` computes ``‖G_{i,p}‖²`` for every parameter ``p`` — by the ghost norm
  ``⟨L_i L_iᵀ, R_i R_iᵀ⟩`` (Li et al. 2022, §4, App. F) or by instantiating ``G_i``, whichever is cheaper
  (:func:`use_ghost_norm`, the one place that decides);
* :meth:`accumulate_clipped` adds ``Σ_i c_i G_{i,p}`` for given per-example factors ``c`` — "book-keeping"
  (Bu et al. 2023): one matmul per layer from the stored factors, no second backward.

A parameter used by several layers (tied GPT-2 ``wte``/``lm_head``) has one per-example gradient, the sum of its
uses; its norm includes the cross terms ``⟨L_u L_vᵀ, R_u R_vᵀ⟩``.

This module is the façade the steps, the trainers and ``sft.py`` use; the work is done in the rooms beside it:
``coverage.py`` (which hook computes which parameter: the plan), ``recorder.py`` (the hooks of one micro-batch;
``broadcast.py``, the model-specific broadcast points), ``regroup.py`` (packed rows, privacy units), ``sums.py``
(norms and clipped sums, at the end of the backward pass or fused into it; ``norms.py``, the maths) and
``checks.py`` (the first-step checks).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .broadcast import ALL_POINTS
from .checks import FirstStepChecks, train_without_dropout
from .coverage import CoveragePlan
from .fallback import Fallback
from .norms import use_ghost_norm
from .recorder import Recorder
from .regroup import Units
from .rules import UnsupportedLayerError, Use
from .sums import ClippedSums, GroupHandler

__all__ = ["ClippingEngine", "GroupHandler", "use_ghost_norm", "UnsupportedLayerError", "train_without_dropout"]

logger = logging.getLogger(__name__)


class ClippingEngine:
    """Per-example gradient norms and clipped sums for every trainable parameter of a model.

    Args:
        model: the (unwrapped) model. Every module that owns a parameter with ``requires_grad=True`` must have a rule
            in ``rules/`` that covers it, or get the generic exact fallback (``fallback.py``: modules with no rule,
            re-run per example with ``torch.func``). A parameter that a ruled layer owns but its rule does not cover
            (T5Gemma2's ``eoi_embedding`` beside the embedding weight, a router's scale) gets a side fallback: the
            layer itself re-run per example for that parameter alone, its rule still recording the others (or, when
            the layer cannot be re-run per example, an enclosing module's fallback; refused, naming the cause, when
            none verifies; a parameter of the model itself is refused statically). Nothing is skipped silently, and a
            parameter is never "covered" because another module that shares it has a rule (each owner's forward is
            its own use). A parameter whose uses its owner's rule cannot see whole (read directly by an ancestor's
            forward, looked up with no batch axis, a parametrization) is computed by the fallback of its smallest
            enclosing module that treats examples independently (the enclosing-module fallback: :meth:`replan`,
            found by :meth:`first_step_check`, or statically: :class:`~hf_dp.clipping.coverage.CoveragePlan`). Layers
            that compute batch statistics (BatchNorm, InstanceNorm with running statistics) are refused: they mix
            examples in train mode and write statistics of private data into the checkpoint.
    """

    #: the recorder of one micro-batch's uses; a subclass names its own (``clipping/fsdp.py``)
    recorder_class: type[Recorder] = Recorder

    def __init__(self, model: nn.Module):
        self.model = model
        self.params: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.params[name] = p
        #: parameter id -> qualified name, shared (the same dict) by the plan, the recorder and the sums
        self._names = {id(p): n for n, p in self.params.items()}
        self._plan = CoveragePlan(model, self.params, self._names, host=self, broadcast_methods=ALL_POINTS)
        if self._plan.batch_stats:
            raise UnsupportedLayerError(
                "These layers compute statistics over the batch: " + ", ".join(self._plan.batch_stats) + ". In train "
                "mode (which DPTrainer uses) a BatchNorm normalises each example with the statistics of the whole "
                "micro-batch, which mixes examples so per-example clipping no longer bounds one example's "
                "contribution, and it writes running statistics of the private data, without noise, into the "
                "checkpoint; freezing its parameters changes neither. Replace them by layers with fixed statistics "
                "(e.g. torchvision.ops.FrozenBatchNorm2d, built from the trained BatchNorm's running statistics) or "
                "by per-example normalisations (GroupNorm, LayerNorm)."
            )
        if self._plan.problems:
            listing = "\n  ".join(self._plan.problems)
            raise UnsupportedLayerError(
                "These trainable parameters belong to layers whose per-example rule does not cover them, so their "
                f"gradients could not be clipped per example:\n  {listing}\n"
                "Freeze them before training, e.g. `model.get_parameter(name).requires_grad_(False)`, or train the "
                "model through a PEFT adapter (LoRA)."
            )
        self._logged: set[str] = set()
        self.log_fallbacks()
        self._sums = ClippedSums(self.params, self._names)
        self._recorder = self.recorder_class(model, self.params, self._names, self._plan, self._sums)
        self._checks = FirstStepChecks(self)

    # ------------------------------------------------------------------ the plan
    @property
    def plan(self) -> CoveragePlan:
        """Which hook computes which parameter (replaced when the first-step checks enclose a parameter)."""
        return self._plan

    @property
    def recorder(self) -> Recorder:
        """The hooks of one micro-batch (:meth:`record` installs them)."""
        return self._recorder

    def layer_parameters(self) -> list[tuple[str, list[str]]]:
        """``[(module name, names of the trainable parameters it holds)]`` per hooked module (per-layer groups)."""
        return self._plan.layer_parameters()

    def replan(self, names: list[str] | None) -> bool:
        """After a first-step refusal naming ``names``: compute their per-example gradients one enclosing module up
        and plan again; ``False`` when there is nothing left to try (the refusal stands).

        The enclosing-module fallback: a parameter that its owner's rule cannot see whole (read directly or applied
        functionally by an ancestor's forward, e.g. Mamba's ``conv1d.weight``; used with no batch axis, e.g. Swin's
        relative position table or DeBERTa's position projections applied once per batch) gets its per-example
        gradient from the smallest enclosing module whose forward contains all its uses and treats examples
        independently: the generic fallback (``fallback.py``) re-runs that module per example with the parameter
        replaced by its path, and the owner's rule no longer records it (:meth:`CoveragePlan.enclose`). The enclosing
        module is verified like any fallback (the per-example re-run must reproduce its batched output, no dropout),
        and the whole first-step check runs again on the new plan: it must pass for every parameter, or the first
        refusal is raised.
        """
        plan = self._plan.enclose(names) if names else None
        if plan is None:
            return False
        self._plan = plan
        self._recorder.use_plan(plan)
        return True

    def log_fallbacks(self) -> None:
        """Say once in the log which modules the generic fallback re-runs, and what it costs."""
        fallbacks = [fb for fb in self._plan.fallbacks.values()  # recurrent.py logs its own
                     if type(fb) is Fallback and fb.describe() not in self._logged]
        if not fallbacks:
            return
        self._logged.update(fb.describe() for fb in fallbacks)
        # Repeated blocks said once: "layers.*.self_attn (...) × 24" rather than 24 copies of the same description.
        counts: dict[str, int] = {}
        for fb in fallbacks:
            key = re.sub(r"\.\d+(?=[.\s(:;,]|$)", ".*", fb.describe())
            counts[key] = counts.get(key, 0) + 1
        logger.warning(
            "hf_dp: no per-layer rule covers the parameters of %s; their per-example gradients are computed exactly "
            "by the generic fallback (clipping/fallback.py): each is re-run on every example under torch.func.vmap "
            "(one extra forward and backward of the module per micro-batch) and its per-example gradients are "
            "instantiated (micro-batch size × values above). Freeze them or use LoRA if that is too slow.",
            "; ".join(k if n == 1 else f"{k} × {n}" for k, n in counts.items()),
        )

    # ------------------------------------------------------------------ recording
    @contextlib.contextmanager
    def record(self, batch_size: int, freeze: bool = True, units: torch.Tensor | None = None,
               unit_weights: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> Iterator[None]:
        """Capture the per-example factors of one micro-batch of ``batch_size`` examples.

        Run the forward *and* the backward of ``Σ_i L_i`` inside this context. Parameters are frozen inside it
        (unless ``freeze=False``, used by the checks), so no ``.grad`` is produced; the factors stay available
        (:meth:`per_example_norms_sq`) until :meth:`clear`. The model's persistent buffers (what a checkpoint saves)
        must not change inside it: a buffer updated in training (running statistics, counters) would carry private
        data into the checkpoint without noise (:class:`UnsupportedLayerError`).

        Args:
            units: ``(B,)`` privacy unit of each example (user-level DP), ids ``0..U-1``. Norms are then those of each
                unit's gradient ``G_u = Σ_{i∈u} w_i G_i`` (ghost norms over the unit's concatenated tokens, cross terms
                between its examples included), and factors given to :meth:`accumulate_clipped` are per unit.
            unit_weights: ``(B,)`` weights ``w_i`` (1 for a user's sum, ``1/n_u`` for their mean).
            segments: ``(B, T)`` for padding-free packed rows: the example ``0..S-1`` each token belongs to (``-1``
                for padding). The ``B`` rows then hold ``S`` examples, and every captured use is split into
                per-example blocks (:class:`~hf_dp.clipping.regroup.Segments`), so norms and factors are per example,
                ``(S,)``; ``units`` and ``unit_weights`` are then ``(S,)`` too. ``batch_size`` stays the number of rows.
        """
        self._sums.units = None if units is None else Units(units, unit_weights)
        with self._recorder.record(batch_size, freeze, segments):  # drops the previous micro-batch's uses
            yield

    @property
    def packed(self) -> bool:
        """Whether the micro-batch being recorded is padding-free packed rows (read by ``recurrent.py``)."""
        return self._recorder.packed

    def clear(self) -> None:
        """Drop the stored factors of the last micro-batch."""
        self._sums.clear()

    def recorded_uses(self) -> dict[str, list[Use]]:
        """``{parameter name: its uses}`` recorded and not yet clipped (benchmarks/floor.py)."""
        return self._sums.recorded_uses()

    # ------------------------------------------------------------------ norms and sums
    @property
    def summed_grads(self) -> dict[str, torch.Tensor]:
        """``{parameter name: Σ_i c_i G_i}`` accumulated since the last :meth:`pop_summed_grads`."""
        return self._sums.summed_grads

    @summed_grads.setter
    def summed_grads(self, value: dict[str, torch.Tensor]) -> None:
        self._sums.summed_grads = value

    @property
    def norm_paths(self) -> dict[str, str]:
        """``{parameter name: "ghost" | "instantiate"}``, how its last per-example norms were computed
        (:func:`use_ghost_norm`; read by benchmarks/run.py)."""
        return self._sums.norm_paths

    def unit_factors(self, unit_factors: torch.Tensor) -> torch.Tensor:
        """Per-unit clipping factors → per-example factors ``c_{u(i)} w_i`` for the clipped sum."""
        return self._sums.unit_factors(unit_factors)

    def per_example_norms_sq(self) -> dict[str, torch.Tensor]:
        """``{param name: (B,) squared per-example gradient norms}`` for every parameter that got a gradient.

        Parameters that no captured use touched (not reached by the loss) have zero gradient and are absent.
        """
        return self._sums.per_example_norms_sq()

    def accumulate_clipped(self, factors: dict[str, torch.Tensor] | torch.Tensor) -> None:
        """Add ``Σ_i c_i G_{i,p}`` into :attr:`summed_grads` for every parameter ``p``.

        Args:
            factors: one ``(B,)`` vector for all parameters (flat clipping), or ``{param name: (B,)}``; per unit
                ``(U,)`` when the micro-batch was recorded with ``units``.
        """
        self._sums.accumulate_clipped(factors)

    def pop_summed_grads(self) -> dict[str, torch.Tensor]:
        """The clipped sums accumulated since the last call (zeros for untouched parameters); resets them."""
        return self._sums.pop_summed_grads()

    @contextlib.contextmanager
    def norms_only(self, on: bool = True) -> Iterator[None]:
        """Inside it (with ``on``), each group's per-example norms are computed as its gradient arrives and its
        factors are dropped right after (flat two-pass clipping's pass 1, ``clipping/two_pass.py``):
        :meth:`per_example_norms_sq` returns the norms and :meth:`accumulate_clipped` has nothing left to add. Needs
        the groups of :meth:`set_fused_groups` (flat clipping sets them with no handler); without groups the norms
        are computed when the backward ends, from factors kept until then."""
        before, self._sums.norms_only = self._sums.norms_only, bool(on) or self._sums.norms_only
        try:
            yield
        finally:
            self._sums.norms_only = before

    # ------------------------------------------------------------------ clipping fused into back-propagation
    def set_fused_groups(self, groups: list[list[str]] | None, handler: GroupHandler | None) -> None:
        """Clip group by group *during* the backward pass (He et al. 2023, §3.1).

        With groups set, as soon as every captured use of every parameter of a group has received its output
        gradient, the engine computes the group's per-example squared norms, asks ``handler(k, norms_sq)`` for the
        ``(B,)`` clipping factors of group ``k``, adds the clipped sums, and frees that group's activations and
        output gradients. Nothing waits for the end of the backward pass except groups whose parameters are shared
        with a layer whose gradient arrives later (tied embeddings: the cross term needs both). ``None`` turns it off.

        ``handler=None`` (flat clipping, whose factors need every norm): norms at arrival only. Each group's norms are
        computed as soon as it is complete and kept, with what its clipped sum needs — the factors ``L, R``, or the
        per-example gradients instead when that is faster and they take no more memory than the factors they
        replace (:func:`use_ghost_norm` with ``memory_ratio=1``); :meth:`per_example_norms_sq` then returns them and
        :meth:`accumulate_clipped` works as without groups.
        """
        self._sums.set_fused_groups(groups, handler)

    @property
    def fused_groups(self) -> tuple[list[list[str]] | None, GroupHandler | None]:
        """``(groups, handler)`` as last given to :meth:`set_fused_groups` (to restore them after a check)."""
        return self._sums.fused_groups

    def finish_fused(self) -> None:
        """After the backward pass: process the groups not completed during it (some use got no gradient)."""
        self._sums.finish_fused()

    # ------------------------------------------------------------------ first-step checks (checks.py)
    def first_step_check(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int,
                         rtol: float = 1e-3) -> None:
        """The cheap check, always on: batch axes proven, hooks vs autograd (:meth:`FirstStepChecks.first_step_check`).
        """
        self._checks.first_step_check(run_losses, batch_size, rtol)

    def probe_layout(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int) -> None:
        """Every hooked layer's batch axis proven on ``batch_size`` examples and the first alone
        (:meth:`FirstStepChecks.probe_layout`); what is proven: :attr:`proven_layouts`."""
        self._checks.probe_layout(run_losses, batch_size)

    @property
    def proven_layouts(self) -> dict:
        """The hooked calls whose input the first step proved not plain batch-first (flattened ``B·T`` rows, or the
        examples on a later axis), by call."""
        return self._recorder.layouts

    def check_single_examples(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int,
                              num_single: int = 2, rtol: float = 1e-3, mode: str = "") -> None:
        """Each example's norm in its micro-batch equals its norm alone (:meth:`FirstStepChecks.check_single_examples`).
        """
        self._checks.check_single_examples(run_losses, batch_size, num_single, rtol, mode)

    def check_counterfactual(self, run_batch: Callable[[], torch.Tensor], rows: int, num_examples: int,
                             alone: dict[int, Callable[[], torch.Tensor]], rtol: float = 1e-3,
                             segments: torch.Tensor | None = None, what: str = "",
                             units: torch.Tensor | None = None) -> None:
        """Each example's loss and gradient in its micro-batch equal those of the example *alone* (DESIGN inv. 12;
        :meth:`FirstStepChecks.check_counterfactual`)."""
        self._checks.check_counterfactual(run_batch, rows, num_examples, alone, rtol, segments, what, units)

    def recorded_norms(self, run: Callable[[], torch.Tensor], rows: int, segments: torch.Tensor | None = None,
                       context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                       ) -> torch.Tensor:
        """Flat per-example gradient norms (float64) of one recorded run of ``run()`` (the per-example losses of a
        micro-batch of ``rows`` rows; :meth:`FirstStepChecks.recorded_norms`)."""
        return self._checks.recorded_norms(run, rows, segments, context)

    def self_check(self, run_losses: Callable[[slice], torch.Tensor], batch_size: int, num_single: int = 2,
                   rtol: float = 1e-3) -> None:
        """:meth:`first_step_check` then :meth:`check_single_examples` (both checks, on the model as it is)."""
        self.first_step_check(run_losses, batch_size, rtol)
        self.check_single_examples(run_losses, batch_size, num_single, rtol)

    # ------------------------------------------------------------------ read by tests (tests/ reads private state)
    @property
    def _enclosure(self) -> dict[int, str]:
        return self._plan.enclosure

    @property
    def _fallbacks(self) -> dict[int, Fallback]:
        return self._plan.fallbacks

    @property
    def _scratch(self) -> dict:
        return self._sums.scratch

    @property
    def _instantiated(self) -> dict:
        return self._sums.instantiated
