"""Flat per-example clipping under FSDP2 (accelerate's FSDP plugin, ``fsdp_version=2``): two-pass ghost clipping.

Why the ordinary engine cannot run under FSDP: :class:`~hf_dp.clipping.engine.ClippingEngine` finds a parameter's
uses by ``id(param)`` captured before wrapping, and it clips by book-keeping (it forms ``Σ_i c_i G_i`` itself and
writes ``.grad``). Under FSDP2 the parameters a layer holds during forward and backward are *other* tensors (the
unsharded ``nn.Parameter`` that FSDP2 swaps in; the registered one is a sharded DTensor), and ``.grad`` must be the
rank's shard of the gradient reduced over ranks. So here (Li et al. 2022, §4: ghost clipping, a norm pass then a
backward of the reweighted loss):

* **Pass 1 — norms only.** A forward with the engine's layer hooks, then ``torch.autograd.grad(Σ_i L_i, inputs=<the
  hooked layers' outputs>)``. Autograd computes every hooked layer's output gradient (the tensor hooks fire with the
  full, unsharded weights and this rank's full activations) but no parameter gradient (no ``AccumulateGrad`` node
  runs), so FSDP reduces nothing. Uses are mapped to parameter names *by attribute* (module, ``"weight"``), not by
  identity; tied parameters (GPT-2 ``wte``/``lm_head``) keep one name and their cross terms. The engine's ghost-norm
  vs instantiation decision applies unchanged (:meth:`ClippingEngine.per_example_norms_sq`).
* **Pass 2 — clipped backward.** On the same graph (``retain_graph``), an ordinary ``backward`` of
  ``Σ_i c_i L_i · W / B`` with ``c_i = min(1, C / (‖g_i‖ + 1e-6))``, ``W`` the world size and ``B = qN`` the expected
  batch size. FSDP2's reduce-scatter *averages* over the ``W`` ranks, so every rank's ``.grad`` shard holds its rows
  of ``Σ_{all ranks} Σ_i c_i g_i / B``.
* **Noise.** Each rank adds ``N(0, (σC/B)²)`` to the coordinates it owns (the local tensor of each ``Shard`` DTensor
  gradient), from a generator seeded by ``(seed, step, rank)``. Shards are disjoint and cover every coordinate, so
  each coordinate is noised exactly once with total std ``σC`` on the sum (DESIGN invariant 5).

Under FSDP the forwards and backwards are collectives (all-gathers, reduce-scatters), so every rank must run the
same number of micro-batches: the step's micro-batch count is all-reduced (MAX) per chunk and a rank with fewer
(its Poisson sample is smaller, or empty) runs padding micro-batches of one row with clipping factor 0, whose
contribution is exactly zero. The Poisson shards of :mod:`hf_dp.sampling` and the accountant are unchanged.

Only flat clipping, example-level, with FSDP2 is supported; the trainer refuses the rest
(:func:`check_fsdp_supported`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..noise import add_noise_to_shards
from .checks import check_rtol, eval_mode_check, norm_alone_problem
from .engine import ClippingEngine, UnsupportedLayerError, train_without_dropout
from .modes import flat_clip_factors
from .recorder import Recorder
from .rules import Rule
from .step import INDEX_KEY, DPStep, StepPieces, slice_batch
from .two_pass import backward_clipped_loss

__all__ = ["FSDPClippingEngine", "FSDPFlatClipping", "check_fsdp_supported", "fsdp_requested"]

_TRUE = ("1", "true", "yes", "on")


def fsdp_requested(args: Any, environ: dict[str, str] | None = None) -> bool:
    """Whether the user asked for FSDP: ``TrainingArguments(fsdp=..., fsdp_config=...)`` or ``accelerate launch
    --use_fsdp`` (which exports ``ACCELERATE_USE_FSDP=true``)."""
    env = os.environ if environ is None else environ
    return bool(getattr(args, "fsdp", None)) or env.get("ACCELERATE_USE_FSDP", "false").strip().lower() in _TRUE


def check_fsdp_supported(plugin: Any, args: Any) -> None:
    """Refuse FSDP settings under which hf_dp's FSDP path is not exact (raises ``ValueError``).

    ``plugin`` is accelerate's ``FullyShardedDataParallelPlugin`` (``accelerator.state.fsdp_plugin``), ``args`` the
    ``DPTrainingArguments``. Supported: FSDP2 (``fsdp_version=2``), flat clipping, example-level privacy. Per-layer /
    adaptive / group-wise / per-device clipping and user-level units need the engine's book-keeping on whole
    parameters; FSDP1 is deprecated by transformers and, on CPU, cannot save (a torch bug in ``FULL_STATE_DICT`` with
    ``offload_to_cpu``).
    """
    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    if version != 2:
        raise ValueError(
            f"DPTrainer supports FSDP2 only (got fsdp_version={version}). Use fsdp_config={{'version': 2, ...}} or "
            "`accelerate launch --use_fsdp --fsdp_version 2`. FSDP1 is deprecated in transformers."
        )
    if args.clipping != "flat":
        raise ValueError(
            f"Under FSDP, DPTrainer supports clipping='flat' only (got clipping={args.clipping!r}): per-layer, "
            "adaptive and group-wise clipping need whole parameters on each rank. Use multi-process DDP "
            "(`accelerate launch --multi_gpu`) for them, and clipping='per_device' for model-parallel placement "
            "(a model placed across devices with device_map)."
        )
    if getattr(args, "flat_clipping_passes", "auto") == "one":
        raise ValueError(
            "Under FSDP, flat clipping is always two-pass (norms, then a backward of the reweighted loss: "
            "clipping/fsdp.py); flat_clipping_passes='one' (book-keeping on whole parameters) is not available. "
            "Leave flat_clipping_passes='auto'."
        )
    if args.privacy_unit != "example":
        raise ValueError(
            "Under FSDP, DPTrainer supports privacy_unit='example' only. Use multi-process DDP "
            "(`accelerate launch --multi_gpu`) for user-level DP, or clipping='per_device' for model-parallel "
            "placement."
        )
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False) \
            or getattr(plugin, "activation_checkpointing", False):
        raise ValueError(
            "Under FSDP, DPTrainer does not support activation checkpointing yet: its FSDP clipping records layer "
            "inputs with hooks of its own (clipping/fsdp.py), which have not been made to follow segments recomputed "
            "in the backward (clipping/checkpointing.py covers one device and DDP). Turn activation checkpointing "
            "off, or train under DDP / on one device, where it is supported."
        )


class FSDPRecorder(Recorder):
    """The recorder under FSDP2 (``Recorder.layer_hook`` overridden): each ruled layer's uses are keyed by its
    attributes (FSDP replaces the parameter objects by unsharded ones during the forward, so identities change), the
    parameters are not frozen, and each hooked output is kept for pass 1's ``autograd.grad``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: module id -> {attribute: canonical parameter name}, set by FSDPClippingEngine from the unwrapped model
        self.attr_names: dict[int, dict[str, str]] = {}
        self._outputs: list[torch.Tensor] = []
        self._capturing = False

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Keep the hooked outputs and record output gradients inside it (pass 1)."""
        self._outputs = []
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
            self._outputs = []

    def take_outputs(self) -> list[torch.Tensor]:
        """The hooked outputs that need a gradient; recording stops (the retained graph's tensor hooks must not record
        again in pass 2)."""
        outs = [o for o in self._outputs if o.requires_grad]
        self._outputs = []
        return outs

    def stop(self) -> None:
        self._capturing = False

    def layer_hook(self, name: str, module: nn.Module, rule: Rule):
        attrs = self.attr_names.get(id(module), {})

        def hook(mod, args, kwargs, output):
            if self._probe is not None:  # first-step layout probe (FirstStepChecks.probe_layout)
                self._probe[self._next_call(mod)] = (args[0] if args else next(iter(kwargs.values()))).detach().clone()
                return None
            if not self._capturing or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return None
            inp = (args[0] if args else next(iter(kwargs.values()))).detach()
            if rule.verify is not None and id(module) not in self._verified:
                rule.verify(module, name, inp, output)
                self._verified.add(id(module))
            if not output.requires_grad:
                output = output.detach().requires_grad_(True)
            out_data = output.detach()  # the hook must not refer to `output` (see Recorder.layer_hook)

            def grad_hook(grad: torch.Tensor) -> None:
                if not self._capturing:
                    return
                # The tensors FSDP has put on the module now (unsharded), named by attribute, not by identity.
                by_id = {id(getattr(module, a)): n for a, n in attrs.items() if getattr(module, a, None) is not None}
                for u in rule.uses(module, name, inp, out_data, grad.detach()):
                    n = by_id.get(id(u.param))
                    if n is None:
                        continue
                    if u.batch_size != self._batch_size:
                        raise UnsupportedLayerError(
                            f"{name} saw a batch of {u.batch_size} in a micro-batch of {self._batch_size} examples: "
                            "an input is broadcast across the batch, so per-example gradients would merge examples. "
                            "Materialise the input per example."
                        )
                    self._sums.store(n, u)

            output.register_hook(grad_hook)
            self._outputs.append(output)
            return output

        return hook


class FSDPClippingEngine(ClippingEngine):
    """The per-example norm engine for FSDP2-wrapped models: hooks keyed by (module, attribute), norms only.

    Build it on the model *before* ``accelerator.prepare`` wraps it (as :class:`DPTrainer` does in ``__init__``):
    coverage is checked, and every ruled layer's parameters get their canonical names, from the unwrapped model. No
    reference to the parameters is kept (FSDP replaces them by shards; keeping them would keep a full copy of the
    model alive on every rank): :attr:`params` holds ``meta`` tensors of the same shapes.
    """

    recorder_class = FSDPRecorder

    def __init__(self, model: nn.Module):
        super().__init__(model)
        plan = self.plan
        special = [f"{n} ({type(m).__name__})" for n, m, r in plan.layers if r.capture is not None or r.all_inputs]
        if special:  # their hooks are not keyed by attribute here (layers.Rule.capture / all_inputs)
            raise UnsupportedLayerError(
                "Under FSDP, hf_dp has no per-example rule yet for these layers (embedding subclasses, MoE experts "
                "and routers): " + ", ".join(special) + ". Freeze them (requires_grad_(False)), train through LoRA, "
                "or train without FSDP."
            )
        if plan.fallbacks:
            raise UnsupportedLayerError(
                "Under FSDP, hf_dp has no generic fallback for layers without a per-layer rule: "
                + "; ".join(fb.describe() for fb in plan.fallbacks.values())
                + ". Freeze them (requires_grad_(False)), use a PEFT adapter (LoRA), or train with DDP."
            )
        names = plan.names
        for _, module, rule in plan.layers:
            self.recorder.attr_names[id(module)] = {
                a: names[id(getattr(module, a))] for a in rule.params
                if getattr(module, a, None) is not None and id(getattr(module, a)) in names
            }
        # In place: the plan, the recorder and the sums hold these same two dicts.
        for n, p in list(self.params.items()):
            self.params[n] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        names.clear()

    @contextlib.contextmanager
    def capture(self, batch_size: int) -> Iterator[None]:
        """Record one micro-batch's layer inputs and output gradients (run the forward and :meth:`norms_backward`
        inside). Parameters are not frozen: pass 1 asks autograd for layer-output gradients only."""
        with self.recorder.capturing(), self.record(batch_size, freeze=False):
            yield

    def norms_backward(self, losses: torch.Tensor, retain_graph: bool = False) -> None:
        """Pass 1: ``autograd.grad(Σ_i L_i, <hooked outputs>)`` — output gradients only, no parameter gradient."""
        outs = self.recorder.take_outputs()
        if outs and losses.requires_grad:
            torch.autograd.grad(losses.sum(), outs, allow_unused=True, retain_graph=retain_graph)
        self.recorder.stop()  # the retained graph's tensor hooks must not record again in pass 2

    @torch.no_grad()
    def per_example_norms(self, batch_size: int) -> torch.Tensor:
        """``(B,)`` flat per-example gradient norms (float64) of the captured micro-batch."""
        norms_sq = self.per_example_norms_sq()
        self.clear()  # (drops the instantiations kept for a clipped sum)
        if not norms_sq:
            return torch.zeros(batch_size, dtype=torch.float64)
        return torch.stack([v.double() for v in norms_sq.values()]).sum(0).sqrt()


def _reset_after_error(engine: FSDPClippingEngine, model: nn.Module) -> None:
    """After the model's own forward/backward raised inside a check: drop what the engine recorded and reset FSDP2's
    per-iteration state (``FSDPModule.reset_iter_state`` on the root: the aborted backward left parameters unsharded
    and its final callback unrun), so that training runs on; without that method (torch < 2.13) nothing can."""
    engine.clear()
    reset = getattr(model, "reset_iter_state", None)
    if not callable(reset):
        raise RuntimeError(
            "The model's own forward/backward raised in eval mode during dp_self_check under FSDP2, and this torch "
            f"({torch.__version__}) has no FSDPModule.reset_iter_state to restore FSDP's state after it. Set "
            "dp_self_check=False (the coverage checks still run at the first step) or upgrade torch.")
    reset()


def _all_max(value: float, device: torch.device) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


class FSDPFlatClipping(DPStep):
    """The DP step of :class:`~hf_dp.DPTrainer` under FSDP2: two-pass flat ghost clipping, sharded noise
    (``clipping/step.py``; the trainer chooses it when ``is_fsdp_enabled``).

    ``pieces.engine`` is an :class:`FSDPClippingEngine` built on the model before ``accelerator.prepare`` wraps it.
    Set :attr:`dummy_source` to the train DataLoader (its dataset and collator give the one-row padding micro-batch).
    """

    def __init__(self, pieces: StepPieces):
        super().__init__(pieces)
        self.dummy_source: Any = None
        self._dummy: tuple[dict, torch.Tensor] | None = None
        #: micro-batches run / of which padding, since construction (for tests and logs)
        self.stats = {"micro_batches": 0, "padding": 0}
        self.reset()

    def reset(self) -> None:
        """At ``train()``: the next chunk starts a logical step; drop a half-done self-check."""
        super().reset()
        self._checking = False  # the first step runs the self-check (dp_self_check)
        self._singles_checked = False
        self._layout_checked = False
        self.engine.summed_grads = {}

    def _discard_partial(self) -> None:
        """A discarded step's pass-2 backward left its clipped sum in the sharded ``.grad``: dropped; the first-step
        check it was part of runs again on the next step."""
        model = self._step_model if self._step_model is not None else self.engine.model
        for p in model.parameters():
            p.grad = None
        self._checking = False

    # ------------------------------------------------------------------ the step
    def training_step(self, model: nn.Module, inputs: dict | None) -> torch.Tensor:
        """One chunk of a logical step (``inputs=None``: this rank's chunk is empty). Returns the logged loss."""
        pc = self.pieces
        device = pc.args.device
        if self.at_step_boundary and not self.self_checked:
            # Always (coverage never depends on dp_self_check): the first step's clipped sum from the hooks is
            # compared with the gradient FSDP reduced (pass 2 is a plain backward: an unhooked use would leak into
            # it). dp_self_check adds the single-example norm comparison.
            self._checking, self._singles_checked = True, not pc.args.dp_self_check
        self._begin_chunk(model)
        micro: list[tuple[dict, torch.Tensor, torch.Tensor]] = []
        if inputs is not None:
            inputs = pc.hooks.prepare_inputs(inputs)
            if "labels" not in inputs:
                raise ValueError("DPTrainer needs `labels` in every batch to compute per-example losses.")
            labels = inputs.pop("labels")
            for part, part_labels, _ in pc.hooks.micro_batches(inputs, labels):
                micro.append((part, part_labels, torch.ones(part_labels.shape[0], dtype=torch.float64)))
        n = int(_all_max(len(micro), device))  # every rank runs the same number of forwards/backwards
        while len(micro) < n:
            part, part_labels = self._padding_batch()
            micro.append((part, part_labels, torch.zeros(part_labels.shape[0], dtype=torch.float64)))
            self.stats["padding"] += 1
        loss_sum = torch.zeros((), device=device)
        for part, part_labels, weights in micro:
            if self._checking and not self._layout_checked:
                self._check_layout(model, part, part_labels)
            if self._checking and not self._singles_checked:
                self._check_single_examples(model, part, part_labels)
            nonfinite_before = int(self.nonfinite_in_step)
            losses = self._two_pass(model, part, part_labels, weights)  # a non-finite example's loss comes back 0
            micro_sum = (losses.double() * weights.to(losses.device)).sum()
            self._add_losses(micro_sum, weights.sum() - (int(self.nonfinite_in_step) - nonfinite_before))
            loss_sum = loss_sum + micro_sum.to(loss_sum)
            self.stats["micro_batches"] += 1
        if pc.hooks.sync_gradients():
            self.finish_step(model)
        return loss_sum / self._local_expected()

    def _padding_batch(self) -> tuple[dict, torch.Tensor]:
        """One collated row of the training set, run with clipping factor 0 (it contributes exactly nothing)."""
        if self._dummy is None:
            src = self.dummy_source
            if src is None:
                raise RuntimeError("FSDPFlatClipping.dummy_source is not set (DPTrainer.get_train_dataloader sets it).")
            batch = self.pieces.hooks.prepare_inputs(src.collate_fn([src.dataset[0]]))
            batch.pop(INDEX_KEY, None)
            labels = batch.pop("labels")
            self._dummy = (batch, labels)
        batch, labels = self._dummy
        return dict(batch), labels

    def _forward_losses(self, model: nn.Module, batch: dict, labels: torch.Tensor) -> torch.Tensor:
        hooks = self.pieces.hooks
        b = labels.shape[0]
        losses = hooks.example_losses(model, batch, labels)
        if losses.shape != (b,):
            raise ValueError(f"per_example_loss must return shape ({b},), got {tuple(losses.shape)}.")
        return losses

    def _two_pass(self, model: nn.Module, batch: dict, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Pass 1 (per-example norms, no parameter gradient) and pass 2 (``backward`` of ``Σ c_i L_i · W/B``) on one
        forward graph. Returns the per-example losses (detached)."""
        pc = self.pieces
        engine = self.engine
        b = labels.shape[0]
        with pc.hooks.loss_context(), engine.capture(b):
            losses = self._forward_losses(model, batch, labels)
            engine.norms_backward(losses, retain_graph=True)
        norms_sq = engine.per_example_norms_sq()
        factors = flat_clip_factors(norms_sq, pc.args.per_sample_max_grad_norm, b, pc.args.clipping_function,
                                    pc.args.automatic_clipping_gamma).to(losses.device)
        factors = factors * weights.to(device=losses.device, dtype=factors.dtype)
        bad = ~torch.isfinite(losses.detach()) | ((factors == 0) & (weights.to(factors.device) > 0))
        factors = torch.where(bad, 0.0, factors)
        if self._checking:
            engine.accumulate_clipped(factors)  # the hooks' Σ c_i G_i, compared with autograd's at the step's end
        engine.clear()
        # A non-finite example (NaN/inf loss or norm: factor 0, modes.clip_factors_from_norms) would still put
        # 0·NaN = NaN into pass 2's batch backward. Then pass 2 runs on a fresh forward of the finite examples only
        # (a padding row with factor 0 if none is left); every rank does so when any rank has one, so all ranks run
        # the same FSDP collectives.
        if _all_max(float(bad.any()), losses.device):
            self.stats["nonfinite_redo"] = self.stats.get("nonfinite_redo", 0) + 1
            self.nonfinite_in_step = self.nonfinite_in_step + int(bad.sum())
            keep = (~bad).nonzero().flatten()
            del losses
            if len(keep):
                batch, labels, factors = slice_batch(batch, keep, b), labels[keep], factors[keep]
            else:
                batch, labels = self._padding_batch()
                factors = torch.zeros(labels.shape[0], dtype=factors.dtype, device=factors.device)
            with pc.hooks.loss_context():
                losses = self._forward_losses(model, batch, labels)
            out = torch.zeros(b, dtype=losses.dtype, device=losses.device)
            if len(keep):
                out[keep] = losses.detach()
        else:
            out = losses.detach()
        scale = pc.args.world_size / pc.mechanism.expected_batch_size  # FSDP averages over ranks: × W gives the sum
        backward_clipped_loss(losses, factors, scale)
        return out

    def finish_step(self, model: nn.Module) -> None:
        """At the step's last chunk: noise once per coordinate on the local shards, record the step."""
        pc = self.pieces
        mech = pc.mechanism
        pc.hooks.check_step_mechanism()  # q and C unchanged since the step's first chunk (a callback between chunks)
        params = sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)
        if not mech.budget_allows(1):
            mech.stop_for_budget()  # never release a step beyond the budget: no update, nothing recorded
            for _, p in params:
                p.grad = None
            self._checking = False
            self._step_released(released=False)
            return
        world = pc.args.world_size
        for n, p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # no rank's loss reached it: its released gradient is pure noise
            _check_sharded(n, p.grad, world)
        if self._checking:
            self._check_against_autograd(params)
        sigma = mech.noise_multiplier
        std = float(sigma) * pc.args.per_sample_max_grad_norm / mech.expected_batch_size  # σ·C / B
        accountant = mech.accountant
        if std > 0:
            step, rank, noise = accountant.steps, pc.args.process_index, mech.noise
            with torch.no_grad():
                shards = [p.grad.to_local() for _, p in params]  # no-grad to_local: the DTensor's own storage
            add_noise_to_shards(shards, std, lambda device, k: noise.for_shard(step, rank, device, k))
        accountant.step(sigma, mech.sample_rate)
        self._step_released()

    # ------------------------------------------------------------------ self-check (dp_self_check)
    def _norms_only(self, model: nn.Module, batch: dict, labels: torch.Tensor) -> torch.Tensor:
        b = labels.shape[0]
        with self.pieces.hooks.loss_context(), self.engine.capture(b):
            losses = self._forward_losses(model, batch, labels)
            self.engine.norms_backward(losses)
        norms = self.engine.per_example_norms(b)
        self.engine.clear()
        return norms

    def _check_batch(self, batch: dict, labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The micro-batch, or two collated training examples if it has one (a one-example check proves nothing)."""
        if labels.shape[0] < 2 and self.dummy_source is not None and len(self.dummy_source.dataset) >= 2:
            src = self.dummy_source
            batch = self.pieces.hooks.prepare_inputs(src.collate_fn([src.dataset[0], src.dataset[1]]))
            batch.pop(INDEX_KEY, None)
            labels = batch.pop("labels")
        return batch, labels

    def _check_layout(self, model: nn.Module, batch: dict, labels: torch.Tensor) -> None:
        """Always, at the first step: every hooked layer's batch axis is proven (ClippingEngine.first_step_check,
        part 1); flattened (B·T) inputs are not supported under FSDP."""
        batch, labels = self._check_batch(batch, labels)
        b = labels.shape[0]
        try:
            if b >= 2:
                with train_without_dropout(model):
                    self.engine.probe_layout(lambda sl: self._forward_losses(
                        model, slice_batch(batch, sl, b), labels[sl]), b)
        finally:
            self.engine.clear()
        self._layout_checked = True
        if self.engine.proven_layouts:
            raise UnsupportedLayerError(
                "Under FSDP, layers whose input holds the examples' tokens flattened into rows (B·T, d) are not "
                "supported; freeze them, use a PEFT adapter (LoRA), or train with DDP.")

    def _check_single_examples(self, model: nn.Module, batch: dict, labels: torch.Tensor) -> None:
        """Each example's norm in its micro-batch equals its norm alone (ClippingEngine.self_check, check 2).

        Every rank runs the same number of forwards (1 batched + 2 single), since they are collectives under FSDP.
        """
        args = self.pieces.args
        batch, labels = self._check_batch(batch, labels)
        b = labels.shape[0]
        rtol = check_rtol(args, model)
        was_training = model.training
        problems: list[str] = []

        def compare(mode: str) -> None:
            batched = self._norms_only(model, batch, labels)
            for i in range(2):
                j = min(i, b - 1)
                alone = float(self._norms_only(model, slice_batch(batch, slice(j, j + 1), b), labels[j:j + 1])[0])
                problem = norm_alone_problem(j, float(batched[j]), alone, b, rtol, f" ({mode})")
                if problem is not None:
                    problems.append(problem)

        try:
            with train_without_dropout(model):  # batch statistics run as in training; dropout off
                compare("train mode, dropout off")
            model.eval()  # skipped, warned, where the model's own forward/backward raises in eval mode (as locally)
            eval_mode_check(lambda: compare("eval mode"), clean_up=lambda: _reset_after_error(self.engine, model))
        finally:
            model.train(was_training)
        problem = problems[0] if problems else None
        self._singles_checked = True
        if _all_max(problem is not None, args.device):
            raise UnsupportedLayerError(
                (problem or "On another rank, an example's gradient norm differs between its micro-batch and alone")
                + ": the model or the per-example loss mixes examples (an input broadcast over the batch, batch "
                "statistics, or a layer whose input has no batch axis; a per_example_loss that reads other examples' "
                "outputs or divides by a count over the batch), so per-example clipping would not bound an example's "
                "contribution."
            )

    @torch.no_grad()
    def _check_against_autograd(self, params: list[tuple[str, nn.Parameter]]) -> None:
        """The hooks' clipped sum, reduced over ranks, equals the gradient FSDP reduced (check 1 of
        ClippingEngine.self_check): a parameter used outside its layer's forward would escape clipping.

        Runs once per run; during that step every rank holds the hooks' full (unsharded) clipped sum, and the
        reduced gradient is gathered one parameter at a time.
        """
        args = self.pieces.args
        hooked = self.engine.summed_grads
        self.engine.summed_grads = {}
        rtol = check_rtol(args, self.engine.model)
        escaped, unknown = [], [n for n, _ in params if n not in self.engine.params]
        for n, p in params:
            if n not in self.engine.params:
                continue
            ref = p.grad.full_tensor().to(args.device)  # (CPU-offloaded grads: reduce on the job's device)
            mine = hooked.get(n)
            mine = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device) if mine is None else mine
            mine = mine.to(device=ref.device, dtype=torch.promote_types(ref.dtype, torch.float32)).reshape(ref.shape)
            dist.all_reduce(mine)
            mine = mine / self.pieces.mechanism.expected_batch_size
            tol = rtol * float(ref.abs().max().clamp(min=1e-12))
            if not torch.allclose(mine, ref.to(mine.dtype), rtol=rtol, atol=tol):
                escaped.append(n)
        self._checking = False
        self.self_checked = True
        if _all_max(bool(escaped or unknown), args.device):
            raise UnsupportedLayerError(
                "Under FSDP, the gradient FSDP reduced differs from hf_dp's clipped sum for: "
                + ", ".join(escaped + unknown or ["(on another rank)"]) + ". Either these parameters get gradient "
                "that the layer hooks do not see (used outside their layer's forward, or renamed by FSDP), so it "
                "could not be clipped per example — freeze them (requires_grad_(False)) — or, if every parameter is "
                "listed, FSDP's gradient reduction is not the average over all ranks (a custom gradient divide "
                "factor)."
            )


def _check_sharded(name: str, grad: torch.Tensor, world_size: int) -> None:
    """The gradient must be a DTensor sharded over all ``world_size`` ranks (so that noising each rank's local shard
    noises every coordinate once, and FSDP's average over the mesh is an average over all ranks)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(grad, DTensor):
        raise ValueError(
            f"Under FSDP, the gradient of {name} is not a sharded DTensor (is it in fsdp ignored_modules?). Every "
            "trainable parameter must be sharded by FSDP2; freeze the others."
        )
    if grad.device_mesh.size() != world_size or not all(isinstance(pl, Shard) for pl in grad.placements):
        raise ValueError(
            f"Under FSDP, the gradient of {name} has placements {grad.placements} on a mesh of "
            f"{grad.device_mesh.size()} ranks; DPTrainer supports FSDP2 full sharding over all {world_size} ranks "
            "only (no HSDP / replication, no tensor parallelism)."
        )
