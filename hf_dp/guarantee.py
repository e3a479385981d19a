"""Run-time checks of the DP guarantee (DESIGN invariant 8): what was true at construction is checked again where it
can stop being true, and a violation stops the run before anything is released.

The DP-SGD release of one step (Abadi et al. 2016, Alg. 1) is ``(Σ_{i∈B} clip_C(g_i) + N(0, σ²C²)) / (qN)``. It
is a DP release only if (a) every gradient the optimizer applies is that noised sum — no parameter outside the
clipping engine carries a gradient, none is modified after the release but by post-processing; (b) each ``g_i`` is
one sampled example's gradient — the collated batch has one row per sampled example; (c) the batch is the Poisson
sample the accountant assumes — the Trainer's loader draws from the DP sampler; (d) one non-finite example cannot
poison the sum (it gets clipping factor 0 and its rows are zeroed: ``clipping/modes.py``, ``clipping/engine.py``).
This module holds those checks and the privacy-budget checks (no step is released beyond ``target_epsilon``); the
trainer calls them at train start, at collation, at every step's first chunk and before every optimizer step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["StepGradientGuard", "trainable_set_difference", "describe_difference", "check_trainable_set_change",
           "discard_stale_gradients", "check_step_gradients", "nonfinite_message", "check_batch_rows",
           "check_train_loader", "overriding_class", "check_delta", "check_noise_std", "check_budget_left",
           "steps_within_budget", "budget_allows"]

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "max_length_q", "max_length_k")


# ---------------------------------------------------------------------- the trainable set
def trainable_set_difference(model: nn.Module, engine_params: Mapping[str, nn.Parameter], by_name: bool = False
                             ) -> tuple[list[str], list[str]]:
    """``(added, removed)``: trainable parameters of ``model`` that the engine does not clip, and parameters the
    engine clips that are no longer trainable parameters of ``model`` — compared by identity, not by name (a
    replaced module has new parameters under the old names). ``by_name``: compared by name (FSDP2's engine keeps
    ``meta`` stand-ins, since FSDP swaps the parameters)."""
    if by_name:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        return sorted(trainable - set(engine_params)), sorted(set(engine_params) - trainable)
    current = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    clipped = {id(p): n for n, p in engine_params.items()}
    added = [n for pid, n in current.items() if pid not in clipped]
    removed = [n for pid, n in clipped.items() if pid not in current]
    return added, removed


def describe_difference(added: list[str], removed: list[str], limit: int = 6) -> str:
    def short(names: list[str]) -> str:
        return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")

    parts = []
    if added:
        parts.append(f"newly trainable or replaced: {short(added)}")
    if removed:
        parts.append(f"no longer trainable or removed: {short(removed)}")
    return "; ".join(parts)


def check_trainable_set_change(what: str, *, sharded: bool, at_step_boundary: bool, at_train_begin: bool,
                               group_clipping: str | None) -> None:
    """The trainable set changed since the engine was built (``what``: :func:`describe_difference`): raise unless
    the engine may be rebuilt now so that every trainable parameter is clipped per example.

    Rebuilding is allowed at train start, and at a step boundary for flat clipping. It is refused under FSDP
    (``sharded``: the engine is built before the model is wrapped), inside a step (the examples of this step already
    clipped did not include the change), and during training under group-wise clipping (``group_clipping``: the
    mode, whose groups, thresholds and noise allocation were fixed at train start).
    """
    if sharded:
        raise RuntimeError(
            f"hf_dp: the trainable parameters changed after DPTrainer was built ({what}). Under FSDP the clipping "
            "engine cannot be rebuilt: set requires_grad before constructing DPTrainer."
        )
    if not at_train_begin and not at_step_boundary:
        raise RuntimeError(
            f"hf_dp: the trainable parameters changed in the middle of a DP step ({what}); the examples of this "
            "step already clipped did not include them. Change requires_grad or modules only at a step boundary "
            "(on_step_begin / on_step_end of a callback) or before train()."
        )
    if not at_train_begin and group_clipping is not None:
        raise RuntimeError(
            f"hf_dp: the trainable parameters changed during training ({what}) under "
            f"clipping={group_clipping!r}, whose groups, thresholds and noise allocation were fixed at train "
            "start. Set requires_grad before train() (or use clipping='flat', whose engine is rebuilt at the "
            "next step)."
        )


# ---------------------------------------------------------------------- the gradients the optimizer applies
def discard_stale_gradients(model: nn.Module) -> int:
    """At a step's first chunk no parameter should hold a gradient (the Trainer zeroes them after every optimizer
    step); one computed outside the DP step (e.g. a callback's backward in ``on_step_begin``) is dropped, never
    applied, and never mistaken for the hooks' by the self-check. Returns how many were dropped."""
    stale = [p for p in model.parameters() if p.grad is not None]
    for p in stale:
        p.grad = None
    return len(stale)


class StepGradientGuard:
    """Before each optimizer step: every ``.grad`` is the tensor the DP release of this step wrote, unmodified.

    :meth:`released` records, right after ``.grad`` is written, each tensor's identity and version counter. At
    :meth:`check` (``TrainerCallback.on_pre_optimizer_step``) a parameter may carry no gradient or exactly that tensor;
    an in-place change (a plain ``backward()`` accumulates into an existing ``.grad`` in place, bumping its version)
    is refused, except the one in-place rescaling by ``clip_grad_norm_`` the Trainer does before every optimizer step
    (with ``max_grad_norm``, or with an infinite bound to measure the norm): post-processing of the released gradient.
    A step without a release (budget stop) must leave every gradient empty.
    """

    def __init__(self) -> None:
        self._written: dict[int, tuple[torch.Tensor, int, int]] = {}
        self.has_released = False

    def released(self, params: Iterable[nn.Parameter]) -> None:
        grads = [(p, p.grad) for p in params if p.grad is not None]
        # Views of one buffer (the distributed release is one all-reduced flat tensor) share one version counter:
        # an in-place op on each of k views advances it k times. Record k with each gradient.
        shared = Counter(g.untyped_storage().data_ptr() for _, g in grads)
        self._written = {id(p): (g, g._version, shared[g.untyped_storage().data_ptr()]) for p, g in grads}
        self.has_released = True

    def reset(self) -> None:
        self._written = {}
        self.has_released = False

    def check(self, model: nn.Module, allowed_version_bumps: int = 0) -> None:
        escaped, modified = [], []
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            mine = self._written.get(id(p))
            if mine is None or p.grad is not mine[0]:
                escaped.append(name)
            elif p.grad._version > mine[1] + allowed_version_bumps * mine[2]:
                modified.append(name)
        self.reset()
        if escaped:
            raise RuntimeError(
                "hf_dp: before this optimizer step, these parameters carry a gradient that DPTrainer's DP step did "
                f"not write (it was never clipped nor noised): {', '.join(escaped[:8])}"
                + (f" (+{len(escaped) - 8} more)" if len(escaped) > 8 else "") + ". Typical causes: a subclass's "
                "`training_step` that calls `loss.backward()` / `accelerator.backward()` itself instead of "
                "`super().training_step(...)`, a callback that runs a backward pass, or a parameter made trainable "
                "in the middle of a step. Compute extra losses through `per_example_loss=` instead. Training stopped "
                "before the optimizer applied it."
            )
        if modified:
            raise RuntimeError(
                "hf_dp: the privatized gradient of these parameters was changed in place after DPTrainer released "
                f"it (e.g. a second backward() accumulated an unclipped gradient into it): "
                f"{', '.join(modified[:8])}. Add any extra loss through `per_example_loss=` so that it is clipped "
                "per example. Training stopped before the optimizer applied it."
            )


def check_step_gradients(guard: StepGradientGuard, model: nn.Module, engine_params: Mapping[str, nn.Parameter],
                         allowed_version_bumps: int = 0) -> None:
    """Before the optimizer step: the gradients are this step's DP release and nothing else
    (:class:`StepGradientGuard`), and the trainable set did not change during the step's backward pass (a parameter
    made trainable there got a gradient the engine never clipped)."""
    released = guard.has_released
    guard.check(model, allowed_version_bumps=allowed_version_bumps)
    added, removed = trainable_set_difference(model, engine_params)
    if released and (added or removed):
        raise RuntimeError(
            "hf_dp: the trainable parameters changed during this step's backward pass "
            f"({describe_difference(added, removed)}). Change requires_grad or modules only at a step boundary."
        )


def nonfinite_message(step: int, count: int, total: int) -> str:
    """The warning for ``count`` examples of ``step`` (``total`` so far) with a non-finite loss or gradient norm:
    they got clipping factor 0 (``clipping/modes.py``), so the guarantee holds, but the data needs a look."""
    return (
        f"hf_dp: step {step}: {count} example(s) had a non-finite loss or gradient norm (NaN/inf, e.g. a NaN label); "
        "they got clipping factor 0 (no contribution, the DP guarantee holds) and are left out of the logged loss. "
        f"{total} so far. Check the data."
    )


# ---------------------------------------------------------------------- collated rows
def _batch_rows(batch: Mapping[str, Any]) -> int | None:
    for key in ("labels", "input_ids"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _restarting_positions(batch: Mapping[str, Any]) -> bool:
    """Position ids that fall back to 0 inside a row: several sequences packed into one row."""
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] < 2:
        return False
    return bool(((pos[:, 1:] == 0) & (pos[:, :-1] > 0)).any())


def check_batch_rows(num_examples: int, batch: Any) -> None:
    """The collated batch must hold one row per sampled example (each row is clipped as one example).

    Padding-free packing (``DataCollatorWithFlattening``, trl's ``packing=True``) concatenates the sampled examples
    into one row: clipped as one example, its sensitivity would be the whole batch's. A collator that drops or merges
    rows changes the sampled set the accountant analyses.
    """
    if not isinstance(batch, Mapping):
        return
    packed = [k for k in _PACKING_KEYS if k in batch]
    rows = _batch_rows(batch)
    if packed or (rows is not None and rows < num_examples and _restarting_positions(batch)):
        raise ValueError(
            f"hf_dp: the data collator packed {num_examples} sampled examples into {rows} row(s) (padding-free "
            f"packing: {', '.join(packed) if packed else 'position_ids restart at 0 inside a row'}). DPTrainer "
            "clips each row as one example, so a packed row's sensitivity would be several examples'. Packing is not "
            "supported by DPTrainer (DPSFTTrainer clips each packed sequence separately); use a padding collator "
            "instead (e.g. DataCollatorWithPadding, DataCollatorForLanguageModeling(mlm=False), or trl with "
            "packing=False)."
        )
    if rows is not None and rows != num_examples:
        raise ValueError(
            f"hf_dp: the data collator turned {num_examples} sampled examples into a batch of {rows} rows. DP-SGD "
            "clips each example's gradient and the accountant analyses the Poisson-sampled set, so the collated "
            "batch must hold exactly one row per example: a collator that drops, merges, splits or duplicates rows "
            "breaks both. Filter or split the dataset before training (Dataset.filter / map), not in the collator."
        )


# ---------------------------------------------------------------------- the train loader
def check_train_loader(loader: Any, dp_sampler: Any) -> None:
    """The loader the Trainer iterates must draw its batches from DPTrainer's Poisson sampler."""
    if dp_sampler is None or getattr(loader, "batch_sampler", None) is not dp_sampler:
        raise ValueError(
            "hf_dp: the train dataloader does not draw its batches from DPTrainer's Poisson sampler: your "
            "get_train_dataloader replaces Poisson sampling (or wraps the loader, e.g. in accelerator.prepare, which "
            "may pad or repeat examples), while ε is computed for Poisson sampling. Remove the override, or return "
            "`super().get_train_dataloader()` unchanged (change the dataset or the data_collator instead)."
        )


# ---------------------------------------------------------------------- subclass overrides
def overriding_class(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``name`` (None if none does)."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


# ---------------------------------------------------------------------- arguments that need N or σ
def check_delta(delta: float, n: int) -> None:
    """δ must be below 1/N: releasing one random example in full is already (0, 1/N)-DP."""
    if delta >= 1.0 / n:
        raise ValueError(
            f"target_delta={delta} is not below 1/N = {1.0 / n:.3g} for N={n} privacy units: a mechanism that "
            "publishes one random example in full satisfies (0, 1/N)-DP, so this guarantee protects nobody. Choose "
            "δ well below 1/N (the default is 1/N^1.1; 1/N^2 or 1e-5 for large N are common)."
        )


def check_noise_std(noise_multiplier: float, max_norm: float) -> None:
    """σ·C must be a finite float32 (noise is drawn in the gradient's dtype, float32 at least)."""
    std = float(noise_multiplier) * float(max_norm)
    if not math.isfinite(std) or std >= FLOAT32_MAX:
        raise ValueError(
            f"The noise std σ·C = {noise_multiplier} × {max_norm} overflows float32: the noised gradient would be "
            "non-finite. Lower per_sample_max_grad_norm (C; Li et al. 2022 recommend a small C such as 0.1)."
        )


# ---------------------------------------------------------------------- the privacy budget
def check_budget_left(accountant: Any, target_epsilon: float | None, delta: float) -> None:
    """A second ``train()`` with ``target_epsilon``: refuse when the earlier runs already spent the budget
    (``accountant``: the :class:`~hf_dp.PrivacyAccountant` of the model, which composes over all its runs)."""
    if not accountant.steps or target_epsilon is None:
        return
    spent = accountant.get_epsilon(delta)
    if spent >= target_epsilon:
        raise ValueError(
            f"The privacy budget target_epsilon={target_epsilon} (δ={delta:.3g}) is already "
            f"spent: this model took {accountant.steps} DP steps in earlier train() calls (ε={spent:.4f}), "
            "and ε composes over all of them. Keep the model as it is, or start from a fresh model with a new "
            "DPTrainer (or pass model_init, which builds a fresh model for every train())."
        )


def steps_within_budget(epsilon_after: Callable[[int], float], planned: int, target_epsilon: float | None
                        ) -> int | None:
    """How many more steps the budget allows: the largest ``n <= planned`` with ``epsilon_after(n) <=
    target_epsilon`` (ε is monotone in the steps; bisection), or None when ε is reported rather than targeted."""
    if target_epsilon is None:
        return None
    if planned > 0 and epsilon_after(planned) <= target_epsilon:
        return planned
    lo, hi = 0, max(planned, 1)  # epsilon_after(lo) <= target < epsilon_after(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if epsilon_after(mid) <= target_epsilon else (lo, mid)
    return lo


def budget_allows(steps_this_run: int, n: int, allowed: int | None) -> bool:
    """Whether ``n`` more steps after the ``steps_this_run`` already taken stay within the ``allowed`` steps of this
    run (:func:`steps_within_budget`; None: unlimited). A DP step beyond it is never released."""
    return allowed is None or steps_this_run + n <= allowed
