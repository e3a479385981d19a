"""Probe, then fine-tune, under one privacy budget (Ke, Hou, Fanti, Oh 2024, "On the Convergence of
Differentially-Private Fine-tuning: To Linearly Probe or to Fully Fine-tune?"; Li et al. 2022 §5).

Phase 1 (*probe*) trains the head alone on the frozen model; phase 2 (*fine-tune*) continues from that model with
LoRA adapters or the whole model. The two phases are two ``DPTrainer`` runs on the same model object, and the model
carries its privacy history (``hf_dp/history.py``, DESIGN invariant 13): phase 2's accountant starts with phase 1's
mechanisms, so its ``target_epsilon`` is the **total** budget and σ of phase 2 is calibrated (the one calibration,
:func:`hf_dp.plan.calibrate_noise`) so that the composition of both phases meets it. ε in phase 2's logs,
``privacy_spent()``, ``dp_state.json`` and the final model's card is the composed one.

**The budget split.** The user gives a total ε and the share of it phase 1 may spend alone:
ε₁ = ``probe_share`` × ε_total is phase 1's ``target_epsilon``; phase 2 gets what composition leaves. Composition is
computed on the mechanisms (PRV accountant), not by adding ε's, and it is sub-additive here: phase 2 alone can spend
more than ε_total − ε₁.

:func:`plan_probe_then_finetune` gives both phases' σ, q, steps and ε before any data is loaded (the numbers the two
trainers will use: :func:`hf_dp.plan.plan_privacy` for each phase, the second after the first's mechanisms);
:func:`probe_then_finetune` runs the recipe on a model, after planning it, so that a split that cannot be met fails
before phase 1 spends anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from .accounting import MechanismRecord
from .plan import default_delta, expected_batch_size, plan_privacy, planned_steps, steps_per_epoch

__all__ = ["plan_probe_then_finetune", "probe_epsilon", "probe_then_finetune", "train_only"]


def probe_epsilon(total_epsilon: float, probe_share: float) -> float:
    """ε₁ = ``probe_share`` × ``total_epsilon``: phase 1's ``target_epsilon`` (0 < share < 1)."""
    if not (math.isfinite(total_epsilon) and total_epsilon > 0):
        raise ValueError(f"total_epsilon must be a finite number > 0, got {total_epsilon}.")
    if not 0 < probe_share < 1:
        raise ValueError(f"probe_share must be in (0, 1) (the share of the total ε the probe spends alone), got "
                         f"{probe_share}: with 0 there is no probe, with 1 nothing is left for fine-tuning.")
    return float(total_epsilon) * float(probe_share)


def plan_probe_then_finetune(*, total_epsilon: float, probe_share: float = 0.5, num_examples: int,
                             probe: Mapping[str, Any] | None = None, finetune: Mapping[str, Any] | None = None,
                             **common: Any) -> dict[str, Any]:
    """The privacy plan of both phases: phase 1 at ε₁ = ``probe_share`` × ``total_epsilon``, phase 2 calibrated after
    phase 1's mechanisms to reach ``total_epsilon`` composed.

    Args:
        total_epsilon: The budget of the final model (both phases composed).
        probe_share: The share of it phase 1 spends alone.
        num_examples: N (the same training set in both phases).
        probe, finetune: :func:`~hf_dp.plan.plan_privacy` arguments of each phase (batch, epochs or ``max_steps``,
            ``trainable_parameters``, ...).
        common: :func:`~hf_dp.plan.plan_privacy` arguments of both (``target_delta``, ``accountant``, ...).

    Returns:
        ``{"probe": plan, "finetune": plan, "epsilon": composed ε, "total_epsilon", "probe_share", "delta"}``; the
        finetune plan's ``epsilon`` is the composed one.

    Raises:
        ValueError: If no σ of phase 2 meets the total after phase 1 (the split leaves too little).
    """
    for name, given in (("probe", probe), ("finetune", finetune)):
        clash = {"target_epsilon", "noise_multiplier", "history", "num_examples"} & set(given or {})
        if clash:
            raise ValueError(f"{name} must not set {sorted(clash)}: the recipe sets them from total_epsilon, "
                             "probe_share and num_examples.")
    first = plan_privacy(num_examples=num_examples, target_epsilon=probe_epsilon(total_epsilon, probe_share),
                         **{**common, **(probe or {})})
    done = [MechanismRecord(first["noise_multiplier"], first["sample_rate"], first["steps"])]
    second = plan_privacy(num_examples=num_examples, target_epsilon=float(total_epsilon), history=done,
                          **{**common, **(finetune or {})})
    if second["delta"] != first["delta"]:
        raise ValueError(f"Both phases must use one δ (phase 1: {first['delta']}, phase 2: {second['delta']}): pass "
                         "target_delta in common, not per phase.")
    return {"probe": first, "finetune": second, "epsilon": second["epsilon"], "total_epsilon": float(total_epsilon),
            "probe_share": float(probe_share), "delta": second["delta"]}


def _matcher(head: str | Sequence[str] | Callable[[str], bool]) -> Callable[[str], bool]:
    if callable(head):
        return head
    prefixes = (head,) if isinstance(head, str) else tuple(head)

    def match(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") or f".{p}." in f".{name}" for p in prefixes)

    return match


def train_only(model: nn.Module, head: str | Sequence[str] | Callable[[str], bool]) -> dict[str, bool]:
    """Makes the parameters ``head`` names trainable and freezes every other one; returns the earlier
    ``requires_grad`` of every parameter (by name), to restore the full model for phase 2.

    ``head``: a module name or names (``"classifier"``: every parameter under a module of that name, at any depth,
    e.g. ``base_model.model.classifier``), or a predicate on the parameter name.

    Raises:
        ValueError: If ``head`` names no parameter (the probe would train nothing).
    """
    match = _matcher(head)
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    chosen = [name for name in before if match(name)]
    if not chosen:
        some = ", ".join(list(before)[-4:])
        raise ValueError(f"head={head!r} names no parameter of the model, so the probe would train nothing. Name the "
                         f"head's module (the last parameters are: {some}).")
    for name, p in model.named_parameters():
        p.requires_grad_(name in chosen)
    return before


def probe_then_finetune(trainer_class: type, model: nn.Module, *, head: str | Sequence[str] | Callable[[str], bool],
                        probe_args: Any, finetune_args: Any, peft_config: Any = None,
                        **trainer_kwargs: Any) -> tuple[Any, Any]:
    """Runs the recipe: phase 1 trains ``head`` alone, phase 2 continues from it with ``peft_config`` (LoRA: the
    adapters and the config's ``modules_to_save``, e.g. the classifier) or, without one, every parameter that was
    trainable before phase 1. Returns ``(probe_trainer, finetune_trainer)``; save or push the final model with
    ``finetune_trainer`` (its card states the composed ε).

    ``probe_args.target_epsilon`` is ε₁ (:func:`probe_epsilon`) and ``finetune_args.target_epsilon`` the total; both
    phases use one δ. Both phases are planned before phase 1 trains (:func:`plan_probe_then_finetune`'s rule, with
    phase 1's own trainer's plan), so a split that leaves phase 2 nothing fails before any budget is spent.

    Args:
        trainer_class: ``DPTrainer`` or a subclass (named by the caller: only the package and trainer subclasses
            import the trainer, ``tests/architecture/test_architecture.py``).
        model: The model (a ``PreTrainedModel``); phase 2 trains the same object (or the ``PeftModel`` over it).
        head: What phase 1 trains (:func:`train_only`).
        probe_args, finetune_args: ``DPTrainingArguments`` of each phase, each with ``target_epsilon``.
        peft_config: A ``peft`` config for phase 2 (``None``: the full model).
        trainer_kwargs: Passed to both trainers (``train_dataset``, ``data_collator``, ``processing_class``, ...).
    """
    for name, args in (("probe_args", probe_args), ("finetune_args", finetune_args)):
        if getattr(args, "target_epsilon", None) is None:
            raise ValueError(f"{name} needs target_epsilon (phase 1: its share ε₁, phase 2: the total), so that σ of "
                             "each phase is calibrated to the split.")
    if not probe_args.target_epsilon < finetune_args.target_epsilon:
        raise ValueError(f"probe_args.target_epsilon ({probe_args.target_epsilon}) must be below the total "
                         f"finetune_args.target_epsilon ({finetune_args.target_epsilon}): phase 2 would have nothing "
                         "left.")
    before = train_only(model, head)
    try:  # planned before phase 1 spends anything; a refusal leaves the trainable set as it was
        probe = trainer_class(model=model, args=probe_args, **trainer_kwargs)
        n = probe.num_examples_private  # the same training set in both phases
        deltas = [default_delta(n) if a.target_delta is None else float(a.target_delta)
                  for a in (probe_args, finetune_args)]
        if deltas[0] != deltas[1]:
            raise ValueError(f"Both phases must use one δ: the probe's is {deltas[0]:.6g}, the fine-tuning's "
                             f"{deltas[1]:.6g}. Set the same target_delta in probe_args and finetune_args (or in "
                             "neither).")
        first = probe.privacy_plan()
        # what phase 2's accountant will start from: the earlier DP runs the model carries, then phase 1
        history = [*probe.accountant.history,
                   MechanismRecord(first["noise_multiplier"], first["sample_rate"], first["steps"])]

        batch = expected_batch_size(finetune_args.per_device_train_batch_size,
                                    finetune_args.gradient_accumulation_steps, finetune_args.world_size)
        plan_privacy(num_examples=n, per_device_train_batch_size=finetune_args.per_device_train_batch_size,
                     gradient_accumulation_steps=finetune_args.gradient_accumulation_steps,
                     world_size=finetune_args.world_size,
                     steps=planned_steps(steps_per_epoch(n, batch), finetune_args.max_steps,
                                         finetune_args.num_train_epochs),
                     target_epsilon=finetune_args.target_epsilon, target_delta=first["delta"],
                     accountant=finetune_args.accountant, accountant_eps_error=finetune_args.accountant_eps_error,
                     privacy_unit=finetune_args.privacy_unit or "example",
                     poisson_sampling=finetune_args.poisson_sampling, history=history)  # raises if unreachable
    except Exception:
        for name, p in model.named_parameters():
            p.requires_grad_(before[name])
        raise
    probe.train()
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(before[name])
    finetune = trainer_class(model=model, args=finetune_args, **trainer_kwargs)
    finetune.train()
    return probe, finetune
