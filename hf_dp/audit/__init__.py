"""Empirical privacy audits: secret-sharer canary exposure and loss-based membership inference.

* :mod:`.canaries` — build canaries, insert their copies into a training set, and measure exposure after training
  (Carlini et al. 2019, "The Secret Sharer"; the protocol of Li et al. 2022, App. M / Table 9).
* :mod:`.membership` — loss-threshold, difficulty-calibrated and zlib-calibrated membership inference (Chen et al.,
  App. A.2; Yeom et al. 2018; Watson et al. 2022; Carlini et al. 2021), exact ROC, TPR at low FPR, and the empirical
  ε lower bound with Clopper–Pearson intervals (Jagielski et al. 2020).
* :mod:`.callbacks` — both as ``TrainerCallback``s that log through the trainer (next to ε) and feed
  :func:`audit_report` (a dict for the model card).
* ``metrics/`` — the same computations as ``evaluate`` metric scripts shipped in the package:
  ``load_metric("canary_exposure")`` / ``load_metric("membership_inference")`` load them offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .callbacks import AuditCallback, CanaryExposureCallback, MembershipInferenceCallback, audit_report
from .canaries import (
    Canary,
    CanarySet,
    canary_exposure,
    exposure_by_distribution,
    exposure_from_rank,
    make_canaries,
    summarize_exposures,
)
from .membership import (
    attack_metrics,
    clopper_pearson,
    epsilon_lower_bound,
    membership_inference,
    per_example_losses,
    roc_auc,
    roc_curve,
    tpr_at_fpr,
    zlib_bits,
)

__all__ = [
    "METRICS",
    "METRICS_DIR",
    "AuditCallback",
    "Canary",
    "CanaryExposureCallback",
    "CanarySet",
    "MembershipInferenceCallback",
    "attack_metrics",
    "audit_report",
    "canary_exposure",
    "clopper_pearson",
    "epsilon_lower_bound",
    "exposure_by_distribution",
    "exposure_from_rank",
    "load_metric",
    "make_canaries",
    "membership_inference",
    "metric_path",
    "per_example_losses",
    "roc_auc",
    "roc_curve",
    "summarize_exposures",
    "tpr_at_fpr",
    "zlib_bits",
]

METRICS_DIR = Path(__file__).resolve().parent / "metrics"
"""Directory of the ``evaluate`` metric scripts shipped with hf_dp (one sub-directory per metric)."""

METRICS: tuple[str, ...] = ("canary_exposure", "membership_inference")


def metric_path(name: str) -> str:
    """Path of the shipped ``evaluate`` script for ``name`` (``"canary_exposure"`` or ``"membership_inference"``)."""
    if name not in METRICS:
        raise ValueError(f"Unknown hf_dp metric {name!r}; available: {list(METRICS)}.")
    return str(METRICS_DIR / name / f"{name}.py")


def load_metric(name: str, **kwargs: Any) -> Any:
    """``evaluate.load`` of a metric script shipped in the package: works offline (``HF_HUB_OFFLINE=1``).

    ``kwargs`` go to ``evaluate.load`` (e.g. ``experiment_id``).
    """
    import evaluate

    return evaluate.load(metric_path(name), **kwargs)
