"""Clipping modes: from per-example (per-parameter) squared norms to per-example clipping factors.

Flat clipping (Abadi et al. 2016; Li et al. 2022 §2): one norm over all trainable parameters,
``c_i = min(1, C / ‖g_i‖)``, so ``‖c_i g_i‖ ≤ C`` and the L2 sensitivity of ``Σ_i c_i g_i`` is ``C``.
"""

from __future__ import annotations

import torch

__all__ = ["flat_clip_factors", "clip_factors_from_norms", "STABILITY_EPS"]

STABILITY_EPS = 1e-6


def clip_factors_from_norms(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, C / (‖g‖ + 1e-6))``: ``‖g‖ · factor ≤ C`` always holds, and tiny gradients are left unscaled."""
    return (max_norm / (norms + STABILITY_EPS)).clamp(max=1.0)


def flat_clip_factors(norms_sq: dict[str, torch.Tensor], max_norm: float, batch_size: int) -> torch.Tensor:
    """Per-example factors for flat clipping from ``{param: (B,) squared norms}``."""
    if not norms_sq:
        return torch.ones(batch_size)
    total = torch.stack(list(norms_sq.values())).sum(0)
    return clip_factors_from_norms(total.sqrt(), max_norm)
