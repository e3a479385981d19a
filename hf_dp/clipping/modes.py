"""Clipping modes: from per-example (per-parameter) squared norms to per-example clipping factors.

Flat clipping (Abadi et al. 2016; Li et al. 2022 §2): one norm over all trainable parameters,
``c_i = min(1, C / ‖g_i‖)``, so ``‖c_i g_i‖ ≤ C`` and the L2 sensitivity of ``Σ_i c_i g_i`` is ``C``.

Group-wise clipping (He et al. 2023, §2-3): parameters are split into groups ``k = 1..K`` (layers, named groups,
devices), each example's gradient restricted to group ``k`` is clipped to ``C_k``, so the release
``(Σ_i c_{i,k} g_{i,k})_k`` has sensitivity ``(Σ_k C_k²)^½``; with per-layer groups the clipping runs inside the
backward pass (``ClippingEngine.set_fused_groups``). Adaptive thresholds follow Alg. 1.

Automatic clipping (Bu et al., "Automatic Clipping: Differentially Private Deep Learning Made Easier and Stronger",
NeurIPS 2023, "AUTO-S"): ``c_i = C / (‖g_i‖ + γ)`` instead of ``min(1, C / ‖g_i‖)`` — every example is
normalised, small gradients included; ``‖c_i g_i‖ = C ‖g_i‖ / (‖g_i‖ + γ) < C``, so the sensitivity stays ``C`` (and
``(Σ_k C_k²)^½`` per group: ``C_k / (‖g_{i,k}‖ + γ)``) and the noise and the accounting are unchanged. C then only
scales the update (with SGD it is interchangeable with the learning rate; Adam is almost invariant to it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .engine import ClippingEngine

__all__ = ["flat_clip_factors", "clip_factors_from_norms", "STABILITY_EPS", "CLIPPING_FUNCTIONS", "ClipGroup",
           "GroupClipper", "build_groups", "group_clipper_from_args"]

STABILITY_EPS = 1e-6
CLIPPING_FUNCTIONS = ("clip", "automatic")
"""``"clip"``: ``min(1, C / ‖g‖)`` (Abadi et al. 2016); ``"automatic"``: ``C / (‖g‖ + γ)`` (Bu et al. 2023)."""


def clip_factors_from_norms(norms: torch.Tensor, max_norm: float, function: str = "clip",
                            gamma: float = 0.01) -> torch.Tensor:
    """Per-example factors from per-example norms, with ``‖g‖ · factor ≤ C`` always.

    * ``function="clip"``: ``min(1, C / (‖g‖ + 1e-6))``; tiny gradients are left unscaled.
    * ``function="automatic"``: ``C / (‖g‖ + γ)`` (Bu et al. 2023, AUTO-S, with stability constant γ > 0):
      every gradient is rescaled to norm ``C ‖g‖ / (‖g‖ + γ) < C``.

    An example whose norm is not finite (a NaN or infinite loss, e.g. a NaN regression label) gets factor 0: it
    contributes nothing, so the sensitivity stays ``C`` (the engine also zeroes its rows, since ``0 · NaN = NaN``).
    """
    if function == "clip":
        factors = (max_norm / (norms + STABILITY_EPS)).clamp(max=1.0)
    elif function == "automatic":
        if not gamma > 0:
            raise ValueError(f"automatic clipping needs γ > 0 (automatic_clipping_gamma), got {gamma}.")
        factors = max_norm / (norms + gamma)
    else:
        raise ValueError(f"clipping_function must be one of {CLIPPING_FUNCTIONS}, got {function!r}.")
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def flat_clip_factors(norms_sq: dict[str, torch.Tensor], max_norm: float, batch_size: int, function: str = "clip",
                      gamma: float = 0.01) -> torch.Tensor:
    """Per-example factors for flat clipping from ``{param: (B,) squared norms}`` (:func:`clip_factors_from_norms`)."""
    if not norms_sq:
        return torch.ones(batch_size)
    total = torch.stack(list(norms_sq.values())).sum(0)
    return clip_factors_from_norms(total.sqrt(), max_norm, function, gamma)


ADAPTIVE_AUTOMATIC_REFUSAL = (
    "clipping='adaptive_per_layer' cannot be combined with clipping_function='automatic'. Adaptive clipping (He et "
    "al. 2023, Alg. 1) moves each threshold C_k to a private quantile of the group's gradient norms so that a target "
    "fraction of examples goes unclipped; automatic clipping (Bu et al. 2023) rescales every example by "
    "C_k / (‖g‖ + γ), so no example is unclipped and C_k only sets the group's step size. The quantile would still "
    "track the norms, but it would spend part of the budget (quantile_budget_fraction) on what the learning rate "
    "already sets. Use clipping='per_layer' (or 'flat') with clipping_function='automatic', or adaptive_per_layer "
    "with clipping_function='clip'."
)


# ---------------------------------------------------------------------- group-wise clipping (He et al. 2023)
@dataclass
class ClipGroup:
    """A set of parameters clipped together with one threshold ``C_k``."""

    name: str
    params: list[str]


def _union_find_groups(engine: ClippingEngine) -> list[ClipGroup]:
    """One group per layer; layers that share a parameter (tied embeddings) form one group."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    layer_params: list[tuple[str, list[str]]] = []
    for mname, names in engine.layer_parameters():
        if names:
            layer_params.append((mname, names))
            for n in names[1:]:
                parent[find(n)] = find(names[0])
    groups: dict[str, ClipGroup] = {}
    for mname, names in layer_params:
        root = find(names[0])
        if root not in groups:
            groups[root] = ClipGroup(mname, [])
        elif mname not in groups[root].name.split("+"):
            groups[root].name += "+" + mname
        for n in names:
            if n not in groups[root].params:
                groups[root].params.append(n)
    return list(groups.values())


def _device_of(name: str, model: nn.Module, param: torch.Tensor) -> str:
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        best = max((m for m in device_map if m == "" or name == m or name.startswith(m + ".")), key=len, default=None)
        if best is not None:
            return str(device_map[best])
    return str(param.device)


def build_groups(engine: ClippingEngine, mode: str, patterns: list[str] | None = None) -> list[ClipGroup]:
    """The clipping groups of a mode (He et al. 2023, §2: group-wise clipping).

    * ``per_layer`` / ``adaptive_per_layer``: one group per layer (parameters of one module; tied layers merged);
    * ``group_wise``: one group per regular expression in ``patterns`` (first match wins, in order), plus a group
      ``other`` for parameters no pattern matches;
    * ``per_device``: one group per device holding parameters (``model.hf_device_map`` when the model was placed
      with one, else each parameter's device) — §4 and App. C.
    """
    if mode in ("per_layer", "adaptive_per_layer"):
        return _union_find_groups(engine)
    if mode == "group_wise":
        if not patterns:
            raise ValueError("clipping='group_wise' needs clipping_groups: a list of parameter-name patterns.")
        groups = [ClipGroup(p, []) for p in patterns]
        other = ClipGroup("other", [])
        for name in engine.params:
            match = next((g for g in groups if re.search(g.name, name)), other)
            match.params.append(name)
        groups = [g for g in groups + [other] if g.params]
    elif mode == "per_device":
        by_device: dict[str, ClipGroup] = {}
        for name, p in engine.params.items():
            dev = _device_of(name, engine.model, p)
            by_device.setdefault(dev, ClipGroup(dev, [])).params.append(name)
        groups = list(by_device.values())
    else:
        raise ValueError(f"No groups for clipping mode {mode!r}.")
    return groups


class GroupClipper:
    """Per-group thresholds ``C_k``, clipping factors, and the private quantile estimate of Alg. 1 (He et al. 2023).

    Args:
        groups: the clipping groups.
        thresholds: initial ``C_k``.
        adaptive: update thresholds from privatized counts (Alg. 1, lines 10 and 15-17).
        target_quantile: ``q``, the fraction of examples whose group norm should fall below ``C_k``.
        quantile_lr: ``η`` of the geometric update ``C_k ← C_k exp(−η (b̃_k − q))``.
        rescale_to: if set, after each update thresholds are rescaled so that ``‖(C_1..C_K)‖ = rescale_to``
            (App. A.1: ``C̃_k = C · C_k / (Σ C_k²)^½``).
        function, gamma: the clipping function, ``"clip"`` (``min(1, C_k / ‖g_{i,k}‖)``) or ``"automatic"``
            (``C_k / (‖g_{i,k}‖ + γ)``, Bu et al. 2023); see :func:`clip_factors_from_norms`. Automatic clipping
            is not combined with adaptive thresholds: it rescales every example, so no example is "unclipped", and
            the private quantile of the norms would only set each group's step size, at a privacy cost.
    """

    def __init__(self, groups: list[ClipGroup], thresholds: list[float], adaptive: bool = False,
                 target_quantile: float = 0.5, quantile_lr: float = 0.3, rescale_to: float | None = None,
                 function: str = "clip", gamma: float = 0.01):
        if function not in CLIPPING_FUNCTIONS:
            raise ValueError(f"clipping_function must be one of {CLIPPING_FUNCTIONS}, got {function!r}.")
        if adaptive and function != "clip":
            raise ValueError(ADAPTIVE_AUTOMATIC_REFUSAL)
        if len(thresholds) != len(groups):
            raise ValueError(f"{len(groups)} clipping groups but {len(thresholds)} thresholds.")
        if any(not c > 0 for c in thresholds):
            raise ValueError(f"Clipping thresholds must be > 0, got {thresholds}.")
        self.groups = groups
        self.thresholds = torch.tensor(thresholds, dtype=torch.float64)
        self.adaptive = adaptive
        self.target_quantile = target_quantile
        self.quantile_lr = quantile_lr
        self.rescale_to = rescale_to
        self.function = function
        self.gamma = gamma
        self.released_unclipped_fraction: torch.Tensor | None = None
        self._counts = torch.zeros(len(groups), dtype=torch.float64)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def factors(self, k: int, norms_sq: dict[str, torch.Tensor]) -> torch.Tensor:
        """Group ``k``'s per-example factors ``min(1, C_k / ‖g_{i,k}‖)`` (``C_k / (‖g_{i,k}‖ + γ)`` with automatic
        clipping); adaptive: counts ``Σ_i (1[‖g_{i,k}‖ ≤ C_k] − ½)``."""
        norm = torch.stack(list(norms_sq.values())).sum(0).sqrt()
        c_k = float(self.thresholds[k])
        if self.adaptive:
            # Symmetrised count (Andrew et al. 2019; He et al. 2023 App. D): sensitivity 1/2 per group.
            self._counts[k] += float(((norm <= c_k).double() - 0.5).sum())
        return clip_factors_from_norms(norm, c_k, self.function, self.gamma)

    def pop_counts(self) -> torch.Tensor:
        """This step's ``Σ_i (b_{i,k} − ½)`` per group (to be privatized); resets them."""
        counts, self._counts = self._counts, torch.zeros_like(self._counts)
        return counts

    def update(self, released_unclipped_fraction: torch.Tensor) -> None:
        """Alg. 1 line 16 with the privatized fraction ``b̃_k``: ``C_k ← C_k · exp(−η (b̃_k − q))``."""
        b = released_unclipped_fraction.to(torch.float64).cpu()
        self.released_unclipped_fraction = b
        self.thresholds = self.thresholds * torch.exp(-self.quantile_lr * (b - self.target_quantile))
        if self.rescale_to is not None:
            self.thresholds = self.rescale_to * self.thresholds / self.thresholds.norm()

    def state_dict(self) -> dict:
        return {"groups": [g.name for g in self.groups], "thresholds": self.thresholds.tolist(),
                "released_unclipped_fraction": None if self.released_unclipped_fraction is None
                else self.released_unclipped_fraction.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if state["groups"] != [g.name for g in self.groups]:
            raise ValueError("The checkpoint's clipping groups differ from this model's.")
        self.thresholds = torch.tensor(state["thresholds"], dtype=torch.float64)
        fraction = state.get("released_unclipped_fraction")
        self.released_unclipped_fraction = None if fraction is None else torch.tensor(fraction, dtype=torch.float64)


def group_clipper_from_args(engine: ClippingEngine, args: Any) -> GroupClipper:
    """The group clipper of a group-wise ``args.clipping`` mode (``DPTrainingArguments``): the groups of
    :func:`build_groups`, thresholds ``group_max_grad_norms`` or ``C / √K`` each (He et al. 2023, App. A.1: the
    thresholds' norm is C), adaptive quantiles for ``adaptive_per_layer``, the clipping function."""
    groups = build_groups(engine, args.clipping, args.clipping_groups)
    k = len(groups)
    if args.group_max_grad_norms is not None:
        if len(args.group_max_grad_norms) != k:
            raise ValueError(
                f"group_max_grad_norms has {len(args.group_max_grad_norms)} values but there are {k} clipping "
                f"groups: {[g.name for g in groups]}."
            )
        thresholds = list(args.group_max_grad_norms)
    else:
        thresholds = [args.per_sample_max_grad_norm / math.sqrt(k)] * k  # App. A.1: ‖C‖ = C
    return GroupClipper(
        groups, thresholds, adaptive=args.clipping == "adaptive_per_layer", target_quantile=args.target_quantile,
        quantile_lr=args.quantile_lr,
        rescale_to=args.per_sample_max_grad_norm if args.adaptive_rescale_to_global else None,
        function=args.clipping_function, gamma=args.automatic_clipping_gamma,
    )
