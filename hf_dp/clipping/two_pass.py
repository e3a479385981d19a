"""Flat clipping in two passes (one device, DDP): norms in pass 1, the clipped sum from an ordinary backward in pass 2.

Flat clipping's factor ``c_i = min(1, C/‖g_i‖)`` needs every layer's norm contribution, so book-keeping (Bu et al. 2023;
``clipping/local.py``) keeps every layer's factors — its input ``a`` and output gradient ``g`` — to the end of the
backward pass, where it forms ``Σ_i c_i G_i`` from them. Under activation checkpointing those are exactly the
activations checkpointing frees: flat book-keeping then costs 1.70× the non-private checkpointed step
(``benchmarks/RESULTS.md``, issue 24). Ghost clipping's two passes (Li et al. 2022, §4) avoid it:

* **Pass 1 — norms only.** The forward with the engine's hooks (parameters frozen: no ``.grad``) and a backward of
  ``Σ_i L_i``; each layer's per-example norm contribution is computed as its output gradient arrives and its factors
  are dropped at once (:meth:`~hf_dp.clipping.engine.ClippingEngine.norms_only`), so under checkpointing a
  segment's recomputed activations are freed as in a non-private backward.
* **Pass 2 — an ordinary backward.** A second forward of the same micro-batch, without hooks, from the same random
  state (:class:`RandomState`: dropout draws the same masks as in pass 1, as checkpointing's own recompute does),
  and a backward of ``Σ_u c_u L_u`` with the factors detached (:func:`backward_clipped_loss`, shared with FSDP's
  pass 2): autograd writes ``Σ_u c_u ∇L_u``, the clipped sum, into ``.grad``, which accumulates into the step's
  clipped sums (:func:`clipped_backward`). Nothing else changes: the noise is added once, in ``privatize``, at the
  step's release (``LocalDPStep.finish_step``).

A second forward rather than a second backward on pass 1's retained graph: reentrant checkpointing cannot run pass 1
as ``autograd.grad`` to the layers' outputs (which a retained graph whose parameters are not frozen needs, so that pass
1 writes no ``.grad``), and the retained graph would hold the LM head's logits through all of pass 1.

A micro-batch with a non-finite example (factor 0) is clipped again by book-keeping, from the same random state: in
pass 2's batched backward its ``0 · NaN`` would poison every parameter's sum, and it cannot always be cut out of the
batch (a padding-free packed row holds several examples).

Which path a run takes: :func:`flat_clipping_passes` (``DPTrainingArguments.flat_clipping_passes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .rules import UnsupportedLayerError

__all__ = ["FLAT_CLIPPING_PASSES", "RandomState", "backward_clipped_loss", "check_same_losses", "checkpointing_on",
           "clipped_backward", "flat_clipping_passes"]

FLAT_CLIPPING_PASSES = ("auto", "one", "two")
"""``"one"``: book-keeping (factors kept to the end of the backward); ``"two"``: norms, then a second forward and
backward of the reweighted loss; ``"auto"``: two with activation checkpointing on, one otherwise."""


def checkpointing_on(args: Any, model: nn.Module) -> bool:
    """Whether activation checkpointing is on: ``args.activation_checkpointing`` / ``gradient_checkpointing`` (the
    Trainer enables it on the model in ``train()``), or turned on on the model or on any module inside it
    (``gradient_checkpointing_enable()``, as ``peft.prepare_model_for_kbit_training`` calls it, or on the
    transformers model inside a module of one's own): a module whose ``gradient_checkpointing`` is ``True``, what
    transformers' ``is_activation_checkpointing`` reads (its deprecated ``is_gradient_checkpointing`` alias is not
    read: it warns, and goes in transformers 6)."""
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        return True
    if isinstance(model, nn.Module):
        return any(vars(m).get("gradient_checkpointing") is True for m in model.modules())
    return bool(getattr(model, "is_gradient_checkpointing", False))


def flat_clipping_passes(args: Any, model: nn.Module) -> int:
    """1 or 2: how the local step clips a flat-clipping micro-batch (read at each micro-batch: checkpointing may be
    turned on after the trainer is built). ``"auto"``: 2 with activation checkpointing on (:func:`checkpointing_on`),
    else 1. Under DDP as on one process: the DP step runs the unwrapped model, so DDP's reducer, armed only by the
    wrapper's forward, reduces nothing in pass 2; each rank's sum goes into the step's one noised all-reduce
    (``privatize``; tested with two processes in ``tests/trl_trainers/test_sft.py``)."""
    choice = getattr(args, "flat_clipping_passes", "auto")
    if choice == "two":
        return 2
    if choice == "one":
        return 1
    return 2 if checkpointing_on(args, model) else 1


class RandomState:
    """The random state of the CPU and of each accelerator among ``devices`` (those of the model's parameters and the
    run's device: a model placed over several GPUs draws dropout masks on each) when made; :meth:`restore` puts it
    back, so that a second forward draws what the first drew (as ``torch.utils.checkpoint`` does for its recompute)."""

    def __init__(self, devices: Iterable[torch.device | str]):
        self.cpu = torch.get_rng_state()
        self.accelerators = []
        for device in {torch.device(d) for d in devices}:
            if device.type in ("cpu", "meta"):
                continue
            module = torch.get_device_module(device.type)
            self.accelerators.append((module, device, module.get_rng_state(device)))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for module, device, state in self.accelerators:
            module.set_rng_state(state, device)


def backward_clipped_loss(losses: torch.Tensor, factors: torch.Tensor, scale: float = 1.0) -> None:
    """Pass 2 of two-pass clipping: ``backward`` of ``scale · Σ_i c_i L_i`` with the factors ``c`` constant (detached),
    in at least float32; its parameter gradients are ``scale · Σ_i c_i ∇L_i``."""
    if not losses.requires_grad:
        return
    dtype = torch.promote_types(losses.dtype, torch.float32)
    ((losses.to(dtype) * factors.detach().to(device=losses.device, dtype=dtype)).sum() * scale).backward()


def check_same_losses(first: torch.Tensor, second: torch.Tensor) -> None:
    """Pass 2's per-example losses equal pass 1's (to 1e-4 relative: the same computation, up to the order of
    floating-point reductions), or :class:`UnsupportedLayerError`: pass 1's clipping factors would not bound pass 2's
    gradients."""
    a, b = first.detach().double().cpu(), second.detach().double().cpu()
    if a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6)):
        return
    raise UnsupportedLayerError(
        "Two-pass flat clipping: the second forward of this micro-batch gave other per-example losses than the first "
        f"({b.flatten()[:4].tolist()} vs {a.flatten()[:4].tolist()}), although it ran from the same random state. The "
        "model's forward changes between two calls on the same data (a random generator of its own, a counter, a "
        "cache), so the clipping factors from the first pass would not bound the second pass's gradients. Set "
        "flat_clipping_passes='one' (book-keeping: one pass), or make the forward repeatable. Nothing of this step "
        "was released.")


def clipped_backward(engine: Any, hooks: Any, net: nn.Module, micro: dict, labels: torch.Tensor,
                     segments: torch.Tensor | None, factors: torch.Tensor, random_state: RandomState,
                     expected: torch.Tensor | None = None) -> None:
    """Pass 2 on one micro-batch: a forward of ``net`` without hooks from ``random_state`` (pass 1's), then the
    backward of ``Σ_i c_i L_i`` (``factors``: per example, ``c_{u(i)} w_i`` with units; none non-finite, and no
    example with a non-finite loss or gradient in the batch), added into ``engine.summed_grads``. ``.grad`` is used
    as the accumulator only inside this call: the parameters' ``.grad`` is ``None`` when it returns (a step writes
    ``.grad`` once, when it releases).

    ``expected``: pass 1's per-example losses. The factors bound each example's pass-1 gradient; they bound its pass-2
    gradient only if pass 2 computes the same function of the example. A forward that draws randomness the restored
    state does not cover (a generator of the model's own) or that otherwise changes between the passes shows as
    different losses, and is refused (:func:`check_same_losses`) before anything of the step is released."""
    summed = engine.summed_grads
    params = engine.params
    for name, p in params.items():  # accumulate in place into the step's sum when the dtypes allow it
        s = summed.get(name)
        p.grad = s if s is not None and s.dtype == p.dtype and s.device == p.device else None
    try:
        random_state.restore()
        with hooks.loss_context():
            losses = hooks.example_losses(net, micro, labels, **({} if segments is None else {"segments": segments}))
        if expected is not None:
            check_same_losses(expected, losses)
        backward_clipped_loss(losses, factors)
        del losses
        with torch.no_grad():
            for name, p in params.items():
                g, s = p.grad, summed.get(name)
                if g is None or g is s:
                    continue
                if s is None:
                    summed[name] = g if g.dtype == torch.promote_types(g.dtype, torch.float32) else g.float()
                else:
                    s += g.to(device=s.device, dtype=s.dtype)
    finally:
        for p in params.values():
            p.grad = None
