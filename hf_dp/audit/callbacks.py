"""Audits as ``TrainerCallback``s: canary exposure and membership inference, logged next to ε.

Attach with :meth:`AuditCallback.attach` so that results go through the trainer's ``log`` (``DPTrainer.log`` adds the
``epsilon`` spent so far to the same record, and every reporting integration sees them)::

    exposure = CanaryExposureCallback(canaries).attach(trainer)
    mia = MembershipInferenceCallback(members=train_subset, nonmembers=heldout).attach(trainer)
    trainer.train()              # on_train_end: {'audit/exposure_r10': ..., 'audit/mia_loss_auc': ..., 'epsilon': ...}
    audit_report(trainer)        # {'canary_exposure': {...}, 'membership_inference': {...}, ...} for the model card

A callback passed as ``DPTrainer(callbacks=[...])`` without :meth:`~AuditCallback.attach` still runs; it then appends
its record to ``state.log_history`` itself (without ``epsilon``) and warns once.

The audits evaluate the model on private training examples: like the training loss, their results are statistics of
the private data that the DP guarantee does not cover (they are for the data holder; publish them knowingly).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .canaries import CanarySet, canary_exposure
from .membership import DEFAULT_FPRS, membership_inference, per_example_losses

__all__ = ["AuditCallback", "CanaryExposureCallback", "MembershipInferenceCallback", "audit_report"]

logger = logging.getLogger(__name__)

NOT_COVERED = ("computed from private training examples: like the training loss, these statistics are not covered by "
               "the differential privacy guarantee")


class AuditCallback(TrainerCallback):
    """Base class: when to run (``on_train_end``, ``on_evaluate``), how to log, and the report for the card."""

    name = "audit"

    def __init__(self, *, run_on_train_end: bool = True, run_on_evaluate: bool = False):
        self.run_on_train_end = run_on_train_end
        self.run_on_evaluate = run_on_evaluate
        self.trainer: Any = None
        self.history: list[dict[str, Any]] = []
        self._warned = False

    def attach(self, trainer: Any) -> AuditCallback:
        """Register on ``trainer`` (``trainer.add_callback``) and log through ``trainer.log``. Returns ``self``."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    # -- subclasses implement
    def compute(self, model: Any, **kwargs: Any) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def flat_metrics(self, result: dict[str, Any]) -> dict[str, float]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- plumbing
    @property
    def latest(self) -> dict[str, Any] | None:
        """The most recent result (``None`` before the first run)."""
        return self.history[-1]["result"] if self.history else None

    def _record(self) -> Any:
        """The attached trainer's privacy record (``privacy_record()``: a :class:`hf_dp.record.PrivacyRecord`)."""
        make = getattr(self.trainer, "privacy_record", None)
        if not callable(make):
            return None
        try:
            return make()
        except Exception:  # noqa: BLE001 - e.g. no train_dataset: report without ε
            return None

    def _privacy(self) -> dict[str, Any]:
        record = self._record()
        if record is None:
            return {}
        try:
            return {"epsilon": record.epsilon(), "delta": record.delta}
        except Exception:  # noqa: BLE001 - report without ε
            return {}

    def _run(self, args: TrainingArguments, state: TrainerState, event: str, model: Any,
             metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or model is None:
            return
        result = self.compute(model, **kwargs)
        record = {"step": state.global_step, "event": event, **self._privacy(), "result": result}
        self.history.append(record)
        flat = {k: float(v) for k, v in self.flat_metrics(result).items()
                if v is not None and not (isinstance(v, float) and math.isnan(v))}
        if metrics is not None:
            metrics.update(flat)
        if self.trainer is not None:
            self.trainer.log(dict(flat))
        else:
            if not self._warned:
                warnings.warn(f"{type(self).__name__} is not attached to a trainer (use .attach(trainer)); its "
                              "results are appended to state.log_history without epsilon.", UserWarning, stacklevel=2)
                self._warned = True
            state.log_history.append({**flat, "step": state.global_step})
        logger.info("hf_dp audit (%s, step %d): %s", self.name, state.global_step, flat)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
                     **kwargs: Any) -> None:
        if self.run_on_train_end:
            self._run(args, state, "train_end", model, **kwargs)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.run_on_evaluate:
            self._run(args, state, "evaluate", model, metrics=metrics, **kwargs)

    def audit_report(self) -> dict[str, Any] | None:
        """The latest result with its step, ε and δ, for the model card (``None`` if it has not run)."""
        if not self.history:
            return None
        rec = self.history[-1]
        return {"step": rec["step"], "event": rec["event"],
                **{k: rec[k] for k in ("epsilon", "delta") if k in rec}, **self.card_summary(rec["result"])}

    def card_summary(self, result: dict[str, Any]) -> dict[str, Any]:
        return result


class CanaryExposureCallback(AuditCallback):
    """Secret-sharer exposure of inserted canaries (Carlini et al. 2019; Li et al. 2022, App. M) after training.

    Args:
        canaries: the :class:`~hf_dp.audit.CanarySet` whose copies are in the training set
            (:meth:`CanarySet.insert_into`).
        num_reference, exact, max_exact_forwards, method, batch_size, seed: see :func:`~hf_dp.audit.canary_exposure`.
        run_on_train_end, run_on_evaluate: when to run (default: at the end of training only).

    Logs ``audit/exposure_r{r}`` (mean distribution-model exposure of the canaries repeated ``r`` times),
    ``audit/exposure_exact_r{r}`` when the space was enumerated, and ``audit/exposure_max_possible`` (``log2 |R|``).
    """

    name = "canary_exposure"

    def __init__(self, canaries: CanarySet, *, num_reference: int = 2000, exact: bool | None = None,
                 max_exact_forwards: int = 4096, method: str = "skewnorm", batch_size: int = 256, seed: int = 0,
                 run_on_train_end: bool = True, run_on_evaluate: bool = False):
        super().__init__(run_on_train_end=run_on_train_end, run_on_evaluate=run_on_evaluate)
        self.canaries = canaries
        self.kwargs = dict(num_reference=num_reference, exact=exact, max_exact_forwards=max_exact_forwards,
                           method=method, batch_size=batch_size, seed=seed)

    def compute(self, model: Any, **kwargs: Any) -> dict[str, Any]:
        return canary_exposure(model, self.canaries, **self.kwargs)

    def flat_metrics(self, result: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for r, entry in result["by_repetitions"].items():
            out[f"audit/exposure_r{r}"] = entry["mean"]
            if "mean_exact" in entry:
                out[f"audit/exposure_exact_r{r}"] = entry["mean_exact"]
        out["audit/exposure_max_possible"] = result["max_exposure"]
        return out

    def card_summary(self, result: dict[str, Any]) -> dict[str, Any]:
        return {k: result[k] for k in ("method", "space_size", "max_exposure", "subvocab_size", "secret_length",
                                       "exact", "by_repetitions")} | {
            "source": "Carlini et al. 2019 (secret sharer); protocol of Li et al. 2022, App. M"}


class MembershipInferenceCallback(AuditCallback):
    """Loss-threshold and calibrated membership inference on held-in vs held-out examples.

    Args:
        members: tokenized training examples (a subset of ``train_dataset``; rows with ``input_ids``, ``labels``).
        nonmembers: tokenized examples of a real held-out split of the same data, never trained on.
        reference: ``"initial"`` (default): record every example's loss under the model at the first
            ``on_train_begin`` (the pre-trained / initial model; for a run resumed from a checkpoint, the checkpoint's
            model) and run the difficulty-calibrated attack; ``None``: loss attack only.
        text_column: column with each example's text: enables the zlib-calibrated attack (Carlini et al. 2021).
        delta: δ for the empirical ε lower bound; default: the trainer's ``target_delta`` when attached to a
            ``DPTrainer``; ``None`` without a DPTrainer disables the bound unless given.
        fpr_targets, confidence, seed: see :func:`~hf_dp.audit.membership.attack_metrics`.
        batch_size, per_example_loss: see :func:`~hf_dp.audit.per_example_losses`.
        run_on_train_end, run_on_evaluate: when to run (default: both).

    Logs ``audit/mia_{attack}_auc``, ``audit/mia_{attack}_tpr@fpr{α}`` and ``audit/mia_{attack}_eps_lb``.
    """

    name = "membership_inference"

    def __init__(self, members: Any, nonmembers: Any, *, reference: str | None = "initial",
                 text_column: str | None = None, delta: float | None = None,
                 fpr_targets: Sequence[float] = DEFAULT_FPRS, confidence: float = 0.95, seed: int = 0,
                 batch_size: int = 64, per_example_loss: Any = None, run_on_train_end: bool = True,
                 run_on_evaluate: bool = True):
        super().__init__(run_on_train_end=run_on_train_end, run_on_evaluate=run_on_evaluate)
        if reference not in ("initial", None):
            raise ValueError("reference must be 'initial' or None.")
        self.members, self.nonmembers = members, nonmembers
        self.reference = reference
        self.text_column = text_column
        self.delta = delta
        self.fpr_targets = tuple(fpr_targets)
        self.confidence, self.seed = confidence, seed
        self.batch_size, self.per_example_loss = batch_size, per_example_loss
        self.reference_losses: tuple[np.ndarray, np.ndarray] | None = None

    def _losses(self, model: Any, data: Any, counts: bool = False) -> Any:
        return per_example_losses(model, data, batch_size=self.batch_size, per_example_loss=self.per_example_loss,
                                  return_counts=counts)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
                       **kwargs: Any) -> None:
        if self.reference == "initial" and model is not None and state.is_world_process_zero \
                and self.reference_losses is None:
            self.reference_losses = (self._losses(model, self.members), self._losses(model, self.nonmembers))

    def _delta(self) -> float | None:
        if self.delta is not None:
            return self.delta
        record = self._record()
        return None if record is None or record.delta is None else float(record.delta)

    def compute(self, model: Any, **kwargs: Any) -> dict[str, Any]:
        lin, cin = self._losses(model, self.members, counts=True)
        lout, cout = self._losses(model, self.nonmembers, counts=True)
        kw: dict[str, Any] = {}
        if self.reference_losses is not None:
            kw.update(member_reference_losses=self.reference_losses[0],
                      nonmember_reference_losses=self.reference_losses[1])
        if self.text_column is not None:
            kw.update(member_texts=list(self.members[self.text_column]),
                      nonmember_texts=list(self.nonmembers[self.text_column]), member_counts=cin, nonmember_counts=cout)
        out = membership_inference(lin, lout, fpr_targets=self.fpr_targets, delta=self._delta(),
                                   confidence=self.confidence, seed=self.seed, **kw)
        out["mean_member_loss"], out["mean_nonmember_loss"] = float(lin.mean()), float(lout.mean())
        return out

    def flat_metrics(self, result: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, m in result["attacks"].items():
            out[f"audit/mia_{name}_auc"] = m["auc"]
            for a, v in m["tpr_at_fpr"].items():
                if v is not None:
                    out[f"audit/mia_{name}_tpr@fpr{a}"] = v
            lb = m.get("epsilon_lower_bound") or {}
            if lb.get("epsilon_lower_bound") is not None:
                out[f"audit/mia_{name}_eps_lb"] = lb["epsilon_lower_bound"]
        return out

    def dp_guarantee_notes(self) -> list[str]:
        """Once it has run: its results are statistics of private training examples (the members' losses), logged
        and written into the model card (``audit`` metadata and body), so the released record is not strictly DP."""
        if not self.history:
            return []
        return ["membership-inference results computed on private training examples (members) are reported in the "
                "logs and in the model card: they are statistics of the private data, not covered by the guarantee"]

    def card_summary(self, result: dict[str, Any]) -> dict[str, Any]:
        attacks = {}
        for name, m in result["attacks"].items():
            lb = m.get("epsilon_lower_bound") or {}
            attacks[name] = {"auc": m["auc"], "tpr_at_fpr": m["tpr_at_fpr"], "notes": m["notes"],
                             "epsilon_lower_bound": lb.get("epsilon_lower_bound"),
                             "epsilon_lower_bound_confidence": lb.get("confidence")}
        return {"num_members": result["num_members"], "num_nonmembers": result["num_nonmembers"], "attacks": attacks,
                "attack_definitions": {
                    "loss": "score = -loss (Yeom et al. 2018)",
                    "calibrated": "score = loss under the initial/pre-trained model - loss (Watson et al. 2022)",
                    "zlib": "score = -(model code length) / (zlib code length) (Carlini et al. 2021)"},
                "epsilon_lower_bound_method": "Clopper-Pearson, Bonferroni over TPR and FPR, threshold chosen on a "
                                              "disjoint half (Jagielski et al. 2020); heuristic for one training run"}


def audit_report(trainer_or_callbacks: Any) -> dict[str, Any]:
    """Collect the latest results of every audit callback into one dict for the model card.

    Accepts a trainer (its registered callbacks are searched) or a list of callbacks. Returns ``{}`` when no audit
    has run; otherwise ``{"canary_exposure": ..., "membership_inference": ..., "covered_by_dp": False, "note": ...}``.
    """
    if isinstance(trainer_or_callbacks, (list, tuple)):
        callbacks = list(trainer_or_callbacks)
    else:
        callbacks = list(trainer_or_callbacks.callback_handler.callbacks)
    report: dict[str, Any] = {}
    for cb in callbacks:
        if isinstance(cb, AuditCallback):
            r = cb.audit_report()
            if r is not None:
                report[cb.name] = r
    if report:
        report["covered_by_dp"] = False
        report["note"] = NOT_COVERED
    return report
