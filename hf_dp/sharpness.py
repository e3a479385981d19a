"""Loss-landscape sharpness, as an evaluation metric (Chen et al., Privacy-Flat, Def. 1 and Fig. 1).

* :func:`sharpness`: Def. 1, ``max_{w' ∈ C_η} (L(w') − L(w)) / (1 + L(w))`` — the sharpness of Keskar et al. 2017
  ("On large-batch training ...", §2.2.2 and their Metric 2.1), which Def. 1 restates. Two ways to find the max:

  - ``method="box"`` (default): projected sign-gradient ascent inside the box ``C_ε = {w + z : |z_j| ≤
    ε (|w_j| + 1)}`` (Keskar's box; the first step goes to the box corner the gradient points at, the first-order
    maximiser; later steps refine it). This is what Def. 1 defines, and it is > 0 at any point that is not a local
    maximum of the loss.
  - ``method="paper"``: the paper's approximation (§2.2), ``w' ∈ {w − η ∇L(w) : η ∈ [0, 1]}`` on a grid. Along
    this *descent* line the loss only rises once a step overshoots, so small gradients give exactly 0 — which is
    why greedy selection on it cannot tell layers apart at a well-trained point; kept to reproduce the paper.
* :func:`loss_landscape`: ``f(η) = L(w + η d)`` along a random direction ``d`` (normalised per parameter tensor to
  the norm of that tensor, as in filter-normalised landscape plots), the curves of Fig. 1.

Both evaluate the model's own (HF) loss on the batches you give them. If those batches are private data, the
numbers are not covered by the DP guarantee: report them as the data holder, or compute them on public data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["mean_loss", "sharpness", "loss_landscape"]


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def mean_loss(model: nn.Module, batches: Iterable[dict]) -> float:
    """Mean of the model's HF loss over ``batches`` (dicts with ``labels``), evaluation mode, no gradient."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in batches:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            total += float(model(**batch).loss)
            count += 1
    model.train(was_training)
    if count == 0:
        raise ValueError("No batches to evaluate the loss on.")
    return total / count


@contextlib.contextmanager
def _shifted(params: list[nn.Parameter], deltas: list[torch.Tensor], scale: float) -> Iterator[None]:
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, d in zip(params, deltas):
            p.add_(d, alpha=scale)
    try:
        yield
    finally:
        with torch.no_grad():  # restore exactly (w + d - d is not w in floating point)
            for p, w in zip(params, saved):
                p.copy_(w)


def _loss_gradient(model: nn.Module, batches: list[dict]) -> list[torch.Tensor]:
    params = _trainable(model)
    grads = [torch.zeros_like(p) for p in params]
    was_training = model.training
    model.eval()
    device = params[0].device
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss = model(**batch).loss / len(batches)
        for g, gi in zip(grads, torch.autograd.grad(loss, params, allow_unused=True)):
            if gi is not None:
                g += gi
    model.train(was_training)
    return grads


def sharpness(model: nn.Module, batches: Iterable[dict], etas: Iterable[float] | None = None, *,
              method: str = "box", epsilon: float = 1e-3, steps: int = 5) -> float:
    """Def. 1 of Chen et al. (Keskar et al.'s sharpness) for the model's trainable parameters (e.g. a prefix):
    ``max_{w' ∈ C} (L(w') − L(w)) / (1 + L(w))``. The parameters are restored afterwards.

    Args:
        batches: the batches the loss is averaged over (dicts with ``labels``); evaluation mode, dropout off.
        method: ``"box"`` — ``C = {w + z : |z_j| ≤ epsilon (|w_j| + 1)}``, maximised by ``steps`` steps of
            projected sign-gradient ascent starting at the corner ``z = h·sign(∇L(w))`` (``h`` the half-widths),
            the largest loss seen is used; ``"paper"`` — the paper's grid over ``w − η ∇L(w)``, ``η ∈ etas``
            (default ``0, 0.1, …, 1``).
        epsilon: box size for ``"box"`` (Keskar et al. use 1e-3 and 5e-4).
        steps: ascent steps for ``"box"`` (≥ 1; each costs one forward and backward over ``batches``).
    """
    batches = list(batches)
    params = _trainable(model)
    if not params:
        raise ValueError("sharpness needs trainable parameters (requires_grad=True).")
    base = mean_loss(model, batches)
    grads = _loss_gradient(model, batches)
    worst = 0.0
    if method == "paper":
        etas = list(etas) if etas is not None else [i / 10 for i in range(11)]
        for eta in etas:
            with _shifted(params, grads, -eta):
                worst = max(worst, mean_loss(model, batches) - base)
        return worst / (1 + base)
    if method != "box":
        raise ValueError(f"method must be 'box' or 'paper', got {method!r}.")
    if epsilon <= 0 or steps < 1:
        raise ValueError(f"sharpness needs epsilon > 0 and steps >= 1, got {epsilon}, {steps}.")
    half = [epsilon * (p.detach().abs() + 1) for p in params]
    offset = [torch.where(g >= 0, h, -h) for h, g in zip(half, grads)]  # a corner even where ∇L = 0
    step_size = [h / 2 for h in half]
    for step in range(steps):
        with _shifted(params, offset, 1.0):
            worst = max(worst, mean_loss(model, batches) - base)
            if step == steps - 1:
                break
            grads = _loss_gradient(model, batches)
        offset = [torch.maximum(torch.minimum(z + a * torch.sign(g), h), -h)
                  for z, a, g, h in zip(offset, step_size, grads, half)]
    return worst / (1 + base)


def loss_landscape(model: nn.Module, batches: Iterable[dict], etas: Iterable[float], seed: int = 0
                   ) -> list[tuple[float, float]]:
    """``[(η, L(w + η d))]`` along one random direction ``d``, each tensor of ``d`` scaled to the norm of the
    corresponding parameter tensor (Fig. 1 of Chen et al.; filter normalisation, Li et al. 2018)."""
    batches = list(batches)
    params = _trainable(model)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    direction = []
    for p in params:
        d = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device)
        direction.append(d * (p.detach().norm() / d.norm().clamp(min=1e-12)))
    out = []
    for eta in etas:
        with _shifted(params, direction, eta):
            out.append((float(eta), mean_loss(model, batches)))
    return out
