"""The DP step on one process or under DDP (whole parameters on every rank): book-keeping clipping.

For each chunk of a logical step (Abadi et al. 2016, Alg. 1; Li et al. 2022, §4 and App. A for DP-Adam), split into
micro-batches of at most ``per_device_train_batch_size`` examples (memory only), one forward and one backward of
``Σ_i L_i`` give every example's gradient norm and the clipped sum ``Σ_i c_i g_i`` (``clipping/engine.py``): flat
clipping computes the factors after the backward from the per-layer norms, per-layer/group-wise clipping (He et al.
2023) applies them inside it (:meth:`ClippingEngine.set_fused_groups`). Flat clipping may instead run two passes
(``clipping/two_pass.py``, ``flat_clipping_passes``; by default with activation checkpointing on): norms only in the
recorded backward, then a second forward and a backward of ``Σ_u c_u L_u``. At the step's last chunk the sum is noised
once and divided by the expected batch size (``noise.py``; the noise is all-reduced once under DDP), written to
``.grad``, and the accountant records the step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..noise import privatize
from ..peft_support import adapter_advice
from .checks import check_rtol, eval_mode_check
from .engine import ClippingEngine, train_without_dropout
from .modes import flat_clip_factors
from .step import UNIT_KEY, DPStep, StepHooks, slice_batch
from .two_pass import RandomState, clipped_backward, flat_clipping_passes

__all__ = ["LocalDPStep", "first_step_check", "unit_layout"]

_COUNTS = "_hf_dp_clip_counts"


def unit_layout(units: torch.Tensor | None, user_contribution: str
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Local unit ids ``0..U-1`` of a micro-batch (a user's rows are contiguous) and the weight ``w_i`` of each row
    in its user's contribution (``user_contribution="mean"``: ``1/n_u``; ``"sum"``: none)."""
    if units is None:
        return None, None
    local = torch.unique_consecutive(units, return_inverse=True)[1]
    if user_contribution == "sum":
        return local, None
    counts = torch.bincount(local)
    return local, 1.0 / counts[local].double()


class LocalDPStep(DPStep):
    """The DP step of :class:`~hf_dp.DPTrainer` on one process or under DDP (``clipping/step.py``)."""

    # ------------------------------------------------------------------ the step
    def training_step(self, model: nn.Module, inputs: dict | None) -> torch.Tensor:
        """Clip each example's gradient and add it to the step's sum; at the step's last chunk, privatize."""
        pc = self.pieces
        args, hooks = pc.args, pc.hooks
        self._begin_chunk(model)
        loss_sum = torch.zeros((), device=args.device)
        if inputs is not None:
            inputs = hooks.prepare_inputs(inputs)
            if "labels" not in inputs:
                raise ValueError(
                    "DPTrainer needs `labels` in every batch to compute per-example losses. If your dataset has the "
                    "targets under another name, rename that column to `labels` (and keep it with "
                    "`DPTrainingArguments(..., label_names=['labels'])`, since the Trainer drops columns the model's "
                    "forward does not list).")
            labels = inputs.pop("labels")
            units_all = inputs.pop(UNIT_KEY, None)
            net = hooks.unwrap_model(model)
            engine = self.engine
            for micro, micro_labels, micro_units in hooks.micro_batches(inputs, labels, units_all):
                segments = hooks.segment_ids(micro)  # packed rows (DPSFTTrainer): each token's example; else None
                rows = micro_labels.shape[0]
                b = rows if segments is None else int(segments.max()) + 1
                if not self.self_checked:  # always: coverage never depends on dp_self_check
                    hooks.first_step_check(net, micro, micro_labels)
                    self.self_checked = True
                units, weights = (unit_layout(micro_units, args.user_contribution) if pc.unit_layout is None
                                  else pc.unit_layout(micro_units))
                if units is not None:
                    units, weights = units.to(labels.device), None if weights is None else weights.to(labels.device)
                passes = 1 if pc.group_clipper is not None else flat_clipping_passes(args, net)
                losses, bad = self._clip_micro(net, micro, micro_labels, segments, units, weights, b, passes)
                if pc.rows_per_example > 1:  # an example of k model rows (a preference pair) is counted once
                    bad, losses = (t.view(pc.rows_per_example, -1) for t in (bad, losses))
                    bad, losses = bad.any(0), losses.sum(0)
                engine.clear()
                self.nonfinite_in_step = self.nonfinite_in_step + bad.sum()
                micro_sum = torch.where(bad, 0.0, losses).sum()
                self._add_losses(micro_sum, (~bad).sum())  # the logged loss: the realised mean (step.RealisedLoss)
                loss_sum = loss_sum + micro_sum.to(loss_sum.device)
        if hooks.sync_gradients():
            self.finish_step(model)
        return loss_sum / self._local_expected()

    def _clip_micro(self, net: nn.Module, micro: dict, labels: torch.Tensor, segments: torch.Tensor | None,
                    units: torch.Tensor | None, weights: torch.Tensor | None, b: int, passes: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip one micro-batch of ``b`` examples into the step's sums; returns its per-example losses (detached)
        and which examples got factor 0 for a non-finite loss or norm. ``passes``: 1, book-keeping (flat: factors
        kept to the end of the backward; per-layer: clipped inside it); 2, flat two-pass (``clipping/two_pass.py``):
        norms only in the recorded backward, then a second forward and backward of ``Σ_u c_u L_u``."""
        pc = self.pieces
        args, hooks, engine = pc.args, pc.hooks, self.engine
        random_state = None  # pass 2 draws what pass 1 drew (dropout masks)
        if passes == 2:
            random_state = RandomState({args.device, *(p.device for p in engine.params.values())})
        with hooks.loss_context(), engine.record(labels.shape[0], units=units, unit_weights=weights,
                                                 segments=segments), engine.norms_only(passes == 2):
            # (no reference to the outputs is kept: the logits are freed during the backward pass)
            losses = hooks.example_losses(net, micro, labels, **({} if segments is None else {"segments": segments}))
            if losses.shape != (b,):
                raise ValueError(f"per_example_loss must return shape ({b},), got {tuple(losses.shape)}.")
            if losses.requires_grad:
                losses.sum().backward()
            losses = losses.detach()
        bad = ~torch.isfinite(losses)  # non-finite examples get factor 0 (clip_factors_from_norms)
        if pc.group_clipper is None:
            norms_sq = engine.per_example_norms_sq()  # per user with user-level units
            n_units = b if units is None else int(units.max()) + 1
            factors = flat_clip_factors(norms_sq, args.per_sample_max_grad_norm, n_units,
                                        args.clipping_function, args.automatic_clipping_gamma).to(losses.device)
            zero = factors == 0
            bad = bad | (zero if units is None else zero[units])
            if passes == 1:
                engine.accumulate_clipped(factors)
            elif bool(bad.any()):
                # 0 · NaN would poison pass 2's batched backward, and a packed row cannot always be cut: this
                # micro-batch is clipped by book-keeping, from the same random state
                engine.clear()
                random_state.restore()
                return self._clip_micro(net, micro, labels, segments, units, weights, b, 1)
            else:
                engine.clear()
                clipped_backward(engine, hooks, net, micro, labels, segments, engine.unit_factors(factors),
                                 random_state, expected=losses)
        else:
            engine.finish_fused()  # groups were clipped during the backward pass
        return losses, bad

    def finish_step(self, model: nn.Module | None = None) -> None:
        """Noise once, divide by the expected batch size, write ``.grad``, record the step."""
        pc = self.pieces
        mech = pc.mechanism
        pc.hooks.check_release()  # nothing changed inside the step (guarantee.ReleasedStateGuard)
        engine = self.engine
        summed = engine.pop_summed_grads()
        if not mech.budget_allows(1):
            # Never release a step beyond the budget: no gradient, no update, nothing recorded.
            mech.stop_for_budget()
            for p in engine.params.values():
                p.grad = None
            self._step_released(released=False)
            return
        device = next(iter(summed.values())).device
        stds = mech.noise_stds()
        gc = pc.group_clipper
        adaptive = gc is not None and gc.adaptive
        if adaptive:
            # The clip counts are released with the gradient, in the same noised all-reduce (Alg. 1 lines 15-16).
            first = next(iter(summed.values()))
            summed[_COUNTS] = gc.pop_counts().to(device=device, dtype=first.dtype)
            stds = {**stds, _COUNTS: mech.quantile_noise()[1]}
        accountant = mech.accountant
        grads = privatize(summed, stds, mech.expected_batch_size, mech.noise.for_step(accountant.steps, device))
        if adaptive:
            gc.update(grads.pop(_COUNTS) + 0.5)  # b̃_k = (Σ(b − ½) + z) / B + ½
        for name, p in engine.params.items():
            p.grad = grads[name].to(p.dtype)
        pc.grad_guard.released(engine.params.values())  # before the optimizer step: these and only these
        accountant.step(mech.noise_multiplier, mech.sample_rate)
        self._step_released()


def first_step_check(engine: ClippingEngine, hooks: StepHooks, args: Any, net: nn.Module, micro: dict,
                     labels: torch.Tensor) -> None:
    """Once per run, before the first update: the engine's checks on the real model and data (called by the
    trainer's first-step hook, ``DPTrainer._self_check``, which the step calls once).

    Always (cheap; ``ClippingEngine.first_step_check``): every hooked layer's batch axis is proven (the model on
    the micro-batch and on its first example alone) and the hooks' unclipped sum equals autograd's gradient on
    two examples, so coverage never depends on ``dp_self_check``. With ``dp_self_check`` (the expensive part):
    two examples' gradient norms in the micro-batch equal their norms alone, in eval mode and in train mode with
    dropout off (a layer that behaves differently in training, e.g. batch statistics, runs as it will). The
    checks need a micro-batch of at least two examples: if the first has one, two training examples are
    collated for them.
    """
    if labels.shape[0] < 2:
        micro, labels = hooks.check_batch() or (micro, labels)
    b = labels.shape[0]

    def run_losses(sl: slice) -> torch.Tensor:
        part, part_labels = slice_batch(micro, sl, b), labels[sl]
        with hooks.loss_context():
            return hooks.example_losses(net, part, part_labels)

    rtol = check_rtol(args, net)
    was_training = net.training
    try:
        with train_without_dropout(net), adapter_advice(net):
            engine.first_step_check(run_losses, b, rtol=rtol)
            if args.dp_self_check and b >= 2:
                engine.check_single_examples(run_losses, b, rtol=rtol, mode=" (train mode, dropout off)")
        if args.dp_self_check and b >= 2:
            net.eval()
            # skipped, warned, where the model's own forward/backward raises in eval mode (shared with FSDP2's step);
            # check_single_examples's own `finally` restores the engine and clears the gradients
            eval_mode_check(lambda: engine.check_single_examples(run_losses, b, rtol=rtol, mode=" (eval mode)"))
    finally:
        net.train(was_training)

